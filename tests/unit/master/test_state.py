"""MasterState scenarios, driven by a fake clock: given / when / then."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.master.config import MasterConfig
from kvtier.master.records import PIN_HARD, PIN_NONE, replica_segment
from kvtier.master.state import MasterState, ObjectState, PutOptions
from kvtier.proto.auth import wall_ms
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent

OK = Status.OK
MiB = 1 << 20
NS = "ns"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def config() -> MasterConfig:
    return MasterConfig(
        cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0, put_timeout_s=30.0
    ).validate()


@pytest.fixture
def state(config: MasterConfig, clock: FakeClock) -> MasterState:
    return MasterState(config, clock=clock)


def mount(state: MasterState, name: str, capacity: int = MiB) -> int:
    result = state.mount_segment("unit", name, f"host-{name}", [f"tcp://127.0.0.1:9/{name}"], capacity)
    assert result.status == OK, result.error
    return result.segment.segment_id


def put(
    state: MasterState,
    key: str,
    size: int = 1000,
    replicas: int = 1,
    namespace: str = NS,
    checksum: int = 7,
    pin: int = PIN_NONE,
):
    """A complete put of one key; returns the PutStartResult."""
    started = state.put_start(namespace, [key], [size], replicas, PutOptions(pin=pin))
    assert started.statuses == [OK], started.first_error
    assert state.put_end(namespace, [key], [checksum], started.put_id) == [OK]
    return started


def visible(state: MasterState, key: str, namespace: str = NS) -> bool:
    """Visible to readers: both exists() and get_replicas() agree."""
    found, _ = state.exists(namespace, [key])
    got = state.get_replicas(namespace, [key]).statuses[0]
    assert found[0] == (got == OK), "exists and get_replicas disagree"
    return found[0]


def advance_alive(state: MasterState, clock: FakeClock, seconds: float) -> None:
    """Let time pass while every mounted segment keeps heartbeating."""
    clock.advance(seconds)
    for segment_id in list(state.segments):
        assert state.heartbeat(segment_id) == OK


def used(state: MasterState) -> int:
    return sum(segment.used for segment in state.segments.values())


# ---------------------------------------------------------------- put lifecycle


def test_pending_put_is_invisible_until_put_end(state):
    # given a mounted segment
    seg = mount(state, "a")
    # when a put is started
    started = state.put_start(NS, ["k"], [1000], 1)
    # then it has a range but readers do not see it
    assert started.statuses == [OK]
    assert started.replica_counts == [1]
    assert started.replica_segments == [seg]
    assert not visible(state, "k")
    assert state.exists(NS, ["k"]) == ([False], 0)
    assert state.get_replicas(NS, ["k"]).statuses == [Status.NOT_FOUND]
    assert state.snapshot().pending_puts == 1
    assert state.snapshot().objects == 0
    # when the put ends with its put_id
    assert state.put_end(NS, ["k"], [0xABC], started.put_id) == [OK]
    # then it is visible with its size, checksum and placement
    got = state.get_replicas(NS, ["k"])
    assert got.statuses == [OK]
    assert got.sizes == [1000]
    assert got.checksums == [0xABC]
    assert got.replica_counts == [1]
    assert got.replica_segments == [seg]
    assert got.replica_offsets == started.replica_offsets
    assert state.snapshot().objects == 1
    assert state.snapshot().pending_puts == 0


def test_put_end_with_wrong_put_id_is_not_pending_and_stays_invisible(state):
    mount(state, "a")
    started = state.put_start(NS, ["k"], [1000], 1)
    assert state.put_end(NS, ["k"], [1], started.put_id + 1) == [Status.NOT_PENDING]
    assert not visible(state, "k")
    assert state.put_end(NS, ["unknown"], [1], started.put_id) == [Status.NOT_PENDING]
    assert state.put_end("other-ns", ["k"], [1], started.put_id) == [Status.NOT_PENDING]
    assert not visible(state, "k")


def test_retried_put_end_is_ok_only_with_the_same_checksum(state):
    mount(state, "a")
    started = state.put_start(NS, ["k"], [10], 1)
    assert state.put_end(NS, ["k"], [5], started.put_id) == [OK]
    assert state.put_end(NS, ["k"], [5], started.put_id) == [OK]
    assert state.put_end(NS, ["k"], [6], started.put_id) == [Status.NOT_PENDING]
    assert state.get_replicas(NS, ["k"]).checksums == [5]


def test_put_revoke_frees_space(state):
    mount(state, "a")
    started = state.put_start(NS, ["k", "j"], [1000, 64], 1)
    assert used(state) == 1024 + 64
    # wrong put_id: nothing happens
    assert state.put_revoke(NS, ["k"], started.put_id + 1) == [Status.NOT_PENDING]
    assert used(state) == 1024 + 64
    assert state.put_revoke(NS, ["k", "j", "never"], started.put_id) == [OK, OK, Status.NOT_PENDING]
    assert used(state) == 0
    assert state.snapshot().pending_puts == 0
    assert state.put_end(NS, ["k"], [0], started.put_id) == [Status.NOT_PENDING]
    assert not visible(state, "k")
    # the key is free for a new writer
    put(state, "k")


def test_put_revoke_of_a_complete_object_is_not_pending(state):
    mount(state, "a")
    started = put(state, "k")
    assert state.put_revoke(NS, ["k"], started.put_id) == [Status.NOT_PENDING]
    assert visible(state, "k")


def test_put_of_a_complete_key_is_idempotent_ok_with_zero_replicas(state):
    mount(state, "a")
    first = put(state, "k", size=1000)
    before = used(state)
    again = state.put_start(NS, ["k"], [1000], 1)
    assert again.statuses == [OK]
    assert again.replica_counts == [0]
    assert again.replica_segments == [] and again.replica_offsets == []
    assert used(state) == before
    assert state.get_replicas(NS, ["k"]).replica_offsets == first.replica_offsets


def test_concurrent_put_of_a_pending_key_is_put_in_progress(state, clock):
    mount(state, "a")
    first = state.put_start(NS, ["k"], [100], 1)
    clock.advance(29.9)
    second = state.put_start(NS, ["k"], [100], 1)
    assert second.statuses == [Status.PUT_IN_PROGRESS]
    assert second.replica_counts == [0]
    assert "PUT_IN_PROGRESS" in second.first_error
    assert state.remove(NS, ["k"]) == [Status.PUT_IN_PROGRESS]
    # the first writer is unaffected
    assert state.put_end(NS, ["k"], [1], first.put_id) == [OK]


def test_same_key_twice_in_one_batch(state):
    mount(state, "a")
    started = state.put_start(NS, ["k", "k"], [100, 100], 1)
    assert started.statuses == [OK, Status.PUT_IN_PROGRESS]
    assert started.replica_counts == [1, 0]


def test_abandoned_put_is_reclaimed_by_tick_after_put_timeout(state, clock):
    # given a put that never ends
    mount(state, "a")
    started = state.put_start(NS, ["k"], [1000], 1)
    assert used(state) == 1024
    # when the timeout has not quite passed, tick keeps it
    advance_alive(state, clock, 29.0)
    state.tick()
    assert used(state) == 1024
    assert state.snapshot().pending_puts == 1
    # when it has passed, tick reclaims its space
    advance_alive(state, clock, 1.0)
    state.tick()
    assert used(state) == 0
    assert state.snapshot().pending_puts == 0
    assert state.object_count == 0
    # then the late PutEnd is refused and the object never appears
    assert state.put_end(NS, ["k"], [1], started.put_id) == [Status.NOT_PENDING]
    assert not visible(state, "k")


def test_tick_reclaims_only_the_puts_that_timed_out(state, clock):
    mount(state, "a")
    state.put_start(NS, ["old"], [64], 1)
    advance_alive(state, clock, 20)
    young = state.put_start(NS, ["young"], [64], 1)
    advance_alive(state, clock, 10)
    state.tick()
    assert state.snapshot().pending_puts == 1
    assert state.put_end(NS, ["young"], [0], young.put_id) == [OK]
    assert used(state) == 64


def test_abandoned_put_is_reclaimed_inline_by_a_new_put_start(state, clock):
    seg = mount(state, "a")
    old = state.put_start(NS, ["k"], [1000], 1)
    clock.advance(30.0)
    new = state.put_start(NS, ["k"], [500], 1)  # no tick in between
    assert new.statuses == [OK]
    assert new.replica_counts == [1]
    assert used(state) == 512  # the old 1024 bytes were freed
    assert state.snapshot().pending_puts == 1
    assert state.put_end(NS, ["k"], [1], old.put_id) == [Status.NOT_PENDING]
    assert state.put_end(NS, ["k"], [2], new.put_id) == [OK]
    assert state.get_replicas(NS, ["k"]).sizes == [500]
    # a later tick has nothing left to reclaim
    advance_alive(state, clock, 100)
    state.tick()
    assert seg in state.segments
    assert visible(state, "k")


# ---------------------------------------------------------------- placement and space


def test_too_large_vs_no_space_vs_no_replica(state):
    # given two segments of 1 MiB
    mount(state, "a", MiB)
    mount(state, "b", MiB)
    # an object larger than any segment could ever hold
    result = state.put_start(NS, ["huge"], [MiB + 1], 1)
    assert result.statuses == [Status.TOO_LARGE]
    assert "TOO_LARGE" in result.first_error
    # more replicas than segments
    assert state.put_start(NS, ["r3"], [10], 3).statuses == [Status.NO_REPLICA]
    # both segments full of objects that cannot be evicted
    put(state, "fill-a", MiB, pin=PIN_HARD)
    put(state, "fill-b", MiB, pin=PIN_HARD)
    assert state.put_start(NS, ["later"], [1], 1).statuses == [Status.NO_SPACE]
    # failures do not leave records behind
    assert state.object_count == 2
    assert state.snapshot().pending_puts == 0


def test_no_space_for_the_second_replica_releases_the_first(state):
    mount(state, "a", MiB)
    mount(state, "b", MiB)
    put(state, "fill-b", MiB // 2 + 64, pin=PIN_HARD)
    put(state, "fill-a", MiB // 2 + 64, pin=PIN_HARD)
    before = {s.segment_id: s.used for s in state.segments.values()}
    assert state.put_start(NS, ["k"], [MiB // 2], 2).statuses == [Status.NO_SPACE]
    assert {s.segment_id: s.used for s in state.segments.values()} == before
    assert all(s.objects == 1 for s in state.segments.values())


def test_no_segments_mounted(state):
    assert state.put_start(NS, ["k"], [1], 1).statuses == [Status.NO_REPLICA]


def test_replicas_are_placed_on_distinct_segments(state):
    segments = {mount(state, name) for name in ("a", "b", "c")}
    for i in range(20):
        result = state.put_start(NS, [f"k{i}"], [4096], 3)
        assert result.statuses == [OK]
        assert sorted(result.replica_segments) == sorted(segments)
    two = state.put_start(NS, ["pair"], [4096], 2)
    assert len(set(two.replica_segments)) == 2


def test_batch_reports_per_key_results(state):
    mount(state, "a", MiB)
    result = state.put_start(NS, ["ok1", "", "big", "ok2"], [10, 10, 2 * MiB, 20], 1)
    assert result.statuses == [OK, Status.INVALID_KEY, Status.TOO_LARGE, OK]
    assert result.replica_counts == [1, 0, 0, 1]
    assert len(result.replica_offsets) == 2
    assert result.first_error.startswith("INVALID_KEY")


def test_zero_size_object_uses_no_space(state):
    seg = mount(state, "a")
    put(state, "empty", size=0)
    assert used(state) == 0
    got = state.get_replicas(NS, ["empty"])
    assert got.statuses == [OK] and got.sizes == [0] and got.replica_segments == [seg]
    assert state.remove(NS, ["empty"]) == [OK]
    assert state.segments[seg].objects == 0


# ---------------------------------------------------------------- segments


def test_segment_ttl_expiry_drops_its_replicas(state, clock):
    # given two segments; one object on both, one only on "a", one only on "b"
    a = mount(state, "a")
    b = mount(state, "b")
    put(state, "both", replicas=2)
    put(state, "big-on-a", size=MiB // 2)  # "a" is freest at first; afterwards "b" is
    put(state, "only-b", size=100)
    assert state.get_replicas(NS, ["big-on-a"]).replica_segments == [a]
    assert state.get_replicas(NS, ["only-b"]).replica_segments == [b]
    # when "a" stops heartbeating past the TTL while "b" keeps going
    for _ in range(11):
        clock.advance(1.0)
        assert state.heartbeat(b) == OK
        state.tick()
    # then "a" is gone with its replicas
    assert a not in state.segments
    assert state.heartbeat(a) == Status.SEGMENT_NOT_FOUND
    assert not visible(state, "big-on-a")
    both = state.get_replicas(NS, ["both"])
    assert both.statuses == [OK] and both.replica_segments == [b]
    assert visible(state, "only-b")
    assert state.snapshot().objects == 2


def test_segment_is_kept_at_exactly_the_ttl(state, clock):
    a = mount(state, "a")
    clock.advance(10.0)
    state.tick()
    assert a in state.segments
    clock.advance(0.01)
    state.tick()
    assert a not in state.segments


def test_a_master_that_did_not_run_counts_nobody_silent_for_that_time(state, clock):
    # given a segment with an object, and a master stopped (SIGSTOP) for twice the TTL: the
    # segment's heartbeats meanwhile sit unread in the master's socket
    a = mount(state, "a")
    put(state, "k")
    clock.advance(20.0)
    # when the ticker notices it slept 20 s too long, before its first tick
    state.forgive_deafness(20.0)
    state.tick()
    # then the segment is not expelled: the master could not have heard it
    assert a in state.segments and visible(state, "k")
    assert state.heartbeat(a) == OK
    # and silence while the master runs still counts
    clock.advance(10.01)
    state.tick()
    assert a not in state.segments


def test_segment_loss_drops_pending_puts_on_it_entirely(state, clock):
    a = mount(state, "a")
    b = mount(state, "b")
    started = state.put_start(NS, ["k"], [100], 2)
    assert sorted(started.replica_segments) == sorted([a, b])
    assert state.unmount_segment(a) == OK
    # the surviving replica's range is freed and the put cannot complete
    assert state.segments[b].used == 0
    assert state.segments[b].objects == 0
    assert state.put_end(NS, ["k"], [0], started.put_id) == [Status.NOT_PENDING]
    assert state.snapshot().pending_puts == 0
    assert state.unmount_segment(a) == Status.SEGMENT_NOT_FOUND


def test_remount_under_the_same_name_drops_old_replicas(state):
    old = mount(state, "a")
    put(state, "k")
    new = mount(state, "a")
    assert new != old
    assert list(state.segments) == [new]
    assert state.segments[new].used == 0
    assert not visible(state, "k")
    assert state.heartbeat(old) == Status.SEGMENT_NOT_FOUND
    assert state.snapshot().objects == 0
    put(state, "k")
    assert state.get_replicas(NS, ["k"]).replica_segments == [new]


def test_a_second_region_under_a_mounted_name_is_refused_until_the_first_is_proven_gone(state):
    """Two processes under one name (another host, or another --shm-dir) replaced each other at every
    heartbeat, for good; and a holder merely stopped for a few heartbeats lost every object to the
    other. The name goes to another region only once the holder was silent for segment_ttl_s (what
    expels it), or at once to a new process holding the same region lock (same host and shm
    directory: a restart); the same region mounting again keeps it."""

    def mount_as(incarnation: str, host: str = "host-1", shm_dir: str = "/dev/shm"):
        endpoints = ["tcp://127.0.0.1:9/a", f"shm://{shm_dir}/kvtier.unit.a.sock?host={host}&nonce={incarnation}"]
        return state.mount_segment("unit", "a", host, endpoints, MiB, incarnation=incarnation)

    first = mount_as("r1")
    assert first.status == OK
    put(state, "k")
    intruder = mount_as("r2", shm_dir="/other")
    assert intruder.status == Status.SEGMENT_NAME_IN_USE and "--name" in intruder.error
    assert 0 < intruder.name_frees_in_s <= state.config.segment_ttl_s
    assert mount_as("r2", host="host-2").status == Status.SEGMENT_NAME_IN_USE
    state.clock.advance(5 * state.config.heartbeat_interval_s)  # the holder stopped a while
    assert mount_as("r2", shm_dir="/other").status == Status.SEGMENT_NAME_IN_USE
    assert visible(state, "k"), "the live segment keeps its objects"
    again = mount_as("r1")  # the first process mounting again (after the master dropped it)
    assert again.status == OK
    assert mount_as("r3").status == OK  # same host and directory: it holds the region lock, r1 is gone
    state.clock.advance(state.config.segment_ttl_s)  # silent that long: r3 would be expelled anyway
    assert mount_as("r4", shm_dir="/other").status == OK


def test_mount_with_another_cluster_id_is_cluster_mismatch(state):
    result = state.mount_segment("other", "a", "h", ["tcp://x:1"], MiB)
    assert result.status == Status.CLUSTER_MISMATCH
    assert result.segment is None
    assert "other" in result.error
    assert state.segments == {}


@pytest.mark.parametrize(
    ("name", "endpoints", "capacity"),
    [("", ["tcp://x:1"], MiB), ("a", [], MiB), ("a", ["tcp://x:1"], 63), ("a", ["tcp://x:1"], 0)],
)
def test_mount_rejects_incomplete_segments(state, name, endpoints, capacity):
    assert state.mount_segment("unit", name, "h", endpoints, capacity).status == Status.INVALID_ARGUMENT
    assert state.segments == {}


# ---------------------------------------------------------------- removal and leases


def test_remove_of_a_leased_object_defers_freeing_until_the_lease_ends(state, clock):
    # given a complete object that a reader holds a lease on (lease_s = 5)
    mount(state, "a")
    put(state, "k", size=1000)
    got = state.get_replicas(NS, ["k"])
    assert got.lease_ms == 5000
    # when it is removed one second later
    clock.advance(1.0)
    assert state.remove(NS, ["k"]) == [OK]
    # then it is gone for readers, but its bytes stay allocated
    assert not visible(state, "k")
    assert used(state) == 1024
    assert state.snapshot().objects == 0
    clock.advance(3.9)
    state.tick()
    assert used(state) == 1024
    # and once the clock passes the lease, tick frees them
    clock.advance(0.2)
    state.tick()
    assert used(state) == 0


def test_leased_range_is_not_reused_before_the_lease_ends(state, clock):
    # given a full segment whose only object is read, then removed
    mount(state, "a", MiB)
    first = put(state, "k", size=MiB)
    state.get_replicas(NS, ["k"])
    assert state.remove(NS, ["k"]) == [OK]
    # then no new object can take its range while the lease runs
    assert state.put_start(NS, ["new"], [MiB], 1).statuses == [Status.NO_SPACE]
    # and can once it ended
    advance_alive(state, clock, 5.0)
    state.tick()
    again = state.put_start(NS, ["new"], [MiB], 1)
    assert again.statuses == [OK]
    assert again.replica_offsets == first.replica_offsets


def test_remove_without_lease_frees_at_once(state):
    mount(state, "a")
    put(state, "k", size=1000)
    assert state.exists(NS, ["k"]) == ([True], 1)  # exists grants no lease
    assert state.remove(NS, ["k"]) == [OK]
    assert used(state) == 0


def test_exists_grants_no_lease_but_get_replicas_does(state, clock):
    mount(state, "a")
    put(state, "k", size=64)
    put(state, "j", size=64)
    state.exists(NS, ["k", "j"])
    state.get_replicas(NS, ["j"])
    state.remove(NS, ["k", "j"])
    assert used(state) == 64  # only "j" is held back
    clock.advance(5.0)
    state.tick()
    assert used(state) == 0


def test_a_later_get_extends_the_lease(state, clock):
    mount(state, "a")
    put(state, "k", size=64)
    state.get_replicas(NS, ["k"])
    clock.advance(4.0)
    state.get_replicas(NS, ["k"])  # lease now ends at +9
    state.remove(NS, ["k"])
    clock.advance(4.5)
    state.tick()
    assert used(state) == 64
    clock.advance(0.5)
    state.tick()
    assert used(state) == 0


def test_deferred_ranges_of_a_lost_segment_are_forgotten(state, clock):
    a = mount(state, "a")
    put(state, "k", size=64)
    state.get_replicas(NS, ["k"])
    state.remove(NS, ["k"])
    assert state.unmount_segment(a) == OK
    b = mount(state, "b")
    clock.advance(10)
    state.heartbeat(b)
    state.tick()  # must not release the old range into anything
    assert state.segments[b].used == 0


def test_remove_results(state):
    mount(state, "a")
    put(state, "k")
    state.put_start(NS, ["pending"], [10], 1)
    assert state.remove(NS, ["k", "k", "missing", "pending"]) == [
        OK,
        Status.NOT_FOUND,
        Status.NOT_FOUND,
        Status.PUT_IN_PROGRESS,
    ]
    assert state.remove("nowhere", ["k"]) == [Status.NOT_FOUND]


def test_exists_reports_the_complete_prefix(state):
    mount(state, "a")
    for key in ("p0", "p1", "p3"):
        put(state, key, size=10)
    state.put_start(NS, ["p2"], [10], 1)
    assert state.exists(NS, ["p0", "p1", "p2", "p3"]) == ([True, True, False, True], 2)
    assert state.exists(NS, []) == ([], 0)
    assert state.exists("other", ["p0"]) == ([False], 0)


def test_remove_prefix_only_within_the_namespace(state):
    mount(state, "a")
    for key in ("chat/1", "chat/2", "doc/1"):
        put(state, key, size=10, namespace="ns1")
    put(state, "chat/1", size=10, namespace="ns2")
    state.put_start("ns1", ["chat/pending"], [10], 1)
    assert state.remove_prefix("ns1", "chat/") == 2
    assert not visible(state, "chat/1", "ns1")
    assert not visible(state, "chat/2", "ns1")
    assert visible(state, "doc/1", "ns1")
    assert visible(state, "chat/1", "ns2")
    assert state.snapshot().pending_puts == 1  # pending puts are not removed
    assert state.remove_prefix("missing-ns", "") == 0
    assert state.remove_prefix("ns2", "") == 1
    assert not visible(state, "chat/1", "ns2")


def test_namespaces_isolate_identical_keys(state):
    mount(state, "a")
    one = put(state, "k", size=100, namespace="one", checksum=1)
    two = put(state, "k", size=200, namespace="two", checksum=2)
    assert two.replica_counts == [1]  # not an idempotent no-op: another namespace
    assert one.replica_offsets != two.replica_offsets
    got_one = state.get_replicas("one", ["k"])
    got_two = state.get_replicas("two", ["k"])
    assert (got_one.sizes, got_one.checksums) == ([100], [1])
    assert (got_two.sizes, got_two.checksums) == ([200], [2])
    assert state.remove("one", ["k"]) == [OK]
    assert visible(state, "k", "two")
    assert not visible(state, "k", "three")


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize("key", ["", "a\x00b", "x" * 1025, "é" * 513])
def test_invalid_keys_are_invalid_key(state, key):
    mount(state, "a")
    result = state.put_start(NS, [key], [10], 1)
    assert result.statuses == [Status.INVALID_KEY]
    assert result.replica_counts == [0]
    assert state.get_replicas(NS, [key]).statuses == [Status.INVALID_KEY]
    assert state.exists(NS, [key]) == ([False], 0)
    assert used(state) == 0


@pytest.mark.parametrize("key", ["x" * 1024, "é" * 512, "🙂" * 256, "a/b c"])
def test_boundary_keys_are_valid(state, key):
    mount(state, "a")
    put(state, key, size=10)
    assert visible(state, key)


# ---------------------------------------------------------------- snapshot


def test_snapshot_counts(state):
    a = mount(state, "a")
    b = mount(state, "b")
    put(state, "c1")
    put(state, "c2", replicas=2)
    state.put_start(NS, ["p1", "p2"], [10, 10], 1)
    snap = state.snapshot()
    assert snap.objects == 2
    assert snap.pending_puts == 2
    assert sorted(s.segment_id for s in snap.segments) == [a, b]
    assert sum(s.objects for s in snap.segments) == 5  # c1 + 2 x c2 + p1 + p2
    assert sum(s.used for s in snap.segments) == 1024 + 2 * 1024 + 64 + 64
    assert all(s.capacity == MiB for s in snap.segments)


# ---------------------------------------------------------------- property: accounting never drifts


class MasterStateMachine(RuleBasedStateMachine):
    """Random operation sequences; after each step the books must balance."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        config = MasterConfig(
            cluster_id="unit", segment_ttl_s=4.0, heartbeat_interval_s=1.0, lease_s=2.0, put_timeout_s=3.0
        )
        self.state = MasterState(config, clock=self.clock)
        self.put_ids: list[int] = [0]
        self.leases: list[int] = []  # releasable read leases not handed back yet

    @rule(name=st.sampled_from(["a", "b", "c"]), capacity=st.sampled_from([64, 1000, 4096]), slots=st.booleans())
    def mount(self, name, capacity, slots):
        result = self.state.mount_segment("unit", name, "h", ["tcp://x:1"], capacity)
        assert result.status == OK
        result.segment.writer_slots = slots  # it reports same-host writers (kvtier.master.range_book)

    @rule(
        pick=st.integers(0, 5),
        offset=st.integers(0, 5000),
        length=st.integers(1, 2000),
        stalled=st.booleans(),
        later=st.booleans(),
    )
    def writers_report(self, pick, offset, length, stalled, later):
        if self.state.segments:
            segment_id = sorted(self.state.segments)[pick % len(self.state.segments)]
            sampled = wall_ms() + (60_000 if later else -60_000)
            writers = [(offset, length)]
            self.state.writers_reported(segment_id, sampled, writers, writers if stalled else [])

    @rule(pick=st.integers(0, 5))
    def writers_gone(self, pick):
        if self.state.segments:
            segment_id = sorted(self.state.segments)[pick % len(self.state.segments)]
            self.state.writers_reported(segment_id, wall_ms() + 60_000, [])

    @rule(pick=st.integers(0, 5))
    def unmount(self, pick):
        if self.state.segments:
            self.state.unmount_segment(sorted(self.state.segments)[pick % len(self.state.segments)])

    @rule()
    def heartbeat_all(self):
        for segment_id in list(self.state.segments):
            self.state.heartbeat(segment_id)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5, 5.0]))
    def advance_and_tick(self, seconds):
        self.clock.advance(seconds)
        self.state.tick()

    @rule(
        keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), min_size=1, max_size=3),
        size=st.sampled_from([0, 1, 64, 100, 1000, 5000]),
        replicas=st.integers(1, 3),
    )
    def put_start(self, keys, size, replicas):
        result = self.state.put_start(NS, keys, [size] * len(keys), replicas)
        self.put_ids.append(result.put_id)
        assert len(result.replica_segments) == sum(result.replica_counts)
        at = 0
        for count in result.replica_counts:
            placed = result.replica_segments[at : at + count]
            assert len(set(placed)) == count, "two replicas on one segment"
            at += count

    @rule(key=st.sampled_from(["k0", "k1", "k2", "p/k3"]), back=st.integers(0, 3))
    def put_end(self, key, back):
        self.state.put_end(NS, [key], [1], self.put_ids[-1 - back % len(self.put_ids)])

    @rule(key=st.sampled_from(["k0", "k1", "k2", "p/k3"]), back=st.integers(0, 3))
    def put_revoke(self, key, back):
        self.state.put_revoke(NS, [key], self.put_ids[-1 - back % len(self.put_ids)])

    @rule(keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), max_size=3))
    def get_replicas(self, keys):
        result = self.state.get_replicas(NS, keys)
        assert len(result.replica_segments) == sum(result.replica_counts)
        assert set(result.replica_segments) <= set(self.state.segments)

    @rule(keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), max_size=3))
    def get_releasable(self, keys):
        lease = self.state.get_replicas(NS, keys, releasable=True).lease_id
        if lease:
            self.leases.append(lease)

    @rule(pick=st.integers(0, 3))
    def release(self, pick):
        if self.leases:
            self.state.leases.release([self.leases.pop(pick % len(self.leases))])

    @rule(keys=st.lists(st.sampled_from(["k0", "k1", "k2", "p/k3"]), max_size=3))
    def remove(self, keys):
        self.state.remove(NS, keys)

    @rule(prefix=st.sampled_from(["", "k", "p/"]))
    def remove_prefix(self, prefix):
        self.state.remove_prefix(NS, prefix)

    @invariant()
    def books_balance(self):
        state = self.state
        used = {segment_id: 0 for segment_id in state.segments}
        replicas = dict.fromkeys(state.segments, 0)
        records = pending = 0
        for record in state.records():
            records += 1
            pending += record.state is ObjectState.PENDING
            assert record.replicas, "an object without replicas"
            assert len({replica_segment(r) for r in record.replicas}) == len(record.replicas)
            for replica in record.replicas:
                segment_id = replica_segment(replica)
                segment = state.segments[segment_id]
                replicas[segment_id] += 1
                if record.size:
                    used[segment_id] += segment.allocator.aligned(record.size)
        for _, _, segment_id, _, size in state._deferred:
            used[segment_id] += state.segments[segment_id].allocator.aligned(size)
        for segment_id, _, size in state.leases.parked():
            if segment_id in used:
                used[segment_id] += state.segments[segment_id].allocator.aligned(size)
        for segment_id, segment in state.segments.items():  # held while a writer may be in them
            used[segment_id] += sum(segment.allocator.aligned(size) for _, _, _, size in segment.held)
        assert {s: seg.used for s, seg in state.segments.items()} == used
        assert_consistent(state)
        assert {s: seg.objects for s, seg in state.segments.items()} == replicas
        assert state.object_count == records
        assert state.snapshot().pending_puts == pending == len(state._pending)
        assert_consistent(state)  # includes the segments' indexes built from the commit log


