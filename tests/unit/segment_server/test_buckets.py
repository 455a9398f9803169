"""BucketStore on real files in a tmp directory: format, appends, recovery after damage, tombstones, eviction."""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import random
import struct
import tempfile
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.segment_server import bucket_format, buckets
from kvtier.segment_server.bucket_format import ALIGN, DiskRecord, ReadPlan, RecordError
from kvtier.segment_server.buckets import BucketStore, DiskFull
from kvtier.segment_server.verifier import Verifier

CLUSTER = "test-cluster"
SMALL = {"bucket_size": 16 * ALIGN, "bucket_keys": 3}  # seals every 3 records or 64 KiB
LOCATOR = struct.Struct("<Q4sI")
RECORD = struct.Struct("<4sHHIHHQIII")  # ... size, payload_crc, cluster_crc, header_crc
RECORD_FIXED = 36  # the names follow at this offset


@pytest.fixture
def stores():
    """Open BucketStores on demand; all closed at teardown whatever the test did."""
    opened: list[BucketStore] = []

    def open_store(directory: Path, capacity: int = 1 << 30, cluster: str = CLUSTER, **kwargs) -> BucketStore:
        store = BucketStore(directory, capacity, cluster, **kwargs)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def ssd(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def put(store: BucketStore, key: str, data: bytes, namespace: str = "ns") -> int:
    return store.append(namespace, key, data, crc32c.crc32c(data))


def read(store: BucketStore, location: int, key: str, namespace: str = "ns") -> bytes:
    """Read a record the way the data plane does: one aligned pread with the plan, then payload_of."""
    plan = store.plan_read(location)
    buf = os.pread(plan.fd, plan.read_length, plan.file_offset)
    return bytes(BucketStore.payload_of(memoryview(buf), plan, namespace, key, store.cluster_id))


def bucket_file(directory: Path, bucket_id: int) -> Path:
    return directory / f"bucket-{bucket_id:016x}.kvb"


def bucket_ids(directory: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1], 16) for p in directory.glob("bucket-*.kvb"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def reopen(stores, store: BucketStore, directory: Path, **kwargs) -> tuple[BucketStore, list[DiskRecord]]:
    store.close()
    again = stores(directory, **kwargs)
    return again, again.recover()


def fill(store: BucketStore, count: int, size: int = 3000) -> dict[int, tuple[str, bytes]]:
    written = {}
    for i in range(count):
        data = blob(i, size)
        written[put(store, f"k{i}", data)] = (f"k{i}", data)
    return written


def bucket_header(bucket_id: int, cluster: bytes, version: int = 1) -> bytes:
    """A bucket header built from the documented format, independently of the module."""
    head = struct.pack("<4sHHQdH", b"KVTB", version, 0, bucket_id, 1.0e9, len(cluster)) + cluster
    return (head + struct.pack("<I", crc32c.crc32c(head))).ljust(ALIGN, b"\0")


# --- appends and reads -----------------------------------------------------------------------


def test_append_sync_read_returns_exact_bytes(stores, ssd):
    store = stores(ssd)
    assert not ssd.exists() or not list(ssd.iterdir())  # nothing touched before recover
    assert store.recover() == []
    assert (ssd.stat().st_mode & 0o777) == 0o700
    data = blob(1, 10_000)
    location = store.append("ns", "key-é", memoryview(data), crc32c.crc32c(data))
    store.sync()
    plan = store.plan_read(location)
    assert location >> 20 == store.open_bucket_id
    assert plan.file_offset == (location & 0xFFFFF) * ALIGN == ALIGN
    assert plan.header_len == RECORD_FIXED + len(b"ns") + len("key-é".encode())
    assert plan.size == len(data)
    assert plan.read_length % ALIGN == 0 and plan.read_length >= plan.header_len + plan.size
    assert read(store, location, "key-é") == data
    assert store.records() == [DiskRecord(location, "ns", "key-é", len(data), crc32c.crc32c(data))]
    assert store.used == os.path.getsize(bucket_file(ssd, store.open_bucket_id)) // ALIGN * ALIGN + ALIGN


def test_empty_payload_round_trips(stores, ssd):
    store = stores(ssd)
    store.recover()
    location = put(store, "empty", b"")
    assert read(store, location, "empty") == b""
    store, records = reopen(stores, store, ssd)
    assert [(r.key, r.size) for r in records] == [("empty", 0)]


def test_append_keeps_no_reference_to_the_callers_buffer(stores, ssd):
    """A caller that reuses its buffer after append (before sync) cannot change what is on disk."""
    store = stores(ssd)
    store.recover()
    source = bytearray(blob(2, 5000))
    original = bytes(source)
    location = store.append("ns", "k", memoryview(source), crc32c.crc32c(original))
    source[:100] = bytes(100)
    store.sync()
    assert read(store, location, "k") == original


def test_records_across_buckets_survive_reopen(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    rng = random.Random(7)
    written = {}
    for i in range(40):
        data = blob(i, rng.randrange(0, 20_000))
        written[put(store, f"key{i}", data, namespace=f"ns{i % 3}")] = (f"ns{i % 3}", f"key{i}", data)
    store.sync()
    assert store.bucket_count >= 10
    assert bucket_ids(ssd) == list(range(store.bucket_count))
    for bucket_id in bucket_ids(ssd)[:-1]:  # every bucket but the open one is sealed
        assert bucket_file(ssd, bucket_id).read_bytes()[-8:-4] == b"KVTE"
    used = store.used

    store, records = reopen(stores, store, ssd, **SMALL)
    assert {r.location: (r.namespace, r.key) for r in records} == {loc: w[:2] for loc, w in written.items()}
    for record in records:
        namespace, key, data = written[record.location]
        assert (record.size, record.checksum) == (len(data), crc32c.crc32c(data))
        assert read(store, record.location, key, namespace) == data
    assert store.records() == records
    assert store.used == used


def test_bucket_seals_when_next_record_would_pass_bucket_size(stores, ssd):
    store = stores(ssd, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    first = put(store, "a", blob(1, 2 * ALIGN))  # offsets 4096..16384: the bucket is full
    second = put(store, "b", blob(2, 100))
    assert (first >> 20, second >> 20) == (0, 1)
    assert bucket_file(ssd, 0).read_bytes()[-8:-4] == b"KVTE"


def test_open_bucket_at_its_limits_is_sealed_on_recover(stores, ssd):
    store = stores(ssd, bucket_keys=10)
    store.recover()
    written = fill(store, 3)
    store, records = reopen(stores, store, ssd, bucket_keys=2)
    assert {r.location for r in records} == set(written)
    assert store.open_bucket_id == 1
    assert bucket_file(ssd, 0).read_bytes()[-8:-4] == b"KVTE"


def test_bucket_ids_increase_across_restarts_and_deletes(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    fill(store, 7)  # buckets 0, 1 sealed; 2 open
    store.delete_buckets([0, 1])
    store, _ = reopen(stores, store, ssd, **SMALL)
    assert store.open_bucket_id == 2
    fill(store, 3)
    assert store.open_bucket_id == 3


def test_file_format_matches_the_documentation(stores, ssd):
    store = stores(ssd, cluster="fmt", bucket_keys=2)
    store.recover()
    payloads = [blob(1, 5000), blob(2, 10)]
    locations = [store.append("space", f"key{i}", p, crc32c.crc32c(p)) for i, p in enumerate(payloads)]
    raw = bucket_file(ssd, 0).read_bytes()

    magic, version, _, bucket_id, created, cluster_len = struct.unpack_from("<4sHHQdH", raw)
    assert (magic, version, bucket_id, raw[26 : 26 + cluster_len]) == (b"KVTB", 1, 0, b"fmt")
    assert created > 1.6e9
    assert struct.unpack_from("<I", raw, 26 + cluster_len)[0] == crc32c.crc32c(raw[: 26 + cluster_len])
    assert raw[30 + cluster_len : ALIGN] == bytes(ALIGN - 30 - cluster_len)

    assert RECORD.size == RECORD_FIXED
    offsets = [ALIGN, ALIGN + ((36 + 5 + 4 + 5000 + ALIGN - 1) // ALIGN) * ALIGN]
    for offset, location, data, i in zip(offsets, locations, payloads, range(2), strict=True):
        assert location == offset // ALIGN
        magic, version, flags, header_len, ns_len, key_len, size, payload_crc, cluster_crc, header_crc = (
            RECORD.unpack_from(raw, offset)
        )
        assert (magic, version, flags, ns_len, key_len, size) == (b"KVTR", 1, 0, 5, 4, len(data))
        assert header_len == 36 + 5 + 4
        assert cluster_crc == crc32c.crc32c(b"fmt")
        assert struct.unpack_from("<I", raw, offset + 28)[0] == cluster_crc  # right before header_crc
        assert struct.unpack_from("<I", raw, offset + 32)[0] == header_crc
        header = bytearray(raw[offset : offset + header_len])
        header[32:36] = bytes(4)
        assert header_crc == crc32c.crc32c(header)
        assert raw[offset + 36 : offset + header_len] == f"spacekey{i}".encode()
        assert raw[offset + header_len : offset + header_len + size] == data
        assert payload_crc == crc32c.crc32c(data)

    footer_off, magic, crc = LOCATOR.unpack_from(raw, len(raw) - 16)
    assert magic == b"KVTE" and crc == crc32c.crc32c(raw[-16:-4])
    assert footer_off % ALIGN == 0 and footer_off == offsets[1] + ALIGN
    footer = raw[footer_off:-16]
    assert struct.unpack_from("<4sI", footer) == (b"KVTI", 2)
    entries = [struct.unpack_from("<QIQH", footer, 8 + 22 * i) for i in range(2)]
    assert entries == [(offsets[0], 45, 5000, 0), (offsets[1], 45, 10, 0)]
    assert len(footer) == 8 + 2 * 22 + 4
    assert struct.unpack_from("<I", footer, len(footer) - 4)[0] == crc32c.crc32c(footer[:-4])

    store.tombstone(locations[0])  # written twice, on its own page each (buckets.py, _append_tombstones)
    raw = bucket_file(ssd, 1).read_bytes()
    for offset in (ALIGN, 2 * ALIGN):
        fields = RECORD.unpack_from(raw, offset)
        assert fields[:7] == (b"KVTR", 1, 1, 36, 0, 0, 8)
        assert fields[8] == crc32c.crc32c(b"fmt")  # tombstones carry the cluster tag too
        assert raw[offset + 36 : offset + 44] == struct.pack("<Q", locations[0])
        assert fields[7] == crc32c.crc32c(raw[offset + 36 : offset + 44])

    more = [store.append("space", f"more{i}", b"m", crc32c.crc32c(b"m")) for i in range(2)]  # bucket 2
    store.tombstone_many([locations[1], *more])  # one record, N = 3 locations (and its copy): bucket 3
    raw = bucket_file(ssd, 3).read_bytes()
    for offset in (ALIGN, 2 * ALIGN):
        fields = RECORD.unpack_from(raw, offset)
        assert fields[:7] == (b"KVTR", 1, 1, 36, 0, 0, 24)
        payload = raw[offset + 36 : offset + 60]
        assert payload == struct.pack("<3Q", locations[1], *more)
        assert fields[7] == crc32c.crc32c(payload)


# --- verification ----------------------------------------------------------------------------


def test_checksum_mismatch_writes_nothing(stores, ssd):
    store = stores(ssd)
    store.recover()
    good = put(store, "good", b"a" * 100)
    store.sync()
    path = bucket_file(ssd, 0)
    size = path.stat().st_size
    used = store.used
    with pytest.raises(RecordError, match="CRC32C"):
        store.append("ns", "bad", b"b" * 100, crc32c.crc32c(b"something else"))
    assert path.stat().st_size == size and store.used == used
    assert [r.key for r in store.records()] == ["good"]
    after = put(store, "after", b"c" * 100)
    store.sync()
    store, records = reopen(stores, store, ssd)
    assert {r.location: r.key for r in records} == {good: "good", after: "after"}


@pytest.mark.parametrize("which", [0, 4], ids=["sealed-bucket", "open-bucket"])
def test_corrupt_payload_byte_is_listed_at_mount_and_dropped_by_the_verifier(stores, ssd, which, caplog):
    """Mounting reads no payload: a damaged one is still listed (unverified) until the background
    verifier reads it, finds it corrupt and has it tombstoned; its neighbours stay."""
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 5)
    victim = list(written)[which]
    plan = store.plan_read(victim)
    store.close()
    flip(bucket_file(ssd, victim >> 20), plan.file_offset + plan.header_len + 1000)

    store = stores(ssd, **SMALL)
    records = store.recover()
    assert {r.location for r in records} == set(written)
    assert store.unverified_bytes == sum(len(data) for _, data in written.values())
    verifier = Verifier(store, rate=0)  # off in the background; driven by hand here
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.verifier"):
        while verifier.run_once():
            pass
    assert "payload CRC32C" in caplog.text
    assert (verifier.verified, verifier.corrupt, store.unverified_bytes) == (4, 1, 0)
    verifier.apply(stub=None, segment_id=0)  # the writer's side: tombstone (no master to tell)
    with pytest.raises(KeyError):
        store.plan_read(victim)
    for location, (key, data) in written.items():
        if location != victim:
            assert read(store, location, key) == data
    store, records = reopen(stores, store, ssd, **SMALL)
    assert {r.location for r in records} == set(written) - {victim}


def test_recover_reads_headers_not_payloads(stores, ssd, monkeypatch):
    """Sealed buckets through their footer and the open bucket by a header scan: one page per large
    record; small records in a sealed bucket are read in runs, a few preads for many records."""
    store = stores(ssd, bucket_size=4 << 20)
    store.recover()
    large = fill_sizes(store, [256 * ALIGN] * 40)  # 1 MiB records, 3 to a bucket
    small = fill_sizes(store, [100] * 1500)  # 6 MiB of 4 KiB records...
    large.update(fill_sizes(store, [256 * ALIGN] * 4))  # ...all in sealed buckets
    store.sync()
    store.close()
    reads: list[int] = []
    real_pread = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        reads.append(length)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", pread)
    store = stores(ssd, bucket_size=4 << 20)
    records = store.recover()
    monkeypatch.undo()
    assert {r.location for r in records} == set(large) | set(small)
    assert store.bucket_count >= 5
    # a page per large record; the small ones' pages (runs read them whole), plus footers
    assert sum(reads) < len(large) * 2 * ALIGN + len(small) * ALIGN + store.bucket_count * 2 * ALIGN
    assert len(reads) < len(large) + len(small) // 10 + 3 * store.bucket_count


def test_unverified_records_leave_the_backlog_when_tombstoned_or_deleted(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    written = list(fill(store, 7))
    store.sync()
    store, _ = reopen(stores, store, ssd, **SMALL)
    assert store.unverified_bytes == 7 * 3000
    # the bucket that was never sealed first (only it can hold records a crash tore), then oldest first
    assert store.next_unverified().location == written[-1]
    store.tombstone(written[-1])
    assert store.unverified_bytes == 6 * 3000
    store.delete_buckets([written[0] >> 20])  # the oldest sealed bucket: 3 records
    assert store.unverified_bytes == 3 * 3000
    remaining = []
    while (record := store.next_unverified()) is not None:
        remaining.append(record.location)
        store.verified(record.location)
    assert remaining == written[3:6] and store.unverified_bytes == 0
    put(store, "fresh", b"f" * 100)  # written and checked now: never unverified
    assert store.next_unverified() is None


def test_payload_of_accepts_a_short_read_past_eof(stores, ssd):
    store = stores(ssd)
    store.recover()
    location = put(store, "k", blob(3, 100))
    plan = store.plan_read(location)
    buf = os.pread(plan.fd, plan.read_length, plan.file_offset)
    assert len(buf) < plan.read_length  # the last record: the read stops at EOF
    assert bytes(BucketStore.payload_of(memoryview(buf), plan, "ns", "k")) == blob(3, 100)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda buf, plan: buf.__setitem__(37, buf[37] ^ 1), "header CRC"),
        (lambda buf, plan: buf.__setitem__(0, ord("X")), "magic"),
        (lambda buf, plan: buf.__setitem__(4, 2), "version"),
        (lambda buf, plan: buf.__setitem__(6, 1), "flags|tombstone|CRC"),
        (lambda buf, plan: buf.__delitem__(slice(plan.header_len + plan.size - 1, None)), "short read"),
        (lambda buf, plan: buf.__delitem__(slice(20, None)), "truncated"),
    ],
    ids=["name-byte", "magic", "version", "flags", "short-payload", "short-header"],
)
def test_payload_of_rejects_damaged_records(stores, ssd, damage, message):
    store = stores(ssd)
    store.recover()
    location = put(store, "key", blob(4, 3000))
    put(store, "next", b"x")  # so the first record's read is not cut by EOF
    plan = store.plan_read(location)
    buf = bytearray(os.pread(plan.fd, plan.read_length, plan.file_offset))
    assert bytes(BucketStore.payload_of(memoryview(buf), plan, "ns", "key")) == blob(4, 3000)
    damage(buf, plan)
    with pytest.raises(RecordError, match=message):
        BucketStore.payload_of(memoryview(buf), plan, "ns", "key")


@pytest.mark.parametrize(
    ("namespace", "key", "change"),
    [("other", "key", {}), ("ns", "kez", {}), ("ns", "key", {"size": 2999}), ("ns", "key", {"header_len": 40})],
    ids=["namespace", "key", "size", "header_len"],
)
def test_payload_of_rejects_a_record_that_is_not_the_expected_one(stores, ssd, namespace, key, change):
    store = stores(ssd)
    store.recover()
    location = put(store, "key", blob(5, 3000))
    plan = store.plan_read(location)
    buf = os.pread(plan.fd, plan.read_length, plan.file_offset)
    with pytest.raises(RecordError):
        BucketStore.payload_of(memoryview(buf), dataclasses.replace(plan, **change), namespace, key)


def test_payload_of_checks_the_cluster_tag_when_given_a_cluster_id(stores, ssd):
    store = stores(ssd)
    store.recover()
    assert store.cluster_id == CLUSTER
    data = blob(6, 3000)
    plan = store.plan_read(put(store, "key", data))
    buf = memoryview(os.pread(plan.fd, plan.read_length, plan.file_offset))
    assert bytes(BucketStore.payload_of(buf, plan, "ns", "key", CLUSTER)) == data
    assert bytes(BucketStore.payload_of(buf, plan, "ns", "key")) == data  # no cluster id: tag not checked
    with pytest.raises(RecordError, match="another cluster"):
        BucketStore.payload_of(buf, plan, "ns", "key", "other-cluster")


def test_payload_of_refuses_a_record_written_by_another_cluster(stores, ssd):
    other = stores(ssd, cluster="other-cluster")
    other.recover()
    plan = other.plan_read(put(other, "key", b"theirs"))
    buf = memoryview(os.pread(plan.fd, plan.read_length, plan.file_offset))
    assert bytes(BucketStore.payload_of(buf, plan, "ns", "key", "other-cluster")) == b"theirs"
    with pytest.raises(RecordError, match="another cluster"):
        BucketStore.payload_of(buf, plan, "ns", "key", CLUSTER)


def test_payload_of_rejects_a_tombstone(stores, ssd):
    store = stores(ssd)
    store.recover()
    location = put(store, "key", b"abc")
    store.tombstone(location)
    tomb_plan = ReadPlan(store.plan_read(put(store, "x", b"")).fd, 2 * ALIGN, ALIGN, RECORD_FIXED, 8)
    buf = os.pread(tomb_plan.fd, ALIGN, 2 * ALIGN)
    with pytest.raises(RecordError, match="tombstone"):
        BucketStore.payload_of(memoryview(buf), tomb_plan, "", "")


# --- recovery after damage -------------------------------------------------------------------


def _cut_mid_payload(path: Path, offset: int, plan: ReadPlan) -> None:
    os.truncate(path, offset + plan.header_len + plan.size // 2)


def _cut_mid_header(path: Path, offset: int, plan: ReadPlan) -> None:
    os.truncate(path, offset + 20)


def _bad_header_crc(path: Path, offset: int, plan: ReadPlan) -> None:
    flip(path, offset + plan.header_len - 1)


def _garbage_tail(path: Path, offset: int, plan: ReadPlan) -> None:
    os.truncate(path, offset)
    with open(path, "ab") as f:
        f.write(b"KVTR" + os.urandom(5000))


@pytest.mark.parametrize("tear", [_cut_mid_payload, _cut_mid_header, _bad_header_crc, _garbage_tail])
def test_torn_tail_is_truncated_and_appends_continue(stores, ssd, tear):
    store = stores(ssd)
    store.recover()
    written = fill(store, 4)
    torn = list(written)[-1]
    plan = store.plan_read(torn)
    path = bucket_file(ssd, 0)
    store.close()
    tear(path, plan.file_offset, plan)

    store = stores(ssd)
    records = store.recover()
    assert {r.location for r in records} == set(written) - {torn}
    assert path.stat().st_size == plan.file_offset
    later = put(store, "later", b"after the tear")
    assert later == torn  # the torn record's space is reused
    store.sync()

    store, records = reopen(stores, store, ssd)
    assert {r.location: r.key for r in records} == {**{loc: k for loc, (k, _) in written.items()}, later: "later"}
    assert read(store, later, "later") == b"after the tear"


def retag(path: Path, offset: int, cluster: bytes) -> None:
    """Give the record at `offset` another cluster's tag, with a recomputed header CRC: only the tag is wrong."""
    with open(path, "r+b") as f:
        f.seek(offset)
        fixed = f.read(RECORD_FIXED)
        header_len = struct.unpack_from("<I", fixed, 8)[0]
        f.seek(offset)
        header = bytearray(f.read(header_len))
        header[28:32] = struct.pack("<I", crc32c.crc32c(cluster))
        header[32:36] = bytes(4)
        header[32:36] = struct.pack("<I", crc32c.crc32c(header))
        f.seek(offset)
        f.write(header)


@pytest.mark.parametrize("which", [1, 5], ids=["sealed-bucket", "open-bucket"])
def test_record_with_another_clusters_tag_is_dropped_and_its_neighbours_survive(stores, ssd, which, caplog):
    kwargs = {"bucket_size": 16 * ALIGN, "bucket_keys": 4}  # bucket 0 sealed: k0..k3; bucket 1 open: k4..k6
    store = stores(ssd, **kwargs)
    store.recover()
    written = fill(store, 7)
    store.sync()
    assert store.open_bucket_id == 1
    victim = list(written)[which]
    plan = store.plan_read(victim)
    path = bucket_file(ssd, victim >> 20)
    store.close()
    retag(path, plan.file_offset, b"other-cluster")
    size = path.stat().st_size

    store = stores(ssd, **kwargs)
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        records = store.recover()
    assert "cluster tag" in caplog.text
    assert "footer invalid" not in caplog.text  # the sealed bucket's footer path checks the tag itself
    assert "torn" not in caplog.text
    assert {r.location for r in records} == set(written) - {victim}
    assert path.stat().st_size == size  # nothing truncated: the scan went on past the record
    with pytest.raises(KeyError):
        store.plan_read(victim)
    for location, (key, data) in written.items():
        if location != victim:
            assert read(store, location, key) == data

    later = put(store, "later", b"after the foreign record")
    assert later > max(written)  # the foreign record's space is not reused
    store.sync()
    store, records = reopen(stores, store, ssd, **kwargs)
    assert {r.location for r in records} == (set(written) - {victim}) | {later}
    assert read(store, later, "later") == b"after the foreign record"


def test_sealed_bucket_with_corrupt_footer_is_scanned(stores, ssd, caplog):
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 5)
    store.close()
    path = bucket_file(ssd, 0)
    footer_off = LOCATOR.unpack_from(path.read_bytes(), path.stat().st_size - 16)[0]
    flip(path, footer_off + 12)  # inside the first index entry
    before = path.read_bytes()

    store = stores(ssd, **SMALL)
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        records = store.recover()
    assert "footer invalid" in caplog.text
    assert {r.location for r in records} == set(written)
    assert path.read_bytes() == before  # a sealed bucket is never rewritten
    for location, (key, data) in written.items():
        assert read(store, location, key) == data


def test_sealed_bucket_with_corrupt_locator_is_scanned_and_resealed(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 5)
    store.close()
    path = bucket_file(ssd, 0)
    flip(path, path.stat().st_size - 10)

    store = stores(ssd, **SMALL)
    records = store.recover()
    assert {r.location for r in records} == set(written)
    raw = path.read_bytes()
    footer_off, magic, crc = LOCATOR.unpack_from(raw, len(raw) - 16)
    assert magic == b"KVTE" and crc == crc32c.crc32c(raw[-16:-4])
    assert store.open_bucket_id == 1


# --- a corrupt record header in the middle ----------------------------------------------------

HEADER_DAMAGE = {"bucket_size": 64 * ALIGN, "bucket_keys": 4}  # 4 records seal bucket 0
HEADER_SIZES = [3000, 3 * ALIGN + 100, 5000, 100]  # record 1 spans 4 pages: the probe skips 3


def fill_sizes(store: BucketStore, sizes: list[int]) -> dict[int, tuple[str, bytes]]:
    written = {}
    for i, size in enumerate(sizes):
        data = blob(i, size)
        written[put(store, f"k{i}", data)] = (f"k{i}", data)
    return written


def damage_key(store: BucketStore, directory: Path, location: int) -> Path:
    """Close the store and flip one byte of the record's key (inside its header, covered by the header CRC)."""
    plan = store.plan_read(location)
    path = bucket_file(directory, location >> 20)
    store.close()
    flip(path, plan.file_offset + plan.header_len - 1)
    return path


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed-bucket", "open-bucket"])
def test_corrupt_header_in_the_middle_drops_only_that_record(stores, ssd, sealed, caplog):
    kwargs = HEADER_DAMAGE if sealed else {}
    store = stores(ssd, **kwargs)
    store.recover()
    written = fill_sizes(store, HEADER_SIZES)
    store.sync()
    assert store.open_bucket_id == (1 if sealed else 0)
    victim = list(written)[1]
    path = damage_key(store, ssd, victim)
    before = path.read_bytes()

    store = stores(ssd, **kwargs)
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        records = store.recover()
    assert "stretch dropped" in caplog.text
    assert "footer invalid" not in caplog.text  # a sealed bucket's valid footer stays trusted
    assert "torn" not in caplog.text
    assert {r.location for r in records} == set(written) - {victim}
    assert path.read_bytes() == before  # nothing truncated or rewritten
    with pytest.raises(KeyError):
        store.plan_read(victim)
    for location, (key, data) in written.items():
        if location != victim:
            assert read(store, location, key) == data


def test_open_bucket_with_a_corrupt_header_takes_appends_that_survive_reopen_and_sealing(stores, ssd, caplog):
    store = stores(ssd)
    store.recover()
    written = fill_sizes(store, HEADER_SIZES)
    store.sync()
    victim = list(written)[1]
    path = damage_key(store, ssd, victim)

    store = stores(ssd)
    store.recover()
    later = put(store, "later", b"after the damage")
    assert later > max(written)  # appended after the last record, not over the damaged one
    store.sync()
    survivors = {loc: key for loc, (key, _) in written.items() if loc != victim} | {later: "later"}

    store, records = reopen(stores, store, ssd)
    assert {r.location: r.key for r in records} == survivors
    assert read(store, later, "later") == b"after the damage"

    # Sealed on recover (full at 5 records); its footer marks the dropped stretch and still tiles the file.
    store, records = reopen(stores, store, ssd, bucket_keys=5)
    assert store.open_bucket_id == 1
    assert LOCATOR.unpack_from(path.read_bytes(), path.stat().st_size - 16)[1] == b"KVTE"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        store, records = reopen(stores, store, ssd, bucket_keys=5)
    assert "footer invalid" not in caplog.text
    assert "stretch dropped" in caplog.text
    assert {r.location: r.key for r in records} == survivors
    for location, (key, data) in written.items():
        if location != victim:
            assert read(store, location, key) == data


def test_sealed_bucket_with_corrupt_footer_and_header_scans_past_the_header(stores, ssd, caplog):
    store = stores(ssd, **HEADER_DAMAGE)
    store.recover()
    written = fill_sizes(store, HEADER_SIZES)
    victim = list(written)[1]
    path = damage_key(store, ssd, victim)
    footer_off = LOCATOR.unpack_from(path.read_bytes(), path.stat().st_size - 16)[0]
    flip(path, footer_off + 12)
    before = path.read_bytes()

    store = stores(ssd, **HEADER_DAMAGE)
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        records = store.recover()
    assert "footer invalid" in caplog.text
    assert "stretch dropped" in caplog.text
    assert {r.location for r in records} == set(written) - {victim}
    assert path.read_bytes() == before


def test_header_probe_reads_headers_not_the_damaged_stretch(stores, ssd, monkeypatch):
    store = stores(ssd)
    store.recover()
    written = fill_sizes(store, [100, 256 * ALIGN, 100])  # a 1 MiB record whose header is damaged
    store.sync()
    victim = list(written)[1]
    damage_key(store, ssd, victim)
    reads: list[int] = []
    real_pread = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        reads.append(length)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", pread)
    store = stores(ssd)
    records = store.recover()
    monkeypatch.undo()
    assert {r.location for r in records} == set(written) - {victim}
    assert max(reads) <= ALIGN
    assert sum(reads) < 64 * ALIGN  # about 4 bytes per page of the stretch


def record_header(key: bytes, size: int, payload_crc: int, cluster: bytes = CLUSTER.encode()) -> bytes:
    """A record header with a valid header CRC, built from the documented format."""
    ns = b"ns"
    head = (
        bytearray(
            RECORD.pack(
                b"KVTR",
                1,
                0,
                RECORD_FIXED + len(ns) + len(key),
                len(ns),
                len(key),
                size,
                payload_crc,
                crc32c.crc32c(cluster),
                0,
            )
        )
        + ns
        + key
    )
    head[32:36] = struct.pack("<I", crc32c.crc32c(head))
    return bytes(head)


def _garbage_pages(path: Path, offset: int, plan: ReadPlan) -> None:
    os.truncate(path, offset)
    with open(path, "ab") as f:
        for _ in range(5):
            f.write(b"KVTR" + os.urandom(ALIGN - 4))


def _header_past_eof(path: Path, offset: int, plan: ReadPlan) -> None:
    """A bad header, then a valid-looking header whose payload would run past the end of the file."""
    flip(path, offset + plan.header_len - 1)
    with open(path, "r+b") as f:
        f.seek(offset + 2 * ALIGN)
        f.write(record_header(b"ghost", 1 << 20, 0) + b"x" * 100)


def _cut_mid_later_page(path: Path, offset: int, plan: ReadPlan) -> None:
    """A torn write that reached only a later page of the record: its header page is zeros."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(ALIGN))


@pytest.mark.parametrize("tear", [_garbage_pages, _header_past_eof, _cut_mid_later_page])
def test_torn_tail_without_a_valid_header_after_it_is_cut(stores, ssd, tear, caplog):
    store = stores(ssd)
    store.recover()
    written = fill_sizes(store, [3000, 5000, 3 * ALIGN])
    store.sync()
    torn = list(written)[-1]
    plan = store.plan_read(torn)
    path = bucket_file(ssd, 0)
    store.close()
    tear(path, plan.file_offset, plan)

    store = stores(ssd)
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        records = store.recover()
    assert "torn bucket tail truncated" in caplog.text
    assert {r.location for r in records} == set(written) - {torn}
    assert path.stat().st_size == plan.file_offset
    later = put(store, "later", b"after the tear")
    assert later == torn
    store.sync()
    store, records = reopen(stores, store, ssd)
    assert {r.location for r in records} == (set(written) - {torn}) | {later}


def test_buckets_of_other_clusters_and_formats_are_ignored_untouched(stores, ssd):
    other = stores(ssd, cluster="other")
    other.recover()
    put(other, "theirs", b"not ours")
    other.close()
    bucket_file(ssd, 5).write_bytes(bucket_header(5, CLUSTER.encode(), version=2) + b"future format")
    bad_crc = bytearray(bucket_header(6, CLUSTER.encode()))
    bad_crc[10] ^= 1
    bucket_file(ssd, 7).write_bytes(bytes(bad_crc))
    bucket_file(ssd, 8).write_bytes(b"KVTB")  # shorter than a header
    bucket_file(ssd, 9).write_bytes(bucket_header(3, CLUSTER.encode()))  # names another bucket
    bucket_file(ssd, 1 << 28).write_bytes(bucket_header(1 << 28, CLUSTER.encode()))  # no location fits
    before = snapshot(ssd)

    store = stores(ssd)
    assert store.recover() == []
    assert store.records() == []
    assert store.open_bucket_id == 10
    assert store.used == ALIGN  # only our new bucket's header
    after = snapshot(ssd)
    assert {name: after[name] for name in before} == before
    location = put(store, "ours", b"data")
    assert read(store, location, "ours") == b"data"


def test_a_bucket_header_built_from_the_documentation_is_accepted(stores, ssd):
    ssd.mkdir()
    bucket_file(ssd, 4).write_bytes(bucket_header(4, CLUSTER.encode()))
    store = stores(ssd)
    assert store.recover() == []
    assert store.open_bucket_id == 4
    assert read(store, put(store, "k", b"v"), "k") == b"v"


# --- tombstones ------------------------------------------------------------------------------


def test_tombstone_hides_record_now_and_after_reopen(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 5)
    dead = list(written)[1]  # in the sealed bucket 0; the tombstone lands in bucket 1
    store.tombstone(dead)
    with pytest.raises(KeyError):
        store.plan_read(dead)
    size = sum(p.stat().st_size for p in ssd.iterdir())
    store.tombstone(dead)  # already dead: ignored
    store.tombstone(12345 << 20)  # unknown: ignored
    assert sum(p.stat().st_size for p in ssd.iterdir()) == size
    store.sync()
    store, records = reopen(stores, store, ssd, **SMALL)
    assert {r.location for r in records} == set(written) - {dead}


def test_tombstone_many_writes_one_record_for_all_locations(stores, ssd):
    store = stores(ssd)
    store.recover()
    written = fill(store, 5)
    dead = list(written)[1:4]
    used = store.used
    size = bucket_file(ssd, 0).stat().st_size
    store.tombstone_many(iter(dead))
    assert store.used == used + 2 * ALIGN  # one record (a page, not three), and its copy
    assert bucket_file(ssd, 0).stat().st_size == _aligned(size) + ALIGN + 36 + 3 * 8
    for location in dead:
        with pytest.raises(KeyError):
            store.plan_read(location)
    assert {r.location for r in store.records()} == set(written) - set(dead)
    store.sync()
    store, records = reopen(stores, store, ssd)
    assert {r.location for r in records} == set(written) - set(dead)


def test_tombstone_many_ignores_unknown_and_dead_locations(stores, ssd):
    one_bucket = {"bucket_keys": 10}  # 5 records and two tombstones (each written twice): no seal between
    store = stores(ssd, **one_bucket)
    store.recover()
    written = fill(store, 5)
    first, second = list(written)[:2]
    store.tombstone(first)
    used, files = store.used, snapshot(ssd)
    store.tombstone_many([first, 12345 << 20, first + 7])  # dead, unknown bucket, unknown record
    store.tombstone_many([])
    assert (store.used, snapshot(ssd)) == (used, files)
    store.tombstone_many([first, second, second, 12345 << 20])  # one record with only `second` (and its copy)
    assert store.used == used + 2 * ALIGN
    store.sync()
    store, records = reopen(stores, store, ssd, **one_bucket)
    assert {r.location for r in records} == set(written) - {first, second}


def test_a_forget_tombstones_only_the_object_it_names(stores, ssd):
    """A FORGET for a location's previous life (its bucket deleted, the id taken again after a
    restart) must not kill the record written there since."""
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 3)
    first, second, third = list(written)
    ns = store.records()[0].namespace
    other = store.tombstone_named([(first, ns, "k0"), (second, ns, "someone-else"), (third, "other-ns", "k2")])
    assert other == 2
    assert {r.location for r in store.records()} == {second, third}
    assert store.tombstone_named([(first, ns, "k0"), (12345 << 20, ns, "k9")]) == 0  # dead, unknown: ignored


def test_a_record_withdrawn_without_its_tombstone_is_still_tombstoned_by_a_forget(stores, ssd):
    """`withdraw` after a tombstone that failed (a disk error): the record is on disk and a restart
    would recover it, so a later FORGET of it still writes its tombstone."""
    store = stores(ssd, **SMALL)
    store.recover()
    first, second = list(fill(store, 2))
    ns = store.records()[0].namespace
    store.withdraw([first])
    assert {r.location for r in store.records()} == {second}
    assert store.tombstone_named([(first, ns, "k0")]) == 0
    store.sync()
    store, records = reopen(stores, store, ssd, **SMALL)
    assert {r.location for r in records} == {second}


def test_a_tombstone_whose_sync_failed_is_written_again_by_a_retried_forget(stores, ssd, monkeypatch):
    """The failed pages may hold the tombstone, and a later fdatasync that succeeds proves nothing
    (the kernel reports a writeback error once): the retried FORGET must append another."""
    store = stores(ssd, **SMALL)
    store.recover()
    (first,) = fill(store, 1)
    ns = store.records()[0].namespace
    store.sync()
    real = os.fdatasync
    fail = [True]

    def fdatasync(fd: int) -> None:
        if fail.pop() if fail else False:
            raise OSError(errno.EIO, "failed writeback")
        real(fd)

    monkeypatch.setattr(buckets.os, "fdatasync", fdatasync)
    assert store.tombstone_named([(first, ns, "k0")]) == 0
    with pytest.raises(OSError):
        store.sync()
    used = store.used
    assert store.tombstone_named([(first, ns, "k0")]) == 0
    assert store.used > used, "the retry wrote no tombstone"
    store.sync()
    used = store.used
    store.tombstone_named([(first, ns, "k0")])  # durable now: nothing more to write
    assert store.used == used


def test_tombstone_many_past_the_per_record_cap_writes_several_records(stores, ssd, monkeypatch):
    assert bucket_format._MAX_TOMBSTONE_TARGETS * 8 == 64 << 10
    monkeypatch.setattr(buckets, "_MAX_TOMBSTONE_TARGETS", 3)
    store = stores(ssd)
    store.recover()
    written = fill(store, 10, size=10)
    dead = list(written)[:8]
    used = store.used
    store.tombstone_many(dead)
    assert store.used == used + 6 * ALIGN  # 3 + 3 + 2 locations, each record twice
    store.sync()
    store, records = reopen(stores, store, ssd)
    assert {r.location for r in records} == set(written) - set(dead)


@pytest.mark.parametrize("sealed", [False, True])
def test_tombstone_with_a_payload_not_a_multiple_of_8_is_invalid(stores, ssd, sealed, caplog):
    kwargs = {"bucket_keys": 3} if sealed else {}
    store = stores(ssd, **kwargs)
    store.recover()
    written = fill(store, 3, size=10)
    first, victim, last = written
    # Overwrite the middle record (one page) with a tombstone of 12 bytes naming the first record.
    payload = struct.pack("<Q", first) + b"\xff" * 4
    head = bytearray(RECORD.pack(b"KVTR", 1, 1, RECORD_FIXED, 0, 0, 12, crc32c.crc32c(payload), 0, 0))
    struct.pack_into("<I", head, 28, crc32c.crc32c(CLUSTER.encode()))
    struct.pack_into("<I", head, 32, crc32c.crc32c(head))
    page = (bytes(head) + payload).ljust(ALIGN, b"\0")
    with open(bucket_file(ssd, 0), "r+b") as f:
        f.seek((victim & 0xFFFFF) * ALIGN)
        f.write(page)
    store.close()
    with caplog.at_level(logging.WARNING):
        store, records = reopen(stores, store, ssd, **kwargs)
    assert "tombstone payload of 12 bytes" in caplog.text
    assert {r.location for r in records} == {first, last}
    assert read(store, first, written[first][0]) == written[first][1]
    assert read(store, last, written[last][0]) == written[last][1]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def test_deleting_a_bucket_holding_a_tombstone_keeps_its_target_dead(stores, ssd):
    store = stores(ssd, bucket_keys=1)  # one record per bucket
    store.recover()
    target = put(store, "a", b"a")  # bucket 0
    keep = put(store, "b", b"b")  # bucket 1
    store.tombstone(target)  # bucket 2, sealed at once, and its copy: bucket 3
    assert store.open_bucket_id == 4
    store.delete_buckets([2, 3])
    store, records = reopen(stores, store, ssd, bucket_keys=1)
    assert [r.location for r in records] == [keep]


def test_deleting_buckets_carries_their_tombstones_in_one_record(stores, ssd):
    store = stores(ssd, bucket_keys=2)
    store.recover()
    targets = [put(store, f"t{i}", b"t") for i in range(4)]  # buckets 0 and 1
    store.tombstone(targets[0])  # bucket 2: the record and its copy, sealed
    store.tombstone_many(targets[1:3])  # bucket 3, likewise
    store.tombstone(targets[3])  # bucket 4, likewise
    keep = put(store, "keep", b"k")  # bucket 5
    assert store.open_bucket_id == 5 and keep >> 20 == 5
    store.delete_buckets([2, 3, 4])
    assert bucket_ids(ssd) == [0, 1, 5, 6]  # the carried record beside `keep`, its copy in a new bucket
    carried = struct.pack("<4Q", *targets)  # the four carried tombstones in one record
    assert bucket_file(ssd, 5).read_bytes()[2 * ALIGN + 36 :][: len(carried)] == carried
    assert bucket_file(ssd, 6).read_bytes()[ALIGN + 36 :][: len(carried)] == carried
    store, records = reopen(stores, store, ssd, bucket_keys=2)
    assert [r.key for r in records] == ["keep"]


# --- capacity, eviction, deletion, pins ------------------------------------------------------


def test_eviction_takes_the_buckets_with_the_least_live_data_first_and_the_oldest_among_equals(stores, ssd):
    """Append-only buckets fill with dead records under overwrites and removals. Deleting the oldest
    bucket first threw away the live records in it while newer buckets held only dead ones (an
    adversarial overwrite burst lost 174-267 disk copies with the tier under half full of live data):
    a bucket whose records are all dead costs nothing to delete. Equally live buckets (within a
    sixteenth of a bucket) still go oldest first."""
    capacity = 10 * 5 * ALIGN
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    written = {}
    while store.used <= 0.95 * capacity:
        written.update(fill(store, 1, size=3000))
    sealed = [b for b in bucket_ids(ssd) if b != store.open_bucket_id]
    assert len(sealed) >= 4
    dead = sealed[2]  # a newer bucket than the two oldest: everything in it removed since
    store.tombstone_many(loc for loc in written if loc >> 20 == dead)
    store.sync()
    live = collections.Counter(r.location >> 20 for r in store.records())
    candidates = store.eviction_candidates()
    assert candidates[0] == (dead, []), candidates  # nothing live goes with it
    chosen = {bucket_id for bucket_id, _ in candidates}
    kept = [b for b in bucket_ids(ssd) if b not in chosen and b != store.open_bucket_id]
    assert max(live[b] for b in chosen) <= min(live[b] for b in kept), (candidates, live)
    store.delete_buckets([bucket_id for bucket_id, _ in candidates])
    assert store.used <= 0.85 * capacity
    assert {r.location for r in store.records()} == {
        loc for loc in written if (loc >> 20) not in {bucket_id for bucket_id, _ in candidates}
    } - {loc for loc in written if loc >> 20 == dead}
    # (equally live buckets go oldest first: the test below)


def test_eviction_candidates_are_oldest_sealed_buckets_down_to_low_watermark(stores, ssd):
    capacity = 10 * 5 * ALIGN
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    written = {}
    while store.used <= 0.95 * capacity:
        assert store.eviction_candidates() == []
        written.update(fill(store, 1, size=3000))  # keys repeat; locations do not
    sizes = {i: -(-bucket_file(ssd, i).stat().st_size // ALIGN) * ALIGN for i in bucket_ids(ssd)}
    assert store.used == sum(sizes.values())

    expected, used = [], store.used
    for bucket_id in sorted(sizes)[:-1]:
        if used <= 0.85 * capacity:
            break
        expected.append(bucket_id)
        used -= sizes[bucket_id]
    candidates = store.eviction_candidates()
    assert [bucket_id for bucket_id, _ in candidates] == expected == [0, 1]
    for bucket_id, locations in candidates:
        assert sorted(locations) == sorted(loc for loc in written if loc >> 20 == bucket_id)
    assert store.open_bucket_id not in expected

    store.delete_buckets(expected)
    assert store.used == used <= 0.85 * capacity
    assert store.eviction_candidates() == []
    for bucket_id, locations in candidates:
        assert not bucket_file(ssd, bucket_id).exists()
        for location in locations:
            with pytest.raises(KeyError):
                store.plan_read(location)
    survivors = {loc for loc in written if loc >> 20 not in expected}
    assert {r.location for r in store.records()} == survivors
    store, records = reopen(stores, store, ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    assert {r.location for r in records} == survivors


def test_open_bucket_cannot_be_deleted(stores, ssd):
    store = stores(ssd)
    store.recover()
    location = put(store, "k", b"v")
    with pytest.raises(ValueError, match="open bucket"):
        store.delete_buckets([store.open_bucket_id])
    assert read(store, location, "k") == b"v"


def test_pinned_bucket_is_unlinked_at_the_last_unpin(stores, ssd):
    store = stores(ssd, **SMALL)
    store.recover()
    written = fill(store, 4)
    location = list(written)[0]
    first, second = store.pin(location), store.pin(location)
    store.delete_buckets([0])
    path = bucket_file(ssd, 0)
    assert path.exists()
    with pytest.raises(KeyError):
        store.plan_read(location)
    with pytest.raises(KeyError):
        store.pin(location)
    assert store.bucket_count == 1
    store.unpin(first)
    assert path.exists()
    buf = os.pread(second.fd, second.read_length, second.file_offset)  # the fd still reads
    assert bytes(BucketStore.payload_of(memoryview(buf), second, "ns", "k0")) == written[location][1]
    store.unpin(second)
    assert not path.exists()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(second.fd)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(second)


def test_disk_full_leaves_the_store_usable(stores, ssd):
    capacity = 8 * ALIGN
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    written = {}
    with pytest.raises(DiskFull) as raised:
        for i in range(100):
            data = blob(i, 3000)
            written[put(store, f"k{i}", data)] = (f"k{i}", data)
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert store.used + ALIGN > capacity
    assert {r.location for r in store.records()} == set(written)
    for location, (key, data) in written.items():
        assert read(store, location, key) == data

    (bucket_id, locations), *_ = store.eviction_candidates()
    store.delete_buckets([bucket_id])
    after = put(store, "after", b"room again")
    store.sync()
    store, records = reopen(stores, store, ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    assert {r.location for r in records} == (set(written) - set(locations)) | {after}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_size": (4 << 30) + ALIGN}, "4 GiB"),
        ({"bucket_size": 1 << 33}, "4 GiB"),
        ({"bucket_size": ALIGN}, "bucket_size"),
        ({"capacity": ALIGN}, "capacity"),
        ({"bucket_keys": 0}, "bucket_keys"),
        ({"low_watermark": 0.96}, "watermark"),
        ({"high_watermark": 1.5}, "watermark"),
        ({"cluster_id": "x" * 65}, "cluster_id"),
    ],
)
def test_constructor_rejects_bad_settings(ssd, kwargs, message):
    args = {"capacity": 64 << 30, "cluster_id": CLUSTER, **kwargs}
    with pytest.raises(ValueError, match=message):
        BucketStore(ssd, args.pop("capacity"), args.pop("cluster_id"), **args)


def test_largest_bucket_size_is_accepted(stores, ssd):
    store = stores(ssd, capacity=16 << 30, bucket_size=4 << 30)
    store.recover()
    location = put(store, "k", blob(1, 5000))
    assert location >> 20 == store.open_bucket_id  # the record went into the (4 GiB) open bucket
    assert read(store, location, "k") == blob(1, 5000)
    with pytest.raises(ValueError, match="bucket_size"):
        BucketStore(ssd, 16 << 30, CLUSTER, bucket_size=(4 << 30) + ALIGN)


def test_open_bucket_filling_the_capacity_is_never_an_eviction_candidate(stores, ssd):
    store = stores(ssd, capacity=8 * ALIGN)  # default bucket_size 256 MiB: the bucket never seals
    store.recover()
    written = {}
    with pytest.raises(DiskFull):
        for i in range(10):
            written[put(store, f"k{i}", blob(i, 3000))] = i
    assert len(written) == 7 and store.used == 8 * ALIGN
    assert store.eviction_candidates() == []
    assert read(store, max(written), "k6") == blob(6, 3000)


def test_calls_before_recover_are_refused(stores, ssd):
    store = stores(ssd)
    with pytest.raises(RuntimeError, match="recover"):
        put(store, "k", b"v")
    store.recover()
    with pytest.raises(RuntimeError, match="once"):
        store.recover()


# --- direct I/O ------------------------------------------------------------------------------


def _direct_read(store: BucketStore, location: int, key: str) -> bytes:
    """Read into page-aligned memory, as O_DIRECT requires."""
    plan = store.plan_read(location)
    buf = mmap.mmap(-1, plan.read_length)
    try:
        got = os.preadv(plan.fd, [buf], plan.file_offset)
        with memoryview(buf) as view:
            return bytes(BucketStore.payload_of(view[:got], plan, "ns", key))
    finally:
        buf.close()


def test_direct_io_plans_read_with_aligned_buffers(stores, ssd):
    store = stores(ssd, direct_io=True, **SMALL)
    store.recover()
    written = fill(store, 5)
    for location, (key, data) in written.items():
        assert _direct_read(store, location, key) == data
    flags = fcntl.fcntl(store.plan_read(list(written)[0]).fd, fcntl.F_GETFL)
    assert flags & os.O_ACCMODE == os.O_RDONLY
    assert bool(flags & os.O_DIRECT) == accepts_o_direct(ssd)


def accepts_o_direct(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.open fails with EINVAL for O_DIRECT, as tmpfs before 6.6 and some FUSE file systems do.

    Forced on any kernel: since 6.6 tmpfs accepts O_DIRECT, so no local file system is left that
    reliably refuses it. Only the libc call is replaced; BucketStore runs unchanged. Returns the
    paths refused."""
    real_open, refused = os.open, []

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(str(path))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    return refused


def test_direct_io_falls_back_to_buffered_when_o_direct_is_refused(stores, ssd, refuse_o_direct, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.segment_server.buckets"):
        store = stores(ssd, direct_io=True, **SMALL)
        store.recover()
        written = fill(store, 5)
        store.close()
        assert len(refuse_o_direct) == 1  # asked once, then the store stops asking
        store = stores(ssd, direct_io=True, **SMALL)
        store.recover()
        for location, (key, data) in written.items():
            assert _direct_read(store, location, key) == data
            assert fcntl.fcntl(store.plan_read(location).fd, fcntl.F_GETFL) & os.O_DIRECT == 0
    assert caplog.text.count("O_DIRECT not supported") == 2  # once per store
    assert len(refuse_o_direct) == 2
    location = put(store, "k", b"buffered")
    assert _direct_read(store, location, "k") == b"buffered"


def test_direct_io_open_errors_other_than_einval_are_raised(stores, ssd, monkeypatch):
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    store = stores(ssd, direct_io=True, **SMALL)
    store.recover()
    written = fill(store, 2)
    monkeypatch.setattr(os, "open", open_)
    store.close()
    store = stores(ssd, direct_io=True, **SMALL)
    with pytest.raises(OSError) as info:
        store.recover()
        for location in written:
            store.plan_read(location)
    assert info.value.errno == errno.EACCES


# --- property --------------------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 9000)),
        st.tuples(st.just("tombstone"), st.integers(0, 1000)),
        st.tuples(st.just("delete"), st.integers(0, 1000)),
        st.tuples(st.just("reopen"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=30, deadline=None)
@given(_ops)
def test_random_histories_recover_to_the_model(ops):
    """Appends, tombstones, out-of-order bucket deletes and restarts: recover() always equals the model."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        store = BucketStore(directory, 64 << 20, CLUSTER, **SMALL)
        try:
            assert store.recover() == []
            model: dict[int, tuple[str, bytes]] = {}
            for step, (op, arg) in enumerate(ops):
                if op == "put":
                    data = blob(step, arg)
                    model[put(store, f"k{step}", data)] = (f"k{step}", data)
                elif op == "tombstone" and model:
                    location = sorted(model)[arg % len(model)]
                    store.tombstone(location)
                    del model[location]
                elif op == "delete":
                    sealed = [i for i in bucket_ids(directory) if i != store.open_bucket_id]
                    if sealed:
                        victim = sealed[arg % len(sealed)]
                        store.delete_buckets([victim])
                        model = {loc: v for loc, v in model.items() if loc >> 20 != victim}
                elif op == "reopen":
                    store.sync()
                    store.close()
                    store = BucketStore(directory, 64 << 20, CLUSTER, **SMALL)
                    assert {r.location: r.key for r in store.recover()} == {loc: k for loc, (k, _) in model.items()}
                assert {r.location for r in store.records()} == set(model)
            for location, (key, data) in model.items():
                assert read(store, location, key) == data
        finally:
            store.close()


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 2 MiB tmpfs: a file system that really runs out of room."""
    import subprocess

    from tests.capability import require

    path = tmp_path / "tiny"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "kvtier-unit", str(path)], capture_output=True)
    require("root", done.returncode == 0, f"mount -t tmpfs: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_the_reserve_lets_tombstones_and_recovery_write_on_a_full_file_system(stores, tiny_fs):
    capacity = 4 << 20  # more than the file system holds: it, not the store, runs out
    kwargs = {"bucket_size": 64 * ALIGN, "bucket_keys": 1000}
    store = stores(tiny_fs, capacity=capacity, **kwargs)
    store.recover()
    reserve = tiny_fs / bucket_format.RESERVE_NAME
    # taken at recovery: at most 1/8 of the tier and 1/4 of its file system (2 MiB here)
    assert reserve.stat().st_size == min(capacity // 8, (2 << 20) // 4)
    assert store.used < capacity // 8, "and not counted as the tier's use"
    written = []
    with pytest.raises(DiskFull):
        for i in range(1000):
            written.append(put(store, f"k{i}", blob(i, 60_000)))
    store.sync()
    with open(tiny_fs / "filler", "wb", buffering=0) as f:  # not one free page left
        with pytest.raises(OSError):
            while f.write(b"\0" * ALIGN):
                pass
    # a removal on the full file system still gets its tombstone, from the reserve's space
    store.tombstone_many(written[:1])
    store.sync()
    assert not reserve.exists()
    # and a restart on it recovers (it may have to open a new bucket) without the removed record
    store, records = reopen(stores, store, tiny_fs, capacity=capacity, **kwargs)
    assert {r.location for r in records} == set(written[1:])
    # once buckets are deleted there is room for the reserve again
    store.delete_buckets([bucket_id for bucket_id, _ in store.eviction_candidates()[:3]] or [written[1] >> 20])
    assert reserve.exists()


def test_a_record_refused_for_room_below_the_high_watermark_frees_buckets(stores, ssd):
    """A record larger than the room left below the high watermark (5% of the tier) was refused with
    DiskFull, and no bucket was ever deleted (the tier was not above its watermark): every later
    offload refused for good."""
    capacity = 20 * ALIGN
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    while store.used + 2 * ALIGN <= capacity:
        fill(store, 1, size=ALIGN)
    assert store.used <= 0.95 * capacity and store.eviction_candidates() == []
    with pytest.raises(DiskFull):
        store.append("ns", "big", blob(1, 3 * ALIGN), crc32c.crc32c(blob(1, 3 * ALIGN)))
    candidates = store.eviction_candidates()
    assert candidates, "the refusal must free room"
    store.delete_buckets([bucket_id for bucket_id, _ in candidates])
    big = blob(1, 3 * ALIGN)
    location = store.append("ns", "big", big, crc32c.crc32c(big))
    assert location and store.eviction_candidates() == []


def test_a_file_system_smaller_than_the_tier_is_its_ceiling(stores, ssd, monkeypatch):
    """With --ssd-size above what the file system holds, writes failed ENOSPC far below the
    watermarks and nothing was deleted. The watermarks apply to what the file system has room for."""
    store = stores(ssd, capacity=1 << 30, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    fill(store, 12, size=ALIGN)
    assert store.eviction_candidates() == []
    real = os.statvfs

    def no_room_left(path):
        got = real(path)
        return os.statvfs_result((got.f_bsize, got.f_frsize, got.f_blocks, 0, 0, *tuple(got)[5:]))

    monkeypatch.setattr(os, "statvfs", no_room_left)  # the file system is full: used is all it holds
    before = store.used
    candidates = store.eviction_candidates()
    assert candidates
    store.delete_buckets([bucket_id for bucket_id, _ in candidates])
    assert store.used <= 0.85 * before


def test_a_record_that_can_never_fit_asks_for_no_room(stores, ssd):
    """A record larger than the tier had every sealed bucket deleted for it, and still did not fit
    (the review of the refused-record change found it): the segment also no longer offers the master
    objects over a quarter of its tier."""
    capacity = 20 * ALIGN
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    while store.used + 6 * ALIGN <= capacity:  # below every watermark
        fill(store, 1, size=ALIGN)
    huge = blob(1, 30 * ALIGN)
    with pytest.raises(DiskFull):
        store.append("ns", "huge", huge, crc32c.crc32c(huge))
    assert store.eviction_candidates() == []


def test_a_record_that_fits_the_tier_but_not_its_file_system_asks_for_no_room(stores, ssd, monkeypatch):
    capacity = 1 << 30
    store = stores(ssd, capacity=capacity, bucket_size=4 * ALIGN, bucket_keys=1000)
    store.recover()
    fill(store, 12, size=ALIGN)
    real = os.statvfs
    free = 8 * ALIGN

    def a_small_file_system(path):
        got = real(path)
        blocks = free // got.f_frsize
        return os.statvfs_result((got.f_bsize, got.f_frsize, got.f_blocks, blocks, blocks, *tuple(got)[5:]))

    monkeypatch.setattr(os, "statvfs", a_small_file_system)
    store._want_room(store.used + free + 10 * ALIGN)  # what a refused record larger than it all would ask
    before = store.used
    candidates = store.eviction_candidates()
    store.delete_buckets([bucket_id for bucket_id, _ in candidates])
    assert store.used >= before // 2, "most of the tier deleted for a record that could not fit anyway"


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("damaged", [0, 1])
def test_a_damaged_page_of_a_tombstone_brings_no_removed_object_back(stores, ssd, sealed, damaged):
    """After a master restart a tombstone is the only record of an acknowledged removal. One flipped bit
    in its header (recovery drops the stretch, or cuts it as a torn tail) brought every object it
    named back (the tester: 5 of 5 removed keys read again). It is written twice, a page each."""
    kwargs = {"bucket_keys": 8} if sealed else {}  # 6 objects and the tombstone twice: sealed, a footer
    store = stores(ssd, **kwargs)
    store.recover()
    written = fill(store, 6)
    dead = list(written)[1:4]
    store.tombstone_many(dead)
    store.sync()
    raw = bucket_file(ssd, 0).read_bytes()
    tombstones = [o for o in range(ALIGN, len(raw), ALIGN) if raw[o : o + 4] + raw[o + 6 : o + 8] == b"KVTR\1\0"]
    assert len(tombstones) == 2 and store.bucket_count == (2 if sealed else 1)
    store.close()
    with open(bucket_file(ssd, 0), "r+b") as f:  # one bit of the size field of one copy
        f.seek(tombstones[damaged] + 20)
        byte = f.read(1)
        f.seek(tombstones[damaged] + 20)
        f.write(bytes([byte[0] ^ 0x10]))
    store, records = reopen(stores, store, ssd, **kwargs)
    assert {r.location for r in records} == set(written) - set(dead)
    assert store.tombstones_unreadable == (1 if sealed else 0)  # known from the footer only
