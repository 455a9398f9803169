"""Per-rank quotas: `QuotaTable` on its own, then quota accounting and quota eviction in MasterState.

An instance (engine deployment) registers TP x PP and one budget; each rank
may hold budget // (TP x PP) bytes, every replica counted. A put beyond its
rank's quota evicts that rank's own least recently used objects, never
anyone else's. Scenarios run on a fake clock; the books are checked at the
end of each (`assert_consistent`).
"""

from __future__ import annotations

import pytest

from kvtier.master.quotas import Owner, QuotaTable
from kvtier.master.records import PIN_HARD, PIN_SOFT
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_eviction import (
    NS,
    KiB,
    end_leases,
    make_state,
    put,
    put_status,
    read,
    stored,
)
from tests.unit.master.test_state import FakeClock, advance_alive, mount

OK = Status.OK
MiB = 1 << 20


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    state = make_state(clock)
    mount(state, "a", MiB)
    mount(state, "b", MiB)
    return state


def owner(state: MasterState, instance: str, rank: int = 0) -> Owner:
    found = [o for o in state.quotas.snapshot() if (o.instance, o.rank) == (instance, rank)]
    assert found, f"{instance}/{rank} is not tracked"
    return found[0]


def account(state: MasterState, instance: str, rank: int = 0) -> tuple[int, int]:
    """(used, objects) of the rank; (0, 0) once an unregistered instance's account went with its
    last object (QuotaTable.forget_idle)."""
    found = [o for o in state.quotas.snapshot() if (o.instance, o.rank) == (instance, rank)]
    return (found[0].used, found[0].objects) if found else (0, 0)


def by(instance: str, rank: int = 0, **options) -> dict:
    return {"instance": instance, "rank": rank, **options}


# ---------------------------------------------------------------- QuotaTable


@pytest.mark.parametrize(
    ("tp", "pp", "budget", "quota"),
    [(1, 1, 1000, 1000), (2, 1, 16 * MiB, 8 * MiB), (4, 2, 100, 12), (8, 4, 256 << 30, 8 << 30), (3, 1, 3, 1)],
)
def test_register_gives_each_rank_budget_floor_divided_by_tp_times_pp(tp, pp, budget, quota):
    table = QuotaTable()
    assert table.register("llm", tp, pp, budget) == quota
    owners = table.snapshot()
    assert [(o.instance, o.rank) for o in owners] == [("llm", r) for r in range(tp * pp)]
    for o in owners:
        assert (o.quota, o.used, o.objects, o.tp_size, o.pp_size) == (quota, 0, 0, tp, pp)
    assert all(table.rank_allowed("llm", r) for r in range(tp * pp))
    assert not table.rank_allowed("llm", tp * pp)


@pytest.mark.parametrize(
    ("instance", "tp", "pp", "budget", "message"),
    [
        ("", 1, 1, 100, "instance"),
        ("llm", 0, 1, 100, "at least 1"),
        ("llm", 1, 0, 100, "at least 1"),
        ("llm", -2, -1, 100, "at least 1"),
        ("llm", 2, 2, 3, "less than one byte per rank"),
        ("llm", 1, 1, 0, "less than one byte per rank"),
        # Found by tests/unit/master/test_handlers_fuzz.py: one RegisterInstance of 2^32 x 2^32 ranks
        # made the master allocate an account per rank until it ran out of memory.
        ("llm", (1 << 32) - 1, (1 << 32) - 1, (1 << 64) - 1, "at most 65536"),
        ("llm", 257, 256, 1 << 40, "at most 65536"),
    ],
)
def test_invalid_registrations_raise_value_error_and_register_nothing(instance, tp, pp, budget, message):
    table = QuotaTable()
    with pytest.raises(ValueError, match=message):
        table.register(instance, tp, pp, budget)
    assert table.snapshot() == []
    assert table.rank_allowed("llm", 10**6), "a failed registration must not limit ranks"


