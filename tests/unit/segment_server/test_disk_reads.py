"""DiskReader (segment_server/disk_reads.py): READ_DISK answered on a real uvloop transport over a
socketpair, from a real BucketStore, through the thread-pool engine and a real BufferPool.

Checked: the exact response frame (status and bytes per record, in request order, zeros after an
error status), the counters, that every pool buffer goes back, that the pool bounds the buffers
however many records a request names, that a client that stops reading is cut off after
send_timeout_s with its buffers given back, and that adjacent records are read with one I/O of at
most coalesce_bytes while each keeps its own status.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path

import crc32c
import pytest
import uvloop

from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.buffer_pool import BufferPool
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.diskio import ThreadPoolEngine
from kvtier.segment_server.protocol import DataPlaneStats

CLUSTER = "readtest"
OK = int(Status.OK)
HANG_GUARD_S = 20.0  # past every bound a test here waits for; below pytest-timeout's


class Sender(asyncio.Protocol):
    """The server side of a connection as DataProtocol drives it: `writable` follows flow control."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost = asyncio.Event()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc) -> None:
        self.writable.set()
        self.lost.set()


@pytest.fixture
def store(tmp_path: Path):
    store = BucketStore(tmp_path / "ssd", 256 << 20, CLUSTER, bucket_size=64 << 20)
    store.recover()
    yield store
    store.close()


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def put(store: BucketStore, key: str, data: bytes) -> int:
    location = store.append("ns", key, data, crc32c.crc32c(data))
    store.sync()
    return location


