"""GroupWriter on real files: grouped records recover byte-exact; a bad copy or a failed write fails only
what it must and leaves nothing recovery would take as live; O_DIRECT falls back to buffered writes."""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import crc32c
import pytest

from kvtier.segment_server import buckets
from kvtier.segment_server.bucket_format import ALIGN, RecordError
from kvtier.segment_server.buckets import BucketStore, DiskFull
from kvtier.segment_server.group_writer import GroupWriter, OffloadItem

CLUSTER = "test-cluster"
CHUNK = 2 * ALIGN  # tiny staging buffers: records span several of them


@pytest.fixture
def opened():
    """Stores and writers opened by a test, closed at teardown whatever it did."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close()


def open_store(opened: list, directory: Path, capacity: int = 1 << 30, **kwargs) -> BucketStore:
    store = BucketStore(directory, capacity, CLUSTER, **kwargs)
    opened.append(store)
    store.recover()
    return store


def open_writer(opened: list, store: BucketStore, **kwargs) -> GroupWriter:
    writer = GroupWriter(store, **{"buffer_bytes": 4 * CHUNK, "chunk_bytes": CHUNK, "threads": 2, **kwargs})
    opened.append(writer)
    return writer


def items_of(sizes: list[int], seed: int = 0) -> list[OffloadItem]:
    """Objects in one shared 'DRAM region' (a bytearray), as the tier worker hands them over."""
    rng = random.Random(seed)
    region = bytearray(rng.randbytes(sum(sizes)))
    view = memoryview(region)
    out, at = [], 0
    for i, size in enumerate(sizes):
        payload = view[at : at + size]
        out.append(OffloadItem("ns", f"k{i}", payload, crc32c.crc32c(payload)))
        at += size
    return out


def recovered(opened: list, store: BucketStore, directory: Path, **kwargs) -> dict[str, bytes]:
    """Close the store, recover a fresh one, and read every live record the data plane's way."""
    store.close()
    again = open_store(opened, directory, **kwargs)
    out = {}
    for record in again.records():
        plan = again.plan_read(record.location)
        buf = os.pread(plan.fd, plan.read_length, plan.file_offset)
        payload = BucketStore.payload_of(memoryview(buf), plan, record.namespace, record.key, CLUSTER)
        assert crc32c.crc32c(payload) == record.checksum
        out[record.key] = bytes(payload)
    return out


def test_group_is_recovered_byte_exact_across_buffers_and_bucket_rolls(opened, tmp_path):
    store = open_store(opened, tmp_path, bucket_size=16 * ALIGN, bucket_keys=5)
    writer = open_writer(opened, store)
    sizes = [1, 100, ALIGN, ALIGN - 40, 3 * CHUNK + 17, 5000, 0, 12000, 7, CHUNK, 2 * ALIGN] * 2
    items = items_of(sizes)
    outcomes = writer.write(items)
    assert all(isinstance(o, int) for o in outcomes), outcomes
    store.sync()
    assert len(set(outcomes)) == len(items)
    assert store.bucket_count > 2  # the batch rolled over buckets (5 records or 64 KiB each)
    got = recovered(opened, store, tmp_path, bucket_size=16 * ALIGN, bucket_keys=5)
    assert got == {item.key: bytes(item.payload) for item in items}


def test_group_writes_are_direct_on_a_disk_that_takes_them(opened, tmp_path):
    store = open_store(opened, tmp_path, direct_io=True)
    writer = open_writer(opened, store, chunk_bytes=16 * ALIGN, buffer_bytes=64 * ALIGN)
    items = items_of([70000, 3000, 9000] + [1000] * 40)
    assert all(isinstance(o, int) for o in writer.write(items))
    assert writer.writes <= 5  # 61 pages of records in 16-page writes
    fd, direct = store.group_fd()
    assert direct and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # an O_DIRECT fd of the open bucket
    assert os.fstat(fd).st_ino == os.stat(next(tmp_path.glob("bucket-*.kvb"))).st_ino
    store.sync()
    assert recovered(opened, store, tmp_path) == {item.key: bytes(item.payload) for item in items}


