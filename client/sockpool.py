"""A bounded pool of blocking TCP sockets to one address, shared by threads.

Sockets are blocking with kernel send/receive timeouts (SO_SNDTIMEO,
SO_RCVTIMEO), so a transfer is a few syscalls with no poll loop, and a peer
that stops answering costs at most the timeout. At most `limit` sockets
exist; further callers wait up to the timeout for one. A socket whose use
raised is closed, never returned to the pool. An idle socket the peer closed
meanwhile (the server restarted) is noticed before it is handed out, so a
request is never sent into a connection known to be dead: callers can tell
"failed before sending" (safe to repeat anywhere) from "failed mid-call".

A client call with a deadline (`call_deadline`, set by the read path for the call's duration) also
bounds every wait of its exchanges by it: the wait for a free socket, the connect, and the socket's
timeouts while the exchange runs. So a read that retries (kvtier.client.reads) never waits past its
caller's timeout, to within `_SLACK` of the pool's timeout. A socket keeps the timeouts last set on
it: they are set again only when an exchange needs them over `_SLACK` apart, so the reads of a
replicated key (which give their first attempt half the call) cost no syscalls after the first.

The kernel's timeouts bound one syscall each: a peer that trickles a few bytes now and then (a
segment paused and resumed over and over) restarted them at every receive, and a 1 s call took 7 s.
So a transfer that needs another syscall first cuts the socket's timeouts to what is left of the
call (or, without a call deadline, of one timeout from its first short return), and fails when
nothing is left; such a socket gets its timeouts back at its next exchange.
"""

from __future__ import annotations

import contextvars
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvtier.common.units import timeval
from kvtier.proto.errors import ConnectError, ReadError

_IOV_MAX = 1024  # Linux's limit of buffers per sendmsg
# The time.monotonic() by which the client call this context works for must be over, or None.
call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvtier_call_deadline", default=None)
# Timeouts are set again only when they would change by more than this fraction of the pool's: the
# first attempt of a call (a few ms after it started) costs no syscalls. A timeval of 0 is "never".
_SLACK = 0.02
_MIN_TIMEOUT = 0.001
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # once: or-ing the enum flags runs Python code per call
_TIMEVAL = struct.Struct("@ll")
# File descriptors of sockets whose timeouts a transfer cut to its deadline (`more_time`): set back
# at their next exchange (`SocketPool._take`).
_shortened: set[int] = set()


class SocketPool:
    def __init__(
        self,
        address: tuple[str, int],
        timeout: float,
        limit: int,
        what: str,
        on_connect: Callable[[socket.socket], None] | None = None,
    ) -> None:
        self.address = address
        self._on_connect = on_connect  # e.g. an authentication exchange; raises to refuse the socket
        self.timeout = timeout
        self.limit = limit
        self.what = what  # for error messages, e.g. "segment tcp://127.0.0.1:4000"
        self._idle: list[socket.socket] = []
        # Timeouts last set on a socket, where not the pool's (a plain dict, its entry dropped when the
        # socket is closed: a WeakKeyDictionary's lookup builds a weak reference on every exchange).
        self._applied: dict[socket.socket, float] = {}
        self._open = 0
        self._cond = threading.Condition()
        self._closed = False

    def _connect(self, timeout: float) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=timeout)
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.what}: {exc}") from None
        sock.settimeout(None)  # blocking; the kernel enforces the timeouts below
        _set_timeouts(sock, self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._on_connect is not None:
            try:
                self._on_connect(sock)
            except BaseException:
                sock.close()
                raise
        return sock

    def socket(self) -> _Exchange:
        """`with pool.socket() as sock:` a socket for one exchange; returned to the pool only if the
        block did not raise. (A class, not a generator context manager: a third of the cost.)"""
        return _Exchange(self)

    def _take(self) -> socket.socket:
        timeout = self.timeout
        call_ends = call_deadline.get()
        if call_ends is not None:
            timeout = max(min(timeout, call_ends - time.monotonic()), _MIN_TIMEOUT)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                raise ConnectError(f"connection pool to {self.what} is closed")
            while not self._idle and self._open >= self.limit:
                # A wake-up for a socket another thread took first must not restart the wait.
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    raise ConnectError(f"no free connection to {self.what} within {timeout:.3g}s")
                if self._closed:
                    raise ConnectError(f"connection pool to {self.what} is closed")
            sock = None
            while self._idle:
                sock = self._idle.pop()
                if _alive(sock):
                    break
                self._forget(sock)
                self._open -= 1
                sock = None
            if sock is None:
                self._open += 1
        if sock is None:
            try:
                sock = self._connect(timeout)
            except BaseException:
                with self._cond:
                    self._open -= 1
                    self._cond.notify()
                raise
        try:
            cut = _shortened and sock.fileno() in _shortened
            if cut or abs(timeout - self._applied.get(sock, self.timeout)) > self.timeout * _SLACK:
                _set_timeouts(sock, timeout)
                self._applied[sock] = timeout
                if cut:
                    _shortened.discard(sock.fileno())
        except BaseException:
            self._give_back(sock, False)
            raise
        return sock

    def _give_back(self, sock: socket.socket, healthy: bool) -> None:
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(sock)
            else:
                self._open -= 1
                self._forget(sock)
            self._cond.notify()

    def _forget(self, sock: socket.socket) -> None:
        """Close a socket of this pool (under `_cond`)."""
        self._applied.pop(sock, None)
        _shortened.discard(sock.fileno())
        sock.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for sock in self._idle:
                self._forget(sock)
            self._open -= len(self._idle)
            self._idle.clear()
            self._cond.notify_all()  # waiters give up instead of sleeping out their timeout


class _Exchange:
    """One `SocketPool.socket()` block: the socket it took, handed back (or closed, when the block
    raised) at its end."""

    __slots__ = ("_pool", "_sock")

    def __init__(self, pool: SocketPool) -> None:
        self._pool = pool

    def __enter__(self) -> socket.socket:
        self._sock = self._pool._take()
        return self._sock

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._pool._give_back(self._sock, exc_type is None)


def _set_timeouts(sock: socket.socket, timeout: float) -> None:
    packed = timeval(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, packed)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, packed)


