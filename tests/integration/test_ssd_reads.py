"""Reads of the SSD tier against real processes: adjacent records read with one I/O (`--ssd-read-coalesce`),
one batch spread over several connections, every byte checked."""

from __future__ import annotations

from pathlib import Path

from tests.cluster import Cluster
from tests.integration.test_ssd_tier import disk_location, put_and_offload, segment_info, start_ssd_segment, value_for

KiB = 1 << 10
SIZE = 256 * KiB


def test_batches_of_adjacent_disk_records_come_back_exact_in_any_order(bare_cluster: Cluster, tmp_path: Path):
    bare_cluster.start_master("--promote-after-reads", "0")  # reads stay on disk
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-read-coalesce", "1MiB")  # three 256 KiB records a read
    keys = [f"adj/{i:03d}" for i in range(96)]  # 24 MiB through a 16 MiB region, offloaded in order
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys, size=SIZE)
        probe = [bytearray(SIZE) for _ in keys]
        got = client.batch_get_into(keys, probe, with_source=True)
        on_disk = [k for k, (_, source) in zip(keys, got, strict=True) if source == "ssd/tcp"]
        assert len(on_disk) >= 32, f"only {len(on_disk)} objects are disk-only"
        # Records are 4 KiB-aligned, a 256 KiB object and its header take 65 pages: most neighbours
        # in key order are neighbours on disk too, which is what a coalesced read needs.
        locations = [disk_location(client, k) for k in on_disk]
        adjacent = sum(1 for a, b in zip(locations, locations[1:], strict=False) if b == a + SIZE // 4096 + 1)
        assert adjacent >= len(on_disk) // 2, locations
        served = segment_info(client).ssd_bytes_served
        for order in (on_disk, on_disk[::-1], on_disk[::2] + on_disk[1::2]):  # adjacent, backwards, interleaved
            buffers = [bytearray(SIZE) for _ in order]
            got = client.batch_get_into(order, buffers, with_source=True)
            assert [source for _, source in got] == ["ssd/tcp"] * len(order)
            assert [n for n, _ in got] == [SIZE] * len(order)
            assert all(bytes(b) == value_for(k, SIZE) for k, b in zip(order, buffers, strict=True)), "wrong bytes"
        assert client.stats().get("checksum_mismatches", 0) == 0
        assert bare_cluster.wait_for(lambda: segment_info(client).ssd_bytes_served >= served + 3 * len(on_disk) * SIZE)
