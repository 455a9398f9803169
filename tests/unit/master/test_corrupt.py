"""kvtier.master.corrupt: readers' reports of damaged replicas, against a real MasterState and fake clock."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.corrupt import CorruptReport
from kvtier.master.records import TIER_DRAM, TIER_SSD
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_state import NS, OK, FakeClock, advance_alive, mount, put, used, visible

NOT_FOUND = int(Status.NOT_FOUND)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(
        cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0, put_timeout_s=30.0
    ).validate()
    return MasterState(config, clock=clock)


def reports_for(state, key: str, checksum: int = 7, namespace: str = NS) -> list[CorruptReport]:
    """One report per replica of `key`, as a reader would send after GetReplicas."""
    got = state.get_replicas(namespace, [key])
    return [
        CorruptReport(key, segment, tier, offset, checksum)
        for segment, tier, offset in zip(got.replica_segments, got.replica_tiers, got.replica_offsets, strict=True)
    ]


def test_the_last_replica_reported_takes_the_object_and_frees_its_range_after_the_lease(state, clock):
    mount(state, "a")
    put(state, "k", size=4096)
    (report,) = reports_for(state, "k")  # the read grants a lease
    assert state.corrupt.report(NS, [report]) == [OK]
    assert not visible(state, "k")
    assert state.corrupt.dropped == {"dram": 1, "ssd": 0}
    assert used(state) > 0, "a reader's lease still covers the range"
    advance_alive(state, clock, state.config.lease_s + 1)
    state.tick()
    assert used(state) == 0
    assert_consistent(state)
    # The key is free: a new put writes it anew.
    put(state, "k", size=4096, checksum=8)
    assert visible(state, "k")


def test_one_replica_of_two_goes_and_the_object_stays(state):
    mount(state, "a")
    mount(state, "b")
    put(state, "k", replicas=2)
    bad, good = reports_for(state, "k")
    bad = CorruptReport(
        bad.key, bad.segment_id, bad.tier, bad.offset, bad.checksum, state.segments[bad.segment_id].name
    )
    assert state.corrupt.report(NS, [bad]) == [OK], "the right segment name"
    got = state.get_replicas(NS, ["k"])
    assert got.statuses == [OK] and got.replica_segments == [good.segment_id]
    assert state.corrupt.report(NS, [bad]) == [NOT_FOUND], "a repeated report drops nothing"
    assert state.corrupt.stale == 1
    assert_consistent(state)


def test_stale_reports_drop_nothing(state):
    mount(state, "a")
    put(state, "k", checksum=7)
    (report,) = reports_for(state, "k", checksum=7)
    assert state.remove(NS, ["k"]) == [OK]
    put(state, "k", checksum=9)  # re-put: another checksum
    assert state.corrupt.report(NS, [report]) == [NOT_FOUND]
    (current,) = reports_for(state, "k", checksum=9)
    moved = CorruptReport("k", current.segment_id, current.tier, current.offset + 4096, 9)
    other_tier = CorruptReport("k", current.segment_id, TIER_SSD, current.offset, 9)
    bad_tier = CorruptReport("k", current.segment_id, 3, current.offset, 9)
    # A segment id handed out by an earlier master may name another segment now: the name must match.
    renamed = CorruptReport("k", current.segment_id, current.tier, current.offset, 9, "b")
    assert state.corrupt.report(NS, [moved, other_tier, bad_tier, renamed]) == [NOT_FOUND] * 4
    assert state.corrupt.report("other-ns", [current]) == [NOT_FOUND], "namespaces are separate"
    assert state.corrupt.report(NS, [CorruptReport("absent", 1, TIER_DRAM, 0, 9)]) == [NOT_FOUND]
    assert visible(state, "k") and state.corrupt.dropped == {"dram": 0, "ssd": 0}
    assert state.corrupt.stale == 7
    assert_consistent(state)


def test_a_pending_object_is_never_dropped(state):
    mount(state, "a")
    started = state.put_start(NS, ["p"], [1000], 1)
    report = CorruptReport("p", started.replica_segments[0], TIER_DRAM, started.replica_offsets[0], 0)
    assert state.corrupt.report(NS, [report]) == [NOT_FOUND]
    assert state.put_end(NS, ["p"], [7], started.put_id) == [OK]
    assert visible(state, "p")


def test_an_offset_past_48_bits_never_names_another_segments_replica(state):
    """Replicas pack segment << 50 | tier << 48 | offset: segment 1 with offset bit 51 set would be segment 3."""
    ids = [mount(state, name) for name in ("a", "b", "c")]
    assert ids == [1, 2, 3]
    started = state.put_start(NS, ["k"], [1000], 1, PutOptions(preferred_segment="c"))
    assert started.replica_segments == [3]
    assert state.put_end(NS, ["k"], [7], started.put_id) == [OK]
    forged = CorruptReport("k", 1, TIER_DRAM, started.replica_offsets[0] | 1 << 51, 7)
    assert state.corrupt.report(NS, [forged]) == [NOT_FOUND]
    assert visible(state, "k")
