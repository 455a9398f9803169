"""The master's side of the SSD tier: offload on eviction, disk replicas, promotion, forgetting.

Scenarios on a fake clock: the "segment" is played by the test, which polls
tasks and reports outcomes the way a segment server does. Every scenario
ends by checking the books (`assert_consistent`).
"""

from __future__ import annotations

import pytest

from kvtier.master.records import TIER_DRAM, TIER_SSD, object_name, replica_offset, replica_segment, replica_tier
from kvtier.master.state import MasterState
from kvtier.master.tier_forgets import OWED_SAVED_MAX_BYTES
from kvtier.master.tier_tasks import TaskKind
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_eviction import LEASE_S, NS, KiB, make_state, put, put_status, read, stored
from tests.unit.master.test_state import FakeClock, advance_alive

OK = Status.OK


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    return make_state(clock, promote_after_reads=2)


def mount_ssd(state: MasterState, name: str, dram: int, ssd: int = 1 << 30, offload: bool = True) -> int:
    result = state.mount_segment(
        "unit", name, f"host-{name}", [f"tcp://127.0.0.1:9/{name}"], dram, ssd_capacity=ssd, offload=offload
    )
    assert result.status == OK, result.error
    return result.segment.segment_id


def tiers(state: MasterState, key: str) -> list[tuple[int, int]]:
    """(segment id, tier) of each replica of a key."""
    return sorted((replica_segment(r), replica_tier(r)) for r in state.record(NS, key).replicas)


def fill_past_watermark(state: MasterState) -> None:
    """Four 1 KiB objects k0..k3 on a 4 KiB segment: above the 0.90 watermark."""
    for i in range(4):
        put(state, f"k{i}")


def put_waiting(state: MasterState, disk: FakeDisk, key: str, size: int = KiB, **options) -> None:
    """A put the way a waiting PutStart sees it (kvtier.master.backpressure): while the answer is
    OFFLOAD_BEHIND, the segment runs the offloads queued for it, then the put is tried again."""
    for _ in range(4):
        if put_status(state, key, size, **options) != Status.OFFLOAD_BEHIND:
            return
        disk.complete(disk.poll())
    raise AssertionError(f"{key} still OFFLOAD_BEHIND after 4 offload rounds")


class FakeDisk:
    """Plays a segment server's tier worker: locations are handed out in order."""

    def __init__(self, state: MasterState, segment_id: int) -> None:
        self.state = state
        self.segment_id = segment_id
        self.next_location = 1
        self.forgotten: list[int] = []

    def poll(self, ack_forgets: bool = True) -> list:
        """The OFFLOAD and PROMOTE tasks handed out; FORGETs are recorded (and acknowledged)."""
        tasks = self.state.tiering.poll(self.segment_id, 100)
        forgets = [t for t in tasks if t.kind is TaskKind.FORGET]
        self.forgotten += [t.disk_location for t in forgets]
        if forgets and ack_forgets:
            ids = [t.task_id for t in forgets]
            assert self.state.tiering.done(self.segment_id, ids, [int(OK)] * len(ids), [0] * len(ids)) == [OK] * len(
                ids
            )
        return [t for t in tasks if t.kind is not TaskKind.FORGET]

    def complete(self, tasks: list, status: Status = OK) -> list[int]:
        locations = []
        for task in tasks:
            if task.kind is TaskKind.OFFLOAD:
                locations.append(self.next_location)
                self.next_location += 1
            else:
                locations.append(task.disk_location)
        return self.state.tiering.done(
            self.segment_id, [t.task_id for t in tasks], [int(status)] * len(tasks), locations
        )


def offloaded_k0(state: MasterState) -> tuple[int, FakeDisk]:
    """An 8 KiB segment filled with k0..k7 (1 KiB each), after one watermark pass offloaded the
    least recently used, k0, to SSD (down to 0.85). The segment id and its FakeDisk."""
    seg = mount_ssd(state, "a", 8 * KiB)
    disk = FakeDisk(state, seg)
    for i in range(8):
        put(state, f"k{i}")
    state.tick()
    disk.complete(disk.poll())
    return seg, disk


def test_watermark_offloads_lru_objects_instead_of_dropping_them(state):
    # given a segment with an SSD tier, filled past its DRAM watermark
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    # when the tick runs
    state.tick()
    # then the least recently used object is queued for offload, and still served from DRAM meanwhile
    tasks = disk.poll()
    assert [(t.kind, t.name.split("\x00")[1]) for t in tasks] == [(TaskKind.OFFLOAD, "k0")]
    assert tiers(state, "k0") == [(seg, TIER_DRAM)]
    used_before = state.segments[seg].used
    # and a second tick does not offload it again
    state.tick()
    assert disk.poll() == []
    assert_consistent(state)
    # when the segment reports the copy durable
    assert disk.complete(tasks) == [OK]
    # then k0 lives on SSD only, its DRAM range is free, and it is still visible
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    assert state.segments[seg].used == used_before - KiB
    assert state.segments[seg].ssd_objects == 1
    assert stored(state) == {"k0", "k1", "k2", "k3"}
    assert state.evictions["offload"] == [1, KiB]
    assert "watermark" not in state.evictions
    assert_consistent(state)


