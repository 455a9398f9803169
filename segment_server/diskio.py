"""Bounded disk I/O for bucket files: one `DiskEngine` protocol, an io_uring and a thread-pool engine.
Choosing one at start: kvtier.segment_server.diskio_probe (`open_engine`); aligned read buffers:
kvtier.segment_server.buffer_pool (`BufferPool`).

Why bounded: the event loop must never block on the disk, and the resources a read needs must not
grow with request shape (keys x batch x concurrency x retries). A thread-per-I/O design hit the
cgroup pids limit in the field. So every engine has

- a fixed queue depth: at most `queue_depth` I/Os in flight; further calls wait on an
  `asyncio.Semaphore` (backpressure, never a growing queue of threads or syscalls);
- a fixed set of OS threads, decided at construction:
  - `ThreadPoolEngine`: exactly `threads` workers, all spawned in the constructor;
  - `IoUringEngine`: no userspace thread at all. Submissions and completions both run on the event
    loop thread: the ring signals an eventfd, `loop.add_reader` reaps with `io_uring_peek_cqe`.
    The kernel still runs what it cannot complete inline (fsync, some buffered writes and cache
    misses, and I/Os above `inline_max`, see `IoUringEngine`) on io-wq worker threads
    (`iou-wrk-<pid>`), which appear in /proc/self/status `Threads` and count against the pids
    cgroup. By default the kernel allows min(entries, 4 x CPUs) workers
    in its bounded pool and RLIMIT_NPROC in its unbounded pool, and this engine uses both: a request
    punted with IOSQE_ASYNC has no file resolved yet, so reads and writes land in the unbounded
    pool, while fsync and requests that first tried inline land in the bounded one. The engine caps
    them with IORING_REGISTER_IOWQ_MAX_WORKERS so the two add up to `kernel_workers`. The cap
    belongs to the submitting thread and is shared by every ring that thread uses: the last engine
    opened on a loop sets it. Idle workers linger for a few seconds after their last request.

liburing binding notes (liburing==2024.5.3, a Cython wrapper):
- `io_uring_prep_read(sqe, fd, buf, nbytes, offset)` takes `buf` as a typed `unsigned char[:]`:
  any writable buffer of format "B" works, including a `memoryview` slice of an `mmap.mmap`, which
  is what O_DIRECT needs (page-aligned). A read-only buffer raises BufferError; a buffer of another
  format raises ValueError, so views are `cast("B")` first. The typed memoryview is *strided*: a
  non-contiguous slice (`mv[::2]`) is accepted and the kernel would write past it, so
  `_byte_view` rejects non-contiguous buffers. `io_uring_prep_write` takes `const unsigned char[:]`,
  so `bytes` work too. The binding keeps no reference to the buffer: this module holds one in
  `_pending` until the completion is reaped, and an mmap with a live export cannot be closed.
- `io_uring_wait_cqe` is declared `nogil` but does not release the GIL when called from Python, so
  a blocking wait would freeze every thread; the eventfd design never waits in the kernel.
- Constants such as `IORING_FSYNC_DATASYNC` and `IOSQE_ASYNC` live in per-module enums
  (`liburing.common.__common_define__`, `liburing.queue.__queue_define__`), not at the top level.
- `io_uring_register_iowq_max_workers` passes the address of one `unsigned int` where the kernel
  reads and writes back two, so the cap is set with a direct io_uring_register(2) call instead.

Threading: an engine belongs to one event loop; call its coroutines and `close()` from that loop's
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import importlib
import importlib.util
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

logger = logging.getLogger(__name__)

ALIGN = 4096  # BufferPool granule and O_DIRECT alignment
MAX_QUEUE_DEPTH = 4096
_MAX_IO = 1 << 30  # one SQE / syscall moves at most this much (the SQE length field is 32-bit)
_CLOSE_DRAIN_SECONDS = 10.0
_SYS_IO_URING_REGISTER = 427  # the same number on every Linux architecture (added in 5.1)
_IORING_REGISTER_IOWQ_MAX_WORKERS = 19  # Linux 5.15+
# <linux/io_uring.h> values, used if the binding does not expose them (they are stable UAPI)
_IORING_FSYNC_DATASYNC = 1
_IOSQE_ASYNC = 1 << 4
_TRANSIENT_SUBMIT_ERRNOS = (errno.EINTR, errno.EAGAIN, errno.EBUSY)

Buffer = memoryview | bytes | bytearray | mmap.mmap

# Buffers of I/Os still owned by a ring that close() had to give up on: kept alive for the life of
# the process so the kernel can never write into memory Python has reused.
_ABANDONED: list[object] = []


class DiskEngine(Protocol):
    """Positional I/O on file descriptors, off the event loop, with bounded resources.

    All coroutines raise `OSError` with the kernel's errno on I/O errors (EBADF for a bad fd, ...),
    `ValueError` for bad arguments (negative offset, non-contiguous or read-only read buffer) and
    `RuntimeError` once the engine is closed. A cancelled call still waits for its I/O to finish
    before `CancelledError` propagates, because until then the kernel or a worker thread owns the
    caller's buffer.
    """

    name: str  # "io_uring" or "threads"
    queue_depth: int  # max I/Os in flight; further calls wait
    threads: int  # userspace OS threads this engine owns (fixed at construction)
    kernel_workers: int  # cap on kernel io-wq threads this engine's I/O may add (0: none)

    @property
    def in_flight(self) -> int:
        """I/Os admitted and not yet completed; never exceeds `queue_depth`."""
        ...

    @property
    def peak_in_flight(self) -> int:
        """High-water mark of `in_flight` since construction."""
        ...

    async def read_at(self, fd: int, offset: int, buf: memoryview) -> int:
        """Read into `buf` from `offset`; returns the byte count (short only at EOF for the thread
        engine; io_uring returns what the kernel returned, see `read_fully`)."""
        ...

    async def write_at(self, fd: int, offset: int, data: memoryview | bytes) -> int:
        """Write all of `data` at `offset`; returns len(data) or raises."""
        ...

    async def sync(self, fd: int) -> None:
        """fdatasync(fd)."""
        ...

    def close(self) -> None:
        """Finish or abandon in-flight I/O and release the engine's resources. Idempotent."""
        ...