TestMasterStateMachine = MasterStateMachine.TestCase
TestMasterStateMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_a_dropped_segment_fences_changes_until_its_direct_read_lease_ran_out(state, clock):
    """A segment may serve direct reads two heartbeat intervals after the last heartbeat it sent
    (we received it after): a drop the segment did not ask for moves the fence there; its own
    unmount (it stopped serving first) and an expulsion long after its last heartbeat do not."""
    lease = state.config.direct_read_lease_s
    assert lease == 2 * state.config.heartbeat_interval_s
    a, b, c, d = mount(state, "a"), mount(state, "b"), mount(state, "c"), mount(state, "d")
    for segment_id in (a, b, c):
        state.segments[segment_id].direct_reads = True  # the handler sets it from the mount request
    advance_alive(state, clock, 0.5)
    state.unmount_segment(a)
    state.drop_segment(d, reason="drained")  # serves no direct reads: nothing to wait for
    assert state.direct_read_fence == 0.0
    state.drop_segment(b, reason="drained")
    assert state.direct_read_fence == clock.now + lease
    clock.advance(state.config.segment_ttl_s + 1)
    state.tick()  # c expelled for silence: its lease ended long ago, the fence stays where it was
    assert c not in state.segments
    assert state.direct_read_fence == clock.now - state.config.segment_ttl_s - 1 + lease
