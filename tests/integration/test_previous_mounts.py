"""Grants from a segment's previous mount never act on its next one (real processes, raw frames).

A segment that is dropped and mounts again (stopped past `segment_ttl_s`, or its master restarted)
gets a new allocator on the master: every range is free at once, while a grant handed out before
still has most of its life. Every grant therefore names the mount it was issued under (its
frame's deadline or capability entry carries the mount session, kvtier.proto.frames), the segment
refuses one from another mount, and a frame admitted under a mount that has ended is cut: a WRITE
stops writing into the region, a READ still queued has its connection aborted.

Grants here are long (`--lease-s 30 --put-timeout-s 30`) so that the only thing between writer A's
late bytes and the next owner is the mount they belong to. Segments are exactly one object large, so
B's put lands on A's range (hard-pinned: a full segment would otherwise evict it).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.proto import frames
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.integration.rawframes import connect, recv_response
from tests.integration.test_stalled_peers import (
    Master,
    finish_cut_write,
    frames_cut,
    slow_reader,
    start_segment,
    with_secret,
)

LONG_GRANTS = ("--lease-s", "30", "--put-timeout-s", "30")
REMOUNT_WAIT_S = 20.0


@pytest.fixture(params=["no-secret", "secret"])
def long_grants(bare_cluster, tmp_path, request):
    with_secret(bare_cluster, tmp_path, request.param)
    bare_cluster.start_master(*LONG_GRANTS)
    return bare_cluster


@pytest.fixture
def plain_long_grants(bare_cluster):
    """As `long_grants`, without a secret only (what the client does about a refusal is the same)."""
    bare_cluster.start_master(*LONG_GRANTS)
    return bare_cluster


def mounted(cluster, observer) -> None:
    """Wait until the segment is mounted and has reported its inventory (it takes allocations)."""
    active = lambda: any(s.state == "ACTIVE" for s in observer.cluster_status().segments)  # noqa: E731
    assert cluster.wait_for(active, REMOUNT_WAIT_S, 0.2)


def away_past_ttl(cluster, segment) -> None:
    """Stop the segment until the master dropped it, then let it mount again."""
    segment.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(cluster.segment_ttl_s + 2.0)
    finally:
        segment.popen.send_signal(signal.SIGCONT)


def put_on_range(cluster, offset: int, size: int, wait_s: float = REMOUNT_WAIT_S) -> tuple[object, bytes]:
    """B's acknowledged object, on `offset` (the segment holds one object of `size`)."""
    b = cluster.client(transport="tcp")
    value = os.urandom(size)
    assert cluster.wait_for(lambda: b.batch_put(["b"], [value], pin="hard") == [Status.OK], wait_s, 0.2)
    assert b.locate("b")[0]["offset"] == offset, "B's object must be on A's range for this test to mean anything"
    assert b.get("b") == value
    return b, value


def remount_after_first(client, method: str, cluster, segment, observer) -> list[int]:
    """Make `client`'s first `method` call answer, then the segment go away past its ttl and mount
    again before the client goes on; returns the mount sessions each such answer named."""
    real_call = client._master.call
    sessions: list[int] = []

    def call(name, request, *args, **kwargs):
        reply = real_call(name, request, *args, **kwargs)
        if name == method:
            sessions.append(reply.segments[0].session)
            if len(sessions) == 1:
                away_past_ttl(cluster, segment)
                mounted(cluster, observer)
        return reply

    client._master.call = call
    return sessions


def pending_write(cluster, size: int):
    """Writer A's PutStart of `size` bytes: its offset, the grant as a client would send it, and the
    segment's endpoint as the answer named it."""
    master = Master(cluster)
    start = master.PutStart(pb.PutStartRequest(namespace="default", keys=["a"], sizes=[size], replicas=1))
    assert list(start.statuses) == [Status.OK] and start.tag_expiry_ms
    grant = (start.tag_expiry_ms, start.replica_tags, start.segments[0].session)
    return start.replica_offsets[0], grant, start.segments[0]


def test_a_write_in_flight_across_its_segments_remount_never_lands_in_the_next_owners_object(long_grants):
    # given A's pending put of 1 MiB on a segment of 1 MiB, its frame sent as far as 1 byte
    size = 1 << 20
    segment, endpoint = start_segment(long_grants, "1MiB")
    offset, grant, _ = pending_write(long_grants, size)
    a = connect(endpoint)
    a.sendall(frames.pack_request(Op.WRITE, 1, [(offset, size)], size, caps=grant) + b"A")
    # when the segment is away past its ttl, mounts again, and B's put lands on A's range
    away_past_ttl(long_grants, segment)
    b, value = put_on_range(long_grants, offset, size)
    # and A sends the rest of its payload, with most of its grant left
    # then A's frame was cut (the connection stays in sync) and B reads back exactly its bytes
    finish_cut_write(a, size)
    assert b.get("b") == value
    assert frames_cut(segment, "WRITE") == 1


def test_a_grant_from_before_a_remount_is_refused_after_it(long_grants):
    # given A's grant for the whole segment, unused
    size = 1 << 20
    segment, endpoint = start_segment(long_grants, "1MiB")
    offset, grant, _ = pending_write(long_grants, size)
    # when the segment is away past its ttl, mounts again, and B's put lands on A's range
    away_past_ttl(long_grants, segment)
    b, value = put_on_range(long_grants, offset, size)
    # and A then writes and reads with its old grant, as a client would send it
    with connect(endpoint) as a:
        a.sendall(frames.pack_request(Op.WRITE, 1, [(offset, size)], size, caps=grant) + b"A" * size)
        write = recv_response(a)
        a.sendall(frames.pack_request(Op.READ, 2, [(offset, size)], caps=grant))
        read = recv_response(a)
    # then both are refused, and B's bytes are untouched
    assert write[2] == Status.LEASE_EXPIRED and b"earlier mount" in write[3], write
    assert read[2] == Status.LEASE_EXPIRED and b"earlier mount" in read[3], read
    assert b.get("b") == value


def test_a_write_in_flight_across_a_master_restart_never_lands_in_the_next_owners_object(bare_cluster):
    # given A's pending put of 1 MiB on a segment of 1 MiB under a master started with its defaults
    # (write grants of 10 s), its frame sent as far as 1 byte
    bare_cluster.start_master()
    size = 1 << 20
    segment, endpoint = start_segment(bare_cluster, "1MiB")
    offset, grant, _ = pending_write(bare_cluster, size)
    a = connect(endpoint)
    a.sendall(frames.pack_request(Op.WRITE, 1, [(offset, size)], size, caps=grant) + b"A")
    # when the master is killed and restarted, and B's put lands on A's range
    bare_cluster.restart_master()
    b, value = put_on_range(bare_cluster, offset, size)
    # and A sends the rest of its payload
    # then A's frame was cut, and B reads back exactly its bytes
    finish_cut_write(a, size)
    assert b.get("b") == value


def test_a_read_queued_across_its_segments_remount_is_cut_at_the_remount_not_at_its_grants_end(plain_long_grants):
    long_grants = plain_long_grants
    # given A's object of 8 MiB on a segment of 8 MiB, and A's READ of it, of which A takes 1 KiB
    size = 8 << 20
    segment, endpoint = start_segment(long_grants, "8MiB")
    b = long_grants.client(transport="tcp")
    b.put("a", b"a" * size, pin="hard")
    a, offset = slow_reader(long_grants, endpoint, size)
    grant_ends = time.monotonic() + 30.0  # LONG_GRANTS: a read lease of 30 s from the lookup
    # when the segment is away past its ttl and mounts again
    away_past_ttl(long_grants, segment)
    mounted(long_grants, b)
    # then A's READ was cut when the mount ended, not at the end of its grant (which is what let the
    # next owner's bytes, written into the range meanwhile, go out to A before mount sessions)
    assert long_grants.wait_for(lambda: frames_cut(segment, "READ") == 1, 5.0)
    assert time.monotonic() < grant_ends - 10.0
    rest = bytearray()
    try:
        while chunk := a.recv(1 << 20):
            rest += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        a.close()
    assert set(rest) <= {ord("a")}
    assert 1024 + len(rest) < size, "the whole response arrived: nothing was cut"
    # and the range of the re-adopted copy, once removed, goes to no one while a reader of it may
    # hold a lease from the adoption (the master's own guard against such a reader)
    b.remove("a", force=True)
    assert b.batch_put(["b"], [b"b" * size], pin="hard") != [Status.OK]
    assert b.locate("b") == []


def test_a_same_host_copy_with_a_grant_from_before_a_remount_is_refused(bare_cluster):
    # given A's grant for the whole segment, and A's mapping of the region (same host)
    bare_cluster.start_master(*LONG_GRANTS)
    size = 1 << 20
    segment, _endpoint = start_segment(bare_cluster, "1MiB")
    offset, grant, endpoint = pending_write(bare_cluster, size)
    connector = bare_cluster.client(transport="shm")._connector(endpoint)
    assert connector.scheme == "shm"
    # when the segment is away past its ttl, mounts again, and B's put lands on A's range
    away_past_ttl(bare_cluster, segment)
    b, value = put_on_range(bare_cluster, offset, size)
    # and A copies into the region with its old grant
    result = connector.write([(offset, memoryview(b"A" * size))], [None], caps=(grant[0], [], grant[2]))
    # then the copy is refused, and B's bytes are untouched
    assert result == [Status.LEASE_EXPIRED]
    assert b.get("b") == value


@pytest.mark.parametrize("read", ["get", "get_ranges"])
def test_a_read_whose_lookup_predates_a_remount_is_served_after_a_fresh_lookup(plain_long_grants, read):
    long_grants = plain_long_grants
    # given an object on a segment, and a reader whose lookup of it is answered just before the
    # segment is away past its ttl and mounts again (the master re-adopts the untouched object)
    segment, _endpoint = start_segment(long_grants, "8MiB")
    writer = long_grants.client(transport="tcp")
    value = os.urandom(256 << 10)  # several chunks: a ranged read reads only its chunks
    writer.put("k", value)
    reader = long_grants.client(transport="tcp", timeout=30.0)  # the re-mount happens inside its get
    lookups = remount_after_first(reader, "GetReplicas", long_grants, segment, writer)
    # when it reads with that answer's grant, then its copy is refused as another mount's, and a
    # fresh lookup serves the object
    if read == "get":
        assert reader.get("k") == value
    else:
        assert reader.get_ranges("k", [(5, 100), (70_000, 10)]) == [value[5:105], value[70_000:70_010]]
    assert len(lookups) == 2 and lookups[1] != lookups[0]  # the fresh lookup names the new mount


def test_a_put_whose_start_predates_a_remount_is_placed_anew(plain_long_grants):
    long_grants = plain_long_grants
    # given a writer whose PutStart is answered just before its segment is away past its ttl and
    # mounts again (the put's grant belongs to the ended mount)
    segment, _endpoint = start_segment(long_grants, "8MiB")
    observer = long_grants.client(transport="tcp")
    writer = long_grants.client(transport="tcp", timeout=60.0)  # the re-mount happens inside its put
    starts = remount_after_first(writer, "PutStart", long_grants, segment, observer)
    value = os.urandom(64 << 10)
    # when it puts, then its write is refused as the earlier mount's, a new PutStart places it, and
    # the object reads back
    writer.put("k", value)
    assert len(starts) == 2 and starts[1] != starts[0]
    assert observer.get("k") == value
