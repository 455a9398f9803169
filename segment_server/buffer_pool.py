"""Page-aligned read buffers for O_DIRECT, with backpressure: `BufferPool` (used with the disk
engines of kvtier.segment_server.diskio).

Threading: loop-thread only, like the engines.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
from collections import deque

from kvtier.segment_server.diskio import ALIGN


class BufferPool:
    """Page-aligned buffers for O_DIRECT, carved from one anonymous mmap made at construction.

    Memory bound: `capacity` bytes (rounded up to 4 KiB) of address space, mapped once and never
    grown; resident memory grows as pages are first touched, up to that. Bookkeeping is O(leases).
    Allocation is first-fit over a sorted, coalesced list of free page runs; `acquire` rounds up to
    whole pages and returns a view of that rounded size, starting on a page boundary.

    Backpressure: when no free run is large enough, `acquire` waits. Waiters are served strictly in
    FIFO order, so a large request at the head holds back smaller ones behind it and cannot starve;
    a request larger than the whole pool raises ValueError instead of waiting forever.
    Loop-thread only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        pages = -(-capacity // ALIGN)
        self.capacity = pages * ALIGN
        self._map = mmap.mmap(-1, self.capacity)
        self._base: memoryview | None = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, pages)]  # (first page, page count), sorted, coalesced
        self._leases: dict[int, tuple[memoryview, int, int]] = {}  # id(view) -> (view, first page, count)
        self._waiters: deque[tuple[int, asyncio.Future[int]]] = deque()  # (page count, granted first page)
        self._used_pages = 0
        self._peak_pages = 0

    @property
    def used(self) -> int:
        """Bytes leased out now."""
        return self._used_pages * ALIGN

    @property
    def peak_used(self) -> int:
        return self._peak_pages * ALIGN

    @property
    def waiting(self) -> int:
        return sum(1 for _, fut in self._waiters if not fut.done())

    async def acquire(self, nbytes: int) -> memoryview:
        """A writable, page-aligned view of `nbytes` rounded up to 4 KiB; waits while the pool lacks room."""
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        pages = -(-nbytes // ALIGN)
        if pages * ALIGN > self.capacity:
            raise ValueError(f"{nbytes} bytes exceeds the whole buffer pool ({self.capacity} bytes)")
        if self._base is None:
            raise RuntimeError("buffer pool is closed")
        if not self._waiters:
            start = self._take(pages)
            if start is not None:
                return self._lease(start, pages)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = (pages, fut)
        self._waiters.append(waiter)
        try:
            start = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._give_back(fut.result(), pages)  # granted just before the cancellation landed
            else:
                self._waiters.remove(waiter)
                self._grant()  # a smaller request may have been queued behind this one
            raise
        return self._lease(start, pages)

    def release(self, view: memoryview) -> None:
        """Return a buffer from `acquire`. The view is released: later use raises ValueError.

        Raises ValueError for a view this pool did not lease (or already took back) and BufferError,
        freeing nothing, while something still holds an export of the view (e.g. numpy.frombuffer).
        """
        entry = self._leases.get(id(view))
        if entry is None or entry[0] is not view:
            raise ValueError("not a buffer leased from this pool, or already released")
        view.release()
        del self._leases[id(view)]
        self._used_pages -= entry[2]
        self._give_back(entry[1], entry[2])

    def close(self) -> None:
        """Unmap the pool. RuntimeError while buffers are leased, or while views sliced from them
        are still alive. Idempotent."""
        if self._map.closed:
            return
        if self._leases:
            raise RuntimeError(f"buffer pool closed with {len(self._leases)} buffers still leased")
        if self._base is not None:
            self._base.release()
            self._base = None
        try:
            self._map.close()
        except BufferError:
            raise RuntimeError("buffer pool closed while views of its buffers are still alive") from None

    def _lease(self, start: int, pages: int) -> memoryview:
        assert self._base is not None
        view = self._base[start * ALIGN : (start + pages) * ALIGN]
        self._leases[id(view)] = (view, start, pages)
        self._used_pages += pages
        self._peak_pages = max(self._peak_pages, self._used_pages)
        return view

    def _take(self, pages: int) -> int | None:
        for i, (start, count) in enumerate(self._free):
            if count >= pages:
                if count == pages:
                    del self._free[i]
                else:
                    self._free[i] = (start + pages, count - pages)
                return start
        return None

    def _give_back(self, start: int, pages: int) -> None:
        free = self._free
        i = bisect.bisect_left(free, (start, 0))
        end = start + pages
        if i < len(free) and free[i][0] == end:  # merge with the run after
            end += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # merge with the run before
            start = free[i - 1][0]
            i -= 1
            del free[i]
        free.insert(i, (start, end - start))
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            pages, fut = self._waiters[0]
            if fut.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            start = self._take(pages)
            if start is None:
                return
            self._waiters.popleft()
            fut.set_result(start)
