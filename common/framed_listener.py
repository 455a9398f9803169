"""A bounded listener for a framed protocol on asyncio: what the master's fast path and the segment's
data plane share, written once.

Both serve many clients over long-lived TCP connections, one
`asyncio.BufferedProtocol` per connection, and both must stay bounded
whatever their peers do. This module holds the part that does not depend on
the frames (kvtier.proto.rpcframe for the fast path, kvtier.proto.frames for
the data plane); each side keeps only its frame codec and dispatch:

- `ConnectionSet`: the live connections of one listener, their limit, and one
  sweep a second (one timer per listener, none per connection) that aborts
  each connection whose `stalled()` names a reason, counted in
  `timed_out_connections`.
- `FramedConnection`: one connection's bounded life. At accept, a connection
  over `max_connections` gets the side's refusal frame (`refusal()`: an error
  frame that names the limit) and the close, before any of its bytes is read;
  the others are counted, get TCP_NODELAY, and are swept:
  * idle (between requests) longer than `idle_timeout_s`;
  * a request still arriving `request_timeout_s` after its first byte (a slow
    sender, a slowloris);
  * answers the peer has left unread that long (its reading stopped while our
    send buffer stays above the high-water mark);
  * whatever the side adds before a request (`_stalled_early`: the fast
    path's missing AUTH frame), never while the server itself is the one
    late (`_server_busy`: an answer waiting on commits, a disk read).
  `frame_fits(size)` is the one test of a frame against the side's
  `max_frame_bytes` (a larger frame is a protocol error: error frame, close).
- `serve()`: bind, start the sweep, and name the endpoint to advertise.

Everything runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import abc
import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

SWEEP_INTERVAL_S = 1.0


class ListenerLimits(Protocol):
    """What every listener's limits name (each side's frozen dataclass adds its own)."""

    @property
    def max_connections(self) -> int: ...
    @property
    def idle_timeout_s(self) -> float: ...  # between requests
    @property
    def request_timeout_s(self) -> float: ...  # a request's first byte to its last; answers left unread


class ListenerStats(Protocol):
    """The counters every listener keeps (each side's stats dataclass adds its own)."""

    connections: int  # open now
    refused_connections: int  # over max_connections
    timed_out_connections: int  # cut by the sweep


C = TypeVar("C", bound="FramedConnection")


class ConnectionSet(Generic[C]):
    """The live connections of one listener, their limit, and the sweep that cuts stalled ones."""

    def __init__(self, limits: Any, stats: Any) -> None:
        self.limits = limits  # a ListenerLimits
        self.stats = stats  # a ListenerStats
        self.live: set[C] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self._sweep)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _sweep(self) -> None:
        now = time.monotonic()
        for connection in list(self.live):
            if reason := connection.stalled(now, self.limits):
                self.stats.timed_out_connections += 1
                connection.abort(reason)
        self._timer = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self._sweep)


