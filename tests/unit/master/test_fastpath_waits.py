"""Parked answers on the fast path (kvtier.master.commit_wait, session 9): a PutEnd's commit notice
reaches the segment's waiting poll inside the PutEnd frame's own dispatch, and the acknowledgement on
the segment's next poll answers the PutEnd inside that poll's dispatch, before the poll waits again:
no task, no loop turn in between. What is answered, and when it may be OK, is unchanged."""

from __future__ import annotations

import asyncio

from kvtier.master.commit_wait import CommitWaiter
from kvtier.master.fastpath import Connections, FastPathLimits, FastPathProtocol
from kvtier.master.handlers import MasterHandlers
from kvtier.master.recovery import inventory_done
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.status import Status
from tests.unit.master.fastpath_fakes import HEADER, Conn, FakeTransport, frames_of, make_handlers

MiB = 1 << 20
NS = "ns"


def frame(name: str, request, request_id: int = 1) -> bytes:
    payload = request.SerializeToString()
    return HEADER.pack(rpcframe.MAGIC, rpcframe.METHOD_IDS[name], request_id, len(payload)) + payload


def answers(conn: Conn) -> list[tuple[int, int, bytes]]:
    """The frames written since the last call."""
    out = frames_of(bytes(conn.transport.stream))
    conn.transport.stream.clear()
    return out


async def answered(conn: Conn, within_s: float) -> None:
    """Until something was written to `conn` (a parked answer's timer fired), or `within_s` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not conn.transport.stream and loop.time() < deadline:
        await asyncio.sleep(0.01)


class Cluster:
    """One master's handlers with a segment that keeps an index (PutEnd waits for it), and fast-path
    connections sharing one CommitWaiter, as the server wires them."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.handlers: MasterHandlers = make_handlers()
        state = self.handlers.state
        result = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], MiB, inventory=True)
        self.segment_id = result.segment.segment_id
        inventory_done(state, self.segment_id)
        self.waiter = CommitWaiter(self.handlers, timeout_s)
        self.connections = Connections(FastPathLimits())

    def connect(self) -> Conn:
        protocol = FastPathProtocol(self.handlers, self.waiter, self.connections)
        transport = FakeTransport()
        protocol.connection_made(transport)
        return Conn(protocol, transport)

    def poll(self, acked: int, wait_ms: int = 1000) -> bytes:
        request = pb.PollCommitsRequest(
            segment_id=self.segment_id, epoch=self.handlers.epoch, acked_seq=acked, wait_ms=wait_ms, max_notices=100
        )
        return frame("PollCommits", request, request_id=acked + 1)

    def put_start(self, client: Conn, key: str) -> int:
        client.feed(frame("PutStart", pb.PutStartRequest(namespace=NS, keys=[key], sizes=[4096], replicas=1)))
        [(_, _, body)] = answers(client)
        reply = pb.PutStartResponse.FromString(body)
        assert reply.status == Status.OK and list(reply.statuses) == [Status.OK]
        return reply.put_id


def put_end(key: str, put_id: int, request_id: int = 7) -> bytes:
    return frame("PutEnd", pb.PutEndRequest(namespace=NS, keys=[key], checksums=[1], put_id=put_id), request_id)


def test_the_commit_goes_to_the_waiting_poll_and_the_ack_answers_the_put_end_within_their_frames():
    async def main() -> None:
        cluster = Cluster()
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        assert answers(segment) == [] and not segment.transport.reading  # nothing queued: it waits
        put_id = cluster.put_start(client, "k")

        client.feed(put_end("k", put_id))
        assert answers(client) == [] and not client.transport.reading  # waits for the acknowledgement
        [(method, _, body)] = answers(segment)  # the notice, already: no loop turn since the PutEnd
        notices = pb.PollCommitsResponse.FromString(body)
        assert method == rpcframe.METHOD_IDS["PollCommits"] and list(notices.names) == [f"{NS}\x00k"]
        assert segment.transport.reading

        segment.feed(cluster.poll(acked=notices.first_seq))  # applied: the next poll acknowledges it
        [(method, request_id, body)] = answers(client)  # answered inside the acknowledging poll's dispatch
        reply = pb.KeyStatusResponse.FromString(body)
        assert (method, request_id) == (rpcframe.METHOD_IDS["PutEnd"], 7)
        assert reply.status == Status.OK and list(reply.statuses) == [Status.OK]
        assert client.transport.reading
        assert answers(segment) == [] and not segment.transport.reading  # that poll waits for more

    asyncio.run(main())


def test_a_put_end_is_not_answered_ok_before_its_segment_acknowledged_and_times_out_unavailable():
    async def main() -> None:
        cluster = Cluster(timeout_s=0.05)
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        client.feed(put_end("k", put_id))
        [(_, _, body)] = answers(segment)
        first_seq = pb.PollCommitsResponse.FromString(body).first_seq
        segment.feed(cluster.poll(acked=first_seq - 1))  # polls again without acknowledging the notice
        answers(segment)
        assert answers(client) == []
        await answered(client, 100 * 0.05)
        [(_, _, body)] = answers(client)
        assert pb.KeyStatusResponse.FromString(body).status == Status.UNAVAILABLE
        assert client.transport.reading

    asyncio.run(main())


