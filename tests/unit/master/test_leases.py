"""Releasable read leases (kvtier.master.leases) in MasterState, driven by a fake clock."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.state import MasterState
from kvtier.proto.status import Status
from tests.unit.master.test_state import FakeClock, mount

OK = Status.OK
NS = "ns"
SIZE = 1000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", lease_s=5.0, put_timeout_s=30.0).validate()
    return MasterState(config, clock=clock)


def put(state: MasterState, key: str) -> None:
    result = state.put_start(NS, [key], [SIZE], 1)
    assert result.statuses == [OK]
    assert state.put_end(NS, [key], [7], result.put_id, []) == [OK]


def used(state: MasterState) -> int:
    return sum(s.used for s in state.segments.values())


def test_released_lease_frees_a_removed_range_at_once(state: MasterState) -> None:
    mount(state, "a")
    put(state, "k")
    lease = state.get_replicas(NS, ["k"], releasable=True).lease_id
    assert lease
    assert state.leases.release([lease]) == 1
    assert state.remove(NS, ["k"]) == [OK]
    assert used(state) == 0


def test_removed_range_waits_for_every_counted_reader(state: MasterState, clock: FakeClock) -> None:
    mount(state, "a")
    put(state, "k")
    first = state.get_replicas(NS, ["k"], releasable=True).lease_id
    second = state.get_replicas(NS, ["k"], releasable=True).lease_id
    assert first != second
    assert state.remove(NS, ["k"]) == [OK]
    held = used(state)
    assert held > 0
    state.leases.release([first])
    state.leases.release([first])  # repeated: still one reader left
    state.tick()
    assert used(state) == held
    state.leases.release([second])
    assert used(state) == 0


def test_an_uncounted_lease_keeps_the_range_after_every_release(state: MasterState, clock: FakeClock) -> None:
    """A reader that does not release (an older client, a tenant) holds the range to its lease's end."""
    mount(state, "a")
    put(state, "k")
    counted = state.get_replicas(NS, ["k"], releasable=True).lease_id
    state.get_replicas(NS, ["k"])  # uncounted: runs its full lease_s
    assert state.remove(NS, ["k"]) == [OK]
    state.leases.release([counted])
    held = used(state)
    assert held > 0
    clock.advance(5.1)
    state.tick()
    assert used(state) == 0


def test_a_lease_never_released_expires_as_before(state: MasterState, clock: FakeClock) -> None:
    mount(state, "a")
    put(state, "k")
    state.get_replicas(NS, ["k"], releasable=True)
    assert state.remove(NS, ["k"]) == [OK]
    clock.advance(4.9)
    state.tick()
    assert used(state) > 0
    clock.advance(0.2)
    state.tick()
    assert used(state) == 0
    assert len(state.leases) == 0
    assert state.leases.expired == 1


def test_a_released_object_is_an_eviction_candidate_again(state: MasterState) -> None:
    mount(state, "a")
    put(state, "k")
    record = next(r for r in state.records() if r.key == "k")
    lease = state.get_replicas(NS, ["k"], releasable=True).lease_id
    assert record.lease_until > state.clock()
    state.leases.release([lease])
    assert record.lease_until <= state.clock()