async def read_fully(engine: DiskEngine, fd: int, offset: int, buf: Buffer) -> int:
    """Read until `buf` is full or EOF; returns the byte count. Safe for O_DIRECT fds with aligned
    `offset`/`buf`: the kernel answers 0 (not EINVAL) to an unaligned read at or past EOF."""
    view = _byte_view(buf, writable=True)
    done = 0
    while done < len(view):
        n = await engine.read_at(fd, offset + done, view[done:])
        if n == 0:
            break
        done += n
    return done


def _byte_view(buf: Buffer, *, writable: bool) -> memoryview:
    """A flat, C-contiguous, format "B" view of `buf` (what liburing's `unsigned char[:]` needs)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("I/O buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read buffers must be writable")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise ValueError(f"negative file offset {offset}")


async def _settle(fut: asyncio.Future[int], on_cancel: Callable[[asyncio.Future[int]], None] | None = None) -> int:
    """Await `fut`, outliving cancellation: the I/O owns the caller's buffer until it completes, so
    a cancelled caller asks the engine to cancel the I/O (`on_cancel`, best effort), waits for it
    to finish either way, and only then re-raises CancelledError."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError as exc:
        cancelled = exc
    if on_cancel is not None and not fut.done():
        on_cancel(fut)
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((fut,))
    if not fut.cancelled():
        fut.exception()  # retrieved: the caller asked to stop caring about the outcome
    raise cancelled


class _Bounded:
    """The queue-depth gate and in-flight accounting shared by both engines."""

    name: str
    _on_cancel: Callable[[asyncio.Future[int]], None] | None = None

    def __init__(self, queue_depth: int) -> None:
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, got {queue_depth}")
        self.queue_depth = queue_depth
        self._slots = asyncio.Semaphore(queue_depth)
        self._in_flight = 0
        self._peak = 0
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def peak_in_flight(self) -> int:
        return self._peak

    @property
    def closed(self) -> bool:
        return self._closed

    async def _bounded(self, start: Callable[..., asyncio.Future[int]], *args: Any) -> int:
        """Wait for a slot, start one I/O with `start(*args)` and await its result."""
        async with self._slots:
            if self._closed:
                raise RuntimeError(f"{self.name} disk engine is closed")
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            try:
                return await _settle(start(*args), self._on_cancel)
            finally:
                self._in_flight -= 1


# --- thread pool ---------------------------------------------------------------------------------


