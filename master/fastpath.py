"""The master's framed fast-path listener (see kvtier.proto.rpcframe).

Each connection parses frames from a receive buffer and answers each with the
same `MasterHandlers` method gRPC would call. Handlers are synchronous and
never block, so answering inline on the event loop keeps responses in order
and costs no task per request. While the transport's send buffer is above
its high-water mark the connection stops reading (backpressure).

PutEnd and Remove are the exception: their answers wait for the segments to
acknowledge the commit log (`CommitWaiter`). The connection then stops
reading and parsing until that answer is written, so answers stay in
request order.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from google.protobuf.message import DecodeError

from kvtier.master.auth import current_principal
from kvtier.master.servicer import WAITING_CALLS, CommitWaiter, MasterHandlers
from kvtier.proto import rpcframe
from kvtier.proto.auth import CLUSTER_PRINCIPAL
from kvtier.proto.units import parse_hostport

logger = logging.getLogger(__name__)
_HEADER = rpcframe.HEADER
_HEADER_SIZE = _HEADER.size


_WAITING = {rpcframe.METHOD_IDS[name] for name in WAITING_CALLS if name in rpcframe.METHOD_IDS}


class FastPathProtocol(asyncio.Protocol):
    def __init__(self, handlers: MasterHandlers, waiter: CommitWaiter) -> None:
        self._handlers = handlers
        # Who this connection speaks for: nobody until its AUTH frame when credentials are required.
        self._principal = "" if handlers.auth.enabled else CLUSTER_PRINCIPAL
        self._waiter = waiter
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self._waiting = False  # a PutEnd answer is waiting for acknowledgements
        self._write_paused = False
        self._dispatch = {
            method: (getattr(handlers, name), request_type)
            for method, (name, request_type, _) in rpcframe.METHODS.items()
        }

    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self._transport = None
        self._buffer = bytearray()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._closing and not self._waiting:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._buffer += data
        if not self._waiting:
            self._process()

    def _process(self) -> None:
        buffer = self._buffer
        consumed = 0
        while len(buffer) - consumed >= _HEADER_SIZE:
            magic, method, request_id, size = _HEADER.unpack_from(buffer, consumed)
            if not self._principal:
                if magic != rpcframe.MAGIC or method != rpcframe.AUTH_METHOD or size > rpcframe.MAX_TOKEN:
                    return self._fatal(request_id, "unauthenticated: this master needs an AUTH frame first")
                end = consumed + _HEADER_SIZE + size
                if len(buffer) < end:
                    break
                token = bytes(buffer[consumed + _HEADER_SIZE : end]).decode(errors="replace")
                consumed = end
                self._principal = self._handlers.auth.principal(token)
                if not self._principal:
                    return self._fatal(request_id, "unauthenticated: wrong credentials for this cluster")
                self._transport.write(_HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, request_id, 0))
                continue
            entry = self._dispatch.get(method)
            if magic != rpcframe.MAGIC or entry is None or size > rpcframe.MAX_PAYLOAD:
                return self._fatal(request_id, f"bad frame: magic={magic:#x} method={method} size={size}")
            end = consumed + _HEADER_SIZE + size
            if len(buffer) < end:
                break
            handler, request_type = entry
            try:
                request = request_type.FromString(memoryview(buffer)[consumed + _HEADER_SIZE : end])
            except DecodeError:
                return self._fatal(request_id, f"undecodable {request_type.__name__}")
            consumed = end
            principal = current_principal.set(self._principal)
            try:
                response = handler(request)
            finally:
                current_principal.reset(principal)
            if method in _WAITING and response.status == 0 and (barrier := self._waiter.barrier()) is not None:
                del buffer[:consumed]
                self._waiting = True
                self._transport.pause_reading()
                asyncio.get_running_loop().create_task(self._answer_later(method, request_id, response, barrier))
                return
            reply = response.SerializeToString()
            self._transport.write(_HEADER.pack(rpcframe.MAGIC, method, request_id, len(reply)) + reply)
        if consumed:
            del buffer[:consumed]

    async def _answer_later(self, method: int, request_id: int, response, barrier) -> None:
        try:
            response = await self._waiter.finish(response, barrier)
        except Exception:  # never leave the connection paused: answer, and let the client retry
            logger.exception("waiting for acknowledgements failed")
            response = type(response)(status=-1, error="internal error while waiting for acknowledgements")
        transport = self._transport
        if transport is None or self._closing:
            return
        reply = response.SerializeToString()
        transport.write(_HEADER.pack(rpcframe.MAGIC, method, request_id, len(reply)) + reply)
        self._waiting = False
        if not self._write_paused:
            transport.resume_reading()
        self._process()

    def _fatal(self, request_id: int, reason: str) -> None:
        peer = self._transport.get_extra_info("peername")
        logger.warning("fast path protocol error peer=%s: %s; closing", peer, reason)
        message = reason.encode()
        self._transport.write(_HEADER.pack(rpcframe.MAGIC, rpcframe.ERROR_METHOD, request_id, len(message)) + message)
        self._closing = True
        self._buffer = bytearray()
        self._transport.close()


async def start_fast_path(
    listen: str, handlers: MasterHandlers, waiter: CommitWaiter, advertise_host: str = ""
) -> asyncio.AbstractServer:
    """Listen on `listen` (HOST:PORT, port 0 = any); set `handlers.fast_endpoint` (with
    `advertise_host` in place of the bound host when given)."""
    host, port = parse_hostport(listen)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FastPathProtocol(handlers, waiter), host=host, port=port, reuse_address=True, backlog=512
    )
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    bound_host = advertise_host or bound_host
    handlers.fast_endpoint = f"tcp://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
    logger.info("fast path listening endpoint=%s", handlers.fast_endpoint)
    return server