def test_disk_replica_is_returned_with_its_tier_and_location(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())
    got = state.get_replicas(NS, ["k0", "k1"])
    assert got.statuses == [OK, OK]
    assert got.replica_tiers == [TIER_SSD, TIER_DRAM]
    assert got.replica_offsets[0] == 1  # the disk location the segment reported
    assert got.replica_segments == [seg, seg]


def test_segment_without_offload_drops_at_the_watermark(state):
    seg = mount_ssd(state, "a", 4 * KiB, offload=False)
    fill_past_watermark(state)
    state.tick()
    assert state.tiering.poll(seg, 100) == []
    assert "k0" not in stored(state)
    assert state.evictions["watermark"][0] == 1
    assert_consistent(state)


def test_failed_offload_keeps_the_dram_copy_and_disk_full_pauses_offload(state, clock):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    # when the segment's disk is full
    assert disk.complete(disk.poll(), Status.NO_SPACE) == [OK]
    # then the object is still in DRAM, and the next watermark pass drops instead of offloading
    assert tiers(state, "k0") == [(seg, TIER_DRAM)]
    assert state.tiering.counters["offload_failures"] == 1
    state.tick()
    assert disk.poll() == []
    assert "k0" not in stored(state)
    assert_consistent(state)


def test_a_copy_of_an_object_removed_while_offloading_is_refused_for_the_segment_to_tombstone(state):
    """Answered NOT_PENDING (the segment tombstones it before anything else of it is answered), never
    registered: a master restart before a FORGET alone was acknowledged would bring it back. The
    FORGET goes all the same."""
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    tasks = disk.poll()
    assert state.remove(NS, ["k0"]) == [OK]
    answers = disk.complete(tasks)
    assert answers[[t.name for t in tasks].index(object_name(NS, "k0"))] == Status.NOT_PENDING
    assert disk.poll(ack_forgets=False) == [] and disk.forgotten == [1]
    assert state.record(NS, "k0") is None
    assert state.segments[seg].ssd_objects == sum(a == OK for a in answers)
    assert_consistent(state)
    # and if the segment's own tombstone is lost (killed before it was durable, the FORGET not
    # acknowledged), the FORGET kept refuses its next mount's report of the copy
    state.unmount_segment(seg)
    again = mount_ssd(state, "a", 4 * KiB)
    assert state.tiering.report_disk_objects(again, [NS], ["k0"], [KiB], [7], [1]) == [Status.CHECKSUM_MISMATCH]
    assert state.record(NS, "k0") is None


def test_removing_an_offloaded_object_forgets_its_disk_copy(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())
    assert state.remove(NS, ["k0"]) == [OK]
    disk.poll()
    assert disk.forgotten == [1]
    assert state.segments[seg].ssd_objects == 0
    assert_consistent(state)


def test_disk_only_object_is_promoted_after_repeated_reads(state, clock):
    seg, disk = offloaded_k0(state)
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    # when the disk-only object is read once: no promotion yet
    read(state, "k0")
    assert disk.poll() == []
    # when it is read a second time (promote_after_reads=2) and DRAM has room
    read(state, "k0")
    tasks = disk.poll()
    assert [t.kind for t in tasks] == [TaskKind.PROMOTE]
    assert tasks[0].disk_location == replica_offset(state.record(NS, "k0").replicas[0])
    assert_consistent(state)  # the promotion's DRAM range is accounted while in flight
    # then the reported copy becomes a DRAM replica next to the disk one
    assert disk.complete(tasks) == [OK]
    assert tiers(state, "k0") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    assert state.tiering.counters["promoted_objects"] == 1
    assert_consistent(state)


def test_a_promotion_never_takes_its_rank_over_its_quota(state):
    """A promoted copy is DRAM charged to the object's rank; promotions were queued whatever the
    rank's quota said, and a rank that only read its offloaded objects went over it for good."""
    seg = mount_ssd(state, "a", 64 * KiB)
    state.register_instance("llm", 1, 1, 4 * KiB)
    for i in range(4):
        put(state, f"k{i}", instance="llm", rank=0)
    record = state.record(NS, "k0")
    assert not state.tiering.promotion_room(state.segments[seg], KiB, record), "the rank's quota is full"
    assert state.tiering.promotion_room(state.segments[seg], KiB), "the segment has room"
    assert state.remove(NS, ["k3"]) == [OK]
    assert state.tiering.promotion_room(state.segments[seg], KiB, record)


def test_promotion_waits_for_space_and_never_evicts(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())
    put(state, "k4")  # DRAM full again: 4 KiB of 4
    read(state, "k0")
    read(state, "k0")
    # no promotion (k4's PutEnd started an offload of k1: offload starts as soon as objects qualify)
    assert [t.kind for t in disk.poll()] == [TaskKind.OFFLOAD]
    assert stored(state) == {"k0", "k1", "k2", "k3", "k4"}
    assert_consistent(state)


