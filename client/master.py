"""The client's link to the master: gRPC, plus the framed fast path for the hot calls.

`call(method, request)` sends the hot per-batch calls (see
`kvtier.proto.rpcframe.METHODS`) over the master's fast path when the master
advertises one in `Hello`, and everything else, or everything when the fast
path is off or unreachable, over gRPC. Both carry the same messages to the
same handlers.

Failure handling, written once here:
- gRPC UNAVAILABLE (master restarting, connection refused) is retried with
  exponential back-off from 50 ms to 1 s, with jitter (kvtier.common.poller.Backoff),
  until the caller's deadline.
- A reply whose status is UNAVAILABLE (the master is recovering after a
  restart, or is a standby) is retried the same way; the master answered
  before doing anything, so every call, PutStart included, may be repeated.
- The master can move (`address` is a list or etcd://..., see
  kvtier.common.discovery): after a failure or a standby's refusal the client
  asks its `MasterLocator` for the leader (a standby's `leader=` hint first)
  and reconnects there, fast path included. Each attempt then gets at most
  ATTEMPT_S of the caller's timeout: a leader that hangs (paused, cut off)
  must not hold the call until the whole timeout is gone.
- A fast-path connection that cannot be opened switches this client to gRPC
  and asks `Hello` again a second later (a restarted master listens elsewhere).
- A fast-path exchange that broke after the request was sent is retried over
  gRPC only for calls that are safe to repeat; a broken PutStart raises
  UNAVAILABLE (its allocations are reclaimed by the master's put timeout).
  When the master can move (HA) a PutStart is repeated too: the master that
  hung is most likely a deposed leader, which refuses it when it wakes; at
  worst a live one allocated twice, and the keys answer PUT_IN_PROGRESS until
  the first allocation times out.
- A response whose whole-request `status` is not OK raises KvtierError.
Thread-safe: the gRPC channel and the socket pool are shared.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import grpc

from kvtier.client.sockpool import SocketPool, recv_exact, send_all
from kvtier.common.channels import Credentials, open_channel
from kvtier.common.discovery import MasterLocator, leader_hint
from kvtier.common.logs import request_id as current_request_id
from kvtier.common.poller import Backoff
from kvtier.common.units import parse_hostport
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc, rpcframe
from kvtier.proto.errors import ConnectError, KvtierError, ProtocolError, TransportError
from kvtier.proto.status import Status, to_status

logger = logging.getLogger(__name__)
# Requests that carry the client call's request id (kvtier.common.logs).
_TRACED = frozenset(
    (
        pb.KeysRequest,
        pb.ExistsRequest,
        pb.PutStartRequest,
        pb.PutEndRequest,
        pb.PutRevokeRequest,
        pb.RemovePrefixRequest,
        pb.RemoveReplicasRequest,
        pb.RegisterInstanceRequest,
        pb.ReportCorruptRequest,
        pb.SegmentFailuresRequest,
    )
)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_DENIED = {
    grpc.StatusCode.UNAUTHENTICATED: Status.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
}
_UNAVAILABLE = int(Status.UNAVAILABLE)

# Clients of this process, told when it forks: a child has their sockets and gRPC channel but none of
# their threads, and a call there hung (a pool's job never ran) or crossed the parent's replies.
_ALIVE: weakref.WeakSet[MasterClient] = weakref.WeakSet()


def _forked() -> None:
    for client in list(_ALIVE):
        client.forked_from = client.made_in


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def closed_error() -> KvtierError:
    return KvtierError(Status.CANCELLED, "client is closed")


def fork_error(pid: int) -> KvtierError:
    return KvtierError(
        Status.CANCELLED, f"this client was made in process {pid}, which forked: make a new Client in this process"
    )


_NOT_REPEATABLE = {"PutStart"}  # executing it twice would allocate twice
_HELLO_RETRY_S = 1.0
_FIRST_RECV = 16 << 10  # a fast-path reply's first receive: the header and, mostly, the whole body
ATTEMPT_S = 2.0  # longest single attempt when the master can move (a list of masters, or etcd)


def _backoff() -> Backoff:
    """One call's retries (kvtier.common.poller): 50 ms doubling to 1 s, with jitter, within its deadline."""
    return Backoff(0.05, 1.0)


