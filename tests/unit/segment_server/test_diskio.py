"""Disk engines on real files in tmp_path (real io_uring, no mocks): exact bytes, errors, and the
bounds that matter in production: queue depth, thread count, buffer pool capacity."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from kvtier.segment_server.buffer_pool import BufferPool
from kvtier.segment_server.diskio import (
    _CLOSE_DRAIN_SECONDS,
    ALIGN,
    DiskEngine,
    IoUringEngine,
    ThreadPoolEngine,
    read_fully,
)
from kvtier.segment_server.diskio_probe import io_uring_probe, open_engine, probe_io_uring
from tests.capability import missing

KINDS = ["threads", "io_uring"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "io_uring":
        probe = io_uring_probe()
        if not probe.ok:
            missing("io_uring", probe.reason)
    return request.param


@pytest.fixture
def uring() -> None:
    probe = io_uring_probe()
    if not probe.ok:
        missing("io_uring", probe.reason)


def make_engine(kind: str, *, queue_depth: int = 32, threads: int = 4) -> DiskEngine:
    if kind == "threads":
        return ThreadPoolEngine(queue_depth=queue_depth, threads=threads)
    return IoUringEngine(queue_depth=queue_depth, kernel_workers=threads)


def run_with_engine(kind: str, body: Callable[[DiskEngine], Awaitable[None]], **kwargs: int) -> None:
    async def main() -> None:
        engine = make_engine(kind, **kwargs)
        try:
            await body(engine)
        finally:
            engine.close()
        assert engine.in_flight == 0

    asyncio.run(main())


@pytest.fixture
def open_fd(tmp_path: Path):
    """open_fd(name, content=b"", flags=O_RDWR) -> fd, closed at teardown."""
    fds: list[int] = []

    def opener(name: str, content: bytes = b"", flags: int = os.O_RDWR) -> int:
        path = tmp_path / name
        if not path.exists():
            path.write_bytes(content)
        fd = os.open(path, flags | os.O_CLOEXEC)
        fds.append(fd)
        return fd

    yield opener
    for fd in fds:
        os.close(fd)


# Thread bounds are asserted on threads the engine owns, never on the whole process: the process
# also holds gRPC threads left by earlier tests and io-wq workers of rings closed by earlier tests
# (they outlive their ring by ~15 ms), and either may exit in the middle of a measurement.
def engine_threads() -> frozenset[int]:
    """Idents of the thread-pool engine's workers (named kvtier-diskio_N by ThreadPoolEngine)."""
    return frozenset(t.ident for t in threading.enumerate() if t.name.startswith("kvtier-diskio") and t.ident)


def python_threads() -> frozenset[int]:
    return frozenset(t.ident for t in threading.enumerate() if t.ident)