def test_reported_inventory_becomes_disk_replicas_and_conflicts_are_refused(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    put(state, "same")  # checksum 7 (see put())
    put(state, "other")
    statuses = state.tiering.report_disk_objects(
        seg,
        [NS, NS, NS, NS],
        ["fresh", "same", "other", "bad\x00key"],
        [KiB, KiB, KiB, 1],
        [5, 7, 99, 0],
        [10, 11, 12, 13],
    )
    assert statuses == [OK, OK, Status.CHECKSUM_MISMATCH, Status.INVALID_KEY]
    assert tiers(state, "fresh") == [(seg, TIER_SSD)]
    assert tiers(state, "same") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    assert tiers(state, "other") == [(seg, TIER_DRAM)]
    got = state.get_replicas(NS, ["fresh"])
    assert got.statuses == [OK] and got.checksums == [5] and got.sizes == [KiB]
    # reporting the same inventory again (a re-mount) changes nothing
    again = state.tiering.report_disk_objects(seg, [NS], ["fresh"], [KiB], [5], [10])
    assert again == [OK]
    assert state.segments[seg].ssd_objects == 2
    assert_consistent(state)


def test_dropped_disk_copies_remove_objects_left_without_replicas(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    put(state, "both")
    state.tiering.report_disk_objects(seg, [NS, NS], ["both", "disk"], [KiB, KiB], [7, 3], [1, 2])
    assert state.tiering.drop_disk_replicas(seg, [NS, NS, NS], ["both", "disk", "nope"], [1, 2, 3]) == 2
    assert tiers(state, "both") == [(seg, TIER_DRAM)]
    assert state.record(NS, "disk") is None
    assert state.tiering.poll(seg, 10) == []  # the segment deletes them itself: nothing to forget
    assert_consistent(state)


def test_segment_loss_drops_its_disk_replicas_and_tasks(state):
    # given a segment with one object on SSD, one offload in flight and one queued
    a = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, a)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())  # k0 on SSD
    put(state, "k4")
    # k5 needs a copy not on SSD yet: it waits (kvtier.master.backpressure), k1's offload starts at once
    assert put_status(state, "k5", size=700) == Status.OFFLOAD_BEHIND
    disk.complete(disk.poll())  # k1 on SSD
    put(state, "k5", size=700)  # the retry: 4.7 KiB of 4, over the watermark again
    state.tick()
    in_flight = disk.poll()
    assert [t.kind for t in in_flight] == [TaskKind.OFFLOAD]
    # when the segment goes away
    assert state.unmount_segment(a) == OK
    # then its objects are gone, disk copies included, and a late report of its task is refused
    assert stored(state) == set()
    assert state.tiering.done(a, [in_flight[0].task_id], [OK], [9]) == [Status.NOT_PENDING]
    assert state.tiering.offloading == {} and state.tiering.offloading_bytes(a) == 0
    assert_consistent(state)


def test_unreported_offload_expires_refuses_a_late_report_and_pauses_offload(state, clock):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    tasks = disk.poll()
    advance_alive(state, clock, state.config.put_timeout_s + 1)
    # when the task expires, the next watermark pass drops instead of offloading again (paused)
    state.tick()
    assert state.tiering.counters["offload_failures"] == 1
    assert disk.poll() == []
    assert "k0" not in stored(state)
    # and a report that comes too late is refused: the segment tombstones that copy
    assert state.tiering.done(seg, [tasks[0].task_id], [OK], [1]) == [Status.NOT_PENDING]
    assert_consistent(state)


@pytest.mark.parametrize("change", ["remove", "upsert"])
def test_a_checksum_mismatch_of_an_object_changed_while_offloading_does_not_pause_offload(state, change):
    """Its range was freed by the removal (or the upsert's swap) and may hold a new object's bytes by
    the time the segment reads it: the mismatch says nothing of the disk or of what is stored. A
    pause would stop offload for seconds, and under `wait` a burst of puts then drops acknowledged
    only-copies (the adversarial SSD run lost 41 of 68 keys so)."""
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    tasks = disk.poll()
    assert object_name(NS, "k0") in [t.name for t in tasks]
    if change == "remove":
        assert state.remove(NS, ["k0"]) == [OK]
    else:
        assert put_status(state, "k0", 0, overwrite=True) == OK  # a new version that needs no room
    assert disk.complete(tasks, Status.CHECKSUM_MISMATCH) == [OK] * len(tasks)
    assert state.tiering.can_offload(state.segments[seg])
    assert state.tiering.counters["offload_failures"] == len(tasks) - 1
    assert_consistent(state)


