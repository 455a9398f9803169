"""Placement (kvtier.master.placement): which segments get a new object's replicas, and making room.

Through placement's own functions over a real MasterState driven by a fake clock: given segments
and objects, when a range is asked for, then where it goes and what was evicted for it.
"""

from __future__ import annotations

import random

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.placement import allocate_on, fits_after, place, static_rank
from kvtier.master.records import PIN_HARD, PIN_NONE, ObjectRecord, replica, replica_offset, replica_segment
from kvtier.master.state import MasterState, PutOptions
from kvtier.master.state_types import SegmentState
from kvtier.proto.status import Status

KiB = 1 << 10
MiB = 1 << 20
NS = "ns"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0)
    return MasterState(config.validate(), clock=clock)


def mount(state: MasterState, name: str, host: str = "", capacity: int = MiB):
    result = state.mount_segment("unit", name, host or f"host-{name}", [f"tcp://127.0.0.1:9/{name}"], capacity)
    assert result.status == Status.OK, result.error
    return state.segments[result.segment.segment_id]


def put(state: MasterState, key: str, size: int, pin: int = PIN_NONE) -> tuple[int, int]:
    """A complete put of one key; (segment id, offset) of its replica."""
    started = state.put_start(NS, [key], [size], 1, PutOptions(pin=pin))
    assert started.statuses == [Status.OK], started.first_error
    assert state.put_end(NS, [key], [7], started.put_id) == [Status.OK]
    return started.replica_segments[0], started.replica_offsets[0]


def present(state: MasterState, *keys: str) -> list[bool]:
    return state.exists(NS, list(keys))[0]


def test_static_rank_puts_the_named_segment_first_then_the_writers_host(state: MasterState):
    a, b, c = mount(state, "a", "h1"), mount(state, "b", "h2"), mount(state, "c", "h2")
    rank = static_rank([a, b, c], PutOptions(preferred_segment="c", client_host="h2"))
    assert sorted([a, b, c], key=lambda s: rank[s.segment_id])[0] is c
    assert rank[b.segment_id] < rank[a.segment_id], "the writer's host before another host"
    unranked = static_rank([a, b, c], PutOptions())
    assert len(set(unranked.values())) == 1, "without a preference every segment ranks the same"


def test_one_replica_goes_to_the_emptiest_segment(state: MasterState):
    fuller, emptier = mount(state, "fuller"), mount(state, "emptier")
    assert fuller.allocator.allocate(512 * KiB) is not None
    active = [fuller, emptier]
    placed = place(state, active, static_rank(active, PutOptions()), 1000, 1)
    assert [replica_segment(p) for p in placed] == [emptier.segment_id]
    assert emptier.objects == 1


def test_the_preferred_segment_wins_while_it_has_room(state: MasterState):
    fuller, emptier = mount(state, "fuller"), mount(state, "emptier")
    assert fuller.allocator.allocate(512 * KiB) is not None
    active = [fuller, emptier]
    static = static_rank(active, PutOptions(preferred_segment="fuller"))
    assert replica_segment(place(state, active, static, 1000, 1)[0]) == fuller.segment_id


