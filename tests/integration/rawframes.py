"""Raw data-plane access for tests: frames over a plain socket, no kvtier client code."""

from __future__ import annotations

import socket

from kvtier.proto import frames
from kvtier.proto.auth import wall_ms
from kvtier.proto.frames import Op

IO_TIMEOUT_S = 5.0


def far_deadline() -> int:
    """A grant deadline (kvtier.proto.frames FLAG_DEADLINE) no test outlives: for frames whose test is
    about something else. Tests of grants use the one the master's reply names (`tag_expiry_ms`)."""
    return wall_ms() + 3_600_000


def connect(endpoint: str) -> socket.socket:
    """A blocking socket to a `tcp://host:port` endpoint, with a timeout on every operation."""
    assert endpoint.startswith("tcp://"), endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=IO_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def send_request(
    sock: socket.socket,
    op: Op,
    request_id: int,
    ranges: list[tuple[int, int]],
    payload: bytes = b"",
    deadline: int | None = None,
) -> None:
    """One request; a READ or WRITE carries `deadline`, by default `far_deadline()` (the segment
    refuses one without)."""
    if deadline is None:
        deadline = far_deadline() if op in (Op.READ, Op.WRITE) else 0
    sock.sendall(frames.pack_request(op, request_id, ranges, len(payload), deadline=deadline) + payload)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


def recv_response(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(op, request_id, status, payload) of the next response; checks magic and version."""
    magic, version, op, request_id, status, _flags, payload_len = frames.RESPONSE.unpack(
        recv_exact(sock, frames.RESPONSE.size)
    )
    assert (magic, version) == (frames.MAGIC, frames.VERSION), f"bad response header {magic:#x}/{version}"
    return op, request_id, status, recv_exact(sock, payload_len)


def is_closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer closed the connection (EOF or reset), waiting up to the socket timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def ping(endpoint: str, request_id: int = 1) -> bool:
    """A PING on a fresh connection gets its OK response."""
    with connect(endpoint) as sock:
        send_request(sock, Op.PING, request_id, [])
        return recv_response(sock) == (Op.PING, request_id, 0, b"")
