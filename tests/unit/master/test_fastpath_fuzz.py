"""The fast path's frame parser against arbitrary byte streams (issue 8), no sockets.

A stream is valid frames of every method (with arbitrary request messages,
tests/unit/master/messages.py) mixed with garbage: random bytes, bad magic,
unknown methods, payloads over the limit, undecodable messages, a frame cut
off at the end; delivered in reads split at arbitrary points. A reference
reading of the stream (`expected`), written from kvtier.proto.rpcframe's
contract, says what must come back, and the test checks that:

- nothing raises; every response frame is whole and well-formed, a decodable
  response of its method with OK or a negative kvtier Status;
- the valid frames before the first untrusted one are answered, in order,
  with their request ids; the untrusted one gets one ERROR_METHOD frame with
  its request id, then the close, and nothing after it is answered;
- a stream that ends mid-frame leaves the connection open, unanswered;
- the receive buffer never exceeds one frame (header + max_message_bytes) or
  BASE_BUFFER, and every byte borrowed from the shared budget is given back.

The same with credentials required: an AUTH frame first (a right or wrong
token, or none).

atheris (`make fuzz`, tests/fuzz/) runs the same parser coverage-guided for a
fixed time outside the default suite; here hypothesis keeps it to seconds.
"""

from __future__ import annotations

import logging
import os

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.master.fastpath import BASE_BUFFER, Connections, FastPathLimits
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.auth import make_token
from kvtier.proto.status import Status
from tests.unit.master.fastpath_fakes import HEADER, connect, frames_of, make_handlers
from tests.unit.master.messages import messages

SCALE = float(os.environ.get("KVTIER_FUZZ_SCALE", "1"))  # `make fuzz` runs larger budgets
LIMIT = 64 << 10  # max_message_bytes here: small, so that "too large" is common
LIMITS = FastPathLimits(max_message_bytes=LIMIT, max_buffered_bytes=4 * LIMIT)
SECRET = b"s" * 32
STATUSES = {int(s) for s in Status}
METHOD_IDS = sorted(rpcframe.METHODS)

request_ids = st.integers(0, (1 << 32) - 1)


def frame(method: int, request_id: int, payload: bytes, magic: int = rpcframe.MAGIC) -> bytes:
    return HEADER.pack(magic, method, request_id, len(payload)) + payload


@st.composite
def valid_frames(draw) -> bytes:
    method = draw(st.sampled_from(METHOD_IDS))
    request = draw(messages(rpcframe.METHODS[method][1]))
    return frame(method, draw(request_ids), request.SerializeToString())


def sized_payload(size: int) -> bytes:
    """A KeysRequest of exactly `size` bytes (one long key: decodable, answered INVALID_KEY when too long)."""
    for overhead in (2, 3, 4):  # field 2: its tag, the key's length as a varint (1-3 bytes)
        payload = pb.KeysRequest(keys=["k" * (size - overhead)]).SerializeToString()
        if len(payload) == size:
            return payload
    raise AssertionError(f"no KeysRequest of {size} bytes")


# Frames around the buffer sizes: the base buffer's edge, and exactly the limit.
EDGES = [BASE_BUFFER - HEADER.size - 1, BASE_BUFFER - HEADER.size, BASE_BUFFER - HEADER.size + 1, 40_000, LIMIT]
large_frames = st.builds(frame, st.sampled_from([1, 2, 6]), request_ids, st.sampled_from(EDGES).map(sized_payload))

bad_frames = st.one_of(
    st.binary(min_size=1, max_size=40),  # anything
    st.builds(frame, st.sampled_from(METHOD_IDS), request_ids, st.just(b""), st.integers(0, 0xFFFF)),  # magic
    st.builds(  # a method that is no request
        frame, st.integers(0, 0xFFFF).filter(lambda m: m not in rpcframe.METHODS), request_ids, st.binary(max_size=8)
    ),
    st.builds(  # a size over the limit (the payload need not follow)
        lambda method, request_id, size: HEADER.pack(rpcframe.MAGIC, method, request_id, size),
        st.sampled_from(METHOD_IDS),
        request_ids,
        st.integers(LIMIT + 1, (1 << 32) - 1),
    ),
    st.builds(  # undecodable messages
        frame, st.sampled_from(METHOD_IDS), request_ids, st.sampled_from([b"\xff", b"\x0a\x05ab", b"\x12\x02\xff\xfe"])
    ),
)

streams = st.lists(st.one_of(valid_frames(), valid_frames(), large_frames, bad_frames), max_size=8).flatmap(
    lambda parts: st.tuples(
        st.just(b"".join(parts)),
        st.integers(0, 1),  # 1: cut the stream short, mid-frame somewhere
        st.lists(st.integers(1, 70_000), min_size=1, max_size=6),  # read sizes
    )
)


def expected(stream: bytes, token: bytes | None = None) -> tuple[list[tuple[int, int]], int | None]:
    """What the master must answer: [(method, request_id)] for the frames answered, and the request
    id of the ERROR_METHOD frame (None: no error, the connection stays open). `token`: the AUTH
    token the master accepts (credentials required), else None."""
    answers: list[tuple[int, int]] = []
    authenticated = token is None
    pos = 0
    while len(stream) - pos >= HEADER.size:
        magic, method, request_id, size = HEADER.unpack_from(stream, pos)
        if not authenticated:
            if magic != rpcframe.MAGIC or method != rpcframe.AUTH_METHOD or size > rpcframe.MAX_TOKEN:
                return answers, request_id
            if len(stream) - pos - HEADER.size < size:
                break
            if stream[pos + HEADER.size : pos + HEADER.size + size] != token:
                return answers, request_id
            authenticated = True
            answers.append((rpcframe.AUTH_METHOD, request_id))
            pos += HEADER.size + size
            continue
        if magic == rpcframe.MAGIC and method == rpcframe.AUTH_METHOD and size <= rpcframe.MAX_TOKEN:
            # once authenticated, or with authentication off, an AUTH frame is answered unchecked
            # (a client that has a secret keeps the fast path of a master without one)
            if len(stream) - pos - HEADER.size < size:
                break
            answers.append((rpcframe.AUTH_METHOD, request_id))
            pos += HEADER.size + size
            continue
        if magic != rpcframe.MAGIC or method not in rpcframe.METHODS or size > LIMIT:
            return answers, request_id
        if len(stream) - pos - HEADER.size < size:
            break
        try:
            rpcframe.METHODS[method][1].FromString(stream[pos + HEADER.size : pos + HEADER.size + size])
        except DecodeError:
            return answers, request_id
        answers.append((method, request_id))
        pos += HEADER.size + size
    return answers, None


