"""The master's framed fast-path listener (see kvtier.proto.rpcframe).

Each connection reads frames into its own receive buffer (an
`asyncio.BufferedProtocol`: the event loop reads straight into it) and answers
each with the same `MasterHandlers` method gRPC would call. Handlers are
synchronous and never block, so answering inline on the event loop keeps
responses in order and costs no task per request. While the transport's send
buffer is above its high-water mark the connection stops reading
(backpressure).

PutEnd and Remove are the exception: their answers wait for the segments to
acknowledge the commit log (`CommitWaiter`). So does a segment's PollCommits
that finds no notice queued (a long poll, `CommitPolls`). The connection then
stops reading and parsing until that answer is written, so answers stay in
request order. Those answers are parked, not awaited (no task per wait), and
written as soon as the handler that completes them returns: the notices a
call made go to the waiting polls right after it, and the answers a poll's
acknowledgement completes go out before that poll waits again.

Limits (`FastPathLimits`, from the master's config), kept with the segments'
data plane in one base (kvtier.common.framed_listener; this module keeps the
frame codec, the dispatch and the shared buffer budget):
- at most `max_connections` at once: one more gets an ERROR_METHOD frame that
  names the limit, then the close;
- a connection's buffer is `BASE_BUFFER` bytes, or exactly one frame (header
  and message) when its next frame is larger; a header announcing more than
  `max_message_bytes` gets the error frame and the close. The bytes beyond
  `BASE_BUFFER` come from one budget shared by the listener's connections
  (`max_buffered_bytes`): a connection whose next frame does not fit waits
  with reading paused, first come first served, until others give theirs
  back. So the master buffers at most `max_buffered_bytes` plus `BASE_BUFFER`
  per connection, whatever its peers announce;
- one sweep a second per listener (no timer per connection) cuts a
  connection idle for `idle_timeout_s`, one whose frame has been arriving for
  `request_timeout_s` since its first byte (a slowloris), one that has not
  authenticated within `request_timeout_s`, and one whose answers the peer
  has left unread that long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

from google.protobuf.message import DecodeError

from kvtier.common.framed_listener import ConnectionSet, FramedConnection, ListenerLimits, serve
from kvtier.common.logs import LogBudget
from kvtier.common.units import parse_hostport
from kvtier.master.auth import current_principal
from kvtier.master.commit_wait import WAITING_CALLS, CommitWaiter
from kvtier.master.handlers import MasterHandlers
from kvtier.proto import rpcframe
from kvtier.proto.auth import CLUSTER_PRINCIPAL

logger = logging.getLogger(__name__)
_HEADER = rpcframe.HEADER
_HEADER_SIZE = _HEADER.size
# Every connection's own buffer: many small pipelined frames per read; larger frames borrow from
# the listener's budget. 16 KiB x 4096 connections = 64 MiB at the connection limit.
BASE_BUFFER = 16 << 10
_SCRATCH = memoryview(bytearray(BASE_BUFFER))  # shared by closed connections: what they read is dropped
_LOG_LINES_PER_S = 20  # refusals and cuts logged per second per listener; the rest counted

_WAITING = {rpcframe.METHOD_IDS[name] for name in WAITING_CALLS if name in rpcframe.METHOD_IDS}
_REMOVE_PREFIX = rpcframe.METHOD_IDS.get("RemovePrefix", -1)
_PUT_START = rpcframe.METHOD_IDS["PutStart"]  # may wait for offload (kvtier.master.backpressure)
_POLL_COMMITS = rpcframe.METHOD_IDS["PollCommits"]  # a segment's long poll (kvtier.master.commit_wait)


@dataclass(frozen=True, slots=True)
class FastPathLimits:
    """What the fast path's connections may hold (kvtier.master.config)."""

    max_connections: int = 4096
    idle_timeout_s: float = 600.0  # between requests
    request_timeout_s: float = 60.0  # a frame's first byte to its last; an answer left unread; AUTH
    max_message_bytes: int = rpcframe.MAX_PAYLOAD  # one request message
    max_buffered_bytes: int = 1 << 30  # beyond BASE_BUFFER per connection, over all connections


