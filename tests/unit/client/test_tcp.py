"""The tcp connector (client/transport/tcp.py) against a real segment data plane, and how the client
picks the connector for SSD reads (`connect_disk`, client/transport/__init__.py).

The segment side is the shipped TcpListener on uvloop, on its own thread, over a real DRAM buffer
and a real BucketStore read by a real DiskReader; nothing is mocked. Checked: a DRAM write/read
round trip; READ_DISK through the connector gives each record's bytes (or fills the caller's views,
with their CRC32C), fails only the item that does not match, and splits a batch into frames of at
most `frame_bytes`; the registry hands SSD reads to a connector that `reads_disk` (tcp), whatever
transport is forced, and says why when a segment serves none.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from pathlib import Path

import crc32c
import pytest
import uvloop

from kvtier.client.config import ClientConfig
from kvtier.client.transport import CONNECTORS, DISK_CONNECTORS, connect_disk
from kvtier.client.transport.shm import ShmConnector
from kvtier.client.transport.tcp import TcpConnector
from kvtier.proto.errors import ConnectError
from kvtier.proto.status import Status
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.buffer_pool import BufferPool
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.diskio import ThreadPoolEngine
from kvtier.segment_server.listeners import TcpListener
from kvtier.segment_server.protocol import DataPlaneStats

CLUSTER = "tcptest"
OK = int(Status.OK)
REGION = 1 << 20


class Segment:
    """A segment's TCP data plane on its own uvloop thread: region, SSD store, listener."""

    def __init__(self, directory: Path) -> None:
        self.region = memoryview(bytearray(REGION))
        self.store = BucketStore(directory, 64 << 20, CLUSTER, bucket_size=8 << 20)
        self.store.recover()
        self.stats = DataPlaneStats()
        self._engine = ThreadPoolEngine(queue_depth=4, threads=2)
        self._loop = uvloop.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "the data plane did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        reader = DiskReader(self.store, self._engine, BufferPool(4 << 20))
        self.listener = TcpListener("127.0.0.1:0", self.region, self.stats, reader)
        self.endpoint = self._loop.run_until_complete(self.listener.start())
        self._ready.set()
        self._loop.run_forever()

    def put_disk(self, key: str, data: bytes) -> int:
        location = self.store.append("ns", key, data, crc32c.crc32c(data))
        self.store.sync()
        return location

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.listener.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._engine.close()
        self.store.close()


@pytest.fixture
def segment(tmp_path: Path):
    segment = Segment(tmp_path / "ssd")
    yield segment
    segment.close()


def config(transport: str = "", frame_bytes: int = 0) -> ClientConfig:
    extra = {"frame_bytes": frame_bytes} if frame_bytes else {}
    return ClientConfig(master="127.0.0.1:1", transport=transport, **extra)


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def name(key: str) -> bytes:
    return b"ns\x00" + key.encode()


# ------------------------------------------------------------------ the registry


def test_only_connectors_that_read_disk_serve_the_ssd_tier():
    assert DISK_CONNECTORS == {"tcp": TcpConnector}
    assert TcpConnector.reads_disk and not ShmConnector.reads_disk
    assert all(hasattr(cls, "reads_disk") for cls in CONNECTORS.values())


@pytest.mark.parametrize("forced", ["", "tcp", "shm"])
def test_ssd_reads_get_the_tcp_connector_whatever_transport_is_forced(forced):
    endpoints = ["shm:///dev/shm/nowhere?nonce=00&host=h&uid=0", "tcp://127.0.0.1:1"]
    connector = connect_disk(endpoints, config(forced), "seg0")
    try:
        assert isinstance(connector, TcpConnector) and connector.endpoint == "tcp://127.0.0.1:1"
    finally:
        connector.close()


@pytest.mark.parametrize("endpoints", [[], ["shm:///dev/shm/nowhere"], ["rdma://10.0.0.1:4791"]])
def test_a_segment_without_a_disk_reading_endpoint_is_a_connect_error(endpoints):
    with pytest.raises(ConnectError, match="segment seg0 serves no TCP endpoint for its SSD tier"):
        connect_disk(endpoints, config(), "seg0")


# ------------------------------------------------------------------ the connector on a live data plane


