"""Commit through the segment: a client's PutEnd relayed to the master (the data plane's COMMIT frame).

A put over tcp used to cost the client three exchanges (PutStart, the WRITE,
PutEnd) and PutEnd a fourth hop inside the master: its commit notice to the
segment and the acknowledgement on the segment's next poll. A client whose put
went to one segment can instead send its PutEnd right behind its WRITE, in a
COMMIT frame on the same connection (kvtier.proto.frames); the segment relays
it over the master's fast path (`RelayPutEnd`), and the master hands the
segment's own notices of the call back in the answer instead of waiting for
their acknowledgement. The segment applies them to its index, after every
earlier notice (kvtier.segment_server.dram_index), and only then tells the
client: "acknowledged means in an index" holds as for a direct PutEnd, with
one round trip less on the put's path (docs/architecture.md).

The relayed notices do not wake the segment's long poll (its acknowledgement
would only cost both sides a round trip on every put): each relay carries the
index's acknowledgement instead (`acked_seq`), and the master wakes the poll as
soon as another call waits for them (kvtier.master.commits). When no relay
follows within ACK_DELAY_S, the relay sends the acknowledgement on its own (a
PollCommits that waits for nothing): unacknowledged notices are what a master
fences when the segment is cut off (kvtier.master.fences), and a segment whose
last puts stayed unacknowledged would lose them to a network blip.

When the index has not applied every notice before the call's yet (its feed is
one poll behind), the answer's notices cannot be applied out of order: the
relay waits for the feed to bring them, up to `timeout_s`, and otherwise
answers UNAVAILABLE (the put may be committed: a PutEnd retried by the client is
answered OK then). Anything that is not the master's answer (no fast path
known, a broken connection, a timeout) is UNAVAILABLE too: the client falls
back to its own PutEnd, which is safe to repeat.

One framed connection per segment on the event loop, callbacks only (no task
or future per call: this is on every put's path), opened on first use to the
endpoint the commit feed found, with the feed's token. The fast path answers
a connection's frames in order, so answers are matched first in, first out;
a connection that fails or times out is closed with every call in flight on
it, so no late answer can be taken for another call's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from google.protobuf.internal.encoder import _VarintBytes

from kvtier.common.units import parse_hostport
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.status import Status
from kvtier.segment_server.dram_index import DramIndex

logger = logging.getLogger(__name__)

_HEADER = rpcframe.HEADER
_HEADER_SIZE = _HEADER.size
_METHOD = rpcframe.METHOD_IDS["RelayPutEnd"]
_FEED_WAIT_SLICE_S = 0.001  # how often a call whose notices wait for the feed looks again
# RelayPutEndRequest's segment_id (3), epoch (4) and acked_seq (5), varints: appended to the client's
# bytes (protobuf concatenation sets them; the client sends fields 1 and 2 only).
_SEGMENT_TAG, _EPOCH_TAG, _ACKED_TAG = b"\x18", b"\x20", b"\x28"
ACK_DELAY_S = 0.002  # an acknowledgement no relay carried within this goes out on its own
_POLL_METHOD = rpcframe.METHOD_IDS["PollCommits"]
_OK = int(Status.OK)
_UNAVAILABLE = int(Status.UNAVAILABLE)

# The answer for the client: (0, RelayPutEndResponse bytes without notices) or (status, message).
Done = Callable[[int, bytes], None]


class CommitRelay:
    """Relays COMMIT frames' PutEnds to the master and applies the answers' notices (event loop only)."""

    def __init__(
        self,
        index: DramIndex,
        endpoint: Callable[[], str],
        token: str | None,
        timeout_s: float = 2.0,
    ) -> None:
        """`endpoint()`: the master's fast-path endpoint the commit feed uses now ("" = none: relay
        nothing); `token`: the segment's bearer token for it (None: never relay, e.g. TLS).
        `timeout_s` stays below a client's default timeout, so the client hears UNAVAILABLE and
        still has time to send its PutEnd itself."""
        self._index = index
        self._endpoint = endpoint
        self._token = token
        self.timeout_s = timeout_s
        self._link: _RelayLink | None = None
        self._acknowledged: tuple[tuple[int, int], int] = ((0, 0), 0)  # (session, applied) the master was told
        self._ack_timer: asyncio.TimerHandle | None = None
        self.relayed = 0  # PutEnds the master answered through this relay
        self.failed = 0  # COMMITs answered UNAVAILABLE (no usable answer from the master)
        self.feed_waits = 0  # answers whose notices waited for the feed

    def commit(self, payload: bytes, done: Done) -> None:
        """Relay a COMMIT frame's payload (RelayPutEndRequest fields 1-2); `done` gets the answer
        for the client, once, later (never from inside this call)."""
        loop = asyncio.get_running_loop()
        if self._token is None:
            return self._fail(loop, done, "this segment relays no commits (its master link uses TLS)")
        session, applied = self._index.session_and_applied()
        segment_id, epoch = session
        if not segment_id:
            return self._fail(loop, done, "this segment is not mounted on a master")
        endpoint = self._endpoint()
        if not endpoint:
            return self._fail(loop, done, "no fast path to the master known yet")
        link = self._link_to(endpoint, loop)
        self._acknowledged = (session, applied)
        body = b"".join(
            (
                payload,
                _SEGMENT_TAG,
                _VarintBytes(segment_id),
                _EPOCH_TAG,
                _VarintBytes(epoch),
                _ACKED_TAG,
                _VarintBytes(applied),
            )
        )
        link.send(_METHOD, body, lambda status, answer: self._answered(status, answer, session, done))

    def close(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        if self._link is not None:
            self._link.close("the segment stops")
            self._link = None

    def _link_to(self, endpoint: str, loop: asyncio.AbstractEventLoop) -> _RelayLink:
        link = self._link
        if link is None or link.endpoint != endpoint or link.closed:
            if link is not None:
                link.close("the leading master moved")
            link = self._link = _RelayLink(self, endpoint, self._token, loop)
        return link

    def _applied_now(self, done: Done, reply: pb.RelayPutEndResponse) -> None:
        """The call's notices are in the index: answer the client; acknowledge them soon."""
        self.relayed += 1
        done(_OK, reply.SerializeToString())
        if self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_DELAY_S, self._acknowledge)

    def _acknowledge(self) -> None:
        """Tell the master what the index applied, unless a relay since did (module docstring)."""
        self._ack_timer = None
        session, applied = self._index.session_and_applied()
        told_session, told = self._acknowledged
        endpoint = self._endpoint()
        if not session[0] or not endpoint or (session == told_session and applied <= told):
            return
        self._acknowledged = (session, applied)
        request = pb.PollCommitsRequest(segment_id=session[0], epoch=session[1], acked_seq=applied, max_notices=1)
        link = self._link_to(endpoint, asyncio.get_running_loop())
        link.send(_POLL_METHOD, request.SerializeToString(), _ignore)

    def _fail(self, loop: asyncio.AbstractEventLoop, done: Done, message: str) -> None:
        self.failed += 1
        loop.call_soon(done, _UNAVAILABLE, message.encode())

    def _answered(self, status: int, answer: bytes, session: tuple[int, int], done: Done) -> None:
        """The master's answer (status 0) or the link's failure (UNAVAILABLE, a message)."""
        if status != _OK:
            self.failed += 1
            return done(status, answer)
        try:
            reply = pb.RelayPutEndResponse.FromString(answer)
        except Exception:  # noqa: BLE001 - a broken answer is no answer
            self.failed += 1
            return done(_UNAVAILABLE, b"an undecodable RelayPutEnd answer from the master")
        if reply.status != _OK:  # refused before committing anything: nothing to apply
            self.relayed += 1
            return done(_OK, answer)
        notices = reply.notices
        reply.ClearField("notices")
        if self._index.apply_relayed(notices, session):
            return self._applied_now(done, reply)
        self.feed_waits += 1  # the feed is behind: it brings the earlier notices, these included
        last = notices.first_seq + len(notices.offsets) - 1
        loop = asyncio.get_running_loop()
        self._wait_for_feed(loop, loop.time() + self.timeout_s, notices, last, session, reply, done)

    def _wait_for_feed(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        notices: pb.PollCommitsResponse,
        last: int,
        session: tuple[int, int],
        reply: pb.RelayPutEndResponse,
        done: Done,
    ) -> None:
        index = self._index
        if index.apply_relayed(notices, session) or (index.session == session and index.applied >= last):
            return self._applied_now(done, reply)
        if index.session != session:
            self.failed += 1
            return done(_UNAVAILABLE, b"this segment mounted again meanwhile; retry")
        if loop.time() > deadline:
            self.failed += 1
            return done(_UNAVAILABLE, b"the commit feed did not bring the put's notices in time; retry")
        loop.call_later(_FEED_WAIT_SLICE_S, self._wait_for_feed, loop, deadline, notices, last, session, reply, done)


