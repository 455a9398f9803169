"""RelayPutEnd (kvtier.master.handlers_data): a PutEnd relayed by the segment the client wrote to,
answered with that segment's notices from its first unacknowledged one on. Plain MasterState and
MasterHandlers, no processes: given relayed and ordinary puts, what each answer carries."""

from __future__ import annotations

from kvtier.master.config import MasterConfig
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.test_commits import FakeClock

EPOCH = 7


def _cluster() -> tuple[MasterHandlers, int]:
    state = MasterState(MasterConfig(cluster_id="unit").validate(), clock=FakeClock())
    mounted = state.mount_segment("unit", "seg0", "host", ["tcp://127.0.0.1:9"], 1 << 20)
    assert mounted.status == Status.OK
    return MasterHandlers(state, EPOCH), mounted.segment.segment_id


def _relay(handlers: MasterHandlers, segment_id: int, key: str, acked: int) -> pb.RelayPutEndResponse:
    started = handlers.state.put_start("ns", [key], [100], 1, PutOptions())
    put_end = pb.PutEndRequest(namespace="ns", keys=[key], checksums=[7], put_id=started.put_id)
    reply = handlers.RelayPutEnd(
        pb.RelayPutEndRequest(put_end=put_end, segment_id=segment_id, epoch=EPOCH, acked_seq=acked)
    )
    handlers.relayed_by = 0  # what the waiter's barrier() takes after each call
    return reply


def test_each_answer_carries_the_segments_notices_from_its_first_unacknowledged_one():
    """Answers may reach the segment out of order (several links, one parked for other segments):
    each must be applicable on its own, so it starts where the segment's acknowledgement stands."""
    handlers, segment_id = _cluster()
    first = _relay(handlers, segment_id, "a", acked=0)
    assert list(first.statuses) == [Status.OK]
    assert (first.notices.first_seq, [n[3:] for n in first.notices.names]) == (1, ["a"])
    second = _relay(handlers, segment_id, "b", acked=0)  # the segment has not acknowledged "a" yet
    assert (second.notices.first_seq, [n[3:] for n in second.notices.names]) == (1, ["a", "b"])
    third = _relay(handlers, segment_id, "c", acked=2)  # now it has: only its own
    assert (third.notices.first_seq, [n[3:] for n in third.notices.names]) == (3, ["c"])
    assert handlers.state.commits.first_unacked(segment_id) == 3


def test_a_refused_relay_carries_no_notices_and_a_foreign_epoch_is_refused():
    handlers, segment_id = _cluster()
    wrong = pb.RelayPutEndRequest(
        put_end=pb.PutEndRequest(namespace="ns", keys=["x"], checksums=[1], put_id=99),
        segment_id=segment_id,
        epoch=EPOCH + 1,
    )
    assert handlers.RelayPutEnd(wrong).status == Status.SEGMENT_NOT_FOUND
    wrong.epoch = EPOCH
    reply = handlers.RelayPutEnd(wrong)  # no such pending put: put id 99 is not this incarnation's
    assert reply.status == Status.OK and list(reply.statuses) == [Status.TIMEOUT]
    assert len(reply.notices.offsets) == 0


def test_under_a_direct_read_fence_a_relay_is_refused_after_its_acknowledgement_counts():
    """A dropped segment may still serve direct reads: the relay would wait past its own bound, so it
    is answered UNAVAILABLE at once (the client sends its PutEnd itself) and commits nothing; the
    acknowledgement it carried still counts."""
    handlers, segment_id = _cluster()
    state = handlers.state
    first = _relay(handlers, segment_id, "a", acked=0)
    assert list(first.statuses) == [Status.OK]
    state.direct_read_fence = state.clock() + 1.0
    started = state.put_start("ns", ["b"], [100], 1, PutOptions())
    put_end = pb.PutEndRequest(namespace="ns", keys=["b"], checksums=[7], put_id=started.put_id)
    reply = handlers.RelayPutEnd(
        pb.RelayPutEndRequest(put_end=put_end, segment_id=segment_id, epoch=EPOCH, acked_seq=1)
    )
    assert reply.status == Status.UNAVAILABLE and not reply.statuses
    assert state.commits.first_unacked(segment_id) == 2  # "a"'s notice acknowledged all the same
    assert state.exists("ns", ["b"])[0] == [False]  # nothing committed: the client's own PutEnd will