def test_failed_offload_of_corrupt_dram_bytes_drops_that_copy(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    # when the segment finds k0's DRAM bytes do not match its checksum
    assert disk.complete(disk.poll(), Status.CHECKSUM_MISMATCH) == [OK]
    # then that copy is gone (it could only ever be a miss), counted as such
    assert state.record(NS, "k0") is None
    assert state.evictions["corrupt"][0] == 1
    assert_consistent(state)


def test_forget_is_retried_until_acknowledged_and_survives_the_segments_absence(state):
    # given an offloaded object on a segment that then goes away before it tombstoned the copy
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())
    location = replica_offset(state.record(NS, "k0").replicas[0])
    assert state.remove(NS, ["k0"]) == [OK]
    forgets = [t for t in state.tiering.poll(seg, 10) if t.kind is TaskKind.FORGET]
    assert [t.disk_location for t in forgets] == [location]  # handed out, never acknowledged
    assert state.unmount_segment(seg) == OK
    # when it mounts again and reports its (recovered) inventory, the removed copy among it
    seg = mount_ssd(state, "a", 4 * KiB)
    statuses = state.tiering.report_disk_objects(seg, [NS, NS], ["k0", "k1"], [KiB, KiB], [7, 7], [location, 99])
    # then the removed copy is refused (the segment tombstones it), the other one registered,
    # and the forget is handed out again until the segment acknowledges it
    assert statuses == [Status.CHECKSUM_MISMATCH, OK]
    assert state.record(NS, "k0") is None
    disk = FakeDisk(state, seg)
    disk.poll()
    assert disk.forgotten == [location]
    assert state.tiering.report_disk_objects(seg, [NS], ["k0"], [KiB], [7], [location]) == [OK]  # acknowledged
    assert_consistent(state)


def test_offloaded_copy_of_a_leased_object_is_freed_when_the_lease_ends(state, clock):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    tasks = disk.poll()
    read(state, "k0")  # a reader holds k0's DRAM range now
    used_before = state.segments[seg].used
    disk.complete(tasks)
    assert tiers(state, "k0") == [(seg, TIER_SSD)]
    assert state.segments[seg].used == used_before  # not reusable while the reader may copy it
    assert_consistent(state)
    advance_alive(state, clock, LEASE_S)
    state.tick()
    assert state.segments[seg].used < used_before
    assert_consistent(state)


def test_allocation_eviction_drops_redundant_copies_before_lru_order(state):
    # given a full segment where k2 (not the LRU object) also has a disk copy
    seg = mount_ssd(state, "a", 4 * KiB)
    fill_past_watermark(state)  # k0..k3, 4 KiB of 4
    assert state.tiering.report_disk_objects(seg, [NS], ["k2"], [KiB], [7], [5]) == [OK]
    # when a put needs room before any tick ran
    put(state, "k4")
    # then k2 lost its DRAM copy (it stays readable from SSD) and k0, the LRU object, kept its own
    assert tiers(state, "k2") == [(seg, TIER_SSD)]
    assert tiers(state, "k0") == [(seg, TIER_DRAM)]
    assert stored(state) == {"k0", "k1", "k2", "k3", "k4"}
    assert_consistent(state)


def test_drain_migrates_dram_copies_and_disk_only_objects(state):
    # given a draining segment holding a DRAM+SSD object and an SSD-only object, and a target
    a = mount_ssd(state, "a", 4 * KiB)
    mount_ssd(state, "b", 4 * KiB, offload=False)
    put(state, "both", preferred_segment="a")
    assert state.tiering.report_disk_objects(a, [NS, NS], ["both", "disk"], [KiB, KiB], [7, 3], [1, 2]) == [OK, OK]
    assert state.drainer.drain("a", finish=False)[0] == OK
    # when the drainer asks for work
    status, batch = state.drainer.migrate_start("a", 10)
    # then it gets the DRAM copy of "both" (its disk copy goes with the segment) and, read from its
    # disk copy, "disk", which has no other
    assert status == OK
    moves = sorted((item.record.key, replica_tier(item.source)) for item in batch.items)
    assert moves == [("both", TIER_DRAM), ("disk", TIER_SSD)]
    assert_consistent(state)


def test_quota_eviction_never_takes_a_ranks_disk_only_objects(state):
    # given a rank whose oldest objects were offloaded to SSD (they hold no DRAM, no quota)
    seg = mount_ssd(state, "a", 8 * KiB)
    disk = FakeDisk(state, seg)
    assert state.register_instance("llm", 1, 1, 3 * KiB) == 3 * KiB
    for key in ("d0", "d1"):
        put(state, key, instance="llm")
    for i in range(6):
        put(state, f"x{i}")  # fill past the watermark with objects of nobody's quota
    state.tick()
    disk.complete(disk.poll())
    assert tiers(state, "d0") == [(seg, TIER_SSD)] and tiers(state, "d1") == [(seg, TIER_SSD)]
    # when the rank fills its quota and goes over it
    for key in ("q0", "q1", "q2", "q3"):
        put_waiting(state, disk, key, instance="llm")
    # then its own DRAM objects made room, and its disk-only objects are untouched
    assert {"d0", "d1", "q3"} <= stored(state)
    assert "q0" not in stored(state)
    assert_consistent(state)


def test_disk_only_objects_leave_the_eviction_order_and_come_back_when_promoted(state):
    # given an object offloaded to SSD
    seg, disk = offloaded_k0(state)
    name = state.record(NS, "k0").name
    # then it is not in the order the eviction scan walks (millions of them must not slow it)
    assert name in state._disk_only and name not in state._objects
    assert all(r.name != name for r in state._objects.values())
    # and a promotion puts it back, at the most recently used end
    read(state, "k0")
    read(state, "k0")
    disk.complete(disk.poll())
    assert name in state._objects and name not in state._disk_only
    assert next(reversed(state._objects)) == name
    assert_consistent(state)