def test_an_invalid_re_registration_keeps_the_previous_one():
    table = QuotaTable()
    table.register("llm", 2, 1, 100)
    with pytest.raises(ValueError):
        table.register("llm", 0, 1, 100)
    assert [(o.rank, o.quota, o.tp_size) for o in table.snapshot()] == [(0, 50, 2), (1, 50, 2)]
    assert not table.rank_allowed("llm", 2)


def test_owner_accounts_are_created_on_first_use_and_shared():
    table = QuotaTable()
    assert table.owner("", 0) is None, "no instance: no account"
    first = table.owner("adhoc", 3)
    assert table.owner("adhoc", 3) is first
    assert (first.quota, first.tp_size, first.pp_size) == (0, 0, 0)
    assert first.over_by(10**15) == 0, "an unregistered instance has no limit"
    assert table.rank_allowed("adhoc", 10**6)
    # registering later limits the account that already exists, and the ranks it did not have
    table.register("adhoc", 2, 2, 4000)
    assert (first.quota, first.tp_size, first.pp_size) == (1000, 2, 2)
    assert table.owner("adhoc", 0).quota == 1000
    assert [o.rank for o in table.snapshot()] == [0, 1, 2, 3]


def test_owner_of_a_registered_instance_outside_its_ranks_has_no_quota_and_is_not_allowed():
    table = QuotaTable()
    table.register("llm", 2, 1, 100)
    assert not table.rank_allowed("llm", 2)
    assert not table.rank_allowed("llm", 99)


def test_over_by():
    o = Owner("llm", 0, quota=100, used=60)
    assert o.over_by(0) == 0
    assert o.over_by(40) == 0
    assert o.over_by(41) == 1
    assert o.over_by(1000) == 960
    o.used = 150  # over its quota after a re-registration
    assert o.over_by(0) == 50


def test_re_registering_updates_every_rank_and_keeps_usage():
    table = QuotaTable()
    table.register("llm", 2, 1, 100)
    rank0 = table.owner("llm", 0)
    rank0.used, rank0.objects = 40, 2
    assert table.register("llm", 2, 1, 60) == 30
    assert table.owner("llm", 0) is rank0
    assert (rank0.quota, rank0.used, rank0.objects) == (30, 40, 2)
    # growing TP adds ranks; shrinking it takes ranks away
    assert table.register("llm", 4, 1, 400) == 100
    assert [o.rank for o in table.snapshot()] == [0, 1, 2, 3]
    assert table.rank_allowed("llm", 3)
    assert table.register("llm", 1, 1, 400) == 400
    assert not table.rank_allowed("llm", 1)
    assert [(o.rank, o.quota) for o in table.snapshot()] == [(0, 400), (1, 0), (2, 0), (3, 0)]


def test_snapshot_is_sorted_by_instance_then_rank():
    table = QuotaTable()
    table.owner("zeta", 1)
    table.register("alpha", 1, 2, 10)
    table.owner("zeta", 0)
    assert [(o.instance, o.rank) for o in table.snapshot()] == [("alpha", 0), ("alpha", 1), ("zeta", 0), ("zeta", 1)]


# ---------------------------------------------------------------- registration through MasterState


def test_register_instance_creates_every_rank_with_its_quota(state):
    assert state.register_instance("llm", 2, 2, 16 * KiB) == 4 * KiB
    assert [(o.instance, o.rank, o.quota, o.tp_size, o.pp_size) for o in state.quotas.snapshot()] == [
        ("llm", r, 4 * KiB, 2, 2) for r in range(4)
    ]


@pytest.mark.parametrize(
    ("instance", "tp", "pp", "budget"), [("", 1, 1, KiB), ("llm", 0, 1, KiB), ("llm", 1, 0, KiB), ("llm", 4, 4, 15)]
)
def test_register_instance_refuses_invalid_registrations(state, instance, tp, pp, budget):
    with pytest.raises(ValueError):
        state.register_instance(instance, tp, pp, budget)
    assert state.quotas.snapshot() == []


