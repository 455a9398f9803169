"""`kvtier drain`'s loop (kvtier.cli.drain) against the master's Drainer in process: when it may stop.

The master's calls are routed to a real `MasterState` (its Drainer, its tables); only the data
plane's copy is played (every object with a target copies), and time is a fake clock."""

from __future__ import annotations

import pytest

from kvtier.cli import drain as cli_drain
from kvtier.master.records import TIER_SSD, replica_tier
from kvtier.master.state_types import SegmentState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import KvtierError
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent, segment_indexes
from tests.unit.master.test_eviction import NS, KiB, make_state, put
from tests.unit.master.test_state import FakeClock
from tests.unit.master.test_tiering import mount_ssd

OK = Status.OK


@pytest.fixture
def state():
    state = make_state(FakeClock())
    for name in ("a", "b", "c"):
        mount_ssd(state, name, 16 * KiB, offload=False)
    return state


def seg(state, name: str) -> int:
    return state.segment_named(name).segment_id


class InProcessMaster:
    """The drain's three calls, answered by `state.drainer` as the master's handlers would."""

    def __init__(self, state) -> None:
        self.state = state
        self.starts: list[list[str]] = []

    def call(self, method: str, request):
        reply = self._answer(method, request)
        if reply.status != OK:  # as the client's MasterClient.call
            raise KvtierError(Status(reply.status), f"{method}: {reply.error}")
        return reply

    def _answer(self, method: str, request):
        drainer = self.state.drainer
        if method == "DrainSegment":
            status, left, _, name, disk = drainer.drain(
                request.segment, request.finish, request.if_draining, request.status_only
            )
            return pb.DrainSegmentResponse(
                status=status,
                objects_left=left,
                state=name,
                ssd_objects_left=disk,
                incarnation=drainer.incarnation_of(request.segment),
            )
        if method == "MigrateStart":
            status, batch = drainer.migrate_start(request.segment, request.max_objects)
            if batch is None:
                return pb.MigrateStartResponse(status=status)
            reply = pb.MigrateStartResponse(status=status, migration_id=batch.migration_id)
            reply.more, reply.waiting = batch.more, batch.waiting
            for item in batch.items:
                reply.namespaces.append(item.record.namespace)
                reply.keys.append(item.record.key)
                reply.sizes.append(item.record.size)
                reply.statuses.append(OK if item.target is not None else Status.NO_SPACE)
            self.starts.append(list(reply.keys))
            return reply
        if method == "MigrateEnd":
            moved = dict(zip(zip(request.namespaces, request.keys, strict=True), request.moved, strict=True))
            status, statuses, _ = drainer.migrate_end(request.migration_id, moved)
            segment_indexes(self.state)  # the targets acknowledge
            return pb.KeyStatusResponse(status=status, statuses=statuses)
        raise AssertionError(method)


class ExpelledAfterABatch(InProcessMaster):
    """The drained segment is expelled once a batch of it was reported, and never mounts again."""

    def __init__(self, state, segment: str) -> None:
        super().__init__(state)
        self.segment = segment

    def _answer(self, method: str, request):
        reply = super()._answer(method, request)
        if method == "MigrateEnd" and self.state.segment_named(self.segment) is not None:
            self.state.drop_segment(seg(self.state, self.segment), reason="heartbeat_expired")
        return reply


class Client:
    def __init__(self, master: InProcessMaster) -> None:
        self._master = master


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(cli_drain, "time", fake)
    # the data plane: every object that got a target copies
    monkeypatch.setattr(cli_drain, "copy_batch", lambda client, start: [int(s) for s in start.statuses])
    return fake


