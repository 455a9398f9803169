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
answered OK then, even once the key was removed or replaced since:
kvtier.master.put_outcomes). Anything that is not the master's answer (no
fast path known, a broken connection, a timeout) is UNAVAILABLE too: the
client falls back to its own PutEnd, which is safe to repeat.

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
from dataclasses import dataclass

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
_FEED_WAIT_SLICE_S = 0.001  # how often answers whose notices wait for the feed look again
_LINKS = 4  # connections to the master at most (a new one only when every other has calls in flight)
_REFUSED_S = 30.0  # an older master refused RelayPutEnd: no relay there for this long
_UNKNOWN = f"method={rpcframe.METHOD_IDS['RelayPutEnd']} size=".encode()  # an older master's "bad frame" answer
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
        timeout_s: float = 1.5,
    ) -> None:
        """`endpoint()`: the master's fast-path endpoint the commit feed uses now ("" = none: relay
        nothing); `token`: the segment's bearer token for it (None: never relay, e.g. TLS).
        `timeout_s` bounds a relay from its COMMIT to its answer, the wait for the feed included,
        well below a client's default timeout: the client hears UNAVAILABLE and still has time to
        send its PutEnd itself."""
        self._index = index
        self._endpoint = endpoint
        self._token = token
        self.timeout_s = timeout_s
        # A few connections, not one: the master answers a connection's frames in order and parks it
        # while a relayed answer waits for other segments, so one link would queue every put behind it.
        self._links: list[_RelayLink] = []
        self._refused: tuple[str, float] = ("", 0.0)  # a master that does not know RelayPutEnd, until when
        self._acknowledged: tuple[tuple[int, int], int] = ((0, 0), 0)  # (session, applied) the master was told
        self._ack_timer: asyncio.TimerHandle | None = None
        self._feed_waits: list[_FeedWait] = []  # answers whose notices wait for the feed
        self._feed_timer: asyncio.TimerHandle | None = None
        self.relayed = 0  # PutEnds the master answered through this relay
        self.failed = 0  # COMMITs answered UNAVAILABLE (no usable answer from the master)
        self.feed_waits = 0  # answers not applicable at once (the feed behind, or applying a batch)

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
        if self._refused[0] == endpoint and loop.time() < self._refused[1]:
            return self._fail(loop, done, "the master does not take relayed PutEnds")
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
        deadline = loop.time() + self.timeout_s
        link.send(_METHOD, body, lambda status, answer: self._answered(status, answer, session, deadline, done))

    def close(self) -> None:
        for timer in (self._ack_timer, self._feed_timer):
            if timer is not None:
                timer.cancel()
        self._ack_timer = self._feed_timer = None
        waits, self._feed_waits = self._feed_waits, []
        for wait in waits:
            _call(wait.done, _UNAVAILABLE, b"the segment stops")
        for link in self._links:
            link.close("the segment stops")
        self._links = []

    def refused_by(self, endpoint: str) -> None:
        """The master at `endpoint` answered RelayPutEnd as an unknown method (an older master): no
        relay there for a while, so every put does not pay a new connection to learn it again."""
        self._refused = (endpoint, asyncio.get_running_loop().time() + _REFUSED_S)
        logger.warning("the master at %s does not take relayed PutEnds: clients send PutEnd themselves", endpoint)

    def _link_to(self, endpoint: str, loop: asyncio.AbstractEventLoop) -> _RelayLink:
        """An idle link to `endpoint`, a new one while under _LINKS, else the least busy."""
        links = self._links
        if any(link.endpoint != endpoint or link.closed for link in links):
            for link in links:
                if link.endpoint != endpoint:
                    link.close("the leading master moved")
            links = self._links = [link for link in links if not link.closed]
        best = min(links, key=_in_flight, default=None)
        if best is None or (best.in_flight and len(links) < _LINKS):
            best = _RelayLink(self, endpoint, self._token, loop)
            links.append(best)
        return best

    def _applied_now(self, done: Done, reply: pb.RelayPutEndResponse) -> None:
        """The call's notices are in the index: answer the client; acknowledge them soon."""
        self.relayed += 1
        done(_OK, reply.SerializeToString())
        if self._feed_waits:  # answers come out of order over the links: a waiting one may apply now
            self._look_at_feed_in(0.0)
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

    def _answered(self, status: int, answer: bytes, session: tuple[int, int], deadline: float, done: Done) -> None:
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
        try:
            applied = self._index.apply_relayed(notices, session)
        except Exception:  # never leave the client's connection waiting for an answer
            logger.exception("applying a relayed PutEnd's notices failed")
            self.failed += 1
            return done(_UNAVAILABLE, b"internal error while applying the put's notices")
        if applied:
            return self._applied_now(done, reply)
        # The feed is behind (or applying a batch right now): it brings the earlier notices, these
        # included. One timer looks at every such answer, whatever their number.
        self.feed_waits += 1
        last = notices.first_seq + len(notices.offsets) - 1
        self._feed_waits.append(_FeedWait(notices, last, session, reply, deadline, done))
        if self._feed_timer is None:
            self._look_at_feed_in(_FEED_WAIT_SLICE_S)

    def _look_at_feed_in(self, delay: float) -> None:
        """(Re)schedule the one look at the answers waiting for the feed."""
        if self._feed_timer is not None:
            self._feed_timer.cancel()
        self._feed_timer = asyncio.get_running_loop().call_later(delay, self._look_at_feed)

    def _look_at_feed(self) -> None:
        """Answer every waiting call whose notices are in the index now, or whose time is up."""
        self._feed_timer = None
        index, now = self._index, asyncio.get_running_loop().time()
        waiting = []
        for wait in self._feed_waits:
            try:
                session, applied = index.session_and_applied()  # one read: never another mount's number
                if index.apply_relayed(wait.notices, wait.session) or (
                    session == wait.session and applied >= wait.last
                ):
                    self._applied_now(wait.done, wait.reply)  # schedules a look at once: it may unblock others
                elif session != wait.session:
                    self.failed += 1
                    wait.done(_UNAVAILABLE, b"this segment mounted again meanwhile; retry")
                elif now > wait.deadline:
                    self.failed += 1
                    wait.done(_UNAVAILABLE, b"the commit feed did not bring the put's notices in time; retry")
                else:
                    waiting.append(wait)
            except Exception:  # never leave a client connection waiting for an answer
                logger.exception("a relayed PutEnd's answer failed")
                self.failed += 1
                _call(wait.done, _UNAVAILABLE, b"internal error while applying the put's notices")
        self._feed_waits = waiting
        if waiting and self._feed_timer is None:
            self._look_at_feed_in(_FEED_WAIT_SLICE_S)


