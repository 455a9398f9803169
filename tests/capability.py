"""What a test needs from the machine, and what happens when the machine lacks it.

Outside CI a missing capability skips (a laptop without etcd or io_uring still runs the rest).
Under CI (`CI` set, as `.ci/run` does) it fails instead: `.ci/run` installs what can be installed,
so a skip there means a broken setup that nobody would notice in a `-ra` summary. A CI host that
truly cannot provide one (a kernel or seccomp profile refusing io_uring, a runner that is not
root) says so explicitly with KVTIER_TEST_ALLOW_MISSING, a comma-separated list of names below;
those skip, and still show in the summary.

Names: faketime, io_uring, loop-device, o_direct, promtool, root, systemd-analyze, vllm-offloading.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

NAMES = frozenset(
    {"faketime", "io_uring", "loop-device", "o_direct", "promtool", "root", "systemd-analyze", "vllm-offloading"}
)


def allowed_missing() -> frozenset[str]:
    names = frozenset(n.strip() for n in os.environ.get("KVTIER_TEST_ALLOW_MISSING", "").split(",") if n.strip())
    if unknown := names - NAMES:
        raise pytest.UsageError(f"KVTIER_TEST_ALLOW_MISSING: unknown {sorted(unknown)}, known {sorted(NAMES)}")
    return names


def missing(name: str, reason: str) -> NoReturn:
    """Skip, or under CI fail, because capability `name` is missing here (see the module docstring)."""
    assert name in NAMES, name
    if os.environ.get("CI") and name not in allowed_missing():
        pytest.fail(f"{name} missing in CI: {reason} (or list it in KVTIER_TEST_ALLOW_MISSING)", pytrace=False)
    pytest.skip(f"{name} missing: {reason}")


def require(name: str, ok: bool, reason: str) -> None:
    if not ok:
        missing(name, reason)
