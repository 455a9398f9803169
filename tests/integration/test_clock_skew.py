"""Segments whose wall clock is wrong: detected, shown, kept out of placement; grants judged on the master's clock.

A segment runs under libfaketime (Debian's `faketime` package) with its offset in a file it rereads
(FAKETIME_TIMESTAMP_FILE, no cache), so a test moves its wall clock while it runs; its monotonic
clock is left alone (FAKETIME_DONT_FAKE_MONOTONIC), as when an operator or NTP steps a wall clock.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.proto import auth, frames
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.capability import require
from tests.cluster import Cluster
from tests.integration.rawframes import connect, recv_response
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ops_cli import as_json, kvtier

LIBFAKETIME = os.environ.get("KVTIER_TEST_LIBFAKETIME", "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


class FakeClock:
    """The wall clock offset of the processes started with `prefix()`; `set("+30s")` moves it."""

    def __init__(self, path: Path, offset: str = "+0") -> None:
        require("faketime", os.path.exists(LIBFAKETIME), f"{LIBFAKETIME} (apt-get install faketime)")
        self.path = path
        self.set(offset)

    def set(self, offset: str) -> None:
        self.path.write_text(offset + "\n")

    def prefix(self) -> list[str]:
        return [
            "env",
            f"LD_PRELOAD={LIBFAKETIME}",
            f"FAKETIME_TIMESTAMP_FILE={self.path}",
            "FAKETIME_NO_CACHE=1",
            "FAKETIME_DONT_FAKE_MONOTONIC=1",
        ]


def segment_info(client, name: str):
    return next((s for s in client.cluster_status().segments if s.name == name), None)


def skewed(client, name: str, want: bool) -> bool:
    info = segment_info(client, name)
    return info is not None and info.clock_skewed == want


@pytest.fixture
def clock(tmp_path: Path) -> FakeClock:
    return FakeClock(tmp_path / "faketime")


def test_a_segment_whose_clock_jumps_ahead_leaves_placement_until_fixed_and_still_serves_reads(bare_cluster, clock):
    cluster: Cluster = bare_cluster
    master = cluster.start_master("--metrics", "127.0.0.1:0")
    cluster.start_segment("s0")
    cluster.start_segment("skewed", "64MiB", prefix=clock.prefix())
    with cluster.client(transport="tcp") as client:
        assert cluster.wait_for(lambda: skewed(client, "skewed", False) and segment_info(client, "s0"))
        client.put("before", b"b" * 65536, preferred_segment="skewed")
        assert client.locate("before")[0]["segment"] == "skewed"

        clock.set("+30s")  # today: every write refused ("capability expired"), the segment ACTIVE all along
        assert cluster.wait_for(lambda: skewed(client, "skewed", True), timeout=10), segment_info(client, "skewed")
        info = segment_info(client, "skewed")
        assert 28 < info.clock_skew_s < 32 and info.state == "ACTIVE", info
        shown = {s["name"]: s for s in as_json(cluster, "status")["segments"]}["skewed"]
        assert shown["clock_skewed"] and 28 < shown["clock_skew_s"] < 32, shown
        table = kvtier(cluster, "status").stdout.decode()
        assert "ACTIVE CLOCK_SKEW +" in table, table
        metrics = scrape(master.info["metrics"])
        assert 28 < value(metrics, "kvtier_master_segment_clock_skew_seconds", segment="skewed") < 32
        assert value(metrics, "kvtier_master_segment_clock_skewed", segment="skewed") == 1
        # out of placement, even when preferred; what it holds is still read
        client.put("during", b"d" * 65536, preferred_segment="skewed")
        assert client.locate("during")[0]["segment"] == "s0"
        assert client.get("before") == b"b" * 65536

        clock.set("+0")  # fixed: placed on again
        assert cluster.wait_for(lambda: skewed(client, "skewed", False), timeout=10)
        client.put("after", b"a" * 65536, preferred_segment="skewed")
        assert client.locate("after")[0]["segment"] == "skewed"
        assert client.get("after") == b"a" * 65536


def test_a_segment_mounting_with_its_clock_behind_is_flagged_and_never_accepts_an_ended_grant(bare_cluster, clock):
    clock.set("-30s")
    cluster: Cluster = bare_cluster
    cluster.start_master()
    proc = cluster.start_segment("behind", "1MiB", prefix=clock.prefix())
    endpoint = next(e for e in proc.info["endpoints"] if e.startswith("tcp://"))
    with cluster.client(transport="tcp") as client:
        # flagged from its mount on
        assert cluster.wait_for(lambda: skewed(client, "behind", True), timeout=5), segment_info(client, "behind")
        assert -32 < segment_info(client, "behind").clock_skew_s < -28
        # A write whose grant ended 10 s ago by the master's clock (the master may have reused the
        # range since, CLOCK_SKEW_MS after its end): on the segment's own clock, 30 s behind, it
        # would still have 20 s to run.
        ended = auth.wall_ms() - auth.CLOCK_SKEW_MS - 10_000
        with connect(endpoint) as sock:
            sock.sendall(frames.pack_request(Op.WRITE, 1, [(0, 4096)], 4096, deadline=ended) + b"X" * 4096)
            assert recv_response(sock)[2] == Status.LEASE_EXPIRED
            alive = auth.wall_ms() + 5_000  # and one still running by the master's clock is served
            sock.sendall(frames.pack_request(Op.READ, 2, [(0, 16)], deadline=alive))
            op, request_id, status, _ = recv_response(sock)
            assert (request_id, status) == (2, Status.OK)
