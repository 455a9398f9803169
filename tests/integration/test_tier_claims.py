"""Claims of README.md and docs/architecture.md about leases and the SSD tier, on a live cluster:
late bytes after a read lease are discarded, and objects the segment could not serve back from
its read buffers are never offloaded. (A promotion past its deadline and durability before the
DRAM copy is freed: tests/unit/segment_server/test_tier_worker.py.)"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from kvtier.client import Status
from tests.integration.test_ssd_tier import KiB, MiB, put_and_offload, segment_info, sources, start_ssd_segment


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


def test_bytes_that_arrive_after_the_read_lease_are_discarded(bare_cluster):
    lease_s = 0.5
    bare_cluster.start_master("--lease-s", str(lease_s))
    segment = bare_cluster.start_segment("seg0", "16MiB")
    client = bare_cluster.client(transport="tcp", timeout=20.0)  # TCP: a stopped segment sends nothing
    value = bytes(range(256)) * 4096
    client.put("k", value)
    assert client.get("k") == value  # the connection is open: the next read is one request away
    observer = bare_cluster.client(transport="tcp")
    result: list[int] = []
    segment.popen.send_signal(signal.SIGSTOP)
    try:
        reader = threading.Thread(target=lambda: result.append(client.get_into("k", bytearray(len(value)))))
        reader.start()
        # The read lease is granted (the master answered GetReplicas); its bytes cannot come while
        # the segment is stopped. Held past the lease: they arrive late.
        assert bare_cluster.wait_for(lambda: observer.stat("k").lease_s > 0, interval=0.01), "no lease granted"
        time.sleep(2 * lease_s)  # the stall under test (not a wait for load): bytes held past the lease
    finally:
        segment.popen.send_signal(signal.SIGCONT)
    reader.join(30)
    # The late bytes are never taken: the client discards them (LEASE_EXPIRED), or the segment refused
    # the grant as ended and a fresh lookup read the object again under a lease of its own.
    stats = client.stats()
    if result != [int(Status.LEASE_EXPIRED)]:
        assert result == [len(value)] and stats["read_retries"] >= 1, (result, stats)
    else:
        assert stats["misses"] >= 1
    assert client.get("k") == value, "a read within its lease is served again"


def test_objects_larger_than_the_ssd_read_buffers_are_never_offloaded(bare_cluster, ssd_dir):
    bare_cluster.start_master()
    # 1 MiB of read buffers: a record (header and padding included) must fit in them to be served
    # back, so 1 MiB objects cannot be and 256 KiB objects can.
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-read-buffers", "1MiB")
    small_size = 256 * KiB
    big = [f"big/{i:02d}" for i in range(16)]
    small = [f"small/{i:02d}" for i in range(64)]
    with bare_cluster.client() as client:
        for i in range(16):  # interleaved, 32 MiB in all through a 16 MiB region
            put_and_offload(bare_cluster, client, [big[i]], MiB)
            put_and_offload(bare_cluster, client, small[4 * i : 4 * i + 4], small_size)
        tiers = {key: {r["tier"] for r in client.locate(key)} for key in big + small}
        assert not any("ssd" in tiers[key] for key in big), "an object the segment cannot serve back was offloaded"
        assert any(not tiers[key] for key in big), "no pressure: every big object is still in DRAM"
        on_ssd = [key for key in small if "ssd" in tiers[key]]
        assert on_ssd, "the small objects were offloaded meanwhile"
        assert all(sources(client, on_ssd, small_size).values()), "and are served back, verified"
        info = segment_info(client)
        assert info.ssd_objects == len(on_ssd)
        assert info.ssd_bytes_offloaded <= len(small) * small_size, "no big object's bytes were ever written"