def test_a_rank_beyond_tp_times_pp_is_invalid_argument_for_every_key(state):
    state.register_instance("llm", 2, 1, 16 * KiB)
    result = state.put_start(NS, ["k1", "k2", ""], [KiB, KiB, KiB], 1, PutOptions(instance="llm", rank=2))
    assert result.statuses == [Status.INVALID_ARGUMENT] * 3
    assert result.replica_counts == [0, 0, 0]
    assert result.replica_segments == [] and result.replica_offsets == []
    assert "rank 2" in result.first_error and "llm" in result.first_error
    assert sum(s.used for s in state.segments.values()) == 0
    assert state.snapshot().pending_puts == 0
    assert [o.rank for o in state.quotas.snapshot()] == [0, 1], "no account for a rank that does not exist"
    # the ranks that exist may put
    assert put_status(state, "k1", **by("llm", 1)) == OK
    assert_consistent(state)


# ---------------------------------------------------------------- quota eviction and isolation


def test_a_rank_over_its_quota_evicts_its_own_lru_objects_only(state, clock):
    # given instance llm (2 ranks x 4 KiB) and instance other (1 rank x 4 KiB), and objects with no owner;
    # everyone else's objects are older than rank 0's, so they come first in the global LRU order
    state.register_instance("llm", 2, 1, 8 * KiB)
    state.register_instance("other", 1, 1, 4 * KiB)
    for i in range(4):
        put(state, f"free/{i}")
        put(state, f"r1/{i}", **by("llm", 1))
        put(state, f"other/{i}", **by("other", 0))
    for i in range(4):
        put(state, f"r0/{i}", **by("llm", 0))
    assert account(state, "llm", 0) == (4 * KiB, 4)
    everyone_else = {k for k in stored(state) if not k.startswith("r0/")}
    # when rank 0 puts one more object
    put(state, "r0/4", **by("llm", 0))
    # then its own least recently used object made room, and nobody else's
    assert stored(state) == everyone_else | {"r0/1", "r0/2", "r0/3", "r0/4"}
    assert account(state, "llm", 0) == (4 * KiB, 4)
    assert account(state, "llm", 1) == (4 * KiB, 4)
    assert account(state, "other", 0) == (4 * KiB, 4)
    # reads refresh recency within the rank too: r0/1 read, so r0/2 goes next
    read(state, "r0/1")
    end_leases(state, clock)
    put(state, "r0/5", **by("llm", 0))
    assert stored(state) == everyone_else | {"r0/1", "r0/3", "r0/4", "r0/5"}
    # a bigger object takes as many of the rank's objects as it needs
    put(state, "r0/big", 3 * KiB, **by("llm", 0))
    assert stored(state) == everyone_else | {"r0/big", "r0/5"}
    assert state.evictions == {"quota": [5, 5 * KiB]}
    assert_consistent(state)


def test_two_ranks_under_pressure_each_evict_only_their_own(state):
    state.register_instance("llm", 2, 1, 4 * KiB)  # 2 KiB per rank
    for i in range(6):
        put(state, f"r0/{i}", **by("llm", 0))
        put(state, f"r1/{i}", **by("llm", 1))
    assert stored(state) == {"r0/4", "r0/5", "r1/4", "r1/5"}
    assert account(state, "llm", 0) == account(state, "llm", 1) == (2 * KiB, 2)
    assert state.evictions == {"quota": [8, 8 * KiB]}
    assert_consistent(state)


def test_quota_eviction_runs_even_when_the_segments_have_room(state):
    state.register_instance("llm", 1, 1, 2 * KiB)
    for i in range(3):
        put(state, f"k{i}", **by("llm"))
    assert stored(state) == {"k1", "k2"}
    assert sum(s.used for s in state.segments.values()) == 2 * KiB