def test_disk_only_objects_without_room_are_tried_again_until_the_stall_timeout(state, clock):
    """The empty call that ends a walk said nothing of the objects the walk handed out before it: the
    drain stopped there, after one try of two disk-only objects that found no room, not after
    --stall-timeout (objects of other segments after them in name order end such walks)."""
    a = seg(state, "a")
    assert state.tiering.report_disk_objects(a, [NS, NS], ["d0", "d1"], [32 * KiB] * 2, [7, 7], [1, 2]) == [OK, OK]
    for i in range(3):
        put(state, f"z{i}", preferred_segment="b")
    master = InProcessMaster(state)
    report = cli_drain.drain_segment(Client(master), "a", batch=2, stall_timeout=30.0, timeout=600)
    assert report.state == "DRAINED"
    assert report.no_space == 2 and report.dropped_ssd == 2, "two objects, however often they were tried"
    assert clock.now >= 30.0 and master.starts.count(["d0", "d1"]) > 2


def test_a_drain_ending_a_walk_another_drain_took_objects_in_is_told_to_wait(state):
    """Two drains share the segment's walk: the second's call that ended it found nothing and said
    nothing waited, so it finished the segment under the first one's batch (both objects lost)."""
    a = seg(state, "a")
    assert state.tiering.report_disk_objects(a, [NS, NS], ["d0", "d1"], [KiB] * 2, [7, 7], [1, 2]) == [OK, OK]
    for i in range(3):
        put(state, f"z{i}", preferred_segment="b")
    drainer = state.drainer
    assert drainer.drain("a", finish=False)[0] == OK
    _, first = drainer.migrate_start("a", 2)
    assert [item.record.key for item in first.items] == ["d0", "d1"]
    _, second = drainer.migrate_start("a", 2)
    assert second.items == [] and not second.more and second.waiting
    assert drainer.migrate_end(first.migration_id, {(NS, "d0"): True, (NS, "d1"): True})[1] == [OK, OK]
    segment_indexes(state)
    _, third = drainer.migrate_start("a", 2)
    assert third.items == [] and not third.waiting
    assert state.get_replicas(NS, ["d0", "d1"]).statuses == [OK, OK]
    assert_consistent(state)


def test_a_disk_copy_whose_other_copies_drain_too_or_went_is_moved(state):
    """A disk copy counted as 'held elsewhere' if any other replica existed: on a segment draining
    too (each drain left it to the other), or on a dropped segment not swept yet. Both lost it."""
    a, b = seg(state, "a"), seg(state, "b")
    assert state.tiering.report_disk_objects(a, [NS], ["x"], [KiB], [7], [1]) == [OK]
    assert state.tiering.report_disk_objects(b, [NS], ["x"], [KiB], [7], [1]) == [OK]
    put(state, "y", preferred_segment="b")
    assert state.tiering.report_disk_objects(a, [NS], ["y"], [KiB], [7], [2]) == [OK]
    assert state.drainer.drain("b", finish=False)[0] == OK
    assert state.drainer.drain("a", finish=False)[0] == OK
    _, batch = state.drainer.migrate_start("a", 10)
    taken = {item.record.key: replica_tier(item.source) for item in batch.items}
    assert taken == {"x": TIER_SSD, "y": TIER_SSD}, "b drains too: its copies do not outlive a's drain"
    state.drainer.migrate_end(batch.migration_id, {})

    state.sweep_inline = False  # as the server runs: a dropped segment's copies are swept in slices
    state.drop_segment(b, reason="heartbeat expired")
    _, batch = state.drainer.migrate_start("a", 10)
    assert {item.record.key for item in batch.items} == {"x", "y"}, "b is gone, its copies with it"


def test_giving_up_waits_for_the_end_of_a_walk_so_objects_after_the_full_ones_still_move(state, clock):
    """Every batch that moved nothing slept and checked the stall timeout, mid-walk: objects without
    room that sorted first used up --stall-timeout before the walk reached objects that fit (all 50 of
    them lost in the tester's run). The timeout is checked only where a walk ends."""
    a = seg(state, "a")
    big = [f"a/{i}" for i in range(6)]  # no room anywhere (32 KiB each; the others hold 16 KiB)
    assert state.tiering.report_disk_objects(a, [NS] * 6, big, [32 * KiB] * 6, [7] * 6, list(range(1, 7))) == [OK] * 6
    small = [f"b/{i}" for i in range(4)]
    for key in small:
        put(state, key, size=64, preferred_segment="a")
    report = cli_drain.drain_segment(Client(InProcessMaster(state)), "a", batch=1, stall_timeout=1.0, timeout=600)
    assert report.moved == len(small) and report.no_space == len(big)
    assert state.get_replicas(NS, small).statuses == [OK] * len(small)
    assert clock.now >= 1.0, "the objects without room were tried again until the stall timeout"


