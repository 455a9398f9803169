"""The data-plane frame format between clients and segment servers.

All integers little-endian. A request is a 24-byte header, `nranges` range
descriptors of 16 bytes (offset, length, relative to the segment's data area),
then for WRITE the payload: the ranges' bytes concatenated, `payload_len` in
total. A response is a 24-byte header followed by `payload_len` bytes: for a
successful READ the ranges' bytes concatenated, for an error (status < 0) a
UTF-8 message. Responses come in request order; `request_id` echoes the
request's so a pipelining client can check the pairing.

    request   magic:u16 version:u8 op:u8 request_id:u32 nranges:u32 flags:u32 payload_len:u64
    range     offset:u64 length:u64
    response  magic:u16 version:u8 op:u8 request_id:u32 status:i32 flags:u32 payload_len:u64

A range that lies outside the region fails the whole request with
INVALID_RANGE; the server still consumes the WRITE payload, so the connection
stays in sync and keeps serving. A bad magic or version, or a header that
violates the limits below, gets a PROTOCOL_ERROR response and the connection is
closed (the stream cannot be re-synchronised).
"""

from __future__ import annotations

import enum
import struct

MAGIC = 0x544B  # b"KT" little-endian
VERSION = 1

REQUEST = struct.Struct("<HBBIIIQ")
RESPONSE = struct.Struct("<HBBIiIQ")
RANGE = struct.Struct("<QQ")
assert REQUEST.size == RESPONSE.size == 24

# Protocol limits: a header outside them is a protocol error.
MAX_RANGES_PER_FRAME = 1 << 16
MAX_ERROR_MESSAGE = 4096


class Op(enum.IntEnum):
    WRITE = 1  # ranges + payload -> empty OK response once every byte is in the region
    READ = 2  # ranges, no payload -> the ranges' bytes
    PING = 3  # no ranges -> empty OK response (liveness, connection warm-up)


def pack_request(op: Op, request_id: int, ranges: list[tuple[int, int]], payload_len: int = 0) -> bytes:
    """Header plus range table of one request, ready to send before any payload."""
    flat = [v for pair in ranges for v in pair]
    return REQUEST.pack(MAGIC, VERSION, op, request_id, len(ranges), 0, payload_len) + struct.pack(
        f"<{len(flat)}Q", *flat
    )


def pack_response(op: int, request_id: int, status: int, payload_len: int = 0) -> bytes:
    return RESPONSE.pack(MAGIC, VERSION, op, request_id, status, 0, payload_len)


def unpack_ranges(buf: bytes | bytearray | memoryview, nranges: int) -> tuple[int, ...]:
    """Flat (offset0, length0, offset1, length1, ...) from a range table."""
    return struct.unpack_from(f"<{2 * nranges}Q", buf)
