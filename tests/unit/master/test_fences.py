"""Fences (master/fences.py) and the PutEnd acknowledgement check (master/commits.py), without sockets."""

from __future__ import annotations

from kvtier.master.commits import PutAcknowledgement
from kvtier.master.fences import Fences
from kvtier.master.recovery import inventory_done
from kvtier.proto.status import Status
from tests.unit.master.test_recovery import NS, MiB, mount, new_state
from tests.unit.master.test_state import FakeClock


def test_a_fence_refuses_its_seed_and_every_change_while_open_and_nothing_else():
    fences = Fences(max_keys=100)
    assert not fences.recording
    fence = fences.open("s0", {"unacked"})
    fences.touch("reput")
    fences.touch_prefix("gone/")
    assert not fence.admits("unacked") and not fence.admits("reput") and not fence.admits("gone/x")
    assert fence.admits("untouched")
    fences.close("s0")
    assert fences.get("s0") is None and not fences.recording
    fences.touch("later")  # no fence open: nothing recorded
    assert fences._total == 0


def test_fences_are_bounded_in_names_and_count_and_the_oldest_gives_up_first():
    fences = Fences(max_keys=5, max_fences=2)
    old = fences.open("old", {"a", "b"})
    new = fences.open("new", set())
    for name in ("c", "d"):
        fences.touch(name)
    assert old.everything and not old.admits("x"), "7 names over a budget of 5: the oldest fence gives up"
    assert not new.everything and not new.admits("c") and new.admits("a")
    third = fences.open("third", set())
    assert fences.get("old") is None, "past max_fences the oldest is forgotten (its name stays expelled)"
    assert fences.get("new") is new and fences.get("third") is third


def test_a_put_end_whose_segment_was_lost_during_its_wait_is_not_acknowledged():
    clock = FakeClock()
    state = new_state(clock)
    a, b = mount(state, "a", MiB, inventory=True), mount(state, "b", MiB, inventory=True)
    inventory_done(state, a)
    inventory_done(state, b)
    started = state.put_start(NS, ["k1", "k2"], [100, 100], 1)
    ack = PutAcknowledgement()
    statuses = state.put_end(NS, ["k1", "k2"], [1, 2], started.put_id, ack.committed)
    assert ack.settle(state.segments, list(statuses)) == 0, "nothing lost: OK stays OK"
    lost_segment = started.replica_segments[0]
    state.unmount_segment(lost_segment)  # as an expulsion does during the wait
    answer = list(statuses)
    assert ack.settle(state.segments, answer) == sum(1 for s in started.replica_segments if s == lost_segment)
    for key, segment_id, status in zip(["k1", "k2"], started.replica_segments, answer, strict=True):
        assert status == (Status.SEGMENT_NOT_FOUND if segment_id == lost_segment else Status.OK), key
    assert {a, b} >= set(started.replica_segments)