def parse(response: bytes, sizes: list[int]) -> list[tuple[int, bytes]]:
    """(status, bytes) per record of one READ_DISK response; asserts the frame is whole and exact."""
    magic, _version, op, request_id, status, _flags, length = frames.RESPONSE.unpack_from(response)
    assert (magic, op, request_id, status) == (frames.MAGIC, Op.READ_DISK, 42, OK)
    assert length == 4 * len(sizes) + sum(sizes) == len(response) - frames.RESPONSE.size
    out, pos = [], frames.RESPONSE.size
    for size in sizes:
        (record_status,) = frames.DISK_STATUS.unpack_from(response, pos)
        out.append((record_status, response[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    return out


class CountingEngine(ThreadPoolEngine):
    """The thread-pool engine, remembering the length of every read it was asked for."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.read_lengths: list[int] = []

    async def read_at(self, fd, offset, buf):
        self.read_lengths.append(len(buf))
        return await super().read_at(fd, offset, buf)


def total_pins(store: BucketStore) -> int:
    return sum(bucket.pins for bucket in store._buckets.values())  # test-only look inside


def serve(
    store: BucketStore,
    requests: list[tuple[int, int, str]],
    *,
    pool_bytes: int = 1 << 20,
    window: int = 4,
    send_timeout_s: float = 30.0,
    read: bool = True,
    sndbuf: int | None = None,
    coalesce_bytes: int | None = None,
    engine: ThreadPoolEngine | None = None,
) -> tuple[bytes, DataPlaneStats, BufferPool, Sender]:
    """Serve one READ_DISK of `requests` [(location, size, key)]; returns what the client received.

    `sndbuf` shrinks the server socket's kernel send buffer, so that what a stalled client leaves
    unsent stays in the transport. A serve() that does not return fails the test instead of hanging
    pytest: the uvloop loop cannot be interrupted by pytest-timeout's signal.
    """
    ranges = [v for location, size, _ in requests for v in (location, size)]
    names = [("ns", key) for _, _, key in requests]
    expected = frames.RESPONSE.size + 4 * len(requests) + sum(size for _, size, _ in requests)

    async def main():
        loop = asyncio.get_running_loop()
        server_sock, client_sock = socket.socketpair()
        if sndbuf is not None:
            server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        client_sock.setblocking(False)
        disk = engine or ThreadPoolEngine(queue_depth=4, threads=2)
        pool = BufferPool(pool_bytes)
        try:
            _, sender = await loop.create_connection(Sender, sock=server_sock)
            extra = {} if coalesce_bytes is None else {"coalesce_bytes": coalesce_bytes}
            reader = DiskReader(store, disk, pool, window=window, send_timeout_s=send_timeout_s, **extra)
            received = bytearray()

            async def receive() -> None:
                while len(received) < expected:
                    chunk = await loop.sock_recv(client_sock, 1 << 20)
                    if not chunk:
                        return
                    received.extend(chunk)

            receiving = loop.create_task(receive()) if read else None
            stats = DataPlaneStats()
            serving = loop.create_task(reader.serve(sender.transport, sender.writable, 42, ranges, names, stats))
            await bounded(serving, HANG_GUARD_S + send_timeout_s)
            if receiving is not None:
                await asyncio.wait_for(receiving, 10)
            sender.transport.close()
            return bytes(received), stats, pool, sender
        finally:
            client_sock.close()
            disk.close()

    return run(main())


async def bounded(task: asyncio.Task, timeout_s: float) -> None:
    """Await `task`; fail the test if it is not done within `timeout_s`. Unlike wait_for, this never
    waits unboundedly for a cancellation that does not land (a hang in a finally, say)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        pytest.fail(f"DiskReader.serve hung: not done within {timeout_s:g}s")
    task.result()


def run(main):
    """uvloop.run without its last step, which cancels the tasks left over and waits for them all
    without a bound: after a hang, those may never finish, and pytest would hang with them."""
    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def test_records_come_back_in_order_with_a_status_each(store: BucketStore) -> None:
    data = [blob(i, size) for i, size in enumerate([5000, 1, 70_000, 4096])]
    locations = [put(store, f"k{i}", d) for i, d in enumerate(data)]
    requests = [(loc, len(d), f"k{i}") for i, (loc, d) in enumerate(zip(locations, data, strict=True))]
    requests += [
        (locations[0], len(data[0]), "k1"),  # another object's record: the header names k0
        (locations[0], len(data[0]) + 1, "k0"),  # the master's size is not the record's
        (locations[-1] + 1, 100, "nothing"),  # no record there
    ]
    sizes = [size for _, size, _ in requests]
    response, stats, pool, _ = serve(store, requests)
    got = parse(response, sizes)
    assert got[:4] == [(OK, d) for d in data]
    assert [status for status, _ in got[4:]] == [
        int(Status.CHECKSUM_MISMATCH),
        int(Status.INVALID_RANGE),
        int(Status.NOT_FOUND),
    ]
    assert all(body == bytes(len(body)) for _, body in got[4:]), "an error status is followed by zeros"
    assert stats.ssd_bytes_served == sum(map(len, data)) and stats.ssd_read_errors == 3
    assert stats.ssd_bytes_read >= sum(map(len, data))  # headers and padding too
    assert pool.used == 0, "every read buffer went back to the pool"


def test_a_record_larger_than_the_whole_pool_is_too_large_and_the_rest_is_served(store: BucketStore) -> None:
    big, small = blob(1, 1 << 20), blob(2, 3000)
    requests = [(put(store, "big", big), len(big), "big"), (put(store, "small", small), len(small), "small")]
    response, stats, pool, _ = serve(store, requests, pool_bytes=1 << 20)  # a record needs its header too
    assert parse(response, [len(big), len(small)]) == [(int(Status.TOO_LARGE), bytes(len(big))), (OK, small)]
    assert pool.used == 0


def test_the_pool_bounds_read_buffers_whatever_the_request_names(store: BucketStore) -> None:
    data = [blob(i, 60_000) for i in range(40)]
    requests = [(put(store, f"k{i}", d), len(d), f"k{i}") for i, d in enumerate(data)]
    pool_bytes = 3 * 64 * 1024  # three records' buffers for 40 records, a window of 8
    response, stats, pool, _ = serve(store, requests, pool_bytes=pool_bytes, window=8)
    assert parse(response, [len(d) for d in data]) == [(OK, d) for d in data]
    assert 0 < pool.peak_used <= pool_bytes and pool.used == 0


def test_a_client_that_stops_reading_is_cut_off_and_its_buffers_go_back(store: BucketStore) -> None:
    data = [blob(i, 1 << 20) for i in range(12)]  # 12 MiB: past the socket and the transport's 4 MiB
    requests = [(put(store, f"k{i}", d), len(d), f"k{i}") for i, d in enumerate(data)]
    send_timeout_s = 0.3
    started = time.monotonic()
    _, stats, pool, sender = serve(store, requests, pool_bytes=4 << 20, send_timeout_s=send_timeout_s, read=False)
    assert time.monotonic() - started >= send_timeout_s, "cut off only after send_timeout_s without progress"
    assert sender.lost.is_set(), "the connection was aborted"
    assert pool.used == 0, "the stalled client's buffers are back in the pool"
    assert stats.ssd_bytes_served < sum(map(len, data))


def test_a_client_cut_off_while_a_read_waits_for_its_own_buffers_ends_the_request(store: BucketStore) -> None:
    """The exact interleaving: the pool holds one record's buffer, so the second record's read waits
    in pool.acquire for the buffer of the first, which the stalled client never takes. Sending drains
    before awaiting that read, the drain times out and aborts the connection: the request must end
    there and give the buffer back, not await a read that can only get that buffer afterwards."""
    data = [blob(i, 256 << 10) for i in range(3)]
    requests = [(put(store, f"k{i}", d), len(d), f"k{i}") for i, d in enumerate(data)]
    one_buffer = 2 * (256 << 10) - 4096  # room for one record's buffer (payload, header, pages), not two
    send_timeout_s = 0.2
    _, stats, pool, sender = serve(
        store, requests, pool_bytes=one_buffer, window=2, send_timeout_s=send_timeout_s, read=False, sndbuf=4096
    )
    assert sender.lost.is_set(), "the connection was aborted"
    assert pool.used == 0 and pool.waiting == 0, "the buffer is back and no read still waits for one"
    assert stats.ssd_bytes_served == len(data[0]), "only the first record was queued before the cut-off"


def test_adjacent_records_are_read_with_one_io_each_within_coalesce_bytes(store: BucketStore) -> None:
    data = [blob(i, 100_000) for i in range(10)]  # 100 KB + header: 25 pages (102,400 bytes) a record
    requests = [(put(store, f"k{i}", d), len(d), f"k{i}") for i, d in enumerate(data)]
    put(store, "after", blob(99, 10))  # the last read does not end at EOF (a short read reads once more)
    engine = CountingEngine(queue_depth=4, threads=2)
    response, stats, pool, _ = serve(store, requests, pool_bytes=4 << 20, coalesce_bytes=300_000, engine=engine)
    assert parse(response, [len(d) for d in data]) == [(OK, d) for d in data]
    record = 25 * 4096
    assert engine.read_lengths == [2 * record] * 5, "two adjacent records (not three: 307,200 > 300,000) per read"
    assert stats.ssd_bytes_read == 10 * record and stats.ssd_bytes_served == sum(map(len, data))
    assert pool.used == 0 and total_pins(store) == 0


def test_records_asked_out_of_disk_order_or_with_coalescing_off_are_read_alone(store: BucketStore) -> None:
    data = [blob(i, 10_000) for i in range(6)]
    locations = [put(store, f"k{i}", d) for i, d in enumerate(data)]
    put(store, "after", blob(99, 10))
    backwards = [(loc, len(d), f"k{i}") for i, (loc, d) in reversed(list(enumerate(zip(locations, data, strict=True))))]
    engine = CountingEngine(queue_depth=4, threads=2)
    response, _, pool, _ = serve(store, backwards, coalesce_bytes=1 << 20, engine=engine)
    assert parse(response, [size for _, size, _ in backwards]) == [(OK, data[int(k[1:])]) for _, _, k in backwards]
    assert len(engine.read_lengths) == 6
    in_order = list(reversed(backwards))
    engine = CountingEngine(queue_depth=4, threads=2)
    response, _, pool, _ = serve(store, in_order, coalesce_bytes=0, engine=engine)
    assert parse(response, [len(d) for d in data]) == [(OK, d) for d in data]
    assert len(engine.read_lengths) == 6 and pool.used == 0 and total_pins(store) == 0


def test_a_bad_record_inside_a_coalesced_read_fails_alone(store: BucketStore, tmp_path: Path) -> None:
    data = [blob(i, 20_000) for i in range(5)]
    locations = [put(store, f"k{i}", d) for i, d in enumerate(data)]
    put(store, "after", blob(99, 10))
    requests = [(loc, len(d), f"k{i}") for i, (loc, d) in enumerate(zip(locations, data, strict=True))]
    requests[1] = (locations[1], len(data[1]), "k9")  # the header names k1: refused
    # Record 3's header damaged on disk (its header CRC fails): refused, its neighbours are not.
    plan = store.plan_read(locations[3])
    with open(next((tmp_path / "ssd").rglob("bucket-*.kvb")), "r+b") as f:
        f.seek(plan.file_offset + 20)
        byte = f.read(1)
        f.seek(plan.file_offset + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine = CountingEngine(queue_depth=4, threads=2)
    response, stats, pool, _ = serve(store, requests, coalesce_bytes=1 << 20, engine=engine)
    mismatch = int(Status.CHECKSUM_MISMATCH)
    assert parse(response, [len(d) for d in data]) == [
        (OK, data[0]),
        (mismatch, bytes(len(data[1]))),
        (OK, data[2]),
        (mismatch, bytes(len(data[3]))),
        (OK, data[4]),
    ]
    assert len(engine.read_lengths) == 1, "one read for the five adjacent records"
    assert stats.ssd_read_errors == 2 and pool.used == 0 and total_pins(store) == 0


def test_a_client_cut_off_mid_coalesced_read_gives_back_buffers_and_pins(store: BucketStore) -> None:
    data = [blob(i, 1 << 20) for i in range(12)]
    requests = [(put(store, f"k{i}", d), len(d), f"k{i}") for i, d in enumerate(data)]
    _, stats, pool, sender = serve(
        store, requests, pool_bytes=16 << 20, coalesce_bytes=4 << 20, send_timeout_s=0.3, read=False, sndbuf=4096
    )
    assert sender.lost.is_set(), "the connection was aborted"
    assert pool.used == 0 and pool.waiting == 0 and total_pins(store) == 0
    assert stats.ssd_bytes_served < sum(map(len, data))
