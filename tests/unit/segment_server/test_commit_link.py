"""The commit feed's framed connection (kvtier.segment_server.commit_link) against a silent peer."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.segment_server.commit_link import FeedLinkError, FramedFeedLink


@pytest.fixture
def silent_master():
    """A listener that accepts and reads but never answers (a paused leader)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        conn, _ = server.accept()
        accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    server.close()


def test_a_waiting_poll_ends_as_soon_as_the_leader_moved(silent_master):
    link = FramedFeedLink(silent_master, "", 5.0)
    checks = []

    def current() -> bool:
        checks.append(1)
        return len(checks) < 3  # the master link moved to another leader after two slices

    try:
        with pytest.raises(FeedLinkError, match="leading master changed"):
            link.poll(pb.PollCommitsRequest(segment_id=1, wait_ms=1000), 600.0, current)
    finally:
        link.close()
    assert len(checks) == 3


def _scripted_master(chunks_of):
    """A listener answering each request with `chunks_of(request_id)`: byte strings sent one by one
    (with TCP_NODELAY, so a reply can arrive cut anywhere)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while header := conn.recv(rpcframe.HEADER.size, socket.MSG_WAITALL):
                _, _, request_id, size = rpcframe.HEADER.unpack(header)
                if size:
                    conn.recv(size, socket.MSG_WAITALL)
                for chunk in chunks_of(request_id):
                    conn.sendall(chunk)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


@contextlib.contextmanager
def _linked(chunks_of):
    """A FramedFeedLink to a `_scripted_master(chunks_of)`, both closed afterwards."""
    server, thread = _scripted_master(chunks_of)
    link = FramedFeedLink(f"tcp://127.0.0.1:{server.getsockname()[1]}", "", 5.0)
    try:
        yield link
    finally:
        link.close()
        thread.join(timeout=5)
        server.close()


def test_a_refusal_frame_is_an_error_not_a_reply():
    message = b"unauthenticated: this master needs an AUTH frame first"

    def refusal(request_id: int) -> list[bytes]:
        return [rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.ERROR_METHOD, request_id, len(message)) + message]

    with _linked(refusal) as link, pytest.raises(FeedLinkError, match="refused"):
        link.poll(pb.PollCommitsRequest(segment_id=1), 5.0)


def _reply(request_id: int, reply: pb.PollCommitsResponse) -> bytes:
    body = reply.SerializeToString()
    return rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.METHOD_IDS["PollCommits"], request_id, len(body)) + body


def test_replies_cut_anywhere_or_larger_than_the_buffer_are_read_whole_and_in_order():
    # the link reads a reply into one reusable buffer, header and message together when they come together
    names = [f"ns\x00{i:06d}-" + "x" * 200 for i in range(600)]  # ~130 KiB: more than the link's buffer
    big = pb.PollCommitsResponse(status=0, first_seq=1, names=names, offsets=range(600), sizes=[1] * 600)
    small = pb.PollCommitsResponse(status=0, first_seq=601)

    def chunks_of(request_id: int) -> list[bytes]:
        data = _reply(request_id, big if request_id % 2 else small)
        cuts = [0, 3, 11, 12, 13, 4000, 70000, len(data)]  # inside the header, at its end, inside the message
        return [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    with _linked(chunks_of) as link:
        for _ in range(2):
            assert list(link.poll(pb.PollCommitsRequest(segment_id=1), 5.0).names) == names
            assert link.poll(pb.PollCommitsRequest(segment_id=1), 5.0).first_seq == 601


def test_bytes_after_a_reply_are_an_error_not_the_next_reply():
    with _linked(lambda request_id: [_reply(request_id, pb.PollCommitsResponse()) * 2]) as link:
        with pytest.raises(FeedLinkError, match="unexpected bytes"):
            link.poll(pb.PollCommitsRequest(segment_id=1), 5.0)