def test_read_disk_returns_each_record_and_fails_only_the_one_that_does_not_match(segment):
    data = [blob(i, 1000 + 4096 * i) for i in range(4)]
    locations = [segment.put_disk(f"k{i}", d) for i, d in enumerate(data)]
    items = [(loc, len(d), name(f"k{i}")) for i, (loc, d) in enumerate(zip(locations, data, strict=True))]
    items[2] = (locations[2], len(data[2]), name("another key"))  # the record holds k2: never its bytes
    connector = connect_disk([segment.endpoint], config(), "seg0")
    try:
        results = connector.read_disk(items)
    finally:
        connector.close()
    assert results[0] == data[0] and results[1] == data[1] and results[3] == data[3]
    assert isinstance(results[2], int) and results[2] < 0
    assert segment.stats.ssd_read_errors == 1


def test_read_disk_into_views_fills_them_with_their_checksums_over_several_frames(segment):
    data = [blob(100 + i, 20_000) for i in range(5)]
    locations = [segment.put_disk(f"v{i}", d) for i, d in enumerate(data)]
    items = [(loc, len(d), name(f"v{i}")) for i, (loc, d) in enumerate(zip(locations, data, strict=True))]
    views = [memoryview(bytearray(len(d))) for d in data]
    checksums: list[int | None] = [None] * len(items)
    requests_before = segment.stats.requests
    connector = connect_disk([segment.endpoint], config(frame_bytes=40_000), "seg0")
    try:
        assert connector.read_disk(items, views, checksums) == [OK] * len(items)
    finally:
        connector.close()
    assert [bytes(v) for v in views] == data
    assert checksums == [crc32c.crc32c(d) for d in data]
    assert segment.stats.requests - requests_before == 3, "frames of at most frame_bytes: 2 + 2 + 1 records"


def test_dram_ranges_round_trip_through_the_same_connector(segment):
    payload = blob(7, 30_000)
    connector = TcpConnector(segment.endpoint, config())
    deadline = int(time.time() * 1000) + 60_000
    try:
        # Without a cluster secret a READ or WRITE carries its grant's deadline (FLAG_DEADLINE).
        assert connector.write([(4096, memoryview(payload))], caps=(deadline, [], 0)) == [OK]
        assert connector.read([(4096, len(payload))], caps=(deadline, [], 0)) == [payload]
    finally:
        connector.close()
    assert bytes(segment.region[4096 : 4096 + len(payload)]) == payload


@pytest.mark.parametrize(
    "sizes",
    [
        [16 << 10] * 12 + [0, 520 << 10, 3, 5000, 0] + [40 << 10] * 6 + [17],  # small ones around a large one
        [40 << 10] * 14 + [0, 3, 5000, 0, 17],  # more small ones than one 512 KiB receive takes
    ],
    ids=["around-a-large-one", "past-one-receive"],
)
def test_mixed_sizes_round_trip_with_the_checksums_of_what_moved(segment, sizes):
    """Small objects are sent together and received with one scatter call per 512 KiB; large ones
    chunk by chunk (issue 19): every range lands in its own buffer with its own CRC32C."""
    payloads = [blob(100 + i, n) for i, n in enumerate(sizes)]
    offsets = [sum(sizes[:i]) + 64 * i for i in range(len(sizes))]  # gaps: separate runs on the segment
    deadline = int(time.time() * 1000) + 60_000
    connector = TcpConnector(segment.endpoint, config())
    try:
        written: list[int | None] = [None] * len(sizes)
        ranges = [(o, memoryview(p)) for o, p in zip(offsets, payloads, strict=True)]
        assert connector.write(ranges, written, caps=(deadline, [], 0)) == [OK] * len(sizes)
        buffers = [bytearray(n) for n in sizes]
        read: list[int | None] = [None] * len(sizes)
        ranges = [(o, memoryview(b)) for o, b in zip(offsets, buffers, strict=True)]
        assert connector.read_into(ranges, read, caps=(deadline, [], 0)) == [OK] * len(sizes)
    finally:
        connector.close()
    assert [bytes(b) for b in buffers] == payloads
    assert written == read == [crc32c.crc32c(p) for p in payloads]