def test_a_group_tag_survives_recovery_sealed_or_open_and_ungrouped_records_keep_version_1(opened, tmp_path):
    """An offloaded group member's record carries its group tag (version 2): recovery, from a sealed
    bucket's footer or by scanning the open one, reports it, and the data plane reads the record.
    Ungrouped records stay version 1, byte for byte what older readers take."""
    store = open_store(opened, tmp_path, bucket_size=16 * ALIGN, bucket_keys=3)
    writer = open_writer(opened, store)
    tags = {f"k{i}": (0x5EED0000 + i, 3) for i in (0, 2, 3, 5, 6)}
    plain = items_of([5000, 100, 0, 9000, 7000, 4096, 300])
    items = [replace(item, group=tags.get(item.key, (0, 0))) for item in plain]
    outcomes = writer.write(items)
    assert all(isinstance(o, int) for o in outcomes), outcomes
    store.sync()
    assert store.bucket_count >= 2  # sealed buckets (3 records each) and the open one
    assert {r.key: (r.group_id, r.group_size) for r in store.records()} == {i.key: i.group for i in items}
    got = recovered(opened, store, tmp_path, bucket_size=16 * ALIGN, bucket_keys=3)
    assert got == {item.key: bytes(item.payload) for item in items}
    again = opened[-1]
    assert {r.key: (r.group_id, r.group_size) for r in again.records()} == {i.key: i.group for i in items}
    for record in again.records():
        plan = again.plan_read(record.location)
        version = int.from_bytes(os.pread(plan.fd, 2, plan.file_offset + 4), "little")
        assert version == (2 if record.key in tags else 1), record


def test_a_group_tag_is_covered_by_the_header_crc_and_must_name_a_group():
    from kvtier.segment_server.bucket_format import (
        FLAG_OBJECT,
        FLAG_TOMBSTONE,
        _parse_header,
        _record_header,
    )

    header = _record_header(FLAG_OBJECT, b"ns", b"key", 10, 1, 2, (0xABCDEF, 4))
    head = _parse_header(header)
    assert (head.namespace, head.key, head.group_id, head.group_size) == ("ns", "key", 0xABCDEF, 4)
    assert head.header_len == len(header) == 36 + 5 + 12
    flipped = bytearray(header)
    flipped[-3] ^= 1  # inside the tag
    with pytest.raises(RecordError, match="CRC"):
        _parse_header(bytes(flipped))
    with pytest.raises(RecordError, match="names no group"):
        _parse_header(_record_header(FLAG_OBJECT, b"ns", b"key", 10, 1, 2, (7, 0)))
    with pytest.raises(RecordError, match="flags"):
        _parse_header(_record_header(FLAG_TOMBSTONE, b"", b"", 8, 1, 2, (7, 1)))
    plain = _record_header(FLAG_OBJECT, b"ns", b"key", 10, 1, 2)
    assert len(plain) == 36 + 5 and _parse_header(plain).group_id == 0


@pytest.mark.parametrize("bad", [1, 4], ids=["inside-one-buffer", "spanning-buffers"])
def test_a_crc_mismatch_fails_that_record_only(opened, tmp_path, bad):
    store = open_store(opened, tmp_path)
    writer = open_writer(opened, store)
    items = items_of([3000, 5000, 200, 9000, 3 * CHUNK, 100])
    items[bad] = OffloadItem(items[bad].namespace, items[bad].key, items[bad].payload, items[bad].checksum ^ 1)
    outcomes = writer.write(items)
    assert isinstance(outcomes[bad], RecordError)
    assert all(isinstance(o, int) for i, o in enumerate(outcomes) if i != bad)
    assert {r.key for r in store.records()} == {item.key for i, item in enumerate(items) if i != bad}
    store.sync()
    got = recovered(opened, store, tmp_path)
    assert got == {item.key: bytes(item.payload) for i, item in enumerate(items) if i != bad}


