"""Fences (master/fences.py) and the PutEnd acknowledgement check (master/commits.py), without sockets."""

from __future__ import annotations

from kvtier.master.commits import PutAcknowledgement
from kvtier.master.fences import Fences
from kvtier.master.records import replica_segment
from kvtier.master.recovery import inventory_done, report_dram_objects
from kvtier.proto.status import Status
from tests.unit.master.test_recovery import NS, OK, MiB, chunk, mount, new_state
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


def test_a_fence_releases_seeded_names_the_returning_segment_applied_and_nothing_else():
    fences = Fences(max_keys=100)
    fences.open("s0", {"forget", "both"}, {"a": 3, "b": 5, "touched": 2, "both": 1}, segment_id=7)
    fences.touch("touched")  # changed while away: fenced for good
    fences.open("s0", set(), {"again": 2, "a": 1}, segment_id=8)  # a second drop, another mount
    fence = fences.get("s0")
    assert fences.release("s0", 9, 100) == 0, "another mount's numbers prove nothing"
    assert fences.release("s0", 7, 4) == 0
    assert fence.admits("x") and not fence.admits("a"), "'a' was seeded again by mount 8: fenced for good"
    assert not fence.admits("b"), "b's last notice (5) is past what the index applied (4)"
    assert fences.release("s0", 7, 5) == 1 and fence.admits("b")
    assert not any(map(fence.admits, ("forget", "both", "touched", "again", "a")))
    assert fences.release("s0", 8, 2) == 1 and fence.admits("again") and not fence.admits("a")
    assert fences.released == 2 and fences._total == len(fence.names) == 4


def test_seeded_names_stay_within_the_bound_and_an_overflow_forgets_them():
    fences = Fences(max_keys=4)
    fence = fences.open("s0", set(), {"a": 1, "b": 2, "c": 3}, segment_id=1)
    assert fences._total == 3 and set(fence.seeded) <= fence.names
    assert fences.release("s0", 1, 2) == 2 and fences._total == 1
    for name in ("d", "e", "f", "g"):
        fences.touch(name)
    assert fence.everything and fence.seeded == {} and fences.release("s0", 1, 99) == 0
    assert fences._total == 0 and not fence.admits("a")


def test_a_returning_segment_gets_back_what_its_index_applied_but_never_acknowledged():
    """The master's books (MasterState): puts and removals on a whose notices a never acknowledged (a
    relayed put's client heard OK from a, which applied them from the relay's answer), a dropped, then
    a mounts again saying how far its index got under the dropped mount. A name whose notices name a
    version no longer the key's is fenced unless the index applied them all; a name whose notices are
    all about the current version is not fenced at all (test below); a touch while away fences."""
    clock = FakeClock()
    state = new_state(clock)
    a = mount(state, "a", MiB, inventory=True)
    inventory_done(state, a)

    def put(key: str, checksum: int) -> None:
        started = state.put_start(NS, [key], [100], 1)
        state.put_end(NS, [key], [checksum], started.put_id)

    put("k6", 60)  # notice 1
    state.remove(NS, ["k6"])  # 2: a drop of a version that is gone
    put("k6", 66)  # 3
    for key, checksum in (("k1", 1), ("k2", 2), ("k3", 3)):  # notices 4, 5, 6 on a
        put(key, checksum)
    state.remove(NS, ["k3"])  # notice 7: k3's drop
    put("k4", 4)  # notice 8
    assert state.commits.unacked_seqs(a) == {
        f"{NS}\x00{k}": seq for k, seq in (("k6", 3), ("k1", 4), ("k2", 5), ("k3", 7), ("k4", 8))
    }
    assert state.commits.unacked_seqs(a, state.visible) == {f"{NS}\x00k6": 3, f"{NS}\x00k3": 7}
    state.unmount_segment(a)  # as an expulsion
    b = mount(state, "b", MiB, inventory=True)
    inventory_done(state, b)
    put("k2", 22)  # touched while a was away (on b)
    again = state.mount_segment(
        "unit", "a", "host-a", ["tcp://127.0.0.1:9"], MiB, inventory=True, previous_segment_id=a, previous_applied_seq=3
    )
    assert not again.discard_index and state.fences.released == 1  # k6: its index applied 1-3
    statuses = report_dram_objects(
        state,
        again.segment.segment_id,
        chunk(
            [
                ("k1", 100, 1, 0),
                ("k2", 100, 2, 4096),
                ("k3", 100, 3, 8192),
                ("k4", 100, 4, 12288),
                ("k5", 64, 5, 16384),
                ("k6", 100, 66, 20480),
            ]
        ),
    )
    refused = Status.CHECKSUM_MISMATCH
    assert statuses == [OK, refused, refused, OK, OK, OK], (
        "k1 and k4 never fenced (their notices are about the version that was the key's); k2 put again "
        "meanwhile; k3's drop (7) past the applied 3; k5 never fenced; k6 released: its index applied 1-3"
    )
    assert state.record(NS, "k1") is not None and state.record(NS, "k2").checksum == 22
    assert state.record(NS, "k6").checksum == 66