def test_small_objects_share_socket_calls_both_ways(segment, monkeypatch):
    """Issue 19: 32 x 8 KiB used to cost 32 sendmsg calls to write and 32 receives to read; now
    one call each way carries them, the read's response header included (the checksums still per
    object)."""
    import kvtier.client.transport.tcp as tcp

    calls: dict[str, int] = {"send": 0, "recv_into": 0, "recv_into_all": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tcp, "send_all", counted("send", tcp.send_all))
    monkeypatch.setattr(tcp, "recv_exact_into", counted("recv_into", tcp.recv_exact_into))
    monkeypatch.setattr(tcp, "recv_exact_into_all", counted("recv_into_all", tcp.recv_exact_into_all))
    payloads = [blob(200 + i, 8 << 10) for i in range(32)]
    ranges = [(i * (8 << 10), memoryview(p)) for i, p in enumerate(payloads)]
    deadline = int(time.time() * 1000) + 60_000
    connector = TcpConnector(segment.endpoint, config())
    try:
        crcs: list[int | None] = [None] * 32
        assert connector.write(ranges, crcs, caps=(deadline, [], 0)) == [OK] * 32
        assert calls["send"] == 1
        buffers = [bytearray(8 << 10) for _ in range(32)]
        calls.update(recv_into=0)
        read: list[int | None] = [None] * 32
        into = [(o, memoryview(b)) for (o, _), b in zip(ranges, buffers, strict=True)]
        assert connector.read_into(into, read, caps=(deadline, [], 0)) == [OK] * 32
        # Session 9: the header comes with the payloads' scatter receive (it is the last response in
        # flight); what had not arrived by then takes one more.
        assert calls["recv_into"] == 0 and calls["recv_into_all"] <= 1
    finally:
        connector.close()
    assert [bytes(b) for b in buffers] == payloads and read == crcs == [crc32c.crc32c(p) for p in payloads]


class CountingSocket:
    """A pooled socket that counts its receive calls (peeks at idle sockets apart): the connector
    under test uses it as it would the socket itself."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.receives = 0

    def __getattr__(self, name: str):
        attr = getattr(self._sock, name)
        if name in ("recv", "recv_into", "recvmsg_into"):

            def counted(*args):
                if not (len(args) > 1 and args[-1] & socket.MSG_PEEK):
                    self.receives += 1
                return attr(*args)

            return counted
        return attr


@pytest.fixture
def counted_sockets(monkeypatch) -> list[CountingSocket]:
    from kvtier.client.sockpool import SocketPool

    made: list[CountingSocket] = []
    connect = SocketPool._connect

    def counting(pool, timeout):
        made.append(CountingSocket(connect(pool, timeout)))
        return made[-1]

    monkeypatch.setattr(SocketPool, "_connect", counting)
    return made


@pytest.mark.parametrize("into", [True, False], ids=["read_into", "read"])
def test_a_small_read_gets_header_and_payload_in_one_receive(segment, counted_sockets, into):
    """Session 9: the response header and the payload of a small read arrive together (the segment
    writes them with one writev): one receive call takes both, verified bytes and CRC as before."""
    payload = blob(300, 4096)
    deadline = int(time.time() * 1000) + 60_000
    connector = TcpConnector(segment.endpoint, config())
    try:
        assert connector.write([(8192, memoryview(payload))], [None], caps=(deadline, [], 0)) == [OK]
        (sock,) = counted_sockets
        sock.receives = 0
        if into:
            buffer, crcs = bytearray(4096), [None]
            assert connector.read_into([(8192, memoryview(buffer))], crcs, caps=(deadline, [], 0)) == [OK]
            assert bytes(buffer) == payload and crcs == [crc32c.crc32c(payload)]
        else:
            assert connector.read([(8192, 4096)], caps=(deadline, [], 0)) == [payload]
        assert sock.receives == 1
    finally:
        connector.close()


@pytest.mark.parametrize("into", [True, False], ids=["read_into", "read"])
def test_a_refused_small_read_reports_its_message_and_the_connection_stays_in_step(segment, caplog, into):
    """The error message of a refused read may land in the read's own buffers with its header
    (session 9): it is still logged whole, the range fails with the segment's status, and the
    same connection serves the next read."""
    payload = blob(301, 4096)
    deadline = int(time.time() * 1000) + 60_000
    connector = TcpConnector(segment.endpoint, ClientConfig(master="127.0.0.1:1", connections_per_segment=1))
    try:
        assert connector.write([(0, memoryview(payload))], [None], caps=(deadline, [], 0)) == [OK]
        outside = REGION - 100  # runs past the region: INVALID_RANGE, with a message
        if into:
            result = connector.read_into([(outside, memoryview(bytearray(4096)))], [None], caps=(deadline, [], 0))
        else:
            result = connector.read([(outside, 4096)], caps=(deadline, [], 0))
        assert result == [int(Status.INVALID_RANGE)]
        assert f"range offset={outside} length=4096 outside region of {REGION}" in caplog.text
        assert connector.read([(0, 4096)], caps=(deadline, [], 0)) == [payload]
        assert connector._pool._open == 1  # the same socket: the refusal left it in step
    finally:
        connector.close()
