"""The commit log (kvtier.master.commits): what each segment is told about its DRAM copies, in order,
and when a PutEnd or Remove may answer. Plain objects and a fake clock: given feeds, when notices and
polls, then what each poll hands out and what the waits see."""

from __future__ import annotations

import math

import pytest

from kvtier.master.commits import POLL_BYTES, RELAYED_DUE_AFTER_S, CommitLog, PutAcknowledgement, notice_pin
from kvtier.master.records import PIN_HARD, PIN_NONE, PIN_SOFT, ObjectRecord, replica
from kvtier.proto.status import Status

A, B, C, D = 1, 2, 3, 4  # segment ids


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(name: str, *replicas: int, size: int = 64, pin_until: float = 0.0) -> ObjectRecord:
    return ObjectRecord(name, size, tuple(replicas), put_id=1, started_at=0.0, pin_until=pin_until)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Wakes:
    """What the log woke: long polls by segment, in order, and the PutEnd waiters."""

    def __init__(self) -> None:
        self.polls: list[int] = []
        self.acks = 0

    def ack(self) -> None:
        self.acks += 1


@pytest.fixture
def wakes() -> Wakes:
    return Wakes()


@pytest.fixture
def log(clock: FakeClock, wakes: Wakes) -> CommitLog:
    log = CommitLog(clock)
    log.notify = wakes.polls.append
    log.on_ack = wakes.ack
    return log


def names(notices) -> list[tuple[str, bool]]:
    return [(r.name, dropped) for _, r, dropped in notices.items]


def test_notices_are_numbered_per_segment_and_handed_out_in_order(log: CommitLog, wakes: Wakes):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    x, y = record("x", replica(A, 0)), record("y", replica(B, 128))
    log.committed(A, 0, x)
    log.committed(B, 128, y)
    log.dropped(A, 0, x)
    assert wakes.polls == [A, B, A]

    got = log.poll(A, acked_seq=0, limit=100)
    assert got.first_seq == 1 and names(got) == [("x", False), ("x", True)]
    assert [offset for offset, _, _ in got.items] == [0, 0]
    got = log.poll(B, acked_seq=0, limit=100)
    assert got.first_seq == 1 and names(got) == [("y", False)]
    assert log.backlog() == 3, "handing notices out acknowledges nothing"


def test_an_acknowledgement_releases_notices_and_a_lost_reply_is_answered_again(log: CommitLog, wakes: Wakes):
    log.mounted(A, keeps_index=True)
    for i in range(3):
        log.committed(A, 64 * i, record(f"k{i}", replica(A, 64 * i)))
    assert names(log.poll(A, acked_seq=0, limit=2)) == [("k0", False), ("k1", False)]
    # The reply was lost: the segment polls again with its old acknowledgement and gets the same notices.
    again = log.poll(A, acked_seq=0, limit=2)
    assert again.first_seq == 1 and names(again) == [("k0", False), ("k1", False)]
    after = log.poll(A, acked_seq=2, limit=10)
    assert after.first_seq == 3 and names(after) == [("k2", False)]
    assert log.backlog() == 1 and wakes.acks == 1
    # An acknowledgement past what was handed out counts only what exists.
    assert log.poll(A, acked_seq=99, limit=10).items == []
    assert log.backlog() == 0 and not log.has_notices(A, 3)


def test_a_poll_answer_stays_under_its_byte_budget_but_always_carries_one_notice(log: CommitLog):
    log.mounted(A, keeps_index=True)
    big = "b" * POLL_BYTES  # one name over the whole budget
    log.committed(A, 0, record(big, replica(A, 0)))
    log.committed(A, 64, record("small", replica(A, 64)))
    first = log.poll(A, acked_seq=0, limit=100)
    assert names(first) == [(big, False)], "a notice larger than the budget goes alone, never stuck"
    assert names(log.poll(A, acked_seq=1, limit=100)) == [("small", False)]


def test_segments_not_mounted_get_no_notices_and_their_poll_is_refused(log: CommitLog, wakes: Wakes):
    log.committed(A, 0, record("x", replica(A, 0)))
    log.dropped(A, 0, record("x", replica(A, 0)))
    assert log.poll(A, acked_seq=0, limit=10) is None
    assert wakes.polls == [] and log.backlog() == 0
    assert log.unacked_names(A) == set() and not log.keeps_index(A)


