"""Grants name the segment's mount: DataProtocol driven directly with a MountSession (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.proto import frames
from kvtier.proto import region as region_format
from kvtier.proto.auth import CapabilityKey, capability_key
from kvtier.proto.frames import Op, mount_session
from kvtier.proto.status import Status
from kvtier.segment_server.data_plane_stats import ConnectionLimits, Connections, DataPlaneStats
from kvtier.segment_server.mount_session import CapabilityCheck, MountSession
from kvtier.segment_server.protocol import DataProtocol
from tests.unit.segment_server.test_protocol import FAR, SENTINEL, Conn, FakeTransport

CAPACITY = 4096
SEGMENT_ID, EPOCH = 3, 1_700_000_000_123
SESSION = mount_session(SEGMENT_ID, EPOCH)


class HoldingTransport(FakeTransport):
    """A transport whose kernel takes nothing: every READ response stays queued."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def writelines(self, parts) -> None:
        super().writelines(parts)
        self.held += sum(len(part) for part in parts)

    def get_write_buffer_size(self) -> int:
        return self.held


def mounted_conn(mount: MountSession, transport: FakeTransport | None = None) -> Conn:
    region = bytearray([SENTINEL]) * CAPACITY
    stats = DataPlaneStats()
    connections = Connections(ConnectionLimits(), stats)
    protocol = DataProtocol(memoryview(region), stats, connections=connections, mount=mount)
    transport = transport or FakeTransport()
    protocol.connection_made(transport)
    return Conn(protocol, transport, region, stats)


def write(request_id: int, offset: int, data: bytes, session: int) -> bytes:
    table = [(offset, len(data))]
    return frames.pack_request(Op.WRITE, request_id, table, len(data), caps=(FAR, b"", session)) + data


def test_mount_sessions_differ_per_mount_and_are_never_zero_while_mounted():
    sessions = {mount_session(segment_id, epoch) for segment_id in range(1, 50) for epoch in (1, 2, EPOCH)}
    assert len(sessions) == 49 * 3 and 0 not in sessions
    assert mount_session(0, EPOCH) == 0


def test_a_grant_of_another_mount_is_refused_and_its_payload_touches_nothing():
    # given a segment on its current mount
    mount = MountSession()
    mount.set(SEGMENT_ID, EPOCH)
    conn = mounted_conn(mount)
    # when a WRITE and a READ name a mount of the same segment id under another epoch, and one of ours
    conn.feed(write(1, 0, b"stale", mount_session(SEGMENT_ID, EPOCH - 1)))
    conn.feed(frames.pack_request(Op.READ, 2, [(0, 5)], caps=(FAR, b"", mount_session(SEGMENT_ID + 1, EPOCH))))
    conn.feed(write(3, 100, b"fresh", SESSION))
    # then the other mount's are refused LEASE_EXPIRED, nothing of them is in the region, ours is
    answers = conn.responses()
    assert [(a.request_id, a.status) for a in answers] == [(1, Status.LEASE_EXPIRED), (2, Status.LEASE_EXPIRED), (3, 0)]
    assert b"earlier mount" in answers[0].payload
    assert conn.region[:5] == bytes([SENTINEL]) * 5 and conn.region[100:105] == b"fresh"


def test_a_grant_naming_no_mount_is_served_while_mounted_and_refused_while_not():
    # given a segment not mounted yet
    mount = MountSession()
    conn = mounted_conn(mount)
    # when a frame from a client older than mount sessions comes, then another once it is mounted
    conn.feed(write(1, 0, b"early", 0))
    mount.set(SEGMENT_ID, EPOCH)
    conn.feed(write(2, 0, b"later", 0))
    # then the first is refused (no grant is valid on an unmounted segment), the second served
    assert [(a.request_id, a.status) for a in conn.responses()] == [(1, Status.LEASE_EXPIRED), (2, 0)]
    assert conn.region[:5] == b"later"


def test_a_write_in_progress_when_its_mount_ends_writes_no_further_byte():
    # given a WRITE of 1000 bytes under the current mount, of which 10 arrived
    mount = MountSession()
    mount.set(SEGMENT_ID, EPOCH)
    conn = mounted_conn(mount)
    frame = write(1, 0, b"A" * 1000, SESSION)
    head = len(frame) - 1000
    conn.feed(frame[: head + 10])
    # when the mount ends (the link asks for a new one), a new one starts, and the rest arrives
    mount.set(0, 0)
    mount.set(SEGMENT_ID + 1, EPOCH)
    conn.feed(frame[head + 10 :], chunks=64)
    # then the frame was cut: LEASE_EXPIRED, nothing past its first 10 bytes in the region, counted
    (answer,) = conn.responses()
    assert (answer.request_id, answer.status) == (1, Status.LEASE_EXPIRED)
    assert b"mount" in answer.payload
    assert conn.region[:10] == b"A" * 10 and conn.region[10:1000] == bytes([SENTINEL]) * 990
    assert conn.stats.frames_cut["WRITE"] == 1


