"""Direct reads on the segment (kvtier.segment_server.keyed_reads): what the index does not vouch for,
and anything without a lease, is never served."""

from __future__ import annotations

import crc32c

from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import DISK_STATUS
from kvtier.proto.status import Status
from kvtier.segment_server.dram_index import DramIndex
from kvtier.segment_server.keyed_reads import DirectReadLease, KeyedReads

SESSION = (7, 3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _notices(first_seq: int, *items: tuple[bool, int, str, bytes]) -> pb.PollCommitsResponse:
    reply = pb.PollCommitsResponse(first_seq=first_seq)
    for drop, offset, key, value in items:
        reply.drops.append(drop)
        reply.offsets.append(offset)
        reply.sizes.append(len(value))
        reply.checksums.append(crc32c.crc32c(value))
        reply.names.append("ns\x00" + key)
        reply.instances.append("")
        reply.ranks.append(0)
        reply.pins.append(pb.PIN_NONE)
        reply.pin_ttl_ms.append(0)
    return reply


def _answers(parts) -> list[tuple[int, bytes]]:
    """(status, bytes) per range from a response's parts (or KeyedReads.serve's answer)."""
    if isinstance(parts, tuple):
        parts = parts[0]
    out = []
    for i in range(0, len(parts), 2):
        (status,) = DISK_STATUS.unpack(parts[i])
        out.append((status, parts[i + 1]))
    return out


def _setup(clock: Clock) -> tuple[bytearray, DramIndex, KeyedReads]:
    region = bytearray(8192)
    index = DramIndex(memoryview(region))
    index.set_session(SESSION)
    lease = DirectReadLease(clock)
    lease.start(2.0, clock.now)
    a, b = b"a" * 100, b"b" * 64
    region[0:100], region[1024:1088] = a, b
    index.apply(_notices(1, (False, 0, "a", a), (False, 1024, "b", b)), SESSION)
    return region, index, KeyedReads(index, memoryview(region), lease)


def test_only_the_object_the_index_names_there_is_served():
    clock = Clock()
    region, index, keyed = _setup(clock)
    answers = _answers(
        keyed.serve(
            (0, 100, 1024, 64, 0, 100, 1024, 32, 2048, 16),
            [b"ns\x00a", b"ns\x00b", b"ns\x00b", b"ns\x00b", b"ns\x00a"],
        )
    )
    assert answers[0] == (0, b"a" * 100)
    assert answers[1] == (0, b"b" * 64)
    not_found = int(Status.NOT_FOUND)
    # Another object's range, the right object with the wrong size, and a range with no entry: zeros.
    assert answers[2:] == [(not_found, bytes(100)), (not_found, bytes(32)), (not_found, bytes(16))]
    assert (keyed.stats.served, keyed.stats.not_found) == (2, 3)
    # Another namespace's object of the same key is another object.
    assert _answers(keyed.serve((0, 100), [b"other\x00a"])) == [(not_found, bytes(100))]


def test_a_dropped_object_and_a_range_being_reused_are_not_served():
    clock = Clock()
    region, index, keyed = _setup(clock)
    index.apply(_notices(3, (True, 0, "a", b"a" * 100)), SESSION)
    assert _answers(keyed.serve((0, 100), [b"ns\x00a"]))[0][0] == Status.NOT_FOUND
    # b's drop has not arrived, but its range already holds other bytes (reused): not b, not served,
    # and the new bytes do not leave.
    region[1024:1040] = b"X" * 16
    assert _answers(keyed.serve((1024, 64), [b"ns\x00b"])) == [(int(Status.NOT_FOUND), bytes(64))]


def test_without_a_live_lease_or_a_mount_nothing_is_served():
    clock = Clock()
    region, index, keyed = _setup(clock)
    unavailable = int(Status.UNAVAILABLE)
    clock.now += 1.9
    assert _answers(keyed.serve((0, 100), [b"ns\x00a"]))[0][0] == 0
    keyed.lease.renew(clock.now)  # a heartbeat sent now was acknowledged
    clock.now += 1.9
    assert _answers(keyed.serve((0, 100), [b"ns\x00a"]))[0][0] == 0
    clock.now += 0.2  # 2 s after the last acknowledged heartbeat was sent
    assert _answers(keyed.serve((0, 100), [b"ns\x00a"])) == [(unavailable, bytes(100))]
    assert keyed.stats.no_lease == 1
    keyed.lease.renew(clock.now)
    index.set_session((0, 0))  # mounting again: the index follows no master
    assert _answers(keyed.serve((0, 100), [b"ns\x00a"]))[0][0] == unavailable


def test_a_lease_ends_with_its_mount_and_a_master_without_direct_reads_grants_none():
    clock = Clock()
    lease = DirectReadLease(clock)
    assert not lease.valid()
    lease.start(2.0, clock.now - 1.0)  # the mount was sent a second ago
    assert lease.valid() and abs(lease.left_s - 1.0) < 1e-9
    lease.renew(clock.now - 5.0)  # a late answer to an older heartbeat never shortens it
    assert abs(lease.left_s - 1.0) < 1e-9
    lease.end()
    assert not lease.valid()
    lease.renew(clock.now)  # nothing to renew until the next mount
    assert not lease.valid()
    lease.start(0.0, clock.now)  # the master names no lease (direct reads off there)
    lease.renew(clock.now)
    assert not lease.valid() and lease.left_s == 0.0


def test_a_lease_granted_only_once_the_masters_save_held_grows_at_a_heartbeat_never_after_the_mount():
    clock = Clock()
    lease = DirectReadLease(clock)
    lease.start(2.0, clock.now, granted_s=0.0)  # mounted, but the master's saved state holds no lease yet
    assert not lease.valid()
    lease.renew(clock.now, granted_s=0.0)
    assert not lease.valid()
    lease.renew(clock.now, granted_s=5.0)  # its save held: granted, at most the mount's 2 s
    assert lease.valid() and abs(lease.left_s - 2.0) < 1e-9
    lease.renew(clock.now)  # an older master's answer (no grant): renewed as granted before
    clock.now += 1.5
    assert lease.valid() and abs(lease.left_s - 0.5) < 1e-9
    lease.end()
    lease.renew(clock.now, granted_s=2.0)  # a heartbeat answered after the mount ended revives nothing
    assert not lease.valid()
    lease.start(2.0, clock.now)  # an older master grants at the mount
    assert lease.valid()
    lease.close()  # the server stops (found by review): a mount it was still finishing starts nothing
    lease.start(2.0, clock.now)
    lease.renew(clock.now, granted_s=2.0)
    assert not lease.valid()


# ---------------------------------------------------------------- the frame (DataProtocol driven directly)


def _conn(clock: Clock):
    from kvtier.segment_server.protocol import DataPlaneStats, DataProtocol
    from tests.unit.segment_server.test_protocol import Conn, FakeTransport

    region, index, keyed = _setup(clock)
    stats = DataPlaneStats()
    protocol = DataProtocol(memoryview(region), stats, keyed=keyed)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return Conn(protocol, transport, region, stats), keyed


def _keyed_frame(request_id: int, items: list[tuple[int, int, bytes]]) -> bytes:
    from kvtier.proto import frames

    names = frames.pack_disk_names([name for _, _, name in items])
    return frames.pack_request(frames.Op.READ_KEYED, request_id, [(o, n) for o, n, _ in items], len(names)) + names


def test_a_read_keyed_frame_in_pieces_is_answered_per_range_and_the_connection_serves_on():
    from kvtier.proto.frames import Op
    from tests.unit.segment_server.test_protocol import assert_back_to_header

    conn, keyed = _conn(Clock())
    conn.feed(_keyed_frame(5, [(1024, 64, b"ns\x00b"), (0, 100, b"ns\x00zz")]), chunks=7)
    [response] = conn.responses()
    assert (response.op, response.request_id, response.status) == (Op.READ_KEYED, 5, 0)
    assert _answers(
        [response.payload[0:4], response.payload[4:68], response.payload[68:72], response.payload[72:]]
    ) == [
        (0, b"b" * 64),
        (int(Status.NOT_FOUND), bytes(100)),
    ]
    assert conn.stats.bytes_read == 64 and sum(conn.stats.latency["READ_KEYED"].counts) == 1
    assert_back_to_header(conn)


def test_bad_read_keyed_frames_get_clear_errors():
    from kvtier.proto import frames
    from kvtier.proto.frames import Op
    from tests.unit.segment_server.test_protocol import assert_back_to_header

    conn, _ = _conn(Clock())
    # Outside the region, and more than one frame may ask: refused whole, the names drained.
    conn.feed(_keyed_frame(1, [(8000, 400, b"ns\x00a")]))
    conn.feed(_keyed_frame(2, [(0, 4096, b"ns\x00a")] * (frames.MAX_KEYED_FRAME_BYTES // 4096 + 1)))
    first, second = conn.responses()
    assert (first.request_id, first.status) == (1, Status.INVALID_RANGE)
    assert (second.request_id, second.status) == (2, Status.INVALID_RANGE)
    assert_back_to_header(conn)
    # Names that do not match the ranges: the stream cannot be trusted any more.
    names = frames.pack_disk_names([b"ns\x00a"])
    conn.feed(frames.pack_request(Op.READ_KEYED, 3, [(0, 100), (1024, 64)], len(names)) + names)
    assert conn.responses()[-1].status == Status.PROTOCOL_ERROR and conn.transport.closed