@dataclass(slots=True)
class FastPathStats:
    """Counters of one listener (event loop thread; kvtier_master_fast_path_*)."""

    connections: int = 0  # open now
    refused_connections: int = 0  # over max_connections
    timed_out_connections: int = 0  # idle, a slow request, unread answers, no AUTH in time
    protocol_errors: int = 0  # frames that could not be trusted: error frame and close
    buffer_waits: int = 0  # a frame waited for room in the shared budget (backpressure)
    buffered_bytes: int = 0  # of the shared budget, held now


class Connections(ConnectionSet["FastPathProtocol"]):
    """The live connections of one listener, their limit and sweep (kvtier.common.framed_listener),
    and the shared buffer budget."""

    limits: FastPathLimits
    stats: FastPathStats

    def __init__(self, limits: FastPathLimits, stats: FastPathStats | None = None) -> None:
        if limits.max_buffered_bytes < limits.max_message_bytes:
            raise ValueError("max_buffered_bytes must hold at least one message of max_message_bytes")
        super().__init__(limits, stats or FastPathStats())
        self._waiters: deque[FastPathProtocol] = deque()
        self._log_budget = LogBudget(logger, "fast path", _LOG_LINES_PER_S)

    # ------------------------------------------------------------ the shared budget

    def reserve(self, connection: FastPathProtocol, nbytes: int) -> bool:
        """Take `nbytes` of the budget for `connection` now (True), or queue it (False): it is then
        called back with `granted()` once the bytes are free, in arrival order."""
        stats = self.stats
        if not self._waiters and stats.buffered_bytes + nbytes <= self.limits.max_buffered_bytes:
            stats.buffered_bytes += nbytes
            return True
        stats.buffer_waits += 1
        self._waiters.append(connection)
        return False

    def release(self, nbytes: int) -> None:
        self.stats.buffered_bytes -= nbytes
        self._grant()

    def forget(self, connection: FastPathProtocol) -> None:
        """A closed connection leaves the queue (its own bytes it released itself)."""
        if connection in self._waiters:
            self._waiters.remove(connection)
            self._grant()

    def _grant(self) -> None:
        limit = self.limits.max_buffered_bytes
        while self._waiters:
            head = self._waiters[0]
            wanted = head.wanted_bytes
            if self.stats.buffered_bytes + wanted > limit:
                return
            self._waiters.popleft()
            self.stats.buffered_bytes += wanted
            head.granted()

    # ------------------------------------------------------------ logging

    def log(self, message: str, fields: dict) -> bool:
        """Log one warning within the listener's budget (kvtier.common.logs.LogBudget)."""
        return self._log_budget.log(logging.WARNING, message, extra={"fields": fields})