def test_frames_pipelined_behind_a_parked_answer_are_answered_after_it_in_order():
    async def main() -> None:
        cluster = Cluster()
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        exists = frame("Exists", pb.ExistsRequest(namespace=NS, keys=["k"]), request_id=8)
        client.feed(put_end("k", put_id) + exists)
        [(_, _, body)] = answers(segment)
        assert answers(client) == []
        segment.feed(cluster.poll(acked=pb.PollCommitsResponse.FromString(body).first_seq))
        for _ in range(10):
            if len(frames_of(bytes(client.transport.stream))) == 2:
                break
            await asyncio.sleep(0)  # the Exists is parsed on a later loop turn, not inside the poll's dispatch
        [(put_method, put_rid, _), (ex_method, ex_rid, ex_body)] = answers(client)
        assert (put_method, put_rid, ex_method, ex_rid) == (4, 7, 2, 8)
        assert list(pb.ExistsResponse.FromString(ex_body).exists) == [True]

    asyncio.run(main())


def test_a_parked_poll_answers_empty_after_its_wait_and_a_closed_connection_gets_nothing():
    async def main() -> None:
        cluster = Cluster()
        segment = cluster.connect()
        segment.feed(cluster.poll(acked=0, wait_ms=20))
        assert answers(segment) == []
        await answered(segment, 100 * 0.02)
        [(_, _, body)] = answers(segment)
        reply = pb.PollCommitsResponse.FromString(body)
        assert reply.status == Status.OK and not reply.offsets
        # A poll whose connection is gone: its notice finds nobody to write to, and nothing breaks.
        gone, client = cluster.connect(), cluster.connect()
        gone.feed(cluster.poll(acked=0))
        gone.lose()
        put_id = cluster.put_start(client, "k")
        client.feed(put_end("k", put_id))
        assert gone.transport.stream == bytearray()

    asyncio.run(main())


def test_a_tenants_call_that_wakes_a_segments_parked_poll_does_not_answer_it_as_the_tenant():
    """The poll is answered as its own connection's caller: a tenant's gRPC PutEnd that made the
    notice must not lend the poll its principal (it may not call PollCommits)."""
    from kvtier.master.auth import Authenticator, Tenant, current_principal

    async def main():
        cluster = Cluster()
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        assert answers(segment) == []  # parked: nothing to tell yet
        put_id = cluster.put_start(client, "k")
        cluster.handlers.auth = Authenticator(b"c" * 32, {"t1": (b"t" * 32, Tenant("t1", ("*",)))})

        async def tenants_grpc_put_end():  # what the auth interceptor and the servicer do
            current_principal.set("t1")
            reply = cluster.handlers.PutEnd(pb.PutEndRequest(namespace=NS, keys=["k"], checksums=[1], put_id=put_id))
            assert reply.status == Status.OK
            return await asyncio.wait_for(cluster.waiter.finish(reply, cluster.waiter.barrier()), 1.0)

        task = asyncio.create_task(tenants_grpc_put_end())
        for _ in range(5):
            await asyncio.sleep(0)
        [(_, _, body)] = answers(segment)
        poll = pb.PollCommitsResponse.FromString(body)
        task.cancel()
        assert poll.status == Status.OK, (Status(poll.status).name, poll.error)
        assert list(poll.names)  # the commit notice itself

    asyncio.run(main())


def test_a_put_end_waits_for_the_direct_read_fence_of_a_dropped_segment():
    """While a dropped segment (or one of an earlier incarnation) may still serve direct reads
    (MasterState.direct_read_fence), a PutEnd is not answered, even once acknowledged."""

    async def main() -> None:
        cluster = Cluster()
        state = cluster.handlers.state
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        fence = state.direct_read_fence = state.clock() + 0.2
        client.feed(put_end("k", put_id))
        [(_, _, body)] = answers(segment)
        segment.feed(cluster.poll(acked=pb.PollCommitsResponse.FromString(body).first_seq))
        assert answers(client) == []  # acknowledged, but the fence is ahead
        await answered(client, 2.0)
        assert state.clock() >= fence
        [(_, _, body)] = answers(client)
        assert pb.KeyStatusResponse.FromString(body).status == Status.OK
        # Past the fence nothing waits for it any more.
        put_id = cluster.put_start(client, "k2")
        client.feed(put_end("k2", put_id))
        [(_, _, body)] = answers(segment)
        segment.feed(cluster.poll(acked=pb.PollCommitsResponse.FromString(body).first_seq))
        [(_, _, body)] = answers(client)
        assert pb.KeyStatusResponse.FromString(body).status == Status.OK

    asyncio.run(main())


