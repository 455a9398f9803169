"""LRU eviction in MasterState and the victim rules of pick_victims: scenarios on a fake clock.

Segments here are a few KiB and objects 1 KiB, so "full" is a handful of
puts. A read (`get_replicas`) refreshes recency and grants a lease of
`lease_s` = 5 s; `end_leases` lets that much time pass with every segment
heartbeating. Every scenario ends by checking the books (`assert_consistent`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.master.config import MasterConfig
from kvtier.master.eviction import pick_victims
from kvtier.master.records import PIN_HARD, PIN_NONE, PIN_SOFT, replica_segment
from kvtier.master.state import MasterState, ObjectState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent, namespace_records
from tests.unit.master.test_state import FakeClock, advance_alive, mount, visible

OK = Status.OK
KiB = 1 << 10
NS = "ns"
LEASE_S = 5.0


def make_state(clock: FakeClock, **changes) -> MasterState:
    settings = {"segment_ttl_s": 10.0, "heartbeat_interval_s": 1.0, "lease_s": LEASE_S, "put_timeout_s": 30.0}
    config = MasterConfig(cluster_id="unit", **{**settings, **changes}).validate()
    return MasterState(config, clock=clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    return make_state(clock)


def put(state: MasterState, key: str, size: int = KiB, replicas: int = 1, **options):
    """A complete put of one key (asserting it is accepted); the PutStartResult."""
    started = state.put_start(NS, [key], [size], replicas, PutOptions(**options))
    assert started.statuses == [OK], started.first_error
    assert state.put_end(NS, [key], [7], started.put_id) == [OK]
    return started


def put_status(state: MasterState, key: str, size: int = KiB, replicas: int = 1, **options) -> Status:
    """Try a put; complete it when accepted. The PutStart status."""
    started = state.put_start(NS, [key], [size], replicas, PutOptions(**options))
    if started.statuses == [OK]:
        assert state.put_end(NS, [key], [7], started.put_id) == [OK]
    return Status(started.statuses[0])


def read(state: MasterState, *keys: str) -> None:
    """Read like a client: refreshes recency and takes a lease."""
    assert state.get_replicas(NS, list(keys)).statuses == [OK] * len(keys)


def stored(state: MasterState) -> set[str]:
    """The complete objects of NS, as the master's tables hold them and as `exists` reports them.

    `exists` takes no lease and does not refresh recency, so asking it changes nothing.
    """
    records = namespace_records(state, NS)
    complete = {key for key, record in records.items() if record.state is ObjectState.COMPLETE}
    keys = sorted(records)
    found, _ = state.exists(NS, keys)
    assert {key for key, there in zip(keys, found, strict=True) if there} == complete
    return complete


def end_leases(state: MasterState, clock: FakeClock) -> None:
    advance_alive(state, clock, LEASE_S)


def segment(state: MasterState, segment_id: int):
    return state.segments[segment_id]


def replica_segments(state: MasterState, key: str) -> list[int]:
    return [replica_segment(r) for r in state.record(NS, key).replicas]


# ---------------------------------------------------------------- LRU order


def test_victims_are_least_recently_used_and_reads_refresh_recency(state, clock):
    # given a full segment of a, b, c (put in that order), and a read of a
    mount(state, "a", 3 * KiB)
    for key in "abc":
        put(state, key)
    read(state, "a")
    end_leases(state, clock)
    # when new objects need the space, one at a time
    put(state, "d")
    # then b goes first (a was read after it), then c, then a
    assert stored(state) == {"a", "c", "d"}
    put(state, "e")
    assert stored(state) == {"a", "d", "e"}
    put(state, "f")
    assert stored(state) == {"d", "e", "f"}
    assert state.evictions == {"allocation": [3, 3 * KiB]}
    assert_consistent(state)


@pytest.mark.parametrize(("look", "evicted"), [("exists", "a"), ("get_replicas", "b")])
def test_exists_neither_refreshes_recency_nor_grants_a_lease(state, look, evicted):
    # given a full segment of a, b (a is the least recently used)
    mount(state, "a", 2 * KiB)
    put(state, "a")
    put(state, "b")
    # when a is looked at, and a new object needs space at once (no time passes)
    if look == "exists":
        assert state.exists(NS, ["a"]) == ([True], 1)
    else:
        read(state, "a")
    put(state, "c")
    # then exists changed nothing (a, unleased and LRU, goes); a read protects a (lease and recency)
    assert stored(state) == {"a", "b", "c"} - {evicted}
    assert_consistent(state)


def test_exists_alone_leaves_an_object_evictable(state):
    mount(state, "a", KiB)
    put(state, "a")
    for _ in range(3):
        assert state.exists(NS, ["a"]) == ([True], 1)
    put(state, "b")
    assert stored(state) == {"b"}


# ---------------------------------------------------------------- leases


def test_a_leased_object_is_never_evicted_until_its_lease_ends(state, clock):
    # given a full segment whose two objects a reader holds leases on (until +5 s)
    seg = mount(state, "a", 2 * KiB)
    put(state, "a")
    put(state, "b")
    read(state, "a", "b")
    # then neither an allocation nor the watermark (the segment is 100% full) evicts them
    assert put_status(state, "c") == Status.NO_SPACE
    state.tick()
    assert stored(state) == {"a", "b"} and segment(state, seg).used == 2 * KiB
    advance_alive(state, clock, 4.5)
    state.tick()
    assert put_status(state, "c") == Status.NO_SPACE
    assert stored(state) == {"a", "b"}
    assert state.evictions == {}
    # when b is read again, its lease runs to +9.5 s; a's ends at +5 s
    read(state, "b")
    advance_alive(state, clock, 0.5)
    # then a can go, b cannot
    put(state, "c")
    assert stored(state) == {"b", "c"}
    advance_alive(state, clock, 4.0)  # +9 s
    put(state, "d")  # c is unleased, b still leased
    assert stored(state) == {"b", "d"}
    advance_alive(state, clock, 0.5)  # +9.5 s: b's lease has ended, and b is the least recently used
    put(state, "e")
    assert stored(state) == {"d", "e"}
    assert state.evictions == {"allocation": [3, 3 * KiB]}
    assert_consistent(state)


def test_a_pending_put_is_never_evicted(state, clock):
    # given a pending put p (older than anything) and a complete object a on a full segment
    seg = mount(state, "a", 2 * KiB)
    pending = state.put_start(NS, ["p"], [KiB], 1)
    assert pending.statuses == [OK]
    put(state, "a")
    # when another put needs the space, a is evicted, not the in-flight p
    second = state.put_start(NS, ["x"], [KiB], 1)
    assert second.statuses == [OK]
    assert stored(state) == set()
    # then with only pending puts left there is nothing to evict: NO_SPACE, and the watermark evicts nothing
    assert put_status(state, "y") == Status.NO_SPACE
    advance_alive(state, clock, 29.0)  # below put_timeout_s
    state.tick()
    assert segment(state, seg).used == 2 * KiB
    assert state.evictions == {"allocation": [1, KiB]}
    # and both writers can still finish
    assert state.put_end(NS, ["p"], [1], pending.put_id) == [OK]
    assert state.put_end(NS, ["x"], [1], second.put_id) == [OK]
    assert visible(state, "p") and visible(state, "x")
    assert_consistent(state)


# ---------------------------------------------------------------- pins


def test_hard_pinned_objects_are_never_evicted(state, clock):
    # given two segments full of hard-pinned objects
    a = mount(state, "a", 2 * KiB)
    b = mount(state, "b", 2 * KiB)
    for key in ("h1", "h2", "h3", "h4"):
        put(state, key, pin=PIN_HARD)
    # then a new put is NO_SPACE, now and long after any soft pin would have expired
    assert put_status(state, "x") == Status.NO_SPACE
    state.tick()
    advance_alive(state, clock, 10 * state.config.soft_pin_ttl_s)
    state.tick()
    assert put_status(state, "x") == Status.NO_SPACE
    assert put_status(state, "x", replicas=2) == Status.NO_SPACE
    assert stored(state) == {"h1", "h2", "h3", "h4"}
    assert state.evictions == {}
    assert segment(state, a).used == segment(state, b).used == 2 * KiB
    assert state.snapshot().pending_puts == 0
    assert_consistent(state)


def test_a_hard_pinned_lru_object_is_skipped_for_a_younger_unpinned_one(state):
    mount(state, "a", 2 * KiB)
    put(state, "h", pin=PIN_HARD)
    put(state, "u")
    put(state, "x")
    assert stored(state) == {"h", "x"}
    put(state, "y")
    assert stored(state) == {"h", "y"}
    assert_consistent(state)


def test_a_soft_pinned_object_goes_only_when_nothing_unpinned_is_left(state, clock):
    # given, oldest first: s (soft pin), a, h (hard pin), b on a full segment
    mount(state, "a", 4 * KiB)
    put(state, "s", pin=PIN_SOFT)
    put(state, "a")
    put(state, "h", pin=PIN_HARD)
    put(state, "b")
    # when space is needed, the unpinned objects go first although s is older
    put(state, "x")
    assert stored(state) == {"s", "h", "b", "x"}
    put(state, "y")
    assert stored(state) == {"s", "h", "x", "y"}
    # when every unpinned object is leased, the soft pin yields (the hard one never does)
    read(state, "x", "y")
    put(state, "z")
    assert stored(state) == {"h", "x", "y", "z"}
    # and with only hard pins and leases left, the put is refused
    read(state, "z")
    assert put_status(state, "w") == Status.NO_SPACE
    assert stored(state) == {"h", "x", "y", "z"}
    assert_consistent(state)


def test_the_watermark_takes_unpinned_objects_first_then_the_least_recently_used_soft_pins(state):
    # given a full 10 KiB segment: 9 soft-pinned objects, then 1 unpinned one (the youngest)
    seg = mount(state, "a", 10 * KiB)
    soft = [f"s{i}" for i in range(9)]
    for key in soft:
        put(state, key, pin=PIN_SOFT)
    put(state, "u")
    # when a tick must free 1.5 KiB, the unpinned object is not enough: the oldest soft pin goes too
    state.tick()
    assert stored(state) == set(soft[1:])
    assert segment(state, seg).used == 8 * KiB
    assert state.evictions == {"watermark": [2, 2 * KiB]}
    assert_consistent(state)


def test_the_watermark_spares_older_soft_pins_while_unpinned_objects_can_go(state):
    seg = mount(state, "a", 10 * KiB)
    put(state, "s0", pin=PIN_SOFT)
    put(state, "s1", pin=PIN_SOFT)
    for i in range(8):
        put(state, f"u{i}")
    state.tick()
    assert stored(state) == {"s0", "s1"} | {f"u{i}" for i in range(2, 8)}
    assert segment(state, seg).used == 8 * KiB


@pytest.mark.parametrize(
    ("pin_ttl_s", "expires_after"),
    [(10.0, 10.0), (0.0, 60.0), (500.0, 500.0)],
    ids=["explicit-ttl", "config-default", "ttl-above-default"],
)
def test_a_soft_pin_expires_after_its_ttl_and_then_is_evicted_like_an_unpinned_object(clock, pin_ttl_s, expires_after):
    # given soft_pin_ttl_s = 60 in the config, a soft-pinned s and a younger unpinned a on a full segment
    state = make_state(clock, soft_pin_ttl_s=60.0)
    mount(state, "a", 2 * KiB)
    put(state, "s", pin=PIN_SOFT, pin_ttl_s=pin_ttl_s)
    put(state, "a")
    # just before the pin expires, the younger unpinned object goes
    advance_alive(state, clock, expires_after - 0.1)
    put(state, "x")
    assert stored(state) == {"s", "x"}
    # once it expired, s is an ordinary object, and the least recently used one
    advance_alive(state, clock, 0.1)
    put(state, "y")
    assert stored(state) == {"x", "y"}
    assert state.evictions == {"allocation": [2, 2 * KiB]}
    assert_consistent(state)


def test_pin_ttl_is_ignored_without_a_soft_pin(state, clock):
    mount(state, "a", 2 * KiB)
    put(state, "h", pin=PIN_HARD, pin_ttl_s=1.0)
    put(state, "n", pin=PIN_NONE, pin_ttl_s=1000.0)
    advance_alive(state, clock, 2.0)
    put(state, "x")
    assert stored(state) == {"h", "x"}
    assert_consistent(state)


# ---------------------------------------------------------------- watermark


def test_tick_evicts_a_segment_above_the_high_watermark_down_to_high_minus_ratio(state, clock):
    # given segment a at 95% (95 x 1 KiB of 100 KiB), segment b empty, and the 5 oldest objects read
    capacity = 100 * KiB
    a = mount(state, "a", capacity)
    b = mount(state, "b", capacity)
    keys = [f"k{i:02d}" for i in range(95)]
    for key in keys:
        put(state, key, preferred_segment="a")
    assert segment(state, a).used == 95 * KiB and segment(state, b).used == 0
    read(state, *keys[:5])
    end_leases(state, clock)
    assert state.evictions == {}, "nothing is evicted before a tick"
    # when the master ticks
    state.tick()
    # then a is at most 85% full, and exactly the least recently used objects were evicted
    assert segment(state, a).used <= 0.85 * capacity
    assert segment(state, a).used == 85 * KiB, "evicted more than needed"
    assert stored(state) == set(keys) - set(keys[5:15])
    assert segment(state, b).used == 0
    assert state.evictions == {"watermark": [10, 10 * KiB]}
    # and a second tick has nothing to do
    state.tick()
    assert state.evictions == {"watermark": [10, 10 * KiB]}
    assert_consistent(state)


def test_the_watermark_counts_ranges_on_their_way_back_and_evicts_no_live_object_for_them(state, clock):
    """Replaced objects under put-time leases keep their ranges until the leases and the margin end
    (counted in `used`). The watermark pass evicted every live object for that room, which they did
    not hold (the tester's writer of 30 leased keys: 0 live objects left, again and again)."""
    state.reuse_margin_s = 2.0
    capacity = 100 * KiB
    a = mount(state, "a", capacity)
    keys = [f"k{i:02d}" for i in range(32)]
    for key in keys:
        put(state, key, lease_s=1.0)
    for _ in range(2):  # each replaced version's range waits 1 s + the margin
        for key in keys:
            started = state.put_start(NS, [key], [KiB], 1, PutOptions(lease_s=1.0, overwrite=True))
            assert started.statuses == [OK]
            assert state.put_end(NS, [key], [8], started.put_id) == [OK]
    assert segment(state, a).used == 96 * KiB and segment(state, a).releasing == 64 * KiB  # above 0.90
    advance_alive(state, clock, 1.1)  # the live versions' leases are over, the margin of the old ones is not
    state.tick()
    assert stored(state) == set(keys) and state.evictions == {}, "live objects evicted for leased garbage"
    advance_alive(state, clock, 2.0)
    state.tick()
    assert segment(state, a).used == 32 * KiB and segment(state, a).releasing == 0
    assert stored(state) == set(keys)
    assert_consistent(state)


def test_tick_leaves_a_segment_at_exactly_the_high_watermark_alone(state):
    seg = mount(state, "a", 10 * KiB)
    for i in range(9):
        put(state, f"k{i}")
    state.tick()
    assert segment(state, seg).used == 9 * KiB
    assert state.evictions == {}
    put(state, "k9")
    state.tick()
    assert segment(state, seg).used <= 0.85 * 10 * KiB
    assert stored(state) == {f"k{i}" for i in range(2, 10)}
    assert state.evictions == {"watermark": [2, 2 * KiB]}


@pytest.mark.parametrize(("high", "ratio", "kept"), [(0.5, 0.25, 2), (0.8, 0.4, 4), (1.0, 0.1, 10)])
def test_watermark_settings_come_from_the_config(clock, high, ratio, kept):
    # 10 KiB segment, 10 objects of 1 KiB written without a tick in between (100% full)
    state = make_state(clock, high_watermark=high, eviction_ratio=ratio)
    seg = mount(state, "a", 10 * KiB)
    for i in range(10):
        put(state, f"k{i}")
    state.tick()
    assert segment(state, seg).used == kept * KiB
    assert stored(state) == {f"k{i}" for i in range(10 - kept, 10)}


def test_watermark_eviction_does_not_touch_leased_or_pinned_objects(state, clock):
    seg = mount(state, "a", 10 * KiB)
    put(state, "h", pin=PIN_HARD)
    put(state, "s", pin=PIN_SOFT)
    put(state, "r")
    for i in range(7):
        put(state, f"k{i}")
    read(state, "r")
    state.tick()  # 100% -> at most 85%: two objects go, the LRU unpinned and unleased ones
    assert stored(state) == {"h", "s", "r"} | {f"k{i}" for i in range(2, 7)}
    assert segment(state, seg).used == 8 * KiB
    assert_consistent(state)


# ---------------------------------------------------------------- eviction on allocation failure


def test_a_put_on_a_full_segment_of_evictable_objects_makes_room(state):
    # given two full segments of evictable objects
    a = mount(state, "a", 4 * KiB)
    mount(state, "b", 4 * KiB)
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        put(state, key)
    on_a = [key for key in keys if replica_segments(state, key) == [a]]
    assert len(on_a) == 4 and sum(s.used for s in state.segments.values()) == 8 * KiB
    # when a 2 KiB object is put on a
    started = put(state, "new", 2 * KiB, preferred_segment="a")
    # then it is stored on a, in place of the two least recently used objects there, and nothing else moved
    assert started.replica_segments == [a]
    assert stored(state) == set(keys) - set(on_a[:2]) | {"new"}
    assert state.evictions == {"allocation": [2, 2 * KiB]}
    assert visible(state, "new")
    assert_consistent(state)


def test_allocation_eviction_keeps_going_when_freed_space_is_not_contiguous_and_stops_once_it_fits(state, clock):
    # given a, b, c, d at consecutive offsets of a full 4 KiB segment, with b and d read (a, c are LRU)
    mount(state, "a", 4 * KiB)
    offsets = {key: put(state, key).replica_offsets[0] for key in "abcd"}
    assert offsets == {"a": 0, "b": KiB, "c": 2 * KiB, "d": 3 * KiB}
    read(state, "b", "d")
    end_leases(state, clock)
    # when a 2 KiB object is put: evicting a and c frees 2 KiB, but in two holes
    started = put(state, "x", 2 * KiB)
    # then eviction went on with b, which joins a's hole to c's, and stopped there: d, the most recent, stays
    assert started.replica_offsets == [0]
    assert stored(state) == {"d", "x"}
    assert state.evictions == {"allocation": [3, 3 * KiB]}
    assert_consistent(state)


def test_allocation_eviction_counts_the_room_that_is_already_free(state):
    # a 6 KiB segment: 2 KiB free at its start, then c, d, e, f (oldest first)
    mount(state, "a", 6 * KiB)
    for key in "abcdef":
        put(state, key)
    assert state.remove(NS, ["a", "b"]) == [OK, OK]
    # a 4 KiB put needs 2 KiB more: c and d, next to the free 2 KiB. Not e and f as well.
    put(state, "x", 4 * KiB)
    assert stored(state) == {"e", "f", "x"}
    assert state.evictions == {"allocation": [2, 2 * KiB]}


def test_a_put_refused_for_space_evicts_nothing(state):
    # segment a: one evictable object beside a hard pin that leaves no room for 2 KiB; b full of pins
    mount(state, "a", 3 * KiB)
    mount(state, "b", 2 * KiB)
    put(state, "plain", preferred_segment="a")
    put(state, "pinned-a", 2 * KiB, pin=PIN_HARD, preferred_segment="a")
    put(state, "pinned-b", 2 * KiB, pin=PIN_HARD, preferred_segment="b")
    assert put_status(state, "x", 2 * KiB) == Status.NO_SPACE
    assert "plain" in stored(state), "the refused put destroyed 'plain' for nothing"


def test_a_put_evicts_nothing_whose_range_is_not_free_yet(state, clock):
    """A victim's range goes back to the allocator only after its leases, plus the clock-skew margin
    (kvtier.master.range_book): evicting objects still inside that window freed nothing now, and a
    put refused NO_SPACE had destroyed them (k0 and k1 in the tester's run)."""
    state.reuse_margin_s = 2.0  # as the server sets it (CLOCK_SKEW_MS)
    mount(state, "a", 8 * KiB)
    for i in range(7):
        put(state, f"k{i}", lease_s=1.0)
    advance_alive(state, clock, 1.3)  # the put-time leases are over, their margin is not
    assert put_status(state, "big", 2 * KiB) == Status.NO_SPACE
    assert stored(state) == {f"k{i}" for i in range(7)}, "evicted for room that was not there"
    assert state.evictions == {}
    advance_alive(state, clock, 2.0)  # past the margin: eviction frees room at once
    assert put_status(state, "big", 2 * KiB) == Status.OK
    assert stored(state) == {"big"} | {f"k{i}" for i in range(2, 7)}  # k0 and k1 make a 2 KiB run
    assert_consistent(state)


def test_a_replicated_put_refused_for_its_second_replica_evicts_nothing_for_its_first(state):
    """Room for the first replica by eviction on one segment, none for the second anywhere: the put
    is refused and nothing is evicted (the first replica's victims went before the second failed)."""
    mount(state, "s0", 8 * KiB)
    mount(state, "s1", 8 * KiB)
    for i in range(7):
        put(state, f"pinned{i}", pin=PIN_HARD, preferred_segment="s1")
    for i in range(6):
        put(state, f"keep{i}", preferred_segment="s0")
    assert put_status(state, "x", 3 * KiB, replicas=2) == Status.NO_SPACE
    assert {f"keep{i}" for i in range(6)} <= stored(state), "the refused put evicted objects on s0"
    assert state.evictions == {}
    assert_consistent(state)


def test_a_replicated_put_never_plans_both_copies_of_one_object_as_victims(state, clock):
    """Every replica's victims are planned before any is evicted: each plan saw the LRU object's other
    copy still there (redundant), and both copies went, the object with them (review finding)."""
    mount(state, "a", 4 * KiB)
    mount(state, "b", 4 * KiB)
    for i in range(4):
        put(state, f"r{i}", replicas=2)
    end_leases(state, clock)
    put(state, "x", replicas=2)
    assert {f"r{i}" for i in range(4)} - stored(state) == set(), "an object lost both its copies"
    assert sorted(len(state.record(NS, f"r{i}").replicas) for i in range(4)) == [1, 1, 2, 2]
    assert_consistent(state)


def test_a_put_evicts_nothing_on_a_segment_where_it_cannot_fit(state):
    # a: u1 | hard pin | u2 (no 2 KiB range even when empty of evictable objects); b: v1 | v2
    mount(state, "a", 3 * KiB)
    mount(state, "b", 2 * KiB)
    put(state, "u1", preferred_segment="a")
    put(state, "h", pin=PIN_HARD, preferred_segment="a")
    put(state, "u2", preferred_segment="a")
    put(state, "v1", preferred_segment="b")
    put(state, "v2", preferred_segment="b")
    put(state, "x", 2 * KiB, preferred_segment="a")  # lands on b, in place of v1 and v2
    assert stored(state) == {"u1", "h", "u2", "x"}, "u1 and u2 were evicted from a, where x could never fit"


def test_allocation_failure_tries_the_other_segments_before_evicting(state):
    mount(state, "a", 2 * KiB)
    mount(state, "b", 2 * KiB)
    put(state, "a1", preferred_segment="a")
    put(state, "a2", preferred_segment="a")
    put(state, "x", preferred_segment="a")  # a is full, b has room: nothing is evicted
    assert stored(state) == {"a1", "a2", "x"}
    assert state.evictions == {}


def test_an_object_larger_than_a_segment_evicts_nothing(state):
    mount(state, "a", 2 * KiB)
    put(state, "k1")
    put(state, "k2")
    assert put_status(state, "huge", 2 * KiB + 1) == Status.TOO_LARGE
    assert stored(state) == {"k1", "k2"}
    assert state.evictions == {}


# ---------------------------------------------------------------- replicas


def test_pressure_on_one_segment_drops_only_that_replica_of_a_two_replica_object(state, clock):
    # given r on both segments (least recently used), x only on a, z only on b: both full
    a = mount(state, "a", 2 * KiB)
    b = mount(state, "b", 2 * KiB)
    put(state, "r", replicas=2)
    put(state, "x", preferred_segment="a")
    put(state, "z", preferred_segment="b")
    # when a new object needs space on a
    started = put(state, "y", preferred_segment="a")
    assert started.replica_segments == [a]
    # then r lost its copy on a only, and is still readable from b
    assert stored(state) == {"r", "x", "y", "z"}
    assert replica_segments(state, "r") == [b]
    assert state.evictions == {"allocation": [1, KiB]}
    assert (segment(state, a).objects, segment(state, b).objects) == (2, 2)
    assert_consistent(state)
    got = state.get_replicas(NS, ["r"])
    assert got.statuses == [OK] and got.replica_counts == [1] and got.replica_segments == [b]
    end_leases(state, clock)
    # when b is under pressure, z goes first (r was read after z was written), then r with its last copy
    put(state, "w", preferred_segment="b")
    assert stored(state) == {"r", "x", "y", "w"}
    put(state, "v", preferred_segment="b")
    assert stored(state) == {"x", "y", "w", "v"}
    assert state.get_replicas(NS, ["r"]).statuses == [Status.NOT_FOUND]
    assert state.evictions == {"allocation": [3, 3 * KiB]}
    assert_consistent(state)


def test_the_watermark_on_one_segment_drops_only_that_replica(state):
    a = mount(state, "a", 10 * KiB)
    b = mount(state, "b", 10 * KiB)
    put(state, "r", replicas=2)
    for i in range(9):
        put(state, f"k{i}", preferred_segment="a")
    state.tick()  # a is at 100%, b at 10%
    assert segment(state, a).used == 8 * KiB
    assert replica_segments(state, "r") == [b]
    assert visible(state, "r")
    assert "k0" not in stored(state) and "k1" in stored(state)
    assert segment(state, b).used == KiB
    assert state.evictions == {"watermark": [2, 2 * KiB]}
    assert_consistent(state)


# ---------------------------------------------------------------- counters


def test_eviction_counters_count_objects_and_bytes_per_reason(state):
    a = mount(state, "a", 10 * KiB)
    # watermark: 10 x 1 KiB on the 10 KiB segment, then a tick takes the two oldest
    for i in range(10):
        put(state, f"w{i}", preferred_segment="a")
    state.tick()
    assert state.evictions == {"watermark": [2, 2 * KiB]}
    # allocation: refill a (no tick), then a 1 KiB and a 2 KiB object on it take the three oldest
    put(state, "f0", preferred_segment="a")
    put(state, "f1", preferred_segment="a")
    assert put(state, "x").replica_segments == [a]
    assert put(state, "y", 2 * KiB).replica_segments == [a]
    assert stored(state) & {"w2", "w3", "w4"} == set()
    assert state.evictions == {"watermark": [2, 2 * KiB], "allocation": [3, 3 * KiB]}
    # quota: a rank of 2 KiB puts a third 1 KiB object (on a roomy new segment) and loses its oldest
    mount(state, "q", 100 * KiB)
    assert state.register_instance("llm", 1, 1, 2 * KiB) == 2 * KiB
    for i in range(3):
        put(state, f"q{i}", instance="llm", preferred_segment="q")
    assert "q0" not in stored(state) and {"q1", "q2"} <= stored(state)
    assert state.evictions == {"watermark": [2, 2 * KiB], "allocation": [3, 3 * KiB], "quota": [1, KiB]}
    assert_consistent(state)


def test_quota_eviction_counts_the_bytes_of_every_replica(state):
    mount(state, "a", 100 * KiB)
    mount(state, "b", 100 * KiB)
    state.register_instance("llm", 1, 1, 4 * KiB)
    put(state, "r0", replicas=2, instance="llm")
    put(state, "r1", replicas=2, instance="llm")
    put(state, "r2", replicas=2, instance="llm")
    assert stored(state) == {"r1", "r2"}
    assert state.evictions == {"quota": [1, 2 * KiB]}
    assert_consistent(state)


def test_eviction_with_one_replica_per_segment_counts_replica_bytes(state):
    mount(state, "a", 2 * KiB)
    mount(state, "b", 2 * KiB)
    put(state, "r", replicas=2)
    put(state, "s", replicas=2)
    put(state, "t", 2 * KiB, preferred_segment="a")  # drops one replica of r and of s, on a
    assert state.evictions == {"allocation": [2, 2 * KiB]}
    assert stored(state) == {"r", "s", "t"}
    assert_consistent(state)


# ---------------------------------------------------------------- pick_victims


@dataclass(eq=False)
class Rec:
    name: str
    size: int = 1
    lease_until: float = 0.0
    pin_until: float = 0.0  # 0 unpinned, a time for a soft pin, inf for a hard pin
    state: ObjectState = ObjectState.COMPLETE


def names(records) -> list[str]:
    return [r.name for r in records]


def victims(records: list[Rec], now: float, need: int, weight=None, eligible=None) -> list[str]:
    return names(pick_victims(records, now, need, weight or size, eligible or anything))


def size(record: Rec) -> int:
    return record.size


def anything(record: Rec) -> bool:
    return True


def test_recency_order_follows_put_start_and_reads_but_not_exists(state):
    # given three objects started in the order a, b, c and completed in the order b, a, c
    mount(state, "a", 16 * KiB)
    started = state.put_start(NS, ["a", "b", "c"], [KiB] * 3, 1)
    assert state.put_end(NS, ["b"], [1], started.put_id) == [OK]
    assert state.put_end(NS, ["a", "c"], [1, 1], started.put_id) == [OK, OK]
    assert [r.key for r in state.records()] == ["a", "b", "c"]  # recency starts at PutStart
    # when b is only checked for existence, then a is read
    state.exists(NS, ["b"])
    read(state, "a")
    # then exists moved nothing and the read moved a to the most recent end
    assert [r.key for r in state.records()] == ["b", "c", "a"]


def test_victims_are_lru_first_until_the_need_is_met():
    lru = [Rec("a", 3), Rec("b", 2), Rec("c", 5), Rec("d", 1)]
    assert victims(lru, 0.0, 1) == ["a"]
    assert victims(lru, 0.0, 3) == ["a"]
    assert victims(lru, 0.0, 4) == ["a", "b"]
    assert victims(lru, 0.0, 6) == ["a", "b", "c"]
    assert victims(lru, 0.0, 11) == ["a", "b", "c", "d"]
    # not enough: every candidate, and the caller decides
    assert victims(lru, 0.0, 100) == ["a", "b", "c", "d"]


def test_victims_use_the_callers_weight_and_predicate():
    lru = [Rec("a", 3), Rec("b", 2), Rec("c", 5), Rec("d", 1)]
    odd = lambda r: r.size % 2 == 1  # noqa: E731
    assert victims(lru, 0.0, 4, eligible=odd) == ["a", "c"]
    assert victims(lru, 0.0, 2, weight=lambda r: 1) == ["a", "b"]
    assert victims(lru, 0.0, 1, eligible=lambda r: False) == []
    assert victims([], 0.0, 1) == []


def test_victims_skip_pending_leased_and_hard_pinned_records():
    now = 100.0
    lru = [
        Rec("pending", state=ObjectState.PENDING),
        Rec("leased", lease_until=now + 1),
        Rec("hard", pin_until=math.inf),
        Rec("lease-ended", lease_until=now),  # lease_until == now: ended
        Rec("free"),
    ]
    assert victims(lru, now, 10) == ["lease-ended", "free"]
    assert victims(lru, now + 1, 10) == ["leased", "lease-ended", "free"]
    assert "hard" not in victims(lru, 1e12, 10)
    assert "pending" not in victims(lru, 1e12, 10)


def test_victims_take_live_soft_pins_last_and_expired_ones_in_lru_order():
    now = 100.0
    s1 = Rec("soft1", pin_until=now + 10)
    expired = Rec("expired", pin_until=now)
    u = Rec("u")
    s2 = Rec("soft2", pin_until=now + 1)
    lru = [s1, expired, u, s2]
    assert victims(lru, now, 1) == ["expired"]
    assert victims(lru, now, 2) == ["expired", "u"]
    assert victims(lru, now, 3) == ["expired", "u", "soft1"]
    assert victims(lru, now, 9) == ["expired", "u", "soft1", "soft2"]
    # a leased soft pin is not a victim at all
    s1.lease_until = now + 5
    assert victims(lru, now, 9) == ["expired", "u", "soft2"]
    # the predicate applies to soft pins too
    assert victims(lru, now, 9, eligible=lambda r: r.name != "soft2") == ["expired", "u"]


def test_victims_of_nothing_needed_is_empty():
    assert victims([Rec("a"), Rec("b")], 0.0, 0) == []


# ---------------------------------------------------------------- property: eviction never breaks the books

KEYS = [f"k{i}" for i in range(12)]
OWNERS = [("", 0), ("llm", 0), ("llm", 1), ("other", 0)]
SEGMENT = 4 * KiB


class EvictionMachine(RuleBasedStateMachine):
    """Random puts, pins, reads, removals, quotas and ticks on small segments.

    After every step: the books balance (`assert_consistent`); hard-pinned
    objects, leased objects and pending puts are still there; no quota is
    exceeded right after a put that the quota admitted.
    """

    policy = "lru"  # tests/unit/master/test_eviction_policy.py runs it under s3fifo too

    @initialize()
    def setup(self):
        self.clock = FakeClock()
        self.state = make_state(self.clock, soft_pin_ttl_s=8.0, eviction_policy=self.policy)
        for name in ("a", "b", "c"):
            mount(self.state, name, SEGMENT)
        self.hard: set[str] = set()  # complete hard-pinned keys: may go only by remove or segment loss
        self.leased: dict[str, float] = {}  # key -> lease end
        self.pending: dict[str, int] = {}  # key -> put_id of a pending put that has not timed out

    def _forget(self, key: str) -> None:
        self.hard.discard(key)
        self.leased.pop(key, None)

    @rule(
        key=st.sampled_from(KEYS),
        size=st.sampled_from([0, 1, 700, KiB, 2 * KiB, 3 * KiB, 5 * KiB]),
        replicas=st.integers(1, 2),
        pin=st.sampled_from([PIN_NONE, PIN_NONE, PIN_SOFT, PIN_HARD]),
        owner=st.sampled_from(OWNERS),
        finish=st.booleans(),
    )
    def put(self, key, size, replicas, pin, owner, finish):
        instance, rank = owner
        started = self.state.put_start(
            NS, [key], [size], replicas, PutOptions(instance=instance, rank=rank, pin=pin, pin_ttl_s=3.0)
        )
        status = started.statuses[0]
        if status != OK or not started.replica_counts[0]:
            return
        self.pending.pop(key, None)  # an abandoned put of the key was reclaimed by this one
        record = self.state.record(NS, key)
        if record.owner is not None and record.owner.quota:
            assert record.owner.used <= record.owner.quota, "a put was admitted beyond its rank's quota"
        if finish:
            assert self.state.put_end(NS, [key], [1], started.put_id) == [OK]
            if pin == PIN_HARD:
                self.hard.add(key)
        else:
            self.pending[key] = started.put_id

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=2, max_size=6, unique=True),
        size=st.sampled_from([700, KiB, 2 * KiB]),
        owner=st.sampled_from(OWNERS),
        pin=st.sampled_from([PIN_NONE, PIN_SOFT]),
    )
    def put_batch(self, keys, size, owner, pin):
        """Pressure: a batch of complete puts."""
        started = self.state.put_start(
            NS, keys, [size] * len(keys), 1, PutOptions(instance=owner[0], rank=owner[1], pin=pin)
        )
        done = [k for k, s, n in zip(keys, started.statuses, started.replica_counts, strict=True) if s == OK and n]
        for key in done:
            self.pending.pop(key, None)
        if done:
            assert self.state.put_end(NS, done, [1] * len(done), started.put_id) == [OK] * len(done)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), revoke=st.booleans())
    def finish_pending(self, data, revoke):
        key = data.draw(st.sampled_from(sorted(self.pending)))
        put_id = self.pending.pop(key)
        record = self.state.record(NS, key)
        if revoke:
            assert self.state.put_revoke(NS, [key], put_id) == [OK]
        else:
            assert self.state.put_end(NS, [key], [1], put_id) == [OK]
            if record.pin == PIN_HARD:
                self.hard.add(key)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def read(self, keys):
        got = self.state.get_replicas(NS, keys)
        for key, status in zip(keys, got.statuses, strict=True):
            if status == OK:
                self.leased[key] = self.clock() + LEASE_S

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def exists(self, keys):
        self.state.exists(NS, keys)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        if self.state.remove(NS, [key]) == [OK]:
            self._forget(key)

    @rule(owner=st.sampled_from(OWNERS[1:]), ranks=st.integers(1, 2), budget=st.sampled_from([2, 3, 4, 8]))
    def register(self, owner, ranks, budget):
        self.state.register_instance(owner[0], ranks, 1, budget * KiB)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 5.0, 9.0]))
    def advance_and_tick(self, seconds):
        advance_alive(self.state, self.clock, seconds)
        self.state.tick()
        now = self.clock()
        self.leased = {k: until for k, until in self.leased.items() if until > now}
        objects = namespace_records(self.state, NS)
        self.pending = {k: p for k, p in self.pending.items() if k in objects and objects[k].put_id == p}

    @precondition(lambda self: len(self.state.segments) > 1)
    @rule(pick=st.integers(0, 2))
    def unmount_and_remount(self, pick):
        seg = sorted(self.state.segments)[pick % len(self.state.segments)]
        name = self.state.segments[seg].name
        assert self.state.unmount_segment(seg) == OK
        objects = namespace_records(self.state, NS)
        for key in list(self.hard) + list(self.leased):
            if key not in objects:
                self._forget(key)
        self.pending = {k: p for k, p in self.pending.items() if k in objects and objects[k].put_id == p}
        mount(self.state, name, SEGMENT)

    @invariant()
    def books_balance(self):
        assert_consistent(self.state)

    @invariant()
    def protected_objects_stay(self):
        objects = namespace_records(self.state, NS)
        for key in self.hard:
            assert key in objects, f"hard-pinned {key!r} was evicted"
        now = self.clock()
        for key, until in self.leased.items():
            if until > now:
                assert key in objects, f"{key!r} was evicted under a read lease"
        for key, put_id in self.pending.items():
            record = objects.get(key)
            assert record is not None and record.put_id == put_id, f"pending put of {key!r} was evicted"
            assert record.state is ObjectState.PENDING


TestEvictionMachine = EvictionMachine.TestCase
TestEvictionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