class MasterClient:
    def __init__(
        self,
        address: str,
        timeout: float,
        *,
        fast_path: bool = True,
        connections: int = 4,
        credentials: Credentials | None = None,
    ) -> None:
        self.spec = address
        self.timeout = timeout
        self.credentials = credentials or Credentials()
        # The fast path has no TLS: with TLS every call goes over gRPC.
        fast_path = fast_path and not self.credentials.tls
        self._locator = MasterLocator(address, timeout=min(timeout, 2.0))
        self._attempt_s = min(timeout, ATTEMPT_S) if self._locator.is_multi else timeout
        self.address = ""
        self._channel: grpc.Channel | None = None
        self.stub: Any = None
        self._want_fast = fast_path
        self._connections = connections
        self._fast: SocketPool | None = None
        self._fast_master = ""  # the master (gRPC address) whose Hello gave the fast path in use
        self._next_hello = 0.0  # monotonic time of the next Hello when the fast path is unknown
        self._lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self.made_in = os.getpid()
        self.forked_from = 0  # set in a forked child: every call is refused there (`fork_error`)
        self.closed = False  # by close(): every call is refused CANCELLED
        _ALIVE.add(self)

    # ------------------------------------------------------------------ public

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Invoke `method`; raise KvtierError on failure (see the module docstring)."""
        if self.forked_from:
            raise fork_error(self.forked_from)
        if self.closed:
            raise closed_error()
        if (number := current_request_id.get()) and type(request) in _TRACED:
            request.request_id = number  # the client call's id: the master logs it
        deadline = time.monotonic() + (timeout or self.timeout)
        backoff = None  # made on the first refusal only: seeding its jitter costs more than a fast-path call
        while True:
            reply = self._call_once(method, request, deadline)
            status = getattr(reply, "status", 0)
            if status != _UNAVAILABLE:
                return self._check(method, reply)
            if backoff is None:
                backoff = _backoff()
            if deadline - time.monotonic() <= backoff.current_s:
                return self._check(method, reply)
            delay = backoff.next()
            logger.debug("master refused method=%s (%s); retrying in %.2fs", method, reply.error, delay)
            self._moved(reply.error)
            time.sleep(delay)

    def _call_once(self, method: str, request: Any, deadline: float) -> Any:
        method_id = rpcframe.METHOD_IDS.get(method)
        pool = self._fast_pool(deadline) if method_id is not None else None
        if pool is not None:
            sent = [False]
            try:
                reply = self._call_fast(pool, method_id, request, sent)
            except TransportError as exc:
                self._drop_fast(pool, exc)
                if sent[0] and method in _NOT_REPEATABLE and not self._locator.is_multi:
                    raise KvtierError(
                        Status.UNAVAILABLE, f"{method}: fast path failed mid-call: {exc.message}"
                    ) from None
            except OSError as exc:  # timeouts (EAGAIN), resets, broken pipes
                self._drop_fast(pool, exc)
                if sent[0] and method in _NOT_REPEATABLE and not self._locator.is_multi:
                    raise KvtierError(Status.UNAVAILABLE, f"{method}: fast path failed mid-call: {exc}") from None
            else:
                return reply
        return self._call_grpc(method, request, deadline)

    def hello(self, timeout: float | None = None) -> pb.HelloResponse:
        return self._check(
            "Hello", self._call_grpc("Hello", pb.HelloRequest(), time.monotonic() + (timeout or self.timeout))
        )

    @property
    def fast_path_active(self) -> bool:
        return self._fast is not None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            pool, self._fast = self._fast, None
            self._want_fast = False
            channel, self._channel = self._channel, None
            self.stub = None
        if pool is not None:
            pool.close()
        if channel is not None:
            channel.close()
        self._locator.close()

    # ------------------------------------------------------------------ which master

    def _grpc_stub(self) -> tuple[Any, str]:
        """The stub for the locator's current address (a new channel when the leader moved), and that address."""
        address = self._locator.address
        if not address:
            raise ConnectError(f"no leading master known for {self.spec}")
        with self._lock:
            if self.closed:
                raise closed_error()
            if address != self.address or self.stub is None:
                old = self._channel
                self._channel = open_channel(address, self.credentials)
                self.stub = master_pb2_grpc.MasterStub(self._channel)
                self.address = address
                if old is not None:
                    old.close()
            return self.stub, self.address

    def _moved(self, error: str = "") -> None:
        """The master failed or refused: find the leader (a standby's hint first), and forget the
        fast path when it is elsewhere now."""
        if not self._locator.is_multi and not leader_hint(error):
            return
        leader = self._locator.refresh(leader_hint(error))
        # Compared with the master the fast path belongs to, not with self.address: another thread's
        # gRPC call may already have moved self.address while this pool still talks to the old master,
        # which then refuses every call naming a leader equal to self.address, forever.
        with self._lock:
            pool = None
            if self._fast_master != leader:  # the leader is elsewhere: Hello there at the next call
                pool, self._fast = self._fast, None
                self._next_hello = 0.0
        if pool is not None:
            pool.close()

    # ------------------------------------------------------------------ fast path

    def _fast_pool(self, deadline: float) -> SocketPool | None:
        pool = self._fast
        if pool is not None or not self._want_fast or time.monotonic() < self._next_hello:
            return pool
        with self._lock:
            if self._fast is not None or time.monotonic() < self._next_hello:
                return self._fast
            self._next_hello = time.monotonic() + _HELLO_RETRY_S
        answered_by: list[str] = []
        try:
            hello = self._check(
                "Hello",
                self._call_grpc("Hello", pb.HelloRequest(), min(deadline, time.monotonic() + 1), answered_by),
            )
        except KvtierError as exc:
            logger.debug("Hello failed; using gRPC for now: %s", exc)
            return None
        if not hello.fast_endpoint:
            return None
        address = parse_hostport(hello.fast_endpoint.split("://", 1)[-1])
        new = SocketPool(
            address,
            self._attempt_s,
            self._connections,
            f"master fast path {hello.fast_endpoint}",
            on_connect=self._authenticate if self.credentials.token else None,
        )
        with self._lock:
            if self._fast is None and self._want_fast and answered_by[-1] == self._locator.address:
                self._fast, self._fast_master = new, answered_by[-1]
                logger.debug("using the master fast path at %s", hello.fast_endpoint)
                return new
        new.close()
        return self._fast

    def _authenticate(self, sock: socket.socket) -> None:
        """A new fast-path connection's AUTH exchange (kvtier.proto.rpcframe)."""
        token = self.credentials.token.encode()
        send_all(sock, [rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, 0, len(token)), token])
        magic, method, _reply_id, size = rpcframe.HEADER.unpack(recv_exact(sock, rpcframe.HEADER.size))
        body = recv_exact(sock, min(size, 4096)) if size else b""
        if magic != rpcframe.MAGIC or method != rpcframe.AUTH_METHOD:
            raise ProtocolError(f"master fast path refused the credentials: {body.decode(errors='replace')}")

    def _drop_fast(self, pool: SocketPool, exc: Exception) -> None:
        logger.warning("master fast path failed (%s); using gRPC and asking Hello again later", exc)
        with self._lock:
            if self._fast is pool:
                self._fast = None
                self._next_hello = time.monotonic() + _HELLO_RETRY_S
        pool.close()

    def _call_fast(self, pool: SocketPool, method_id: int, request: Any, sent: list[bool]) -> Any:
        name, _, response_type = rpcframe.METHODS[method_id]
        payload = request.SerializeToString()
        request_id = next(self._request_ids) % 0xFFFFFFFF + 1  # never 0: that id marks a refusal at accept
        with pool.socket() as sock:
            send_all(sock, [rpcframe.HEADER.pack(rpcframe.MAGIC, method_id, request_id, len(payload)), payload])
            sent[0] = True
            # Header and body in one receive (the master writes them together); nothing else is in
            # flight on this socket, so whatever came is this reply's.
            data = sock.recv(_FIRST_RECV)
            if len(data) < rpcframe.HEADER.size:
                data += recv_exact(sock, rpcframe.HEADER.size - len(data))  # b"": the master closed
            magic, method, reply_id, size = rpcframe.HEADER.unpack_from(data)
            if magic != rpcframe.MAGIC or size > rpcframe.MAX_PAYLOAD:
                raise ProtocolError(f"bad fast-path frame from the master: magic={magic:#x} size={size}")
            got = len(data) - rpcframe.HEADER.size
            if got > size:
                raise ProtocolError(f"fast-path reply from the master runs {got - size} bytes past its frame")
            body = data[rpcframe.HEADER.size :]
            if got < size:
                body += recv_exact(sock, size - got)
            if method == rpcframe.ERROR_METHOD and reply_id == 0:
                # Refused at accept (the connection limit), before our request was read: it was
                # never executed, so even a PutStart may go again over gRPC.
                sent[0] = False
                raise ConnectError(f"master fast path refused the connection: {body.decode(errors='replace')}")
            if method == rpcframe.ERROR_METHOD:
                raise ProtocolError(f"master refused {name}: {body.decode(errors='replace')}")
            if method != method_id or reply_id != request_id:
                raise ProtocolError(f"fast-path reply {method}/{reply_id} for request {method_id}/{request_id}")
        return response_type.FromString(body)

    # ------------------------------------------------------------------ gRPC

    def _call_grpc(self, method: str, request: Any, deadline: float, answered_by: list[str] | None = None) -> Any:
        """`answered_by`, when given, gets the address of each master tried (the last one answered)."""
        backoff = None  # made on the first retryable failure only (see call)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KvtierError(Status.TIMEOUT, f"{method}: master {self.address} did not answer in time")
            try:
                stub, address = self._grpc_stub()
                if answered_by is not None:
                    answered_by.append(address)
                return getattr(stub, method)(request, timeout=min(remaining, self._attempt_s))
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!" (closed by another thread)
                if self.closed:
                    raise closed_error() from None
                raise
            except (grpc.RpcError, ConnectError) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._locator.is_multi:
                    code = grpc.StatusCode.UNAVAILABLE  # this master hangs: look for the leader elsewhere
                if backoff is None:
                    backoff = _backoff()
                if code in _RETRYABLE and deadline - time.monotonic() > backoff.current_s:
                    delay = backoff.next()
                    logger.debug("master unavailable method=%s; retrying in %.2fs", method, delay)
                    self._moved()
                    time.sleep(delay)
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise KvtierError(Status.TIMEOUT, f"{method}: master {self.address} timed out") from None
                details = exc.details() if isinstance(exc, grpc.RpcError) else exc.message
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise ConnectError(f"{method}: master {self.address or self.spec} unavailable: {details}") from None
                if code in _DENIED:
                    raise KvtierError(_DENIED[code], f"{method}: {details}") from None
                raise KvtierError(Status.INTERNAL, f"{method}: {code.name}: {details}") from None

    def stream(self, method: str, request: Any) -> Any:
        """A server-streaming call to the leader, without deadline: its response iterator (cancel()
        ends it), returned once the master sent its initial metadata (or ended the call). A master
        that cannot be reached is retried, the leader looked up again, like `call`, until the
        client's timeout; once a stream is open nothing is retried: its reader resumes."""
        if self.forked_from:
            raise fork_error(self.forked_from)
        deadline = time.monotonic() + self.timeout
        backoff = _backoff()
        while True:
            try:
                calls = getattr(self._grpc_stub()[0], method)(request)
            except ConnectError:
                calls = None
            if calls is not None:
                if not _answered(calls, deadline):  # a master that accepts but never answers (stopped)
                    calls.cancel()
                    raise KvtierError(Status.TIMEOUT, f"{method}: master {self.address} did not answer in time")
                if not calls.done() or calls.code() != grpc.StatusCode.UNAVAILABLE:
                    return calls  # open, or ended with its answer (read by the caller)
            if deadline - time.monotonic() <= backoff.current_s:
                if calls is None:
                    raise ConnectError(f"{method}: no leading master known for {self.spec}")
                return calls  # its UNAVAILABLE surfaces on the first read
            self._moved()
            time.sleep(backoff.next())

    @staticmethod
    def _check(method: str, reply: Any) -> Any:
        status = getattr(reply, "status", 0)
        if status:
            raise KvtierError(to_status(status), f"{method}: {reply.error}")
        return reply


def _answered(calls: Any, deadline: float) -> bool:
    """Whether a stream's initial metadata (or its end) came before `deadline`. gRPC's wait for it has
    no timeout, so a short-lived helper thread waits while this one waits on an event; the caller
    cancels the call on False, which ends the helper."""
    answered = threading.Event()

    def wait() -> None:
        try:
            calls.initial_metadata()
        finally:
            answered.set()

    threading.Thread(target=wait, name="kvtier-stream-open", daemon=True).start()
    return answered.wait(max(0.0, deadline - time.monotonic()))