def test_capacity_running_out_mid_group_commits_the_records_before_it(opened, tmp_path):
    capacity = 12 * ALIGN
    store = open_store(opened, tmp_path, capacity=capacity, bucket_keys=1000)
    writer = open_writer(opened, store)
    items = items_of([3 * ALIGN] * 6)
    outcomes = writer.write(items)
    done = [i for i, o in enumerate(outcomes) if isinstance(o, int)]
    assert done == list(range(len(done))) and 0 < len(done) < len(items)
    assert all(isinstance(o, DiskFull) for o in outcomes[len(done) :])
    assert store.used <= capacity
    # the store stays usable for appends of another kind
    store.tombstone_many([outcomes[0]])
    store.sync()
    got = recovered(opened, store, tmp_path, capacity=capacity, bucket_keys=1000)
    assert got == {items[i].key: bytes(items[i].payload) for i in done[1:]}


def test_on_full_may_make_room_once(opened, tmp_path):
    kwargs = {"capacity": 20 * ALIGN, "bucket_size": 5 * ALIGN, "bucket_keys": 1000, "high_watermark": 0.5}
    store = open_store(opened, tmp_path, **{**kwargs, "low_watermark": 0.3})
    writer = open_writer(opened, store)
    written_before = []

    def evict() -> bool:  # what the tier worker does: drop the oldest sealed buckets
        written_before.append(len(store.records()))
        store.delete_buckets([bucket_id for bucket_id, _ in store.eviction_candidates()])
        return True

    outcomes = writer.write(items_of([2 * ALIGN] * 12), on_full=evict)
    assert len(written_before) == 1
    full_at = written_before[0]
    assert all(isinstance(o, int) for o in outcomes[: full_at + 1])  # the record that found it full, retried
    assert all(isinstance(o, (int, DiskFull)) for o in outcomes)


_CHILD = textwrap.dedent(
    """
    import json, os, random, resource, signal, sys
    import crc32c
    from kvtier.segment_server.buckets import BucketStore
    from kvtier.segment_server.group_writer import GroupWriter, OffloadItem

    directory, limit = sys.argv[1], int(sys.argv[2])
    store = BucketStore(directory, 1 << 30, "test-cluster", direct_io=True)
    store.recover()
    writer = GroupWriter(store, buffer_bytes=4 * 8192, chunk_bytes=8192, threads=2)
    rng = random.Random(1)
    payloads = [rng.randbytes(n) for n in (3000, 5000, 9000, 7000, 20000, 3000, 100)]
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    items = [OffloadItem("ns", f"k{i}", p, crc32c.crc32c(p)) for i, p in enumerate(payloads)]
    outcomes = writer.write(items)
    store.sync()
    print(json.dumps([o if isinstance(o, int) else [type(o).__name__, getattr(o, "errno", None)] for o in outcomes]))
    """
)


