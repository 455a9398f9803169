"""The SSD tier's write path: a batch of offloads written as a few large aligned writes.

The tier worker hands `GroupWriter.write` the OFFLOAD tasks of one poll. Each record gets its
room from `BucketStore.reserve` (contiguous, 4096-aligned, in the open bucket), is copied into a
staging buffer laid out exactly as the file (header, payload, zero padding to 4096), and its CRC32C
is computed over the copied bytes (copy first, then check: the source is shared memory a client may
still write, and what is checked must be what is written). A record whose copy does not match the
object's checksum is taken back out of the buffer (`release_last`) and fails alone. A full staging
buffer is written with one pwritev at its file offset by a small fixed pool of writer threads (the
GIL is released during the write, so the worker copies the next records meanwhile: several writes
in flight, the copy overlapping the disk). Writes go through an O_DIRECT fd where the file system
takes it (no page-cache copy, no writeback storm), buffered otherwise.

At the end of the batch (or when the bucket must roll) the writer waits for every write and
`commit`s: the records wholly before the first failed write become records of the bucket, the
rest fail (their tasks get the error) and the file is cut back after the last good record, so a
failed write leaves nothing that recovery would take as live. The caller then `sync`s once
(fdatasync: group commit) before reporting any location.

Bounded: `buffer_bytes` of staging buffers (mapped once, reused) and `threads` writer threads, both
constants of the config; a record larger than one buffer streams through several.
"""

from __future__ import annotations

import errno
import logging
import mmap
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import crc32c

from kvtier.segment_server.bucket_format import ALIGN, RecordError, Slot
from kvtier.segment_server.buckets import BucketStore, DiskFull, pwrite_all

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = 4 << 20  # one write; dd oflag=direct on the reference disk peaks at 4 MiB blocks
DEFAULT_THREADS = 4
_ZEROS = bytes(ALIGN)


@dataclass(slots=True, frozen=True)
class OffloadItem:
    """One record to write: the DRAM bytes of an object and the checksum they must have."""

    namespace: str
    key: str
    payload: memoryview | bytes
    checksum: int
    group: tuple[int, int] = (0, 0)  # (group id, member count) its commit named, kept in its record header


Outcome = int | Exception  # a location, or why the record was not written (RecordError, DiskFull, OSError, ...)


@dataclass(slots=True, eq=False)
class _Write:
    buffer: memoryview  # of one of the writer's mappings
    offset: int  # file offset of buffer[0]
    length: int = 0  # bytes staged (a multiple of 4096 once a record is complete)
    future: Future[None] | None = None


