"""Placement: which segments get a new object's replicas, and making room there.

Functions over `MasterState`'s tables through its public methods (same owner,
same thread); split out of state.py to keep each module readable. Preference per key: segments
writers can likely reach first, the put's preferred segment, then segments on the writer's host,
then the highest free ratio; replicas on distinct segments, on distinct hosts first. When nothing
fits, LRU eviction on the most preferred segment that could hold the range, only where it will
work (a refused put must not destroy anything).

"Likely reachable" excludes (shuns) a segment whose heartbeats stopped, one in quarantine
(kvtier.master.quarantine: clients reported it failing) and one the writer itself just failed on
(PutStartRequest.avoid_segments). A shunned segment is a last resort, tried only once no other
segment can take the range, eviction included: a write sent there would most likely hang until
the writer's timeout, which costs more than an evicted object's recompute. Not excluded outright:
a false alarm (or a cluster of one segment) must not refuse every put.
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from kvtier.master.eviction import pick_victims
from kvtier.master.placement_order import place_on, shunned, used_ratio
from kvtier.master.records import OFFSET_MASK, TIER_SHIFT, ObjectRecord, replica
from kvtier.master.tier_tasks import dram_key

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, PutOptions, SegmentRecord

REDUNDANT_SCAN = 4096  # records looked at for redundant copies before plain LRU eviction


def static_rank(
    active: list[SegmentRecord],
    options: PutOptions,
    silent_since: float = float("-inf"),
    quarantined: Container[str] = frozenset(),
) -> dict[int, tuple[bool, bool, bool]]:
    """The batch-constant part of placement preference: not shunned, preferred segment, then the
    writer's host. Shunned (see the module docstring), even when preferred: a segment whose last
    heartbeat is older than `silent_since` (cut off, frozen: the master expels it only at
    segment_ttl_s), one in `quarantined`, one in the put's `avoid_segments`."""
    avoid = options.avoid_segments
    return {
        s.segment_id: (
            shunned(s, silent_since, quarantined, avoid),
            s.name != options.preferred_segment,
            not options.client_host or s.host_id != options.client_host,
        )
        for s in active
    }


# The placeable segments, the largest capacity among them, and their static rank (static_rank).
Ranking = tuple[list["SegmentRecord"], int, dict[int, tuple[bool, bool, bool]]]


def full_ranking(state: MasterState, options: PutOptions, silent_since: float) -> Ranking:
    """What ranking every segment for a key takes (a pass over them all): see `place`."""
    active = [s for s in state.segments.values() if s.placeable]
    largest = max((s.capacity for s in active), default=0)
    return active, largest, static_rank(active, options, silent_since, state.quarantine.names)


def place(
    state: MasterState, active: list[SegmentRecord], static: dict[int, tuple[bool, bool]], size: int, replicas: int
) -> tuple[int, ...] | None:
    """Ranges on `replicas` distinct segments (distinct hosts first); None if they do not fit.

    Preference: `static` (preferred segment, writer's host), then the
    highest free ratio, re-evaluated per key as the batch fills segments.
    Tries each segment in that order, then evicts LRU objects from
    segments in that order until the range fits. (A PutStart asks its
    PlacementOrder for the first choice of a single-replica key before this:
    kvtier.master.placement_order.)
    """

    def rank(segment: SegmentRecord) -> tuple:
        return static[segment.segment_id], used_ratio(segment)

    if replicas == 1 and size:  # the common case: one O(segments) pass instead of a sort
        placed = place_on(active[0] if len(active) == 1 else min(active, key=rank), size)
        if placed is not None:
            return placed
    order = sorted(active, key=rank)
    # Every replica's place first, then the evictions: a put refused for its second replica had
    # already evicted objects for its first (3 of them, for nothing, in the tester's run).
    placed: list[int] = []  # replicas allocated without eviction
    plan: list[tuple[SegmentRecord, int | list[ObjectRecord]]] = []  # per replica, in preference order
    used_hosts: set[str] = set()
    used_segments: set[int] = set()
    # Records planned as victims on an earlier segment are not planned again: each plan saw the other's
    # copy still there ("redundant", not an only copy that offload should take), and the two
    # evictions dropped both copies of one object.
    taken: set[int] = set()
    for _ in range(replicas):
        fresh_host = [s for s in order if s.segment_id not in used_segments and s.host_id not in used_hosts]
        others = [s for s in order if s.segment_id not in used_segments and s.host_id in used_hosts]
        candidates = fresh_host + others
        # Shunned segments only once the others cannot take the range even by eviction.
        segment, where = room_on(state, [s for s in candidates if not static[s.segment_id][0]], size, taken)
        if segment is None:
            segment, where = room_on(state, [s for s in candidates if static[s.segment_id][0]], size, taken)
        if segment is None:
            state.release_ranges(placed, size)
            return None
        if isinstance(where, int):
            placed.append(replica(segment.segment_id, where))
            segment.objects += 1
        else:
            taken.update(map(id, where))
        plan.append((segment, where))
        used_segments.add(segment.segment_id)
        used_hosts.add(segment.host_id)
    out = []  # in preference order, as planned
    for segment, where in plan:
        if not isinstance(where, int):
            offset = evict_for(state, segment, where, size)
            if offset is None:  # fits_after said it would: not expected, but never leave ranges behind
                state.release_ranges(placed, size)
                return None
            placed.append(replica(segment.segment_id, offset))
            segment.objects += 1
            where = offset
        out.append(replica(segment.segment_id, where))
    return tuple(out)