def test_disk_copy_that_fails_verification_on_promotion_is_dropped_and_forgotten(state):
    seg, disk = offloaded_k0(state)
    location = replica_offset(state.record(NS, "k0").replicas[0])
    read(state, "k0")
    read(state, "k0")
    # when the segment finds the disk copy does not match the object's checksum
    assert disk.complete(disk.poll(), Status.CHECKSUM_MISMATCH) == [OK]
    # then that copy (here the only one) is gone, and the segment is told to tombstone it
    assert state.record(NS, "k0") is None
    disk.poll()
    assert disk.forgotten == [location]
    assert state.tiering.counters["corrupt_disk_copies"] == 1
    assert_consistent(state)


def test_above_the_offload_watermark_lru_objects_are_copied_ahead_and_keep_their_dram_copy(clock):
    # given a segment at 85% (above the offload watermark 0.80, at the eviction target 0.85), whose
    # offloads in flight are bounded by eviction_ratio alone (no offload_in_flight floor)
    state = make_state(clock, promote_after_reads=2, offload_in_flight="0")
    seg = mount_ssd(state, "a", 10 * KiB)
    disk = FakeDisk(state, seg)
    for i in range(17):
        put(state, f"k{i}", size=512)
    # when two ticks run, each completing what it queued (at most eviction_ratio = 512 B in flight)
    for _ in range(2):
        state.tick()
        tasks = disk.poll()
        assert [t.kind for t in tasks] == [TaskKind.OFFLOAD]
        disk.complete(tasks)
    # then the two least recently used objects are on SSD and still in DRAM; nothing was evicted
    assert tiers(state, "k0") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    assert tiers(state, "k1") == [(seg, TIER_DRAM), (seg, TIER_SSD)]
    assert tiers(state, "k2") == [(seg, TIER_DRAM)]
    assert stored(state) == {f"k{i}" for i in range(17)}
    assert "watermark" not in state.evictions and "allocation" not in state.evictions
    assert "offload" not in state.evictions, "a copy made ahead of need evicted nothing"
    assert_consistent(state)
    # and when a put needs room in a full segment, the copies already safe on SSD are what
    # leaves DRAM (k0 and k1 are adjacent: 1 KiB of room), and no object is lost
    put(state, "pad", size=1536)  # the free tail: 100% full now
    put(state, "big", size=KiB)
    assert {"big", "pad"} | {f"k{i}" for i in range(17)} == stored(state)
    assert tiers(state, "k0") == [(seg, TIER_SSD)] and tiers(state, "k1") == [(seg, TIER_SSD)]
    assert tiers(state, "k2") == [(seg, TIER_DRAM)]
    assert state.evictions["allocation"][0] == 2
    assert "offload" not in state.evictions, "each copy that left DRAM is counted once, by its reason"
    assert_consistent(state)


def test_below_the_offload_watermark_nothing_is_copied(state):
    seg = mount_ssd(state, "a", 10 * KiB)
    for i in range(15):
        put(state, f"k{i}", size=512)  # 75%
    state.tick()
    assert state.tiering.poll(seg, 10) == []


def test_a_removal_waits_for_the_forget_of_its_disk_copy_unless_the_segment_stalls(state):
    from kvtier.master.commit_wait import Barrier

    seg, disk = offloaded_k0(state)
    assert state.tiering.pending_forgets() == []
    assert state.remove(NS, ["k0"]) == [OK]
    barrier = Barrier(state.commits.barrier(), state.tiering.pending_forgets(), 0)
    assert [t.disk_location for t in barrier.forgets] == [1]
    assert not barrier.done(state), "answered before the segment tombstoned the disk copy"
    disk.poll(ack_forgets=False)
    assert not barrier.done(state), "handed out is not acknowledged"
    state.tiering.done(seg, [barrier.forgets[0].task_id], [int(OK)], [0])
    assert barrier.done(state) and state.tiering.pending_forgets() == []


def test_a_segment_that_does_not_acknowledge_forgets_is_not_waited_for_until_it_answers_again(state):
    from kvtier.master.commit_wait import Barrier

    seg, disk = offloaded_k0(state)
    assert state.remove(NS, ["k0"]) == [OK]
    stuck = Barrier({}, state.tiering.pending_forgets(), 0)
    assert stuck.forgets and not stuck.done(state)
    assert state.tiering.forgets_stalled(stuck.forgets)  # what a timed-out wait does
    assert state.tiering.pending_forgets() == []
    assert not stuck.done(state), "answered before the saved state holds the FORGET it owes"
    assert state.tiering.owed_forgets() == ({"a": [(1, object_name(NS, "k0"))]}, set())
    state.durable_generation = state.state_generation  # what the server's save does
    assert stuck.done(state)
    assert state.tiering.counters["forget_waits_timed_out"] == 1
    disk.poll(ack_forgets=False)
    state.tiering.done(seg, [], [], [])  # it answers again (any report)
    assert [t.disk_location for t in state.tiering.pending_forgets()] == [1], "waited for again"