def _child(directory: Path, limit: int, prefix: list[str] = ()) -> list:
    result = subprocess.run(
        [*prefix, sys.executable, "-c", _CHILD, str(directory), str(limit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_failed_write_mid_group_reports_no_location_and_recovery_accepts_none_of_it(opened, tmp_path):
    # A real kernel refusal in a child process: writes past RLIMIT_FSIZE fail with EFBIG (the bucket
    # header takes 4 KiB, the records 4-20 KiB each: the limit falls inside the third record).
    outcomes = _child(tmp_path, 7 * ALIGN)
    good = [o for o in outcomes if isinstance(o, int)]
    failed = [o for o in outcomes if not isinstance(o, int)]
    assert good and failed and outcomes[: len(good)] == good  # a prefix is written, the rest fails
    assert all(err == ["OSError", errno.EFBIG] for err in failed)
    store = open_store(opened, tmp_path)
    assert sorted(r.location for r in store.records()) == good
    files = list(tmp_path.glob("bucket-*.kvb"))
    assert len(files) == 1 and files[0].stat().st_size <= 7 * ALIGN


def test_disk_full_mid_group_on_a_small_tmpfs(opened, tmp_path):
    # ENOSPC from a 48 KiB tmpfs mounted in a private user and mount namespace (no root needed).
    mount = tmp_path / "small"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user namespaces unavailable: no private tmpfs to fill")
    script = f'mount -t tmpfs -o size=48k none {mount} && exec "$@"'
    outcomes = _child(mount, 0, ["unshare", "-rm", "sh", "-c", script, "sh"])
    good = [o for o in outcomes if isinstance(o, int)]
    assert good and len(good) < len(outcomes) and outcomes[: len(good)] == good
    assert all(err == ["DiskFull", errno.ENOSPC] for err in outcomes[len(good) :])


def test_o_direct_refused_falls_back_to_buffered_writes(opened, tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):  # a file system without O_DIRECT (older tmpfs, some FUSE)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(buckets.os, "open", no_direct)
    store = open_store(opened, tmp_path, direct_io=True)
    writer = open_writer(opened, store)
    items = items_of([3000, 3 * CHUNK, 10])
    assert all(isinstance(o, int) for o in writer.write(items))
    assert store.group_fd()[1] is False
    assert "O_DIRECT writes not supported" in caplog.text
    store.sync()
    monkeypatch.undo()
    assert recovered(opened, store, tmp_path) == {item.key: bytes(item.payload) for item in items}


def test_bounded_and_validated(opened, tmp_path):
    store = open_store(opened, tmp_path)
    with pytest.raises(ValueError, match="multiple of 4096"):
        GroupWriter(store, chunk_bytes=1000)
    with pytest.raises(ValueError, match="two"):
        GroupWriter(store, buffer_bytes=CHUNK, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="threads"):
        GroupWriter(store, buffer_bytes=4 * CHUNK, chunk_bytes=CHUNK, threads=0)
    writer = open_writer(opened, store)
    writer.write(items_of([CHUNK] * 20))
    names = [t.name for t in threading.enumerate() if t.name.startswith("kvtier-ssd-write")]
    assert len(names) == 2 and len(writer._maps) == 4  # fixed: threads (started up front) and buffers
    writer.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-ssd-write")]


def test_payloads_of_any_buffer_format_are_written_as_their_bytes(opened, tmp_path):
    store = open_store(opened, tmp_path)
    writer = open_writer(opened, store)
    words = array.array("I", range(3000))  # 12000 bytes, itemsize 4: spans staging buffers
    raw = words.tobytes()
    items = [
        OffloadItem("ns", "words", memoryview(words), crc32c.crc32c(raw)),
        OffloadItem("ns", "bytes", raw[:100], crc32c.crc32c(raw[:100])),
    ]
    assert all(isinstance(o, int) for o in writer.write(items))
    store.sync()
    assert recovered(opened, store, tmp_path) == {"words": raw, "bytes": raw[:100]}


def test_o_direct_refused_at_write_time_is_retried_buffered(opened, tmp_path, monkeypatch):
    store = open_store(opened, tmp_path, direct_io=True)
    writer = open_writer(opened, store)
    direct_fd, direct = store.group_fd()
    assert direct
    real_pwritev = os.pwritev
    refused = []

    def pwritev(fd, buffers, offset):  # a file system that opens O_DIRECT but will not write so
        if fd == direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    items = items_of([3000, 3 * CHUNK, 10])
    assert all(isinstance(o, int) for o in writer.write(items))
    assert refused and store.group_fd()[1] is False
    store.sync()
    monkeypatch.undo()
    assert recovered(opened, store, tmp_path) == {item.key: bytes(item.payload) for item in items}


def test_a_failure_to_make_room_fails_only_what_does_not_fit(opened, tmp_path):
    store = open_store(opened, tmp_path, capacity=12 * ALIGN, bucket_keys=1000)
    writer = open_writer(opened, store)

    def unreachable() -> bool:
        raise ConnectionError("master unreachable")

    outcomes = writer.write(items_of([3 * ALIGN] * 6), on_full=unreachable)
    done = [o for o in outcomes if isinstance(o, int)]
    assert done and all(isinstance(o, DiskFull) for o in outcomes[len(done) :])
    later = writer.write(items_of([100]))  # buffers and reservations were all given back
    assert isinstance(later[0], int)  # a small record still fits
    assert len(writer._free) == len(writer._views)
