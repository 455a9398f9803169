"""Case 13: malformed data-plane traffic against a real segment server's TCP endpoint.

Raw sockets and `kvtier.proto.frames` only: what any peer could send. A
request with a bad range is refused and the connection stays in sync; a frame
that cannot be trusted closes its connection only; a peer vanishing
mid-transfer leaves the server serving everyone else.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest

from kvtier.client import Status
from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.segment_server.region import read_header
from tests.integration.rawframes import connect, far_deadline, is_closed_by_peer, ping, recv_response, send_request

KiB, MiB = 1 << 10, 1 << 20


def tcp_endpoint(cluster, name: str = "seg0") -> str:
    (endpoint,) = [e for e in cluster.segments[name].info["endpoints"] if e.startswith("tcp://")]
    return endpoint


@pytest.fixture
def stored(cluster):
    """(endpoint, capacity, offset, value) of an object stored on seg0 (and seg1: replicas=2)."""
    client = cluster.client()
    value = os.urandom(10_000)
    client.put("stored", value, replicas=2)
    (replica,) = [r for r in client.locate("stored") if r["segment"] == "seg0"]
    capacity = read_header(str(cluster.region_file("seg0")))["capacity"]
    assert capacity == 64 * MiB
    return tcp_endpoint(cluster), capacity, replica["offset"], value


def assert_serving(cluster, value: bytes) -> None:
    """seg0 is alive, answers a new connection, and the client still reads through it."""
    assert cluster.segments["seg0"].alive
    assert ping(tcp_endpoint(cluster), request_id=99)
    client = cluster.client(transport="tcp")
    assert client.get("stored") == value
    assert {s.name for s in client.cluster_status().segments} == {"seg0", "seg1"}


def test_read_out_of_range_is_invalid_range_and_the_connection_keeps_serving(cluster, stored):
    endpoint, capacity, offset, value = stored
    bad_ranges = [
        [(capacity - 10, 20)],  # straddles the end
        [(capacity, 1)],  # starts at the end
        [(2**64 - 1, 1)],  # offset + length overflows 64 bits
        [(offset, len(value)), (capacity + 4096, 1)],  # one good range does not save the request
    ]
    with connect(endpoint) as sock:
        for request_id, ranges in enumerate(bad_ranges, start=1):
            send_request(sock, Op.READ, request_id, ranges)
            op, rid, status, message = recv_response(sock)
            assert (op, rid, status) == (Op.READ, request_id, Status.INVALID_RANGE), ranges
            assert b"outside region" in message

        send_request(sock, Op.PING, 10, [])
        assert recv_response(sock) == (Op.PING, 10, Status.OK, b"")
        send_request(sock, Op.READ, 11, [(offset, len(value))])
        assert recv_response(sock) == (Op.READ, 11, Status.OK, value)

        # Pipelined: bad and good requests sent back to back are answered in order.
        sock.sendall(
            frames.pack_request(Op.READ, 12, [(capacity - 1, 2)], deadline=far_deadline())
            + frames.pack_request(
                Op.READ, 13, [(offset, 100), (offset + 100, 0), (capacity - 1, 1)], deadline=far_deadline()
            )
            + frames.pack_request(Op.PING, 14, [])
        )
        assert recv_response(sock)[:3] == (Op.READ, 12, Status.INVALID_RANGE)
        op, rid, status, payload = recv_response(sock)
        assert (op, rid, status, payload[:100], len(payload)) == (Op.READ, 13, Status.OK, value[:100], 101)
        assert recv_response(sock) == (Op.PING, 14, Status.OK, b"")
    assert_serving(cluster, value)


def test_write_out_of_range_is_drained_and_refused_and_the_connection_keeps_serving(cluster, stored):
    endpoint, capacity, offset, value = stored
    with connect(endpoint) as sock:
        # 1 MiB of payload, more than the server's drain buffer, for a range past the end. If the
        # payload were not consumed, its bytes would be parsed as headers and the PING would never
        # be answered.
        payload = os.urandom(MiB)
        send_request(sock, Op.WRITE, 1, [(capacity - 100, MiB)], payload)
        send_request(sock, Op.PING, 2, [])
        op, rid, status, message = recv_response(sock)
        assert (op, rid, status) == (Op.WRITE, 1, Status.INVALID_RANGE) and b"outside region" in message
        assert recv_response(sock) == (Op.PING, 2, Status.OK, b"")

        # A bad range after a good one: nothing of the request is written, not even the good range.
        send_request(sock, Op.WRITE, 3, [(offset, 16), (capacity, 16)], b"X" * 32)
        assert recv_response(sock)[:3] == (Op.WRITE, 3, Status.INVALID_RANGE)
        send_request(sock, Op.READ, 4, [(offset, len(value))])
        assert recv_response(sock) == (Op.READ, 4, Status.OK, value), "a refused WRITE changed stored bytes"

        # A valid WRITE on the same connection lands (in the free tail of the region) and reads back.
        tail = os.urandom(4 * KiB)
        send_request(sock, Op.WRITE, 5, [(capacity - len(tail), len(tail))], tail)
        assert recv_response(sock) == (Op.WRITE, 5, Status.OK, b"")
        send_request(sock, Op.READ, 6, [(capacity - len(tail), len(tail))])
        assert recv_response(sock) == (Op.READ, 6, Status.OK, tail)
    assert_serving(cluster, value)


def test_a_write_of_ranges_back_to_back_lands_byte_for_byte_whatever_the_pieces(cluster, stored):
    """The segment receives runs of contiguous ranges in one buffer (issue 19): runs are broken by
    gaps and by ranges that go back, empty ranges neither start nor break one, and a later range
    over an earlier one's bytes wins, as when each range was received alone."""
    endpoint, capacity, _offset, value = stored
    base = capacity - 256 * KiB  # the free tail of the region
    ranges = [
        (base, 10 * KiB),
        (base + 10 * KiB, 0),  # empty, inside a run
        (base + 10 * KiB, 3),
        (base + 10 * KiB + 3, 20 * KiB),  # continues the run
        (base + 64 * KiB, 0),  # empty, elsewhere: does not break the run
        (base + 30 * KiB + 3, 5),  # still contiguous after it
        (base + 100 * KiB, 7 * KiB),  # a gap: a new run
        (base + 2 * KiB, 1 * KiB),  # goes back, over bytes of the first range: written after them
        (base + 3 * KiB, 0),
    ]
    payload = os.urandom(sum(n for _, n in ranges))
    expected = {}
    at = 0
    for offset, size in ranges:
        expected[(offset, size)] = payload[at : at + size]
        at += size
    with connect(endpoint) as sock:
        sock.sendall(frames.pack_request(Op.WRITE, 1, ranges, len(payload), deadline=far_deadline()))
        for lo in range(0, len(payload), 4093):  # pieces that straddle every range boundary
            sock.sendall(payload[lo : lo + 4093])
        assert recv_response(sock) == (Op.WRITE, 1, Status.OK, b"")
        first = bytearray(expected[(base, 10 * KiB)])
        first[2 * KiB : 3 * KiB] = expected[(base + 2 * KiB, 1 * KiB)]
        reads = [(base, 10 * KiB, bytes(first))] + [
            (offset, size, data) for (offset, size), data in expected.items() if size and offset != base
        ]
        for i, (offset, size, data) in enumerate(reads, 2):
            send_request(sock, Op.READ, i, [(offset, size)])
            assert recv_response(sock) == (Op.READ, i, Status.OK, data), (offset, size)
    assert_serving(cluster, value)


