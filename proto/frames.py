"""The data-plane frame format between clients and segment servers.

All integers little-endian. A request is a 24-byte header, `nranges` range
descriptors of 16 bytes (offset, length, relative to the segment's data area),
then for WRITE the payload: the ranges' bytes concatenated, `payload_len` in
total. A response is a 24-byte header followed by `payload_len` bytes: for a
successful READ the ranges' bytes concatenated, for an error (status < 0) a
UTF-8 message. Responses come in request order; `request_id` echoes the
request's so a pipelining client can check the pairing.

A request whose flags have FLAG_TRACED set carries the client's request id
(kvtier.common.logs: the id the client's master calls and errors carry too) as
the first entry of its range table, (request id, 0), counted in `nranges`;
the ranges follow it. The server logs it with anything it reports about the
request.

A request whose flags have FLAG_CAPS set carries a capability for each of its
ranges (kvtier.proto.auth): after the trace entry (if any) comes (expiry_ms, session),
then the n ranges, then n 16-byte tags, one per range in order, all counted in
`nranges` (1 + 2n entries). A segment server with a cluster secret serves READ,
WRITE and READ_DISK only with valid capabilities (CAPABILITY_DENIED otherwise).

Every grant names the segment mount it was issued under: the second word of the (expiry_ms, ...)
and (deadline_ms, ...) entries below is the mount session (`mount_session`: the master's epoch and
its id for the segment's mount, which SegmentEndpoint.session names). A segment refuses a READ or
WRITE whose session is not its current mount's (LEASE_EXPIRED; 0, from clients older than sessions,
is taken as the current one), refuses both while it is not mounted, and cuts the frames admitted
under a mount that has ended (as below for a grant's end): a segment dropped and mounted again, or
whose master restarted, has its ranges handed out afresh while grants of its previous mount may
still run. With a cluster secret the mount session is also part of the capability key.

Every READ and WRITE is bounded by its grant's deadline. With FLAG_CAPS the
capability's expiry_ms is it; without a secret a request whose flags have
FLAG_DEADLINE set carries (deadline_ms, session) after the trace entry (if any),
before any capability block, counted in `nranges`. Both values are what the
master's reply named (`tag_expiry_ms`, master wall clock, milliseconds): the
grant ends at deadline_ms + CLOCK_SKEW_MS (kvtier.proto.auth) on the segment's
clock, and the master reuses no range before another CLOCK_SKEW_MS has passed
on its own. A READ or WRITE with neither is refused (CAPABILITY_DENIED): no
region access is unbounded. A frame whose grant ends while it is served is cut:
a WRITE stops writing into the region at once, drains the rest of its payload
into scratch and answers LEASE_EXPIRED; a READ whose response bytes are still
queued at the end of its grant has its connection aborted (nothing more of the
region is sent). READ_DISK reads only from its own pool buffers, after checking
each record's name: it may carry a deadline but needs none.

    request   magic:u16 version:u8 op:u8 request_id:u32 nranges:u32 flags:u32 payload_len:u64
    range     offset:u64 length:u64
    response  magic:u16 version:u8 op:u8 request_id:u32 status:i32 flags:u32 payload_len:u64

READ_DISK reads objects from the segment's SSD tier. Its ranges are
(disk location, size) as the master gave them, and its payload names the
objects, so the server can check each record is the one asked for: per
range a u16 length and the UTF-8 bytes of "namespace NUL key". Its response
payload is, per range in order, an i32 status and then `size` bytes: the
object's bytes when the status is OK, zeros otherwise (one bad record is one
miss; the rest of the batch is served). Its payload_len is therefore
4 * nranges + the sum of the sizes, known before any disk read; a request
whose sizes add up to more than MAX_DISK_FRAME_BYTES is refused whole.

A READ whose flags have FLAG_WINDOW set reads only a window of each range (verified ranged
reads, issue 21): the table ends with one (skip, take) entry per range, after everything above
(tags included), counted in `nranges`; the server answers the `take` bytes at offset + skip of
each range instead of the whole range. The range, not its window, is what the capability and
the region bounds check, so a window needs no tag of its own and a client holding the grant of
an object reads part of it; a window outside its range (skip + take > length) fails the request
with INVALID_RANGE. Windows are READ-only: any other op with FLAG_WINDOW is a PROTOCOL_ERROR.

COMMIT carries no ranges and, as payload, a RelayPutEndRequest's fields 1 and 2 (the client's
PutEnd and its token; kvtier.proto master.proto), at most MAX_COMMIT_BYTES. It must come right
behind a WRITE on the same connection that completed (an OK response): otherwise it is refused
with INVALID_ARGUMENT and nothing is committed. The segment relays it to the master (RelayPutEnd,
kvtier.segment_server.commit_relay) and answers, once the put's notices are in its index, with
a RelayPutEndResponse (per-key statuses, no notices) as payload and status OK; UNAVAILABLE (with
a message) when the master's answer did not come: the client then sends its PutEnd itself.
A WRITE whose flags have FLAG_COMMIT_FOLLOWS set announces its COMMIT: its own response is held
back and sent with the COMMIT's answer, in one send (a response held when the next frame is not a
COMMIT goes out first). FLAG_COMMIT_FOLLOWS on any other op is a PROTOCOL_ERROR.

READ_KEYED (direct reads, kvtier.segment_server.keyed_reads) reads small DRAM objects a client
looked up before, without the master: READ_DISK's layout with DRAM (offset, size) ranges (the
object names as payload, the same response: per range an i32 status and `size` bytes, zeros
unless OK), at most MAX_KEYED_FRAME_BYTES of objects per request. With a cluster secret each range
carries the READ capability its lookup got (FLAG_CAPS; checked as a READ's). The segment serves a
range only while it holds its direct-read lease and its own index says the range holds that
object, complete, with matching bytes: NOT_FOUND otherwise, UNAVAILABLE for every range without
the lease. It needs no grant deadline: the bytes are copied and checked before they are sent.

A range that lies outside the region fails the whole request with
INVALID_RANGE; the server still consumes the WRITE payload, so the connection
stays in sync and keeps serving. A bad magic or version, or a header that
violates the limits below, gets a PROTOCOL_ERROR response and the connection is
closed (the stream cannot be re-synchronised).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence

from kvtier.proto.keys import MAX_JOINED_NAME_BYTES, split_name_bytes

MAGIC = 0x544B  # b"KT" little-endian
VERSION = 1

REQUEST = struct.Struct("<HBBIIIQ")
RESPONSE = struct.Struct("<HBBIiIQ")
RANGE = struct.Struct("<QQ")
assert REQUEST.size == RESPONSE.size == 24

# Protocol limits: a header outside them is a protocol error.
MAX_RANGES_PER_FRAME = 1 << 16
MAX_ERROR_MESSAGE = 4096
MAX_DISK_FRAME_BYTES = 1 << 30  # object bytes in one READ_DISK request
MAX_DISK_NAME = 2 + MAX_JOINED_NAME_BYTES  # u16 length, then a joined name (kvtier.proto.keys)
DISK_STATUS = struct.Struct("<i")
NAME_LENGTH = struct.Struct("<H")  # before each name of a READ_DISK or READ_KEYED payload
MAX_COMMIT_BYTES = 16 << 20  # a COMMIT's payload (larger PutEnds go to the master directly)
MAX_KEYED_FRAME_BYTES = 4 << 20  # object bytes in one READ_KEYED request (each one is copied)

FLAG_TRACED = 1  # the range table starts with (request id, 0)
FLAG_CAPS = 2  # (expiry_ms, session), the ranges, then one 16-byte capability tag per range
FLAG_DEADLINE = 4  # (deadline_ms, session) after the trace entry: when the grant of the ranges ends (no secret)
FLAG_WINDOW = 8  # READ: the table ends with one (skip, take) per range: only those bytes are sent
FLAG_COMMIT_FOLLOWS = 16  # WRITE: a COMMIT comes right behind; its answer and this one's go out together


class Op(enum.IntEnum):
    WRITE = 1  # ranges + payload -> empty OK response once every byte is in the region
    READ = 2  # ranges, no payload -> the ranges' bytes
    PING = 3  # no ranges -> empty OK response (liveness, connection warm-up)
    READ_DISK = 4  # (location, size) ranges + object names -> per range: status, size bytes
    COMMIT = 5  # a PutEnd for the master, right behind its WRITE -> RelayPutEndResponse (commit_relay)
    READ_KEYED = 6  # (offset, size) DRAM ranges + object names -> per range: status, size bytes


def mount_session(segment_id: int, epoch: int) -> int:
    """The identity of a segment's mount in grants and frames: nonzero for a mounted segment (0 for
    none), and different for every mount a grant could outlive (a re-mount gets a new id from its
    master, a restarted or newly elected master a new epoch)."""
    if not segment_id:
        return 0
    digest = hashlib.blake2b(f"{epoch}:{segment_id}".encode(), digest_size=8, person=b"kvtier-mount").digest()
    return int.from_bytes(digest, "little") | 1


def pack_request(
    op: Op,
    request_id: int,
    ranges: list[tuple[int, int]],
    payload_len: int = 0,
    trace: int = 0,
    caps: tuple[int, bytes] | tuple[int, bytes, int] | None = None,
    deadline: int = 0,
    windows: Sequence[tuple[int, int]] = (),
    flags: int = 0,
) -> bytes:
    """Header plus range table of one request, ready to send before any payload; with `trace` (the
    client's request id, nonzero) the table starts with its trace entry; with `caps`, (expiry_ms,
    the ranges' tags concatenated[, mount session]), it carries their capabilities; caps without
    tags (a cluster without a secret) or `deadline` carry only the grant's deadline (FLAG_DEADLINE);
    caps' mount session (0 without one) rides in either entry; `windows`, one (skip, take) per
    range, make a READ send only those bytes of each (FLAG_WINDOW); `flags` adds others
    (FLAG_COMMIT_FOLLOWS)."""
    flat = [v for pair in ranges for v in pair]
    session = caps[2] if caps is not None and len(caps) > 2 else 0  # type: ignore[misc]
    if caps is not None and not caps[1]:
        deadline, caps = caps[0], None
    if caps is not None:
        flat[:0] = (caps[0], session)
        flags |= FLAG_CAPS
    if deadline:
        flat[:0] = (deadline, session)
        flags |= FLAG_DEADLINE
    if trace:
        flat[:0] = (trace, 0)
        flags |= FLAG_TRACED
    tags = caps[1] if caps is not None else b""
    tail = [v for pair in windows for v in pair]
    if windows:
        flags |= FLAG_WINDOW
    return (
        REQUEST.pack(MAGIC, VERSION, op, request_id, (len(flat) + len(tail)) // 2 + len(tags) // 16, flags, payload_len)
        + struct.pack(f"<{len(flat)}Q", *flat)
        + tags
        + struct.pack(f"<{len(tail)}Q", *tail)
    )


# One traced range with its grant (a get's direct read): the header and three table entries, packed
# at once; with a capability tag, its 16 bytes follow.
_ONE_RANGE = struct.Struct("<HBBIIIQ6Q")


def pack_one_range(
    op: Op, request_id: int, offset: int, size: int, payload_len: int, trace: int, grant: tuple[int, bytes, int]
) -> bytes:
    """`pack_request(op, request_id, [(offset, size)], payload_len, trace, grant)`, in one pack when
    traced and granted (what a single get sends per call); `grant`: (expiry, tag, mount session)."""
    expiry, tag, session = grant
    if not trace or not expiry:
        return pack_request(op, request_id, [(offset, size)], payload_len, trace, grant)
    flags = FLAG_TRACED | (FLAG_CAPS if tag else FLAG_DEADLINE)
    nranges = 3 + len(tag) // 16
    return (
        _ONE_RANGE.pack(
            MAGIC, VERSION, op, request_id, nranges, flags, payload_len, trace, 0, expiry, session, offset, size
        )
        + tag
    )


def pack_response(op: int, request_id: int, status: int, payload_len: int = 0) -> bytes:
    return RESPONSE.pack(MAGIC, VERSION, op, request_id, status, 0, payload_len)


def unpack_ranges(buf: bytes | bytearray | memoryview, nranges: int) -> tuple[int, ...]:
    """Flat (offset0, length0, offset1, length1, ...) from a range table."""
    return struct.unpack_from(f"<{2 * nranges}Q", buf)


def pack_disk_names(names: Sequence[bytes]) -> bytes:
    """The READ_DISK payload: each name ("namespace NUL key", UTF-8) with a u16 length."""
    return b"".join(NAME_LENGTH.pack(len(name)) + name for name in names)


def unpack_names(buf: bytes | bytearray | memoryview, count: int) -> list[bytes]:
    """The joined names of a READ_DISK or READ_KEYED payload, as sent; ValueError when the payload
    does not hold exactly `count` of them."""
    view = memoryview(buf)
    out = []
    pos = 0
    for _ in range(count):
        if pos + 2 > len(view):
            raise ValueError("names end early")
        (length,) = NAME_LENGTH.unpack_from(view, pos)
        pos += 2
        if pos + length > len(view):
            raise ValueError("a name runs past the payload")
        out.append(bytes(view[pos : pos + length]))
        pos += length
    if pos != len(view):
        raise ValueError("payload longer than its names")
    return out


def unpack_disk_names(buf: bytes | bytearray | memoryview, count: int) -> list[tuple[str, str]]:
    """(namespace, key) per range; ValueError when the payload does not hold exactly `count` names."""
    try:
        return [split_name_bytes(name) for name in unpack_names(buf, count)]
    except ValueError as exc:
        raise ValueError(f"READ_DISK {exc}") from exc
