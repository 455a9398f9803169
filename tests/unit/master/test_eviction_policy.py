"""Eviction policies (issue 21): S3-FIFO's queues and LRU's order, through MasterState on a fake clock
and on the policy objects directly. Segments hold a handful of 1 KiB objects, so "full" is a few puts."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings

from kvtier.master.config import MasterConfig, parse_args
from kvtier.master.eviction_policy import FREQ_MAX, GHOST_MIN, S3FifoPolicy, make_policy
from kvtier.master.records import PIN_HARD, PIN_SOFT, ObjectRecord, replica
from kvtier.master.recovery import inventory_done, report_dram_objects
from kvtier.master.state import MasterState
from kvtier.proto.status import Status
from tests.unit.master.accounting import _INDEXES, assert_consistent
from tests.unit.master.test_eviction import (
    EvictionMachine,
    KiB,
    end_leases,
    make_state,
    put,
    read,
    stored,
)
from tests.unit.master.test_recovery import chunk
from tests.unit.master.test_state import FakeClock, mount

POLICIES = ["lru", "s3fifo"]
OK = Status.OK


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def s3fifo_state(clock: FakeClock) -> MasterState:
    return make_state(clock, eviction_policy="s3fifo")


def where(state: MasterState, key: str) -> str:
    return state.policy.where("ns\x00" + key)


# ---------------------------------------------------------------- through MasterState


@pytest.mark.parametrize(("policy", "hot_survives"), [("lru", False), ("s3fifo", True)])
def test_a_hot_set_read_twice_survives_a_one_shot_scan_only_under_s3fifo(clock, policy, hot_survives):
    # given a segment of 10 objects holding a hot set of 4, each read twice
    state = make_state(clock, eviction_policy=policy)
    mount(state, "a", 10 * KiB)
    hot = [f"h{i}" for i in range(4)]
    for key in hot:
        put(state, key)
    for _ in range(2):
        read(state, *hot)
    end_leases(state, clock)
    # when a scan puts and reads once 20 cold keys, one after the other
    for i in range(20):
        put(state, f"s{i}")
        read(state, f"s{i}")
        end_leases(state, clock)
    # then S3-FIFO kept the hot set (the scan left from the small FIFO), LRU lost all of it
    kept = stored(state)
    assert (set(hot) <= kept) is hot_survives
    assert (kept.isdisjoint(hot)) is not hot_survives
    assert len(kept) == 10
    assert_consistent(state)


def test_one_hit_wonders_leave_from_the_small_fifo_in_insertion_order(clock):
    state = s3fifo_state(clock)
    mount(state, "a", 4 * KiB)
    for key in "abcd":
        put(state, key)
    read(state, "a")  # once: still a one-hit wonder
    end_leases(state, clock)
    assert [where(state, k) for k in "abcd"] == ["small"] * 4
    put(state, "e")
    put(state, "f")
    assert stored(state) == {"c", "d", "e", "f"}  # a and b went first, a's single read did not save it
    assert state.policy.sizes()[2] == 2  # both remembered in the ghost
    assert_consistent(state)


def test_a_key_read_twice_reaches_main_and_a_main_key_outlives_the_small_fifo(clock):
    state = s3fifo_state(clock)
    mount(state, "a", 4 * KiB)
    for key in "abcd":
        put(state, key)
    read(state, "a")
    assert where(state, "a") == "small"
    read(state, "a")
    assert where(state, "a") == "main"
    end_leases(state, clock)
    for key in "efg":
        put(state, key)
    assert stored(state) == {"a", "e", "f", "g"}
    assert_consistent(state)


def test_a_ghost_hit_goes_straight_to_main(clock):
    state = s3fifo_state(clock)
    mount(state, "a", 2 * KiB)
    put(state, "a")
    put(state, "b")
    put(state, "c")  # evicts a into the ghost
    assert "a" not in stored(state)
    put(state, "a")  # wanted again: not a one-hit wonder after all
    assert where(state, "a") == "main"
    assert state.policy.ghost_hits == 1
    assert_consistent(state)


def test_hard_pins_are_never_victims_and_soft_pins_go_last(clock):
    state = s3fifo_state(clock)
    mount(state, "a", 3 * KiB)
    put(state, "hard", pin=PIN_HARD)
    put(state, "soft", pin=PIN_SOFT)
    put(state, "plain")
    put(state, "new")  # the small FIFO's oldest is hard-pinned, then soft-pinned: "plain" goes
    assert stored(state) == {"hard", "soft", "new"}
    put(state, "newer")  # only soft-pinned or hard-pinned or new left: "new" (unpinned) goes first
    assert stored(state) == {"hard", "soft", "newer"}
    assert_consistent(state)


def test_a_disk_only_record_leaves_the_queues_and_rejoins_on_promotion(clock):
    # the queues hold exactly the complete records with a DRAM copy (assert_consistent checks it)
    state = s3fifo_state(clock)
    mount(state, "a", 4 * KiB)
    put(state, "a")
    record = state.record("ns", "a")
    state.evict_one(record, "watermark")
    assert where(state, "a") == ""
    assert_consistent(state)


@pytest.mark.parametrize("policy", POLICIES)
def test_recovery_rebuilds_the_order_under_whichever_policy_the_master_now_has(clock, policy):
    # a restarted master (the policy may have changed: the order is not saved) adopts the segment's
    # inventory; under s3fifo every object joins the small FIFO, under lru the dict order
    state = make_state(clock, eviction_policy=policy)
    state.begin_recovery({"a"}, timeout_s=5.0)
    result = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], 3 * KiB, inventory=True)
    segment_id = result.segment.segment_id
    entries = [(key, KiB, 7, i * KiB) for i, key in enumerate("abc")]
    assert report_dram_objects(state, segment_id, chunk(entries)) == [OK] * 3
    # the segment keeps its index (what tests/unit/master/accounting.py checks the books against)
    _INDEXES.setdefault(state, {})[segment_id] = {i * KiB: ("ns\x00" + k, KiB, 7) for i, k in enumerate("abc")}
    inventory_done(state, segment_id)
    assert state.serving
    if policy == "s3fifo":
        assert [where(state, k) for k in "abc"] == ["small"] * 3
    assert_consistent(state)
    end_leases(state, clock)  # adopted objects are leased a while (readers may hold their old placements)
    put(state, "d")  # room: the oldest adopted object goes under both
    assert stored(state) == {"b", "c", "d"}


# ---------------------------------------------------------------- the policy object alone


def records(names: list[str], objects: dict[str, ObjectRecord], policy: S3FifoPolicy) -> list[ObjectRecord]:
    out = []
    for name in names:
        record = ObjectRecord(name, KiB, (replica(1, 0),), 1, 0.0)
        record.complete(1)
        objects[name] = record
        policy.inserted(record)
        out.append(record)
    return out


def one(record: ObjectRecord) -> int:
    return 1


def anything(record: ObjectRecord) -> bool:
    return True


def test_main_gives_a_read_object_a_second_chance_per_read_and_ages_it():
    objects: dict[str, ObjectRecord] = {}
    policy = S3FifoPolicy(objects)
    a, b = records(["a", "b"], objects, policy)
    for _ in range(3):
        policy.touched(a)  # a: read three times -> main at frequency 3 (capped)
    for _ in range(2):
        policy.touched(b)  # b: main at 2
    assert policy.where("a") == policy.where("b") == "main"
    assert policy.frequency("a") == FREQ_MAX and policy.frequency("b") == 2
    # the hand goes a, b, a, b, a (one chance less each time), then finds b at 0: the victim;
    # a, read once more than b, is left at 0 and is next
    assert policy.victims(0.0, 1, one, anything) == [b]
    assert policy.frequency("a") == 0 and policy.frequency("b") == 0
    del objects["b"]
    policy.removed(b, evicted=True)
    assert policy.victims(0.0, 1, one, anything) == [a]
    assert policy.sizes() == (0, 1, 0)  # evicted from main: not remembered in the ghost


def test_victims_follow_the_small_fifo_while_it_holds_its_share():
    objects: dict[str, ObjectRecord] = {}
    policy = S3FifoPolicy(objects)
    rs = records([f"k{i}" for i in range(10)], objects, policy)
    for r in rs[:5]:
        policy.touched(r)
        policy.touched(r)  # main, frequency 2
    # small holds 5 of 10 (>= 10%): its oldest go first, main's untouched
    assert policy.victims(0.0, 3, one, anything) == rs[5:8]
    assert [policy.frequency(r.name) for r in rs[:5]] == [2] * 5


def test_the_ghost_is_bounded():
    objects: dict[str, ObjectRecord] = {}
    policy = S3FifoPolicy(objects)
    for i in range(3 * GHOST_MIN):
        (record,) = records([f"k{i}"], objects, policy)
        del objects[record.name]
        policy.removed(record, evicted=True)
    small, main, ghost = policy.sizes()
    assert (small, main) == (0, 0)
    assert ghost == GHOST_MIN


def test_a_removal_that_is_not_an_eviction_leaves_no_ghost():
    objects: dict[str, ObjectRecord] = {}
    policy = S3FifoPolicy(objects)
    (record,) = records(["k"], objects, policy)
    del objects["k"]
    policy.removed(record, evicted=False)
    assert policy.sizes() == (0, 0, 0)


def test_victims_skip_leased_and_pinned_records_in_either_queue():
    objects: dict[str, ObjectRecord] = {}
    policy = S3FifoPolicy(objects)
    leased, hard, plain = records(["leased", "hard", "plain"], objects, policy)
    leased.lease_until = 10.0
    hard.pin_until = math.inf
    assert policy.victims(5.0, 3, one, anything) == [plain]


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("policy", POLICIES)
def test_the_option_takes_each_policy(policy):
    config = MasterConfig(eviction_policy=policy).validate()
    assert make_policy(config.eviction_policy, {}).name == policy


def test_a_bad_policy_is_a_one_line_start_up_error_naming_the_option(capsys):
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, s3fifo, got 'lfu'"):
        MasterConfig(eviction_policy="lfu").validate()
    with pytest.raises(SystemExit) as excinfo:
        parse_args(["--eviction-policy", "lfu", "--state-dir", "none"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["kvtier-master: error: eviction_policy must be one of lru, s3fifo, got 'lfu'"]


class S3FifoEvictionMachine(EvictionMachine):
    """The random scenario of test_eviction.py (pins, leases, quotas, segment loss) under s3fifo:
    the same safety invariants, and the queues in step with the tables after every step."""

    policy = "s3fifo"


TestS3FifoEvictionMachine = S3FifoEvictionMachine.TestCase
TestS3FifoEvictionMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
