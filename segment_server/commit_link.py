"""The commit feed's connection to the master's framed fast path (kvtier.proto.rpcframe).

Every PutEnd waits for the segments to acknowledge its commit notices
(kvtier.master.commits), so the feed's round trip is on the path of every
put. Over gRPC a long poll cost about a millisecond in Python (a call object,
a channel thread, the server's interceptors); over one framed connection the
segment keeps open it is two small frames (issue 19: the profile is in
docs/benchmarks.md). The messages and their meaning are the same as
PollCommits over gRPC, which stays the fallback: the master has no fast path
(`--fast-listen off`), the link uses TLS (the fast path has none), or the
endpoint cannot be reached.

A blocking socket on the feed's own thread: one request at a time, answered in
order. A broken exchange is harmless to retry: an acknowledgement applies
once (a lower one is ignored), and notices not acknowledged are sent again.
A poll waits in short slices and gives up as soon as `current()` says the
leader moved (over gRPC, closing the old channel did that): a paused old
leader must not hold the feed while the new one expels the segment as silent.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.common.units import parse_hostport, timeval
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe

_HEADER = rpcframe.HEADER
_HEADER_SIZE = _HEADER.size
_METHOD = rpcframe.METHOD_IDS["PollCommits"]
_SLICE_S = 0.1  # how often a waiting poll checks that its master is still the one to ask
_BUFFER = 64 << 10  # a reply buffer that holds most polls' answers whole
_KEEP = 1 << 20  # a larger buffer, needed once for a large answer, is kept up to this size


class FeedLinkError(OSError):
    """The fast path refused or answered something unexpected: use gRPC for a while."""


class FramedFeedLink:
    """One framed connection to the master's fast path, for PollCommits.

    Blocking, with the kernel's own timeouts (SO_RCVTIMEO is the slice a
    waiting poll checks `current()` after; SO_SNDTIMEO bounds a send): a
    Python socket timeout would poll() before every send and receive and cost
    two more syscalls each time it is set. A reply is read into one reusable
    buffer, its header and message together when they arrive together: an
    exchange is one send and, most of the time, one receive (session 9: this
    thread's work is on the path of every PutEnd).
    """

    def __init__(self, endpoint: str, token: str, connect_timeout_s: float) -> None:
        """`endpoint`: the master's advertised `tcp://host:port`; `token`: the bearer token ("" = none)."""
        self.endpoint = endpoint
        host, port = parse_hostport(endpoint.split("://", 1)[-1])
        self._sock = sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(_SLICE_S))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(connect_timeout_s))
        except OSError:
            sock.close()
            raise
        self._lock = threading.Lock()
        self._request_id = 0
        self._buf = bytearray(_BUFFER)
        if token:
            body = token.encode()
            self._exchange(rpcframe.AUTH_METHOD, body, connect_timeout_s, lambda: True)

    def poll(
        self, request: pb.PollCommitsRequest, timeout_s: float, current: Callable[[], bool] = lambda: True
    ) -> pb.PollCommitsResponse:
        """One PollCommits; `current()` False (checked every _SLICE_S while waiting) ends it with
        FeedLinkError: the leader moved."""
        body = request.SerializeToString()
        return pb.PollCommitsResponse.FromString(self._exchange(_METHOD, body, timeout_s, current))

    def close(self) -> None:
        """Any thread: a poll blocked in recv returns with an error at once."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _exchange(self, method: int, body: bytes, timeout_s: float, current: Callable[[], bool]) -> bytes:
        with self._lock:
            self._request_id = self._request_id % 0xFFFFFFFF + 1  # never 0: that id marks a refusal at accept
            request_id = self._request_id
            sock = self._sock
            sock.sendall(_HEADER.pack(rpcframe.MAGIC, method, request_id, len(body)) + body)
            deadline = time.monotonic() + timeout_s
            buf = self._buf
            view = memoryview(buf)
            got = 0
            while got < _HEADER_SIZE:  # the header, and whatever of the message came with it
                got += _recv_into(sock, view[got:], deadline, current)
            magic, reply_method, reply_id, size = _HEADER.unpack_from(buf)
            if magic != rpcframe.MAGIC or size > rpcframe.MAX_PAYLOAD:
                raise FeedLinkError(f"bad frame from the master's fast path: magic={magic:#x} size={size}")
            end = _HEADER_SIZE + size
            if got > end:  # one request at a time: nothing may follow its reply
                raise FeedLinkError(f"{got - end} unexpected bytes after a fast-path reply")
            if end > len(buf):
                view.release()
                larger = bytearray(end)
                larger[:got] = buf[:got]
                buf, view = larger, memoryview(larger)
                if end <= _KEEP:
                    self._buf = larger
            while got < end:
                got += _recv_into(sock, view[got:end], deadline, current)
            reply = bytes(view[_HEADER_SIZE:end])
            view.release()
            if reply_method == rpcframe.ERROR_METHOD:
                raise FeedLinkError(f"the master's fast path refused: {reply[:200].decode(errors='replace')}")
            if reply_method != method or reply_id != request_id:
                raise FeedLinkError(f"fast-path reply {reply_method}/{reply_id} for request {method}/{request_id}")
            return reply


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, current: Callable[[], bool]) -> int:
    """Bytes received into `view` (at least one), waiting in slices of _SLICE_S (SO_RCVTIMEO)."""
    while True:
        try:
            n = sock.recv_into(view)
        except BlockingIOError:  # the slice passed with nothing received
            if not current():
                raise FeedLinkError("the leading master changed") from None
            if time.monotonic() > deadline:
                raise TimeoutError("the master's fast path did not answer in time") from None
            continue
        if not n:
            raise ConnectionResetError("the master closed the fast-path connection")
        return n


def fast_endpoint(stub: Any, timeout_s: float) -> str:
    """The master's advertised fast-path endpoint ("" = none), from Hello."""
    reply = stub.Hello(pb.HelloRequest(), timeout=timeout_s)
    return reply.fast_endpoint if reply.status == 0 else ""