# The buffer travels in a one-element list that the worker empties: the executor's work item keeps
# its arguments until after the caller has resumed, and a view still referenced there would keep the
# caller's mmap exported (BufferPool.close() would fail) for no reason.


def _pread_full(fd: int, offset: int, box: list[memoryview]) -> int:
    view = box.pop()
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + _MAX_IO]], offset + done)
            if n == 0:
                break
            done += n
        return done
    finally:
        del view  # not even an exception's traceback may keep it


def _pwrite_full(fd: int, offset: int, box: list[memoryview]) -> int:
    view = box.pop()
    try:
        done = 0
        while done < len(view):
            n = os.pwritev(fd, [view[done : done + _MAX_IO]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"pwrite made no progress at offset {offset + done}")
            done += n
        return done
    finally:
        del view


def _fdatasync(fd: int) -> int:
    os.fdatasync(fd)
    return 0


class ThreadPoolEngine(_Bounded):
    """preadv/pwritev/fdatasync on a fixed pool of `threads` workers, all spawned by the constructor.

    Reads loop until the buffer is full or EOF, writes until all data is written. Up to
    `queue_depth` I/Os are admitted; those beyond `threads` wait in the executor's queue. Can be
    constructed outside a running loop; use it from one loop.
    """

    name = "threads"
    kernel_workers = 0

    def __init__(self, *, queue_depth: int = 32, threads: int = 4) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        super().__init__(queue_depth)
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-diskio")
        self._prespawn()

    def _prespawn(self) -> None:
        # The executor spawns lazily, one worker per submit while none is idle: make every worker
        # busy at once so all of them exist now and the thread count never changes afterwards.
        barrier = threading.Barrier(self.threads)
        futures = [self._executor.submit(barrier.wait, 30.0) for _ in range(self.threads)]
        for future in futures:
            future.result()

    def _start(self, fn: Callable[..., int], *args: Any) -> asyncio.Future[int]:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def read_at(self, fd: int, offset: int, buf: Buffer) -> int:
        view = _byte_view(buf, writable=True)
        _check_offset(offset)
        if not view:
            return 0
        return await self._bounded(self._start, _pread_full, fd, offset, [view])

    async def write_at(self, fd: int, offset: int, data: Buffer) -> int:
        view = _byte_view(data, writable=False)
        _check_offset(offset)
        if not view:
            return 0
        return await self._bounded(self._start, _pwrite_full, fd, offset, [view])

    async def sync(self, fd: int) -> None:
        await self._bounded(self._start, _fdatasync, fd)

    def close(self) -> None:
        """Blocks until I/O already handed to the workers finishes, then joins them."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=False)


# --- io_uring --------------------------------------------------------------------------------------


def _liburing() -> Any:
    """liburing, imported on first use only: open_engine() runs it in a child process first."""
    import liburing

    return liburing


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _cap_io_workers(ring_fd: int, bounded: int, unbounded: int) -> None:
    """IORING_REGISTER_IOWQ_MAX_WORKERS via io_uring_register(2) (see module docstring for why)."""
    counts = (ctypes.c_uint * 2)(bounded, unbounded)
    rc = _libc().syscall(
        ctypes.c_long(_SYS_IO_URING_REGISTER),
        ctypes.c_int(ring_fd),
        ctypes.c_uint(_IORING_REGISTER_IOWQ_MAX_WORKERS),
        counts,
        ctypes.c_uint(2),
    )
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot cap io_uring kernel workers: {os.strerror(err)}")


class IoUringEngine(_Bounded):
    """io_uring without any userspace thread: the loop thread submits and reaps.

    Each call prepares one SQE; submissions made in the same loop iteration go to the kernel in one
    `io_uring_submit` (scheduled with `call_soon`), completions already posted are reaped right
    after it, the rest when the ring's eventfd becomes readable. At most `queue_depth` I/Os are
    admitted and the ring has 2 x `queue_depth` SQ entries (one spare per I/O for a cancellation),
    so the SQ can never be full and the CQ (twice the SQ) can never overflow.

    Inline work: io_uring_submit runs each request as far as it can without blocking, on the
    calling thread, and the binding keeps the GIL held meanwhile. A read served from the page cache
    is therefore copied on the loop thread inside the submit: measured 5 ms for 32 x 1 MiB. I/Os
    larger than `inline_max` bytes are flagged IOSQE_ASYNC, which hands them straight to the
    (capped) kernel workers, so a submission never copies more than `inline_max` per I/O on the
    loop; smaller ones stay inline, where a cached 4 KiB read costs about a microsecond. fsync is
    always done by a kernel worker.

    Cancelling a caller submits IORING_OP_ASYNC_CANCEL for its request and still waits for the
    request's completion before CancelledError propagates: prompt for a pollable fd, and for disk
    I/O the kernel finishes (or drops, if not started) the request first.

    `read_at` returns what the kernel returned (use `read_fully` to loop); `write_at` loops until
    all data is written. Must be constructed with a running loop, or given `loop`. Importing
    liburing may kill the process on an unsuitable CPU: construct through `open_engine`.

    Submission errors: EINTR/EAGAIN/EBUSY are retried after 1 ms; any other error means the ring
    itself is unusable. SQEs already on the ring cannot be taken back, so it is logged and retried
    every 100 ms rather than failing the callers while the kernel may still own their buffers.
    """

    name = "io_uring"
    threads = 0

    def __init__(
        self,
        *,
        queue_depth: int = 32,
        kernel_workers: int = 4,
        inline_max: int = 64 * 1024,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if kernel_workers < 2:
            raise ValueError(f"kernel_workers must be >= 2 (one per io-wq pool), got {kernel_workers}")
        liburing = _liburing()
        super().__init__(queue_depth)
        self.kernel_workers = kernel_workers
        self.inline_max = inline_max
        self._lib = liburing
        self._loop = loop or asyncio.get_running_loop()
        self._datasync = _binding_constant(liburing, "common", "IORING_FSYNC_DATASYNC", _IORING_FSYNC_DATASYNC)
        self._async = _binding_constant(liburing, "queue", "IOSQE_ASYNC", _IOSQE_ASYNC)
        self._ring = liburing.io_uring()
        self._cqe = liburing.io_uring_cqe()
        # user_data -> (future, buffer the kernel may be using): the reference keeps the memory alive.
        self._pending: dict[int, tuple[asyncio.Future[int], object]] = {}
        self._ids = itertools.count(1)  # user_data 0 is refused by the binding
        self._flush_scheduled = False
        self._efd = -1
        self._ring_open = False
        # Room for one ASYNC_CANCEL per admitted I/O: the SQ can never be full.
        liburing.io_uring_queue_init(2 * queue_depth, self._ring, 0)  # raises OSError (EPERM, ENOMEM, ...)
        self._ring_open = True
        try:
            unbounded = kernel_workers // 2
            _cap_io_workers(self._ring.ring_fd, kernel_workers - unbounded, unbounded)
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            liburing.io_uring_register_eventfd(self._ring, self._efd)
            self._loop.add_reader(self._efd, self._on_eventfd)
        except BaseException:
            self._release_ring()
            raise

    async def read_at(self, fd: int, offset: int, buf: Buffer) -> int:
        view = _byte_view(buf, writable=True)
        _check_offset(offset)
        if not view:
            return 0
        view = view[:_MAX_IO]
        prep, flags = self._lib.io_uring_prep_read, self._sqe_flags(len(view), fd)
        return self._check(await self._bounded(self._start, prep, flags, view, fd, view, len(view), offset))

    async def write_at(self, fd: int, offset: int, data: Buffer) -> int:
        view = _byte_view(data, writable=False)
        _check_offset(offset)
        done = 0
        while done < len(view):
            chunk = view[done : done + _MAX_IO]
            prep, flags = self._lib.io_uring_prep_write, self._sqe_flags(len(chunk), fd)
            n = self._check(await self._bounded(self._start, prep, flags, chunk, fd, chunk, len(chunk), offset + done))
            if n == 0:
                raise OSError(errno.EIO, f"write made no progress at offset {offset + done}")
            done += n
        return done

    async def sync(self, fd: int) -> None:
        self._check(await self._bounded(self._start, self._lib.io_uring_prep_fsync, 0, None, fd, self._datasync))

    def _sqe_flags(self, nbytes: int, fd: int) -> int:
        """IOSQE_ASYNC for large buffered I/O (a page-cache copy would run on the loop thread).

        O_DIRECT I/O is submitted inline: the block layer queues it without copying or
        blocking, and punting it to the workers would cap its queue depth at their number.
        """
        if nbytes <= self.inline_max:
            return 0
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                return 0
        except OSError:
            pass  # a bad fd: let the kernel report it
        return self._async

    @staticmethod
    def _check(res: int) -> int:
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return res

    def _start(self, prep: Callable[..., None], flags: int, keep: object, *args: Any) -> asyncio.Future[int]:
        sqe = self._lib.io_uring_get_sqe(self._ring)
        if not sqe:  # cannot happen: 2 x queue_depth entries >= admitted I/Os + their cancellations
            raise RuntimeError("io_uring submission queue is full")
        prep(sqe, *args)  # liburing's prep helpers reset the whole SQE, flags included
        if flags:
            sqe.flags = flags
        user_data = next(self._ids)
        sqe.user_data = user_data
        fut = self._loop.create_future()
        self._pending[user_data] = (fut, keep)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return fut

    def _on_cancel(self, fut: asyncio.Future[int]) -> None:
        # IORING_OP_ASYNC_CANCEL: prompt for requests parked on a pollable fd (pipe, socket); for disk
        # I/O already running it fails with EALREADY and the original completes normally. Either
        # way the original's CQE still arrives, and the caller waits for it.
        user_data = next((ud for ud, (f, _) in self._pending.items() if f is fut), None)
        if user_data is None or not self._ring_open:
            return
        sqe = self._lib.io_uring_get_sqe(self._ring)
        if not sqe:  # no room: skip the best-effort cancel, the I/O completes on its own
            return
        self._lib.io_uring_prep_cancel64(sqe, user_data, 0)
        sqe.user_data = next(self._ids)  # its CQE matches nothing in _pending and is dropped
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._ring_open:
            return
        try:
            self._lib.io_uring_submit(self._ring)
        except OSError as exc:
            delay = 0.001 if exc.errno in _TRANSIENT_SUBMIT_ERRNOS else 0.1
            if delay > 0.001:
                logger.error("io_uring submit failed errno=%s error=%s pending=%d", exc.errno, exc, len(self._pending))
            self._flush_scheduled = True
            self._loop.call_later(delay, self._flush)
        self._reap()

    def _on_eventfd(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        self._reap()

    def _reap(self) -> None:
        lib, ring, cqe, pending = self._lib, self._ring, self._cqe, self._pending
        while lib.io_uring_peek_cqe(ring, cqe) == 0:
            res, user_data = cqe.res, cqe.user_data
            lib.io_uring_cqe_seen(ring, cqe)
            entry = pending.pop(user_data, None)
            if entry is not None and not entry[0].done():
                entry[0].set_result(res)

    def close(self) -> None:
        """Cancel what the kernel can cancel, wait (up to 10 s, blocking the loop) for the rest of
        the I/O in flight, then tear the ring down. Callers of cancelled I/O get OSError(ECANCELED).

        I/O still running after that is abandoned: its callers get RuntimeError and its buffers
        stay referenced for the life of the process, since the kernel may still write into them.
        """
        if not self._ring_open:
            return
        self._closed = True
        for fut, _ in list(self._pending.values()):
            self._on_cancel(fut)
        deadline = time.monotonic() + _CLOSE_DRAIN_SECONDS
        while self._pending and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                self._lib.io_uring_submit(self._ring)
            self._reap()
            if self._pending:
                time.sleep(0.0005)  # poll: a blocking wait_cqe would hold the GIL
        if self._pending:
            logger.error("io_uring closed with I/O in flight abandoned=%d", len(self._pending))
            for fut, keep in self._pending.values():
                _ABANDONED.append(keep)
                if not fut.done():
                    fut.set_exception(RuntimeError("io_uring engine closed with this I/O in flight"))
            self._pending.clear()
        self._release_ring()

    def _release_ring(self) -> None:
        if self._efd >= 0:
            with contextlib.suppress(RuntimeError):  # the loop may already be closed
                self._loop.remove_reader(self._efd)
        if self._ring_open:
            self._ring_open = False
            self._lib.io_uring_queue_exit(self._ring)  # also drops the eventfd registration
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1


def _binding_constant(liburing: Any, module: str, name: str, default: int) -> int:
    """A constant from one of the binding's `__<module>_define__` enums (not exported at top level)."""
    try:
        enum = getattr(importlib.import_module(f"{liburing.__name__}.{module}"), f"__{module}_define__")
        return int(getattr(enum, name))
    except (ImportError, AttributeError):
        return default
