"""The fast path's limits, with a fake transport and an injected clock where time matters
(kvtier.master.fastpath: max_connections, timeouts, the shared buffer budget)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvtier.master.fastpath import BASE_BUFFER, Connections, FastPathLimits
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from tests.unit.master.fastpath_fakes import HEADER, connect, frames_of, make_handlers

EXISTS = rpcframe.METHOD_IDS["Exists"]
LIMIT = 64 << 10


def exists(request_id: int, keys: list[str]) -> bytes:
    payload = pb.KeysRequest(namespace="ns", keys=keys).SerializeToString()
    return HEADER.pack(rpcframe.MAGIC, EXISTS, request_id, len(payload)) + payload


def large_exists(request_id: int, size: int) -> bytes:
    """An Exists frame whose payload is about `size` bytes (keys of 1000 bytes)."""
    keys = [f"{i:04d}" + "k" * 996 for i in range(size // 1003)]
    return exists(request_id, keys)


def answered(conn) -> list[tuple[int, int]]:
    return [(method, request_id) for method, request_id, _ in frames_of(conn.transport.stream)]


# ------------------------------------------------------------------ max_connections


def test_a_connection_over_the_limit_gets_an_error_frame_naming_the_limit_then_the_close():
    connections = Connections(FastPathLimits(max_connections=2))
    handlers = make_handlers()
    first, second = connect(handlers, connections), connect(handlers, connections)
    extra = connect(handlers, connections)
    [(method, request_id, body)] = frames_of(extra.transport.stream)
    assert (method, request_id) == (rpcframe.ERROR_METHOD, 0)
    assert b"too many connections" in body and b"2 at most" in body
    assert extra.transport.closed and not extra.transport.aborted
    assert extra.feed(exists(1, ["k"])) == 0, "nothing is read from a refused connection"
    assert connections.stats.refused_connections == 1 and connections.stats.connections == 2
    extra.lose()  # a refused connection was never counted
    assert connections.stats.connections == 2
    first.feed(exists(1, ["k"]))
    assert answered(first) == [(EXISTS, 1)], "the connections within the limit are served"
    second.lose()
    again = connect(handlers, connections)
    again.feed(exists(2, ["k"]))
    assert answered(again) == [(EXISTS, 2)], "a slot given back is taken again"


# ------------------------------------------------------------------ timeouts


LIMITS = FastPathLimits(idle_timeout_s=100.0, request_timeout_s=10.0, max_message_bytes=LIMIT)


def test_an_idle_connection_is_stalled_after_idle_timeout_not_before():
    conn = connect(limits=LIMITS)
    conn.feed(exists(1, ["k"]))
    since = conn.protocol._since
    assert conn.protocol.stalled(since + 99, LIMITS) == ""
    assert conn.protocol.stalled(since + 101, LIMITS) == "idle for 100s"


def test_a_frame_still_arriving_after_request_timeout_since_its_first_byte_is_stalled():
    conn = connect(limits=LIMITS)
    data = exists(1, ["k"])
    conn.feed(data[:3])
    first_byte = conn.protocol._since
    conn.feed(data[3:6])  # more bytes of the same frame do not restart its clock
    assert conn.protocol._since == first_byte
    assert conn.protocol.stalled(first_byte + 9, LIMITS) == ""
    assert conn.protocol.stalled(first_byte + 11, LIMITS) == "a request still incomplete after 10s"


def test_an_answered_frame_restarts_the_clock_for_the_next_one():
    conn = connect(limits=LIMITS)
    data = exists(1, ["k"]) + exists(2, ["k"])
    conn.feed(data[:10])
    conn.protocol._since -= 50  # the first frame has been arriving for a long time...
    conn.feed(data[10:30])  # ...and is now complete, with the next one's first bytes
    assert answered(conn) == [(EXISTS, 1)]
    assert conn.protocol.stalled(time.monotonic() + 5, LIMITS) == ""


def test_a_peer_that_reads_no_answers_is_stalled_after_request_timeout():
    conn = connect(limits=LIMITS)
    conn.protocol.pause_writing()
    assert not conn.transport.reading, "no new request is read while answers back up"
    paused = conn.protocol._paused_since
    assert conn.protocol.stalled(paused + 11, LIMITS) == "the peer has read no answer for 10s"
    conn.protocol.resume_writing()
    assert conn.transport.reading
    assert conn.protocol.stalled(paused + 11, LIMITS) == ""


def test_without_an_auth_frame_a_connection_is_stalled_after_request_timeout():
    conn = connect(make_handlers(b"s" * 32), limits=LIMITS)
    assert conn.protocol.stalled(conn.protocol._connected_at + 11, LIMITS) == "no AUTH frame within 10s"


def test_the_sweep_aborts_stalled_connections_and_counts_them():
    async def main() -> None:
        connections = Connections(LIMITS)
        idle, busy = connect(connections=connections), connect(connections=connections)
        busy.feed(exists(1, ["k"])[:5])
        idle.protocol._since -= 101
        connections._sweep()
        connections.stop()
        assert idle.transport.aborted and not busy.transport.aborted
        assert connections.stats.timed_out_connections == 1

    asyncio.run(main())


# ------------------------------------------------------------------ buffers


def test_a_header_announcing_more_than_max_message_bytes_is_refused_before_its_payload():
    conn = connect(limits=LIMITS)
    conn.feed(HEADER.pack(rpcframe.MAGIC, EXISTS, 9, LIMIT + 1))
    [(method, request_id, body)] = frames_of(conn.transport.stream)
    assert (method, request_id) == (rpcframe.ERROR_METHOD, 9)
    assert f"size={LIMIT + 1} over the limit of {LIMIT}".encode() in body
    assert conn.transport.closed and conn.protocol._connections.stats.buffered_bytes == 0


def test_a_large_frame_gets_a_buffer_of_exactly_its_size_and_gives_it_back():
    conn = connect(limits=LIMITS)
    data = large_exists(1, 40_000)
    conn.feed(data, 1000)
    assert answered(conn) == [(EXISTS, 1)]
    assert max(conn.buffer_sizes) == len(data), "one frame, header included, and no more"
    assert len(conn.protocol._buf) == BASE_BUFFER
    assert conn.protocol._connections.stats.buffered_bytes == 0


def test_a_frame_that_does_not_fit_the_shared_budget_waits_unread_until_room_is_given_back():
    connections = Connections(FastPathLimits(max_message_bytes=LIMIT, max_buffered_bytes=LIMIT))
    handlers = make_handlers()
    first, second, small = (connect(handlers, connections) for _ in range(3))
    big1, big2 = large_exists(1, 60_000), large_exists(2, 60_000)
    first.feed(big1[:30_000])
    taken = second.feed(big2[:30_000])  # what it does not read stays in the kernel meanwhile
    assert taken < 30_000 and not second.transport.reading, "the second large frame waits, its connection unread"
    assert connections.stats.buffer_waits == 1
    assert second.protocol.stalled(time.monotonic() + 3600, connections.limits) == "", "waiting is not slowness"
    small.feed(exists(3, ["k"]))  # small frames need no budget: served meanwhile
    assert answered(small) == [(EXISTS, 3)]
    first.feed(big1[30_000:])
    assert answered(first) == [(EXISTS, 1)]
    assert second.transport.reading, "the room given back went to the waiting connection"
    second.feed(big2[taken:])
    assert answered(second) == [(EXISTS, 2)]
    assert connections.stats.buffered_bytes == 0


def test_a_connection_lost_while_waiting_for_the_budget_leaves_the_queue():
    connections = Connections(FastPathLimits(max_message_bytes=LIMIT, max_buffered_bytes=LIMIT))
    handlers = make_handlers()
    first, second, third = (connect(handlers, connections) for _ in range(3))
    frames = [large_exists(i, 60_000) for i in (1, 2, 3)]
    first.feed(frames[0][:20_000])
    second.feed(frames[1][:20_000])
    taken = third.feed(frames[2][:20_000])
    second.lose()
    first.lose()  # its bytes go to the next in line, the third
    assert third.transport.reading
    third.feed(frames[2][taken:])
    assert answered(third) == [(EXISTS, 3)]
    third.lose()
    assert connections.stats.buffered_bytes == 0 and not connections._waiters


def test_the_budget_must_hold_one_message():
    with pytest.raises(ValueError, match="at least one message"):
        Connections(FastPathLimits(max_message_bytes=LIMIT, max_buffered_bytes=LIMIT - 1))


# ------------------------------------------------------------------ logs


def test_refusals_are_logged_at_most_a_few_lines_a_second(caplog):
    # The budget is per clock second: a flood that happens to cross into the next one (a loaded
    # machine) is measured again, within one second, so the bound checked is the budget's own.
    for _ in range(5):
        caplog.clear()
        connections = Connections(FastPathLimits())
        second = int(time.monotonic())
        with caplog.at_level(logging.WARNING, logger="kvtier.master.fastpath"):
            logged = sum(connections.log("fast path protocol error, closing", {"n": i}) for i in range(100))
        if int(time.monotonic()) == second:
            break
    assert logged == len(caplog.records) <= 20
