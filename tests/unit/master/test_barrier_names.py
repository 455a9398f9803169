"""What a waiting call's answer waits for (kvtier.master.commit_wait `CommitWaiter.barrier`): the
commit notices about the keys it names, including those another call made. Handlers and the waiter
in-process, no loop: the barrier each answer would wait for."""

from __future__ import annotations

from kvtier.master.commit_wait import CommitWaiter
from kvtier.master.commits import PutAcknowledgement
from kvtier.master.config import MasterConfig
from kvtier.master.handlers import MasterHandlers
from kvtier.master.recovery import inventory_done
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import name_prefix
from kvtier.proto.status import Status

EPOCH = 7
MiB = 1 << 20


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def cluster(n: int = 1):
    state = MasterState(MasterConfig(cluster_id="unit").validate(), clock=Clock())
    ids = []
    for i in range(n):
        r = state.mount_segment("unit", f"s{i}", f"h{i}", [f"tcp://127.0.0.1:{9 + i}"], MiB, inventory=True)
        inventory_done(state, r.segment.segment_id)
        ids.append(r.segment.segment_id)
    handlers = MasterHandlers(state, EPOCH)
    return handlers, CommitWaiter(handlers, 5.0), ids


def put_end_request(put_id: int, *keys: str, group: bool = False) -> pb.PutEndRequest:
    return pb.PutEndRequest(namespace="ns", keys=list(keys), checksums=[7] * len(keys), put_id=put_id, group=group)


def test_a_retried_put_end_answered_ok_still_waits_for_its_unacknowledged_commit():
    """PutEnd #1 committed, its segment cut off: it times out UNAVAILABLE ("retry"), or its answer is
    lost. The retry finds the key COMPLETE, answers OK: it must wait for the same notice."""
    handlers, waiter, [a] = cluster()
    put_id = handlers.state.put_start("ns", ["k"], [100], 1, PutOptions()).put_id
    assert list(handlers.PutEnd(put_end_request(put_id, "k")).statuses) == [Status.OK]
    first = waiter.barrier()
    assert first is not None and first.notices == {a: 1}
    retry = handlers.PutEnd(put_end_request(put_id, "k"))
    assert list(retry.statuses) == [Status.OK]
    second = waiter.barrier()
    assert second is not None and second.notices == {a: 1}, "OK answered while k is in no index"


def test_the_clients_own_put_end_after_a_relay_it_never_heard_waits_for_the_relayed_notices():
    """commit_relay.py: a relay whose notices the segment cannot apply in order (or a FENCED_RELAY
    answer from CommitWaiter.flush) reaches the client as UNAVAILABLE; "a PutEnd retried by the client
    is answered OK then". That PutEnd must wait for the relaying segment's notices."""
    handlers, waiter, [a] = cluster()
    put_id = handlers.state.put_start("ns", ["k"], [100], 1, PutOptions()).put_id
    relay = pb.RelayPutEndRequest(put_end=put_end_request(put_id, "k"), segment_id=a, epoch=EPOCH, acked_seq=0)
    assert handlers.RelayPutEnd(relay).status == Status.OK
    waiter.barrier()  # the relay's own (leaves "a" out: it applies the answer's notices itself)
    retry = handlers.PutEnd(put_end_request(put_id, "k"))  # the client's own, after UNAVAILABLE
    assert list(retry.statuses) == [Status.OK]
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {a: 1}, "OK answered while k is in no index"


def test_a_group_put_end_answering_ok_for_a_member_another_put_completed_waits_for_that_commit():
    """x completed by another put on s0 (its commit unacknowledged: s0 cut off); the group [x, y]
    puts y on s1 and answers OK for both: x must be in an index first."""
    handlers, waiter, [a, b] = cluster(2)
    state = handlers.state
    other = state.put_start("ns", ["x"], [100], 1, PutOptions(preferred_segment="s0")).put_id
    handlers.PutEnd(put_end_request(other, "x"))  # x's own PutEnd: still waiting for s0
    waiter.barrier()
    group = state.put_start("ns", ["x", "y"], [100, 100], 1, PutOptions(preferred_segment="s1")).put_id
    reply = handlers.PutEnd(put_end_request(group, "x", "y", group=True))
    assert list(reply.statuses) == [Status.OK, Status.OK]
    barrier = waiter.barrier()
    assert barrier is not None and a in barrier.notices, barrier and barrier.notices


def test_a_put_end_does_not_wait_for_another_keys_notice_on_a_segment_cut_off():
    handlers, waiter, [a, b] = cluster(2)
    state = handlers.state
    other = state.put_start("ns", ["x"], [100], 1, PutOptions(preferred_segment="s0")).put_id
    handlers.PutEnd(put_end_request(other, "x"))  # s0 is cut off before it acknowledges x's commit
    waiter.barrier()
    put_id = state.put_start("ns", ["y"], [100], 1, PutOptions(preferred_segment="s1")).put_id
    assert list(handlers.PutEnd(put_end_request(put_id, "y")).statuses) == [Status.OK]
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {b: 1}