@pytest.mark.parametrize("seed", range(6))
def test_the_placement_order_answers_as_the_full_ranking_whatever_changes(state: MasterState, clock, seed: int):
    """PlacementOrder (segments by used ratio, kept across PutStarts) names exactly the segment the
    full ranking puts first, or None when that one is shunned or none is placeable: under puts,
    releases, allocations it did not make, segments draining, recovering, unsaved, skewed, silent,
    mounted and dropped, preferred segments, writers' hosts and avoid lists, ties included."""
    rng = random.Random(seed)
    for i in range(12):
        mount(state, f"s{i}", f"h{i % 3}", capacity=rng.choice([256, 512, 1024]) * KiB)
    order = state.placement_order
    held: list[tuple] = []  # (segment, offset, size) allocated so far
    answers = shunned_seen = 0
    for step in range(600):
        segments = list(state.segments.values())
        move = rng.random()
        if move < 0.2 and held:  # a release (an eviction, a removal)
            segment, offset, size = held.pop(rng.randrange(len(held)))
            if segment.segment_id in state.segments:
                segment.allocator.release(offset, size)
        elif move < 0.28:  # an allocation the order did not answer (a replica, a promotion)
            segment, size = rng.choice(segments), rng.choice([1, 4, 16]) * KiB
            if (offset := segment.allocator.allocate(size)) is not None:
                held.append((segment, offset, size))
        elif move < 0.36:  # placeability and liveness change under it
            segment = rng.choice(segments)
            flip = rng.randrange(5)
            if flip == 0:
                segment.state = rng.choice([SegmentState.ACTIVE, SegmentState.DRAINING, SegmentState.RECOVERING])
            elif flip == 1:
                segment.saved = not segment.saved
            elif flip == 2:
                segment.clock_skewed = not segment.clock_skewed
            else:
                segment.last_heartbeat = clock.now - rng.choice([0.0, 1000.0])
        elif move < 0.39 and len(segments) > 2:
            state.drop_segment(rng.choice(segments).segment_id, reason="unmounted")
        elif move < 0.42:
            mount(state, f"n{step}", f"h{rng.randrange(4)}", capacity=rng.choice([256, 512]) * KiB)
        else:
            names = [s.name for s in segments]
            options = PutOptions(
                preferred_segment=rng.choice(["", "", rng.choice(names), "gone"]),
                client_host=rng.choice(["", "h1", "h3"]),
                avoid_segments=rng.sample(names, rng.choice([0, 0, 1, 2])),
            )
            silent_since = clock.now - state.config.segment_suspect_s
            active = [s for s in state.segments.values() if s.placeable]
            static = static_rank(active, options, silent_since, state.quarantine.names)
            best = min(
                active, key=lambda s: (static[s.segment_id], s.allocator.used / s.allocator.capacity), default=None
            )
            expected = None if best is None or static[best.segment_id][0] else best
            got = order.first(
                options.preferred_segment, options.client_host, silent_since, state.quarantine.names,
                options.avoid_segments,
            )  # fmt: skip
            assert got is expected, (step, options)
            shunned_seen += any(rank[0] for rank in static.values())
            if got is not None:
                answers += 1
                size = rng.choice([1, 4, 16, 32]) * KiB
                if (offset := got.allocator.allocate(size)) is not None:  # the put that follows
                    held.append((got, offset, size))
    assert answers > 150 and shunned_seen > 50  # compared on a changing cluster, shunned segments in it


def test_the_placement_order_leaves_shunned_and_unplaceable_segments_to_the_full_ranking(state, clock):
    a, b = mount(state, "a", "h1"), mount(state, "b", "h2")
    silent_since = clock.now - state.config.segment_suspect_s
    order = state.placement_order
    assert order.first("", "", silent_since, (), ()) is a  # equal ratios: mount order
    assert b.allocator.allocate(4 * KiB) is not None and a.allocator.allocate(8 * KiB) is not None
    assert order.first("", "", silent_since, (), ()) is b  # the lower used ratio
    assert order.first("a", "", silent_since, (), ()) is a  # the preferred segment first
    assert order.first("", "h1", silent_since, (), ()) is a  # then the writer's host
    assert order.first("", "", silent_since, (), ("b",)) is a  # b avoided by this writer
    b.last_heartbeat = silent_since - 1.0
    assert order.first("b", "h2", silent_since, (), ()) is a  # b silent: shunned, even preferred
    a.state = SegmentState.DRAINING
    assert order.first("", "", silent_since, (), ()) is None  # only a shunned one left: the full ranking
    started = state.put_start(NS, ["k"], [KiB], 1, PutOptions())
    assert started.statuses == [Status.OK] and started.replica_segments == [b.segment_id]  # as a last resort
    state.drop_segment(b.segment_id, reason="unmounted")
    assert order.first("", "", silent_since, (), ()) is None
    assert state.put_start(NS, ["k2"], [KiB], 1, PutOptions()).statuses == [Status.NO_REPLICA]


def test_a_batch_spreads_over_many_segments_by_their_fill(state: MasterState):
    """Through PutStart: equal segments take a batch's keys in turn (each key re-ranks them)."""
    segments = [mount(state, f"s{i}") for i in range(8)]
    started = state.put_start(NS, [f"k{i}" for i in range(32)], [4 * KiB] * 32, 1, PutOptions())
    assert started.statuses == [Status.OK] * 32
    counts = {s.segment_id: list(started.replica_segments).count(s.segment_id) for s in segments}
    assert set(counts.values()) == {4}