def _alive(sock: socket.socket) -> bool:
    """An idle socket is alive when nothing is waiting in it: not EOF, not an error, not stray bytes."""
    try:
        sock.recv(1, _PEEK)  # b"" (closed) or stray bytes: unusable
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _exchange_end(sock: socket.socket) -> float:
    """When a transfer that needs more than one syscall must be over: the call's deadline, or one of the
    socket's timeouts from now (its first syscall returned short)."""
    call_ends = call_deadline.get()
    if call_ends is not None:
        return call_ends
    seconds, micros = _TIMEVAL.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.size))
    timeout = seconds + micros / 1e6
    return time.monotonic() + timeout if timeout else float("inf")


def more_time(sock: socket.socket, ends: float = 0.0) -> float:
    """Before another syscall of a transfer: its time left (until `ends`, or `_exchange_end` when 0)
    becomes the socket's timeouts; none left fails it as the kernel's own timeout does (EAGAIN).
    Returns the end, for the transfer's next syscall."""
    ends = ends or _exchange_end(sock)
    left = ends - time.monotonic()
    if left <= 0:
        raise BlockingIOError(errno.EAGAIN, "the call's time ran out while the peer was still sending or taking bytes")
    if left != float("inf"):
        _set_timeouts(sock, max(left, _MIN_TIMEOUT))
        _shortened.add(sock.fileno())
    return ends


def send_all(sock: socket.socket, buffers: list) -> None:
    """sendmsg every buffer, continuing after partial sends (the kernel may take part of an iovec)."""
    index = 0
    ends = 0.0
    first = True
    while index < len(buffers):
        if not first:  # another syscall of this transfer (the first sent only part, or _IOV_MAX buffers)
            ends = more_time(sock, ends)
        first = False
        batch = buffers[index : index + _IOV_MAX]
        sent = sock.sendmsg(batch)
        for buf in batch:
            size = len(buf)
            if sent >= size:
                sent -= size
                index += 1
            else:
                buffers[index] = memoryview(buf)[sent:]
                break


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    ends = 0.0
    while view:
        n = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if n == 0:
            raise ReadError("peer closed the connection mid-frame")
        view = view[n:]
        if view:  # returned short (the timeout, or a signal): what is left of the call bounds the rest
            ends = more_time(sock, ends)


def recv_exact_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view, in order, with scatter `recvmsg_into` (MSG_WAITALL): one call for many small
    buffers instead of one each (continuing after a short receive, as recv_exact_into does)."""
    index = 0
    ends = 0.0
    first = True
    while index < len(views):
        if not first:  # another syscall (the first returned short, or took _IOV_MAX buffers)
            ends = more_time(sock, ends)
        first = False
        batch = views[index : index + _IOV_MAX]
        n = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ReadError("peer closed the connection mid-frame")
        for view in batch:
            size = len(view)
            if n >= size:
                n -= size
                index += 1
            else:
                views[index] = view[n:]
                break


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)  # one allocation, received in place
    if len(data) == size:
        return data
    if not data:
        raise ReadError("peer closed the connection mid-frame")
    buf = bytearray(size)
    buf[: len(data)] = data
    more_time(sock)  # a second syscall: bounded as recv_exact_into's are
    recv_exact_into(sock, memoryview(buf)[len(data) :])
    return bytes(buf)
