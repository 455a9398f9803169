"""The first choice of segment for a single-replica put, without a pass over every segment.

Placement (kvtier.master.placement) ranks the placeable segments for each key: not shunned first,
then the put's preferred segment, then segments on the writer's host, then the lowest used ratio,
ties in mount order. Done as a pass over all segments per key, a master with one segment per
engine rank on many hosts paid that pass on every PutStart and on every key of a batch
(`kvtier bench --master-placement`: 61x the one-segment cost per single-key put at 1024 segments).

`PlacementOrder` keeps the segments by used ratio in a heap that lives as long as the master's
tables, so the first choice costs O(log segments):
- The allocators say when they change: each has this order's `dirty` list as its watch list and
  puts itself on it at its first change since the last look (kvtier.master.allocator). Every
  answer first re-keys the segments whose allocators changed; an entry whose ratio is not its
  segment's current one is stale and skipped (lazy deletion). So the heap is exact at each answer,
  whatever changed the allocators in between (puts, evictions, releases, moves, recovery).
- Mounts add segments, drops remove them; whether a segment is placeable (active, saved, its clock
  within tolerance) and whether it is shunned (silent, quarantined, avoided by the writer) is asked
  of the candidates as they come off the heap, never cached: segments that fail either are put back
  after the answer. Such segments are few; a cluster where many are (all recovering) pays a pop
  for each.
- The preferred segment is found by name and the writer's host by a host index; only without an
  eligible one of those is the heap consulted.

`first` answers the same segment as the full ranking (tests/unit/master/test_placement.py compares
them under random changes), or None when the ranking's first segment would be a shunned one, when
there is none, or when more than MAX_PASSED segments ahead of the answer were not eligible: the
caller then ranks in full (`place`), as it does when the first choice has no room for the range,
and asks no more for the rest of its PutStart (eligibility does not change within one).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Container
from typing import TYPE_CHECKING

from kvtier.master.records import SEGMENT_SHIFT

if TYPE_CHECKING:
    from kvtier.master.allocator import OffsetAllocator
    from kvtier.master.state_types import SegmentRecord


# Segments not eligible now (shunned, not placeable) looked past before `first` gives up and leaves
# the key to the full ranking: a cluster whose best segments are all silent (a partition) or
# skewed pays at most this per answer, not a pop for every segment.
MAX_PASSED = 32


def used_ratio(segment: SegmentRecord) -> float:
    allocator = segment.allocator
    return allocator.used / allocator.capacity if allocator.capacity else 1.0


def shunned(segment: SegmentRecord, silent_since: float, quarantined: Container[str], avoid: Container[str]) -> bool:
    """A last resort for placement (kvtier.master.placement): its last heartbeat is older than
    `silent_since` (cut off, frozen), it is in quarantine, or the writer avoids it. The one
    definition, for the full ranking and for this order alike."""
    return segment.last_heartbeat < silent_since or segment.name in quarantined or segment.name in avoid


def place_on(segment: SegmentRecord, size: int) -> tuple[int, ...] | None:
    """A single replica of `size` bytes on `segment` (counted there), or None if it has no room."""
    offset = segment.allocator.allocate(size)
    if offset is None:
        return None
    segment.objects += 1
    return (segment.segment_id << SEGMENT_SHIFT | offset,)  # kvtier.master.records.replica, inlined: hot


class PlacementOrder:
    """Mounted segments by used ratio (see the module docstring). Event loop only, like MasterState."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []  # (used ratio, segment id); stale entries skipped
        self._ratio: dict[int, float] = {}  # segment id -> the ratio of its live heap entry
        self._segments: dict[int, SegmentRecord] = {}
        self._by_name: dict[str, SegmentRecord] = {}  # a name is mounted once (a remount drops the old)
        self._by_host: dict[str, list[SegmentRecord]] = {}
        self._by_allocator: dict[int, SegmentRecord] = {}  # id(allocator) -> its segment
        self.dirty: list[OffsetAllocator] = []  # allocators changed since the last answer

    def add(self, segment: SegmentRecord) -> None:
        """A mounted segment (ids grow with each mount: their order is the mount order)."""
        self._segments[segment.segment_id] = segment
        self._by_name[segment.name] = segment
        self._by_host.setdefault(segment.host_id, []).append(segment)
        self._by_allocator[id(segment.allocator)] = segment
        segment.allocator.watch = self.dirty
        self._push(segment)

    def remove(self, segment_id: int) -> None:
        """A dropped segment: its heap entries become stale."""
        segment = self._segments.pop(segment_id, None)
        if segment is None:
            return
        self._ratio.pop(segment_id, None)
        if self._by_name.get(segment.name) is segment:
            del self._by_name[segment.name]
        del self._by_allocator[id(segment.allocator)]
        allocator = segment.allocator
        if allocator.watched:  # not kept alive on the list until the next answer, which may never come
            self.dirty.remove(allocator)
            allocator.watched = False
        allocator.watch = None
        peers = self._by_host[segment.host_id]
        peers.remove(segment)
        if not peers:
            del self._by_host[segment.host_id]

    def first(
        self,
        preferred: str,
        client_host: str,
        silent_since: float,
        quarantined: Collection[str],
        avoid: Collection[str],
    ) -> SegmentRecord | None:
        """The placeable segment the full ranking puts first, or None when that would be a shunned
        one (or no segment is placeable): see the module docstring. On every put's path: each
        case costs what it must and no more."""

        def eligible(segment: SegmentRecord) -> bool:
            return segment.placeable and not shunned(segment, silent_since, quarantined, avoid)

        segments = self._segments
        if len(segments) == 1:  # the only one, whatever its ratio (the heap catches up when another comes)
            for only in segments.values():
                return only if eligible(only) else None
        if preferred and (named := self._by_name.get(preferred)) is not None and eligible(named):
            return named
        if client_host and (peers := self._by_host.get(client_host)):
            local = [s for s in peers if eligible(s)]
            if local:
                return local[0] if len(local) == 1 else min(local, key=lambda s: (used_ratio(s), s.segment_id))
        if self.dirty:
            self._refresh()
        heap, ratios = self._heap, self._ratio
        passed: list[tuple[float, int]] = []  # live entries of segments not eligible now: put back
        found = None
        while heap and len(passed) < MAX_PASSED:
            ratio, segment_id = heap[0]
            if ratios.get(segment_id) != ratio:  # stale: a newer entry (or none) stands for it
                heapq.heappop(heap)
                continue
            segment = segments[segment_id]
            if eligible(segment):
                found = segment
                break
            passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found

    def _refresh(self) -> None:
        """Re-key the segments whose allocators changed since the last answer."""
        dirty = self.dirty
        by_allocator = self._by_allocator
        for allocator in dirty:
            allocator.watched = False
            segment = by_allocator.get(id(allocator))
            if segment is not None:
                self._push(segment)
        dirty.clear()

    def _push(self, segment: SegmentRecord) -> None:
        ratio = used_ratio(segment)
        if self._ratio.get(segment.segment_id) == ratio:
            return  # its live entry already says so
        self._ratio[segment.segment_id] = ratio
        heap = self._heap
        if len(heap) > 4 * len(self._ratio) + 64:  # mostly stale entries: keep the live ones only
            heap[:] = [(live, segment_id) for segment_id, live in self._ratio.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (ratio, segment.segment_id))
