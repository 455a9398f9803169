"""Stalled and hostile data-plane peers against real processes (issue 15, observations 1 and 2).

A frame is bounded by its grant: with a cluster secret its capability's expiry, without one the
deadline the master's reply names (kvtier.proto.frames FLAG_DEADLINE). A writer that stalls past
its grant never writes into the range's next owner, a reader that stops draining never receives
bytes put after its grant ended: the segment cuts the frame, logs it and counts it.

Short grants (`--lease-s 1 --put-timeout-s 1`) keep each test at a few seconds: the range is
reused about 1 s + CLOCK_SKEW_MS after its grant started. Segments are exactly one object large, so
the next owner's put succeeds only once the stalled peer's range is handed on, and lands on it
(hard-pinned: a full segment would otherwise evict it at once).
"""

from __future__ import annotations

import os
import socket

import grpc
import pytest

from kvtier.proto import auth, frames, master_pb2_grpc
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.integration.rawframes import IO_TIMEOUT_S, connect, recv_exact, recv_response
from tests.integration.test_metrics import scrape, value

SECRET = b"0123456789abcdef0123456789abcdef"
REUSE_WAIT_S = 15.0  # generous on a loaded machine; the range is reusable ~3 s after its grant


def with_secret(cluster, tmp_path, secret: str) -> None:
    """Give the cluster the test secret when `secret` is "secret" (the fixtures' param)."""
    if secret == "secret":
        path = tmp_path / "cluster.secret"
        path.write_bytes(SECRET)
        os.chmod(path, 0o600)
        cluster.secret_file = str(path)


@pytest.fixture(params=["no-secret", "secret"])
def stall_cluster(bare_cluster, tmp_path, request):
    with_secret(bare_cluster, tmp_path, request.param)
    bare_cluster.start_master("--lease-s", "1", "--put-timeout-s", "1")
    return bare_cluster


class Master:
    """Raw gRPC calls, as a tenant's own code could make them (the cluster token with a secret)."""

    def __init__(self, cluster) -> None:
        self.channel = grpc.insecure_channel(cluster.master.info["address"])
        self.stub = master_pb2_grpc.MasterStub(self.channel)
        self.metadata = ((auth.AUTH_METADATA, auth.make_token(SECRET)),) if cluster.secret_file else ()

    def __getattr__(self, method: str):
        call = getattr(self.stub, method)
        return lambda request: call(request, metadata=self.metadata)


def start_segment(cluster, dram: str):
    proc = cluster.start_segment("seg0", dram, "--metrics", "127.0.0.1:0")
    endpoint = next(e for e in proc.info["endpoints"] if e.startswith("tcp://"))
    return proc, endpoint


def frames_cut(proc, op: str) -> float:
    return value(scrape(proc.info["metrics"]), "kvtier_segment_frames_cut_total", segment="seg0", op=op)


def slow_reader(cluster, endpoint: str, size: int) -> tuple[socket.socket, int]:
    """Reader A of the hard-pinned object "a" (`size` bytes, B's put of it done): its READ sent, as a
    client would send it, with the grant (and mount session) its lookup named, and the first 1 KiB
    of the answer taken; A's receive buffer is small, so most of the response stays on the segment.
    Returns A's socket and the object's offset."""
    reply = Master(cluster).GetReplicas(pb.KeysRequest(namespace="default", keys=["a"]))
    assert list(reply.statuses) == [Status.OK] and reply.tag_expiry_ms
    offset = reply.replica_offsets[0]
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    a = socket.socket()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.settimeout(IO_TIMEOUT_S)
    a.connect((host, int(port)))
    grant = (reply.tag_expiry_ms, reply.replica_tags, reply.segments[0].session)
    a.sendall(frames.pack_request(Op.READ, 1, [(offset, size)], caps=grant))
    head = recv_exact(a, frames.RESPONSE.size + 1024)
    assert frames.RESPONSE.unpack_from(head)[4] == Status.OK and set(head[frames.RESPONSE.size :]) == {ord("a")}
    return a, offset


def finish_cut_write(a: socket.socket, size: int) -> None:
    """Writer A sends the rest of its WRITE (request 1, its first byte sent): it must be cut, answered
    LEASE_EXPIRED, and the connection stay in sync (a PING is answered)."""
    a.sendall(b"A" * (size - 1))
    _op, request_id, status, message = recv_response(a)
    assert (request_id, status) == (1, Status.LEASE_EXPIRED), message
    a.sendall(frames.pack_request(Op.PING, 2, []))
    assert recv_response(a)[:3] == (Op.PING, 2, 0)
    a.close()


def cut_logged(proc, op: str) -> bool:
    return any("frame cut" in line and f"op={op}" in line for line in proc.log.read_text().splitlines())


def test_a_stalled_writer_never_writes_into_the_next_owners_object(stall_cluster):
    # given tenant A's pending put of 1 MiB on a segment of 1 MiB, its frame sent as far as 1 byte
    size = 1 << 20
    segment, endpoint = start_segment(stall_cluster, "1MiB")
    master = Master(stall_cluster)
    start = master.PutStart(pb.PutStartRequest(namespace="default", keys=["a"], sizes=[size], replicas=1))
    assert list(start.statuses) == [Status.OK] and start.tag_expiry_ms
    offset = start.replica_offsets[0]
    a = connect(endpoint)
    grant = (start.tag_expiry_ms, start.replica_tags)  # no secret: no tags, the expiry as the deadline
    a.sendall(frames.pack_request(Op.WRITE, 1, [(offset, size)], size, caps=grant) + b"A")
    # when A revokes and stalls until tenant B's put of the same size is acknowledged on the same range
    assert list(
        master.PutRevoke(pb.PutRevokeRequest(namespace="default", keys=["a"], put_id=start.put_id)).statuses
    ) == [0]
    b_value = os.urandom(size)
    b = stall_cluster.client(transport="tcp")
    assert stall_cluster.wait_for(lambda: b.batch_put(["b"], [b_value], pin="hard") == [Status.OK], REUSE_WAIT_S, 0.2)
    assert b.locate("b")[0]["offset"] == offset, "B's object must be on A's range for this test to mean anything"
    # and A then sends the rest of its payload
    # then A's frame was cut: it gets LEASE_EXPIRED, and the connection is still in sync
    finish_cut_write(a, size)
    # and B reads back exactly its bytes
    assert b.get("b") == b_value
    # and the cut was counted and logged
    assert frames_cut(segment, "WRITE") == 1 and frames_cut(segment, "READ") == 0
    assert stall_cluster.wait_for(lambda: cut_logged(segment, "WRITE"), 5.0)


def test_a_reader_that_stops_draining_never_receives_the_next_owners_bytes(stall_cluster):
    # given A's object of 8 MiB on a segment of 8 MiB, and A's READ of it, of which A takes 1 KiB
    size = 8 << 20
    segment, endpoint = start_segment(stall_cluster, "8MiB")
    b = stall_cluster.client(transport="tcp")
    b.put("a", b"a" * size, pin="hard")
    a, offset = slow_reader(stall_cluster, endpoint, size)
    # when A stops reading, its object is removed and B puts a secret that lands on the same range
    assert b.remove("a")
    secret = b"B" * size
    assert stall_cluster.wait_for(lambda: b.batch_put(["b"], [secret], pin="hard") == [Status.OK], REUSE_WAIT_S, 0.2)
    assert b.locate("b")[0]["offset"] == offset
    # and A reads all it still can
    rest = bytearray()
    closed = False
    try:
        while chunk := a.recv(1 << 20):
            rest += chunk
        closed = True
    except ConnectionResetError:
        closed = True
    except TimeoutError:  # everything sent and the connection left open: nothing was cut
        pass
    finally:
        a.close()
    # then none of it is B's: A's response was cut with the connection
    assert set(rest) <= {ord("a")}, f"A received {len(rest) - rest.count(b'a')} bytes put after its grant ended"
    assert closed and 1024 + len(rest) < size, "the whole response arrived: nothing was cut"
    assert b.get("b") == secret
    assert frames_cut(segment, "READ") == 1
    assert stall_cluster.wait_for(lambda: cut_logged(segment, "READ"), 5.0)


def test_a_frame_without_a_grant_deadline_touches_no_region(bare_cluster):
    # given a cluster without a secret, and a byte of a put of ours in the region
    bare_cluster.start_master()
    _segment, endpoint = start_segment(bare_cluster, "1MiB")
    client = bare_cluster.client(transport="tcp")
    client.put("k", b"k" * 4096)
    offset = client.locate("k")[0]["offset"]
    with connect(endpoint) as sock:
        # when bare frames (no FLAG_DEADLINE, no FLAG_CAPS) read and write it
        sock.sendall(frames.pack_request(Op.READ, 1, [(offset, 4096)]))
        read = recv_response(sock)
        sock.sendall(frames.pack_request(Op.WRITE, 2, [(offset, 4096)], 4096) + b"X" * 4096)
        write = recv_response(sock)
        # and one whose grant ended long ago
        stale = auth.wall_ms() - auth.CLOCK_SKEW_MS - 60_000
        sock.sendall(frames.pack_request(Op.WRITE, 3, [(offset, 4096)], 4096, deadline=stale) + b"X" * 4096)
        expired = recv_response(sock)
        sock.sendall(frames.pack_request(Op.PING, 4, []))
        ping = recv_response(sock)
    # then each is refused before any byte of it touched the region, and the connection stays in sync
    assert read[2] == Status.CAPABILITY_DENIED and b"deadline" in read[3]
    assert write[2] == Status.CAPABILITY_DENIED
    assert expired[2] == Status.LEASE_EXPIRED
    assert ping[:3] == (Op.PING, 4, 0)
    assert client.get("k") == b"k" * 4096
