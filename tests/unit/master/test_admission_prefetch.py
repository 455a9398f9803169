"""SSD write admission (master/admission.py) and prefetch on lookup (master/prefetch.py), on a fake
clock; the segment's tier worker is played by FakeDisk (tests/unit/master/test_tiering.py)."""

from __future__ import annotations

import pytest

from kvtier.master import prefetch
from kvtier.master.records import TIER_DRAM, TIER_SSD
from kvtier.master.state import MasterState
from kvtier.master.tier_tasks import TaskKind
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_eviction import LEASE_S, NS, KiB, make_state, put, read, stored
from tests.unit.master.test_state import FakeClock, advance_alive
from tests.unit.master.test_tiering import FakeDisk, mount_ssd, offloaded_k0, tiers


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---------------------------------------------------------------------------- admission


def test_objects_read_fewer_times_than_required_are_dropped_not_offloaded(clock):
    state = make_state(clock, ssd_admit_after_reads=1, promote_after_reads=0)
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    put(state, "k0")
    read(state, "k0")
    advance_alive(state, clock, LEASE_S + 1)  # its read lease ends: it may be evicted
    for i in (1, 2, 3):
        put(state, f"k{i}")
    # the least recently used, k0, was read once: admitted, offloaded
    state.tick()
    tasks = disk.poll()
    assert [(t.kind, t.name.split("\x00")[1]) for t in tasks] == [(TaskKind.OFFLOAD, "k0")]
    disk.complete(tasks)
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    # the next victim, k1, was never read: dropped at once (to recompute), counted
    put(state, "k4")
    state.tick()
    assert disk.poll() == []
    assert stored(state) == {"k0", "k2", "k3", "k4"}
    assert state.tiering.counters["admission_veto_reads"] == 1
    assert state.evictions["watermark"][0] == 1
    assert_consistent(state)


def test_objects_below_the_minimum_size_are_dropped_not_offloaded(clock):
    state = make_state(clock, ssd_admit_min_bytes="2KiB")
    seg = mount_ssd(state, "a", 8 * KiB)
    disk = FakeDisk(state, seg)
    put(state, "small")  # 1 KiB
    for i in range(3):
        put(state, f"big{i}", size=2 * KiB)
    put(state, "small2")
    state.tick()  # 8 KiB of 8: over the 0.90 watermark; the LRU victims are "small", then "big0"
    assert [t.name.split("\x00")[1] for t in disk.poll()] == ["big0"]
    assert stored(state) == {"big0", "big1", "big2", "small2"}
    assert state.tiering.counters["admission_veto_min_size"] == 1
    assert state.tiering.refusal(state.record(NS, "big0"), state.segments[seg]) is None
    assert_consistent(state)


def test_offload_ahead_skips_objects_admission_refuses(clock):
    state = make_state(clock, ssd_admit_after_reads=1)
    seg = mount_ssd(state, "a", 10 * KiB)
    disk = FakeDisk(state, seg)
    for i in range(7):
        put(state, f"k{i}")
    read(state, "k5")  # the only object read: the only one admitted
    advance_alive(state, clock, LEASE_S + 1)  # (a leased object is not copied ahead either)
    put(state, "k7")
    put(state, "k8")  # 9 KiB of 10: above the offload watermark (0.80), not the high one (0.90)
    state.tick()
    assert [t.name.split("\x00")[1] for t in disk.poll()] == ["k5"]
    assert state.tiering.counters["admission_veto_reads"] == 0  # nothing was dropped for it
    assert_consistent(state)


def test_default_admission_admits_everything(clock):
    state = make_state(clock)
    seg = mount_ssd(state, "a", 4 * KiB)
    record_seg = state.segments[seg]
    put(state, "k0", size=1)
    assert state.tiering.refusal(state.record(NS, "k0"), record_seg) is None


def test_admission_settings_are_validated():
    with pytest.raises(ValueError, match="ssd_admit_after_reads"):
        make_state(FakeClock(), ssd_admit_after_reads=256)
    with pytest.raises(ValueError, match="ssd_admit_min_bytes"):
        make_state(FakeClock(), ssd_admit_min_bytes="lots")


# ---------------------------------------------------------------------------- prefetch


@pytest.fixture
def state(clock) -> MasterState:
    """Promotion by reads off: only a prefetch promotes."""
    return make_state(clock, promote_after_reads=0)


def disk_only_k0_k1(state: MasterState) -> tuple[int, FakeDisk]:
    """k0 and k1 on SSD only; k2..k7 in DRAM (6 KiB of 8)."""
    seg, disk = offloaded_k0(state)
    assert tiers(state, "k0") == tiers(state, "k1") == [(seg, TIER_SSD)]
    assert state.segments[seg].used == 6 * KiB
    return seg, disk


