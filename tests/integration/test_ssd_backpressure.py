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
        statuses = burst(client, keys)
        acked = [k for k, s in statuses.items() if s == Status.OK]
        assert len(acked) >= 0.95 * len(keys), {s.name for s in statuses.values()}
        got = readable(client, acked)
        assert len(got) >= 0.99 * len(acked), f"{len(acked) - len(got)} acknowledged objects lost"
        counters = tiering(client)
        assert not any(v for k, v in counters.items() if k.startswith("dropped_without_ssd_copy.")), counters
        assert segment_info(client).ssd_objects > 0


def test_writer_faster_than_the_disk_waits_then_fails_visibly(bare_cluster: Cluster, ssd_dir: Path):
    # The disk takes 2 MiB/s; a put waits 0.5 s at most: most puts of a burst fail OFFLOAD_BEHIND.
    bare_cluster.start_master("--put-backpressure-s", "0.5")
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
        dropped = counters.get("dropped_without_ssd_copy.policy_drop", 0)
        assert dropped >= 1 and dropped >= len(keys) - len(got) - 1, counters
        assert counters.get("put_backpressure_waits", 0) == 0


def test_status_json_and_metrics_show_backpressure(bare_cluster: Cluster, ssd_dir: Path):
    bare_cluster.start_master("--put-backpressure-s", "0.3", "--metrics", "127.0.0.1:0")
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-write-limit", "1MiB", dram="16MiB")
    keys = [f"m/{i:04d}" for i in range(40)]
    with bare_cluster.client(timeout=10.0) as client:
        failed = [k for k, s in burst(client, keys, 8).items() if s == Status.OFFLOAD_BEHIND]
    assert failed
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.client.cli", "status", "--json", "--master", bare_cluster.master_address],
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
    assert ("kvtier_master_offload_queue_depth", (("segment", "ssd0"),)) in samples
    assert ("kvtier_master_offload_lag_seconds", (("segment", "ssd0"),)) in samples