def allocate_on(state: MasterState, candidates: list[SegmentRecord], size: int) -> tuple[SegmentRecord | None, int]:
    """A range of `size` bytes on the first candidate with room, by eviction where it will work."""
    segment, where = room_on(state, candidates, size)
    if segment is None:
        return None, 0
    if isinstance(where, int):
        return segment, where
    offset = evict_for(state, segment, where, size)
    return (segment, offset) if offset is not None else (None, 0)


def room_on(
    state: MasterState, candidates: list[SegmentRecord], size: int, taken: Container[int] = frozenset()
) -> tuple[SegmentRecord | None, int | list[ObjectRecord]]:
    """Where `size` bytes go among `candidates`, in their order: (segment, offset) of a range
    allocated there now, else (segment, victims) for the first one where evicting the victims makes
    room (nothing evicted yet: `evict_for`; none of the records whose id() is in `taken`), else
    (None, 0)."""
    if size == 0:  # nothing to store, but the object still lives on a segment
        return (candidates[0], 0) if candidates else (None, 0)
    for segment in candidates:
        offset = segment.allocator.allocate(size)
        if offset is not None:
            return segment, offset
    need = state.aligned(size)
    for segment in candidates:
        victims = victims_for(state, segment, need, taken)
        if victims is not None:
            return segment, victims
    return None, 0


def victims_for(
    state: MasterState, segment: SegmentRecord, need: int, taken: Container[int] = frozenset()
) -> list[ObjectRecord] | None:
    """The objects whose DRAM copies on `segment`, evicted, leave a contiguous free run of `need` bytes
    there; None when no choice can (then nothing is evicted: a refused put must not destroy anything).
    Only copies whose ranges go back to the allocator at once count: one still under a lease, a
    write grant or the clock-skew margin (kvtier.master.range_book) frees nothing now, and evicting
    it for room lost it for nothing."""
    pressure = state.pressure
    if segment.capacity < need or segment.segment_id in pressure.blocked:
        return None
    # The least recently used victims that add up to `need` usually do; otherwise check everything
    # evictable here; if even that cannot make room, evict nothing.
    now = state.clock()
    on_segment = state.has_dram_on(segment.segment_id)
    frees_now = state.frees_now

    def here(record: ObjectRecord) -> bool:
        return on_segment(record) and frees_now(record, now) and id(record) not in taken

    # Under dram_full_policy "wait", an object's only copy that the SSD tier could take is
    # never dropped for room (kvtier.master.backpressure): the put waits for offload instead.
    protected = pressure.protected(segment)
    eligible = here if protected is None else lambda r: here(r) and not protected(r)
    # Copies that are redundant (the object has another replica, e.g. offloaded to SSD)
    # go first: dropping them loses nothing. A bounded look only, then the eviction policy's order.
    victims = pick_victims(
        state.dram_lru(),
        now,
        need,
        state.replica_bytes,
        lambda r: len(r.replicas) > 1 and here(r),
        scan_limit=REDUNDANT_SCAN,
    )
    if fits_after(state, segment, victims, need):
        return victims
    victims = state.policy.victims(now, need, state.replica_bytes, eligible)
    if fits_after(state, segment, victims, need):
        return victims
    victims = state.policy.victims(now, segment.capacity, state.replica_bytes, eligible)
    if fits_after(state, segment, victims, need):
        return victims
    if protected is not None:
        everything = pick_victims(state.dram_lru(), now, segment.capacity, state.replica_bytes, here)
        if fits_after(state, segment, everything, need):
            pressure.behind(segment, need)  # room once offload catches up: the put waits
    return None


def evict_for(state: MasterState, segment: SegmentRecord, victims: list[ObjectRecord], size: int) -> int | None:
    """Evict `victims` (from `victims_for`) one at a time, least recently used first, until `size`
    bytes fit on `segment`: the offset allocated, None if they never did."""
    for victim in victims:
        state.evict_one(victim, "allocation", segment.segment_id)
        offset = segment.allocator.allocate(size)
        if offset is not None:
            return offset
    return None


def fits_after(state: MasterState, segment: SegmentRecord, victims: list[ObjectRecord], need: int) -> bool:
    """Whether freeing the victims' ranges on `segment` leaves a contiguous free run of `need` bytes."""
    segment_id = segment.segment_id
    spans = list(segment.allocator.free_spans())
    for record in victims:
        if record.size:
            aligned = state.aligned(record.size)
            dram = dram_key(segment_id)
            spans.extend((r & OFFSET_MASK, aligned) for r in record.replicas if r >> TIER_SHIFT == dram)
    spans.sort()
    run_start = run_end = -1
    for start, length in spans:
        if start == run_end:
            run_end += length
        else:
            run_start, run_end = start, start + length
        if run_end - run_start >= need:
            return True
    return False
