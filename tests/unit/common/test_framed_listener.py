"""The bounded framed-listener base (common/framed_listener.py) with a toy frame codec, over real
sockets on a real uvloop event loop.

The toy side (`Echo`) keeps only what each real side keeps (its frame codec and dispatch): frames
are a 4-byte length and a body, answered with the same frame; a body over `max_frame_bytes` gets an
error frame and the close. Checked: a connection over `max_connections` gets the refusal frame at
accept and is never counted live; the counters follow accepts and closes; the sweep cuts an idle
connection, a slow sender and a peer that reads no answers (each after its own limit, not before)
and counts them, never a connection the server itself holds back; `serve()` names the endpoint.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass

import pytest
import uvloop

from kvtier.common.framed_listener import ConnectionSet, FramedConnection, serve

LENGTH = struct.Struct("<I")
REFUSED = b"REFUSED"


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int = 2
    idle_timeout_s: float = 100.0
    request_timeout_s: float = 10.0


@dataclass(slots=True)
class Stats:
    connections: int = 0
    refused_connections: int = 0
    timed_out_connections: int = 0


class Echo(FramedConnection):
    """A length-prefixed echo: the codec and dispatch a side keeps on the base."""

    def __init__(self, connections: ConnectionSet | None, stats: Stats, max_frame: int = 1 << 16) -> None:
        super().__init__(connections, stats, max_frame)
        self.buf = bytearray(1 << 16)
        self.have = 0
        self.since = self._connected_at
        self.closed = False
        self.held = False  # the server holds its answer back (the side's own wait)
        self.cuts: list[str] = []

    def refusal(self, limit: int) -> bytes:
        return LENGTH.pack(len(REFUSED)) + REFUSED

    def _is_closed(self) -> bool:
        return self.closed

    def _mark_closed(self) -> None:
        self.closed = True

    def _between_requests(self) -> bool:
        return self.have == 0

    def _request_since(self) -> float:
        return self.since

    def _server_busy(self) -> bool:
        return self.held

    def _log_abort(self, reason: str) -> None:
        self.cuts.append(reason)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)[self.have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if self.have == 0:
            self.since = time.monotonic()
        self.have += nbytes
        while self.have >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self.buf)
            if not self.frame_fits(size):
                self._transport.write(LENGTH.pack(0))
                self._mark_closed()
                self._transport.close()
                return
            if self.have < LENGTH.size + size:
                return
            end = LENGTH.size + size
            self._transport.write(bytes(self.buf[:end]))
            self.buf[: self.have - end] = self.buf[end : self.have]
            self.have -= end
            self.since = time.monotonic()


class Listener:
    """An Echo listener on its own uvloop loop, driven from the test thread step by step."""

    def __init__(self, limits: Limits, max_frame: int = 1 << 16) -> None:
        self.loop = uvloop.new_event_loop()
        self.stats = Stats()
        self.connections: ConnectionSet[Echo] = ConnectionSet(limits, self.stats)
        self.server, self.endpoint = self.run(
            serve(("127.0.0.1", 0), lambda: Echo(self.connections, self.stats, max_frame), self.connections)
        )
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def settle(self, predicate, rounds: int = 2000) -> bool:
        """Run the loop until `predicate()` holds (the loop does the I/O the test waits for)."""
        for _ in range(rounds):
            if predicate():
                return True
            self.run(asyncio.sleep(0.002))
        return predicate()

    def dial(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setblocking(False)
        return sock

    def receive(self, sock: socket.socket, size: int) -> bytes:
        got = bytearray()

        def more() -> bool:
            try:
                chunk = sock.recv(size - len(got))
            except BlockingIOError:
                return False
            if not chunk:
                return True
            got.extend(chunk)
            return len(got) >= size

        self.settle(more)
        return bytes(got)

    def close(self) -> None:
        self.connections.stop()
        self.server.close()
        self.run(self.server.wait_closed())
        self.loop.close()


@pytest.fixture
def listener():
    listener = Listener(Limits())
    yield listener
    listener.close()


def frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def test_serve_names_the_bound_endpoint(listener):
    assert listener.endpoint == f"tcp://127.0.0.1:{listener.port}"


def test_frames_are_answered_by_the_side_and_connections_counted(listener):
    sock = listener.dial()
    try:
        sock.sendall(frame(b"hello"))
        assert listener.receive(sock, 9) == frame(b"hello")
        assert listener.stats.connections == 1 and len(listener.connections.live) == 1
    finally:
        sock.close()
    assert listener.settle(lambda: listener.stats.connections == 0)
    assert not listener.connections.live


def test_a_connection_over_the_limit_gets_the_refusal_frame_and_is_never_live(listener):
    first, second = listener.dial(), listener.dial()
    assert listener.settle(lambda: listener.stats.connections == 2)
    third = listener.dial()
    try:
        assert listener.receive(third, 4 + len(REFUSED)) == frame(REFUSED)
        assert listener.settle(lambda: third.recv(1) == b"" if _readable(third) else False), "not closed"
        assert listener.stats.refused_connections == 1
        assert listener.stats.connections == 2 and len(listener.connections.live) == 2
        first.close()
        assert listener.settle(lambda: listener.stats.connections == 1)
        fourth = listener.dial()  # room again
        fourth.sendall(frame(b"x"))
        assert listener.receive(fourth, 5) == frame(b"x")
        fourth.close()
    finally:
        for sock in (first, second, third):
            sock.close()


def _readable(sock: socket.socket) -> bool:
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    return True


def test_a_frame_over_the_side_limit_is_refused():
    listener = Listener(Limits(), max_frame=8)
    sock = listener.dial()
    try:
        sock.sendall(frame(b"123456789"))
        assert listener.receive(sock, 4) == LENGTH.pack(0)
    finally:
        sock.close()
        listener.close()


def connected(listener: Listener) -> tuple[socket.socket, Echo]:
    sock = listener.dial()
    assert listener.settle(lambda: len(listener.connections.live) == 1)
    return sock, next(iter(listener.connections.live))


def test_an_idle_connection_is_stalled_after_the_idle_timeout_not_before(listener):
    sock, conn = connected(listener)
    try:
        since = conn.since
        assert conn.stalled(since + 99, Limits()) == ""
        assert conn.stalled(since + 101, Limits()) == "idle for 100s"
    finally:
        sock.close()


def test_a_slow_sender_is_stalled_request_timeout_after_its_first_byte(listener):
    sock, conn = connected(listener)
    try:
        sock.sendall(LENGTH.pack(100) + b"partial")
        assert listener.settle(lambda: conn.have > 0)
        first_byte = conn.since
        assert conn.stalled(first_byte + 9, Limits()) == ""
        assert conn.stalled(first_byte + 11, Limits()) == "a request still incomplete after 10s"
        conn.held = True  # the server is the one late: never the peer's stall
        assert conn.stalled(first_byte + 3600, Limits()) == ""
    finally:
        sock.close()


def test_a_peer_that_reads_no_answers_is_stalled_after_the_request_timeout(listener):
    sock, conn = connected(listener)
    try:
        conn.pause_writing()  # what the transport calls above its high-water mark
        paused = conn._paused_since
        assert conn.stalled(paused + 9, Limits()) == ""
        assert conn.stalled(paused + 11, Limits()) == "the peer has read no answer for 10s"
        conn.held = True  # even while the server waits on its side: unread answers are the peer's
        assert conn.stalled(paused + 11, Limits()) == "the peer has read no answer for 10s"
        conn.resume_writing()
        conn.held = False
        assert conn.stalled(paused + 11, Limits()) == ""
    finally:
        sock.close()


async def sweep(connections: ConnectionSet) -> None:
    connections._sweep()  # what the timer runs every SWEEP_INTERVAL_S, on the loop


def test_the_sweep_cuts_stalled_connections_counts_them_and_spares_the_others(listener):
    stalled_sock, stalled = connected(listener)
    busy_sock = listener.dial()
    assert listener.settle(lambda: len(listener.connections.live) == 2)
    busy = next(c for c in listener.connections.live if c is not stalled)
    try:
        stalled.since -= 1000  # idle for longer than the idle timeout
        busy.since -= 1000
        busy.held = True
        listener.run(sweep(listener.connections))
        assert stalled.cuts == ["idle for 100s"] and busy.cuts == []
        assert listener.stats.timed_out_connections == 1
        assert listener.settle(lambda: listener.stats.connections == 1), "the stalled one was not closed"
        assert listener.receive(stalled_sock, 1) == b"", "the peer did not see the close"
    finally:
        stalled_sock.close()
        busy_sock.close()


def test_the_sweep_runs_on_its_own_timer():
    listener = Listener(Limits(idle_timeout_s=0.01))
    sock = listener.dial()
    try:
        # Within a few sweep intervals (1 s each) the idle connection is gone: the timer re-arms.
        assert listener.settle(lambda: listener.stats.timed_out_connections == 1, rounds=2500)
        assert listener.receive(sock, 1) == b""
    finally:
        sock.close()
        listener.close()
