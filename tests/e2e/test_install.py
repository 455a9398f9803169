"""From install to result: a wheel built from this tree, installed where nothing else is, serves.

The rest of the suite runs against the editable install of the checkout, which finds every folder
wherever it is. A user gets the wheel: only the packages and data pyproject.toml maps. So this test
builds one (from a copy of what pyproject.toml names, leaving the checkout untouched), installs it
without dependencies into a directory of its own, and runs that copy's `kvtier` script as a user
would: `kvtier up`, then `kvtier put` and `kvtier get`. Every process (the command, the master and the
segment server it starts) imports kvtier from that directory, never from the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.e2e.terminal import CLI_TIMEOUT_S, Up, free_port

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], env: dict | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=env, input=stdin, capture_output=True, timeout=CLI_TIMEOUT_S * 2)
    assert result.returncode == 0, f"{args} exited {result.returncode}: {result.stderr.decode()[-3000:]}"
    return result


def build_wheel(tmp_path: Path) -> Path:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", pyproject["project"]["readme"]):
        shutil.copy(ROOT / name, source / name)
    folders = {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}
    for folder in folders:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the build backend comes from the test extras, so nothing is downloaded.
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)])
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    return wheel


@pytest.mark.slow  # builds a wheel and a venv: make test-slow (CI runs it)
def test_a_wheel_built_from_the_tree_installs_and_its_kvtier_command_serves(tmp_path: Path):
    wheel = build_wheel(tmp_path)
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run(
        [
            sys.executable, "-c",
            "import kvtier.cli.main, kvtier.common.local_cluster, kvtier.master.__main__,"
            " kvtier.segment_server.__main__, kvtier.client, kvtier.bench.run, kvtier.proto.master_pb2 as pb;"
            " import sys; print('\\n'.join(m.__file__ for n, m in sorted(sys.modules.items())"
            " if n.startswith('kvtier.') and getattr(m, '__file__', None)))",
        ],
        env=env,
    )  # fmt: skip
    files = where.stdout.decode().split()
    assert files and all(f.startswith(str(site)) for f in files), [f for f in files if not f.startswith(str(site))]
    assert (site / "kvtier" / "proto" / "master.proto").exists(), "package data: the .proto files ship"

    kvtier = site / "bin" / "kvtier"
    address = f"127.0.0.1:{free_port()}"
    up = Up(
        ["--listen", address, "--cluster-id", f"install{os.getpid()}", "--dram", "16MiB", "--ssd", "0",
         "--state-dir", str(tmp_path / "state")],
        tmp_path / "up.log",
        kvtier=kvtier,
        env=env,
    )  # fmt: skip
    try:
        run([str(kvtier), "put", "--master", address, "installed", "-"], env=env, stdin=b"it works")
        assert run([str(kvtier), "get", "--master", address, "installed"], env=env).stdout == b"it works"
        assert up.ctrl_c() == 0
    finally:
        up.kill()
