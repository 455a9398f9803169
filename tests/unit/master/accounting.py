"""The books of a `MasterState`, checked from scratch: shared by the eviction and quota scenarios.

`assert_consistent(state)` recomputes, from the object records alone, what
every segment's allocator, every segment's replica count, the pending table
and every quota owner must say, and compares. It also proves that each
region is tiled exactly by the records' ranges, the ranges waiting for a
lease to end, and the allocator's free extents: no overlap, no gap. The
master's allocators keep no per-allocation table (see master/allocator.py),
so this is where a double free or a leaked range would show. It extends the invariant of the
`MasterStateMachine` in test_state.py with what eviction and quotas added.

It also plays every segment's part in the commit log (kvtier.master.commits):
it polls each segment's notices, applies them to a model of that segment's
DRAM index, acknowledges them, and checks the index says exactly what the
records say: every complete object's DRAM copy, at its offset, with its size
and checksum, and nothing else. That is what a restarted master would rebuild.
"""

from __future__ import annotations

import weakref
from collections import Counter

from kvtier.master.records import TIER_DRAM, object_name, replica_offset, replica_segment, replica_tier
from kvtier.master.state import MasterState, ObjectState

# state -> segment id -> the segment's DRAM index as its notices built it: where -> (name, size, checksum)
_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def segment_indexes(state: MasterState) -> dict[int, dict]:
    """Poll, apply and acknowledge every segment's notices; each segment's index model."""
    indexes = _INDEXES.setdefault(state, {})
    for segment_id in list(indexes):
        if segment_id not in state.segments:
            del indexes[segment_id]  # gone, or dropped by the master: its index went with it
    for segment_id in state.segments:
        index = indexes.setdefault(segment_id, {})
        feed = state.commits._feeds[segment_id]
        notices = state.commits.poll(segment_id, feed.acked, 1 << 30)
        for offset, record, drop in notices.items:
            where = offset if record.size else record.name
            if drop:
                index.pop(where, None)
            else:
                index[where] = (record.name, record.size, record.checksum)
        state.commits.poll(segment_id, notices.first_seq + len(notices.items) - 1, 0)  # acknowledge
        assert not state.commits.barrier().get(segment_id), "acknowledged notices still awaited"
    return indexes


def records(state: MasterState) -> list:
    return list(state.records())


def namespace_records(state: MasterState, namespace: str) -> dict:
    """key -> record of every object (pending or complete) of `namespace`."""
    return {record.key: record for record in state.records() if record.namespace == namespace}


