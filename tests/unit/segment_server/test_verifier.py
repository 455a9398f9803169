"""The background payload verifier on real bucket files: what it finds, its order, and its pace."""

from __future__ import annotations

import random
from pathlib import Path

import crc32c
import pytest

from kvtier.segment_server.bucket_format import ALIGN
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.verifier import Throttle, Verifier

CLUSTER = "test-cluster"


@pytest.fixture
def store_at(tmp_path: Path):
    opened: list[BucketStore] = []

    def open_store(**kwargs) -> BucketStore:
        # O_DIRECT reads (the segment's default) where the file system allows: aligned buffers, short reads at EOF
        store = BucketStore(
            tmp_path / "ssd", 1 << 30, CLUSTER, bucket_size=kwargs.pop("bucket_size", 1 << 20), direct_io=True
        )
        opened.append(store)
        store.recover()
        return store

    yield open_store
    for store in opened:
        store.close()


def fill(store: BucketStore, sizes: list[int]) -> list[int]:
    locations = []
    for i, size in enumerate(sizes):
        data = random.Random(i).randbytes(size)
        locations.append(store.append("ns", f"k{i}", data, crc32c.crc32c(data)))
    store.sync()
    return locations


def damage(store: BucketStore, location: int, at: int) -> None:
    """Flip one byte `at` bytes into the record's payload (the store is closed by the caller first)."""
    plan = store.plan_read(location)
    path = Path(store._buckets[location >> 20].path)  # the test knows the layout; the store stays closed
    with open(path, "r+b") as f:
        f.seek(plan.file_offset + plan.header_len + at)
        byte = f.read(1)
        f.seek(plan.file_offset + plan.header_len + at)
        f.write(bytes([byte[0] ^ 0x5A]))


def drain(verifier: Verifier) -> None:
    while verifier.run_once():
        pass


def test_every_record_found_at_mount_is_verified_once_and_corrupt_ones_are_dropped(store_at):
    store = store_at()
    locations = fill(store, [3000, 300_000, 5, 900_000, 70_000, 1])  # several buckets, sizes across chunks
    victims = {locations[1]: 299_999, locations[3]: 0}  # last payload byte; first payload byte
    for location, at in victims.items():
        damage(store, location, at)
    store.close()

    store = store_at()
    assert len(store.records()) == len(locations)  # the mount read no payload
    backlog = store.unverified_bytes
    verifier = Verifier(store, rate=0, chunk=64 * 1024)  # chunks smaller than the records
    drain(verifier)
    assert verifier.corrupt == 2
    assert verifier.verified == len(locations) - 2
    assert verifier.verified_bytes == backlog - 300_000 - 900_000
    assert store.unverified_bytes == 0
    verifier.apply(stub=None, segment_id=0)
    assert {r.location for r in store.records()} == set(locations) - set(victims)
    assert not verifier.run_once()  # nothing left: appended records never need it
    store.close()
    store = store_at()
    assert {r.location for r in store.records()} == set(locations) - set(victims)  # the tombstones are durable


def test_a_record_tombstoned_before_its_turn_is_skipped(store_at):
    store = store_at()
    locations = fill(store, [4000] * 4)
    store.close()
    store = store_at()
    verifier = Verifier(store, rate=0)
    store.tombstone(locations[0])
    drain(verifier)
    assert (verifier.verified, verifier.corrupt) == (3, 0)


def test_a_record_whose_bucket_is_deleted_before_its_turn_is_skipped(store_at):
    store = store_at(bucket_size=64 * 1024)
    fill(store, [20_000] * 8)
    store.close()
    store = store_at(bucket_size=64 * 1024)
    verifier = Verifier(store, rate=0)
    oldest = store.records()[0]
    store.delete_buckets([oldest.location >> 20])
    assert verifier.check(oldest) == ""  # gone: neither good nor corrupt
    drain(verifier)
    assert verifier.corrupt == 0
    assert verifier.verified == len(store.records())


def test_throttle_bounds_the_bytes_started_by_any_time():
    now = [0.0]
    throttle = Throttle(rate=1000.0, clock=lambda: now[0])
    started = 0
    for step in range(200):
        wait = throttle.delay(100)
        assert wait >= 0
        now[0] += wait
        started += 100
        assert started <= 1000.0 * now[0] + 100 + 1e-6  # one read ahead of the rate, never more
        if step % 50 == 49:
            now[0] += 5.0  # idle time is not saved up for a burst
            assert throttle.delay(100) == 0
            started += 100
            before = now[0]
            now[0] += throttle.delay(100)
            started += 100
            assert now[0] - before == pytest.approx(0.1)


def test_the_verifier_reads_at_its_rate(store_at):
    """Sleeping on an injected clock: verifying N bytes takes N / rate seconds, within one chunk."""
    store = store_at()
    fill(store, [200_000] * 10)
    store.close()
    store = store_at()
    now = [0.0]
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        now[0] += seconds
        return False

    rate, chunk = 1 << 20, 64 * 1024
    verifier = Verifier(store, rate=rate, chunk=chunk, clock=lambda: now[0], wait=wait)
    drain(verifier)
    assert verifier.verified == 10
    per_record = _align(36 + len("ns") + len("k0") + 200_000)  # header + payload, rounded up to pages
    total = 10 * per_record
    assert (total - chunk) / rate <= now[0] <= total / rate
    assert max(waits) <= chunk / rate + 1e-9


def test_a_stopping_verifier_leaves_the_record_unverified(store_at):
    store = store_at()
    fill(store, [100_000] * 2)
    store.close()
    store = store_at()
    verifier = Verifier(store, rate=1, chunk=ALIGN, wait=lambda seconds: True)  # asked to stop while waiting
    record = store.next_unverified()
    assert not verifier.run_once()
    assert store.next_unverified() == record
    assert (verifier.verified, verifier.corrupt) == (0, 0)


def test_rate_and_chunk_are_checked():
    with pytest.raises(ValueError):
        Throttle(0)
    with pytest.raises(ValueError):
        Verifier(None, rate=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Verifier(None, rate=1, chunk=1000)  # type: ignore[arg-type]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
