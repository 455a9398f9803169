"""READ with windows (FLAG_WINDOW, kvtier.proto.frames): the segment sends only a window of each
granted range (verified ranged reads, issue 21), checks each window lies inside its range, and
the connection keeps serving after a bad one."""

from __future__ import annotations

import pytest

from kvtier.proto import frames
from kvtier.proto.frames import MAGIC, RESPONSE, VERSION, Op
from kvtier.proto.status import Status
from tests.unit.segment_server.test_protocol import (
    CAPACITY,
    assert_back_to_header,
    conn,  # noqa: F401 - the fixture
    pack_request,
)


def test_a_windowed_read_sends_only_the_windows(conn):  # noqa: F811
    conn.region[1000:1100] = bytes(range(100))
    conn.region[0:8] = b"abcdefgh"
    request = pack_request(Op.READ, 5, [(1000, 100), (1000, 100), (0, 8)], windows=[(10, 3), (95, 5), (8, 0)])
    conn.feed(request, 7)
    [(_, parts)] = [c for c in conn.transport.calls if c[0] == "writelines"]
    header, *slices = parts
    assert RESPONSE.unpack(header) == (MAGIC, VERSION, Op.READ, 5, 0, 0, 8)
    assert all(isinstance(s, memoryview) and s.obj is conn.region for s in slices), "READ must not copy"
    [response] = conn.responses()
    assert response.payload == bytes([10, 11, 12, 95, 96, 97, 98, 99])
    assert conn.stats.bytes_read == 8  # the windows, not the ranges
    assert_back_to_header(conn)


def test_a_traced_windowed_read(conn):  # noqa: F811
    conn.region[64:72] = b"01234567"
    conn.feed(pack_request(Op.READ, 6, [(64, 8)], trace=1234, windows=[(2, 4)]))
    [response] = conn.responses()
    assert (response.status, response.payload) == (0, b"2345")


@pytest.mark.parametrize("window", [(0, 9), (8, 1), ((1 << 64) - 1, 2)], ids=["long", "past", "wraps"])
def test_a_window_outside_its_range_is_invalid_range(conn, window):  # noqa: F811
    conn.feed(pack_request(Op.READ, 7, [(0, 8)], windows=[window]))
    [response] = conn.responses()
    assert (response.request_id, response.status) == (7, Status.INVALID_RANGE)
    assert not conn.transport.closed and conn.stats.bytes_read == 0
    assert_back_to_header(conn)


def test_the_range_is_still_checked_against_the_region(conn):  # noqa: F811
    conn.feed(pack_request(Op.READ, 8, [(CAPACITY - 4, 8)], windows=[(0, 4)]))
    [response] = conn.responses()
    assert response.status == Status.INVALID_RANGE
    assert_back_to_header(conn)


def test_windows_on_a_write_are_a_protocol_error(conn):  # noqa: F811
    conn.feed(pack_request(Op.WRITE, 9, [(0, 4)], 4, windows=[(0, 4)]) + b"data")
    [response] = conn.responses()
    assert response.status == Status.PROTOCOL_ERROR and conn.transport.closed


def test_a_table_without_a_window_per_range_is_a_protocol_error(conn):  # noqa: F811
    request = bytearray(pack_request(Op.READ, 10, [(0, 4), (8, 4), (16, 4)]))
    flags_at = 12  # magic u16, version u8, op u8, request_id u32, nranges u32, then flags
    request[flags_at] |= frames.FLAG_WINDOW  # 3 entries after the deadline: not n ranges + n windows
    conn.feed(bytes(request))
    [response] = conn.responses()
    assert response.status == Status.PROTOCOL_ERROR and conn.transport.closed