@pytest.mark.parametrize("removed", [True, False])
def test_an_offload_never_reported_fences_its_key_only_if_it_changed_meanwhile(state, clock, removed):
    # given an offload handed out and never reported (the segment dies between its fdatasync and
    # TierTasksDone: the copy may be durable, the master does not know where). (Expired or not: an
    # expiry does not settle it. Expired, its object is dropped by the next watermark pass, which
    # counts as a change too: the master cannot tell an eviction from a removal afterwards.)
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    (task,) = disk.poll()
    # when its object is removed (or not) before the segment is dropped
    if removed:
        assert state.remove(NS, [task.name.split("\x00", 1)[1]]) == [OK]
    assert state.unmount_segment(seg) == OK
    # then a removed object's name is taken for the segment's fence (a returning copy is refused);
    # an untouched one may come back (its bytes are right)
    assert state.tiering.unsettled_offload_names("a") == ({task.name} if removed else set())
    assert state.tiering.unsettled_offload_names("a") == set(), "taken once"
    assert_consistent(state)


def test_a_reported_offload_is_settled_even_after_it_expired(state, clock):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    tasks = disk.poll()
    advance_alive(state, clock, state.config.put_timeout_s + 1)
    state.tick()
    assert disk.complete(tasks) == [Status.NOT_PENDING] * len(tasks)  # the segment withdraws the copies
    for task in tasks:  # (dropped already by the watermark pass after the expiry)
        state.remove(NS, [task.name.split("\x00", 1)[1]])
    assert state.unmount_segment(seg) == OK
    assert state.tiering.unsettled_offload_names("a") == set()
    assert state.tiering.failures["offload", "TIMEOUT"] == len(tasks)


def test_a_failed_forget_is_sent_again_after_a_pause_not_at_once(state, clock):
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    disk.complete(disk.poll())
    assert state.remove(NS, ["k0"]) == [OK]
    forgets = [t for t in state.tiering.poll(seg, 10) if t.kind is TaskKind.FORGET]
    assert len(forgets) == 1
    # when the segment cannot write the tombstone (its disk is full)
    ids = [forgets[0].task_id]
    assert state.tiering.done(seg, ids, [int(Status.NO_SPACE)], [0]) == [OK]
    assert state.tiering.failures["forget", "NO_SPACE"] == 1
    # then it is not handed out again at once (no loop between master and segment) ...
    state.tick()
    assert state.tiering.poll(seg, 10) == []
    # ... but after the pause, until acknowledged
    advance_alive(state, clock, 1.5)
    state.tick()
    again = state.tiering.poll(seg, 10)
    assert [t.disk_location for t in again] == [forgets[0].disk_location]
    assert state.tiering.done(seg, [again[0].task_id], [int(OK)], [0]) == [OK]
    assert state.tiering.pending_forgets() == []
    assert_consistent(state)


def test_a_failed_forget_is_owed_at_once_and_its_segment_not_waited_for_until_one_succeeds(state, clock):
    """A failing disk answers FORGETs at once, with a failure. The change waiting for one waited out its
    whole timeout, and the failure report (any report) made the segment waited for again, so every
    change stalled the same 3.4 s, again and again, while the disk stayed bad."""
    from kvtier.master.commit_wait import Barrier

    seg, disk = offloaded_k0(state)
    assert state.remove(NS, ["k0"]) == [OK]
    waiting = Barrier({}, state.tiering.pending_forgets(), 0)
    forgets = [t for t in state.tiering.poll(seg, 10) if t.kind is TaskKind.FORGET]
    assert state.tiering.done(seg, [forgets[0].task_id], [int(Status.NO_SPACE)], [0]) == [OK]
    # the failure is the answer: the FORGET is owed (saved), nothing waits for the segment now
    assert state.tiering.pending_forgets() == []
    assert state.tiering.owed_forgets()[0] == {"a": [(1, object_name(NS, "k0"))]}
    state.durable_generation = state.state_generation  # the server's save
    assert waiting.done(state)
    state.tiering.done(seg, [], [], [])  # a report with no FORGET proves nothing of the disk
    assert tiers(state, "k1") == [(seg, TIER_SSD)]  # a disk copy: its removal makes a FORGET
    read(state, "k1")
    assert state.remove(NS, ["k1"]) == [OK]
    assert state.tiering.pending_forgets() == [], "a segment whose FORGETs fail is not waited for"
    # until one succeeds (after the pause), and then it is waited for again
    advance_alive(state, clock, 1.5)
    state.tick()
    again = [t for t in state.tiering.poll(seg, 10) if t.kind is TaskKind.FORGET]
    ids = [t.task_id for t in again]
    assert state.tiering.done(seg, ids, [int(OK)] * len(ids), [0] * len(ids)) == [OK] * len(ids)
    assert state.tiering.counters["forget_failures"] == 1
    state.tiering.forget(seg, object_name(NS, "gone"), 99)  # the next FORGET there
    assert state.tiering.pending_forgets(), "one succeeded: its FORGETs are waited for again"


