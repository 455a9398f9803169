"""The master's packed object record (kvtier.master.records): every field reads back as written,
and ten million of them fit the issue 19 budget."""

from __future__ import annotations

import math
import tracemalloc

import pytest

from kvtier.master.quotas import Owner
from kvtier.master.records import (
    MAX_SEGMENT_CAPACITY,
    READS_CAP,
    TIER_SSD,
    ObjectRecord,
    ObjectState,
    object_name,
    replica,
)
from kvtier.proto.chunks import CHUNK_BYTES


def test_fields_read_back_through_every_change():
    a, b = replica(3, 4096), replica(7, 1 << 47, TIER_SSD)
    record = ObjectRecord(object_name("ns", "k"), MAX_SEGMENT_CAPACITY, (a,), 9, 12.5, None, 0.0)
    top = MAX_SEGMENT_CAPACITY
    assert (record.size, record.checksum, record.state, record.reads) == (top, 0, ObjectState.PENDING, 0)
    assert (record.replicas, record.put_id, record.started_at, record.pin_until) == ((a,), 9, 12.5, 0.0)
    record.complete(0xFFFF_FFFF)
    assert (record.checksum, record.state, record.size) == (0xFFFF_FFFF, ObjectState.COMPLETE, MAX_SEGMENT_CAPACITY)
    assert record.meta == MAX_SEGMENT_CAPACITY << 32 | 0xFFFF_FFFF
    for replicas in [(a, b), (), (b,), (b, a, replica(1, 0))]:  # one replica is packed, others a tuple
        record.replicas = replicas
        assert record.replicas == replicas
        assert (record.size, record.checksum, record.state) == (MAX_SEGMENT_CAPACITY, 0xFFFF_FFFF, ObjectState.COMPLETE)
    for _ in range(READS_CAP + 3):
        record.count_read()
    assert record.reads == READS_CAP, "saturates"
    record.reads = 5
    record.state = ObjectState.PENDING
    assert (record.reads, record.state, record.checksum, record.replicas[0]) == (5, ObjectState.PENDING, 0xFFFF_FFFF, b)
    record.pin_until = math.inf
    assert record.pin == 2 and record.name == "ns\x00k" and (record.namespace, record.key) == ("ns", "k")


def test_a_batch_shares_its_values_until_one_record_changes_them():
    owner, other = Owner("eng", 0), Owner("eng", 0)  # equal fields, distinct quota owners
    first = ObjectRecord("ns\x00a", 64, (replica(1, 0),), 5, 1.0, owner, 2.0)
    second = ObjectRecord("ns\x00b", 64, (replica(1, 64),), 5, 1.0, owner, 2.0)
    assert first._b is second._b
    second.pin_until = 2.0  # unchanged: still shared
    assert first._b is second._b
    second.owner = other
    assert first.owner is owner and second.owner is other
    second.pin_until, second.put_id, second.started_at = 0.0, 6, 3.0
    assert (first.pin_until, first.put_id, first.started_at) == (2.0, 5, 1.0)
    assert (second.pin_until, second.put_id, second.started_at) == (0.0, 6, 3.0)


def test_a_size_the_record_cannot_hold_is_refused():
    with pytest.raises(ValueError):
        ObjectRecord("ns\x00a", 1 << 49, (replica(1, 0),), 1, 0.0)


def test_a_one_replica_record_costs_at_most_112_bytes_beside_its_name():
    """Issue 19: <= 250 B/object of master RSS at 10M; the record and its packed int are 64 + 48 B
    (the name and the dict entry come on top). Random checksums: a constant would flatter it."""
    names = [object_name("ns", f"{i:016x}") for i in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        records = [ObjectRecord(name, 65536, (replica(2, i << 16),), 1, 0.0) for i, name in enumerate(names)]
        for i, record in enumerate(records):
            record.complete(0x9E37_79B9 * (i + 1))
        per_object = (tracemalloc.get_traced_memory()[0] - before - 8 * len(records)) / len(records)  # less the list
    finally:
        tracemalloc.stop()
    assert per_object <= 112, per_object


def test_chunk_checksums_ride_along_only_when_they_fit():
    """Issue 21: a blob of 4 B per 64 KiB chunk is kept with an object of more than one chunk,
    survives every change of the record's other fields, and costs nothing to objects without one."""
    a, b = replica(3, 4096), replica(7, 1 << 20, TIER_SSD)
    size = 3 * CHUNK_BYTES + 1  # 4 chunks
    blob = bytes(range(16))
    record = ObjectRecord(object_name("ns", "k"), size, (a,), 9, 12.5, None, 0.0)
    record.complete(77)
    assert record.chunk_crcs == b""
    for wrong in (blob[:12], blob + b"\0\0\0\0", b""):
        record.keep_chunk_crcs(wrong)
        assert record.chunk_crcs == b""
    record.keep_chunk_crcs(blob)
    assert (record.chunk_crcs, record.replicas, record.checksum, record.size) == (blob, (a,), 77, size)
    for replicas in [(a, b), (b,), (), (a,)]:
        record.replicas = replicas
        assert (record.replicas, record.chunk_crcs, record.checksum) == (replicas, blob, 77)
    for _ in range(3):
        record.count_read()
    record.state = ObjectState.PENDING
    record.reads = 1
    assert (record.reads, record.chunk_crcs, record.replicas) == (1, blob, (a,))
    record.keep_chunk_crcs(blob[:4])  # a blob that does not fit replaces none, and drops the old one
    assert (record.chunk_crcs, record.replicas, record.reads) == (b"", (a,), 1)

    record.keep_chunk_crcs(blob)
    record.complete(78)  # completed again (an overwrite): the old chunk CRCs describe other bytes
    assert (record.chunk_crcs, record.checksum, record.replicas, record.state) == (b"", 78, (a,), ObjectState.COMPLETE)

    small = ObjectRecord(object_name("ns", "s"), CHUNK_BYTES, (a,), 9, 12.5, None, 0.0)
    small.keep_chunk_crcs(blob[:4])  # one chunk: its whole checksum is the chunk's, no blob kept
    assert small.chunk_crcs == b""