def io_wq_workers() -> int:
    """This process's io_uring kernel workers (comm "iou-wrk-<pid>"), from /proc/self/task."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith("iou-wrk")
        except FileNotFoundError:  # the thread exited while we listed
            pass
    return count


def address_of(view: memoryview) -> int:
    probe = (ctypes.c_char * 1).from_buffer(view)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


async def sample_while(
    work: Awaitable[list[int]], sample: Callable[[], tuple[int, ...]]
) -> tuple[list[int], set[tuple[int, ...]]]:
    """Run `work`, recording `sample()` on every loop iteration until it finishes."""
    task = asyncio.ensure_future(work)
    seen = {sample()}
    while not task.done():
        seen.add(sample())
        await asyncio.sleep(0)
    return task.result(), seen


async def submitted(engine: DiskEngine, count: int) -> None:
    """Until `count` requests are in flight and handed to the kernel (io_uring submits on the loop's
    next turn, see IoUringEngine): a parked request, without sleeping for a guessed time."""
    while engine.in_flight < count:
        await asyncio.sleep(0)
    for _ in range(3):  # the submission is scheduled with call_soon: let it run
        await asyncio.sleep(0)


# --- engines ---------------------------------------------------------------------------------------


def test_round_trip_exact_bytes_at_aligned_and_unaligned_offsets(kind: str, open_fd) -> None:
    fd = open_fd("bucket")
    rng = random.Random(1)
    extents = [(0, 1), (1, 4094), (4095, 4097), (8192, 8192), (20003, 12345), (65536, 65536)]
    payloads = [rng.randbytes(size) for _, size in extents]

    async def body(engine: DiskEngine) -> None:
        for i, ((offset, _), payload) in enumerate(zip(extents, payloads, strict=True)):
            data = payload if i % 2 else memoryview(bytearray(payload))
            assert await engine.write_at(fd, offset, data) == len(payload)
        await engine.sync(fd)
        buffers = [bytearray(size) for _, size in extents]
        counts = await asyncio.gather(
            *(read_fully(engine, fd, offset, buf) for (offset, _), buf in zip(extents, buffers, strict=True))
        )
        assert counts == [size for _, size in extents]
        assert buffers == payloads
        for (offset, size), payload in zip(extents, payloads, strict=True):
            assert os.pread(fd, size, offset) == payload  # what the kernel really has
        assert await engine.read_at(fd, 0, memoryview(bytearray())) == 0
        assert await engine.write_at(fd, 0, b"") == 0

    run_with_engine(kind, body)


def test_reads_into_buffer_pool_mmap_views(kind: str, open_fd) -> None:
    content = random.Random(2).randbytes(256 * 1024)
    fd = open_fd("bucket", content)

    async def body(engine: DiskEngine) -> None:
        pool = BufferPool(128 * 1024)
        try:
            views = [await pool.acquire(n) for n in (1, 4096, 5000, 65536)]
            for view in views:
                assert address_of(view) % ALIGN == 0
            offsets = [3, 4096, 12345, 131072]
            counts = await asyncio.gather(
                *(engine.read_at(fd, offset, view) for offset, view in zip(offsets, views, strict=True))
            )
            for offset, view, count in zip(offsets, views, counts, strict=True):
                assert count == len(view)
                assert view == content[offset : offset + len(view)]
            inner = views[3][100:300]  # an unaligned slice of a pool buffer
            assert await read_fully(engine, fd, 777, inner) == 200
            assert inner == content[777:977]
            del inner
            for view in views:
                pool.release(view)
        finally:
            pool.close()

    run_with_engine(kind, body)


def test_o_direct_read_into_pool_buffer(kind: str, tmp_path: Path) -> None:
    content = random.Random(3).randbytes(64 * 1024 + 1000)
    path = tmp_path / "direct"
    path.write_bytes(content)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        missing("o_direct", f"O_DIRECT unsupported in {tmp_path}: {exc}")

    async def body(engine: DiskEngine) -> None:
        pool = BufferPool(128 * 1024)
        try:
            view = await pool.acquire(32 * 1024)
            assert await engine.read_at(fd, 8192, view) == len(view)
            assert view == content[8192 : 8192 + len(view)]
            tail = await pool.acquire(8192)
            assert await read_fully(engine, fd, 64 * 1024, tail) == 1000  # short at EOF, then 0
            assert tail[:1000] == content[64 * 1024 :]
            pool.release(view)
            pool.release(tail)
        finally:
            pool.close()

    try:
        run_with_engine(kind, body)
    finally:
        os.close(fd)


def test_short_read_at_eof(kind: str, open_fd) -> None:
    content = random.Random(4).randbytes(10000)
    fd = open_fd("bucket", content)

    async def body(engine: DiskEngine) -> None:
        buf = bytearray(8192)
        assert await engine.read_at(fd, 8192, buf) == 10000 - 8192
        assert buf[: 10000 - 8192] == content[8192:]
        assert await engine.read_at(fd, 10000, buf) == 0
        assert await engine.read_at(fd, 1 << 20, buf) == 0
        whole = bytearray(16384)
        assert await read_fully(engine, fd, 0, whole) == 10000
        assert whole[:10000] == content

    run_with_engine(kind, body)


def test_bad_fd_raises_oserror_with_ebadf(kind: str, open_fd, tmp_path: Path) -> None:
    read_only = open_fd("ro", b"x" * 4096, os.O_RDONLY)

    async def body(engine: DiskEngine) -> None:
        # Closed here, with the loop and engine already built, so nothing reuses the number.
        closed = os.open(tmp_path / "ro", os.O_RDONLY)
        os.close(closed)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: engine.read_at(closed, 0, bytearray(16)),
            lambda: engine.write_at(closed, 0, b"data"),
            lambda: engine.sync(closed),
            lambda: engine.read_at(-1, 0, bytearray(16)),
            lambda: engine.write_at(read_only, 0, b"data"),  # EBADF too: not open for writing
        ]
        for call in calls:
            with pytest.raises(OSError) as info:
                await call()
            assert info.value.errno == errno.EBADF
        assert await engine.read_at(read_only, 0, bytearray(4)) == 4  # the engine still works

    run_with_engine(kind, body)


def test_bad_arguments(kind: str, open_fd) -> None:
    fd = open_fd("bucket", b"x" * 100)

    async def body(engine: DiskEngine) -> None:
        with pytest.raises(ValueError, match="writable"):
            await engine.read_at(fd, 0, memoryview(b"read-only"))
        with pytest.raises(ValueError, match="contiguous"):
            await engine.read_at(fd, 0, memoryview(bytearray(64))[::2])
        with pytest.raises(ValueError, match="negative"):
            await engine.read_at(fd, -1, bytearray(4))
        words = memoryview(bytearray(16)).cast("I")  # any contiguous format is read as bytes
        assert await engine.read_at(fd, 0, words) == 16
        assert engine.in_flight == 0

    run_with_engine(kind, body)


def test_queue_depth_bounds_in_flight_io(kind: str, open_fd) -> None:
    content = random.Random(5).randbytes(200 * 4096)
    fd = open_fd("bucket", content)
    observed: list[int] = []

    async def body(engine: DiskEngine) -> None:
        async def read_block(i: int) -> bytes:
            buf = bytearray(4096)
            assert await engine.read_at(fd, i * 4096, buf) == 4096
            observed.append(engine.in_flight)
            return bytes(buf)

        blocks = await asyncio.gather(*(read_block(i) for i in range(200)))
        assert b"".join(blocks) == content
        assert engine.peak_in_flight == 4  # the bound was reached, never passed
        assert max(observed) <= 4

    run_with_engine(kind, body, queue_depth=4)


def test_thread_count_is_constant_under_1000_concurrent_reads(kind: str, open_fd) -> None:
    content = random.Random(6).randbytes(1 << 20)
    fd = open_fd("bucket", content)  # written with write(2): no kernel worker was needed so far

    async def body(engine: DiskEngine) -> None:
        own_before, python_before, workers_before = engine_threads(), python_threads(), io_wq_workers()

        async def read_block(i: int) -> int:
            offset = (i * 4096) % len(content)
            buf = bytearray(4096)
            await engine.read_at(fd, offset, buf)
            return int(buf == content[offset : offset + 4096])

        results, seen = await sample_while(
            asyncio.gather(*(read_block(i) for i in range(1000))),
            lambda: (engine_threads(), python_threads(), io_wq_workers()),
        )
        assert sum(results) == 1000
        # No Python thread is started by 1000 reads (threads of earlier tests may exit meanwhile).
        assert all(python <= python_before for _, python, _ in seen)
        if kind == "threads":  # exactly the engine's own workers, the same ones throughout
            assert len(own_before) == engine.threads
            assert {own for own, _, _ in seen} == {own_before}
        else:  # no userspace thread; io-wq workers only if the kernel could not complete inline
            assert own_before == frozenset() and {own for own, _, _ in seen} == {frozenset()}
            assert max(workers for _, _, workers in seen) <= workers_before + engine.kernel_workers

    run_with_engine(kind, body, queue_depth=32, threads=4)


def test_thread_engine_spawns_all_workers_at_construction() -> None:
    assert engine_threads() == frozenset()  # every earlier engine was closed
    engine = ThreadPoolEngine(threads=3)
    try:
        assert engine.threads == 3
        assert len(engine_threads()) == 3
    finally:
        engine.close()
    assert engine_threads() == frozenset()  # close() joins its workers


def test_io_uring_caps_kernel_worker_threads(uring: None, open_fd) -> None:
    # Buffered writes and fsync are punted to io-wq kernel threads: without the cap the kernel
    # allows min(entries, 4 x CPUs) of them for this engine's 64-deep ring.
    fds = [open_fd(f"bucket{i}") for i in range(32)]
    data = os.urandom(256 * 1024)

    async def body(engine: DiskEngine) -> None:
        before = io_wq_workers()

        async def write_and_sync(fd: int) -> int:
            await engine.write_at(fd, 0, data)
            await engine.sync(fd)
            return 1

        results, seen = await sample_while(
            asyncio.gather(*(write_and_sync(fd) for fd in fds)), lambda: (io_wq_workers(),)
        )
        assert sum(results) == len(fds)
        assert max(n for (n,) in seen) <= before + 2
        assert all(os.pread(fd, 16, 1000) == data[1000:1016] for fd in fds)

    run_with_engine("io_uring", body, queue_depth=64, threads=2)


def test_io_uring_cancels_a_parked_read(uring: None) -> None:
    # A pipe read stays in flight until data arrives. Cancelling the caller must cancel the request
    # in the kernel (else the caller would wait for the kernel forever) and free its slot.
    async def body(engine: DiskEngine) -> None:
        r, w = os.pipe()
        try:
            buf = bytearray(16)
            task = asyncio.create_task(engine.read_at(r, 0, buf))
            await submitted(engine, 1)
            assert not task.done() and engine.in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
            assert engine.in_flight == 0
            os.write(w, b"later")  # the cancelled request no longer consumes data
            assert await asyncio.wait_for(engine.read_at(r, 0, buf), 5) == 5
            assert buf[:5] == b"later"
        finally:
            os.close(r)
            os.close(w)

    run_with_engine("io_uring", body, queue_depth=1)


def test_io_uring_close_cancels_parked_io(uring: None) -> None:
    async def main() -> None:
        engine = IoUringEngine(queue_depth=4, kernel_workers=2)
        r, w = os.pipe()
        try:
            task = asyncio.create_task(engine.read_at(r, 0, bytearray(16)))
            await submitted(engine, 1)
            started = time.monotonic()
            engine.close()  # must not sit out its 10 s drain deadline on a request the kernel can cancel
            assert time.monotonic() - started < _CLOSE_DRAIN_SECONDS / 2
            with pytest.raises(OSError) as info:
                await task
            assert info.value.errno == errno.ECANCELED
        finally:
            engine.close()
            os.close(r)
            os.close(w)

    asyncio.run(main())


@pytest.mark.parametrize("inline_max", [0, 1 << 30])
def test_io_uring_inline_and_punted_io_agree(uring: None, open_fd, inline_max: int) -> None:
    # inline_max=0 flags every I/O IOSQE_ASYNC (kernel workers do it); 1 GiB keeps all of it inline.
    fd = open_fd("bucket")
    data = random.Random(8).randbytes(3 * 1024 * 1024 + 5)

    async def main() -> None:
        engine = IoUringEngine(queue_depth=8, kernel_workers=2, inline_max=inline_max)
        try:
            assert await engine.write_at(fd, 7, data) == len(data)
            await engine.sync(fd)
            buf = bytearray(len(data))
            assert await read_fully(engine, fd, 7, buf) == len(data)
            assert buf == data
        finally:
            engine.close()

    asyncio.run(main())


def test_closed_engine_refuses_io(kind: str, open_fd) -> None:
    fd = open_fd("bucket", b"abc")

    async def main() -> None:
        engine = make_engine(kind)
        assert await engine.read_at(fd, 0, bytearray(3)) == 3
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await engine.read_at(fd, 0, bytearray(3))

    asyncio.run(main())


def test_engines_work_under_uvloop(kind: str, open_fd) -> None:
    fd = open_fd("bucket")

    async def main() -> None:
        engine = make_engine(kind)
        try:
            await engine.write_at(fd, 5, b"uvloop")
            await engine.sync(fd)
            buf = bytearray(6)
            assert await engine.read_at(fd, 5, buf) == 6
            assert buf == b"uvloop"
        finally:
            engine.close()

    uvloop.run(main())


# --- choosing an engine ----------------------------------------------------------------------------


def test_open_engine_auto_returns_a_working_engine_and_a_reason(open_fd) -> None:
    fd = open_fd("bucket", b"hello world")

    async def main() -> None:
        engine, reason = open_engine("auto", queue_depth=8, threads=2)
        try:
            assert engine.queue_depth == 8
            buf = bytearray(5)
            assert await engine.read_at(fd, 6, buf) == 5
            assert buf == b"world"
        finally:
            engine.close()
        probe = io_uring_probe()
        if probe.ok:
            assert isinstance(engine, IoUringEngine)
            assert reason.startswith("io_uring (liburing ")
            assert (engine.threads, engine.kernel_workers) == (0, 2)
        else:
            assert isinstance(engine, ThreadPoolEngine)
            assert f"io_uring unavailable: {probe.reason}" in reason

    asyncio.run(main())


def test_open_engine_explicit_kinds() -> None:
    async def main() -> None:
        engine, reason = open_engine("threads", queue_depth=4, threads=3)
        engine.close()
        assert isinstance(engine, ThreadPoolEngine)
        assert reason == "threads x3, queue depth 4 (requested)"
        if io_uring_probe().ok:
            engine, reason = open_engine("io_uring")
            engine.close()
            assert engine.name == "io_uring"
        else:
            with pytest.raises(RuntimeError, match="io_uring unavailable"):
                open_engine("io_uring")
        with pytest.raises(ValueError, match="unknown disk engine kind"):
            open_engine("spdk")

    asyncio.run(main())


def test_probe_reports_a_child_killed_by_sigill() -> None:
    result = probe_io_uring("import os, signal\nos.kill(os.getpid(), signal.SIGILL)")
    assert not result.ok
    assert "killed by signal SIGILL" in result.reason


def test_probe_reports_the_childs_reason_and_timeouts() -> None:
    refused = probe_io_uring("import sys\nsys.exit('EPERM: io_uring_setup blocked by seccomp')")
    assert refused == type(refused)(False, "EPERM: io_uring_setup blocked by seccomp")
    slow = probe_io_uring("import time\ntime.sleep(30)", timeout=0.5)
    assert not slow.ok
    assert "timed out" in slow.reason
    assert probe_io_uring("pass").ok


# --- buffer pool -----------------------------------------------------------------------------------


def test_buffer_pool_rounds_to_pages_and_blocks_until_release() -> None:
    async def main() -> None:
        pool = BufferPool(4 * ALIGN)
        a = await pool.acquire(1)
        b = await pool.acquire(ALIGN + 1)
        assert (len(a), len(b)) == (ALIGN, 2 * ALIGN)
        c = await pool.acquire(ALIGN)
        assert pool.used == pool.capacity == 4 * ALIGN
        waiter = asyncio.create_task(pool.acquire(2 * ALIGN))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done() and pool.waiting == 1  # full: waits, never allocates more
        pool.release(a)  # page 0
        await asyncio.sleep(0)
        assert not waiter.done()  # one free page is not enough
        pool.release(b)  # pages 1-2, coalesced with page 0
        d = await asyncio.wait_for(waiter, 1)
        assert len(d) == 2 * ALIGN and address_of(d) % ALIGN == 0
        assert pool.peak_used <= pool.capacity
        pool.release(c)
        pool.release(d)
        assert pool.used == 0
        whole = await pool.acquire(pool.capacity)  # everything coalesced back into one run
        pool.release(whole)
        pool.close()

    asyncio.run(main())


def test_buffer_pool_fifo_and_cancelled_waiters() -> None:
    async def main() -> None:
        pool = BufferPool(4 * ALIGN)
        held = [await pool.acquire(ALIGN) for _ in range(4)]
        big = asyncio.create_task(pool.acquire(3 * ALIGN))
        small = asyncio.create_task(pool.acquire(ALIGN))
        await asyncio.sleep(0)
        pool.release(held.pop())
        await asyncio.sleep(0)
        assert not small.done()  # FIFO: the big request at the head is not overtaken
        big.cancel()
        view = await asyncio.wait_for(small, 1)  # cancelling the head lets the next one through
        assert pool.waiting == 0
        for v in [*held, view]:
            pool.release(v)
        assert pool.used == 0
        pool.close()

    asyncio.run(main())


def test_buffer_pool_never_exceeds_capacity_or_overlaps_under_load() -> None:
    async def main() -> None:
        pool = BufferPool(64 * ALIGN)
        rng = random.Random(7)

        async def user(tag: int) -> None:
            view = await pool.acquire(rng.randint(1, 16 * ALIGN))
            assert pool.used <= pool.capacity
            view[:] = bytes([tag]) * len(view)
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            assert view.tobytes() == bytes([tag]) * len(view)  # nobody else was handed these pages
            pool.release(view)

        await asyncio.gather(*(user(i % 256) for i in range(400)))
        assert pool.used == 0
        assert pool.peak_used <= pool.capacity
        pool.close()

    asyncio.run(main())


def test_buffer_pool_rejects_misuse() -> None:
    async def main() -> None:
        pool = BufferPool(2 * ALIGN)
        with pytest.raises(ValueError, match="exceeds the whole buffer pool"):
            await pool.acquire(2 * ALIGN + 1)
        with pytest.raises(ValueError):
            await pool.acquire(0)
        view = await pool.acquire(10)
        with pytest.raises(ValueError, match="not a buffer leased"):
            pool.release(memoryview(bytearray(ALIGN)))
        with pytest.raises(RuntimeError, match="still leased"):
            pool.close()
        pool.release(view)
        with pytest.raises(ValueError):
            view[0]  # released: no use after free
        with pytest.raises(ValueError, match="not a buffer leased"):
            pool.release(view)
        pool.close()
        pool.close()

    asyncio.run(main())
