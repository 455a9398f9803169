"""Draining a segment: no new allocations, its objects moved elsewhere, then unmounted.

The master never moves bytes. The drainer (`kvtier drain`, a client) asks
`migrate_start` for a batch of objects on the draining segment; each comes
with a read lease on its source range (so the bytes stay put while they are
copied) and a target range allocated on another ACTIVE segment that holds no
replica of it. The drainer copies and verifies the bytes and reports back in
`migrate_end`: a moved object gets the target as one more replica at once, and
loses its source replica once the target's segment acknowledged the commit of
its copy (kvtier.master.commits.after_acked); the source range is freed from
then on, when the lease ends. A target that goes away before acknowledging
leaves the object on its source, and the move's key is answered
SEGMENT_NOT_FOUND (kvtier.master.commit_wait). Anything else releases the
target. An object whose only copy is on the draining segment's SSD tier moves
too: the drainer reads the disk copy (READ_DISK, verified) into a DRAM range
elsewhere, and the disk copy is tombstoned once the target acknowledged; a disk
copy of an object held on a segment that stays goes with the segment.
`drain(finish=True)` unmounts the segment; objects that could not be moved are
dropped (a cache can always recompute them). The drained incarnation (name +
region nonce) is refused if its process mounts again, so it exits instead of
coming back; a restarted process has a new nonce.

Replica copies and moves (issue 21, kvtier.client.replicas, `kvtier replica`) use the same
batches: `migrate_keys` names the keys, the target segment and optionally the source, and a copy
(`keep_source`) adds the verified target as one more replica instead of swapping it in. Whatever
happens to the key meanwhile (removed, put again, its source replica gone), `migrate_end` finds
it and releases the target: a replica never becomes visible on a record it was not copied from.

Owned by `MasterState`'s thread like everything else; it changes the state's
tables through MasterState's public methods (see its module docstring).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.master.records import (
    TIER_DRAM,
    TIER_SHIFT,
    TIER_SSD,
    ObjectRecord,
    ObjectState,
    name_prefix,
    on_segment,
    replica,
    replica_offset,
    replica_segment,
    replica_tier,
)
from kvtier.master.state_types import SegmentState
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, SegmentRecord

_OK = int(Status.OK)
_NOT_FOUND = int(Status.NOT_FOUND)
# Drained incarnations remembered (and saved): a drained process mounts again within a heartbeat
# interval or two and exits, so only recent ones matter; this bounds what a long-lived cluster keeps.
MAX_DRAINED = 1024
# Names a drain's walk takes from the name index at a time: its time bound is checked between steps.
_WALK_STEP = 64


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
    keep_source: bool = False  # a copy: the target is added as a replica, the source stays
    # Keyed batches (`migrate_keys`): request position -> why that key does not move; the other
    # positions are `items`, in request order.
    refused: dict[int, int] = field(default_factory=dict)
    # A drain's batch: its walk of the object names stopped at its time bound, not at the end (ask
    # again, even when this batch is empty).
    more: bool = False
    # A drain's batch ending a walk: the walk met objects of the segment that cannot move now (a put
    # in progress, a copy, move or drain of them in flight, a promotion into the segment's DRAM), or
    # another mover's batch reads from it, or an upsert's new version there is pending
    # (`_in_flight_from`): ask again after a while; finishing now would drop them with the segment.
    waiting: bool = False


class Drainer:
    def __init__(self, state: MasterState) -> None:
        self.state = state
        self._batches: dict[int, MigrationBatch] = {}
        self._moving: set[int] = set()  # id() of records with a migration in flight (a move: until its source goes)
        self._ids = itertools.count(1)
        # (segment name, incarnation) -> None, oldest first: saved with the master's state
        # (kvtier.master.persist), so a restart right after a drain does not let it mount again.
        self.drained: dict[tuple[str, str], None] = {}
        # Per draining segment, the last object name its walk visited ("" = from the start), and how
        # many of its objects this walk met that could not move then (MigrationBatch.waiting).
        self._cursors: dict[int, str] = {}
        self._waiting: dict[int, int] = {}
        # Segments an operator asked to drain, not finished yet: name -> the incarnation (region nonce)
        # being drained. That process expelled mid-drain (a blip, a stall past its TTL) mounts again
        # DRAINING, not ACTIVE taking new objects, and the drain goes on; a new process under the name
        # (a restart) mounts ACTIVE: a failed drain-on-stop must not leave its successor out of
        # placement. In memory only (a restarted master forgets it: the drain then stops with
        # INVALID_ARGUMENT and the operator runs it again). At most one entry per segment name.
        self.draining: dict[str, str] = {}

    def drain(
        self, name: str, finish: bool, if_draining: bool = False, status_only: bool = False
    ) -> tuple[Status, int, int, str, int]:
        """Mark `name` DRAINING, or with `finish` unmount it, or with `status_only` just say how it
        stands (the drain's progress and its checks: marking there undid a `cancel`). (status, DRAM
        objects left, bytes left, state, disk copies left: those of objects held elsewhere, and last
        copies not moved yet). `incarnation_of` says which process the answer is about."""
        segment = self._by_name(name)
        if segment is None:
            if name in self.draining:
                if not finish:
                    # Expelled or restarting mid-drain: it mounts again DRAINING (`mounted_state`).
                    return Status.OK, 0, 0, "AWAY", 0
                # A drain ending with its segment still away (gone for good?) ends its intent: the
                # process must not come back DRAINING with no drain running.
                del self.draining[name]
            elif any(drained_name == name for drained_name, _ in self.drained):
                return Status.OK, 0, 0, "DRAINED", 0  # (of which incarnation: `incarnation_of`)
            return Status.SEGMENT_NOT_FOUND, 0, 0, "", 0
        if status_only:
            return Status.OK, segment.objects, segment.used, segment.state.name, segment.ssd_objects
        if not finish:
            self.draining[name] = segment.incarnation
            if segment.state is not SegmentState.RECOVERING:  # else DRAINING once its inventory is in
                segment.state = SegmentState.DRAINING
            return Status.OK, segment.objects, segment.used, segment.state.name, segment.ssd_objects
        if if_draining and segment.state is not SegmentState.DRAINING:
            # Mounted again as ACTIVE since this drain began (a master restart forgot the drain):
            # finishing it dropped objects no walk had seen, new puts among them.
            return Status.INVALID_ARGUMENT, segment.objects, segment.used, segment.state.name, segment.ssd_objects
        self.draining.pop(name, None)
        self.remember_drained(name, segment.incarnation)
        # Counted with them: sources of moves whose target has not acknowledged yet (the object lives
        # on only if the target does; told apart they would hide a loss when it does not).
        left, used, disk = segment.objects, segment.used, segment.ssd_objects
        self.state.drop_segment(segment.segment_id, reason="drained")
        return Status.OK, left, used, "DRAINED", disk

    def cancel(self, name: str) -> tuple[Status, int, int, str, int]:
        """Stop draining `name` (`kvtier drain --cancel`): it takes new objects again. Objects moved
        stay moved. (status, objects, bytes, state, disk copies) as `drain` answers."""
        segment = self._by_name(name)
        known = self.draining.pop(name, None) is not None
        if segment is None:
            return (Status.OK, 0, 0, "AWAY", 0) if known else (Status.SEGMENT_NOT_FOUND, 0, 0, "", 0)
        if segment.state is SegmentState.DRAINING:
            segment.state = SegmentState.ACTIVE
            self.segment_dropped(segment.segment_id)  # its walk: a later drain starts afresh
        return Status.OK, segment.objects, segment.used, segment.state.name, segment.ssd_objects

    def mounted_state(self, name: str, incarnation: str) -> SegmentState:
        """The state a segment takes once mounted (its inventory done): DRAINING while an operator's
        drain of this very process is not finished, else ACTIVE."""
        draining = self.draining.get(name)
        return SegmentState.DRAINING if draining is not None and draining == incarnation else SegmentState.ACTIVE

    def incarnation_of(self, name: str) -> str:
        """The process a DrainSegment answer about `name` is about: the one mounted, else the one being
        drained (AWAY), else the one drained last under the name (DRAINED): a drain tells its own
        segment's end from an earlier drain of the name (drain-on-stop drains every restart)."""
        segment = self._by_name(name)
        if segment is not None:
            return segment.incarnation
        if name in self.draining:
            return self.draining[name]
        return next((inc for drained_name, inc in reversed(self.drained) if drained_name == name), "")

    def remember_drained(self, name: str, incarnation: str) -> None:
        """Refuse this incarnation of `name` from now on (the most recent MAX_DRAINED are kept)."""
        self.drained[(name, incarnation)] = None
        while len(self.drained) > MAX_DRAINED:
            del self.drained[next(iter(self.drained))]

    def moving(self, record: ObjectRecord) -> bool:
        """Whether a copy, move or drain of `record` is in flight (a move: until its source went)."""
        return id(record) in self._moving

    def is_drained(self, name: str, incarnation: str) -> bool:
        return bool(incarnation) and (name, incarnation) in self.drained

    def migrate_start(self, name: str, max_objects: int) -> tuple[Status, MigrationBatch | None]:
        """Up to `max_objects` complete objects on draining segment `name`, with targets and source leases.

        The objects are found by a walk of the object names in order (kvtier.master.name_index) that
        each call continues from where the last one stopped, for at most `list_page_ms` (the
        batch's `more` then says so): every call walked every object from the start, on the event
        loop, 1.5 s per batch at 1M objects, and a drain was quadratic in the object count. A walk
        that reaches the end starts again at the next call (objects skipped, pending or moving,
        are met again)."""
        segment = self._by_name(name)
        if segment is None:
            return Status.SEGMENT_NOT_FOUND, None
        if segment.state is SegmentState.RECOVERING and self.draining.get(name) == segment.incarnation:
            # Mounted again mid-drain, still reporting its inventory: DRAINING once it is in.
            return Status.OK, MigrationBatch(0, segment.segment_id, self.state.clock(), waiting=True)
        if segment.state is not SegmentState.DRAINING:
            return Status.INVALID_ARGUMENT, None
        state = self.state
        now = state.clock()
        lease_until = now + state.config.lease_s
        batch = MigrationBatch(next(self._ids), segment.segment_id, now, more=True)
        targets = [s for s in state.segments.values() if s.placeable]
        segment_id = segment.segment_id
        dram = segment_id << 2 | TIER_DRAM
        lookup = state.lookup
        cursor = self._cursors.get(segment_id, "")
        waiting = self._waiting.get(segment_id, 0)
        until = time.perf_counter() + state.config.list_page_ms / 1000
        while len(batch.items) < max_objects:
            names = state.names_after(cursor, "", _WALK_STEP)
            for name_ in names:
                cursor = name_
                record = lookup(name_)
                if record is None:
                    continue
                if record.state is not ObjectState.COMPLETE or id(record) in self._moving:
                    # Counted: a drain that finished past it dropped a disk-only object whose copy
                    # (or whose drain by a second `kvtier drain`) was in flight, though it would
                    # have been kept.
                    waiting += on_segment(record.replicas, segment_id)
                    continue
                source = next((r for r in record.replicas if r >> TIER_SHIFT == dram), None)
                if source is None:
                    source, promoting = self._last_disk_copy(record, segment_id)
                    if source is None:
                        waiting += promoting
                        continue
                target = self._target(record, targets, lease_until)
                if target is None and self._nowhere_else_to_go(record, segment_id, targets):
                    continue  # every other segment holds a copy already: this one just goes with it
                batch.items.append(Migration(record, source, target))
                if len(batch.items) >= max_objects:
                    break
            if len(names) < _WALK_STEP and (not names or cursor == names[-1]):
                # The end: the next call walks again from the start. Waiting too: objects of the
                # segment in another mover's batch (a second `kvtier drain` taking them earlier in
                # this same walk, which a drain finishing now would drop under it).
                batch.more, cursor = False, ""
                batch.waiting = waiting > 0 or self._in_flight_from(segment_id, batch)
                waiting = 0
                break
            if time.perf_counter() > until:
                break
        self._cursors[segment_id], self._waiting[segment_id] = cursor, waiting
        if batch.items:  # else nothing to end or release: an empty batch was kept until the put timeout
            self._batches[batch.migration_id] = batch
        return Status.OK, batch

    def _in_flight_from(self, segment_id: int, besides: MigrationBatch) -> bool:
        """Whether a batch other than `besides`, not ended yet, reads an object from `segment_id`, or an
        upsert's new version written there is still pending (it is in no table the walk sees)."""
        return any(
            replica_segment(item.source) == segment_id
            for batch in self._batches.values()
            if batch is not besides
            for item in batch.items
            if item.target is not None
        ) or any(on_segment(record.replicas, segment_id) for record in self.state.upserts.pending.values())

    def segment_dropped(self, segment_id: int) -> None:
        """Its walk's state goes with it (a draining segment expelled or unmounted, or drained)."""
        self._cursors.pop(segment_id, None)
        self._waiting.pop(segment_id, None)

    def _target(self, record: ObjectRecord, targets: list[SegmentRecord], lease_until: float) -> int | None:
        """A range for `record` on the ACTIVE segment holding none of its replicas that is least full
        (quarantined ones last), reserved (`_reserve`); None: no room anywhere right now."""
        state = self.state
        holders = {replica_segment(r) for r in record.replicas}
        # Quarantined segments last (kvtier.master.quarantine): the mover could not write there.
        candidates = sorted(
            (s for s in targets if s.segment_id not in holders),
            key=lambda s: (
                s.segment_id in state.quarantined_ids,
                s.allocator.used / s.allocator.capacity if s.allocator.capacity else 1.0,
            ),
        )
        for candidate in candidates:
            target = self._reserve(record, candidate, lease_until)
            if target is not None:
                return target
        return None

    def migrate_keys(
        self, namespace: str, keys: list[str], source_name: str, target_name: str, keep_source: bool
    ) -> tuple[Status, MigrationBatch | None]:
        """Start copying (`keep_source`) or moving `keys` to segment `target_name`, each from a
        replica (DRAM first, else a disk copy) on `source_name` ("" = any segment). SEGMENT_NOT_FOUND
        for an unknown segment, INVALID_ARGUMENT for a target that takes no allocations (draining); per key (`refused`):
        NOT_FOUND, PUT_IN_PROGRESS (pending, or a migration of it in flight), REPLICA_EXISTS (the
        target holds one), REPLICA_NOT_FOUND (no replica there to read); NO_SPACE as a target-less item."""
        state = self.state
        target = state.segment_named(target_name)
        source_segment = state.segment_named(source_name) if source_name else None
        if target is None or (source_name and source_segment is None):
            return Status.SEGMENT_NOT_FOUND, None
        if not target.placeable:
            return Status.INVALID_ARGUMENT, None
        now = state.clock()
        lease_until = now + state.config.lease_s
        source_id = source_segment.segment_id if source_segment is not None else 0
        batch = MigrationBatch(next(self._ids), source_id, now, keep_source=keep_source)
        prefix = name_prefix(namespace)
        for position, key in enumerate(keys):
            record = state.visible(prefix + key)
            if record is None:
                batch.refused[position] = _NOT_FOUND
            elif record.state is not ObjectState.COMPLETE or id(record) in self._moving:
                batch.refused[position] = int(Status.PUT_IN_PROGRESS)
            elif on_segment(record.replicas, target.segment_id):
                batch.refused[position] = int(Status.REPLICA_EXISTS)
            elif (source := self._source(record, source_id)) is None:
                batch.refused[position] = int(Status.REPLICA_NOT_FOUND)
            else:
                batch.items.append(Migration(record, source, self._reserve(record, target, lease_until)))
        if any(item.target is not None for item in batch.items):  # else nothing to end or release
            self._batches[batch.migration_id] = batch
        return Status.OK, batch

    def _stays_elsewhere(self, record: ObjectRecord, segment_id: int) -> bool:
        """Whether `record` has a copy on a segment that outlives the drain of `segment_id`: mounted
        (not dropped and still being swept), not draining too, and heard from lately (a heartbeat
        within `segment_suspect_s`, as placement judges it): a holder SIGKILLed shortly before the
        drain stays mounted until its TTL, and a drain that finished within it dropped the objects
        whose other copy that was (6 of 20 in the test). A live holder merely late costs a copy too many."""
        state = self.state
        segments = state.segments
        heard_since = state.clock() - state.config.segment_suspect_s
        for packed in record.replicas:
            holder = segments.get(replica_segment(packed))
            if (
                holder is not None
                and holder.segment_id != segment_id
                and holder.state is not SegmentState.DRAINING
                and holder.last_heartbeat >= heard_since
            ):
                return True
        return False

    def _nowhere_else_to_go(self, record: ObjectRecord, segment_id: int, targets: list[SegmentRecord]) -> bool:
        """No segment a copy could go to holds none of `record` (every placeable one has a replica),
        and a replica stays: the drain has nothing to do for it (a replicated object on two
        segments, one draining, waited for --stall-timeout and was counted `no_space`)."""
        holders = {replica_segment(r) for r in record.replicas}
        return all(s.segment_id in holders for s in targets) and self._stays_elsewhere(record, segment_id)

    def _last_disk_copy(self, record: ObjectRecord, segment_id: int) -> tuple[int | None, bool]:
        """The disk copy on draining segment `segment_id` of an object with no copy that outlives the
        drain (a drain dropped those with the segment: acknowledged puts lost while others had
        room), and whether it must wait: (None, False) when a copy on a segment that stays holds it
        (not draining too, not dropped and still being swept); (None, True) while a promotion into
        this segment's DRAM is in flight (its DRAM copy, or if the promotion fails its disk copy,
        moves in a later batch)."""
        if self._stays_elsewhere(record, segment_id):
            return None, False
        if self.state.tiering.promotion_of(record.name) is not None:
            return None, True
        ssd = segment_id << 2 | TIER_SSD
        return next((r for r in record.replicas if r >> TIER_SHIFT == ssd), None), False

    def _source(self, record: ObjectRecord, segment_id: int) -> int | None:
        """A replica of `record` to read from, on `segment_id` or (0) on any live segment: a DRAM one,
        else a disk copy (the copier reads it with READ_DISK; the target is a DRAM range)."""
        segments = self.state.segments
        found = [
            packed
            for packed in record.replicas
            if (holder := replica_segment(packed)) == segment_id or (not segment_id and holder in segments)
        ]
        return next((r for r in found if replica_tier(r) == TIER_DRAM), found[0] if found else None)

    def _reserve(self, record: ObjectRecord, segment: SegmentRecord, lease_until: float) -> int | None:
        """Allocate `record`'s target range on `segment` and hold its source for the copy; None: no room."""
        offset = segment.allocator.allocate(record.size) if record.size else 0
        if offset is None:
            return None
        segment.objects += 1
        record.lease_until = max(record.lease_until, lease_until)
        self.state.leases.uncounted(record, lease_until)  # no reader's release cuts the copy's read
        self._moving.add(id(record))
        return replica(segment.segment_id, offset)

    def migrate_end(
        self, migration_id: int, moved: dict[tuple[str, str], bool]
    ) -> tuple[Status, list[int], list[tuple[int, ObjectRecord, int]]]:
        """Add the targets of moved objects (a move drops the source once the target acknowledged);
        release every other target. Per reported key: OK, NOT_FOUND (the object was removed or
        replaced meanwhile), NOT_PENDING; and (index, record, target) of the keys answered OK, which
        the answer re-checks once the targets acknowledged (a target lost first: SEGMENT_NOT_FOUND)."""
        batch = self._batches.pop(migration_id, None)
        if batch is None:
            return Status.NOT_PENDING, [], []
        out = {}
        done: dict[tuple[str, str], tuple[ObjectRecord, int]] = {}
        for item in batch.items:
            key = (item.record.namespace, item.record.key)
            target = item.target
            if self._finish(item, moved.get(key, False), batch.keep_source):
                out[key] = _OK
                if target is not None:
                    done[key] = (item.record, target)
            elif self.state.visible(item.record.name) is not item.record:
                out[key] = _NOT_FOUND
            else:
                out[key] = int(Status.NOT_PENDING)
        keys = list(moved)
        checks = [(i, *done[key]) for i, key in enumerate(keys) if key in done]
        return Status.OK, [out.get(key, int(Status.NOT_PENDING)) for key in keys], checks

    def _finish(self, item: Migration, moved: bool, keep_source: bool = False) -> bool:
        state = self.state
        record, source, target = item.record, item.source, item.target
        self._moving.discard(id(record))
        if target is None:
            return False
        alive = state.visible(record.name) is record
        target_segment = state.segments.get(replica_segment(target))
        if keep_source:
            holds = target_segment is not None and on_segment(record.replicas, target_segment.segment_id)
            if moved and alive and target_segment is not None and not holds:
                self._add_copy(record, target)
                return True
        elif moved and alive and target_segment is not None and source in record.replicas:
            # The target is one more replica now; the source goes once the target's index has the
            # object. Swapped at once before, a target dying before its acknowledgement took the
            # object with it, and the source's drop, sent late, could hit the range's next object.
            self._add_copy(record, target)
            # Still moving until then: another move or drain of it now would leave it a third replica.
            self._moving.add(id(record))
            state.commits.after_acked(
                target_segment.segment_id, lambda acked: self._drop_source(record, source, target, acked)
            )
            return True
        # The migrator's write grant on the target ends with the lease migrate_start set: a stalled
        # writer's frames may act on the range until then (plus clock skew), so no reuse before.
        until = record.lease_until + state.reuse_margin_s
        if record.size and target_segment is not None:  # the migrator may be a same-host writer stopped mid-copy
            if not state.held_for_writers([target], record.size, until - state.clock()):
                return False
        if record.size and target_segment is not None and until > state.clock():
            target_segment.objects -= 1
            state.free_after_leases(replica_segment(target), replica_offset(target), record.size, until, record)
        else:
            state.release_ranges([target], record.size)
        return False

    def _add_copy(self, record: ObjectRecord, target: int) -> None:
        """A verified copy becomes one more DRAM replica: told to its segment, counted to its owner."""
        state = self.state
        record.replicas = (*record.replicas, target)
        state.commits.committed(replica_segment(target), replica_offset(target), record)
        if record.owner is not None:
            record.owner.used += state.aligned(record.size)
        state.now_in_dram(record)  # its source may have left DRAM meanwhile
        state.events.changed(record, "copied")

    def _drop_source(self, record: ObjectRecord, source: int, target: int, acked: bool) -> None:
        """A move's target acknowledged its copy (`acked`): the source replica goes (its drop notice
        now, its range once the readers' leases end). Not acked (the target went first), or the
        object changed meanwhile (removed, replaced, either copy gone): nothing to do here."""
        state = self.state
        self._moving.discard(id(record))
        if not acked or state.visible(record.name) is not record:
            return
        if source in record.replicas and target in record.replicas:
            if replica_tier(source) == TIER_DRAM:
                state.drop_dram_replica(record, replica_segment(source))
                state.events.changed(record, "drained")
            else:  # its segment tombstones the disk copy (FORGET)
                state.tiering.remove_disk_copy(record, source, forget=True, reason="drained")

    def tick(self, now: float) -> None:
        """Release the targets of migration batches nobody finished (the drainer died)."""
        timeout = self.state.config.put_timeout_s
        for migration_id in [m for m, b in self._batches.items() if now - b.started_at > timeout]:
            for item in self._batches.pop(migration_id).items:
                self._finish(item, moved=False)

    def _by_name(self, name: str) -> SegmentRecord | None:
        return self.state.segment_named(name)