def test_a_segment_dropped_while_a_put_end_waits_for_it_fences_the_answer():
    """The drop ends the wait for the segment's acknowledgement, but the segment may serve direct
    reads from its index (which never got the notice) until its lease ends: the answer waits."""

    async def main() -> None:
        cluster = Cluster()
        state = cluster.handlers.state
        state.segments[cluster.segment_id].direct_reads = True
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        client.feed(put_end("k", put_id))
        answers(segment)  # the notice, never acknowledged
        assert answers(client) == []
        state.drop_segment(cluster.segment_id, reason="drained")
        state.durable_generation = state.state_generation  # the server's save of the drop (no server here)
        fence = state.direct_read_fence
        assert fence > state.clock()
        await asyncio.sleep(0)
        assert answers(client) == []  # acknowledged by the drop, fenced by the lease
        await answered(client, 5.0)
        assert state.clock() >= fence
        [(_, _, body)] = answers(client)
        reply = pb.KeyStatusResponse.FromString(body)
        assert reply.status == Status.OK and list(reply.statuses) == [Status.SEGMENT_NOT_FOUND]

    asyncio.run(main())


def test_a_relayed_put_end_parked_when_a_segment_is_dropped_is_refused_at_once():
    """The fence a drop sets may outlast the relay's own bound (its link would be cut for every put
    on it): a parked relayed PutEnd is answered UNAVAILABLE at the drop, the client's PutEnd waits."""

    async def main() -> None:
        cluster = Cluster()
        state = cluster.handlers.state
        other = state.mount_segment("unit", "b", "host-b", ["tcp://127.0.0.1:8"], MiB, inventory=True)
        inventory_done(state, other.segment.segment_id)
        other.segment.direct_reads = True
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        relay = pb.RelayPutEndRequest(
            put_end=pb.PutEndRequest(namespace=NS, keys=["k"], checksums=[1], put_id=put_id),
            segment_id=other.segment.segment_id,  # relayed by "b": parked for "a"'s acknowledgement
            epoch=cluster.handlers.epoch,
        )
        relayer = cluster.connect()
        relayer.feed(frame("RelayPutEnd", relay, request_id=9))
        assert answers(relayer) == []
        state.drop_segment(other.segment.segment_id, reason="drained")
        assert state.direct_read_fence > state.clock()
        await asyncio.sleep(0)
        [(_, request_id, body)] = answers(relayer)
        reply = pb.RelayPutEndResponse.FromString(body)
        assert request_id == 9 and reply.status == Status.UNAVAILABLE

    asyncio.run(main())


def test_a_put_end_whose_notice_wakes_a_parked_poll_waits_only_for_its_own_keys():
    """The PutEnd's dispatch answers the segment's parked poll (a PollCommits handler runs between
    the PutEnd's handler and its barrier): that must not widen the PutEnd's wait to every notice,
    so another segment cut off with a notice pending about another key holds nothing here."""

    async def main() -> None:
        cluster = Cluster()
        state = cluster.handlers.state
        other = state.mount_segment("unit", "b", "host-b", ["tcp://127.0.0.1:8"], MiB, inventory=True)
        inventory_done(state, other.segment.segment_id)
        segment, writer, client = cluster.connect(), cluster.connect(), cluster.connect()
        writer.feed(
            frame(
                "PutStart",
                pb.PutStartRequest(namespace=NS, keys=["x"], sizes=[4096], replicas=1, preferred_segment="b"),
            )
        )
        [(_, _, body)] = answers(writer)
        writer.feed(put_end("x", pb.PutStartResponse.FromString(body).put_id))  # "b" never acknowledges it
        assert answers(writer) == []
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")  # on "a" ("b" holds more)
        client.feed(put_end("k", put_id, request_id=9))
        [(_, _, body)] = answers(segment)  # the parked poll, answered inside the PutEnd's dispatch
        segment.feed(cluster.poll(acked=pb.PollCommitsResponse.FromString(body).first_seq))
        [(method, request_id, body)] = answers(client)
        assert (method, request_id) == (rpcframe.METHOD_IDS["PutEnd"], 9)
        assert pb.KeyStatusResponse.FromString(body).status == Status.OK

    asyncio.run(main())


def test_a_parked_answer_waiting_for_a_save_that_never_comes_is_refused_at_once():
    async def main() -> None:
        cluster = Cluster()
        state = cluster.handlers.state
        other = state.mount_segment("unit", "b", "host-b", ["tcp://127.0.0.1:8"], MiB, inventory=True)
        inventory_done(state, other.segment.segment_id)
        state.unsaveable = "cannot save: repair the state file"  # its state store could not be read at start
        state.drop_segment(other.segment.segment_id, reason="unmounted")
        segment, client = cluster.connect(), cluster.connect()
        segment.feed(cluster.poll(acked=0))
        put_id = cluster.put_start(client, "k")
        client.feed(put_end("k", put_id))
        await answered(client, 1.0)
        [(_, _, body)] = answers(client)
        reply = pb.KeyStatusResponse.FromString(body)
        assert reply.status == Status.NOT_DURABLE and reply.error == "cannot save: repair the state file"

    asyncio.run(main())
