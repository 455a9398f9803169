"""The SSD tier against real processes: offload, serving from SSD, restart, corruption, limits.

A segment with a small DRAM region (16 MiB) and an SSD tier in the test's
directory. Values are derived from their keys (`value_for`), so every read is
checked to be either a miss or exactly the bytes that were put.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import zlib
from pathlib import Path

import pytest

from kvtier.client import Client, Status
from tests.capability import missing
from tests.cluster import Cluster

MiB = 1 << 20
KiB = 1 << 10
ALIGN = 4096


def value_for(key: str, size: int = MiB) -> bytes:
    return random.Random(zlib.crc32(key.encode())).randbytes(size)


def start_ssd_segment(cluster: Cluster, ssd_dir: Path, *extra: str, dram: str = "16MiB", name: str = "ssd0"):
    return cluster.start_segment(
        name,
        dram,
        "--ssd-dir", str(ssd_dir),
        "--ssd-size", "256MiB",
        "--ssd-bucket-size", "4MiB",
        *extra,
    )  # fmt: skip


def segment_info(client: Client, name: str = "ssd0"):
    return next(s for s in client.cluster_status().segments if s.name == name)


def put_and_offload(cluster: Cluster, client: Client, keys: list[str], size: int = MiB) -> None:
    """Put `keys` at a pace the offload keeps up with: 1 MiB batches (6% of the region), and after
    each one, wait until the watermark pass brought DRAM back under its high watermark (0.90).
    Faster writers would make puts evict by allocation, which drops copies not yet on SSD."""
    per_batch = max(1, MiB // size)
    for lo in range(0, len(keys), per_batch):
        batch = keys[lo : lo + per_batch]
        assert client.batch_put(batch, [value_for(k, size) for k in batch]) == [0] * len(batch)
        assert cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.9 * s.dram_capacity, timeout=20), (
            f"offload did not bring DRAM under the watermark: {segment_info(client)}"
        )


def sources(client: Client, keys: list[str], size: int = MiB) -> dict[str, str | None]:
    """Source per key, asserting every hit has exactly the bytes that were put."""
    out = {}
    for key, (value, source) in zip(keys, client.batch_get(keys, with_source=True), strict=True):
        if value is not None:
            assert value == value_for(key, size), f"wrong bytes for {key}"
        out[key] = source
    return out


def disk_location(client: Client, key: str) -> int:
    where = [r for r in client.locate(key) if r["tier"] == "ssd"]
    assert where, f"{key} has no disk copy: {client.locate(key)}"
    return where[0]["offset"]


def bucket_file(ssd_dir: Path, location: int) -> tuple[Path, int]:
    """The bucket file and byte offset of the record at a disk location (see segment_server/bucket_format.py)."""
    return ssd_dir / f"bucket-{location >> 20:016x}.kvb", (location & 0xFFFFF) * ALIGN


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


@pytest.fixture
def ssd_cluster(bare_cluster: Cluster, ssd_dir: Path) -> Cluster:
    bare_cluster.start_master("--promote-after-reads", "2")
    start_ssd_segment(bare_cluster, ssd_dir)
    return bare_cluster


def test_dram_pressure_offloads_to_ssd_and_reads_come_back_verified_from_ssd(ssd_cluster, ssd_dir):
    keys = [f"obj/{i:03d}" for i in range(40)]  # 40 MiB through a 16 MiB region
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        info = segment_info(client)
        assert info.ssd_objects > 0 and info.offload and info.disk_engine in ("io_uring", "threads")
        got = sources(client, keys)
        # nothing was lost: what does not fit in DRAM is on SSD, and the oldest went first
        assert all(got.values()), [k for k, s in got.items() if s is None]
        assert got[keys[0]] == "ssd/tcp"
        assert {s.split("/")[0] for s in got.values()} == {"dram", "ssd"}
        stats = client.stats()
        assert stats["bytes_read_ssd"] >= MiB and stats["bytes_read_dram"] >= MiB
        status = client.cluster_status()
        assert status.tiering["offloaded_objects"] >= info.ssd_objects
        # every object read from SSD left DRAM once, counted under the reason it left for (a copy
        # offloaded ahead of need is counted when it leaves, not when it is copied)
        on_ssd_only = sum(1 for s in got.values() if s == "ssd/tcp")
        assert sum(e.objects for e in status.evictions) >= on_ssd_only > 0
        # the segment's own counters keep the tiers and the physical disk apart
        assert ssd_cluster.wait_for(lambda: segment_info(client).ssd_bytes_served >= MiB)
        # ssd_objects counts reported offloads at once, the byte counter comes with the next heartbeat
        assert ssd_cluster.wait_for(
            lambda: (now := segment_info(client)).ssd_bytes_offloaded >= now.ssd_objects * MiB
        ), "every disk copy's bytes counted as offloaded"
        info = segment_info(client)
        assert info.disk_bytes_read > 0  # O_DIRECT reads: the process's own I/O counter saw them
        # DRAM bytes copied by a same-host client through shm never pass the segment: only the
        # client's own counter (bytes_read_dram above) can see them
        assert info.dram_bytes_served <= stats["bytes_read_dram"]
    assert list(ssd_dir.glob("bucket-*.kvb"))


def test_batch_get_into_from_ssd_and_dram_in_one_batch(ssd_cluster):
    keys = [f"into/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        buffers = [bytearray(MiB + 17) for _ in keys]
        results = client.batch_get_into(keys, buffers, with_source=True)
        assert [r for r, _ in results] == [MiB] * len(keys)
        assert {s.split("/")[0] for _, s in results} == {"dram", "ssd"}
        for key, buf in zip(keys, buffers, strict=True):
            assert bytes(buf[:MiB]) == value_for(key)


@pytest.mark.slow  # 6-13 s: runs in make test-slow (CI runs both)
def test_disk_only_object_is_promoted_back_to_dram_after_repeated_reads(ssd_cluster):
    keys = [f"hot/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        cold = next(k for k, s in sources(client, keys).items() if s == "ssd/tcp")
        # leave DRAM room under the watermark for the promotion (it never evicts): the removed
        # ranges are free once the leases of the reads above have ended
        for key in keys[-4:]:
            client.remove(key)
        assert ssd_cluster.wait_for(
            lambda: (s := segment_info(client)).dram_used <= 0.8 * s.dram_capacity, timeout=20
        ), segment_info(client)
        assert client.get(cold, with_source=True)[1] == "ssd/tcp"  # second read (sources() was the first)
        assert ssd_cluster.wait_for(lambda: {r["tier"] for r in client.locate(cold)} == {"dram", "ssd"}, timeout=10)
        value, source = client.get(cold, with_source=True)
        assert value == value_for(cold) and source.startswith("dram/")
        assert client.cluster_status().tiering["promoted_objects"] >= 1


def test_restarted_segment_serves_its_offloaded_objects_again(ssd_cluster, ssd_dir):
    keys = [f"keep/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"]
        assert on_disk
        # copied to SSD ahead of need, some objects read from DRAM have a disk copy too
        in_dram_only = [k for k in keys if all(r["tier"] != "ssd" for r in client.locate(k))]
    # when the segment dies without warning and starts again on the same directory
    ssd_cluster.kill(ssd_cluster.segments["ssd0"])
    start_ssd_segment(ssd_cluster, ssd_dir)
    with ssd_cluster.client() as client:
        assert ssd_cluster.wait_for(lambda: segment_info(client).ssd_objects >= len(on_disk), timeout=15)
        got = sources(client, on_disk)
        assert all(s == "ssd/tcp" for s in got.values()), got
        # DRAM copies died with the process: objects without a disk copy are misses, never wrong bytes
        assert client.batch_get(in_dram_only) == [None] * len(in_dram_only)
        assert all(sources(client, [k for k in keys if k not in in_dram_only]).values())


def test_corrupt_byte_in_a_bucket_is_a_miss_and_the_rest_still_hit(bare_cluster, ssd_dir):
    # No promotion: a second read would also queue a PROMOTE of the damaged record, whose refusal by
    # the tier worker races the reader's report (either drops the copy; this test is about the report).
    bare_cluster.start_master("--promote-after-reads", "0")
    start_ssd_segment(bare_cluster, ssd_dir)
    ssd_cluster = bare_cluster
    keys = [f"rot/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"]
        victim = on_disk[0]
        path, offset = bucket_file(ssd_dir, disk_location(client, victim))
        with open(path, "r+b") as f:  # flip one byte in the middle of the payload
            f.seek(offset + ALIGN + MiB // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        got = client.batch_get(on_disk)
        assert got[0] is None
        assert got[1:] == [value_for(k) for k in on_disk[1:]]
        assert client.stats()["checksum_mismatches"] >= 1
        # The reader reported the damaged disk copy: the master dropped it (and told the segment to forget it).
        assert not any(r["tier"] == "ssd" for r in client.locate(victim))
        assert client.stats()["corrupt_dropped"] >= 1


def test_bucket_truncated_mid_record_drops_the_torn_record_only(ssd_cluster, ssd_dir):
    keys = [f"torn/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"]
        locations = {k: disk_location(client, k) for k in on_disk}
    # the newest record on disk, cut in half while the segment is down
    newest = max(on_disk, key=lambda k: locations[k])
    ssd_cluster.kill(ssd_cluster.segments["ssd0"])
    path, offset = bucket_file(ssd_dir, locations[newest])
    os.truncate(path, offset + MiB // 2)
    start_ssd_segment(ssd_cluster, ssd_dir)
    survivors = [k for k in on_disk if k != newest and bucket_file(ssd_dir, locations[k])[0] == path]
    with ssd_cluster.client() as client:
        assert ssd_cluster.wait_for(lambda: segment_info(client).ssd_objects >= len(on_disk) - 1, timeout=15)
        assert client.get(newest) is None
        assert client.batch_get(survivors) == [value_for(k) for k in survivors]


def test_full_ssd_tier_is_reported_and_dram_keeps_serving(bare_cluster, ssd_dir):
    # a 16 MiB tier (four 4 MiB buckets at least): filled faster than its watermark deletes buckets
    bare_cluster.start_master()
    bare_cluster.start_segment(
        "ssd0",
        "16MiB",
        "--ssd-dir", str(ssd_dir),
        "--ssd-size", "16MiB",
        "--ssd-bucket-size", "16MiB",
    )  # fmt: skip
    keys = [f"full/{i:03d}" for i in range(60)]
    with bare_cluster.client() as client:
        for lo in range(0, len(keys), 4):
            batch = keys[lo : lo + 4]
            assert client.batch_put(batch, [value_for(k) for k in batch]) == [0] * 4
            time.sleep(0.1)
        # (an offload can also fail first because a put evicted its object meanwhile and the range
        # was reused: the segment refuses those bytes, and offload pauses 5 s after any failure)
        # (its whole log: bucket churn can log hundreds of lines after the report)
        segment = bare_cluster.segments["ssd0"]
        assert bare_cluster.wait_for(lambda: "SSD tier full" in segment.tail(1_000_000), timeout=30), (
            "the full tier was never reported"
        )
        assert client.cluster_status().tiering["offload_failures"] >= 1
        # DRAM keeps taking and serving objects; every read is a verified hit or a miss
        assert client.batch_put(["after"], [value_for("after")]) == [0]
        assert client.get("after") == value_for("after")
        sources(client, keys)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


@pytest.mark.slow  # 10-12 s each: the default suite keeps the unit bounds (test_diskio); CI runs test-slow
@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_segment_thread_count_is_constant_under_a_large_disk_batch_get(bare_cluster, ssd_dir, engine):
    bare_cluster.start_master()
    proc = start_ssd_segment(bare_cluster, ssd_dir, "--ssd-io", engine, "--ssd-threads", "4")
    if engine == "io_uring" and "io_uring" not in proc.tail(200):
        missing("io_uring", proc.tail(5))
    keys = [f"many/{i:05d}" for i in range(10_000)]
    size = 4 * KiB
    with bare_cluster.client(timeout=60.0) as client:
        put_and_offload(bare_cluster, client, keys, size)
        disk_keys = [k for k, s in sources(client, keys[:2000], size).items() if s == "ssd/tcp"]
        assert len(disk_keys) > 1000
        baseline = _threads(proc.popen.pid)
        seen = [baseline]
        failures: list[str] = []

        def reader() -> None:
            with bare_cluster.client(timeout=60.0) as own:
                got = own.batch_get(keys)
                if any(v is not None and v != value_for(k, size) for k, v in zip(keys, got, strict=True)):
                    failures.append("wrong bytes")

        readers = [threading.Thread(target=reader) for _ in range(4)]
        for t in readers:
            t.start()
        while any(t.is_alive() for t in readers):
            seen.append(_threads(proc.popen.pid))
            time.sleep(0.01)
        for t in readers:
            t.join()
        assert not failures
        # io_uring's kernel workers (iou-wrk) count as the process's threads: capped by --ssd-threads
        bound = baseline + (4 if engine == "io_uring" else 0)
        assert max(seen) <= bound, f"segment threads went from {baseline} to {max(seen)} under load"
        assert segment_info(client).ssd_bytes_served >= 4 * len(disk_keys) * size // 2


def test_disk_watermark_deletes_the_oldest_buckets_after_telling_the_master(bare_cluster, ssd_dir):
    bare_cluster.start_master()
    bare_cluster.start_segment(
        "ssd0",
        "16MiB",
        "--ssd-dir", str(ssd_dir),
        "--ssd-size", "32MiB",
        "--ssd-bucket-size", "4MiB",
    )  # fmt: skip
    keys = [f"wm/{i:03d}" for i in range(64)]  # 64 MiB through 16 MiB of DRAM and 32 MiB of SSD
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        assert bare_cluster.wait_for(lambda: client.cluster_status().tiering["disk_copies_dropped"] > 0, timeout=15)
        info = segment_info(client)
        assert info.ssd_used <= info.ssd_capacity
        assert not (ssd_dir / f"bucket-{0:016x}.kvb").exists(), "the oldest bucket was deleted"
        got = sources(client, keys)  # every read a verified hit or a miss
        assert got[keys[0]] is None, "the oldest object went with its bucket"
        assert got[keys[-1]] is not None
        assert "ssd/tcp" in got.values(), "the newer disk copies are still served"


def test_bad_and_abandoned_disk_reads_leave_the_segment_serving(ssd_cluster):
    from kvtier.proto import frames
    from kvtier.proto.frames import Op
    from tests.integration import rawframes

    keys = [f"raw/{i:02d}" for i in range(24)]
    with ssd_cluster.client() as client:
        put_and_offload(ssd_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"][:8]
        assert len(on_disk) >= 4
        endpoint = next(e for e in client.cluster_status().segments[0].endpoints if e.startswith("tcp://"))
        table = [(disk_location(client, k), MiB) for k in on_disk]
        names = frames.pack_disk_names([b"default\x00" + k.encode() for k in on_disk])
        # 100 clients that ask for 8 MiB from disk, read 100 bytes and hang up (more than the
        # 64 MiB read pool: a buffer kept by an abandoned request would starve the next ones)
        for n in range(100):
            with rawframes.connect(endpoint) as sock:
                rawframes.send_request(sock, Op.READ_DISK, n, table, names)
                rawframes.recv_exact(sock, 100)
        with rawframes.connect(endpoint) as sock:
            # wrong name, wrong size, unknown location: per-record errors, zeros, the rest served
            bad_names = frames.pack_disk_names(
                [
                    b"default\x00not-" + on_disk[0].encode(),
                    b"default\x00" + on_disk[1].encode(),
                    b"default\x00x",
                    b"default\x00" + on_disk[3].encode(),
                ]
            )
            bad_table = [table[0], (table[1][0], MiB - 1), ((1 << 47) | 5, MiB), table[3]]
            rawframes.send_request(sock, Op.READ_DISK, 7, bad_table, bad_names)
            header = rawframes.recv_exact(sock, frames.RESPONSE.size)
            *_, status, _flags, payload_len = frames.RESPONSE.unpack(header)
            assert status == 0 and payload_len == 4 * 4 + 4 * MiB - 1
            statuses = []
            for _, size in bad_table:
                (item,) = frames.DISK_STATUS.unpack(rawframes.recv_exact(sock, 4))
                data = rawframes.recv_exact(sock, size)
                statuses.append(item)
                last = data
            assert statuses[:3] == [Status.CHECKSUM_MISMATCH, Status.INVALID_RANGE, Status.NOT_FOUND]
            assert statuses[3] == 0 and last == value_for(on_disk[3])
            # names that do not parse: a protocol error, the connection closes
            rawframes.send_request(sock, Op.READ_DISK, 8, table[:1], b"\x05\x00ab")
            assert rawframes.recv_response(sock)[2] == Status.PROTOCOL_ERROR
        # and the segment still serves everything, verified
        assert client.batch_get(on_disk) == [value_for(k) for k in on_disk]
    assert "READ_DISK failed" not in ssd_cluster.segments["ssd0"].tail(5000), "a disk request crashed"


def test_a_client_that_stops_reading_a_disk_response_is_cut_off(bare_cluster, ssd_dir):
    from kvtier.proto import frames
    from kvtier.proto.frames import Op
    from tests.integration import rawframes

    bare_cluster.start_master()
    start_ssd_segment(bare_cluster, ssd_dir, "--ssd-send-timeout-s", "1")
    keys = [f"stall/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        on_disk = [k for k, s in sources(client, keys).items() if s == "ssd/tcp"][:8]
        endpoint = next(e for e in client.cluster_status().segments[0].endpoints if e.startswith("tcp://"))
        table = [(disk_location(client, k), MiB) for k in on_disk]
        names = frames.pack_disk_names([b"default\x00" + k.encode() for k in on_disk])
        stalled = rawframes.connect(endpoint)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        rawframes.send_request(stalled, Op.READ_DISK, 1, table, names)
        try:
            # when it reads nothing, the segment gives up on it after --ssd-send-timeout-s
            assert bare_cluster.wait_for(
                lambda: "stopped reading" in bare_cluster.segments["ssd0"].tail(200), timeout=15
            ), "the stalled connection was never cut off"
            # and everyone else is served meanwhile and afterwards, verified
            assert client.batch_get(on_disk) == [value_for(k) for k in on_disk]
        finally:
            stalled.close()


def test_a_small_ssd_tier_with_the_default_bucket_size_keeps_taking_offloads(bare_cluster, ssd_dir):
    # given a 64 MiB SSD tier under the default 256 MiB bucket size (the README allows any tier of at
    # least 16 MiB): the segment lowers its bucket size so the tier holds several buckets
    bare_cluster.start_master()
    segment = bare_cluster.start_segment("ssd0", "16MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "64MiB")
    client = bare_cluster.client()
    assert bare_cluster.wait_for(lambda: "ssd bucket size lowered" in segment.log.read_text(), 5.0)
    # when more than the tier holds is put and offloaded, all of it removed, then new objects put
    first = [f"a{i:03d}" for i in range(70)]
    put_and_offload(bare_cluster, client, first)
    assert set(client.batch_remove(first)) <= {Status.OK, Status.NOT_FOUND}  # the oldest may have left the tier
    second = [f"b{i:03d}" for i in range(40)]
    put_and_offload(bare_cluster, client, second)
    # then every acknowledged new object reads back (the tier had room: the removed ones' buckets are
    # reclaimed), and none was dropped for want of an SSD copy
    assert all(source is not None for source in sources(client, second).values())
    dropped = client.cluster_status().tiering.get("dropped_without_ssd_copy.offload_failed", 0)
    assert dropped == 0
