"""The commit feed's framed connection (kvtier.segment_server.commit_link) against a silent peer."""

from __future__ import annotations

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


def test_a_refusal_frame_is_an_error_not_a_reply():
    server = socket.create_server(("127.0.0.1", 0))

    def refuse() -> None:
        conn, _ = server.accept()
        with conn:
            header = conn.recv(rpcframe.HEADER.size, socket.MSG_WAITALL)
            _, _, request_id, size = rpcframe.HEADER.unpack(header)
            if size:
                conn.recv(size, socket.MSG_WAITALL)
            message = b"unauthenticated: this master needs an AUTH frame first"
            conn.sendall(
                rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.ERROR_METHOD, request_id, len(message)) + message
            )

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    link = FramedFeedLink(f"tcp://127.0.0.1:{server.getsockname()[1]}", "", 5.0)
    try:
        with pytest.raises(FeedLinkError, match="refused"):
            link.poll(pb.PollCommitsRequest(segment_id=1), 5.0)
    finally:
        link.close()
        thread.join(timeout=5)
        server.close()
