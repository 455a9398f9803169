"""With data-plane capabilities, a freed range goes to no other object while a tag minted for it can
still verify (issue 8): a revoked, removed or reclaimed put's write tags must not write the next
owner's bytes."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.records import replica_segment
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
    state.capability_ttl_s, state.capabilities = TTL, True
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


# ------------------------------------------------------------------ grant end + clock skew (issue 15)

MARGIN = 2.0  # what the server sets: CLOCK_SKEW_MS, a segment's clock may lag the master's


def test_a_revoked_range_waits_past_its_grant_for_the_clock_skew_margin(state: MasterState, clock):
    # given the server's settings, with or without a secret: a write grant of TTL and the skew margin
    state.capability_ttl_s, state.reuse_margin_s = TTL, MARGIN
    mount(state, "a")
    alice = state.put_start(NS, ["alice"], [4096], 1)
    assert state.put_revoke(NS, ["alice"], alice.put_id) == [OK]
    # when the grant is over but a segment's clock may still be inside it
    clock.advance(TTL + MARGIN - 0.5)
    state.tick()
    # then the range goes to nobody yet
    bob = state.put_start(NS, ["bob"], [4096], 1)
    assert offset_of(bob) != offset_of(alice), "a segment whose clock lags could still take alice's bytes"
    clock.advance(1.0)
    state.tick()
    carol = state.put_start(NS, ["carol"], [4096], 1)
    assert offset_of(carol) == offset_of(alice)
    assert_consistent(state)


def test_a_failed_migrations_target_waits_for_the_migrators_write_grant(state: MasterState, clock):
    # given an object on a draining segment and a migration of it that started
    state.capability_ttl_s, state.reuse_margin_s = TTL, MARGIN
    mount(state, "a")
    put(state, "x", size=4096)  # on a: the only segment
    b = mount(state, "b")
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert status == OK and [item.target is not None for item in batch.items] == [True]
    target_segment = replica_segment(batch.items[0].target)
    assert target_segment == b
    used = state.segments[target_segment].allocator.used
    assert used > 0
    # when the migrator reports it did not move it (its frames may still be in flight)
    assert state.drainer.migrate_end(batch.migration_id, {(NS, "x"): False})[0] == OK
    state.tick()
    # then the target range is held until the migration's grant (the lease) and the margin end
    assert state.segments[target_segment].allocator.used == used
    clock.advance(state.config.lease_s + MARGIN + 0.5)
    state.tick()
    assert state.segments[target_segment].allocator.used == 0
    assert_consistent(state)


def test_without_a_secret_a_completed_objects_range_waits_only_for_its_leases_and_the_margin(state, clock):
    # given no capabilities: a completed put has no frame in flight (its writer PutEnds once every
    # WRITE was answered), and no tag outlives it
    state.capability_ttl_s, state.reuse_margin_s = TTL, MARGIN
    mount(state, "a")
    first = put(state, "first", size=4096)
    state.get_replicas(NS, ["first"])  # a read lease of lease_s (= TTL here)
    assert state.remove(NS, ["first"]) == [OK]
    clock.advance(TTL + MARGIN - 0.5)
    state.tick()
    second = put(state, "second", size=4096)
    assert offset_of(second) != offset_of(first), "a reader's frames may still be served from it"
    clock.advance(1.0)
    state.tick()
    third = put(state, "third", size=4096)
    assert offset_of(third) == offset_of(first)
    # and an object never read is free at once
    assert state.remove(NS, ["third"]) == [OK]
    fourth = put(state, "fourth", size=4096)
    assert offset_of(fourth) == offset_of(first)
    assert_consistent(state)
