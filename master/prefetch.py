"""Prefetch on lookup: an Exists with `prefetch` starts moving disk-only objects it finds into DRAM.

An engine asks "which of these blocks do you have?" and, a moment later,
loads them. When the answer is "on SSD", that load is a disk read. With
prefetch the lookup itself queues a PROMOTE task for each disk-only object
it found (for a prefix lookup: those within the present prefix, the only
ones the engine will load), regardless of `promote_after_reads`, so that by
the time the engine's get arrives the object is usually a DRAM hit. A get
that arrives first is served from the SSD copy, correctly; prefetch only
changes which tier serves it.

Bounds:
- the promotion budget (`promotion_budget`): DRAM bytes of promotions in
  flight per segment; a prefetch past it is skipped, never queued;
- the deadline: a PROMOTE not reported within the task TTL expires and its
  DRAM range is freed (kvtier.master.tiering);
- room: a promotion takes a free DRAM range below the high watermark, or
  makes one by dropping DRAM copies that are redundant (the object keeps
  another replica, typically its SSD copy), least recently used first, never
  leased, never an object's only copy, never one being offloaded. Failing
  that, the prefetch is skipped: prefetch never costs an object.

Counters (Tiering.counters, so `kvtier_master_tiering{event}` and `kvtier
status --json` carry them): prefetch_started, prefetch_completed,
prefetch_failed (the PROMOTE failed or expired), prefetch_skipped_<reason>
with reason in SKIP_REASONS.

Runs on the master's thread like the rest of MasterState; never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.master.eviction import pick_victims
from kvtier.master.placement import REDUNDANT_SCAN, fits_after
from kvtier.master.records import TIER_SHIFT, TIER_SSD, ObjectRecord, ObjectState
from kvtier.master.state_types import SegmentRecord, SegmentState

if TYPE_CHECKING:
    from kvtier.master.state import MasterState

# Scopes: the values of proto `Prefetch` (ExistsRequest.prefetch); plain ints, no protobuf import here.
NONE, FOUND, PREFIX = 0, 1, 2

IN_FLIGHT = "in_flight"  # a promotion of the object is already queued or running
BUDGET = "budget"  # the segment's promotion budget is spent
NO_SPACE = "no_space"  # no free DRAM range, and redundant copies would not make one
UNAVAILABLE = "unavailable"  # no segment holding its disk copy takes allocations now
QUOTA = "quota"  # the DRAM copy would take the object's rank over its quota
SKIP_REASONS = (IN_FLIGHT, BUDGET, NO_SPACE, UNAVAILABLE, QUOTA)


def prefetch(state: MasterState, namespace: str, keys: Sequence[str], found: Sequence[bool], scope: int) -> None:
    """Start promoting the disk-only objects among `keys` that an Exists `found`: every one with
    FOUND, only those of the leading run with PREFIX."""
    if scope not in (FOUND, PREFIX):
        return
    for key, present in zip(keys, found, strict=True):
        if not present:
            if scope == PREFIX:
                return
            continue
        record = state.record(namespace, key)
        if record is not None and record.state is ObjectState.COMPLETE:
            _prefetch_one(state, record)


def _prefetch_one(state: MasterState, record: ObjectRecord) -> None:
    tiering = state.tiering
    counters = tiering.counters
    disk = [r for r in record.replicas if r >> TIER_SHIFT & 0b11 == TIER_SSD]
    if len(disk) < len(record.replicas) or not disk:
        return  # it has a DRAM copy: already a DRAM hit
    if tiering.promoting(record.name):
        counters[f"prefetch_skipped_{IN_FLIGHT}"] += 1
        return
    reason = UNAVAILABLE
    for packed in disk:
        segment = state.segments.get(packed >> TIER_SHIFT >> 2)
        if segment is None or segment.state is not SegmentState.ACTIVE:
            continue
        if not tiering.promotion_room(segment, record.size, record):
            reason = QUOTA if tiering.promotion_room(segment, record.size) else BUDGET
            continue
        offset = _dram_range(state, segment, record.size)
        if offset is None:
            reason = NO_SPACE
            continue
        tiering.promote(record, segment, packed, offset, prefetch=True)
        counters["prefetch_started"] += 1
        return
    counters[f"prefetch_skipped_{reason}"] += 1


def _dram_range(state: MasterState, segment: SegmentRecord, size: int) -> int | None:
    """A DRAM range of `size` bytes on `segment` below its high watermark, dropping redundant copies
    there if that is what it takes (see the module docstring); None when there is none."""
    if not size:
        return 0
    allocator = segment.allocator
    limit = state.config.high_watermark * allocator.capacity
    if allocator.used + size <= limit:
        offset = allocator.allocate(size)
        if offset is not None:
            return offset
    aligned = state.aligned(size)
    need = max(aligned, int(allocator.used + aligned - limit))
    on_segment = state.has_dram_on(segment.segment_id)
    offloading = state.tiering.offloading
    now = state.clock()

    def redundant(victim: ObjectRecord) -> bool:
        # and its range free at once (kvtier.master.placement.victims_for): else dropped for nothing
        return (
            len(victim.replicas) > 1
            and victim.name not in offloading
            and on_segment(victim)
            and state.frees_now(victim, now)
        )

    victims = pick_victims(state.dram_lru(), now, need, state.replica_bytes, redundant, scan_limit=REDUNDANT_SCAN)
    if sum(state.replica_bytes(v) for v in victims) < need or not fits_after(state, segment, victims, aligned):
        return None
    for victim in victims:
        state.evict_one(victim, "prefetch", segment.segment_id)
    return allocator.allocate(size)