@dataclass(slots=True, eq=False)
class _FeedWait:
    """A relayed answer whose notices wait for the commit feed to catch up."""

    notices: pb.PollCommitsResponse
    last: int  # sequence number of its last notice
    session: tuple[int, int]
    reply: pb.RelayPutEndResponse  # for the client (notices cleared)
    deadline: float  # loop time: the relay's, from its COMMIT
    done: Done


def _in_flight(link: _RelayLink) -> int:
    return link.in_flight


def _call(callback: Callable[[int, bytes], None], status: int, answer: bytes) -> None:
    """Call an answer callback; an exception in it is logged, never let out (the caller has others
    to answer)."""
    try:
        callback(status, answer)
    except Exception:
        logger.exception("answering a relayed PutEnd failed")


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

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

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
            _call(answered, _UNAVAILABLE, message)

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
        if self.closed:  # given up while connecting: its calls were answered already
            transport.abort()  # type: ignore[attr-defined]
            return
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
                if method == rpcframe.ERROR_METHOD and _UNKNOWN in body and b"over the limit" not in body:
                    self._relay.refused_by(self.endpoint)
                return self.close(f"the master's fast path answered method {method}: {body[:200]!r}")
            _, answered, timer = self._waiting.popleft()
            timer.cancel()
            _call(answered, _OK, body)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(f"the master closed the fast-path connection ({exc or 'EOF'})")

    def _timed_out(self) -> None:
        self.close(f"the master did not answer a relayed PutEnd within {self._relay.timeout_s:g}s")