class FramedConnection(asyncio.BufferedProtocol, metaclass=abc.ABCMeta):
    """One connection's accept, refusal, backpressure clock and sweep test (see the module docstring).

    A side implements `refusal`, `_is_closed`, `_mark_closed`, `_between_requests`,
    `_request_since`, `_server_busy` and `_log_abort`; it may add `_stalled_early`,
    `_accepted`, `_lost`, `_writing_paused` and `_writing_resumed`. Its own
    `_transport` is set before any hook runs and is None once the connection is lost.
    """

    ANSWERS = "answer"  # what the peer leaves unread, in the sweep's reason

    def __init__(self, connections: ConnectionSet | None, stats: Any, max_frame_bytes: int) -> None:
        self._connections = connections  # None: no limit and no sweep (a connection driven by a test)
        self._listener_stats = stats  # a ListenerStats: `connections` counted here even without a set
        self.max_frame_bytes = max_frame_bytes
        self._transport: Any = None
        self._refused = False
        self._write_paused = False
        now = time.monotonic()
        self._connected_at = now
        self._paused_since = 0.0  # when answers backed up

    # ----------------------------------------------------------- to implement

    @abc.abstractmethod
    def refusal(self, limit: int) -> bytes:
        """The frame that tells a connection over the limit why it is closed (no request read)."""

    @abc.abstractmethod
    def _is_closed(self) -> bool:
        """Whether the side has closed (or marked closed) this connection."""

    @abc.abstractmethod
    def _mark_closed(self) -> None:
        """From now on every byte that arrives is dropped, and nothing more is parsed."""

    @abc.abstractmethod
    def _between_requests(self) -> bool:
        """No byte of a request received yet (idle)."""

    @abc.abstractmethod
    def _request_since(self) -> float:
        """Monotonic time of the current request's first byte, or of the last request when idle."""

    @abc.abstractmethod
    def _server_busy(self) -> bool:
        """The server is the one late (it holds an answer back on purpose): not the peer's stall."""

    @abc.abstractmethod
    def _log_abort(self, reason: str) -> None:
        """Log that the sweep (or the side itself) cuts this connection."""

    # ----------------------------------------------------------- optional hooks

    def _stalled_early(self, now: float, limits: ListenerLimits) -> str:
        return ""

    def _accepted(self) -> None:
        """Admitted: counted and live."""

    def _lost(self) -> None:
        """An admitted connection is gone: give back what it holds."""

    def _writing_paused(self) -> None:
        """The transport's send buffer passed its high-water mark: stop reading."""

    def _writing_resumed(self) -> None:
        """Below the low-water mark again: read on, unless the side waits for something else."""

    # ----------------------------------------------------------- asyncio hooks

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        connections = self._connections
        if connections is not None:
            limit = connections.limits.max_connections
            if len(connections.live) >= limit:
                self._listener_stats.refused_connections += 1
                self._refused = True
                self._mark_closed()
                transport.write(self.refusal(limit))
                transport.close()
                return
            connections.live.add(self)
        self._listener_stats.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._accepted()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._mark_closed()
        if self._refused:
            return
        if self._connections is not None:
            self._connections.live.discard(self)
        self._listener_stats.connections -= 1
        self._lost()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._paused_since = time.monotonic()
        self._writing_paused()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._writing_resumed()

    def eof_received(self) -> bool:
        return False  # close our side too

    # ----------------------------------------------------------- limits

    def frame_fits(self, size: int) -> bool:
        """Whether a frame (its message or payload) of `size` bytes is within `max_frame_bytes`."""
        return size <= self.max_frame_bytes

    def stalled(self, now: float, limits: ListenerLimits) -> str:
        """Why this connection should be cut now ("" = it is fine)."""
        if self._transport is None or self._is_closed():
            return ""
        if self._write_paused and now - self._paused_since > limits.request_timeout_s:
            return f"the peer has read no {self.ANSWERS} for {limits.request_timeout_s:g}s"
        if self._server_busy():
            return ""
        if reason := self._stalled_early(now, limits):
            return reason
        waited = now - self._request_since()
        if self._between_requests():
            return f"idle for {limits.idle_timeout_s:g}s" if waited > limits.idle_timeout_s else ""
        if waited > limits.request_timeout_s:
            return f"a request still incomplete after {limits.request_timeout_s:g}s"
        return ""

    def abort(self, reason: str) -> None:
        """Cut the connection now: queued bytes are dropped unsent."""
        self._log_abort(reason)
        self._mark_closed()
        if self._transport is not None:
            self._transport.abort()

    def _peer(self) -> str:
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


async def serve(
    listen: tuple[str, int],
    factory: Callable[[], FramedConnection],
    connections: ConnectionSet,
    advertise_host: str = "",
) -> tuple[asyncio.AbstractServer, str]:
    """Listen on (host, port) (port 0: any), start the sweep; the server and its endpoint URL
    (`tcp://HOST:PORT`, with `advertise_host` in place of the bound host when given)."""
    loop = asyncio.get_running_loop()
    host, port = listen
    server = await loop.create_server(factory, host=host, port=port, reuse_address=True, backlog=512)
    connections.start()
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    bound_host = advertise_host or bound_host
    return server, f"tcp://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