def _ignore(_status: int, _answer: bytes) -> None:
    """An acknowledgement's answer: nothing to do (a lost one is repeated by the next relay or poll)."""


class _RelayLink(asyncio.Protocol):
    """One framed connection to the master's fast path; calls answered in order (FIFO)."""

    def __init__(self, relay: CommitRelay, endpoint: str, token: str, loop: asyncio.AbstractEventLoop) -> None:
        self.endpoint = endpoint
        self.closed = False
        self._relay = relay
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._unsent: list[bytes] = []  # frames written once connected
        # (method, callback, timeout) per call in flight, in the order sent (the answers' order)
        self._waiting: deque[tuple[int, Callable[[int, bytes], None], asyncio.TimerHandle]] = deque()
        self._buffer = bytearray()
        self._request_id = 0
        self._authenticating = bool(token)
        if token:  # the fast path reads frames in order: calls may follow the AUTH frame at once
            body = token.encode()
            self._unsent.append(_HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, 0xFFFFFFFF, len(body)) + body)
        host, port = parse_hostport(endpoint.split("://", 1)[-1])
        connecting = loop.create_task(
            asyncio.wait_for(loop.create_connection(lambda: self, host, port), relay.timeout_s)
        )
        connecting.add_done_callback(self._connected)

    def send(self, method: int, body: bytes, answered: Callable[[int, bytes], None]) -> None:
        self._request_id = self._request_id % 0xFFFFFFFE + 1
        frame = _HEADER.pack(rpcframe.MAGIC, method, self._request_id, len(body)) + body
        timer = self._loop.call_later(self._relay.timeout_s, self._timed_out)
        self._waiting.append((method, answered, timer))
        if self._transport is not None:
            self._transport.write(frame)
        else:
            self._unsent.append(frame)

    def close(self, reason: str) -> None:
        """Close the connection and fail every call in flight on it (their answers may never come)."""
        if self.closed:
            return
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
            logger.info("commit relay connection closed: %s", reason)
        waiting, self._waiting = self._waiting, deque()
        message = f"relay to the master failed: {reason}".encode()
        for _, answered, timer in waiting:
            timer.cancel()
            answered(_UNAVAILABLE, message)

    # ----------------------------------------------------------- asyncio

    def _connected(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            self.close(f"cannot reach the master's fast path {self.endpoint}: {exc or 'cancelled'}")
            return
        if self.closed:
            task.result()[0].abort()
            return
        logger.info("commit relay over the master's fast path endpoint=%s", self.endpoint)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._unsent:
            transport.writelines(self._unsent)  # type: ignore[attr-defined]
            self._unsent = []

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER_SIZE:
            magic, method, _, size = _HEADER.unpack_from(buffer, start)
            if magic != rpcframe.MAGIC or size > rpcframe.MAX_PAYLOAD:
                return self.close(f"bad frame from the master's fast path: magic={magic:#x} size={size}")
            end = start + _HEADER_SIZE + size
            if len(buffer) < end:
                break
            body = bytes(buffer[start + _HEADER_SIZE : end])
            start = end
            if method == rpcframe.AUTH_METHOD and self._authenticating:
                self._authenticating = False
                continue
            if not self._waiting or method != self._waiting[0][0]:
                return self.close(f"the master's fast path answered method {method}: {body[:200]!r}")
            _, answered, timer = self._waiting.popleft()
            timer.cancel()
            answered(_OK, body)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(f"the master closed the fast-path connection ({exc or 'EOF'})")

    def _timed_out(self) -> None:
        self.close(f"the master did not answer a relayed PutEnd within {self._relay.timeout_s:g}s")
