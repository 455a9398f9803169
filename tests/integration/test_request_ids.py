"""A client call's request id reaches the master's and the segment server's logs (issue 7)."""

from __future__ import annotations

import re
import socket

import pytest

from kvtier.client import KvtierError
from kvtier.common.logs import format_request_id, request_id
from kvtier.common.units import parse_hostport
from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.integration.rawframes import far_deadline, recv_response
from tests.integration.test_ssd_tier import (
    bucket_file,
    disk_location,
    put_and_offload,
    sources,
    start_ssd_segment,
)

_RECORD_HEAD_SIZE = 40  # segment_server/bucket_format.py _RECORD_HEAD: the record's names follow it


def log_lines_with(proc, rid: str) -> list[str]:
    return [line for line in proc.log.read_text(errors="replace").splitlines() if f"rid={rid}" in line]


def test_a_refused_put_names_its_request_id_and_the_master_logged_it(cluster):
    client = cluster.client()
    with pytest.raises(KvtierError) as excinfo:
        client.put("far-too-big", b"x" * (96 << 20))  # larger than any segment
    rid = excinfo.value.request_id
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{8}", rid)
    assert f"request_id={rid}" in str(excinfo.value)
    lines = log_lines_with(cluster.master, rid)
    assert lines and all('msg="request refused"' in line for line in lines), cluster.master.tail()
    assert "method=PutStart" in lines[0] and "level=info" in lines[0]
    # Each call has its own id; a later call's refusal names another.
    with pytest.raises(KvtierError) as again:
        client.put("far-too-big", b"x" * (96 << 20))
    assert again.value.request_id != rid


def test_a_disk_record_refused_by_the_segment_is_logged_under_the_callers_request_id(bare_cluster, tmp_path):
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    bare_cluster.start_master("--promote-after-reads", "0")
    segment = start_ssd_segment(bare_cluster, ssd_dir)
    keys = [f"rid/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        victim = next(k for k, s in sources(client, keys).items() if s == "ssd/tcp")
        path, offset = bucket_file(ssd_dir, disk_location(client, victim))
        with open(path, "r+b") as f:  # one byte of the record's names: its header CRC fails
            f.seek(offset + _RECORD_HEAD_SIZE + 1)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
            # An engine may give the call its own id: kvtier keeps an id already set.
        number = 0x5EED0000_00000001
        token = request_id.set(number)
        try:
            assert client.get(victim) is None  # refused by the segment: a miss, never bytes
        finally:
            request_id.reset(token)
    rid = format_request_id(number)
    assert bare_cluster.wait_for(lambda: log_lines_with(segment, rid), timeout=5), segment.tail()
    line = log_lines_with(segment, rid)[0]
    assert 'msg="disk record refused"' in line and f"key={victim}" in line and "CRC" in line


def test_a_traced_frame_refused_by_the_segment_is_logged_with_its_id(cluster):
    segment = next(iter(cluster.segments.values()))
    endpoint = segment.info["endpoints"][0].split("://")[-1]
    number = 0x0BADF00D_0000002A
    with socket.create_connection(parse_hostport(endpoint), timeout=5) as sock:
        sock.sendall(frames.pack_request(Op.READ, 7, [(1 << 60, 8)], trace=number, deadline=far_deadline()))
        op, reply_id, status, _message = recv_response(sock)
        assert (op, reply_id, status) == (Op.READ, 7, Status.INVALID_RANGE)
    rid = format_request_id(number)
    assert cluster.wait_for(lambda: log_lines_with(segment, rid), timeout=5), segment.tail()
    line = log_lines_with(segment, rid)[0]
    assert 'msg="request refused"' in line and "op=READ" in line and "status=INVALID_RANGE" in line
