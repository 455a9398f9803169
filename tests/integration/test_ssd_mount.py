"""Fast mount of the SSD tier with background verification, against real processes and files.

A restarted segment mounts its tier from record headers only; a payload damaged
while it was down stays listed until the background verifier reads it, then it
is dropped (tombstoned by the segment, reported to the master) without any
reader meeting it. Every read is a miss or exactly the bytes that were put.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.test_metrics import scrape, value
from tests.integration.test_ssd_tier import (
    ALIGN,
    MiB,
    bucket_file,
    disk_location,
    put_and_offload,
    segment_info,
    sources,
    start_ssd_segment,
    value_for,
)


@pytest.fixture
def ssd_dir(tmp_path):
    path = tmp_path / "ssd"
    path.mkdir()
    return path


def ssd_replicas(client, key: str) -> list[dict]:
    return [r for r in client.locate(key) if r["tier"] == "ssd"]


def test_a_payload_damaged_while_down_is_dropped_by_background_verification(bare_cluster, ssd_dir):
    # No promotion: reads stay on disk, and no PROMOTE's own check can be what finds the damage.
    bare_cluster.start_master("--promote-after-reads", "0", "--metrics", "127.0.0.1:0")
    start_ssd_segment(bare_cluster, ssd_dir)
    keys = [f"mount/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"]
        assert len(on_disk) >= 4
        victim = on_disk[len(on_disk) // 2]
        path, offset = bucket_file(ssd_dir, disk_location(client, victim))

    # While the segment is down, one byte of the victim's payload rots.
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    with open(path, "r+b") as f:
        f.seek(offset + ALIGN + MiB // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    # Verification off: the mount itself reads no payload, so the damaged copy is still listed.
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-verify-rate", "0")
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: segment_info(client).ssd_objects >= len(on_disk), timeout=15)
        assert ssd_replicas(client, victim)
    bare_cluster.kill(bare_cluster.segments["ssd0"])

    # Verification on (the default rate): the verifier finds it and the master stops listing it,
    # before any reader asked for it.
    segment = start_ssd_segment(bare_cluster, ssd_dir, "--metrics", "127.0.0.1:0")
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: not ssd_replicas(client, victim), timeout=20), client.locate(victim)
        metrics = scrape(segment.info["metrics"])
        assert value(metrics, "kvtier_segment_ssd_corrupt_records_total", segment="ssd0") == 1
        assert (
            value(scrape(bare_cluster.master.info["metrics"]), "kvtier_master_corrupt_replicas_total", tier="ssd") == 1
        )
        assert client.get(victim) is None
        survivors = [k for k in on_disk if k != victim]
        assert client.batch_get(survivors) == [value_for(k) for k in survivors]
        assert bare_cluster.wait_for(
            lambda: (
                value(scrape(segment.info["metrics"]), "kvtier_segment_ssd_verify_backlog_bytes", segment="ssd0") == 0
            ),
            timeout=20,
        )
        metrics = scrape(segment.info["metrics"])
        # every other copy the mount found was verified good (objects with a DRAM copy too had a disk copy)
        assert value(metrics, "kvtier_segment_ssd_verified_records_total", segment="ssd0") >= len(on_disk) - 1
        assert value(metrics, "kvtier_segment_ssd_corrupt_records_total", segment="ssd0") == 1