def test_quota_is_per_instance_and_rank_across_namespaces(state):
    state.register_instance("llm", 1, 1, 2 * KiB)
    for namespace in ("one", "two", "three"):
        started = state.put_start(namespace, ["k"], [KiB], 1, PutOptions(instance="llm"))
        assert started.statuses == [OK]
        assert state.put_end(namespace, ["k"], [1], started.put_id) == [OK]
    assert state.exists("one", ["k"]) == ([False], 0)
    assert state.exists("two", ["k"]) == ([True], 1) and state.exists("three", ["k"]) == ([True], 1)
    assert account(state, "llm") == (2 * KiB, 2)
    assert_consistent(state)


# ---------------------------------------------------------------- QUOTA_EXCEEDED


def test_quota_exceeded_when_the_rank_holds_only_hard_pinned_objects(state):
    state.register_instance("llm", 1, 1, 4 * KiB)
    for i in range(4):
        put(state, f"h{i}", **by("llm", pin=PIN_HARD))
    assert account(state, "llm") == (4 * KiB, 4), "hard-pinned objects count against the quota"
    assert put_status(state, "x", **by("llm")) == Status.QUOTA_EXCEEDED
    assert put_status(state, "x", 1, **by("llm", pin=PIN_HARD)) == Status.QUOTA_EXCEEDED
    assert stored(state) == {"h0", "h1", "h2", "h3"}
    assert state.evictions == {}
    # another rank, another instance and unowned puts are not affected
    assert put_status(state, "y", **by("someone")) == OK
    assert put_status(state, "z") == OK
    assert_consistent(state)


def test_quota_exceeded_when_the_rank_objects_are_leased_until_the_leases_end(state, clock):
    state.register_instance("llm", 1, 1, 2 * KiB)
    put(state, "a", **by("llm"))
    put(state, "b", **by("llm"))
    read(state, "a", "b")
    result = state.put_start(NS, ["x"], [KiB], 1, PutOptions(instance="llm"))
    assert result.statuses == [Status.QUOTA_EXCEEDED]
    assert result.replica_counts == [0]
    assert "QUOTA_EXCEEDED" in result.first_error
    assert stored(state) == {"a", "b"}
    end_leases(state, clock)
    assert put_status(state, "x", **by("llm")) == OK
    assert stored(state) == {"b", "x"}
    assert_consistent(state)


def test_quota_exceeded_while_the_ranks_own_puts_are_in_flight(state):
    state.register_instance("llm", 1, 1, 2 * KiB)
    started = state.put_start(NS, ["p1", "p2"], [KiB, KiB], 1, PutOptions(instance="llm"))
    assert started.statuses == [OK, OK]
    assert account(state, "llm") == (2 * KiB, 2), "pending puts are charged at PutStart"
    assert put_status(state, "x", **by("llm")) == Status.QUOTA_EXCEEDED
    # in one batch: the first key fits, the second does not (the first is pending, not evictable)
    state.put_revoke(NS, ["p1", "p2"], started.put_id)
    batch = state.put_start(NS, ["q1", "q2", "q3"], [KiB, KiB, KiB], 1, PutOptions(instance="llm"))
    assert batch.statuses == [OK, OK, Status.QUOTA_EXCEEDED]
    assert_consistent(state)


def test_quota_exceeded_for_an_object_larger_than_the_quota_without_evicting(state):
    state.register_instance("llm", 1, 1, 4 * KiB)
    put(state, "small", **by("llm"))
    assert put_status(state, "huge", 4 * KiB + 1, **by("llm")) == Status.QUOTA_EXCEEDED
    assert put_status(state, "pair", 3 * KiB, replicas=2, **by("llm")) == Status.QUOTA_EXCEEDED
    assert stored(state) == {"small"}, "a put that can never fit must not evict anything"
    assert state.evictions == {}
    # exactly the quota fits (evicting the rest)
    assert put_status(state, "whole", 4 * KiB, **by("llm")) == OK
    assert stored(state) == {"whole"}
    assert_consistent(state)