def test_a_repeated_offload_report_is_answered_alike_not_as_expired(state):
    # given an offload the segment reported, whose answer it lost (it retries the same report)
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    (task,) = disk.poll()
    assert state.tiering.done(seg, [task.task_id], [int(OK)], [42]) == [OK]
    # then the retry gets OK again (NOT_PENDING would make it withdraw the copy now registered) ...
    assert state.tiering.done(seg, [task.task_id], [int(OK)], [42]) == [OK]
    assert 42 in [replica_offset(r) for r in state.record(NS, "k0").replicas]
    # ... and a report that differs, or comes from another segment, is still refused
    assert state.tiering.done(seg, [task.task_id], [int(OK)], [43]) == [Status.NOT_PENDING]
    assert state.tiering.done(seg + 1, [task.task_id], [int(OK)], [42]) == [Status.NOT_PENDING]
    assert_consistent(state)


def test_forgets_no_answer_waits_for_are_owed_saved_and_given_to_the_next_incarnation(state, clock):
    """A segment whose tier worker stalled is not waited for: its FORGETs are owed (saved before the
    change is answered), and the next incarnation hands them out again and refuses those copies."""
    from kvtier.master.commit_wait import Barrier

    seg, disk = offloaded_k0(state)
    for i in (1, 2):  # two more disk copies
        state.tiering.report_disk_objects(seg, [NS], [f"d{i}"], [KiB], [7], [100 + i])
    assert state.remove(NS, ["k0"]) == [OK]
    state.tiering.forgets_stalled(state.tiering.pending_forgets())
    state.durable_generation = state.state_generation
    # when a later removal's FORGET goes to the stalled segment: owed at once, and its answer waits
    # for the save (a barrier made after the handler carries the generation)
    assert state.remove(NS, ["d1"]) == [OK]
    assert state.state_generation > state.durable_generation and state.saved_state_stale
    waits = Barrier({}, state.tiering.pending_forgets(), state.state_generation)
    assert not waits.done(state)
    owed, overflowed = state.tiering.owed_forgets()
    assert owed == {"a": [(1, object_name(NS, "k0")), (101, object_name(NS, "d1"))]} and not overflowed
    # then the next incarnation takes them: the segment's copies there are refused, the rest come back
    successor = make_state(clock, promote_after_reads=2)
    successor.tiering.restore_owed(owed)
    again = mount_ssd(successor, "a", 8 * KiB)
    statuses = successor.tiering.report_disk_objects(
        again, [NS] * 3, ["k0", "d1", "d2"], [KiB] * 3, [7] * 3, [1, 101, 102]
    )
    assert statuses == [Status.CHECKSUM_MISMATCH, Status.CHECKSUM_MISMATCH, OK]
    handed = successor.tiering.poll(again, 10)
    assert sorted(t.disk_location for t in handed if t.kind is TaskKind.FORGET) == [1, 101]
    # and once acknowledged, no longer saved
    successor.saved_state_stale = False
    successor.tiering.done(again, [t.task_id for t in handed], [int(OK)] * len(handed), [0] * len(handed))
    assert successor.tiering.owed_forgets() == ({}, set()) and successor.saved_state_stale
    assert_consistent(successor)


@pytest.mark.parametrize("char", ["x", "\x00", "\u6f22", "\U0001f600"])  # JSON: 1, 6, 6, 12 bytes
def test_owed_forgets_past_the_bound_save_their_segment_as_expelled(state, char):
    from kvtier.master.persist import SavedState

    seg = mount_ssd(state, "a", 4 * KiB)
    few = mount_ssd(state, "b", 4 * KiB)
    assert not state.tiering.forgets_stalled([])  # an empty wait stalls nothing
    assert state.tiering.owed_forgets() == ({}, set())
    state.unmount_segment(seg)
    state.unmount_segment(few)
    long_name = char * 200  # names count as JSON writes them: the saved state has a size limit (etcd's)
    pairs = [(100_000, long_name + "100000"), (100_001, long_name + "100001")]
    entry = len(SavedState(owed_forgets={"a": pairs}).to_json()) - len(
        SavedState(owed_forgets={"a": pairs[:1]}).to_json()
    )
    fits = OWED_SAVED_MAX_BYTES // entry - 20
    for location in range(1, fits + 1):  # FORGETs for segments that are away: owed
        state.tiering.forget(seg, f"{long_name}{location}", location)
    owed, overflowed = state.tiering.owed_forgets()
    assert not overflowed and 0.9 * OWED_SAVED_MAX_BYTES < len(SavedState(owed_forgets=owed).to_json())
    added = fits
    while not state.tiering.owed_forgets()[1] and added < fits * 1.2:
        for location in range(added + 1, added + 21):
            state.tiering.forget(seg, f"{long_name}{location}", location)
        added += 20
    assert state.tiering.owed_forgets() == ({}, {"a"})
    state.tiering.forget(few, "m", 1)
    assert state.tiering.owed_forgets() == ({"b": [(1, "m")]}, {"a"})


def test_a_forget_that_supersedes_an_owed_one_at_its_location_ends_it(state):
    seg = mount_ssd(state, "a", 4 * KiB)
    state.unmount_segment(seg)
    state.tiering.forget(seg, "old", 1)  # away: owed
    seg = mount_ssd(state, "a", 4 * KiB)
    state.tiering.forget(seg, "new", 1)  # another object's record there now, waited for: not owed
    assert state.tiering.owed_forgets() == ({}, set())
    state.tiering.forget(seg, "new", 1)  # the same copy again: takes its predecessor's place
    assert state.tiering.owed_forgets() == ({}, set())
    state.unmount_segment(seg)
    state.tiering.forget(seg, "new", 1)
    assert state.tiering.owed_forgets() == ({"a": [(1, "new")]}, set())
    seg = mount_ssd(state, "a", 4 * KiB)
    state.tiering.forget(seg, "new", 1)  # owed stays owed (its answer was given without it)
    assert state.tiering.owed_forgets() == ({"a": [(1, "new")]}, set())


