"""Malformed and pipelined traffic against a real master's fast-path endpoint, over raw sockets.

Only `kvtier.proto.rpcframe` and the protobuf messages: what any peer could
send. A frame the master cannot trust gets one ERROR_METHOD frame with a
reason, then its connection is closed; every other connection, and every
other client, is served on. Valid requests pipelined on one connection are
answered in order.
"""

from __future__ import annotations

import contextlib
import socket
import struct

import crc32c
import pytest

from kvtier.common.units import parse_hostport
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.status import Status
from tests.integration.rawframes import IO_TIMEOUT_S, is_closed_by_peer, recv_exact

HEADER = rpcframe.HEADER
EXISTS, GET_REPLICAS, PUT_START = (rpcframe.METHOD_IDS[n] for n in ("Exists", "GetReplicas", "PutStart"))


@pytest.fixture
def master(bare_cluster):
    """A running master (no segment needed: these tests speak to the master only)."""
    bare_cluster.start_master()
    return bare_cluster


def connect(cluster) -> socket.socket:
    endpoint = cluster.master.info["fast_endpoint"]
    assert endpoint.startswith("tcp://"), endpoint
    sock = socket.create_connection(parse_hostport(endpoint[len("tcp://") :]), timeout=IO_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def frame(method: int, request_id: int, payload: bytes = b"", *, magic: int = rpcframe.MAGIC) -> bytes:
    return HEADER.pack(magic, method, request_id, len(payload)) + payload


def exists_frame(request_id: int, keys: list[str], namespace: str = "default") -> bytes:
    return frame(EXISTS, request_id, pb.KeysRequest(namespace=namespace, keys=keys).SerializeToString())


def recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    """(method, request_id, body) of the next response frame; checks the magic."""
    magic, method, request_id, size = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert magic == rpcframe.MAGIC, f"bad magic {magic:#x} from the master"
    return method, request_id, recv_exact(sock, size)


def recv_reply(sock: socket.socket, method: int, request_id: int):
    """The next response, which must answer `method` / `request_id`, decoded."""
    got_method, got_id, body = recv_frame(sock)
    assert (got_method, got_id) == (method, request_id), body[:200]
    return rpcframe.METHODS[method][2].FromString(body)


def assert_serving(cluster, *open_connections: socket.socket) -> None:
    """The master answers new and already-open fast-path connections, gRPC, and a real client."""
    assert cluster.master.alive
    with connect(cluster) as sock:
        sock.sendall(exists_frame(1, ["probe"]))
        reply = recv_reply(sock, EXISTS, 1)
        assert (reply.status, list(reply.exists)) == (Status.OK, [False])
    for n, sock in enumerate(open_connections):
        sock.sendall(exists_frame(1000 + n, ["probe", "other"]))
        assert list(recv_reply(sock, EXISTS, 1000 + n).exists) == [False, False]
    client = cluster.client()
    assert client.batch_exists(["probe"]) == [False]
    assert client._master.fast_path_active
    assert client.cluster_status().objects == 0


# ------------------------------------------------------------------ frames the master cannot trust


BAD_FRAMES = {
    "bad magic": (frame(EXISTS, 7, magic=0x1234), "magic=0x1234"),
    "bad magic, the request bytes swapped": (frame(EXISTS, 7, magic=0x4B4D), "magic=0x4b4d"),
    "unknown method": (frame(99, 7), "method=99"),
    "method 0 is not a request": (frame(rpcframe.ERROR_METHOD, 7), "method=0"),
    "highest method id": (frame(0xFFFF, 7), "method=65535"),
    "oversized payload_len": (HEADER.pack(rpcframe.MAGIC, EXISTS, 7, rpcframe.MAX_PAYLOAD + 1), "size=268435457"),
    "payload_len 2**32-1": (HEADER.pack(rpcframe.MAGIC, EXISTS, 7, 0xFFFFFFFF), "size=4294967295"),
    "truncated protobuf": (frame(EXISTS, 7, b"\x0a\x05ab"), "undecodable ExistsRequest"),
    "garbage protobuf": (frame(PUT_START, 7, b"\xff\xff\xff\xff"), "undecodable PutStartRequest"),
    "key not UTF-8": (frame(GET_REPLICAS, 7, b"\x12\x02\xff\xfe"), "undecodable KeysRequest"),
}


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_an_untrusted_frame_gets_an_error_frame_then_its_connection_closes(master, case):
    data, reason = BAD_FRAMES[case]
    with connect(master) as bystander, connect(master) as sock:
        bystander.sendall(exists_frame(1, ["before"]))
        recv_reply(bystander, EXISTS, 1)

        sock.sendall(data)
        method, request_id, body = recv_frame(sock)
        assert (method, request_id) == (rpcframe.ERROR_METHOD, 7)
        assert reason in body.decode(), body
        assert is_closed_by_peer(sock), "the connection is closed after the error frame"

        assert_serving(master, bystander)


def test_requests_before_a_bad_frame_are_answered_and_after_it_ignored(master):
    with connect(master) as sock:
        sock.sendall(exists_frame(1, ["a"]) + frame(99, 2) + exists_frame(3, ["b"]))
        assert recv_reply(sock, EXISTS, 1).status == Status.OK
        method, request_id, body = recv_frame(sock)
        assert (method, request_id) == (rpcframe.ERROR_METHOD, 2) and b"method=99" in body
        assert is_closed_by_peer(sock), "nothing answered after the bad frame"
    assert_serving(master)


def test_data_after_the_error_frame_is_ignored(master):
    with connect(master) as sock:
        sock.sendall(frame(EXISTS, 5, b"\x0a\x05ab"))
        assert recv_frame(sock)[:2] == (rpcframe.ERROR_METHOD, 5)
        with contextlib.suppress(OSError):  # the master may already have reset the connection
            sock.sendall(exists_frame(6, ["late"]))
        assert is_closed_by_peer(sock)
    assert_serving(master)


# ------------------------------------------------------------------ valid traffic


def test_a_decodable_but_invalid_request_gets_a_status_and_the_connection_stays(master):
    with connect(master) as sock:
        sock.sendall(frame(EXISTS, 1))  # empty payload: an empty KeysRequest, namespace ""
        reply = recv_reply(sock, EXISTS, 1)
        assert reply.status == Status.INVALID_KEY and "namespace" in reply.error
        sock.sendall(exists_frame(2, ["k"], namespace="\x00bad"))
        assert recv_reply(sock, EXISTS, 2).status == Status.INVALID_KEY
        sock.sendall(exists_frame(3, ["k"]))
        assert recv_reply(sock, EXISTS, 3).status == Status.OK
    assert_serving(master)


def test_two_pipelined_requests_get_two_responses_in_order(master):
    with connect(master) as sock:
        get = frame(GET_REPLICAS, 12, pb.KeysRequest(namespace="default", keys=["x"]).SerializeToString())
        sock.sendall(exists_frame(11, ["a", "b", "c"]) + get)
        first = recv_reply(sock, EXISTS, 11)
        assert (first.status, list(first.exists)) == (Status.OK, [False, False, False])
        second = recv_reply(sock, GET_REPLICAS, 12)
        assert (second.status, list(second.statuses)) == (Status.OK, [Status.NOT_FOUND])


def test_many_pipelined_requests_with_any_ids_are_answered_in_order(master):
    master.start_segment("seg0", "16MiB")
    stored = {"k1": b"one" * 100, "k3": b"three" * 7, "g": b"gee" * 1000}
    with master.client() as client:
        for key, value in stored.items():
            client.put(key, value)
    ids = [0, 0xFFFFFFFF, 5, 5, 1, *range(100, 300, 3)]

    def get_keys(n: int) -> list[str]:
        return ["g", "k1", "nope"][: n % 3 + 1]

    requests = b"".join(
        exists_frame(rid, [f"k{j}" for j in range(n % 4 + 1)])
        if n % 2
        else frame(GET_REPLICAS, rid, pb.KeysRequest(namespace="default", keys=get_keys(n)).SerializeToString())
        for n, rid in enumerate(ids)
    )
    with connect(master) as sock:
        sock.sendall(requests)
        for n, rid in enumerate(ids):  # each answer is the one for its own request: ids and values
            if n % 2:
                keys = [f"k{j}" for j in range(n % 4 + 1)]
                reply = recv_reply(sock, EXISTS, rid)
                assert list(reply.exists) == [key in stored for key in keys], (rid, keys)
                assert reply.prefix_count == 0  # k0 is never stored
            else:
                keys = get_keys(n)
                reply = recv_reply(sock, GET_REPLICAS, rid)
                found = [key in stored for key in keys]
                assert list(reply.statuses) == [Status.OK if f else Status.NOT_FOUND for f in found], (rid, keys)
                assert list(reply.sizes) == [len(stored.get(k, b"")) for k in keys]
                assert list(reply.checksums) == [crc32c.crc32c(stored[k]) if k in stored else 0 for k in keys]
                assert list(reply.replica_counts) == [int(f) for f in found] and reply.lease_ms > 0


def test_a_request_dribbled_byte_by_byte_is_answered(master):
    data = exists_frame(77, ["slow", "key"])
    with connect(master) as slow, connect(master) as other:
        slow.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, byte in enumerate(data):
            slow.sendall(bytes([byte]))
            if i == HEADER.size // 2:  # a half-sent header does not hold up other connections
                other.sendall(exists_frame(1, ["fast"]))
                assert recv_reply(other, EXISTS, 1).status == Status.OK
        assert list(recv_reply(slow, EXISTS, 77).exists) == [False, False]


# ------------------------------------------------------------------ connections cut mid-frame


@pytest.mark.parametrize("cut", ["mid-header", "after-header", "mid-payload"])
@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_connection_cut_mid_frame_does_not_disturb_the_master(master, cut, how):
    payload = pb.KeysRequest(namespace="default", keys=["k" * 100]).SerializeToString()
    data = frame(EXISTS, 9, payload)
    sent = {"mid-header": 5, "after-header": HEADER.size, "mid-payload": HEADER.size + 10}[cut]
    with connect(master) as bystander:
        sock = connect(master)
        sock.sendall(data[:sent])
        if how == "reset":  # RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        assert_serving(master, bystander)
