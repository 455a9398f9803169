"""The master's books of DRAM ranges: when a freed object's ranges may go to another object, and
the bytes a record's replicas take. A mixin of `MasterState` (kvtier.master.state), like
`SegmentTable`: its `self` is the MasterState, whose private tables it may use.

A range is reused only once nothing issued for its previous life can still act on it: read leases
(releasable ones end when their readers hand them back, kvtier.master.leases), the PutStart's write
grant (`capability_ttl_s`), the clock skew a segment may have (`reuse_margin_s`), and a same-host
writer still copying into it: a client that maps the region copies without the segment and cannot
be stopped by it, so where the segment reports its writers (writer slots, kvtier.proto.region) the
range of a put that never completed is `held` until a report taken after its grant's end shows no
copy in it (`writers_reported`); one stopped mid-copy (SIGSTOP) keeps it from other objects for as
long as it lives, and its death gives it back. A range a report names as being written that the books
have free (the master restarted, or the segment mounted again, while a writer was stopped) is taken
out of the free space the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from kvtier.master.records import (
    TIER_SHIFT,
    ObjectRecord,
    ObjectState,
    replica_offset,
    replica_segment,
)
from kvtier.master.state_types import SegmentRecord, SegmentState
from kvtier.master.tier_tasks import dram_key, is_dram
from kvtier.proto.auth import wall_ms

_PENDING = ObjectState.PENDING


class RangeBook:
    def _reuse_at(self, record: ObjectRecord) -> float:
        """When the record's ranges may go to another object: after its read leases and its PutStart's
        write grant (`capability_ttl_s`: its tags, or its frames' deadline), plus the clock skew a
        segment may have (`reuse_margin_s`): no frame granted on them can still act (kvtier.proto.frames).
        The write grant counts for a put never completed (revoked, reclaimed: its writer may still be
        sending) and, with capabilities, for every object (its write tags verify until they expire)."""
        until = record.lease_until
        if self.capability_ttl_s and (self.capabilities or record.state is _PENDING):
            until = max(until, record.started_at + self.capability_ttl_s)
        return until + self.reuse_margin_s

    def frees_now(self, record: ObjectRecord, now: float) -> bool:
        """Whether dropping `record`'s DRAM copies gives their ranges back at once (eviction for room
        takes only those: the others free nothing before `_reuse_at`)."""
        return self._reuse_at(record) <= now

    def free_after_leases(
        self, segment_id: int, offset: int, size: int, until: float, record: ObjectRecord | None = None
    ) -> None:
        """Free a DRAM range when the read leases on it end (tick); until then nobody reuses it.
        A range of `record` under releasable leases waits for their readers instead, and is
        freed when the last one releases (`_ranges_unread`), or at `until` when they never do."""
        if (segment := self.segments.get(segment_id)) is not None:
            segment.releasing += self.aligned(size)  # until `_ranges_unread` or the tick frees it
        if record is not None and self.leases.park(record, segment_id, offset, size):
            return
        heapq.heappush(self._deferred, (until, next(self._seq), segment_id, offset, size))

    def _ranges_unread(self, record: ObjectRecord, ranges: list[tuple[int, int, int]]) -> None:
        """The last releasable lease on `record` ended: its parked ranges are freed now, or when
        what else protects them ends (other leases, write grants, the clock-skew margin)."""
        reuse_at = self._reuse_at(record)
        now = self.clock()
        for segment_id, offset, size in ranges:
            if (segment := self.segments.get(segment_id)) is None:
                continue  # dropped meanwhile: its allocator went with it (and no deferral may outlive it)
            if reuse_at > now:
                heapq.heappush(self._deferred, (reuse_at, next(self._seq), segment_id, offset, size))
            else:
                segment.allocator.release(offset, size)
                segment.releasing -= self.aligned(size)

    def held_for_writers(self, replicas: Iterable[int], size: int, wait_s: float) -> list[int]:
        """Hold the DRAM ranges (`size` bytes each) of a put that never completed (or a migration target
        never filled) on segments that report their same-host writers, until a report taken at least
        `wait_s` from now (its grant and the clock skew margin) shows no writer in them
        (`writers_reported`). The replicas not held (other segments, or nothing to hold)."""
        rest = []
        wait_s = max(wait_s, 0.0)
        reuse_at, due_ms = self.clock() + wait_s, wall_ms() + int(wait_s * 1000) + 1
        for packed in replicas:
            segment = self.segments.get(replica_segment(packed))
            if segment is None or not segment.writer_slots or not size:
                rest.append(packed)
                continue
            segment.objects -= 1
            segment.releasing += self.aligned(size)
            segment.held.append((reuse_at, due_ms, replica_offset(packed), size))
        return rest

    def writers_reported(
        self,
        segment_id: int,
        sampled_ms: int,
        ranges: list[tuple[int, int]],
        stalled: list[tuple[int, int]] | None = None,
    ) -> None:
        """A segment's report of the same-host copies in progress at `sampled_ms` (its wall clock, the
        one its writers judge their grants by), and of those the ones past their grant (`stalled`).
        Held ranges due by then (and by this master's clock: tcp frames are judged on that) that no
        copy touches are freed. Free ranges a stalled copy is in are held: a copy within its grant is
        in a range allocated to its put (or held since), and the ranges a restarted master or a
        segment mounted again never allocated are named at its mount (`writers_at_mount`)."""
        segment = self.segments.get(segment_id)
        if segment is None or not segment.writer_slots:
            return
        segment.writer_ranges = tuple(ranges)
        if segment.held:
            now = self.clock()
            keep = []
            for entry in segment.held:
                reuse_at, due_ms, offset, size = entry
                if reuse_at <= now and due_ms <= sampled_ms and not _touches(offset, self.aligned(size), ranges):
                    segment.allocator.release(offset, size)
                    segment.releasing -= self.aligned(size)
                else:
                    keep.append(entry)
            segment.held = keep
        if stalled and segment.state is not SegmentState.RECOVERING:
            self._hold_free(segment, stalled)

    def writers_at_mount(self, segment_id: int, ranges: list[tuple[int, int]]) -> None:
        """The copies in progress a segment named when it mounted (all of the previous mount's grants):
        what of them the books have free is held now, or (a segment reporting its inventory, rebuilt in
        offset order) once its inventory is in (`inventory_done` calls `writers_after_inventory`)."""
        segment = self.segments.get(segment_id)
        if segment is None or not segment.writer_slots:
            return
        if segment.state is SegmentState.RECOVERING:
            segment.mount_writers = tuple(ranges)
        else:
            self._hold_free(segment, ranges)

    def writers_after_inventory(self, segment_id: int) -> None:
        segment = self.segments.get(segment_id)
        if segment is not None and segment.mount_writers:
            self._hold_free(segment, segment.mount_writers)
            segment.mount_writers = ()

    def stalled_held_bytes(self, segment: SegmentRecord) -> int:
        """Bytes of held ranges a writer was still in at the last report (stopped mid-copy: they come
        back only when it goes on or dies; the other held ranges leave at the next report)."""
        ranges = segment.writer_ranges
        return sum(
            self.aligned(size) for _, _, offset, size in segment.held if _touches(offset, self.aligned(size), ranges)
        )

    def _hold_free(self, segment: SegmentRecord, ranges: Iterable[tuple[int, int]]) -> None:
        for offset, length in ranges:
            for start, size in segment.allocator.reserve_free(offset, length):
                segment.releasing += size
                segment.held.append((0.0, 0, start, size))

    def release_ranges(self, replicas: Iterable[int], size: int) -> None:
        """Give the DRAM ranges of `replicas` (each `size` bytes) back to their allocators now: the
        caller knows no lease or write grant covers them (else `free_after_leases`)."""
        for packed in replicas:
            segment = self.segments.get(replica_segment(packed))
            if segment is None:
                continue
            segment.objects -= 1
            if size:
                segment.allocator.release(replica_offset(packed), size)

    def aligned(self, size: int) -> int:
        """DRAM bytes one replica of `size` bytes takes (rounded up to the allocator's alignment)."""
        alignment = self.config.alignment
        return -(-size // alignment) * alignment

    def _record_bytes(self, record: ObjectRecord) -> int:
        """DRAM bytes of all its replicas (disk copies cost no DRAM and no quota)."""
        return self.aligned(record.size) * sum(1 for r in record.replicas if is_dram(r))

    def replica_bytes(self, record: ObjectRecord) -> int:
        """DRAM bytes one replica of `record` frees: the weight eviction counts per victim."""
        return self.aligned(record.size)

    @staticmethod
    def has_dram_on(segment_id: int) -> Callable[[ObjectRecord], bool]:
        """A predicate: whether a record has a DRAM replica on `segment_id` (eviction's filter)."""
        dram = dram_key(segment_id)
        return lambda record: any(r >> TIER_SHIFT == dram for r in record.replicas)


def _touches(offset: int, size: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether [offset, offset + size) overlaps any (start, length) of `ranges`."""
    end = offset + size
    return any(start < end and offset < start + length for start, length in ranges)