class FastPathProtocol(FramedConnection):
    """One client connection. Its receive buffer holds `self._buf[self._start:self._end]`."""

    def __init__(self, handlers: MasterHandlers, waiter: CommitWaiter, connections: Connections | None = None) -> None:
        connections = connections if connections is not None else Connections(FastPathLimits())
        super().__init__(connections, connections.stats, connections.limits.max_message_bytes)
        self._connections: Connections = connections
        self._handlers = handlers
        # Who this connection speaks for: nobody until its AUTH frame when credentials are required.
        self._principal = "" if handlers.auth.enabled else CLUSTER_PRINCIPAL
        self._waiter = waiter
        self._buf = bytearray(BASE_BUFFER)
        self._start = 0  # first byte not parsed yet
        self._end = 0  # end of the bytes received
        self._reserved = 0  # bytes of the shared budget this connection's buffer holds
        self.wanted_bytes = 0  # while queued for the budget: how many more it needs
        self._wanted_size = 0  # ... for a buffer of this size
        self._closing = False
        self._waiting = False  # a PutEnd answer waits for acknowledgements, a PutStart's for offload
        self._budget_wait = False  # queued for the shared budget
        self._reading = True
        self._since = self._connected_at  # idle: since the last byte; a frame pending: since its first byte
        self._dispatch = {
            method: (getattr(handlers, name), request_type)
            for method, (name, request_type, _) in rpcframe.METHODS.items()
        }

    # ----------------------------------------------------------- asyncio hooks

    def refusal(self, limit: int) -> bytes:
        self._connections.log("fast path connection refused", {"peer": self._peer(), "reason": "too many connections"})
        message = f"too many connections: this master's fast path serves {limit} at most; retry later".encode()
        return _HEADER.pack(rpcframe.MAGIC, rpcframe.ERROR_METHOD, 0, len(message)) + message

    def _lost(self) -> None:
        if self._budget_wait:
            self._budget_wait = False
            self._connections.forget(self)
        self._drop_buffer()

    def _writing_paused(self) -> None:
        self._update_reading()

    def _writing_resumed(self) -> None:
        self._update_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closing:
            return _SCRATCH  # closed: swallow what is still in flight
        start, end = self._start, self._end
        if start:  # move the unparsed tail (less than one frame) to the front
            self._buf[: end - start] = self._buf[start:end]
            self._start, self._end = 0, end - start
        if self._end == len(self._buf):
            # Full, yet asked for more: reading should be paused (a PutEnd or the budget waits).
            # Never hand out an empty buffer (uvloop closes the connection on one): room for one more read.
            grown = bytearray(len(self._buf) + BASE_BUFFER)
            grown[: self._end] = self._buf[: self._end]
            self._buf = grown
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        now = time.monotonic()
        if self._start == self._end:
            self._since = now  # the first byte of a frame
        self._end += nbytes
        if not self._waiting:
            self._process(now)

    # ----------------------------------------------------------- limits

    def _is_closed(self) -> bool:
        return self._closing

    def _mark_closed(self) -> None:
        self._closing = True

    def _server_busy(self) -> bool:
        return self._waiting or self._budget_wait  # the master is the one late (CommitWaiter has its own timeout)

    def _stalled_early(self, now: float, limits: ListenerLimits) -> str:
        if not self._principal and now - self._connected_at > limits.request_timeout_s:
            return f"no AUTH frame within {limits.request_timeout_s:g}s"
        return ""

    def _between_requests(self) -> bool:
        return self._start == self._end

    def _request_since(self) -> float:
        return self._since

    def _log_abort(self, reason: str) -> None:
        self._connections.log("fast path connection cut", {"peer": self._peer(), "reason": reason})

    def granted(self) -> None:
        """The budget this connection queued for is its own now: take the larger buffer, read on."""
        self._budget_wait = False
        self._resize(self._wanted_size, self._reserved + self.wanted_bytes)
        self.wanted_bytes = self._wanted_size = 0
        self._since = time.monotonic()  # its sender was not the one late
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or self._closing:
            return
        reading = not (self._closing or self._waiting or self._budget_wait or self._write_paused)
        if reading != self._reading:
            self._reading = reading
            if reading:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _fit(self) -> None:
        """After parsing: size the buffer for the next frame (whose header, when complete, is valid)."""
        start, end = self._start, self._end
        need = BASE_BUFFER
        if end - start >= _HEADER_SIZE:
            need = max(need, _HEADER_SIZE + _HEADER.unpack_from(self._buf, start)[3])
        size = len(self._buf)
        if need <= BASE_BUFFER:
            if size > BASE_BUFFER:  # a large frame is done: give its bytes back
                self._resize(BASE_BUFFER, 0)
        elif need > size:
            more = need - BASE_BUFFER - self._reserved
            if self._connections.reserve(self, more):
                self._resize(need, self._reserved + more)
            else:
                self._budget_wait = True
                self.wanted_bytes, self._wanted_size = more, need
                self._update_reading()

    def _resize(self, size: int, reserved: int) -> None:
        """A new buffer of `size` bytes holding the unparsed bytes; `reserved` of the budget held."""
        start, end = self._start, self._end
        buf = bytearray(size)
        buf[: end - start] = self._buf[start:end]
        self._buf, self._start, self._end = buf, 0, end - start
        if reserved < self._reserved:
            released, self._reserved = self._reserved - reserved, reserved
            self._connections.release(released)
        else:
            self._reserved = reserved

    def _drop_buffer(self) -> None:
        self._buf = bytearray(0)
        self._start = self._end = 0
        if self._reserved:
            released, self._reserved = self._reserved, 0
            self._connections.release(released)

    # ----------------------------------------------------------- frames

    def _process(self, now: float) -> None:
        buffer = self._buf
        consumed = self._start
        end = self._end
        while end - consumed >= _HEADER_SIZE:
            magic, method, request_id, size = _HEADER.unpack_from(buffer, consumed)
            if not self._principal:
                if magic != rpcframe.MAGIC or method != rpcframe.AUTH_METHOD or size > rpcframe.MAX_TOKEN:
                    return self._fatal(request_id, "unauthenticated: this master needs an AUTH frame first")
                frame_end = consumed + _HEADER_SIZE + size
                if end < frame_end:
                    break
                token = bytes(buffer[consumed + _HEADER_SIZE : frame_end]).decode(errors="replace")
                consumed = frame_end
                self._principal = self._handlers.auth.principal(token)
                if not self._principal:
                    return self._fatal(request_id, "unauthenticated: wrong credentials for this cluster")
                self._transport.write(_HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, request_id, 0))
                self._since = now
                continue
            if method == rpcframe.AUTH_METHOD and magic == rpcframe.MAGIC and size <= rpcframe.MAX_TOKEN:
                # Authentication is off here: a client that has a secret anyway is welcome (its token
                # is not checked), rather than pushed to the slower gRPC door for good.
                frame_end = consumed + _HEADER_SIZE + size
                if end < frame_end:
                    break
                consumed = frame_end
                self._transport.write(_HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, request_id, 0))
                continue
            entry = self._dispatch.get(method)
            if magic != rpcframe.MAGIC or entry is None:
                return self._fatal(request_id, f"bad frame: magic={magic:#x} method={method} size={size}")
            if not self.frame_fits(size):
                return self._fatal(
                    request_id,
                    f"bad frame: magic={magic:#x} method={method} size={size} over the limit of {self.max_frame_bytes}",
                )
            frame_end = consumed + _HEADER_SIZE + size
            if end < frame_end:
                break
            handler, request_type = entry
            try:
                request = request_type.FromString(memoryview(buffer)[consumed + _HEADER_SIZE : frame_end])
            except DecodeError:
                return self._fatal(request_id, f"undecodable {request_type.__name__}")
            consumed = frame_end
            self._since = now  # the next frame's first byte, if any, came with this read
            principal = current_principal.set(self._principal)
            try:
                response = handler(request)
            finally:
                current_principal.reset(principal)
            waiter = self._waiter
            if waiter.polls.ready:  # notices this call made (a PutEnd's commits): to their segments first
                waiter.polls.flush()
            wait = None
            if method == _PUT_START and (held := self._handlers.take_put_hold()) is not None:
                wait = self._handlers.put_waiter.finish(held)
            elif method == _REMOVE_PREFIX and (removal := self._handlers.take_removal()) is not None:
                wait = waiter.after_removal(response, removal)  # a sweep in slices: answered when done
            elif method in _WAITING and response.status == 0 and (barrier := waiter.barrier()) is not None:
                self._park(consumed)
                return waiter.park(response, barrier, partial(self._deliver, method, request_id))
            elif method == _POLL_COMMITS:
                waiter.flush()  # the answers its acknowledgement completes go out before it waits
                if waiter.polls.park(request, response, partial(self._deliver, method, request_id), self._principal):
                    return self._park(consumed)
            if wait is not None:
                self._park(consumed)
                asyncio.get_running_loop().create_task(self._answer_later(method, request_id, response, wait))
                return
            reply = response.SerializeToString()
            self._transport.write(_HEADER.pack(rpcframe.MAGIC, method, request_id, len(reply)) + reply)
        if consumed == end:
            self._start = self._end = 0
            if len(buffer) == BASE_BUFFER:  # the common case: nothing buffered, nothing to resize
                return
        else:
            self._start = consumed
        self._fit()

    def _park(self, consumed: int) -> None:
        """The frame up to `consumed` waits for its answer: stop reading and parsing until then."""
        self._start = consumed
        self._waiting = True
        self._update_reading()

    def _deliver(self, method: int, request_id: int, response) -> None:
        """A parked answer (kvtier.master.commit_wait): write it, then read on. Called from another
        connection's dispatch or a timer, so frames already buffered behind it are parsed on the next
        loop turn, never inside the caller's."""
        if not self._write_waited(method, request_id, response):
            return
        if self._start == self._end:
            self._start = self._end = 0
            self._fit()
            self._update_reading()
        else:
            asyncio.get_running_loop().call_soon(self._read_on)

    def _read_on(self) -> None:
        if self._waiting or self._closing or self._transport is None:
            return  # a frame that arrived meanwhile waits again, or the connection is gone
        self._process(time.monotonic())
        self._update_reading()

    async def _answer_later(self, method: int, request_id: int, response, wait) -> None:
        try:
            response = await wait
        except Exception:  # never leave the connection paused: answer, and let the client retry
            logger.exception("waiting for acknowledgements or offload failed")
            response = type(response)(status=-1, error="internal error while waiting for acknowledgements")
        if self._write_waited(method, request_id, response):
            self._process(self._since)
            self._update_reading()

    def _write_waited(self, method: int, request_id: int, response) -> bool:
        """Write the answer the connection waited for and stop waiting; False when it is gone."""
        transport = self._transport
        if transport is None or self._closing:
            return False
        reply = response.SerializeToString()
        transport.write(_HEADER.pack(rpcframe.MAGIC, method, request_id, len(reply)) + reply)
        self._waiting = False
        self._since = time.monotonic()
        return True

    def _fatal(self, request_id: int, reason: str) -> None:
        self._connections.stats.protocol_errors += 1
        self._connections.log("fast path protocol error, closing", {"peer": self._peer(), "detail": reason})
        message = reason.encode()
        self._transport.write(_HEADER.pack(rpcframe.MAGIC, rpcframe.ERROR_METHOD, request_id, len(message)) + message)
        self._closing = True
        self._drop_buffer()
        self._transport.close()


class FastPathListener:
    """A bound fast path: its server, its connections and their counters."""

    def __init__(self, server: asyncio.AbstractServer, connections: Connections) -> None:
        self.server = server
        self.connections = connections

    @property
    def stats(self) -> FastPathStats:
        return self.connections.stats

    def close(self) -> None:
        self.connections.stop()
        self.server.close()


async def start_fast_path(
    listen: str,
    handlers: MasterHandlers,
    waiter: CommitWaiter,
    advertise_host: str = "",
    limits: FastPathLimits | None = None,
) -> FastPathListener:
    """Listen on `listen` (HOST:PORT, port 0 = any); set `handlers.fast_endpoint` (with
    `advertise_host` in place of the bound host when given)."""
    connections = Connections(limits or FastPathLimits())
    server, handlers.fast_endpoint = await serve(
        parse_hostport(listen), lambda: FastPathProtocol(handlers, waiter, connections), connections, advertise_host
    )
    logger.info("fast path listening endpoint=%s", handlers.fast_endpoint)
    return FastPathListener(server, connections)