def check(conn, stream: bytes, token: bytes | None) -> None:
    answers, error = expected(stream, token)
    got = frames_of(conn.transport.stream)
    if error is not None:
        assert conn.transport.closed, "an untrusted frame must close the connection"
        assert got and got[-1][0] == rpcframe.ERROR_METHOD, "the last frame must be the error frame"
        assert got[-1][1] == error, "the error frame carries the request id of the frame it refuses"
        assert got[-1][2], "the error frame says why"
        got = got[:-1]
    else:
        assert not conn.transport.closed, "a stream without an untrusted frame must leave the connection open"
    assert [(method, request_id) for method, request_id, _ in got] == answers
    for method, _, body in got:
        if method == rpcframe.AUTH_METHOD:
            assert body == b""
            continue
        response = rpcframe.METHODS[method][2].FromString(body)
        assert response.status in STATUSES and response.status <= 0 and response.status != Status.INTERNAL
    limit = max(BASE_BUFFER, HEADER.size + LIMIT)
    assert max(conn.buffer_sizes, default=0) <= limit, "a buffer larger than one frame"
    protocol = conn.protocol
    if not conn.transport.closed:
        pending = protocol._end - protocol._start
        if pending < HEADER.size or HEADER.unpack_from(protocol._buf, protocol._start)[3] <= BASE_BUFFER - HEADER.size:
            assert len(protocol._buf) == BASE_BUFFER, "a large buffer kept after its frame was answered"
    connections = protocol._connections
    assert connections.stats.buffered_bytes == protocol._reserved
    conn.lose()
    assert connections.stats.buffered_bytes == 0 and connections.stats.connections == 0
    assert not connections.live


@pytest.fixture(autouse=True)
def _quiet():
    logger = logging.getLogger("kvtier")
    level = logger.level
    logger.setLevel(logging.ERROR)  # thousands of "protocol error" lines would only slow the run
    yield
    logger.setLevel(level)


FUZZ = settings(
    max_examples=int(300 * SCALE),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(streams)
def test_any_byte_stream_gets_answers_in_order_or_one_error_frame_and_the_close(case):
    stream, cut, reads = case
    if cut and stream:
        stream = stream[: len(stream) // 2 or 1]
    conn = connect(make_handlers(), limits=LIMITS)
    conn.feed(stream, reads)
    check(conn, stream, None)


@FUZZ
@given(streams, st.sampled_from(["right", "wrong", "none", "huge"]), st.lists(st.integers(1, 20), min_size=1))
def test_with_credentials_nothing_is_answered_before_a_right_auth_frame(case, auth, reads):
    stream, cut, _ = case
    token = make_token(SECRET).encode()
    first = {
        "right": frame(rpcframe.AUTH_METHOD, 1, token),
        "wrong": frame(rpcframe.AUTH_METHOD, 1, make_token(b"x" * 32).encode()),
        "none": b"",
        "huge": HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, 1, rpcframe.MAX_TOKEN + 1),
    }[auth]
    stream = first + stream
    if cut and stream:
        stream = stream[: len(stream) // 2 or 1]
    conn = connect(make_handlers(SECRET), limits=LIMITS)
    conn.feed(stream, reads)
    check(conn, stream, token)


@FUZZ
@given(
    st.lists(st.lists(st.sampled_from([40, 2000, *EDGES]), min_size=1, max_size=3), min_size=2, max_size=4),
    st.randoms(use_true_random=False),
)
def test_connections_sharing_a_budget_of_one_message_are_all_answered(sizes_per_connection, rng):
    """Large frames on several connections, a shared budget of one message, reads interleaved at
    random: every frame is answered (waiting never deadlocks) and every byte comes back."""
    connections = Connections(FastPathLimits(max_message_bytes=LIMIT, max_buffered_bytes=LIMIT))
    handlers = make_handlers()
    conns = [connect(handlers, connections) for _ in sizes_per_connection]
    streams = [
        b"".join(frame(1, i, sized_payload(size)) for i, size in enumerate(sizes)) for sizes in sizes_per_connection
    ]
    sent = [0] * len(conns)
    while True:
        ready = [i for i, conn in enumerate(conns) if conn.transport.reading and sent[i] < len(streams[i])]
        if not ready:
            break
        i = rng.choice(ready)
        end = min(len(streams[i]), sent[i] + rng.choice([1, 100, 5000, 70_000]))
        sent[i] += conns[i].feed(streams[i][sent[i] : end])
    for conn, sizes in zip(conns, sizes_per_connection, strict=True):
        assert [request_id for _, request_id, _ in frames_of(conn.transport.stream)] == list(range(len(sizes)))
    assert connections.stats.buffered_bytes == sum(conn.protocol._reserved for conn in conns)
    for conn in conns:
        conn.lose()
    assert connections.stats.buffered_bytes == 0 and not connections._waiters
