"""With data-plane capabilities, a freed range goes to no other object while a tag minted for it can
still verify (issue 8): a revoked, removed or reclaimed put's write tags must not write the next
owner's bytes."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.state import MasterState
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_state import NS, OK, FakeClock, mount, put

TTL = 5.0  # lease_s below: Minter.ttl_s = min(put_timeout_s, lease_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, lease_s=TTL, put_timeout_s=30.0).validate()
    return MasterState(config, clock=clock)


def offset_of(started) -> int:
    return started.replica_offsets[0]


def test_a_revoked_puts_range_waits_for_its_tags_to_expire(state: MasterState, clock):
    state.capability_ttl_s = TTL
    mount(state, "a")
    alice = state.put_start(NS, ["alice"], [4096], 1)
    assert state.put_revoke(NS, ["alice"], alice.put_id) == [OK]
    clock.advance(TTL - 0.5)
    state.tick()
    bob = state.put_start(NS, ["bob"], [4096], 1)
    assert bob.statuses == [OK]
    assert offset_of(bob) != offset_of(alice), "alice's write tags still verify on this range"
    clock.advance(1.0)  # past alice's tags
    state.tick()
    carol = state.put_start(NS, ["carol"], [4096], 1)
    assert offset_of(carol) == offset_of(alice), "the range is free once no tag can verify on it"
    assert_consistent(state)


def test_a_removed_objects_range_waits_for_its_write_tags_even_after_its_lease(state: MasterState, clock):
    state.capability_ttl_s = TTL
    mount(state, "a")
    first = put(state, "first", size=4096)
    state.get_replicas(NS, ["first"])  # a read lease, which ends before the write tags do here
    clock.advance(1.0)
    assert state.remove(NS, ["first"]) == [OK]
    state.tick()
    second = put(state, "second", size=4096)
    assert offset_of(second) != offset_of(first)
    clock.advance(TTL)
    state.tick()
    third = put(state, "third", size=4096)
    assert offset_of(third) == offset_of(first)
    assert_consistent(state)


def test_without_capabilities_a_revoked_range_is_reused_at_once(state: MasterState, clock):
    mount(state, "a")
    alice = state.put_start(NS, ["alice"], [4096], 1)
    assert state.put_revoke(NS, ["alice"], alice.put_id) == [OK]
    bob = state.put_start(NS, ["bob"], [4096], 1)
    assert offset_of(bob) == offset_of(alice)