def test_a_read_still_queued_when_its_mount_ends_has_its_connection_aborted():
    async def scenario() -> tuple[Conn, Conn]:
        # given a READ response of the current mount still queued on its connection, and another
        # connection with nothing queued
        mount = MountSession()
        mount.set(SEGMENT_ID, EPOCH)
        reader = mounted_conn(mount, HoldingTransport())
        idle = mounted_conn(mount, HoldingTransport())
        reader.feed(frames.pack_request(Op.READ, 1, [(0, 100)], caps=(FAR, b"", SESSION)))
        assert reader.transport.held > 100 and not reader.transport.closed
        # when the mount ends and the data plane hears of it
        mount.set(0, 0)
        reader.protocol.cut_reads_of_ended_mounts()
        idle.protocol.cut_reads_of_ended_mounts()
        return reader, idle

    reader, idle = asyncio.run(scenario())
    # then the reader's connection is aborted (its queued bytes never go out), the idle one stays
    assert ("abort", None) in reader.transport.calls and reader.stats.frames_cut["READ"] == 1
    assert not idle.transport.closed


def test_the_end_of_a_mount_reaches_the_event_loop_and_the_region_header():
    # given a mount attached to a loop, publishing into a region header
    header = memoryview(bytearray(region_format.HEADER_SIZE))
    mount = MountSession(header)
    ended = []

    async def scenario() -> None:
        mount.attach(asyncio.get_running_loop(), lambda: ended.append(mount.current[0]))
        mount.set(SEGMENT_ID, EPOCH)
        published = region_format.SESSION.unpack_from(header, region_format.SESSION_OFFSET)[0]
        # when it ends
        mount.set(0, 0)
        await asyncio.sleep(0)
        assert published == SESSION

    asyncio.run(scenario())
    # then the loop was told once, after the change, and the header names no mount
    assert ended == [0]
    assert region_format.SESSION.unpack_from(header, region_format.SESSION_OFFSET)[0] == 0


@pytest.mark.parametrize("other", [(SEGMENT_ID + 1, EPOCH), (SEGMENT_ID, EPOCH + 1)])
def test_capability_keys_are_per_mount(other):
    # given the same segment name, incarnation and secret under two mounts
    secret = b"s" * 32
    mount = MountSession()
    check = CapabilityCheck(secret, "seg0", mount, "nonce")
    assert check.key() is None, "no capability is valid while unmounted"
    mount.set(SEGMENT_ID, EPOCH)
    minted = CapabilityKey(capability_key(secret, "seg0", EPOCH, "nonce", SESSION)).tag(Op.WRITE, FAR, 0, 64)
    # then a tag minted for one mount checks under it, and fails under the other
    assert check.key().check(Op.WRITE, FAR, (0, 64), minted) == ""  # type: ignore[union-attr]
    mount.set(*other)
    assert check.key().check(Op.WRITE, FAR, (0, 64), minted) != ""  # type: ignore[union-attr]


def test_under_a_master_from_before_sessions_tags_are_keyed_as_before_and_frames_naming_none_are_served():
    # given a segment mounted on a master that names no sessions
    secret = b"s" * 32
    mount = MountSession()
    mount.set(SEGMENT_ID, EPOCH, keyed=False)
    check = CapabilityCheck(secret, "seg0", mount, "nonce")
    minted = CapabilityKey(capability_key(secret, "seg0", EPOCH, "nonce")).tag(Op.WRITE, FAR, 0, 64)
    # then that master's tags check, and its clients' frames (session 0) are served
    assert check.key().check(Op.WRITE, FAR, (0, 64), minted) == ""  # type: ignore[union-attr]
    conn = mounted_conn(mount)
    conn.feed(write(1, 0, b"plain", 0))
    assert [(a.request_id, a.status) for a in conn.responses()] == [(1, 0)]


def test_a_disk_or_keyed_read_granted_under_an_earlier_mount_is_told_to_look_up_again():
    # given a segment with a secret, mounted again since the master minted a READ_DISK tag
    secret = b"s" * 32
    mount = MountSession()
    mount.set(SEGMENT_ID, EPOCH)
    old_key = CapabilityKey(capability_key(secret, "seg0", EPOCH, "nonce", SESSION))
    disk_tag = old_key.tag(Op.READ_DISK, FAR, 4096, 16)
    read_tag = old_key.tag(Op.READ, FAR, 0, 16)
    mount.set(0, 0)
    mount.set(SEGMENT_ID + 1, EPOCH)
    region = bytearray(CAPACITY)
    stats = DataPlaneStats()
    check = CapabilityCheck(secret, "seg0", mount, "nonce")
    protocol = DataProtocol(memoryview(region), stats, disk=object(), caps=check, mount=mount)  # type: ignore[arg-type]
    conn = Conn(protocol, FakeTransport(), region, stats)
    protocol.connection_made(conn.transport)
    # when a READ_DISK and a READ_KEYED of that mount come (names as payload), then a PING
    names = frames.pack_disk_names([b"default\0k"])
    for op, request_id, tag in ((Op.READ_DISK, 1, disk_tag), (Op.READ_KEYED, 2, read_tag)):
        offset = 4096 if op == Op.READ_DISK else 0
        conn.feed(frames.pack_request(op, request_id, [(offset, 16)], len(names), caps=(FAR, tag, SESSION)) + names)
    conn.feed(frames.pack_request(Op.PING, 3, []))
    # then both are LEASE_EXPIRED (the client's fresh lookup names this mount), not a capability
    # denial, and the connection stays in sync
    answers = [(a.request_id, a.status) for a in conn.responses()]
    assert answers == [(1, Status.LEASE_EXPIRED), (2, Status.LEASE_EXPIRED), (3, 0)]
    assert stats.capability_denials == 0