def test_replicas_go_to_distinct_segments_on_distinct_hosts_first(state: MasterState):
    a1, a2, b1 = mount(state, "a1", "host-a"), mount(state, "a2", "host-a"), mount(state, "b1", "host-b")
    assert b1.allocator.allocate(768 * KiB) is not None  # the fullest, yet the only other host
    active = [a1, a2, b1]
    placed = place(state, active, static_rank(active, PutOptions()), 1000, 2)
    hosts = {state.segments[replica_segment(p)].host_id for p in placed}
    assert hosts == {"host-a", "host-b"}
    three = place(state, active, static_rank(active, PutOptions()), 1000, 3)
    assert len({replica_segment(p) for p in three}) == 3, "then the same host again, never the same segment"


def test_more_replicas_than_segments_is_refused_and_takes_nothing(state: MasterState):
    a, b = mount(state, "a"), mount(state, "b")
    active = [a, b]
    assert place(state, active, static_rank(active, PutOptions()), 1000, 3) is None
    assert a.allocator.used == b.allocator.used == 0, "the ranges of the replicas placed first are given back"
    assert a.objects == b.objects == 0


def test_room_is_made_by_evicting_the_least_recently_used(state: MasterState, clock: FakeClock):
    segment = mount(state, "only")
    for i in range(4):
        put(state, f"k{i}", 256 * KiB)
    state.get_replicas(NS, ["k0"])  # read: k0 is now the most recently used
    clock.now += 10.0  # its read lease is over
    found, offset = allocate_on(state, [segment], 256 * KiB)
    assert found is segment and offset is not None
    assert present(state, "k0", "k1", "k2", "k3") == [True, False, True, True]


def test_an_object_being_read_is_not_evicted(state: MasterState):
    segment = mount(state, "only")
    for i in range(4):
        put(state, f"k{i}", 256 * KiB)
    state.get_replicas(NS, ["k0"])  # a read lease, still running: k1 goes although k0 is older
    found, _ = allocate_on(state, [segment], 256 * KiB)
    assert found is segment
    assert present(state, "k0", "k1") == [True, False]


def test_a_refused_allocation_evicts_nothing(state: MasterState, clock: FakeClock):
    segment = mount(state, "only")
    put(state, "loose", 256 * KiB)
    for i in range(3):
        put(state, f"pinned{i}", 256 * KiB, pin=PIN_HARD)
    clock.now += 10.0
    # Only "loose" may go, and 256 KiB cannot hold 512: evicting it would destroy and still refuse.
    assert allocate_on(state, [segment], 512 * KiB) == (None, 0)
    assert present(state, "loose", "pinned0", "pinned1", "pinned2") == [True] * 4


def test_the_next_candidate_is_tried_when_the_first_cannot_make_room(state: MasterState, clock: FakeClock):
    small, other = mount(state, "small", capacity=256 * KiB), mount(state, "other")
    assert allocate_on(state, [small, other], 512 * KiB)[0] is other


def test_fits_after_asks_for_a_contiguous_run_not_just_enough_bytes(state: MasterState):
    segment = mount(state, "only")
    where = {key: put(state, key, 256 * KiB) for key in ("k0", "k1", "k2", "k3")}
    assert state.remove(NS, ["k1"]) == [Status.OK]  # free: [256 KiB, 512 KiB)

    def victim(key: str) -> ObjectRecord:
        segment_id, offset = where[key]
        return ObjectRecord(key, 256 * KiB, (replica(segment_id, offset),), put_id=0, started_at=0.0)

    assert replica_offset(victim("k2").replicas[0]) == 512 * KiB
    assert fits_after(state, segment, [victim("k2")], 512 * KiB), "k2 lies next to the free gap"
    assert not fits_after(state, segment, [victim("k3")], 512 * KiB), "256 + 256 KiB, but apart"
    assert fits_after(state, segment, [victim("k0"), victim("k2")], 768 * KiB)


def test_the_placement_order_stays_bounded_however_segments_and_allocations_churn(state: MasterState, clock):
    keep = [mount(state, f"k{i}") for i in range(4)]
    for i in range(500):  # mounts and drops without a single put in between
        state.drop_segment(mount(state, f"churn{i}").segment_id, reason="unmounted")
    for _ in range(200):  # allocators changing with answers in between
        for segment in keep:
            offset = segment.allocator.allocate(KiB)
            segment.allocator.release(offset, KiB)
        state.placement_order.first("", "", clock.now - 1.0, (), ())
    order = state.placement_order
    assert len(order._heap) <= 4 * len(keep) + 65 and len(order.dirty) == 0
    assert len(order._segments) == len(order._by_allocator) == 4