def test_a_put_refused_for_quota_evicts_nothing(state):
    # 4 KiB quota: a 3 KiB hard-pinned object and a 1 KiB unpinned one; a 2 KiB put can never fit
    state.register_instance("llm", 1, 1, 4 * KiB)
    put(state, "hard", 3 * KiB, **by("llm", pin=PIN_HARD))
    put(state, "plain", **by("llm"))
    assert put_status(state, "x", 2 * KiB, **by("llm")) == Status.QUOTA_EXCEEDED
    assert stored(state) == {"hard", "plain"}, "the refused put destroyed 'plain' for nothing"


def test_a_put_refused_for_space_evicts_nothing_for_quota(clock):
    state = make_state(clock)
    mount(state, "a", 4 * KiB)
    state.register_instance("llm", 1, 1, 2 * KiB)
    put(state, "mine", **by("llm"))
    put(state, "pinned", 3 * KiB, pin=PIN_HARD)
    assert put_status(state, "x", 2 * KiB, **by("llm")) == Status.NO_SPACE  # can never fit beside the pin
    assert "mine" in stored(state), "the refused put evicted 'mine' for its quota for nothing"


def test_soft_pins_of_the_rank_go_after_its_unpinned_objects(state):
    state.register_instance("llm", 1, 1, 3 * KiB)
    put(state, "soft", **by("llm", pin=PIN_SOFT))
    put(state, "u1", **by("llm"))
    put(state, "u2", **by("llm"))
    put(state, "x", **by("llm"))
    assert stored(state) == {"soft", "u2", "x"}
    put(state, "y", 2 * KiB, **by("llm"))
    assert stored(state) == {"soft", "y"}
    # only when the unpinned objects are not enough does the soft pin go
    put(state, "w", 3 * KiB, **by("llm"))
    assert stored(state) == {"w"}
    assert_consistent(state)


# ---------------------------------------------------------------- accounting


def test_replicas_count_against_the_quota(state):
    state.register_instance("llm", 1, 1, 4 * KiB)
    put(state, "r0", replicas=2, **by("llm"))
    assert account(state, "llm") == (2 * KiB, 1)
    put(state, "r1", 1000, replicas=2, **by("llm"))  # 1000 B is charged as 1024 (alignment) per replica
    assert account(state, "llm") == (4 * KiB, 2)
    put(state, "r2", replicas=2, **by("llm"))
    assert stored(state) == {"r1", "r2"}
    assert account(state, "llm") == (4 * KiB, 2)
    assert state.evictions == {"quota": [1, 2 * KiB]}
    assert_consistent(state)


def test_losing_one_replica_gives_its_bytes_back_to_the_rank(state):
    a, b = sorted(state.segments)
    put(state, "r", replicas=2, **by("llm"))
    put(state, "solo", **by("llm", preferred_segment="b"))
    assert account(state, "llm") == (3 * KiB, 2)
    assert state.unmount_segment(a) == OK
    assert account(state, "llm") == (2 * KiB, 2)
    assert state.unmount_segment(b) == OK
    assert account(state, "llm") == (0, 0)
    assert_consistent(state)


def test_a_replica_dropped_by_eviction_gives_its_bytes_back_to_the_rank(clock):
    state = make_state(clock)
    mount(state, "a", 2 * KiB)
    mount(state, "b", 2 * KiB)
    put(state, "r", replicas=2, **by("llm"))
    put(state, "x", preferred_segment="a")
    put(state, "z", preferred_segment="b")
    put(state, "y", preferred_segment="a")  # takes r's copy on a
    assert account(state, "llm") == (KiB, 1)
    assert_consistent(state)


