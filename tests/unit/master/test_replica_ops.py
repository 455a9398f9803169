"""Replica operations on the master's tables (issue 21): `remove_replicas` (kvtier.master.replicas)
and keyed copies/moves (`Drainer.migrate_keys`). Scenario style, injected clock, books checked
from scratch after each (tests/unit/master/accounting.py)."""

from __future__ import annotations

import pytest

from kvtier.master.records import TIER_DRAM, TIER_SSD, replica_offset, replica_segment, replica_tier
from kvtier.master.replicas import remove_replicas
from kvtier.master.state import MasterState
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent, segment_indexes
from tests.unit.master.test_eviction import LEASE_S, NS, KiB, make_state, put
from tests.unit.master.test_state import FakeClock, advance_alive
from tests.unit.master.test_tiering import mount_ssd, tiers

OK = Status.OK


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    state = make_state(clock)
    for name in ("a", "b", "c"):
        mount_ssd(state, name, 16 * KiB, offload=False)
    return state


def seg(state: MasterState, name: str) -> int:
    return state.segment_named(name).segment_id


def holders(state: MasterState, key: str) -> list[str]:
    record = state.record(NS, key)
    return sorted(state.segments[replica_segment(r)].name for r in record.replicas) if record else []


def copy(state: MasterState, key: str, target: str, keep_source: bool = True, source: str = "", moved: bool = True):
    """Start a keyed migration of one key and report it `moved`; (start status, per-key, end statuses)."""
    status, batch = state.drainer.migrate_keys(NS, [key], source, target, keep_source)
    if batch is None:
        return status, None, None
    if batch.refused:
        return status, batch.refused[0], None
    (item,) = batch.items
    if item.target is None:
        return status, int(Status.NO_SPACE), None
    return status, OK, state.drainer.migrate_end(batch.migration_id, {(NS, key): moved})[1]


# ------------------------------------------------------------------ remove


def test_remove_drops_one_replica_and_refuses_the_last(state):
    put(state, "k", replicas=2, preferred_segment="a")
    assert holders(state, "k") == ["a", "b"]

    assert remove_replicas(state, NS, ["k"], "a", False) == (OK, [OK])
    assert holders(state, "k") == ["b"]
    assert remove_replicas(state, NS, ["k", "k", "gone"], "b", False) == (
        OK,
        [Status.LAST_REPLICA, Status.LAST_REPLICA, Status.NOT_FOUND],
    )
    assert remove_replicas(state, NS, ["k"], "a", False) == (OK, [Status.REPLICA_NOT_FOUND])
    assert remove_replicas(state, NS, ["k"], "nope", False) == (Status.SEGMENT_NOT_FOUND, [])
    assert_consistent(state)

    assert remove_replicas(state, NS, ["k"], "b", True) == (OK, [OK])
    assert state.record(NS, "k") is None
    assert_consistent(state)


def test_a_removed_replicas_range_is_reused_only_after_its_read_lease(state, clock):
    put(state, "k", size=8 * KiB, replicas=2, preferred_segment="a")
    state.get_replicas(NS, ["k"])  # a reader's lease on both replicas
    offset = replica_offset(next(r for r in state.record(NS, "k").replicas if replica_segment(r) == seg(state, "a")))
    assert remove_replicas(state, NS, ["k"], "a", False) == (OK, [OK])

    other = put(state, "other", size=8 * KiB, preferred_segment="a")
    assert other.replica_offsets[0] != offset, "the reader may still be reading that range"
    clock.advance(LEASE_S + 1)
    state.tick()
    assert put(state, "third", size=8 * KiB, preferred_segment="a").replica_offsets[0] == offset
    assert_consistent(state)


def test_remove_takes_a_segments_disk_copy_too(state):
    a = seg(state, "a")
    put(state, "k", preferred_segment="b")
    assert state.tiering.report_disk_objects(a, [NS], ["k"], [KiB], [7], [1]) == [OK]
    assert tiers(state, "k") == sorted([(a, TIER_SSD), (seg(state, "b"), TIER_DRAM)])

    assert remove_replicas(state, NS, ["k"], "a", False) == (OK, [OK])

    assert tiers(state, "k") == [(seg(state, "b"), TIER_DRAM)]
    assert [t.name for t in state.tiering.pending_forgets()] == [f"{NS}\x00k"], "the segment tombstones it"
    assert_consistent(state)


def test_a_pending_put_is_not_touched(state):
    started = state.put_start(NS, ["p"], [KiB], 1)
    assert started.statuses == [OK]
    assert remove_replicas(state, NS, ["p"], "a", True)[1] == [Status.PUT_IN_PROGRESS]
    assert copy(state, "p", "b")[1] == Status.PUT_IN_PROGRESS