def test_prefetch_promotes_disk_only_objects_found_regardless_of_promote_after_reads(state):
    seg, disk = disk_only_k0_k1(state)
    prefetch.prefetch(state, NS, ["k0", "k2", "absent"], [True, True, False], prefetch.FOUND)
    tasks = disk.poll()
    assert [(t.kind, t.name.split("\x00")[1], t.prefetch) for t in tasks] == [(TaskKind.PROMOTE, "k0", True)]
    # a second lookup while it is in flight starts nothing more
    prefetch.prefetch(state, NS, ["k0"], [True], prefetch.FOUND)
    assert disk.poll() == []
    assert_consistent(state)
    assert disk.complete(tasks) == [0]
    assert tiers(state, "k0") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    counters = state.tiering.counters
    assert (counters["prefetch_started"], counters["prefetch_completed"], counters["prefetch_skipped_in_flight"]) == (
        1,
        1,
        1,
    )
    assert_consistent(state)


def test_prefix_prefetch_stops_at_the_first_absent_key(state):
    _, disk = disk_only_k0_k1(state)
    prefetch.prefetch(state, NS, ["k0", "absent", "k1"], [True, False, True], prefetch.PREFIX)
    assert [t.name.split("\x00")[1] for t in disk.poll()] == ["k0"]


def test_prefetch_never_drops_an_only_copy_but_drops_redundant_ones(state):
    seg, disk = disk_only_k0_k1(state)
    prefetch.prefetch(state, NS, ["k0"], [True], prefetch.FOUND)  # 7 KiB of 8: fits under the watermark
    k0_task = disk.poll()
    # k1 does not fit under the watermark (7.2 KiB); every DRAM copy is an only copy (k0's is in flight)
    prefetch.prefetch(state, NS, ["k1"], [True], prefetch.FOUND)
    assert disk.poll() == []
    assert state.tiering.counters["prefetch_skipped_no_space"] == 1
    assert stored(state) == {f"k{i}" for i in range(8)}
    # once k0's DRAM copy is in place it is redundant (k0 is on SSD too): k1's prefetch may drop it
    disk.complete(k0_task)
    prefetch.prefetch(state, NS, ["k1"], [True], prefetch.FOUND)
    tasks = disk.poll()
    assert [t.name.split("\x00")[1] for t in tasks] == ["k1"]
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    assert state.evictions["prefetch"][0] == 1
    disk.complete(tasks)
    assert tiers(state, "k1") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    assert stored(state) == {f"k{i}" for i in range(8)}
    assert state.segments[seg].used <= 0.9 * state.segments[seg].capacity
    assert_consistent(state)


def test_prefetch_is_bounded_by_the_promotion_budget_and_expires_with_the_task_ttl(clock):
    state = make_state(clock, promote_after_reads=0, promotion_budget="1KiB")
    seg, disk = disk_only_k0_k1(state)
    del seg
    prefetch.prefetch(state, NS, ["k0", "k1"], [True, True], prefetch.FOUND)
    tasks = disk.poll()
    assert [t.name.split("\x00")[1] for t in tasks] == ["k0"]
    assert state.tiering.counters["prefetch_skipped_budget"] == 1
    # the segment never reports it: at the deadline it fails, its range is freed, the budget returns
    advance_alive(state, clock, state.tiering.task_ttl_s + 1)
    state.tick()
    assert state.tiering.counters["prefetch_failed"] == 1
    assert_consistent(state)
    prefetch.prefetch(state, NS, ["k1"], [True], prefetch.FOUND)
    assert [t.name.split("\x00")[1] for t in disk.poll()] == ["k1"]


def test_a_prefetch_that_would_take_its_rank_over_its_quota_is_skipped_as_quota(state):
    seg = mount_ssd(state, "a", 8 * KiB)
    disk = FakeDisk(state, seg)
    for i in range(8):
        put(state, f"k{i}", instance="llm", rank=0)
    state.tick()
    disk.complete(disk.poll())  # the least recently used offloaded, their DRAM copies freed
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    used = next(o.used for o in state.quotas.snapshot() if o.instance == "llm")
    state.register_instance("llm", 1, 1, used)  # the rank's quota is exactly what it holds
    prefetch.prefetch(state, NS, ["k0"], [True], prefetch.FOUND)
    assert disk.poll() == []
    assert state.tiering.counters["prefetch_skipped_quota"] == 1
    assert state.tiering.counters["prefetch_skipped_budget"] == 0


def test_an_expired_promotions_range_waits_out_the_clock_margin_before_reuse(clock):
    """A PROMOTE its segment never reported may still be about to write (stopped between its deadline
    check and the copy): its DRAM range is not handed out again until the clock-skew margin passed."""
    state = make_state(clock, promote_after_reads=0)
    state.reuse_margin_s = 2.0
    seg, disk = disk_only_k0_k1(state)
    used = state.segments[seg].allocator.used
    prefetch.prefetch(state, NS, ["k0"], [True], prefetch.FOUND)
    (task,) = disk.poll()
    assert state.segments[seg].allocator.used > used  # the promotion's range
    advance_alive(state, clock, state.tiering.task_ttl_s + 0.5)
    state.tick()  # expired: not reported
    assert state.segments[seg].allocator.used > used, "freed while the segment might still write it"
    advance_alive(state, clock, 2.0)
    state.tick()
    assert state.segments[seg].allocator.used == used
    assert_consistent(state)