@pytest.mark.parametrize(
    "how", ["remove", "remove_prefix", "remove_leased", "revoke", "reclaim_by_tick", "reclaim_inline"]
)
def test_the_rank_account_returns_to_zero(state, clock, how):
    state.register_instance("llm", 2, 1, 64 * KiB)
    options = PutOptions(instance="llm", rank=1)
    if how in ("remove", "remove_prefix", "remove_leased"):
        put(state, "p/k1", 3000, replicas=2, **by("llm", 1))
        put(state, "p/k2", 0, **by("llm", 1))
        put(state, "p/k3", 100, **by("llm", 1, pin=PIN_HARD))
        assert account(state, "llm", 1) == (2 * 3008 + 0 + 128, 3)
        if how == "remove_leased":
            read(state, "p/k1", "p/k3")
        if how == "remove_prefix":
            assert state.remove_prefix(NS, "p/") == 3
        else:
            assert state.remove(NS, ["p/k1", "p/k2", "p/k3"]) == [OK] * 3
    else:
        started = state.put_start(NS, ["k1", "k2"], [3000, 5000], 2, options)
        assert started.statuses == [OK, OK]
        assert account(state, "llm", 1) == (2 * 3008 + 2 * 5056, 2)
        if how == "revoke":
            assert state.put_revoke(NS, ["k1", "k2"], started.put_id) == [OK, OK]
        elif how == "reclaim_by_tick":
            advance_alive(state, clock, state.config.put_timeout_s)
            state.tick()
        else:  # a new put of the same keys after the timeout reclaims the old ones, then charges itself
            advance_alive(state, clock, state.config.put_timeout_s)
            again = state.put_start(NS, ["k1", "k2"], [64, 64], 1, options)
            assert again.statuses == [OK, OK]
            assert account(state, "llm", 1) == (128, 2)
            assert state.put_revoke(NS, ["k1", "k2"], again.put_id) == [OK, OK]
    assert account(state, "llm", 1) == (0, 0)
    assert account(state, "llm", 0) == (0, 0)
    assert_consistent(state)


@pytest.mark.parametrize("how", ["unmount", "heartbeat_ttl", "remount"])
def test_the_rank_account_returns_to_zero_when_segments_are_lost(state, clock, how):
    a, b = sorted(state.segments)
    put(state, "both", 3000, replicas=2, **by("llm"))
    put(state, "on-a", **by("llm", preferred_segment="a"))
    put(state, "on-b", **by("llm", preferred_segment="b"))
    state.put_start(NS, ["pending"], [KiB], 2, PutOptions(instance="llm"))
    assert account(state, "llm") == (2 * 3008 + 2 * KiB + 2 * KiB, 4)
    if how == "unmount":
        assert state.unmount_segment(a) == OK
        assert account(state, "llm") == (3008 + KiB, 2), "only 'both' (one copy) and 'on-b' are left"
        assert state.unmount_segment(b) == OK
    elif how == "heartbeat_ttl":
        clock.advance(state.config.segment_ttl_s + 1)
        state.tick()
        assert state.segments == {}
    else:
        mount(state, "a", MiB)
        mount(state, "b", MiB)
    assert account(state, "llm") == (0, 0)
    assert_consistent(state)


def test_re_registering_with_a_smaller_budget_evicts_on_the_next_put(state):
    state.register_instance("llm", 1, 1, 8 * KiB)
    for i in range(8):
        put(state, f"k{i}", **by("llm"))
    assert state.register_instance("llm", 1, 1, 4 * KiB) == 4 * KiB
    assert owner(state, "llm").quota == 4 * KiB
    assert len(stored(state)) == 8, "re-registering evicts nothing by itself"
    put(state, "new", **by("llm"))
    assert stored(state) == {"k5", "k6", "k7", "new"}
    assert account(state, "llm") == (4 * KiB, 4)
    # and a bigger budget lets the rank hold more again
    assert state.register_instance("llm", 1, 1, 6 * KiB) == 6 * KiB
    put(state, "more1", **by("llm"))
    put(state, "more2", **by("llm"))
    assert len(stored(state)) == 6
    assert_consistent(state)


