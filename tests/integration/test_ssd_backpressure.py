"""Backpressure on puts against real processes: nothing acknowledged is dropped while the SSD tier has room.

One segment with a small DRAM region and an SSD tier in the test's directory;
a writer puts 1 MiB objects in 32-key batches as fast as it can, several times
the region's size. Values derive from their keys, so every read is checked to
be exactly the bytes that were put (kvtier.master.backpressure).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.client import KvtierError, Status
from tests.cluster import Cluster
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ssd_tier import segment_info, start_ssd_segment, value_for

BATCH = 32


def burst(client, keys: list[str], size: int = BATCH) -> dict[str, Status]:
    """Put `keys` in batches of `size` keys, back to back; the status per key. (A batch's keys are
    all pending until it is written: one larger than the region gets NO_SPACE for the rest.)"""
    out: dict[str, Status] = {}
    for lo in range(0, len(keys), size):
        batch = keys[lo : lo + size]
        out.update(zip(batch, client.batch_put(batch, [value_for(k) for k in batch]), strict=True))
    return out


def readable(client, keys: list[str]) -> list[str]:
    """The keys readable now, asserting each hit has exactly the bytes that were put."""
    found = []
    for lo in range(0, len(keys), BATCH):
        batch = keys[lo : lo + BATCH]
        for key, got in zip(batch, client.batch_get(batch), strict=True):
            if got is not None:
                assert got == value_for(key), f"wrong bytes for {key}"
                found.append(key)
    return found


def assert_burst_kept(client, keys: list[str]) -> None:
    """Issue 17's bar for a burst: >= 95% of puts acknowledged, >= 99% of those readable afterwards,
    every hit with exactly the bytes that were put."""
    statuses = burst(client, keys)
    acked = [k for k, s in statuses.items() if s == Status.OK]
    assert len(acked) >= 0.95 * len(keys), {s.name for s in statuses.values()}
    got = readable(client, acked)
    assert len(got) >= 0.99 * len(acked), f"{len(acked) - len(got)} acknowledged objects lost"


def tiering(client) -> dict[str, int]:
    return dict(client.cluster_status().tiering)


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


def test_burst_faster_than_offload_loses_nothing_acknowledged(bare_cluster: Cluster, ssd_dir: Path):
    bare_cluster.start_master()
    start_ssd_segment(bare_cluster, ssd_dir, dram="32MiB")
    keys = [f"burst/{i:04d}" for i in range(160)]  # 160 MiB through a 32 MiB region
    with bare_cluster.client(timeout=20.0) as client:
        assert_burst_kept(client, keys)
        counters = tiering(client)
        assert not any(v for k, v in counters.items() if k.startswith("dropped_without_ssd_copy.")), counters
        assert segment_info(client).ssd_objects > 0


@pytest.mark.slow
def test_issue_17_burst_1GiB_through_128MiB_of_dram(bare_cluster: Cluster, ssd_dir: Path):
    # The issue's reproduction at full size: 1,024 puts of 1 MiB in 32-key batches, as fast as one
    # client goes, into 128 MiB of DRAM and a 4 GiB tier (before: 308 of them readable afterwards).
    bare_cluster.start_master()
    bare_cluster.start_segment("ssd0", "128MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "4GiB")
    keys = [f"issue/{i:04d}" for i in range(1024)]
    with bare_cluster.client(timeout=20.0) as client:
        assert_burst_kept(client, keys)


@pytest.mark.parametrize("door", ["fast", "grpc"])
def test_writer_faster_than_the_disk_waits_then_fails_visibly(bare_cluster: Cluster, ssd_dir: Path, door: str):
    # The disk takes 2 MiB/s; a put waits 0.5 s at most: most puts of a burst fail OFFLOAD_BEHIND.
    # Both doors of the master (fast path, gRPC) share the wait.
    bare_cluster.start_master("--put-backpressure-s", "0.5", *(["--fast-listen", "off"] if door == "grpc" else []))
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-write-limit", "2MiB", dram="16MiB")
    keys = [f"slow/{i:04d}" for i in range(64)]
    with bare_cluster.client(timeout=10.0) as client:
        statuses = burst(client, keys, 8)
        acked = [k for k, s in statuses.items() if s == Status.OK]
        failed = [k for k, s in statuses.items() if s == Status.OFFLOAD_BEHIND]
        assert failed, {s.name for s in statuses.values()}
        assert set(acked) | set(failed) == set(keys), {s.name for s in statuses.values()}
        with pytest.raises(KvtierError, match="OFFLOAD_BEHIND.*put_backpressure_s") as raised:
            for i in range(16):  # DRAM is still full of objects not on SSD: a put waits, then raises
                client.put(f"single/{i}", value_for(f"single/{i}"))
                acked.append(f"single/{i}")
        assert raised.value.status == Status.OFFLOAD_BEHIND
        failed.append(f"single/{i}")
        assert sorted(readable(client, acked)) == sorted(acked)  # every acknowledged put is readable
        assert readable(client, failed) == []  # nothing stored for a failed one
        counters = tiering(client)
        assert counters["put_backpressure_failed_keys"] >= len(failed)
        assert counters["put_backpressure_waits"] >= 1
        assert not any(v for k, v in counters.items() if k.startswith("dropped_without_ssd_copy.")), counters


def test_a_waiting_put_leaves_the_master_serving(bare_cluster: Cluster, ssd_dir: Path):
    bare_cluster.start_master("--put-backpressure-s", "5")
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-write-limit", "1MiB", dram="16MiB")
    with bare_cluster.client(timeout=10.0) as writer, bare_cluster.client(timeout=10.0) as reader:
        writer.put("first", value_for("first"))
        burst(writer, [f"fill/{i:02d}" for i in range(16)], 8)  # DRAM full of objects not on SSD
        more = [f"more/{i}" for i in range(8)]  # 8 MiB to offload at 1 MiB/s: longer than the wait
        results: list = []
        thread = threading.Thread(target=lambda: results.append(writer.batch_put(more, [value_for(k) for k in more])))
        thread.start()
        try:
            assert bare_cluster.wait_for(lambda: tiering(reader)["put_backpressure_waiting"] >= 1, timeout=10)
            # while the put waits, the master answers reads (and status, heartbeats, TierTasksDone)
            assert reader.get("first") == value_for("first")
            assert thread.is_alive()
        finally:
            thread.join()
        assert Status.OFFLOAD_BEHIND in results[0]
        stored = [k for k, s in zip(more, results[0], strict=True) if s == Status.OK]
        assert sorted(readable(reader, stored)) == sorted(stored)


def test_drop_policy_keeps_dropping_and_counts_it(bare_cluster: Cluster, ssd_dir: Path):
    bare_cluster.start_master("--dram-full-policy", "drop")
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-write-limit", "2MiB", dram="16MiB")
    keys = [f"drop/{i:04d}" for i in range(64)]
    with bare_cluster.client(timeout=10.0) as client:
        statuses = burst(client, keys, 8)
        assert set(statuses.values()) == {Status.OK}  # nobody waits: every put is acknowledged...
        got = readable(client, keys)
        assert len(got) < len(keys)  # ...and what offload could not keep up with is gone
        counters = tiering(client)
        dropped = {k.split(".", 1)[1]: v for k, v in counters.items() if k.startswith("dropped_without_ssd_copy.")}
        # every object lost is counted, by reason: policy_drop, and offload_failed once a copy evicted
        # while its offload was in flight failed the segment's checksum check (offload pauses 5 s)
        assert dropped.get("policy_drop", 0) >= 1 and sum(dropped.values()) == len(keys) - len(got), counters
        assert counters.get("put_backpressure_waits", 0) == 0


def test_status_json_and_metrics_show_backpressure(bare_cluster: Cluster, ssd_dir: Path):
    bare_cluster.start_master("--put-backpressure-s", "0.3", "--metrics", "127.0.0.1:0")
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-write-limit", "1MiB", dram="16MiB")
    keys = [f"m/{i:04d}" for i in range(40)]
    with bare_cluster.client(timeout=10.0) as client:
        failed = [k for k, s in burst(client, keys, 8).items() if s == Status.OFFLOAD_BEHIND]
    assert failed
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "status", "--json", "--master", bare_cluster.master_address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    counters = json.loads(result.stdout)["tiering"]
    assert counters["put_backpressure_failed_keys"] == len(failed)
    assert "offload_queue_depth.ssd0" in counters and "offload_lag_ms.ssd0" in counters
    samples = scrape(bare_cluster.master.info["metrics"])
    assert value(samples, "kvtier_master_put_backpressure_failed_keys_total") == len(failed)
    assert value(samples, "kvtier_master_put_backpressure_seconds_count") >= 1
    assert ("kvtier_master_put_backpressure_waiting", ()) in samples
    assert ("kvtier_master_offload_queue_depth", (("segment", "ssd0"),)) in samples
    assert ("kvtier_master_offload_lag_seconds", (("segment", "ssd0"),)) in samples
    # levels are gauges of their own, never samples of the kvtier_master_tiering counter (a level going
    # down read as a counter reset to rate())
    levels = [labels for name, labels in samples if name == "kvtier_master_tiering_total"]
    assert levels and not any(
        dict(labels)["event"].startswith(("offload_queue_depth.", "offload_lag_ms.", "put_backpressure_waiting"))
        for labels in levels
    ), levels
