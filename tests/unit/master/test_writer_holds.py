"""The range of a put that never completed on a segment reporting its same-host writers (writer slots)
goes to no other object until a report taken after its grant shows no writer in it; a range a report
names as being written that the books have free is taken out of the free space
(kvtier.master.range_book). Driven on a fake clock; reports carry the segment's wall clock."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.records import replica_offset
from kvtier.master.recovery import inventory_done
from kvtier.master.state import MasterState
from kvtier.proto.auth import wall_ms
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_state import NS, OK, FakeClock, MiB, mount

TTL, MARGIN = 5.0, 2.0  # the write grant and the clock skew margin, as the server sets them
SIZE = 4096
LATER_MS = 60_000  # a report taken well after any grant of these tests ended


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=100.0, lease_s=TTL, put_timeout_s=TTL).validate()
    state = MasterState(config, clock=clock)
    state.capability_ttl_s, state.reuse_margin_s = TTL, MARGIN
    return state


def writer_segment(state: MasterState, name: str = "a") -> int:
    segment_id = mount(state, name)
    state.segments[segment_id].writer_slots = True
    return segment_id


def abandoned(state: MasterState, key: str) -> int:
    """Start a put and revoke it (as a client does when its write failed): its offset."""
    started = state.put_start(NS, [key], [SIZE], 1)
    assert started.statuses == [OK]
    assert state.put_revoke(NS, [key], started.put_id) == [OK]
    return started.replica_offsets[0]


def next_offset(state: MasterState, key: str) -> int:
    started = state.put_start(NS, [key], [SIZE], 1)
    assert started.statuses == [OK]
    return started.replica_offsets[0]


def test_a_range_is_held_past_its_grant_until_a_later_report_shows_no_writer_in_it(state, clock):
    segment_id = writer_segment(state)
    offset = abandoned(state, "alice")
    clock.advance(TTL + MARGIN + 1)
    state.tick()
    assert state.segments[segment_id].releasing == SIZE, "no report yet: a writer may still be in it"
    assert next_offset(state, "bob") != offset
    # a report taken before the grant's end proves nothing
    state.writers_reported(segment_id, wall_ms() - 1000, [])
    assert state.segments[segment_id].releasing == SIZE
    # one taken after it, with a writer still copying there (stopped mid-copy), keeps it held
    state.writers_reported(segment_id, wall_ms() + LATER_MS, [(offset + 100, 10)])
    assert state.segments[segment_id].releasing == SIZE and next_offset(state, "carol") != offset
    assert_consistent(state)
    # and once a later report shows nobody there, it is free again
    state.writers_reported(segment_id, wall_ms() + LATER_MS, [(offset + SIZE, 10)])
    assert state.segments[segment_id].releasing == 0
    assert next_offset(state, "dave") == offset
    assert_consistent(state)


def test_a_report_does_not_free_a_range_before_the_masters_own_clock_passed_its_grant(state, clock):
    segment_id = writer_segment(state)
    offset = abandoned(state, "alice")
    state.writers_reported(segment_id, wall_ms() + LATER_MS, [])  # a segment clock far ahead of ours
    assert state.segments[segment_id].releasing == SIZE, "tcp frames are judged on the master's clock"
    clock.advance(TTL + MARGIN + 1)
    state.writers_reported(segment_id, wall_ms() + LATER_MS, [])
    assert state.segments[segment_id].releasing == 0 and next_offset(state, "bob") == offset


def test_a_segment_without_writer_slots_reuses_the_range_after_its_grant_as_before(state, clock):
    segment_id = mount(state, "old")
    offset = abandoned(state, "alice")
    clock.advance(TTL + MARGIN + 1)
    state.tick()
    assert state.segments[segment_id].releasing == 0 and next_offset(state, "bob") == offset


def test_a_complete_objects_range_is_not_held_for_writers(state, clock):
    segment_id = writer_segment(state)
    started = state.put_start(NS, ["alice"], [SIZE], 1)
    assert state.put_end(NS, ["alice"], [7], started.put_id) == [OK]
    assert state.remove(NS, ["alice"]) == [OK]
    clock.advance(TTL + MARGIN + 1)
    state.tick()
    assert state.segments[segment_id].releasing == 0, "its writer finished before PutEnd"


def test_a_free_range_a_stalled_writer_is_in_is_taken_out_of_the_free_space_until_it_leaves(state, clock):
    # a master restarted (or a segment mounted again) while a writer was stopped: its books have it free
    segment_id = writer_segment(state)
    segment = state.segments[segment_id]
    assert state.config.alignment == 64
    state.writers_reported(segment_id, wall_ms(), [(100, 5000)])  # within its grant: in a range its put has
    assert segment.releasing == 0, "a copy within its grant takes nothing out of the free space"
    state.writers_reported(segment_id, wall_ms(), [(100, 5000)], [(100, 5000)])  # past it: [64, 5120) aligned
    assert segment.releasing == 5120 - 64
    assert all(next_offset(state, f"k{i}") >= 5120 for i in range(4)), "nothing placed where the writer is"
    assert_consistent(state)
    state.writers_reported(segment_id, wall_ms(), [])
    assert segment.releasing == 0
    assert_consistent(state)


def test_copies_named_at_mount_are_held_at_once_or_once_the_inventory_is_in(state):
    fresh = writer_segment(state, "fresh")  # no inventory: its books are all free now
    state.writers_at_mount(fresh, [(0, 4096)])
    assert state.segments[fresh].releasing == 4096 and next_offset(state, "k") != 0
    result = state.mount_segment("unit", "back", "host-back", ["tcp://127.0.0.1:9/back"], MiB, inventory=True)
    back = result.segment
    back.writer_slots = True
    state.writers_at_mount(back.segment_id, [(8192, 4096)])
    assert back.releasing == 0, "not while its inventory is being rebuilt in offset order"
    inventory_done(state, back.segment_id)
    assert back.releasing == 4096 and back.allocator.reserve_free(8192, 4096) == [], "none of it is free"
    assert_consistent(state)


def test_only_a_held_range_a_writer_is_still_in_is_not_counted_as_room_on_its_way_back(clock):
    # a writer may stay stopped for good: live objects are evicted for the room it holds; a held range
    # nobody is in leaves at the next report, and evicting for it would evict for nothing
    config = MasterConfig(cluster_id="unit", lease_s=TTL, put_timeout_s=TTL, high_watermark=0.5).validate()
    state = MasterState(config, clock=clock)
    state.capability_ttl_s, state.reuse_margin_s = TTL, MARGIN
    segment_id = writer_segment(state)
    segment = state.segments[segment_id]
    stuck = state.put_start(NS, ["stuck"], [MiB // 2], 1)
    for i in range(4):
        started = state.put_start(NS, [f"live{i}"], [MiB // 8], 1)
        assert state.put_end(NS, [f"live{i}"], [7], started.put_id) == [OK]
    assert segment.used == MiB // 2 + 4 * (MiB // 8) and stuck.statuses == [OK]
    clock.advance(TTL + 1)  # "stuck" is reclaimed (its half of the region held), and the region is over 50%
    state.tick()
    assert segment.releasing == MiB // 2
    live_left = segment.used - MiB // 2
    assert live_left >= MiB // 4, "evicted for a held range no writer was reported in"
    writer = [(stuck.replica_offsets[0], 100)]
    state.writers_reported(segment_id, wall_ms() - LATER_MS, writer, writer)  # before its due: it stays held
    state.tick()
    assert segment.used == MiB // 2, "the live objects were evicted: the held half is not coming back"
    assert_consistent(state)


def test_a_drain_targets_range_a_migrator_did_not_fill_is_held_like_a_puts(state, clock):
    # given an object moving from a to b, whose migrator (a same-host writer of b) reports it not moved
    mount(state, "a")
    started = state.put_start(NS, ["x"], [SIZE], 1)
    assert state.put_end(NS, ["x"], [7], started.put_id) == [OK]
    b = writer_segment(state, "b")
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert status == OK and batch.items[0].target is not None
    target = replica_offset(batch.items[0].target)
    assert state.drainer.migrate_end(batch.migration_id, {(NS, "x"): False})[0] == OK
    # when its grant and the margin are over but a report still shows it in the target range
    clock.advance(state.config.lease_s + MARGIN + 1)
    state.tick()
    state.writers_reported(b, wall_ms() + LATER_MS, [(target, 10)], [(target, 10)])
    # then the range goes to no other object
    assert state.segments[b].releasing == SIZE
    assert_consistent(state)
    state.writers_reported(b, wall_ms() + LATER_MS, [])
    assert state.segments[b].releasing == 0
    assert_consistent(state)
