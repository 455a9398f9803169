"""The import rules of the house (pyproject.toml [tool.importlinter], run by `make lint` too):
proto <- common <- {master | segment_server | client} <- bench <- cli.

The runtime side of the thin client (what importing kvtier.client loads) is
tests/unit/client/test_thin_import.py.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def top_level(package: str) -> str:
    return ".".join(package.split(".")[:2])  # kvtier.client.transport -> kvtier.client


def test_every_installed_package_is_checked_by_the_contracts():
    # import-linter walks only its root packages: a top-level package added to pyproject.toml but not
    # to root_packages would escape every rule.
    installed = {top_level(p) for p in PYPROJECT["tool"]["setuptools"]["packages"]}
    assert set(PYPROJECT["tool"]["importlinter"]["root_packages"]) == installed


def test_every_layer_is_an_installed_package():
    installed = {top_level(p) for p in PYPROJECT["tool"]["setuptools"]["packages"]}
    layered = {
        name.strip()
        for contract in PYPROJECT["tool"]["importlinter"]["contracts"]
        if contract["type"] == "layers"
        for layer in contract["layers"]
        for name in layer.split("|")
    }
    assert layered == installed, "every top-level package has its place in the layers"


def test_the_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout
