"""Draining a segment: no new allocations, its objects moved elsewhere, then unmounted.

The master never moves bytes. The drainer (`kvtier drain`, a client) asks
`migrate_start` for a batch of objects on the draining segment; each comes
with a read lease on its source range (so the bytes stay put while they are
copied) and a target range allocated on another ACTIVE segment that holds no
replica of it. The drainer copies and verifies the bytes and reports back in
`migrate_end`: a moved object's source replica is replaced by the target
(the source range is freed when the lease ends); anything else releases the
target. `drain(finish=True)` unmounts the segment; objects that could not be
moved are dropped (a cache can always recompute them). The drained
incarnation (name + region nonce) is refused if its process mounts again, so
it exits instead of coming back; a restarted process has a new nonce.

Owned by `MasterState`'s thread like everything else; it changes the state's
tables through MasterState's public methods (see its module docstring).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.master.records import (
    TIER_DRAM,
    TIER_SHIFT,
    ObjectRecord,
    ObjectState,
    replica,
    replica_offset,
    replica_segment,
)
from kvtier.master.state_types import SegmentState
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, SegmentRecord

_OK = int(Status.OK)


@dataclass(slots=True)
class Migration:
    record: ObjectRecord
    source: int  # packed replicas (kvtier.master.records)
    target: int | None  # None: no room anywhere right now


@dataclass(slots=True)
class MigrationBatch:
    migration_id: int
    source_segment: int
    started_at: float
    items: list[Migration] = field(default_factory=list)


class Drainer:
    def __init__(self, state: MasterState) -> None:
        self.state = state
        self._batches: dict[int, MigrationBatch] = {}
        self._moving: set[int] = set()  # id() of records with a migration in flight
        self._ids = itertools.count(1)
        self.drained: set[tuple[str, str]] = set()  # (segment name, incarnation)

    def drain(self, name: str, finish: bool) -> tuple[Status, int, int, str]:
        """Mark `name` DRAINING, or with `finish` unmount it. (status, objects left, bytes left, state)."""
        segment = self._by_name(name)
        if segment is None:
            if any(drained_name == name for drained_name, _ in self.drained):
                return Status.OK, 0, 0, "DRAINED"
            return Status.SEGMENT_NOT_FOUND, 0, 0, ""
        if not finish:
            segment.state = SegmentState.DRAINING
            return Status.OK, segment.objects, segment.used, segment.state.name
        self.drained.add((name, segment.incarnation))
        left, used = segment.objects, segment.used
        self.state.drop_segment(segment.segment_id, reason="drained")
        return Status.OK, left, used, "DRAINED"

    def is_drained(self, name: str, incarnation: str) -> bool:
        return bool(incarnation) and (name, incarnation) in self.drained

    def migrate_start(self, name: str, max_objects: int) -> tuple[Status, MigrationBatch | None]:
        """Up to `max_objects` complete objects on draining segment `name`, with targets and source leases."""
        segment = self._by_name(name)
        if segment is None:
            return Status.SEGMENT_NOT_FOUND, None
        if segment.state is not SegmentState.DRAINING:
            return Status.INVALID_ARGUMENT, None
        state = self.state
        now = state.clock()
        lease_until = now + state.config.lease_s
        batch = MigrationBatch(next(self._ids), segment.segment_id, now)
        targets = [s for s in state.segments.values() if s.placeable]
        dram = segment.segment_id << 2 | TIER_DRAM
        for record in state.records():
            if len(batch.items) >= max_objects:
                break
            if record.state is not ObjectState.COMPLETE or id(record) in self._moving:
                continue
            # DRAM copies only: disk copies on a drained segment go with it (see docs/architecture.md)
            source = next((r for r in record.replicas if r >> TIER_SHIFT == dram), None)
            if source is None:
                continue
            holders = {replica_segment(r) for r in record.replicas}
            candidates = sorted(
                (s for s in targets if s.segment_id not in holders),
                key=lambda s: s.allocator.used / s.allocator.capacity if s.allocator.capacity else 1.0,
            )
            target = None
            for candidate in candidates:
                offset = candidate.allocator.allocate(record.size) if record.size else 0
                if offset is not None:
                    candidate.objects += 1
                    target = replica(candidate.segment_id, offset)
                    break
            if target is not None:
                record.lease_until = max(record.lease_until, lease_until)
                state.leases.uncounted(record, lease_until)  # no reader's release cuts the copy's read
                self._moving.add(id(record))
            batch.items.append(Migration(record, source, target))
        self._batches[batch.migration_id] = batch
        return Status.OK, batch

    def migrate_end(self, migration_id: int, moved: dict[tuple[str, str], bool]) -> tuple[Status, list[int]]:
        """Swap in the targets of moved objects; release every other target. Per reported key: OK/NOT_PENDING."""
        batch = self._batches.pop(migration_id, None)
        if batch is None:
            return Status.NOT_PENDING, []
        out = {}
        for item in batch.items:
            key = (item.record.namespace, item.record.key)
            ok = self._finish(item, moved.get(key, False))
            out[key] = _OK if ok else int(Status.NOT_PENDING)
        return Status.OK, [out.get(key, int(Status.NOT_PENDING)) for key in moved]

    def _finish(self, item: Migration, moved: bool) -> bool:
        state = self.state
        record, source, target = item.record, item.source, item.target
        self._moving.discard(id(record))
        if target is None:
            return False
        alive = state.visible(record.name) is record
        target_segment = state.segments.get(replica_segment(target))
        if moved and alive and target_segment is not None and source in record.replicas:
            record.replicas = tuple(target if r == source else r for r in record.replicas)
            state.events.changed(record, "drained")
            source_id = replica_segment(source)
            state.commits.committed(replica_segment(target), replica_offset(target), record)
            state.commits.dropped_after(source_id, replica_offset(source), record, replica_segment(target))
            source_segment = state.segments.get(source_id)
            if source_segment is not None:
                source_segment.objects -= 1
                if record.size:  # readers may hold the source range: free it when their lease ends
                    until = record.lease_until + state.reuse_margin_s
                    state.free_after_leases(source_id, replica_offset(source), record.size, until, record)
            return True
        # The migrator's write grant on the target ends with the lease migrate_start set: a stalled
        # writer's frames may act on the range until then (plus clock skew), so no reuse before.
        until = record.lease_until + state.reuse_margin_s
        if record.size and target_segment is not None and until > state.clock():
            target_segment.objects -= 1
            state.free_after_leases(replica_segment(target), replica_offset(target), record.size, until, record)
        else:
            state.release_ranges([target], record.size)
        return False

    def tick(self, now: float) -> None:
        """Release the targets of migration batches nobody finished (the drainer died)."""
        timeout = self.state.config.put_timeout_s
        for migration_id in [m for m, b in self._batches.items() if now - b.started_at > timeout]:
            for item in self._batches.pop(migration_id).items:
                self._finish(item, moved=False)

    def _by_name(self, name: str) -> SegmentRecord | None:
        return self.state.segment_named(name)
