"""The data-plane frame layout: sizes, byte order and pack/unpack round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.proto import frames
from kvtier.proto.frames import MAGIC, RANGE, REQUEST, RESPONSE, VERSION, Op, pack_request, pack_response, unpack_ranges

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
u32 = st.integers(min_value=0, max_value=(1 << 32) - 1)


def test_layout():
    assert REQUEST.size == RESPONSE.size == 24
    assert RANGE.size == 16
    assert MAGIC.to_bytes(2, "little") == b"KT"
    assert VERSION == 1
    assert [int(op) for op in Op] == [1, 2, 3, 4, 5, 6]


def test_request_bytes_are_little_endian():
    data = pack_request(Op.WRITE, 0x01020304, [(5, 6)], payload_len=6)
    assert data[:2] == b"KT"
    assert data[2] == VERSION
    assert data[3] == Op.WRITE
    assert data[4:8] == bytes([4, 3, 2, 1])
    assert data[8:12] == (1).to_bytes(4, "little")  # nranges
    assert data[12:16] == bytes(4)  # flags
    assert data[16:24] == (6).to_bytes(8, "little")
    assert data[24:] == (5).to_bytes(8, "little") + (6).to_bytes(8, "little")


@pytest.mark.parametrize("op", list(Op))
def test_request_without_ranges(op):
    data = pack_request(op, 9, [])
    assert len(data) == 24
    assert REQUEST.unpack(data) == (MAGIC, VERSION, op, 9, 0, 0, 0)
    assert unpack_ranges(data[24:], 0) == ()


@settings(max_examples=100, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    request_id=u32,
    ranges=st.lists(st.tuples(u64, u64), max_size=40),
    payload_len=u64,
)
def test_request_round_trip(op, request_id, ranges, payload_len):
    data = pack_request(op, request_id, ranges, payload_len)
    assert len(data) == REQUEST.size + RANGE.size * len(ranges)
    magic, version, got_op, got_id, nranges, flags, got_len = REQUEST.unpack_from(data)
    assert (magic, version, got_op, got_id, nranges, flags, got_len) == (
        MAGIC,
        VERSION,
        op,
        request_id,
        len(ranges),
        0,
        payload_len,
    )
    flat = unpack_ranges(memoryview(data)[REQUEST.size :], nranges)
    assert list(zip(flat[::2], flat[1::2], strict=True)) == ranges


@settings(max_examples=100, deadline=None)
@given(
    op=st.integers(min_value=0, max_value=255),
    request_id=u32,
    status=st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1),
    payload_len=u64,
)
def test_response_round_trip(op, request_id, status, payload_len):
    data = pack_response(op, request_id, status, payload_len)
    assert RESPONSE.unpack(data) == (MAGIC, VERSION, op, request_id, status, 0, payload_len)


def test_response_status_is_signed():
    data = pack_response(Op.READ, 1, -301)
    assert RESPONSE.unpack(data)[4] == -301
    assert data[8:12] == (-301).to_bytes(4, "little", signed=True)


def test_unpack_ranges_accepts_bytearray_and_ignores_trailing_bytes():
    table = bytearray(pack_request(Op.READ, 1, [(1, 2), (3, 4)])[24:]) + bytearray(16)
    assert unpack_ranges(table, 2) == (1, 2, 3, 4)


def test_out_of_range_values_cannot_be_packed():
    import struct

    with pytest.raises(struct.error):
        pack_request(Op.READ, 1 << 32, [])
    with pytest.raises(struct.error):
        pack_request(Op.READ, 1, [(-1, 0)])


def test_limits():
    assert frames.MAX_RANGES_PER_FRAME == 1 << 16
    assert frames.MAX_ERROR_MESSAGE == 4096


def test_disk_names_round_trip_and_refuse_malformed_payloads():
    from kvtier.proto.frames import pack_disk_names, unpack_disk_names

    names = [b"ns\x00k1", "n\u00e9\x00cl\u00e9".encode(), b"\x00empty-namespace-is-kept"]
    payload = pack_disk_names(names)
    assert unpack_disk_names(payload, 3) == [("ns", "k1"), ("n\u00e9", "cl\u00e9"), ("", "empty-namespace-is-kept")]
    assert unpack_disk_names(b"", 0) == []
    with pytest.raises(ValueError, match="end early"):
        unpack_disk_names(payload, 4)
    with pytest.raises(ValueError, match="longer"):
        unpack_disk_names(payload, 2)
    with pytest.raises(ValueError, match="past the payload"):
        unpack_disk_names(payload[:-1], 3)
    with pytest.raises(ValueError, match="separator"):
        unpack_disk_names(pack_disk_names([b"no-separator"]), 1)


@given(
    op=st.sampled_from(list(Op)),
    request_id=u32,
    offset=u64,
    size=u64,
    payload_len=u64,
    trace=st.one_of(st.just(0), u64),
    expiry=st.one_of(st.just(0), u64),
    tag=st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    session=st.one_of(st.just(0), u64),
)
def test_one_range_packs_what_pack_request_packs(
    op, request_id, offset, size, payload_len, trace, expiry, tag, session
):
    """A single get's frame, packed at once, is byte for byte the general packer's."""
    grant = (expiry, tag, session)
    expected = pack_request(op, request_id, [(offset, size)], payload_len, trace, grant)
    assert frames.pack_one_range(op, request_id, offset, size, payload_len, trace, grant) == expected