def test_an_object_every_other_segment_holds_already_is_no_work_for_a_drain(state, clock):
    """A replicated object with a copy on every segment a copy could go to got no target, was counted
    `no_space` and held the drain for --stall-timeout, though it loses nothing with the segment."""
    put(state, "r", replicas=3)
    report = cli_drain.drain_segment(Client(InProcessMaster(state)), "a", batch=4, stall_timeout=30.0, timeout=600)
    assert (report.moved, report.no_space, report.dropped) == (0, 0, 1)
    assert clock.now < 1.0
    assert state.get_replicas(NS, ["r"]).statuses == [OK]


def test_a_segment_expelled_mid_drain_mounts_again_draining_and_the_drain_goes_on(state, clock):
    """The drained segment is expelled between two batches (a blip, a stall past its TTL) and mounts
    again at once. It used to come back ACTIVE, take new puts, and the drain's next call (segment not
    found) went straight to the finish, which dropped it with every object no walk had seen: now it
    mounts DRAINING, takes no new object, and the drain walks it again before it finishes."""
    for i in range(4):
        put(state, f"k{i}", preferred_segment="a")

    class Blip(InProcessMaster):
        blipped = False

        def _answer(self, method, request):
            reply = super()._answer(method, request)
            if method == "MigrateEnd" and not self.blipped:
                self.blipped = True
                state.drop_segment(seg(state, "a"), reason="heartbeat_expired")  # the next call misses it
            elif method == "MigrateStart" and reply.status == Status.SEGMENT_NOT_FOUND:
                mount_ssd(state, "a", 16 * KiB, offload=False)  # its process mounts again right after
                put(state, "late", preferred_segment="a")  # lands elsewhere while a is DRAINING
            return reply

    master = Blip(state)
    report = cli_drain.drain_segment(Client(master), "a", batch=2, stall_timeout=30.0, timeout=600)
    assert master.blipped and report.state == "DRAINED" and report.dropped == 0, report
    assert state.segment_named("a") is None
    assert state.get_replicas(NS, ["late"]).statuses == [OK], "a put on the returning segment was dropped"
    assert_consistent(state)


def test_finishing_a_drain_of_a_segment_that_mounted_again_active_is_refused(state):
    """A master restart forgets a drain: the segment mounts ACTIVE and takes new objects. A finish
    from the drain that began before must not drop them."""
    drainer = state.drainer
    assert drainer.drain("a", finish=False)[0] == OK
    drainer.draining.clear()  # what a master restart forgets
    state.drop_segment(seg(state, "a"), reason="heartbeat_expired")
    mount_ssd(state, "a", 16 * KiB, offload=False)
    put(state, "new", preferred_segment="a")
    status, left, _, name, _ = drainer.drain("a", finish=True, if_draining=True)
    assert status == Status.INVALID_ARGUMENT and name == "ACTIVE" and left == 1
    assert state.get_replicas(NS, ["new"]).statuses == [OK]


def test_a_drain_whose_segment_never_comes_back_fails_and_leaves_no_intent_behind(state, clock):
    """The segment is expelled mid-drain and never mounts again: the drain waits (AWAY) until its timeout,
    then fails naming the segment; a replacement under the name is not DRAINING."""
    for i in range(4):
        put(state, f"k{i}", preferred_segment="a")

    with pytest.raises(KvtierError) as failure:
        cli_drain.drain_segment(Client(ExpelledAfterABatch(state, "a")), "a", batch=2, stall_timeout=30.0, timeout=20)
    assert failure.value.status == Status.SEGMENT_NOT_FOUND and clock.now >= 20
    assert "a" not in state.drainer.draining
    mount_ssd(state, "a", 16 * KiB, offload=False)  # a replacement under the name
    assert state.segment_named("a").state.name == "ACTIVE"