def test_notices_that_leave_the_key_as_it_was_do_not_fence_it():
    """A segment killed right after a put, an offload's drop of the DRAM copy, or a promotion (their
    notices unacknowledged) returns as a new process with the objects' verified disk copies. Those
    notices changed no key: the version they name is still the key's when the segment is dropped, so
    nothing it brings back of that version can be stale. Only a name whose unacknowledged notice
    names a version no longer the key's (removed, replaced, evicted) is fenced."""
    clock = FakeClock()
    state = new_state(clock)
    a = mount(state, "a", MiB, inventory=True)
    inventory_done(state, a)
    for key, checksum in (("kept", 1), ("removed", 2), ("replaced", 3)):
        started = state.put_start(NS, [key], [100], 1)
        state.put_end(NS, [key], [checksum], started.put_id)
    state.remove(NS, ["removed"])
    state.remove(NS, ["replaced"])
    started = state.put_start(NS, ["replaced"], [100], 1)
    state.put_end(NS, ["replaced"], [33], started.put_id)
    state.unmount_segment(a)  # as an expulsion, or a new process under the name
    fence = state.fences.get("a")
    assert fence is not None
    assert fence.admits(f"{NS}\x00kept")
    assert not fence.admits(f"{NS}\x00removed") and not fence.admits(f"{NS}\x00replaced")


def test_a_segment_dropped_while_a_prefix_removal_sweeps_opens_its_fence_and_the_tick_goes_on():
    """Seeding the fence looked keys up with `visible`, which settles records a RemovePrefix sweep
    will take, adding drop notices to the feed being read: the drop failed half way and every later
    tick failed with it (review of the seeding change)."""
    clock = FakeClock()
    state = new_state(clock)
    a = mount(state, "a", MiB, inventory=True)
    inventory_done(state, a)
    for i in range(40):
        started = state.put_start(NS, [f"p/{i}"], [100], 1)
        state.put_end(NS, [f"p/{i}"], [i + 1], started.put_id)  # a never acknowledges them
    state.sweep_inline = False  # as the server runs it: in slices
    state.start_remove_prefix(NS, "p/")
    assert state.sweeps.active
    clock.advance(1000.0)  # a silent past segment_ttl_s: the tick expels it
    state.tick()
    assert a not in state.segments and state.fences.get("a") is not None
    while state.sweep(1 << 20):
        pass
    assert all(not state.fences.get("a").admits(f"{NS}\x00p/{i}") for i in range(40)), "removed while away"
    clock.advance(1.0)
    state.tick()


def test_a_put_still_waiting_when_its_segment_is_dropped_is_fenced_at_once():
    """Its writer will be told SEGMENT_NOT_FOUND once the wait ends (after the expulsion's save and
    the direct-read fence); the fence was touched only then, so a segment that mounted again and
    proved its index applied the commit inside that window brought the version back (review)."""
    clock = FakeClock()
    state = new_state(clock)
    a = mount(state, "a", MiB, inventory=True)
    inventory_done(state, a)
    acks = {}
    for key, checksum in (("waiting", 5), ("answered", 6)):
        started = state.put_start(NS, [key], [100], 1)
        acks[key] = PutAcknowledgement()
        state.commits.waiting_puts.add(acks[key])
        assert state.put_end(NS, [key], [checksum], started.put_id, acks[key].committed) == [OK]
    state.commits.waiting_puts.discard(acks["answered"])  # what settling its answer does
    offsets = {k: acks[k].committed[0][2][0] & ((1 << 40) - 1) for k in acks}
    state.unmount_segment(a)  # as an expulsion during the wait
    again = state.mount_segment(
        "unit", "a", "host-a", ["tcp://127.0.0.1:9"], MiB, inventory=True, previous_segment_id=a, previous_applied_seq=9
    )
    statuses = report_dram_objects(
        state,
        again.segment.segment_id,
        chunk([("waiting", 100, 5, offsets["waiting"]), ("answered", 100, 6, offsets["answered"])]),
    )
    assert statuses == [Status.CHECKSUM_MISMATCH, OK], "the waiting put is fenced; the answered one comes back"


def test_a_returning_segments_copy_of_a_group_member_takes_its_place_in_the_group_again():
    """A blip expels a segment holding one member of a group: the member leaves with it and the group
    reads as a miss. When the segment mounts again its copy, admitted by the fence and reported under
    the group's id, joins the group its other members kept (docs/architecture.md, "Groups")."""
    state = new_state(FakeClock())
    a = mount(state, "a", 1024, inventory=True)
    b = mount(state, "b", 1024, inventory=True)
    inventory_done(state, a)
    inventory_done(state, b)
    started = state.put_start(NS, ["x", "y"], [1000, 1000], 1)  # 1000 B each: one per segment
    assert state.groups.put_end(NS, ["x", "y"], [7, 7], started.put_id) == [OK, OK]
    where = {key: replica_segment(state.record(NS, key).replicas[0]) for key in ("x", "y")}
    assert sorted(where.values()) == sorted(state.segments), where
    gone = next(key for key, segment_id in where.items() if segment_id == a)
    tag = state.groups.tag_of(state.record(NS, gone))
    state.unmount_segment(a)  # as an expulsion: its member leaves the tables
    assert state.groups.get_replicas(NS, ["x", "y"]).statuses == [int(Status.NOT_FOUND)] * 2

    def back():  # segment a mounts again, its index kept
        endpoints = ["tcp://127.0.0.1:9"]
        return state.mount_segment(
            "unit", "a", "host-a", endpoints, 1024, inventory=True, previous_segment_id=a, previous_applied_seq=99
        )

    again = back()
    inventory = chunk([(gone, 1000, 7, 0)])
    assert report_dram_objects(state, again.segment.segment_id, inventory) == [OK]
    assert state.groups.get_replicas(NS, ["x", "y"]).statuses == [int(Status.NOT_FOUND)] * 2, "no id: not the member"
    state.unmount_segment(again.segment.segment_id)
    again = back()
    inventory.group_ids, inventory.group_sizes = [tag[0]], [tag[1]]
    assert report_dram_objects(state, again.segment.segment_id, inventory) == [OK]
    assert state.groups.get_replicas(NS, ["y", "x"]).statuses == [OK, OK]