def test_bulk_commit_tells_every_replica_segment_and_wakes_each_once(log: CommitLog, wakes: Wakes):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    records = [record(f"r{i}", replica(A, 64 * i), replica(B, 64 * i)) for i in range(3)]
    log.committed_records(records)
    assert sorted(wakes.polls) == [A, B]
    for segment in (A, B):
        got = log.poll(segment, acked_seq=0, limit=10)
        assert names(got) == [("r0", False), ("r1", False), ("r2", False)]
        assert [offset for offset, _, _ in got.items] == [0, 64, 128]
    assert log.unacked_names(A) == {"r0", "r1", "r2"}


def test_a_barrier_waits_for_index_keeping_segments_only_until_they_acknowledge(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=False)  # keeps no index: never waited for
    log.committed(A, 0, record("x", replica(A, 0)))
    log.committed(B, 0, record("y", replica(B, 0)))
    barrier = log.barrier()
    assert barrier == {A: 1}
    assert not log.acked(barrier)
    log.committed(A, 64, record("later", replica(A, 64)))  # made after the barrier: not waited for
    log.poll(A, acked_seq=1, limit=10)
    assert log.acked(barrier)
    assert log.barrier() == {A: 2}


def test_a_segment_dropped_ends_the_waits_for_it(log: CommitLog, wakes: Wakes):
    log.mounted(A, keeps_index=True)
    log.committed(A, 0, record("x", replica(A, 0)))
    barrier = log.barrier()
    log.segment_dropped(A)
    assert log.acked(barrier), "an expelled or departed segment is waited for no longer"
    assert wakes.acks == 1, "waiters are woken to see it"
    assert log.barrier() == {} and log.poll(A, 0, 10) is None


def test_after_acked_runs_once_the_segment_acknowledged_everything_queued_before_it(log: CommitLog):
    """A move's source drop waits for its target (kvtier.master.drain): the call comes when the
    segment acknowledged every notice queued when it was asked, not one queued after."""
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    calls: list[bool] = []
    log.committed(B, 0, record("m", replica(B, 0)))  # seq 1: the target's copy
    log.after_acked(B, calls.append)
    log.committed(B, 64, record("later", replica(B, 64)))  # seq 2: not waited for
    assert calls == []
    log.poll(B, acked_seq=1, limit=10)
    assert calls == [True]
    log.poll(B, acked_seq=2, limit=10)
    assert calls == [True], "called once"


def test_after_acked_runs_at_once_when_nothing_is_outstanding_and_fails_for_an_unknown_segment(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=False)
    calls: list[bool] = []
    log.committed(B, 0, record("m", replica(B, 0)))
    log.after_acked(B, calls.append)  # B keeps no index: nothing to wait for
    log.after_acked(A, calls.append)  # A has nothing outstanding
    log.after_acked(C, calls.append)  # C is not mounted
    assert calls == [True, True, False]


