"""Prefix removals and dead segments cleaned up in slices (kvtier.master.sweeps, issue 19): what
they take is gone for every reader at once, the walk happens `budget` names at a time, and the books
balance when it ends."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.inspection import list_keys, stat_keys
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_state import FakeClock, mount, put, visible

OK = Status.OK
NS = "ns"


@pytest.fixture
def state() -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0).validate()
    state = MasterState(config, clock=FakeClock())
    state.sweep_inline = False  # as the server runs it
    return state


def sweep_all(state: MasterState, budget: int) -> int:
    """Run every sweep to its end, `budget` names a slice; the slices taken."""
    slices = 1
    while state.sweep(budget):
        slices += 1
    return slices


def put_many(state: MasterState, keys: list[str], replicas: int = 1, **options) -> None:
    started = state.put_start(NS, keys, [100] * len(keys), replicas, PutOptions(**options))
    assert set(started.statuses) == {OK}, started.first_error
    assert set(state.put_end(NS, keys, [1] * len(keys), started.put_id)) == {OK}


def test_a_prefix_removal_hides_everything_at_once_and_removes_it_in_slices(state):
    mount(state, "a", 1 << 24)
    doomed = [f"p/{i:04d}" for i in range(1000)]
    kept = [f"q/{i:04d}" for i in range(1000)]
    put_many(state, doomed)
    put_many(state, kept)
    removal = state.start_remove_prefix(NS, "p/")
    assert not removal.done
    # nothing of it is visible to any reader, before a single slice ran
    assert state.exists(NS, doomed[:10]) == ([False] * 10, 0)
    assert set(state.get_replicas(NS, doomed[500:510]).statuses) == {Status.NOT_FOUND}
    page = list_keys(state, NS, "p/", limit=5)  # settles the 6 names it looked at, no more
    assert page.entries == [] and page.next_start_after
    assert stat_keys(state, NS, [doomed[700]])[0] == [Status.NOT_FOUND]
    assert state.remove(NS, [doomed[800]]) == [Status.NOT_FOUND]
    assert state.exists(NS, kept) == ([True] * 1000, 1000)
    # the walk visits at most `budget` names a slice: 1000 names (a few already settled by readers)
    assert sweep_all(state, 100) == 10
    assert removal.done and removal.removed == 1000
    assert state.snapshot().objects == 1000
    assert [e.key for e in list_keys(state, NS, "", limit=5).entries] == kept[:5]
    assert_consistent(state)


def test_objects_put_or_completed_after_the_removal_began_survive_it(state):
    mount(state, "a", 1 << 24)
    put_many(state, [f"p/{i}" for i in range(50)])
    pending = state.put_start(NS, ["p/pending"], [100], 1)
    removal = state.start_remove_prefix(NS, "p/")
    # a key removed but not yet swept is written again: a new object, not the old one
    put(state, "p/7", checksum=99)
    put(state, "p/new")
    assert state.put_end(NS, ["p/pending"], [5], pending.put_id) == [OK]
    assert not visible(state, "p/8")
    sweep_all(state, 7)
    assert removal.removed == 50  # p/7's old object among them, settled when it was written again
    assert [e.key for e in list_keys(state, NS, "p/").entries] == ["p/7", "p/new", "p/pending"]
    assert state.get_replicas(NS, ["p/7"]).checksums == [99]
    assert_consistent(state)


def test_two_removals_in_flight_and_the_blocking_form(state):
    mount(state, "a", 1 << 24)
    put_many(state, [f"a/{i}" for i in range(30)] + [f"b/{i}" for i in range(30)] + ["c"])
    first, second = state.start_remove_prefix(NS, "a/"), state.start_remove_prefix(NS, "b/")
    assert not visible(state, "a/3") and not visible(state, "b/3")
    sweep_all(state, 4)
    assert (first.removed, second.removed) == (30, 30)
    state.sweep_inline = True
    assert state.remove_prefix(NS, "c") == 1
    assert state.snapshot().objects == 0
    assert_consistent(state)


def test_a_dead_segment_hands_out_no_copy_from_the_moment_it_is_declared_dead(state):
    a, b = mount(state, "a", 1 << 24), mount(state, "b", 1 << 24)
    state.quotas.register("engine", 1, 1, 1 << 24)
    owner = PutOptions(instance="engine", rank=0)
    put_many(state, [f"two/{i}" for i in range(300)], replicas=2, instance="engine", rank=0)
    only_a = []
    for i in range(300):
        started = state.put_start(NS, [f"one/{i}"], [100], 1, owner)
        if started.replica_segments[0] == a:  # placement picked a
            only_a.append(f"one/{i}")
        assert state.put_end(NS, [f"one/{i}"], [1], started.put_id) == [OK]
    writing = state.put_start(NS, ["pending"], [100], 2)
    assert only_a, "placement never chose segment a"
    state.drop_segment(a, reason="unmounted")
    # at once, before any slice: no reader gets a copy on a, lost objects are gone, a pending put
    # with a copy there cannot complete, and a lost key can be written again
    got = state.get_replicas(NS, [f"two/{i}" for i in range(300)])
    assert set(got.statuses) == {OK} and set(got.replica_segments) == {b}
    assert state.exists(NS, only_a[:20]) == ([False] * min(20, len(only_a)), 0)
    assert state.put_end(NS, ["pending"], [1], writing.put_id) == [Status.NOT_PENDING]
    assert state.put_start(NS, [only_a[0]], [100], 1).statuses == [OK]
    sweep_all(state, 50)
    assert not state.sweeps.active
    got = state.get_replicas(NS, [f"two/{i}" for i in range(300)])
    assert set(got.replica_segments) == {b}
    assert_consistent(state)


def test_a_removal_and_a_segment_death_sweeping_together(state):
    a, b = mount(state, "a", 1 << 24), mount(state, "b", 1 << 24)
    put_many(state, [f"p/{i}" for i in range(200)], replicas=2)
    put_many(state, [f"q/{i}" for i in range(200)], replicas=2)
    removal = state.start_remove_prefix(NS, "p/")
    state.drop_segment(a, reason="unmounted")
    assert not visible(state, "p/1") and visible(state, "q/1")
    assert set(state.get_replicas(NS, ["q/1"]).replica_segments) == {b}
    sweep_all(state, 33)
    assert removal.removed == 200 and state.snapshot().objects == 200
    assert_consistent(state)


def test_a_segment_remounting_while_its_old_copies_are_swept_gets_them_adopted_again(state):
    from tests.unit.master.test_recovery import chunk, inventory_done, report_dram_objects

    state.begin_recovery(set(), timeout_s=1.0)
    a = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], 1 << 20, inventory=True).segment
    inventory_done(state, a.segment_id)
    started = state.put_start(NS, ["k"], [100], 1)
    assert state.put_end(NS, ["k"], [5], started.put_id) == [OK]
    state.commits.poll(a.segment_id, 1 << 62, 0)  # the segment acknowledged the commit
    offset = started.replica_offsets[0]
    # the process restarts under its name: its old id is dead, its records not swept yet
    again = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], 1 << 20, inventory=True)
    assert state.sweeps.active and not again.discard_index
    assert not visible(state, "k")  # the old copy is never handed out
    assert report_dram_objects(state, again.segment.segment_id, chunk([("k", 100, 5, offset)])) == [OK]
    inventory_done(state, again.segment.segment_id)
    sweep_all(state, 4)
    assert visible(state, "k") and state.get_replicas(NS, ["k"]).replica_segments == [again.segment.segment_id]
    # (assert_consistent's model of the segment's index knows only notices, not an inventory)
    assert state.snapshot().objects == 1 and state.names_after("", inclusive=True) == ["ns\x00k"]
