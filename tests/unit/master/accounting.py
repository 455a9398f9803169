"""The books of a `MasterState`, checked from scratch: shared by the eviction and quota scenarios.

`assert_consistent(state)` recomputes, from the object records alone, what
every segment's allocator, every segment's replica count, the LRU index and
every quota owner must say, and compares. It extends the invariant of the
`MasterStateMachine` in test_state.py with what eviction and quotas added.
"""

from __future__ import annotations

from collections import Counter

from kvtier.master.state import MasterState, ObjectState


def records(state: MasterState) -> list:
    return [record for objects in state._namespaces.values() for record in objects.values()]


def assert_consistent(state: MasterState) -> None:
    alignment = state.config.alignment

    def aligned(size: int) -> int:
        return -(-size // alignment) * alignment

    used = dict.fromkeys(state.segments, 0)
    replicas = dict.fromkeys(state.segments, 0)
    owner_used: Counter = Counter()
    owner_objects: Counter = Counter()
    complete = set()
    pending = 0
    all_records = records(state)
    for objects_ns, objects in state._namespaces.items():
        for key, record in objects.items():
            assert (record.namespace, record.key) == (objects_ns, key), "record filed under another name"
    for record in all_records:
        assert record.replicas, f"{record.key!r} has no replicas"
        segment_ids = [r.segment_id for r in record.replicas]
        assert len(set(segment_ids)) == len(segment_ids), f"{record.key!r} has two replicas on one segment"
        for replica in record.replicas:
            assert replica.segment_id in state.segments, f"{record.key!r} has a replica on a dropped segment"
            replicas[replica.segment_id] += 1
            if record.size:
                used[replica.segment_id] += aligned(record.size)
        if record.state is ObjectState.PENDING:
            pending += 1
            assert state._pending.get((record.namespace, record.key)) is record
        else:
            complete.add(id(record))
        if record.owner is not None:
            owner_used[id(record.owner)] += aligned(record.size) * len(record.replicas)
            owner_objects[id(record.owner)] += 1
    for _, _, segment_id, _, size in state._deferred:
        used[segment_id] += aligned(size)
    for segment_id, segment in state.segments.items():
        allocator = segment.allocator
        assert segment.used == used[segment_id], (
            f"segment {segment.name}: allocator says {segment.used} used, its replicas and deferred ranges "
            f"add up to {used[segment_id]}"
        )
        assert sum(allocator._allocated.values()) == allocator.used, f"segment {segment.name}: allocator drifted"
        assert sum(allocator._free_by_start.values()) == allocator.capacity - allocator.used
        assert segment.objects == replicas[segment_id], (
            f"segment {segment.name}: objects={segment.objects}, replicas on it={replicas[segment_id]}"
        )
    assert state.object_count == len(all_records)
    assert len(state._pending) == pending == state.snapshot().pending_puts
    lru = [id(record) for record in state.lru]
    assert len(lru) == len(set(lru)) == len(state.lru)
    assert set(lru) == complete, "the LRU index must hold exactly the complete objects"
    for owner in state.quotas.snapshot():
        assert owner.used == owner_used[id(owner)], (
            f"{owner.instance}/{owner.rank}: used={owner.used}, its objects hold {owner_used[id(owner)]}"
        )
        assert owner.objects == owner_objects[id(owner)], (
            f"{owner.instance}/{owner.rank}: objects={owner.objects}, it owns {owner_objects[id(owner)]}"
        )