# ------------------------------------------------------------------ copy and move


def test_a_copy_adds_a_replica_counted_to_its_owner(state):
    assert state.register_instance("llm", 1, 1, 64 * KiB) == 64 * KiB
    put(state, "k", preferred_segment="a", instance="llm")
    (owner,) = state.quotas.snapshot()
    used = owner.used

    assert copy(state, "k", "b") == (OK, OK, [OK])

    assert holders(state, "k") == ["a", "b"]
    assert owner.used == 2 * used
    assert_consistent(state)


def test_a_move_swaps_the_source_for_the_target(state):
    put(state, "k", replicas=2, preferred_segment="a")
    assert copy(state, "k", "c", keep_source=False, source="b") == (OK, OK, [OK])
    assert holders(state, "k") == ["a", "c"]
    assert_consistent(state)


def test_refusals(state):
    put(state, "k", preferred_segment="a")
    assert copy(state, "k", "nope")[:2] == (Status.SEGMENT_NOT_FOUND, None)
    assert copy(state, "k", "b", source="nope")[:2] == (Status.SEGMENT_NOT_FOUND, None)
    assert copy(state, "gone", "b")[1] == Status.NOT_FOUND
    assert copy(state, "k", "a")[1] == Status.REPLICA_EXISTS
    assert copy(state, "k", "b", source="c")[1] == Status.REPLICA_NOT_FOUND
    put(state, "big", size=16 * KiB, preferred_segment="b")
    assert copy(state, "k", "b")[1] == Status.NO_SPACE
    assert state.drainer.drain("c", finish=False)[0] == OK
    assert copy(state, "k", "c")[:2] == (Status.INVALID_ARGUMENT, None)
    assert holders(state, "k") == ["a"]
    assert_consistent(state)


def test_a_disk_only_object_is_copied_from_its_disk_copy_into_dram(state):
    """Copies read DRAM replicas only: an SSD-only object answered REPLICA_NOT_FOUND. Its disk copy is
    the source now (the copier reads it with READ_DISK); the target is a DRAM replica."""
    a, b = seg(state, "a"), seg(state, "b")
    assert state.tiering.report_disk_objects(a, [NS], ["d"], [KiB], [7], [1]) == [OK]
    status, batch = state.drainer.migrate_keys(NS, ["d"], "", "b", True)
    (item,) = batch.items
    assert (replica_segment(item.source), replica_tier(item.source)) == (a, TIER_SSD)
    assert replica_tier(item.target) == TIER_DRAM
    assert state.drainer.migrate_end(batch.migration_id, {(NS, "d"): True})[1] == [OK]
    assert tiers(state, "d") == sorted([(a, TIER_SSD), (b, TIER_DRAM)])
    assert state.get_replicas(NS, ["d"]).statuses == [OK]
    assert_consistent(state)


def test_a_disk_only_object_moved_leaves_its_disk_copy_tombstoned(state):
    a, b = seg(state, "a"), seg(state, "b")
    assert state.tiering.report_disk_objects(a, [NS], ["d"], [KiB], [7], [1]) == [OK]
    assert copy(state, "d", "b", keep_source=False, source="a") == (OK, OK, [OK])
    assert tiers(state, "d") == [(b, TIER_DRAM)]
    assert [t.name for t in state.tiering.pending_forgets()] == [f"{NS}\x00d"], "the segment tombstones it"
    assert state.segments[a].ssd_objects == 0
    assert_consistent(state)


def test_a_drain_moves_disk_only_objects_and_leaves_redundant_disk_copies(state):
    """A drain took DRAM copies only: an object whose one copy was on the draining segment's SSD was
    dropped with the segment. It moves now; a disk copy of an object held elsewhere does not."""
    a = seg(state, "a")
    put(state, "both", preferred_segment="b")
    assert state.tiering.report_disk_objects(a, [NS, NS], ["disk", "both"], [KiB, KiB], [7, 7], [1, 2]) == [OK, OK]
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert status == OK
    assert [(i.record.key, replica_tier(i.source)) for i in batch.items] == [("disk", TIER_SSD)]
    assert state.drainer.migrate_end(batch.migration_id, {(NS, "disk"): True})[1] == [OK]
    ((holder, tier),) = tiers(state, "disk")
    assert holder != a and tier == TIER_DRAM, "one DRAM replica elsewhere, the disk copy tombstoned"
    assert [t.name for t in state.tiering.pending_forgets()] == [f"{NS}\x00disk"]
    assert state.drainer.migrate_start("a", 10)[1].items == [], "nothing left to move"
    assert state.drainer.drain("a", finish=True)[1:] == (0, 0, "DRAINED", 1), "one redundant disk copy left"
    assert state.get_replicas(NS, ["disk", "both"]).statuses == [OK, OK]
    assert_consistent(state)