def test_a_restored_owed_forget_refuses_only_the_object_it_names(state):
    """A copy of another object at an owed location is that location's next life: registered, and the
    FORGET is moot (not handed out, not saved again)."""
    state.tiering.restore_owed({"a": [(1, object_name(NS, "gone")), (2, object_name(NS, "removed"))]})
    seg = mount_ssd(state, "a", 4 * KiB)
    statuses = state.tiering.report_disk_objects(seg, [NS, NS], ["new", "removed"], [KiB, KiB], [7, 7], [1, 2])
    assert statuses == [OK, Status.CHECKSUM_MISMATCH]
    assert tiers(state, "new") == [(seg, TIER_SSD)]
    assert state.tiering.owed_forgets() == ({"a": [(2, object_name(NS, "removed"))]}, set())
    assert [t.disk_location for t in state.tiering.poll(seg, 10) if t.kind is TaskKind.FORGET] == [2]


def test_an_offload_reported_where_a_forget_is_owed_ends_that_forget(state):
    """The segment wrote a new record at that location: the old one is gone (its bucket deleted and its
    id taken again after a restart). The FORGET is not handed out, and the saved state lists it no more."""
    seg = mount_ssd(state, "a", 4 * KiB)
    disk = FakeDisk(state, seg)
    fill_past_watermark(state)
    state.tick()
    offloads = disk.poll()
    state.tiering.forget(seg, object_name(NS, "old"), 1)  # a FORGET of the location's previous life
    assert state.tiering.forgets_stalled(state.tiering.pending_forgets())  # and owed
    assert state.tiering.owed_forgets() == ({"a": [(1, object_name(NS, "old"))]}, set())
    state.saved_state_stale = False
    disk.complete(offloads)  # the first written at location 1
    assert state.tiering.owed_forgets() == ({}, set()) and state.saved_state_stale
    assert [t for t in state.tiering.poll(seg, 100) if t.kind is TaskKind.FORGET] == []
    assert_consistent(state)


def test_forgets_of_a_segment_that_leaves_are_owed(state):
    """A prefix removal's barrier is made after its sweep: a segment that left meanwhile is in no
    barrier, and its FORGETs would be in no save either."""
    seg, disk = offloaded_k0(state)
    assert state.remove_prefix(NS, "k0") == 1
    assert [t.disk_location for t in state.tiering.pending_forgets()] == [1]
    state.unmount_segment(seg)
    assert state.tiering.owed_forgets() == ({"a": [(1, object_name(NS, "k0"))]}, set())
    assert state.state_generation > state.durable_generation


def test_a_drain_waits_for_a_promotion_into_the_draining_segment(state):
    """A disk-only object being promoted into the draining segment's DRAM was skipped by the walk and
    the drain finished past it, dropping it with the segment. The walk says it is waiting; the
    promoted DRAM copy moves in the next batch."""
    seg, disk = offloaded_k0(state)
    mount_ssd(state, "b", 64 * KiB, offload=False)
    read(state, "k0")
    read(state, "k0")
    [task] = disk.poll()
    assert task.kind is TaskKind.PROMOTE
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 256)
    assert "k0" not in [item.record.key for item in batch.items]
    assert not batch.more and batch.waiting
    state.drainer.migrate_end(batch.migration_id, {})  # nothing reported moved: every target released
    assert disk.complete([task]) == [OK]
    status, batch = state.drainer.migrate_start("a", 256)
    assert "k0" in [item.record.key for item in batch.items] and not batch.waiting
    assert_consistent(state)


def test_a_copy_on_a_silent_holder_does_not_keep_a_drain_from_moving_the_disk_only_one(state, clock):
    """The draining segment's disk copy of an object whose other copy is on a segment that stopped
    heartbeating (SIGKILLed, still mounted until its TTL): moved, not left to go with the segment."""
    a = mount_ssd(state, "a", 4 * KiB)
    mount_ssd(state, "holder", 4 * KiB, offload=False)
    put(state, "k", preferred_segment="holder")
    assert state.tiering.report_disk_objects(a, [NS], ["k"], [KiB], [7], [1]) == [OK]
    assert state.drainer.drain("a", finish=False)[0] == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert status == OK and batch.items == [] and not batch.waiting  # the holder keeps it
    target = mount_ssd(state, "target", 4 * KiB, offload=False)
    clock.advance(state.config.segment_suspect_s + 0.1)  # every segment but the holder heartbeats
    for segment_id in (a, target):
        assert state.heartbeat(segment_id) == OK
    status, batch = state.drainer.migrate_start("a", 10)
    assert [(item.record.key, replica_tier(item.source)) for item in batch.items] == [("k", TIER_SSD)]
    assert batch.items[0].target is not None
    assert_consistent(state)