def test_a_call_that_names_no_keys_waits_for_every_notice_whatever_the_call_before_left():
    """Names a call left behind (one refused after naming its keys, which answers no barrier) never
    narrow a later call's wait: MigrateEnd names none, so it waits for every notice."""
    handlers, waiter, [a, b] = cluster(2)
    state = handlers.state
    for key, segment in (("x", "s0"), ("y", "s1")):
        put_id = state.put_start("ns", [key], [100], 1, PutOptions(preferred_segment=segment)).put_id
        handlers.PutEnd(put_end_request(put_id, key))
        waiter.barrier()
    handlers.barrier_names = [name_prefix("ns") + "y"]  # as a handler leaves them when it fails after naming its keys
    handlers.MigrateEnd(pb.MigrateEndRequest(migration_id=12345))  # names nothing
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {a: 1, b: 1}


def test_a_wait_ended_by_its_segments_expulsion_answers_only_once_the_expulsion_is_saved():
    """Its notices count as acknowledged once it is expelled; the next master incarnation must know
    its index is stale (saved as expelled) before the Remove is answered, or a restart between the
    answer and the save brings the removed key back from that index."""
    handlers, waiter, [a] = cluster()
    state = handlers.state
    put_id = state.put_start("ns", ["k"], [100], 1, PutOptions()).put_id
    handlers.PutEnd(put_end_request(put_id, "k"))
    waiter.barrier()
    state.commits.poll(a, 1, 10)
    handlers.Remove(pb.KeysRequest(namespace="ns", keys=["k"]))
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {a: 2} and not barrier.done(state)
    state.drop_segment(a, reason="commit feed silent")
    assert not barrier.done(state), "answered before the expulsion was saved"
    state.durable_generation = state.state_generation  # what the server sets once its save is durable
    assert barrier.done(state)


def test_a_wait_ended_by_an_expulsion_waits_for_that_save_not_for_a_later_drops():
    handlers, waiter, [a, b] = cluster(2)
    state = handlers.state
    put_id = state.put_start("ns", ["k"], [100], 1, PutOptions(preferred_segment="s0")).put_id
    handlers.PutEnd(put_end_request(put_id, "k"))
    waiter.barrier()
    state.commits.poll(a, 1, 10)
    handlers.Remove(pb.KeysRequest(namespace="ns", keys=["k"]))
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {a: 2}
    state.drop_segment(a, reason="commit feed silent")
    assert not barrier.done(state)
    saving = state.state_generation  # a save of the expulsion begins
    state.drop_segment(b, reason="unmounted")  # another segment leaves meanwhile
    state.durable_generation = saving  # that save is durable
    assert barrier.done(state), "held for the next save, of an unrelated drop"


def test_every_call_answered_after_a_barrier_starts_clean():
    """The calls the doors answer after `CommitWaiter.barrier()`: both doors' waiting calls and the
    gRPC-only replica moves. Each starts with nothing an earlier call left (kvtier.master.gates)."""
    from kvtier.master.commit_wait import WAITING_CALLS
    from kvtier.master.gates import ANSWERED_AFTER_BARRIER

    assert ANSWERED_AFTER_BARRIER == {*WAITING_CALLS, "MigrateEnd", "RemoveReplicas"}
    handlers, waiter, [a] = cluster()
    state = handlers.state
    put_id = state.put_start("ns", ["k"], [100], 1, PutOptions()).put_id
    handlers.PutEnd(put_end_request(put_id, "k"))
    waiter.barrier()
    # As a RelayPutEnd that failed after naming its segment leaves them (no barrier follows an error).
    handlers.relayed_by, handlers.put_ack = a, PutAcknowledgement()
    assert handlers.Remove(pb.KeysRequest(namespace="ns", keys=["k"])).removed == 1
    barrier = waiter.barrier()
    assert barrier is not None and barrier.notices == {a: 2} and barrier.put_ack is None


def test_a_master_that_saves_nothing_answers_a_wait_for_a_save_at_once_saying_why():
    """Its state store could not be read at start: after a segment left, no change can be
    acknowledged (the next incarnation could not know that segment's index is stale). The call is
    told so at once, instead of waiting its whole timeout for "segments did not acknowledge"."""
    import asyncio

    handlers, waiter, [a, b] = cluster(2)
    state = handlers.state
    state.unsaveable = "cannot save: repair the state file"  # what Roles.lead sets when the load failed
    state.drop_segment(b, reason="unmounted")
    put_id = state.put_start("ns", ["k"], [100], 1, PutOptions()).put_id
    reply = handlers.PutEnd(put_end_request(put_id, "k"))
    barrier = waiter.barrier()
    assert barrier is not None and barrier.generation

    async def answer():
        return await asyncio.wait_for(waiter.finish(reply, barrier), 1.0)

    answered = asyncio.run(answer())
    assert answered.status == Status.NOT_DURABLE and answered.error == "cannot save: repair the state file"