class GroupWriter:
    """Writes batches of records into a BucketStore; one caller thread (the tier worker)."""

    def __init__(
        self,
        store: BucketStore,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        threads: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        if buffer_bytes < 2 * chunk_bytes:
            raise ValueError(f"buffer_bytes must hold at least two {chunk_bytes}-byte buffers, got {buffer_bytes}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._store = store
        self._chunk = chunk_bytes
        # Anonymous mappings: page-aligned, as O_DIRECT needs. Touched once so no write waits on faults.
        self._maps = [mmap.mmap(-1, chunk_bytes) for _ in range(buffer_bytes // chunk_bytes)]
        for mapping in self._maps:
            mapping.write(bytes(chunk_bytes))
        self._views = [memoryview(mapping) for mapping in self._maps]
        self._free: list[memoryview] = list(self._views)
        # Started now, all of them: the segment's thread count is a constant of its config.
        self._jobs: queue.SimpleQueue[tuple[_Write, int, bool] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._writer_loop, name=f"kvtier-ssd-write-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        self._writes: deque[_Write] = deque()  # submitted, oldest first
        self._failed_at: int | None = None  # file offset of the first failed write of this run
        self._failure: Exception | None = None
        self.writes = 0  # pwritev calls (for tests and metrics: bytes per write)
        # Called with each record's file span before it is staged (kvtier.segment_server.write_limit).
        self.pace: Callable[[int], None] | None = None

    def close(self) -> None:
        """Stop the writer threads (after the writes queued) and unmap the buffers. Safe to call twice."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        for view in self._views:
            view.release()
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # a slice still referenced (a traceback): unmapped when it goes
                pass
        self._maps, self._views, self._free = [], [], []

    # ------------------------------------------------------------------ one batch

    def write(self, items: Sequence[OffloadItem], on_full: Callable[[], bool] | None = None) -> list[Outcome]:
        """Write the records; each outcome is its location (durable after the caller's `sync`) or the
        error that kept it out. `on_full()` is called at most once when the store is full; True means it
        freed space (the record is tried again)."""
        out: list[Outcome] = [RuntimeError("not written")] * len(items)
        run: list[tuple[int, Slot, bool]] = []  # (item index, slot, payload matched) in slot order
        try:
            self._write(items, on_full, out, run)
        except BaseException:
            # Unexpected (a bug, or MemoryError): leave the store with nothing reserved, the file cut back.
            while self._writes:
                self._reap(self._writes.popleft())
            self._free = list(self._views)  # nothing in flight: every buffer is free, the staging one too
            self._failed_at = self._failure = None
            self._store.commit(0, [])
            raise
        return out

    def _write(
        self,
        items: Sequence[OffloadItem],
        on_full: Callable[[], bool] | None,
        out: list[Outcome],
        run: list[tuple[int, Slot, bool]],
    ) -> None:
        staging: _Write | None = None
        asked_for_room = False
        for index, item in enumerate(items):
            payload = _bytes_of(item.payload)
            size = len(payload)
            try:
                slot = self._store.reserve(item.namespace, item.key, size, item.checksum, item.group)
                if slot is None:  # the bucket rolls: its records are written and committed first
                    staging = self._finish_run(run, staging, out)
                    slot = self._store.reserve(item.namespace, item.key, size, item.checksum, item.group)
            except DiskFull as exc:
                staging = self._finish_run(run, staging, out)
                if asked_for_room or on_full is None or not self._make_room(on_full):
                    out[index] = exc
                    continue
                asked_for_room = True
                try:
                    slot = self._store.reserve(item.namespace, item.key, size, item.checksum, item.group)
                except (OSError, ValueError) as retry_exc:
                    out[index] = retry_exc
                    continue
            except (OSError, ValueError) as exc:
                out[index] = exc
                continue
            assert slot is not None
            if self.pace is not None:  # --ssd-write-limit: paced before staging, so a waiting record holds no buffer
                self.pace(slot.span)
            if staging is None:
                staging = self._buffer(slot.offset)
            assert staging.offset + staging.length == slot.offset, "slots are contiguous within a run"
            staging, crc, pieces = self._stage(staging, slot, payload)
            if crc == item.checksum:
                run.append((index, slot, True))
            elif pieces == 1:  # still only in the staging buffer: take it back out, nothing written
                staging.length = slot.offset - staging.offset
                self._store.release_last()
                out[index] = _mismatch(crc, item)
            else:  # already partly submitted: stays a dead record (its payload fails its header's CRC)
                run.append((index, slot, False))
                out[index] = _mismatch(crc, item)
        self._finish_run(run, staging, out)

    @staticmethod
    def _make_room(on_full: Callable[[], bool]) -> bool:
        try:
            return on_full()
        except Exception:  # e.g. the master unreachable: the records that do not fit fail, the rest report
            logger.exception("could not make room on the SSD tier")
            return False

    def _stage(self, staging: _Write, slot: Slot, payload: memoryview | bytes) -> tuple[_Write, int, int]:
        """Copy header + payload + padding into staging buffers (submitting each one that fills) and
        return the current buffer, the payload's CRC32C over the copied bytes, and how many buffers
        the record touched."""
        header = slot.header
        start = staging.length
        if start + slot.span <= self._chunk:  # the common case: the whole record fits in this buffer
            buffer, body = staging.buffer, start + len(header)
            buffer[start:body] = header
            target = buffer[body : body + slot.size]
            target[:] = payload
            crc = crc32c.crc32c(target)  # of the copy: exactly the bytes that are written
            end = start + slot.span
            buffer[body + slot.size : end] = _ZEROS[: end - body - slot.size]
            staging.length = end
            return staging, crc, 1
        view = memoryview(payload)
        crc = 0
        pieces = 1
        staging, pieces = self._put(staging, header, pieces)
        done = 0
        while done < len(view):
            if staging.length == self._chunk:
                self._submit(staging)
                staging = self._buffer(staging.offset + self._chunk)
                pieces += 1
            n = min(len(view) - done, self._chunk - staging.length)
            target = staging.buffer[staging.length : staging.length + n]
            target[:] = view[done : done + n]
            crc = crc32c.crc32c(target, value=crc)  # of the copy: exactly the bytes that are written
            staging.length += n
            done += n
        pad = slot.offset + slot.span - (staging.offset + staging.length)
        if pad:
            staging, pieces = self._put(staging, _ZEROS[:pad], pieces)
        return staging, crc, pieces

    def _put(self, staging: _Write, data: bytes, pieces: int) -> tuple[_Write, int]:
        done = 0
        while done < len(data):
            if staging.length == self._chunk:
                self._submit(staging)
                staging = self._buffer(staging.offset + self._chunk)
                pieces += 1
            n = min(len(data) - done, self._chunk - staging.length)
            staging.buffer[staging.length : staging.length + n] = data[done : done + n]
            staging.length += n
            done += n
        return staging, pieces

    def _buffer(self, offset: int) -> _Write:
        """A free staging buffer for file offset `offset`; waits for the oldest write when none is free."""
        while not self._free:
            self._reap(self._writes.popleft())
        return _Write(self._free.pop(), offset)

    def _submit(self, write: _Write) -> None:
        try:
            fd, direct = self._store.group_fd()
        except OSError as exc:  # e.g. EMFILE: this write fails, like one the disk refused
            write.future = Future()
            write.future.set_exception(exc)
        else:
            write.future = Future()
            self._jobs.put((write, fd, direct))
            self.writes += 1
        self._writes.append(write)

    def _writer_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            write, fd, direct = job
            assert write.future is not None
            try:
                self._pwrite(write, fd, direct)
            except BaseException as exc:  # handed to the tier worker, which fails the records
                write.future.set_exception(exc)
            else:
                write.future.set_result(None)

    def _pwrite(self, write: _Write, fd: int, direct: bool) -> None:
        """Runs on a writer thread; the GIL is released inside pwritev."""
        view = write.buffer[: write.length]
        try:
            try:
                pwrite_all(fd, [view], write.offset)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                # The file system refused O_DIRECT here: this and later writes go buffered (the whole
                # buffer again: whatever part went through is the same bytes at the same offsets).
                self._store.direct_writes_refused()
                pwrite_all(self._store.buffered_fd(), [view], write.offset)
        finally:
            view.release()

    def _reap(self, write: _Write) -> None:
        """Wait for a submitted write, note its failure, and return its buffer to the pool."""
        assert write.future is not None
        try:
            write.future.result()
        except Exception as exc:
            if self._failed_at is None or write.offset < self._failed_at:
                self._failed_at, self._failure = write.offset, exc
        self._free.append(write.buffer)

    def _finish_run(self, run: list[tuple[int, Slot, bool]], staging: _Write | None, out: list[Outcome]) -> None:
        """Write what is staged, wait for every write, commit the records wholly before the first failed
        write and fail the others (the store cuts the file back). Returns None (no staging buffer)."""
        if staging is not None:
            if staging.length:
                self._submit(staging)
            else:
                self._free.append(staging.buffer)
        while self._writes:
            self._reap(self._writes.popleft())
        failed_at, failure = self._failed_at, self._failure
        self._failed_at = self._failure = None
        written = len(run)
        if failed_at is not None:
            written = next((i for i, (_, slot, _) in enumerate(run) if slot.offset + slot.span > failed_at), len(run))
        self._store.commit(written, [alive for _, _, alive in run[:written]])
        for i, (index, slot, alive) in enumerate(run):
            if i >= written:
                out[index] = _disk_error(failure)
            elif alive:
                out[index] = slot.location
        run.clear()
        return None


def _bytes_of(payload: memoryview | bytes) -> memoryview | bytes:
    """The payload as a flat byte sequence (len = bytes), whatever the buffer's item format."""
    if isinstance(payload, memoryview) and (payload.format != "B" or payload.ndim != 1):
        return payload.cast("B")
    return payload


def _mismatch(crc: int, item: OffloadItem) -> RecordError:
    return RecordError(f"payload CRC32C {crc:#010x} != expected {item.checksum:#010x} key={item.key:.80}")


def _disk_error(exc: Exception | None) -> Exception:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, DiskFull):
        return DiskFull(f"writing a bucket: {exc.strerror}")
    return exc if exc is not None else OSError(errno.EIO, "write failed")