def test_a_copy_not_verified_adds_nothing_and_its_target_is_released(state, clock):
    put(state, "k", preferred_segment="a")
    assert copy(state, "k", "b", moved=False) == (OK, OK, [Status.NOT_PENDING])
    assert holders(state, "k") == ["a"]
    clock.advance(LEASE_S + 1)  # the copier's write grant ends with the migration's lease
    state.tick()
    assert state.segment_named("b").allocator.used == 0
    assert_consistent(state)


@pytest.mark.parametrize("again", [False, True], ids=["removed", "put-again"])
def test_a_key_removed_during_its_copy_gets_no_orphan_replica(state, clock, again):
    put(state, "k", preferred_segment="a")
    status, batch = state.drainer.migrate_keys(NS, ["k"], "", "b", True)
    assert status == OK and batch.items[0].target is not None
    assert state.remove(NS, ["k"]) == [OK]
    if again:
        put(state, "k", preferred_segment="c")

    assert state.drainer.migrate_end(batch.migration_id, {(NS, "k"): True})[:2] == (OK, [Status.NOT_FOUND])

    assert holders(state, "k") == (["c"] if again else [])
    clock.advance(LEASE_S + 1)
    state.tick()
    assert state.segment_named("b").allocator.used == 0
    assert_consistent(state)


def test_an_unfinished_copy_is_released_by_the_tick(state, clock):
    put(state, "k", preferred_segment="a")
    status, batch = state.drainer.migrate_keys(NS, ["k"], "", "b", True)
    assert status == OK
    advance_alive(state, clock, state.config.put_timeout_s + 1)  # the copier died
    state.tick()
    assert holders(state, "k") == ["a"]
    assert state.segment_named("b").allocator.used == 0
    assert copy(state, "k", "b") == (OK, OK, [OK]), "no migration of it is left in flight"
    assert_consistent(state)


def test_a_replica_being_offloaded_is_not_removed_meanwhile(clock):
    """The offload would put a copy back on the segment when done: PUT_IN_PROGRESS until then."""
    state = make_state(clock)
    a = mount_ssd(state, "a", 4 * KiB)
    mount_ssd(state, "b", 4 * KiB, offload=False)
    put(state, "k", replicas=2)
    for i in range(3):
        put(state, f"x{i}", preferred_segment="a")  # past the watermark: offloads are queued
    state.tick()
    assert state.tiering.offloading, "an offload task is queued"
    name, task = next(iter(state.tiering.offloading.items()))
    key = name.split("\x00", 1)[1]
    assert task.segment_id == a

    assert remove_replicas(state, NS, [key], "a", True) == (OK, [Status.PUT_IN_PROGRESS])
    assert_consistent(state)


# ------------------------------------------------------------------ moves between segments keeping an index


def _indexed(clock: FakeClock) -> tuple[MasterState, int, int]:
    """Two segments keeping DRAM indexes (commit notices waited for), 64 KiB each."""
    from tests.unit.master.test_recovery import mount as mount_indexed
    from tests.unit.master.test_recovery import new_state

    state = new_state(clock)
    a, b = mount_indexed(state, "a", 64 * KiB, inventory=True), mount_indexed(state, "b", 64 * KiB, inventory=True)
    for segment_id in (a, b):
        from kvtier.master.recovery import inventory_done

        inventory_done(state, segment_id)
    return state, a, b


def _notices(state: MasterState, segment_id: int) -> list[tuple[int, str, bool]]:
    return [(offset, r.name.partition("\x00")[2], drop) for offset, r, drop in state.commits.since(segment_id, 1)]


def test_a_move_keeps_its_source_until_the_target_acknowledges_then_drops_it_before_reuse(clock):
    state, a, b = _indexed(clock)
    put(state, "k", size=8 * KiB, preferred_segment="a")
    segment_indexes(state)  # the segments apply and acknowledge what they were told
    source = state.record(NS, "k").replicas[0]
    assert copy(state, "k", "b", keep_source=False, source="a") == (OK, OK, [OK])
    # the target is one more replica; the source stays in its index (no drop) until b acknowledges
    assert holders(state, "k") == ["a", "b"]
    assert [n for n in _notices(state, a) if n[1] == "k"] == []
    segment_indexes(state)  # b acknowledges the copy
    assert holders(state, "k") == ["b"]
    assert _notices(state, a) == [(replica_offset(source), "k", True)]
    # the freed range's next object comes after that drop in a's feed, never before it
    advance_alive(state, clock, LEASE_S + 3)
    state.tick()
    put(state, "x", size=8 * KiB, preferred_segment="a")
    offsets = {n[1]: n[0] for n in _notices(state, a)}
    assert offsets["x"] == replica_offset(source), "the allocator hands the freed range out again"
    assert [n[1:] for n in _notices(state, a)] == [("k", True), ("x", False)]
    assert_consistent(state)


