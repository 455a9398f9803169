"""How the client receives a reply on the master's fast path (client/master.py `_call_fast`).

Session 9 (issue 19): the header and the body of a reply are taken with one receive call when they
arrived together, which is how the master writes them. Checked against a scripted peer on a real
socket: a whole reply costs one receive; a reply that arrives in pieces (the header itself cut) is
put together the same; bytes past the reply's frame are a protocol error, never part of a reply.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvtier.client.master import MasterClient
from kvtier.client.sockpool import SocketPool
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.errors import ProtocolError

EXISTS = rpcframe.METHOD_IDS["Exists"]
ANSWER = pb.ExistsResponse(exists=[True, False] * 50, prefix_count=1)


class Peer:
    """A fast-path peer that reads one request frame and answers it as `pieces` say: the reply
    cut at those offsets, each piece sent only once the client's previous receive returned (so the
    pieces cannot arrive together: each cut must be where the client receives anew), and `extra`
    bytes after the frame."""

    def __init__(self, pieces: tuple[int, ...] = (), extra: bytes = b"") -> None:
        self.pieces = pieces
        self.extra = extra
        self.received = threading.Event()  # set by the client's socket after each receive
        self.stalled = False  # the client did not receive a piece (waiting for more than was sent)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            _, method, request_id, size = rpcframe.HEADER.unpack(conn.recv(rpcframe.HEADER.size, socket.MSG_WAITALL))
            conn.recv(size, socket.MSG_WAITALL)
            body = ANSWER.SerializeToString()
            reply = rpcframe.HEADER.pack(rpcframe.MAGIC, method, request_id, len(body)) + body + self.extra
            start = 0
            for cut in self.pieces:
                conn.sendall(reply[start:cut])
                start = cut
                self.stalled = self.stalled or not self.received.wait(10)
                self.received.clear()
            conn.sendall(reply[start:])
            conn.recv(1)  # until the client hangs up


class CountingSocket:
    """The client's socket, counting its receive calls (peeks at idle sockets apart) and telling
    the peer each time one returned."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self._sock = sock
        self._peer = peer
        self.receives = 0

    def __getattr__(self, name: str):
        attr = getattr(self._sock, name)
        if not name.startswith("recv"):
            return attr

        def counted(*args):
            peek = len(args) > 1 and args[-1] & socket.MSG_PEEK
            result = attr(*args)
            if not peek:
                self.receives += 1
                self._peer.received.set()
            return result

        return counted


@pytest.fixture
def link(monkeypatch) -> Iterator[tuple[MasterClient, list[CountingSocket]]]:
    made: list[CountingSocket] = []
    connect = SocketPool._connect
    peers: list[Peer] = []

    def counting(pool, timeout):
        made.append(CountingSocket(connect(pool, timeout), peers[-1]))
        return made[-1]

    monkeypatch.setattr(SocketPool, "_connect", counting)
    client = MasterClient("127.0.0.1:1", 5.0)
    client.peers = peers  # type: ignore[attr-defined]
    yield client, made
    client.close()


def ask(client: MasterClient, peer: Peer) -> pb.ExistsResponse:
    client.peers.append(peer)  # type: ignore[attr-defined]
    pool = SocketPool(peer.address, 5.0, 1, "fake master fast path")
    try:
        return client._call_fast(pool, EXISTS, pb.ExistsRequest(namespace="n", keys=["k"]), [False])
    finally:
        pool.close()
        peer.listener.close()


def test_a_whole_reply_is_received_with_one_call(link):
    client, sockets = link
    assert ask(client, Peer()) == ANSWER
    assert sockets[0].receives == 1


@pytest.mark.parametrize("pieces", [(5,), (5, 12), (5, 30), (12,), (30,)], ids=str)
def test_a_reply_in_pieces_is_put_together(link, pieces):
    """Cut inside the header (12 bytes), right after it, or inside the body: the same reply."""
    client, _ = link
    peer = Peer(pieces)
    assert ask(client, peer) == ANSWER
    assert not peer.stalled


def test_bytes_past_the_reply_are_a_protocol_error(link):
    client, _ = link
    with pytest.raises(ProtocolError, match="past its frame"):
        ask(client, Peer(extra=b"\x00\x01"))