def _mount(state, name: str, incarnation: str):
    result = state.mount_segment(
        "unit", name, f"host-{name}", [f"tcp://127.0.0.1:9/{name}"], 16 * KiB,
        incarnation=incarnation, ssd_capacity=1 << 30, offload=False,
    )  # fmt: skip
    assert result.status == OK, result.error
    return result


def test_an_earlier_drain_of_the_name_is_not_this_drains_end(state, clock):
    """Drain-on-stop drains a name at every restart: with an earlier process of the name drained, this
    drain's segment expelled mid-drain was answered DRAINED (by name), and the drain reported success,
    dropped 0, two objects never moved; the process then mounted again DRAINING for good (review)."""
    _mount(state, "d", "nonce-1")
    assert state.drainer.drain("d", finish=True)[3] == "DRAINED"
    _mount(state, "d", "nonce-2")
    for i in range(4):
        put(state, f"k{i}", preferred_segment="d")

    with pytest.raises(KvtierError) as failure:
        cli_drain.drain_segment(Client(ExpelledAfterABatch(state, "d")), "d", batch=2, stall_timeout=30.0, timeout=20)
    assert failure.value.status == Status.SEGMENT_NOT_FOUND  # waited for it (AWAY), then the finish failed
    assert "d" not in state.drainer.draining
    assert _mount(state, "d", "nonce-2").segment is not None and state.segment_named("d").state.name == "ACTIVE"


def test_a_cancel_during_a_running_drain_stops_it_and_the_segment_stays(state, clock):
    """The drain's progress call marked the segment DRAINING again: a cancel answered ACTIVE, and the
    drain then finished the segment anyway (review)."""
    for i in range(4):
        put(state, f"k{i}", preferred_segment="a")

    class Cancel(InProcessMaster):
        cancelled = None

        def _answer(self, method, request):
            if method == "MigrateEnd" and self.cancelled is None:
                self.cancelled = self.state.drainer.cancel("a")
            return super()._answer(method, request)

    master = Cancel(state)
    with pytest.raises(KvtierError) as failure:
        cli_drain.drain_segment(Client(master), "a", batch=2, stall_timeout=30.0, timeout=600)
    assert failure.value.status == Status.INVALID_ARGUMENT  # MigrateStart: the segment is not draining
    assert master.cancelled[3] == "ACTIVE"
    assert state.segment_named("a") is not None and state.segment_named("a").state.name == "ACTIVE"


def test_time_away_is_no_stall(state, clock):
    """Away longer than --stall-timeout, back with objects that find no room at first: the drain gave
    up at its first walk after the return (the time away counted as a stall) (review)."""
    for i in range(4):
        put(state, f"k{i}", preferred_segment="a")
    times: dict[str, float] = {}

    class Away(InProcessMaster):
        def _answer(self, method, request):
            if method == "MigrateStart" and "away" not in times:
                times["away"] = clock.now
                state.drop_segment(seg(state, "a"), reason="heartbeat_expired")
                for other in ("b", "c"):  # no room anywhere (for the rest of the test)
                    state.segment_named(other).state = SegmentState.DRAINING
            elif method == "DrainSegment" and "away" in times and "back" not in times and clock.now >= 40:
                times["back"] = clock.now
                mount_ssd(state, "a", 16 * KiB, offload=False)  # the same process mounts again: DRAINING
                a = state.segment_named("a")
                a.state = SegmentState.ACTIVE  # (its objects, played as puts)
                for i in range(4):
                    put(state, f"r{i}", preferred_segment="a")
                a.state = SegmentState.DRAINING
            return super()._answer(method, request)

    report = cli_drain.drain_segment(Client(Away(state)), "a", batch=2, stall_timeout=30.0, timeout=600)
    assert report.no_space == 4 and report.state == "DRAINED"
    assert clock.now - times["back"] >= 30.0, "gave up before --stall-timeout after the segment came back"