def test_a_move_whose_target_goes_first_leaves_the_object_on_its_source(clock):
    state, a, b = _indexed(clock)
    put(state, "k", size=8 * KiB, preferred_segment="a")
    segment_indexes(state)
    assert copy(state, "k", "b", keep_source=False, source="a") == (OK, OK, [OK])
    state.drop_segment(b, reason="heartbeat expired")  # b never acknowledged the copy
    assert holders(state, "k") == ["a"]
    assert state.get_replicas(NS, ["k"]).statuses == [OK]
    assert _notices(state, a) == [], "a keeps it in its index"
    assert_consistent(state)


def test_a_move_waiting_for_its_target_is_not_moved_again_nor_its_source_removed(clock):
    """Until the target acknowledged, the object is still moving: another move (or a drain of the
    source) now would leave it a third replica, and removing the source replica would drop its last
    acknowledged copy (the unacknowledged target made LAST_REPLICA miss it). A drain finished
    meanwhile counts the source as dropped: the object lives on only if the target acknowledges."""
    state, a, b = _indexed(clock)
    put(state, "k", size=8 * KiB, preferred_segment="a")
    segment_indexes(state)
    assert copy(state, "k", "b", keep_source=False, source="a") == (OK, OK, [OK])
    assert copy(state, "k", "b", keep_source=False, source="a")[1] == Status.PUT_IN_PROGRESS
    assert remove_replicas(state, NS, ["k"], "a", False) == (OK, [Status.PUT_IN_PROGRESS])
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert status == OK and batch.items == [], "a drain of the source does not take it again"
    assert state.drainer.drain("a", finish=True)[1] == 1, "its source replica is counted with the dropped"
    segment_indexes(state)
    assert holders(state, "k") == ["b"]
    assert_consistent(state)


def test_a_drain_walks_the_objects_in_bounded_slices_continuing_where_it_stopped(state, monkeypatch):
    """Every MigrateStart walked every object from the start on the event loop (1.5 s a batch at 1M
    objects, a drain quadratic in them). Each call now continues the walk from where the last one
    stopped, for at most list_page_ms, and says when it stopped short (`more`)."""
    import kvtier.master.drain as drain

    for i in range(200):
        put(state, f"a{i:03d}", size=16, preferred_segment="a")
        put(state, f"c{i:03d}", size=16, preferred_segment="c")
    for i in range(5):
        put(state, f"z{i}", size=16, preferred_segment="b")  # last in name order
    assert {holders(state, f"z{i}")[0] for i in range(5)} == {"b"} and "b" not in holders(state, "c199")
    assert state.drainer.drain("b", finish=False)[0] == OK
    import dataclasses

    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, list_page_ms=1e-9))  # a step a call
    visited = []
    original = state.names_after

    def counted(*args, **kwargs):
        names = original(*args, **kwargs)
        visited.append(len(names))
        return names

    monkeypatch.setattr(state, "names_after", counted)
    found, calls = [], 0
    while True:
        calls += 1
        status, batch = state.drainer.migrate_start("b", 256)
        assert status == OK and max(visited[-1:] or [0]) <= drain._WALK_STEP
        found += [item.record.key for item in batch.items]
        if not batch.more:
            break
    assert sorted(found) == [f"z{i}" for i in range(5)]
    assert calls == 7, "405 names, 64 a call, each call going on from the last"
    assert sum(visited) <= 405 + drain._WALK_STEP
    assert_consistent(state)


@pytest.mark.parametrize("copied", [True, False])
def test_a_drain_waits_for_a_copy_of_a_disk_only_object_in_flight(state, copied):
    """A walk skipped a disk-only object whose copy or move (or another drain's batch) was in flight,
    and `kvtier drain` finished past it: the object went with the segment though the copy would have
    kept it. The walk now says it is waiting; once the copy ends, the object is held elsewhere (or,
    the copy failed, the next walk takes it)."""
    a = seg(state, "a")
    assert state.tiering.report_disk_objects(a, [NS], ["d"], [KiB], [7], [1]) == [OK]
    status, keyed = state.drainer.migrate_keys(NS, ["d"], "a", "b", True)
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert batch.items == [] and not batch.more and batch.waiting
    expected = OK if copied else Status.NOT_PENDING  # not copied: nothing changed, the key is there
    assert state.drainer.migrate_end(keyed.migration_id, {(NS, "d"): copied})[1] == [expected]
    status, batch = state.drainer.migrate_start("a", 10)
    assert not batch.waiting
    assert [i.record.key for i in batch.items] == ([] if copied else ["d"])