def test_re_registering_with_more_ranks_splits_the_budget(state):
    state.register_instance("llm", 1, 1, 8 * KiB)
    assert put_status(state, "r1", **by("llm", 1)) == Status.INVALID_ARGUMENT
    assert state.register_instance("llm", 2, 1, 8 * KiB) == 4 * KiB
    assert put_status(state, "r1", **by("llm", 1)) == OK
    assert [(o.rank, o.quota) for o in state.quotas.snapshot()] == [(0, 4 * KiB), (1, 4 * KiB)]


def test_an_unregistered_instance_is_tracked_without_a_limit(state):
    for i in range(100):
        put(state, f"k{i}", 10 * KiB, **by("adhoc", 7))
    o = owner(state, "adhoc", 7)
    assert (o.quota, o.used, o.objects, o.tp_size, o.pp_size) == (0, 1000 * KiB, 100, 0, 0)
    assert [(x.instance, x.rank) for x in state.quotas.snapshot()] == [("adhoc", 7)]
    assert "quota" not in state.evictions
    assert_consistent(state)


def test_puts_without_an_instance_are_not_accounted(state):
    put(state, "k", 10 * KiB)
    put(state, "j", 10 * KiB, rank=3)  # a rank without an instance means nothing
    assert state.quotas.snapshot() == []
    assert_consistent(state)


def test_an_idempotent_re_put_is_not_charged_again(state):
    state.register_instance("llm", 1, 1, 2 * KiB)
    put(state, "k", **by("llm"))
    again = state.put_start(NS, ["k"], [KiB], 1, PutOptions(instance="llm"))
    assert again.statuses == [OK] and again.replica_counts == [0]
    assert account(state, "llm") == (KiB, 1)
    # even when it comes from another rank: the object keeps its owner
    state.put_start(NS, ["k"], [KiB], 1, PutOptions(instance="other"))
    assert account(state, "llm") == (KiB, 1)
    assert account(state, "other") == (0, 0)


def test_accounts_of_unregistered_instances_go_with_their_last_object(state: MasterState) -> None:
    put(state, "taken", **by("engine-0"))
    for i in range(20):  # each instance name made an account that stayed for good
        again = state.put_start(NS, ["taken"], [KiB], 1, PutOptions(**by(f"engine-{i}")))
        assert again.replica_counts == [0]  # stored already: nothing written, nothing charged
        assert put_status(state, f"new{i}", **by(f"engine-{i + 100}")) == Status.OK
        assert state.remove(NS, [f"new{i}"]) == [Status.OK]
    assert {(o.instance, o.rank) for o in state.quotas.snapshot()} == {("engine-0", 0)}
    state.register_instance("registered", 1, 1, MiB)
    put(state, "r", **by("registered"))
    assert state.remove(NS, ["r"]) == [Status.OK]
    assert account(state, "registered") == (0, 0)  # a registered instance keeps its accounts
    assert_consistent(state)


def test_an_account_that_went_idle_within_a_put_is_kept_when_that_put_charges_it(state: MasterState, clock) -> None:
    """Its last object left inside the PutStart that charges it (its own abandoned put reclaimed):
    the account was forgotten and the new object charged to one outside the table, invisible to
    `kvtier quotas` and to a later registration (review of the idle-account change)."""
    options = PutOptions(**by("eng"))
    assert state.put_start(NS, ["k"], [KiB], 1, options).statuses == [Status.OK]
    clock.advance(state.config.put_timeout_s + 1)  # abandoned, not reclaimed by a tick yet
    again = state.put_start(NS, ["k"], [KiB], 1, options)
    assert again.statuses == [Status.OK]
    assert any(o is state.record(NS, "k").owner for o in state.quotas.snapshot())
    assert account(state, "eng") == (KiB, 1)