def assert_consistent(state: MasterState) -> None:
    alignment = state.config.alignment
    # The name index (kvtier.master.name_index) holds exactly the tables' names, in order.
    assert state.names_after("", inclusive=True) == sorted(state.names()), "name index out of step"

    def aligned(size: int) -> int:
        return -(-size // alignment) * alignment

    used = dict.fromkeys(state.segments, 0)
    replicas = dict.fromkeys(state.segments, 0)  # DRAM replicas per segment
    disk_copies = dict.fromkeys(state.segments, 0)
    owner_used: Counter = Counter()
    owner_objects: Counter = Counter()
    complete = set()
    pending = 0
    upserting = list(state.upserts.pending.values())  # new versions beside visible ones (master/upsert.py)
    all_records = records(state) + upserting
    ranges: dict[int, list[tuple[int, int, str]]] = {segment_id: [] for segment_id in state.segments}
    for name, record in state.named_records():
        assert name == record.name == object_name(record.namespace, record.key), "record filed under another name"
    assert not state._objects.keys() & state._disk_only.keys(), "a record in both dicts"
    for record in state._disk_only.values():
        assert record.state is ObjectState.COMPLETE, f"{record.key!r}: a pending record among the disk-only ones"
        assert all(replica_tier(r) != TIER_DRAM for r in record.replicas), f"{record.key!r} holds DRAM"
    queued = state.policy.queued()  # the policy orders exactly the complete records holding DRAM
    if queued is not None:
        complete_in_dram = {n for n, r in state._objects.items() if r.state is ObjectState.COMPLETE}
        assert sorted(queued) == sorted(complete_in_dram), "eviction policy out of step with the tables"
    for record in state._objects.values():
        if record.state is ObjectState.COMPLETE:
            assert any(replica_tier(r) == TIER_DRAM for r in record.replicas), (
                f"{record.key!r} holds no DRAM but sits in the eviction order"
            )
    for record in all_records:
        assert record.replicas, f"{record.key!r} has no replicas"
        places = [(replica_segment(r), replica_tier(r)) for r in record.replicas]
        assert len(set(places)) == len(places), f"{record.key!r} has two replicas in one tier of one segment"
        for replica in record.replicas:
            segment_id = replica_segment(replica)
            assert segment_id in state.segments, f"{record.key!r} has a replica on a dropped segment"
            if replica_tier(replica) != TIER_DRAM:
                disk_copies[segment_id] += 1
                continue
            replicas[segment_id] += 1
            if record.size:
                used[segment_id] += aligned(record.size)
                ranges[segment_id].append((replica_offset(replica), aligned(record.size), record.key))
        if record.state is ObjectState.PENDING:
            pending += 1
            assert state._pending.get(record.name) is record or state.upserts.pending.get(record.name) is record
        else:
            complete.add(id(record))
        if record.owner is not None:
            dram_replicas = sum(1 for r in record.replicas if replica_tier(r) == TIER_DRAM)
            owner_used[id(record.owner)] += aligned(record.size) * dram_replicas
            owner_objects[id(record.owner)] += 1
    for batch in state.drainer._batches.values():  # targets of migrations in flight
        for item in batch.items:
            if item.target is None:
                continue
            segment_id = replica_segment(item.target)
            replicas[segment_id] += 1  # counted from the reservation on, a zero-size object's too
            if item.record.size:
                used[segment_id] += aligned(item.record.size)
                ranges[segment_id].append((replica_offset(item.target), aligned(item.record.size), "<migrating>"))
    for task in state.tiering._promoting.values():  # DRAM ranges allocated for a promotion in flight
        if task.size and task.segment_id in ranges:
            used[task.segment_id] += aligned(task.size)
            ranges[task.segment_id].append((task.dram_offset, aligned(task.size), "<promoting>"))
    releasing: Counter[int] = Counter()  # what SegmentRecord.releasing must say
    for _, _, segment_id, offset, size in state._deferred:
        used[segment_id] += aligned(size)
        releasing[segment_id] += aligned(size)
        ranges[segment_id].append((offset, aligned(size), "<deferred>"))
    for segment_id, offset, size in state.leases.parked():  # waiting for their readers to release
        if segment_id in ranges:
            used[segment_id] += aligned(size)
            releasing[segment_id] += aligned(size)
            ranges[segment_id].append((offset, aligned(size), "<parked>"))
    for segment_id, segment in state.segments.items():  # kept from reuse while a writer may be in them
        for _, _, offset, size in segment.held:
            used[segment_id] += aligned(size)
            releasing[segment_id] += aligned(size)
            ranges[segment_id].append((offset, aligned(size), "<held>"))
    for segment_id, segment in state.segments.items():
        allocator = segment.allocator
        assert segment.used == used[segment_id], (
            f"segment {segment.name}: allocator says {segment.used} used, its replicas and deferred ranges "
            f"add up to {used[segment_id]}"
        )
        assert segment.releasing == releasing[segment_id], (
            f"segment {segment.name}: releasing={segment.releasing}, deferred and parked ranges add up to "
            f"{releasing[segment_id]}"
        )
        assert sum(size for _, size in allocator.free_spans()) == allocator.capacity - allocator.used
        tiles = ranges[segment_id] + [(start, size, "<free>") for start, size in allocator.free_spans()]
        cursor, previous = 0, "<start>"
        for start, size, what in sorted(tiles):
            assert start == cursor, (
                f"segment {segment.name}: {what} at {start} "
                + ("overlaps" if start < cursor else "leaves a gap after")
                + f" {previous} ending at {cursor}"
            )
            cursor, previous = start + size, what
        assert cursor == allocator.capacity, f"segment {segment.name}: tiles end at {cursor}"
        assert segment.objects == replicas[segment_id], (
            f"segment {segment.name}: objects={segment.objects}, replicas on it={replicas[segment_id]}"
        )
        assert segment.ssd_objects == disk_copies[segment_id], (
            f"segment {segment.name}: ssd_objects={segment.ssd_objects}, disk copies on it={disk_copies[segment_id]}"
        )
    indexes = segment_indexes(state)
    expected: dict[int, dict] = {segment_id: {} for segment_id in state.segments}
    for record in all_records:
        if record.state is ObjectState.COMPLETE:
            for replica in record.replicas:
                if replica_tier(replica) == TIER_DRAM:
                    where = replica_offset(replica) if record.size else record.name
                    expected[replica_segment(replica)][where] = (record.name, record.size, record.checksum)
    for segment_id, segment in state.segments.items():
        assert indexes[segment_id] == expected[segment_id], (
            f"segment {segment.name}: its index from the commit log differs from the records: "
            f"extra {sorted(indexes[segment_id].items() - expected[segment_id].items())[:3]}, "
            f"missing {sorted(expected[segment_id].items() - indexes[segment_id].items())[:3]}"
        )
    assert state.object_count == len(all_records)
    assert len(state._pending) + len(upserting) == pending == state.snapshot().pending_puts
    assert len(complete) + pending - len(upserting) == len(state._objects) + len(state._disk_only)
    for owner in state.quotas.snapshot():
        assert owner.used == owner_used[id(owner)], (
            f"{owner.instance}/{owner.rank}: used={owner.used}, its objects hold {owner_used[id(owner)]}"
        )
        assert owner.objects == owner_objects[id(owner)], (
            f"{owner.instance}/{owner.rank}: objects={owner.objects}, it owns {owner_objects[id(owner)]}"
        )