def test_a_segment_that_goes_away_first_fails_what_waited_for_it(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    calls: list[bool] = []
    log.committed(B, 0, record("m", replica(B, 0)))
    log.after_acked(B, calls.append)
    log.segment_dropped(B)
    assert calls == [False], "it never acknowledged: a move's source stays"
    assert log.poll(A, 0, 10).items == [], "nothing is dropped for it"


def test_silent_segments_are_those_keeping_an_index_with_notices_waiting(log: CommitLog, clock: FakeClock):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    log.mounted(C, keeps_index=False)
    log.committed(A, 0, record("x", replica(A, 0)))
    log.committed(C, 0, record("y", replica(C, 0)))
    clock.now += 10.5
    assert log.silent(ttl_s=10.0) == [A], "B has nothing waiting, C keeps no index"
    log.forgive(gap_s=5.0)  # the master itself was not running for 5 s
    assert log.silent(ttl_s=10.0) == []
    log.poll(A, acked_seq=0, limit=10)  # polling (even acknowledging nothing) is a sign of life
    clock.now += 9.0
    assert log.silent(ttl_s=10.0) == []


def test_unacked_names_are_what_the_segment_may_or_may_not_have_applied(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.committed(A, 0, record("x", replica(A, 0)))
    log.committed(A, 64, record("y", replica(A, 64)))
    log.poll(A, acked_seq=0, limit=10)
    assert log.unacked_names(A) == {"x", "y"}, "handed out but not acknowledged"
    log.poll(A, acked_seq=1, limit=10)
    assert log.unacked_names(A) == {"y"}


def test_a_notice_carries_a_soft_pins_time_left(clock: FakeClock):
    assert notice_pin(record("n"), now=clock.now) == (PIN_NONE, 0)
    assert notice_pin(record("h", pin_until=math.inf), now=clock.now) == (PIN_HARD, 0)
    assert notice_pin(record("s", pin_until=clock.now + 2.5), now=clock.now) == (PIN_SOFT, 2500)
    assert notice_pin(record("s", pin_until=clock.now - 1), now=clock.now) == (PIN_SOFT, 0)


def test_an_acknowledged_put_whose_segment_is_gone_is_not_answered_ok():
    kept = record("kept", replica(A, 0))
    moved = record("moved", replica(A, 64))
    lost = record("lost", replica(B, 0))
    acknowledgement = PutAcknowledgement(
        [(0, kept, kept.replicas), (1, moved, moved.replicas), (2, lost, lost.replicas)]
    )
    moved.replicas = (replica(C, 0),)  # a new tuple, but the segment it was committed on is still there
    lost.replicas = ()  # its segment was dropped
    statuses = [int(Status.OK)] * 3
    assert acknowledgement.settle(mounted={A, C}, statuses=statuses) == 1
    assert statuses == [int(Status.OK), int(Status.OK), int(Status.SEGMENT_NOT_FOUND)]


def test_a_replicated_put_that_keeps_a_replica_is_stored_and_answered_ok():
    """One of two replicas lost during the wait: the other's segment acknowledged, the version is
    readable there, so the writer hears OK (before: SEGMENT_NOT_FOUND, "not stored", for bytes readers
    were reading, and an upsert's old version already gone). Every replica lost: SEGMENT_NOT_FOUND."""
    two = record("two", replica(A, 0), replica(B, 0))
    none = record("none", replica(B, 64), replica(D, 0))
    acknowledgement = PutAcknowledgement([(0, two, two.replicas), (1, none, none.replicas)])
    two.replicas, none.replicas = (replica(A, 0),), ()  # B and D were expelled
    statuses = [int(Status.OK)] * 2
    assert acknowledgement.settle(mounted={A, C}, statuses=statuses) == 1
    assert statuses == [int(Status.OK), int(Status.SEGMENT_NOT_FOUND)]


def test_a_relayed_calls_notices_do_not_wake_its_segment_until_another_call_waits_for_them(
    log: CommitLog, wakes: Wakes
):
    """RelayPutEnd: the relaying segment gets its notices in the call's answer, so they do not wake its
    long poll; its acknowledgement rides on its next relay (`ack`). A call that waits for them before
    that wakes the poll, once, so it never waits for the poll's timeout."""
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    log.committed(A, 0, record("first", replica(A, 0)))  # an ordinary notice wakes A
    assert wakes.polls == [A]
    log.relaying = A
    first = log.next_seq(A)
    log.committed(A, 64, record("relayed", replica(A, 64)))
    log.committed(B, 0, record("other", replica(B, 0)))  # another segment's notice still wakes it
    log.relaying = 0
    assert wakes.polls == [A, B]
    assert [r.name for _, r, _ in log.since(A, first)] == ["relayed"]
    assert log.barrier(relayed_by=A) == {B: 1}  # the relay's own wait leaves A out, and wakes nothing
    assert wakes.polls == [A, B]
    assert log.barrier() == {A: 2, B: 1}  # anyone else waits for A: its poll is woken now, once
    assert wakes.polls == [A, B, A]
    assert log.barrier() == {A: 2, B: 1} and wakes.polls == [A, B, A]
    acks = wakes.acks
    log.ack(A, 2)  # the next relay carries the acknowledgement
    assert log.barrier() == {B: 1} and wakes.acks == acks + 1
    log.ack(A, 9)  # more than was ever sent: only what exists is acknowledged
    assert log.next_seq(A) == 3 and log.since(A, 1) == []
    log.ack(C, 5)  # not mounted: nothing to acknowledge, no error


def test_relayed_notices_are_not_due_to_the_feed_until_something_wakes_them(log: CommitLog, wakes: Wakes):
    """Under relay load the segment's feed must not busy-poll: a poll (and `has_notices`) hands out
    only the notices before the first unwoken relayed one. The relay's acknowledgement still applies.
    Once a barrier, a move waiting on the segment, or an ordinary notice wakes them, they are due."""
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    log.committed(A, 0, record("plain", replica(A, 0)))  # seq 1: an ordinary notice, due
    log.relaying = A
    log.committed(A, 64, record("relayed1", replica(A, 64)))  # seq 2
    log.committed_records([record("relayed2", replica(A, 128), replica(B, 0))])  # seq 3 (B's seq 1 wakes B)
    log.relaying = 0
    assert wakes.polls == [A, B]
    assert log.has_notices(A, 0) and not log.has_notices(A, 1), "only 'plain' is due"
    assert names(log.poll(A, 0, 100)) == [("plain", False)]
    assert log.poll(A, 1, 100).items == [], "the relayed ones: the segment has them from its answer"
    assert log.poll(A, 3, 1).items == [] and log.barrier(relayed_by=A) == {B: 1}, "the ~2 ms acknowledgement"
    assert not log.has_notices(A, 3) and wakes.polls == [A, B]
    # another relay: its notices stay unwoken; a barrier (a call waiting for them) makes them due, once
    log.relaying = A
    log.dropped(A, 64, record("relayed1", replica(A, 64)))  # seq 4
    log.relaying = 0
    assert log.poll(A, 3, 100).items == [] and not log.has_notices(A, 3)
    assert A in log.barrier() and wakes.polls == [A, B, A]
    assert log.has_notices(A, 3) and names(log.poll(A, 3, 100)) == [("relayed1", True)]
    # the relay's answer was lost (the client sends PutEnd itself): its barrier wakes them
    log.relaying = A
    log.committed(A, 192, record("lost", replica(A, 192)))  # seq 5
    log.relaying = 0
    assert not log.has_notices(A, 4)
    log.barrier()
    assert names(log.poll(A, 4, 100)) == [("lost", False)]
    # an ordinary notice after unwoken relayed ones wakes the poll: everything is due, in order
    log.relaying = A
    log.committed(A, 256, record("r", replica(A, 256)))  # seq 6
    log.relaying = 0
    log.committed(A, 320, record("o", replica(A, 320)))  # seq 7
    assert names(log.poll(A, 5, 100)) == [("r", False), ("o", False)]
    # a move whose source drop waits for A's acknowledgement of relayed notices wakes A
    log.ack(A, 7)
    log.relaying = A
    log.committed(A, 384, record("moved", replica(A, 384)))  # seq 8
    log.relaying = 0
    polls = len(wakes.polls)
    calls: list[bool] = []
    log.after_acked(A, calls.append)
    assert wakes.polls[polls:] == [A] and names(log.poll(A, 7, 100)) == [("moved", False)]
    assert calls == []
    log.poll(A, 8, 100)
    assert calls == [True], "called once A acked"


def test_unwoken_relayed_notices_nobody_asks_for_are_due_once_unacknowledged_for_a_while(
    log: CommitLog, clock: FakeClock, wakes: Wakes
):
    """A relayed answer lost with its client (no PutEnd follows, no barrier): the segment never
    acknowledges those notices, so after RELAYED_DUE_AFTER_S its feed's next poll gets them anyway.
    Under steady relay load each acknowledgement restarts that grace for the rest."""
    log.mounted(A, keeps_index=True)
    log.relaying = A
    log.committed(A, 0, record("r1", replica(A, 0)))  # seq 1
    log.committed(A, 64, record("r2", replica(A, 64)))  # seq 2 (another relay, in flight)
    log.relaying = 0
    clock.now += RELAYED_DUE_AFTER_S * 0.75
    assert log.poll(A, 1, 100).items == [], "r1's answer applied and acknowledged; r2 in flight"
    clock.now += RELAYED_DUE_AFTER_S * 0.75
    assert not log.has_notices(A, 1), "the acknowledgement restarted the grace for r2"
    clock.now += RELAYED_DUE_AFTER_S * 0.5
    assert log.has_notices(A, 1) and names(log.poll(A, 1, 100)) == [("r2", False)]
    assert wakes.polls == []


def test_unacked_seqs_give_each_name_its_last_unacknowledged_notice(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.committed(A, 0, record("acked", replica(A, 0)))  # seq 1
    log.committed(A, 64, record("x", replica(A, 64)))  # seq 2
    log.committed(A, 128, record("y", replica(A, 128)))  # seq 3
    log.dropped(A, 64, record("x", replica(A, 64)))  # seq 4: x has a commit and a drop pending
    log.poll(A, 1, 100)
    assert log.unacked_seqs(A) == {"x": 4, "y": 3}
    assert log.unacked_seqs(B) == {}


def test_a_barrier_by_names_waits_only_for_notices_about_those_names(log: CommitLog):
    """A segment cut off with notices pending about other keys holds no put of these: before, every
    PutEnd in the cluster waited for it until it was expelled at segment_ttl_s."""
    for s in (A, B, C):
        log.mounted(s, keeps_index=True)
    log.committed(A, 0, record("elsewhere", replica(A, 0)))  # A is cut off with this pending
    log.dropped(B, 0, record("key", replica(B, 0)))  # the key's old version, dropped on B
    log.committed(C, 0, record("key", replica(C, 0)))  # its new version, on C
    assert log.barrier(names=["key"]) == {B: 1, C: 1}, "the old version's drop is waited for: versions stay ordered"
    assert log.barrier(relayed_by=C, names=["key"]) == {B: 1}
    assert log.barrier(names=["unrelated"]) == {}
    assert log.barrier() == {A: 1, B: 1, C: 1}, "every notice, for a prefix removal's sweep"
    log.poll(B, 1, 10)
    assert log.barrier(names=["key"]) == {C: 1}


def test_a_barrier_by_names_waits_up_to_the_names_last_notice_and_forgets_acknowledged_ones(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=False)  # keeps no index: never waited for
    log.committed(A, 0, record("k", replica(A, 0)))
    log.committed(A, 64, record("other", replica(A, 64)))
    log.dropped(A, 0, record("k", replica(A, 0)))
    log.committed(B, 0, record("k", replica(B, 0)))
    assert log.barrier(names=["k"]) == {A: 3}
    log.poll(A, 2, 10)  # applied the commit of k, not its drop
    assert log.barrier(names=["k"]) == {A: 3} and log.barrier(names=["other"]) == {}
    log.poll(A, 3, 10)
    assert log.barrier(names=["k"]) == {} and log.unacked_name_count() == 0


def test_a_dropped_segment_leaves_nothing_waited_for_by_name(log: CommitLog):
    log.mounted(A, keeps_index=True)
    log.mounted(B, keeps_index=True)
    for i in range(3):
        log.committed(A, 64 * i, record(f"k{i}", replica(A, 64 * i)))
    log.committed(B, 0, record("k0", replica(B, 0)))
    log.segment_dropped(A)
    assert log.barrier(names=["k0", "k1", "k2"]) == {B: 1} and log.unacked_name_count() == 1


def test_the_barrier_by_names_matches_every_feeds_own_unacknowledged_notices_under_random_operations(
    log: CommitLog,
):
    """The name index against the feeds themselves (`unacked_seqs`): whatever order notices,
    acknowledgements (in order, stale, relayed), moves, mounts and drops come in."""
    import random

    rng = random.Random(7)
    names_ = [f"n{i}" for i in range(12)]
    mounted: list[int] = []
    next_id = 1
    for _ in range(3000):
        op = rng.random()
        if op < 0.08 or not mounted:
            log.mounted(next_id, keeps_index=rng.random() < 0.8)
            mounted.append(next_id)
            next_id += 1
        elif op < 0.12 and len(mounted) > 1:
            log.segment_dropped(mounted.pop(rng.randrange(len(mounted))))
        elif op < 0.5:
            s = rng.choice(mounted)
            rec = record(rng.choice(names_), replica(s, 0))
            (log.dropped if rng.random() < 0.4 else log.committed)(s, 0, rec)
        elif op < 0.6:
            segs = rng.sample(mounted, min(len(mounted), 2))
            log.committed_records([record(rng.choice(names_), *(replica(s, 0) for s in segs))])
        elif op < 0.68 and len(mounted) > 1:
            source, target = rng.sample(mounted, 2)  # a move: the source drop waits for the target
            moved = record(rng.choice(names_), replica(target, 0))
            log.committed(target, 0, moved)
            log.after_acked(target, lambda ok, s=source, r=moved: ok and s in mounted and log.dropped(s, 0, r))
        else:
            s = rng.choice(mounted)
            upto = log.next_seq(s) - 1
            acked = rng.randint(max(0, log.first_unacked(s) - 2), upto)
            if rng.random() < 0.5:
                log.poll(s, acked, 100)
            else:
                log.ack(s, acked)
        asked = rng.sample(names_, rng.randint(1, 3))
        relayed = rng.choice(mounted + [0])
        expected: dict[int, int] = {}
        for s in mounted:
            if s == relayed or not log.keeps_index(s):
                continue
            seqs = [seq for name, seq in log.unacked_seqs(s).items() if name in asked]
            if seqs:
                expected[s] = max(seqs)
        assert log.barrier(relayed, asked) == expected
    assert log.unacked_name_count() <= len(names_)


def test_an_expelled_segment_fails_only_what_waited_for_it(log: CommitLog):
    for s in (A, B, C, D):
        log.mounted(s, keeps_index=True)
    k = record("k", replica(B, 0), replica(D, 0))
    calls: list[tuple[str, bool]] = []
    log.committed(B, 0, k)
    log.after_acked(B, lambda ok: calls.append(("B", ok)))
    log.committed(D, 0, k)
    log.after_acked(D, lambda ok: calls.append(("D", ok)))
    log.segment_dropped(B)
    assert calls == [("B", False)]
    log.poll(D, 1, 10)
    assert calls == [("B", False), ("D", True)]
