"""Upsert (atomic overwrite) and put-time leases in MasterState (kvtier.master.upsert), on a fake clock."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvtier.master.config import MasterConfig
from kvtier.master.records import replica_offset
from kvtier.master.state import MasterState, ObjectState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_state import NS, FakeClock, MasterStateMachine, mount, put

OK = Status.OK
MiB = 1 << 20
UPSERT = PutOptions(overwrite=True)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(
        cluster_id="unit", segment_ttl_s=1000.0, heartbeat_interval_s=1.0, lease_s=5.0, put_timeout_s=30.0
    ).validate()
    state = MasterState(config, clock=clock)
    mount(state, "s0", 64 * 4096)
    return state


def visible(state: MasterState, key: str) -> tuple[int, int, list[int]]:
    """(status, checksum, offsets) a reader gets for `key` now."""
    got = state.get_replicas(NS, [key])
    return got.statuses[0], got.checksums[0], list(got.replica_offsets)


def test_upsert_keeps_old_version_visible_until_put_end_then_swaps(state: MasterState) -> None:
    put(state, "k", checksum=1)
    old = visible(state, "k")
    started = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert started.statuses == [OK] and started.replica_counts == [1]  # a new range, beside the old one
    assert started.replica_offsets[0] not in old[2]
    assert visible(state, "k") == old  # the new version is invisible while written
    assert state.exists(NS, ["k"])[0] == [True]
    assert_consistent(state)
    assert state.put_end(NS, ["k"], [2], started.put_id) == [OK]
    assert visible(state, "k") == (OK, 2, started.replica_offsets)
    assert state.put_end(NS, ["k"], [2], started.put_id) == [OK]  # a retried PutEnd is harmless
    assert_consistent(state)


def test_old_ranges_wait_for_the_read_lease(state: MasterState, clock: FakeClock) -> None:
    put(state, "k", size=4096, checksum=1)
    segment = next(iter(state.segments.values()))
    state.get_replicas(NS, ["k"])  # a reader holds a lease on the old version
    started = state.put_start(NS, ["k"], [4096], 1, UPSERT)
    state.put_end(NS, ["k"], [2], started.put_id)
    assert segment.used == 2 * 4096  # the old range is still the reader's
    assert_consistent(state)
    clock.advance(state.config.lease_s + 0.1)
    state.tick()
    assert segment.used == 4096
    assert_consistent(state)


def test_revoked_or_abandoned_upsert_keeps_the_old_version(state: MasterState, clock: FakeClock) -> None:
    put(state, "k", checksum=1)
    before = visible(state, "k")
    started = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert state.put_revoke(NS, ["k"], started.put_id) == [OK]
    assert visible(state, "k") == before
    assert state.put_end(NS, ["k"], [2], started.put_id) == [Status.NOT_PENDING]
    started = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    clock.advance(state.config.put_timeout_s + 1)
    state.tick()  # reclaimed
    assert state.put_end(NS, ["k"], [3], started.put_id) == [Status.NOT_PENDING]
    assert visible(state, "k")[:2] == before[:2]
    assert_consistent(state)


def test_second_upsert_answers_put_in_progress(state: MasterState, clock: FakeClock) -> None:
    put(state, "k", checksum=1)
    first = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert state.put_start(NS, ["k"], [1000], 1, UPSERT).statuses == [Status.PUT_IN_PROGRESS]
    assert state.put_start(NS, ["k"], [1000], 1).statuses == [OK]  # a plain put: already stored
    clock.advance(state.config.put_timeout_s + 1)
    second = state.put_start(NS, ["k"], [1000], 1, UPSERT)  # the abandoned one is reclaimed
    assert second.statuses == [OK]
    assert state.put_end(NS, ["k"], [5], first.put_id) == [Status.NOT_PENDING]
    assert state.put_end(NS, ["k"], [6], second.put_id) == [OK]
    assert visible(state, "k")[1] == 6
    assert_consistent(state)


def test_upsert_of_missing_or_removed_key_is_a_put(state: MasterState) -> None:
    started = state.put_start(NS, ["new"], [1000], 1, UPSERT)
    assert state.put_end(NS, ["new"], [4], started.put_id) == [OK]
    assert visible(state, "new")[:2] == (OK, 4)
    put(state, "k", checksum=1)
    started = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert state.remove(NS, ["k"]) == [OK]
    assert visible(state, "k")[0] == Status.NOT_FOUND
    assert state.put_end(NS, ["k"], [2], started.put_id) == [OK]  # the later write wins
    assert visible(state, "k")[:2] == (OK, 2)
    assert_consistent(state)


def test_upsert_loses_to_a_pending_put_of_the_key(state: MasterState) -> None:
    put(state, "k", checksum=1)
    upsert = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    state.remove(NS, ["k"])
    other = state.put_start(NS, ["k"], [1000], 1)
    assert state.put_end(NS, ["k"], [2], upsert.put_id) == [Status.NOT_PENDING]
    assert state.put_end(NS, ["k"], [3], other.put_id) == [OK]
    assert visible(state, "k")[:2] == (OK, 3)
    assert_consistent(state)


def test_segment_loss_drops_the_new_version_only(state: MasterState) -> None:
    put(state, "k", checksum=1)  # on s0, the only segment yet
    first = visible(state, "k")
    s1 = mount(state, "s1", 64 * 4096)
    started = state.put_start(NS, ["k"], [1000], 2, UPSERT)
    assert started.statuses == [OK] and s1 in started.replica_segments
    state.drop_segment(s1, "test")
    assert state.put_end(NS, ["k"], [2], started.put_id) == [Status.NOT_PENDING]
    assert visible(state, "k")[:2] == first[:2]
    assert_consistent(state)


def test_zero_size_upsert_keeps_the_segment_index_right(state: MasterState) -> None:
    put(state, "z", size=0, checksum=1)
    started = state.put_start(NS, ["z"], [0], 1, UPSERT)
    assert state.put_end(NS, ["z"], [2], started.put_id) == [OK]
    assert_consistent(state)  # the drop of the old (by name) goes before the commit of the new


def test_put_time_lease_refuses_remove_and_eviction_until_it_ends(state: MasterState, clock: FakeClock) -> None:
    started = state.put_start(NS, ["k"], [4096], 1, PutOptions(lease_s=10.0))
    state.put_end(NS, ["k"], [1], started.put_id)
    assert state.remove(NS, ["k"]) == [Status.LEASE_HELD]
    assert visible(state, "k")[0] == OK
    segment = next(iter(state.segments.values()))
    assert state.tiering.state is state
    # Every eviction path asks the cluster's policy for victims: none while the lease runs.
    assert state.policy.victims(state.clock(), 1 << 30, state.replica_bytes, lambda r: True) == []
    assert visible(state, "k")[0] == OK
    clock.advance(10.1)
    state.tick()
    assert state.remove(NS, ["k"]) == [OK]
    assert segment.used == 0
    assert_consistent(state)


def test_force_removes_and_frees_after_read_leases_not_the_put_lease(state: MasterState, clock: FakeClock) -> None:
    started = state.put_start(NS, ["k"], [4096], 1, PutOptions(lease_s=100.0))
    state.put_end(NS, ["k"], [1], started.put_id)
    segment = next(iter(state.segments.values()))
    assert state.remove(NS, ["k"], force=True) == [OK]
    clock.advance(state.config.lease_s + 0.1)
    state.tick()
    assert segment.used == 0
    assert_consistent(state)


def test_upsert_keeps_the_keys_put_time_lease(state: MasterState, clock: FakeClock) -> None:
    started = state.put_start(NS, ["k"], [1000], 1, PutOptions(lease_s=10.0))
    state.put_end(NS, ["k"], [1], started.put_id)
    upsert = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert state.put_end(NS, ["k"], [2], upsert.put_id) == [OK]
    assert state.remove(NS, ["k"]) == [Status.LEASE_HELD]
    clock.advance(10.1)
    state.tick()
    assert state.remove(NS, ["k"]) == [OK]
    assert_consistent(state)


def test_remove_prefix_ignores_put_time_leases(state: MasterState) -> None:
    started = state.put_start(NS, ["p1"], [1000], 1, PutOptions(lease_s=10.0))
    state.put_end(NS, ["p1"], [1], started.put_id)
    assert state.remove_prefix(NS, "p") == 1
    assert_consistent(state)


def test_offsets_differ_between_versions(state: MasterState) -> None:
    first = put(state, "k", checksum=1)
    second = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert replica_offset(first.replica_offsets[0]) != replica_offset(second.replica_offsets[0])


def test_history_log_records_the_swap_as_a_version_event(tmp_path, clock: FakeClock) -> None:
    log = tmp_path / "history.jsonl"
    config = MasterConfig(cluster_id="unit", segment_ttl_s=1000.0, history_log=str(log)).validate()
    state = MasterState(config, clock=clock)
    mount(state, "s0", 64 * 4096)
    put(state, "k", checksum=1)
    started = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    state.put_end(NS, ["k"], [2], started.put_id)
    revoked = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    state.put_revoke(NS, ["k"], revoked.put_id)
    state.history.close()
    got = [json.loads(line) for line in log.read_text().splitlines()][1:]
    assert [(e["event"], e["reason"], e["checksum"], e["complete"]) for e in got] == [
        ("version", "upserted", 1, True),
        ("object", "upsert:revoked", 0, False),
    ]


def test_lease_bookkeeping_stays_bounded_when_leased_keys_go_early(state: MasterState) -> None:
    for i in range(3000):
        started = state.put_start(NS, [f"k{i}"], [0], 1, PutOptions(lease_s=1000.0))
        state.put_end(NS, [f"k{i}"], [1], started.put_id)
        assert state.remove(NS, [f"k{i}"], force=True) == [OK]
    assert not state.upserts.leases and not state.upserts.lease_requests
    assert len(state.upserts._ends) <= 1024 + 1  # noqa: SLF001


def test_leased_object_removed_early_frees_when_its_last_reader_releases(state: MasterState, clock: FakeClock) -> None:
    started = state.put_start(NS, ["k"], [4096], 1, PutOptions(lease_s=1000.0))
    state.put_end(NS, ["k"], [1], started.put_id)
    segment = next(iter(state.segments.values()))
    lease_id = state.get_replicas(NS, ["k"], releasable=True).lease_id
    assert state.remove(NS, ["k"], force=True) == [OK]
    assert segment.used == 4096  # the reader still reads it
    state.leases.release([lease_id])
    clock.advance(state.config.lease_s + 0.1)  # what another (unreleasable) read lease could still need
    state.tick()
    assert segment.used == 0  # not held for the rest of the put-time lease
    assert_consistent(state)


def test_ranges_parked_for_readers_of_a_dropped_segment_are_not_deferred(state: MasterState, clock: FakeClock) -> None:
    """Found by the state machine below: a removed object's range parked for a releasable lease,
    its segment unmounted, then the lease expires: nothing may be deferred on the gone segment."""
    put(state, "k", size=64)
    state.get_replicas(NS, ["k"], releasable=True)
    clock.advance(state.config.lease_s / 2)
    state.get_replicas(NS, ["k"])  # a later lease nobody releases: the range outlives the first one
    assert state.remove_prefix(NS, "") == 1
    state.unmount_segment(next(iter(state.segments)))
    clock.advance(state.config.lease_s / 2 + 0.1)  # the releasable lease expires
    state.tick()
    assert_consistent(state)


class UpsertStateMachine(MasterStateMachine):
    """The state machine of test_state.py with upserts, put-time leases and forced removes mixed in:
    after each step the books (allocators, quotas, indexes from the commit log, the name index)
    must still balance, pending new versions included."""

    @initialize()
    def two_segments(self):
        for name in ("a", "b"):
            self.mount(name=name, capacity=16384)

    @rule(name=st.sampled_from(["a", "b", "c"]), capacity=st.sampled_from([4096, 16384]))
    def mount(self, name, capacity):  # room for two versions side by side
        assert self.state.mount_segment("unit", name, "h", ["tcp://x:1"], capacity).status == OK

    @rule(key=st.sampled_from(["k0", "k1", "k2", "p/k3"]), size=st.sampled_from([0, 64, 1000]), lease=st.booleans())
    def upsert_a_complete_key(self, key, size, lease):
        if self.state.record(NS, key) is None:
            self.complete_put(key=key, size=size)
        options = PutOptions(overwrite=True, lease_s=10.0 if lease else 0.0)
        self.put_ids.append(self.state.put_start(NS, [key], [size], 1, options).put_id)

    @rule(
        keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), min_size=1, max_size=3),
        size=st.sampled_from([0, 1, 64, 1000]),
        replicas=st.integers(1, 2),
        lease=st.sampled_from([0.0, 1.0, 10.0]),
    )
    def upsert_start(self, keys, size, replicas, lease):
        options = PutOptions(overwrite=True, lease_s=lease)
        self.put_ids.append(self.state.put_start(NS, keys, [size] * len(keys), replicas, options).put_id)

    @rule(key=st.sampled_from(["k0", "k1", "k2", "p/k3"]), size=st.sampled_from([0, 64, 1000]))
    def complete_put(self, key, size):
        started = self.state.put_start(NS, [key], [size], 1)
        self.state.put_end(NS, [key], [9], started.put_id)

    @rule(
        key=st.sampled_from(["k0", "k1", "k2", "p/k3"]),
        back=st.integers(0, 3),
        checksum=st.integers(1, 3),
        own=st.booleans(),
    )
    def upsert_end(self, key, back, checksum, own):
        before = self.state.record(NS, key)
        pending = self.state.upserts.pending.get(f"{NS}\0{key}")
        put_id = pending.put_id if own and pending is not None else self.put_ids[-1 - back % len(self.put_ids)]
        status = self.state.put_end(NS, [key], [checksum], put_id)[0]
        after = self.state.record(NS, key)
        if pending is not None and pending.put_id == put_id and status == OK:
            assert after is pending and after.checksum == checksum  # swapped in, at once
        elif before is not None and before.state is ObjectState.COMPLETE and status != OK:
            assert after is before  # a failed PutEnd leaves the visible version alone

    @rule(keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), max_size=3), force=st.booleans())
    def remove_maybe_forced(self, keys, force):
        statuses = self.state.remove(NS, keys, force=force)
        if force:
            assert Status.LEASE_HELD not in statuses

    @invariant()
    def books_balance(self):
        assert_consistent(self.state)
        for name, record in self.state.upserts.pending.items():
            assert record.state is ObjectState.PENDING and record.name == name


TestUpsertStateMachine = UpsertStateMachine.TestCase
TestUpsertStateMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