BAD_HEADERS = {
    "bad magic": struct.pack("<HBBIIIQ", 0xBEEF, frames.VERSION, Op.PING, 1, 0, 0, 0),
    "bad version": struct.pack("<HBBIIIQ", frames.MAGIC, frames.VERSION + 1, Op.PING, 1, 0, 0, 0),
    "unknown op": struct.pack("<HBBIIIQ", frames.MAGIC, frames.VERSION, 77, 1, 0, 0, 0),
    "READ with a payload": struct.pack("<HBBIIIQ", frames.MAGIC, frames.VERSION, Op.READ, 1, 0, 0, 8),
    "too many ranges": struct.pack(
        "<HBBIIIQ", frames.MAGIC, frames.VERSION, Op.READ, 1, frames.MAX_RANGES_PER_FRAME + 1, 0, 0
    ),
    "WRITE larger than the region": struct.pack(
        "<HBBIIIQ", frames.MAGIC, frames.VERSION, Op.WRITE, 1, 1, 0, 64 * MiB + 1
    ),
}


def test_an_untrusted_header_is_a_protocol_error_that_closes_only_its_connection(cluster, stored):
    endpoint, _capacity, offset, value = stored
    with connect(endpoint) as bystander:
        send_request(bystander, Op.PING, 1, [])
        assert recv_response(bystander)[:3] == (Op.PING, 1, Status.OK)
        for name, header in BAD_HEADERS.items():
            with connect(endpoint) as sock:
                sock.sendall(header)
                _op, _rid, status, message = recv_response(sock)
                assert status == Status.PROTOCOL_ERROR and message, f"{name}: want PROTOCOL_ERROR with a reason"
                assert is_closed_by_peer(sock), f"{name}: the server must close a connection it cannot re-sync"

            # The other, already open connection is not affected.
            send_request(bystander, Op.READ, 2, [(offset, len(value))])
            assert recv_response(bystander) == (Op.READ, 2, Status.OK, value), name
    assert_serving(cluster, value)


def test_a_write_whose_payload_disagrees_with_its_ranges_is_a_protocol_error(cluster, stored):
    endpoint, capacity, _offset, value = stored
    with connect(endpoint) as sock:
        sock.sendall(
            frames.pack_request(Op.WRITE, 1, [(capacity - 64, 32)], payload_len=64, deadline=far_deadline()) + b"Z" * 64
        )
        assert recv_response(sock)[2] == Status.PROTOCOL_ERROR
        assert is_closed_by_peer(sock)
    assert_serving(cluster, value)


def test_a_connection_cut_mid_transfer_does_not_disturb_the_server(cluster, stored):
    endpoint, capacity, offset, value = stored
    write = frames.pack_request(Op.WRITE, 1, [(capacity - MiB, MiB)], MiB, deadline=far_deadline())
    cuts = {
        "mid WRITE payload": write + os.urandom(100 * KiB),
        "mid header": write[:10],
        "mid range table": write[: frames.REQUEST.size + 5],
        "mid drained payload": frames.pack_request(Op.WRITE, 2, [(capacity, MiB)], MiB, deadline=far_deadline())
        + os.urandom(300 * KiB),
    }
    with connect(endpoint) as bystander:
        for how in ("close", "reset"):
            for name, data in cuts.items():
                sock = connect(endpoint)
                sock.sendall(data)
                if how == "reset":  # an abortive close: RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                assert ping(endpoint, request_id=7), f"server stopped answering after a {how} {name}"

        send_request(bystander, Op.READ, 3, [(offset, len(value))])
        assert recv_response(bystander) == (Op.READ, 3, Status.OK, value)
    assert_serving(cluster, value)
