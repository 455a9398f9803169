"""The choice of eviction victims, in the order the cluster's `eviction_policy` gives them.

The order comes from kvtier.master.eviction_policy: under `lru` it is the
master's object dict, whose order is recency (a record is inserted at the
end by PutStart, its PutEnd following within milliseconds, and moves to the
end when it is read; existence checks never move it); under `s3fifo` it is
that policy's small and main queues. `pick_victims` walks the order it is
given from its first (least valuable) end and applies the rules below.

Victim rules, in this order (they are what makes eviction safe):
- a pending record (bytes still in flight) is never a victim;
- a record whose read lease has not ended is never a victim (its bytes may
  be in flight to a reader);
- a hard-pinned record (pinned until +inf) is never a victim;
- a soft-pinned record whose pin has not expired is a victim only when the
  unpinned candidates do not free enough;
- otherwise least recently used first, among the records the caller's
  predicate accepts (on this segment, of this rank, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvtier.master.records import ObjectRecord, ObjectState

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, SegmentRecord

_COMPLETE = ObjectState.COMPLETE


def pick_victims(
    records: Iterable[ObjectRecord],
    now: float,
    need: int,
    weight: Callable[[ObjectRecord], int],
    eligible: Callable[[ObjectRecord], bool],
    scan_limit: int = 0,
) -> list[ObjectRecord]:
    """LRU-first records that `eligible` accepts, until their `weight` adds up to `need`.

    `records` is in least-recently-used-first order. Returns fewer when not
    enough can be evicted; the caller decides whether that is a failure.
    `scan_limit` > 0 bounds how many records are looked at (for optional,
    opportunistic passes that must not cost O(objects)).
    """
    chosen: list[ObjectRecord] = []
    soft: list[ObjectRecord] = []
    freed = 0
    if need <= 0:
        return chosen
    for scanned, record in enumerate(records, 1):
        if scan_limit and scanned > scan_limit:
            break
        if record.state is not _COMPLETE or record.lease_until > now or record.pin_until == math.inf:
            continue
        if not eligible(record):
            continue
        if record.pin_until > now:
            soft.append(record)
            continue
        chosen.append(record)
        freed += weight(record)
        if freed >= need:
            return chosen
    for record in soft:
        chosen.append(record)
        freed += weight(record)
        if freed >= need:
            break
    return chosen


def evict_to_watermark(state: MasterState, segment: SegmentRecord, need: int) -> None:
    """Free `need` DRAM bytes on `segment`: offload LRU objects to its SSD tier when it has one
    (their bytes are freed when the copy is durable), else drop their copies there."""
    tiering = state.tiering
    segment_id = segment.segment_id
    # Already on their way out: offloads that free their copies once durable, and ranges of copies
    # gone that are reusable once their leases and margin end. Evicting live objects for those
    # freed nothing sooner: a writer of leased objects had every live one evicted, again and again.
    # Not ranges held for a same-host writer stopped mid-copy: those come back only when it goes on.
    need -= tiering.evicting_bytes(segment_id) + segment.releasing - state.stalled_held_bytes(segment)
    if need <= 0:
        return
    on_segment = state.has_dram_on(segment_id)
    evicting = tiering.evicting  # a copy-ahead offload in flight may become one that frees room
    eligible = lambda r: on_segment(r) and not evicting(r.name)  # noqa: E731
    victims = state.policy.victims(state.clock(), need, state.replica_bytes, eligible)  # lru or s3fifo
    offload = tiering.can_offload(segment)
    for victim in victims:
        if offload and tiering.offload(victim, segment):
            continue
        state.evict_one(victim, "watermark", segment_id)
