"""The open file limit the SSD tier needs: one read fd per bucket file, checked and raised at start."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest

from kvtier.segment_server import server
from kvtier.segment_server.__main__ import main
from kvtier.segment_server.server import FD_RESERVE, FdLimitError, fd_budget, max_buckets

GiB, MiB = 1 << 30, 1 << 20
UNLIMITED = resource.RLIM_INFINITY


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """main() installs the service's log handler on this test's (captured, soon closed) stderr."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_max_buckets_is_capacity_over_bucket_size_plus_open_and_slack():
    assert max_buckets(512 * GiB, 4 * MiB) == 131072 + 2
    assert max_buckets(1 * GiB, 256 * MiB, bucket_keys=65536) == 4 + 2  # keys bound at 256 MiB + 4 KiB
    assert max_buckets(1 * GiB, 256 * MiB, bucket_keys=1) == GiB // 8192 + 2  # 1 record + header per bucket


def test_a_soft_limit_that_covers_the_buckets_is_kept():
    needed = max_buckets(64 * GiB, 256 * MiB) + FD_RESERVE
    assert fd_budget(64 * GiB, 256 * MiB, needed, needed) == needed
    assert fd_budget(64 * GiB, 256 * MiB, 1 << 20, 1 << 20) == 1 << 20
    assert fd_budget(512 * GiB, 4 * MiB, UNLIMITED, UNLIMITED) == UNLIMITED


def test_a_short_soft_limit_is_raised_to_the_hard_limit():
    assert fd_budget(512 * GiB, 4 * MiB, 1024, 1 << 20) == 1 << 20
    needed = 131074 + FD_RESERVE
    assert fd_budget(512 * GiB, 4 * MiB, 1024, needed) == needed
    assert fd_budget(512 * GiB, 4 * MiB, 1024, UNLIMITED) == needed  # never ask for an unlimited soft limit


def test_a_hard_limit_that_cannot_cover_the_buckets_is_a_one_line_error():
    with pytest.raises(ValueError) as info:
        fd_budget(512 * GiB, 4 * MiB, 1024, 65536)
    message = str(info.value)
    assert isinstance(info.value, FdLimitError)
    assert "\n" not in message
    for part in ("--ssd-size 512.0 GiB", "--ssd-bucket-size 4.0 MiB", "65536", str(131074 + FD_RESERVE)):
        assert part in message
    with pytest.raises(FdLimitError, match="--ssd-bucket-keys 1"):
        fd_budget(1 * GiB, 256 * MiB, 1024, 65536, bucket_keys=1)


def test_raise_fd_limit_sets_the_soft_limit(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1 << 20))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append((which, limits)))
    server._raise_fd_limit(512 * GiB, 4 * MiB, 65536)
    assert calls == [(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))]

    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1 << 20, 1 << 20))
    server._raise_fd_limit(512 * GiB, 4 * MiB, 65536)
    assert calls == []


def test_raise_fd_limit_refused_by_the_kernel_is_an_fd_limit_error(monkeypatch):
    def refuse(which, limits):
        raise ValueError("not allowed to raise the maximum limit")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1 << 20))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    with pytest.raises(FdLimitError, match="RLIMIT_NOFILE from 1024 to 1048576"):
        server._raise_fd_limit(512 * GiB, 4 * MiB, 65536)


def test_segment_server_start_fails_with_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: pytest.fail("must not change the limit"))
    code = main(
        [
            "--dram", "1MiB",
            "--shm-dir", str(tmp_path),
            "--ssd-dir", str(tmp_path / "ssd"),
            "--ssd-size", "64GiB",
            "--ssd-bucket-size", "4MiB",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2  # a start-up failure (kvtier.common.startup)
    lines = [line for line in err.splitlines() if line.startswith("kvtier-segment:")]
    assert len(lines) == 1
    assert "--ssd-size 64.0 GiB" in lines[0] and "--ssd-bucket-size 4.0 MiB" in lines[0] and "4096" in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "ssd").exists() or not list((tmp_path / "ssd").iterdir())  # failed before recovery
