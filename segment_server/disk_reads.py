"""Serving READ_DISK: objects of the SSD tier, read, checked and streamed in request order.

For each requested (location, size, namespace, key): pin the record's bucket
(so it is not unlinked under the read), read header and payload with one
aligned read into a buffer of the bounded `BufferPool`, check the header
names the object asked for (`BucketStore.payload_of`), and queue the payload.
The payload's CRC32C is checked by the client against the master's
checksum, as for DRAM reads: anything that cannot be verified is a miss.

Bounds: at most `window` records of one request are read ahead of the one
being sent, the engine caps I/Os in flight (its queue depth) and the pool
caps read buffers in bytes. Payloads go to the transport without a copy,
straight from their pool buffers. uvloop keeps a reference to what it could
not send at once, so a buffer goes back to the pool only once the transport
has handed all its bytes to the kernel (counted by stream position), and
at most `_IN_TRANSPORT` bytes wait in the transport (its high-water mark
while a request is served; it resumes writing when empty). Before waiting
for a read that may itself wait for pool space, sending drains first, so
the pool can never be held by bytes nobody will send.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.proto.logs import request_id as current_request_id
from kvtier.proto.status import Status
from kvtier.segment_server.buckets import BucketStore, RecordError
from kvtier.segment_server.diskio import BufferPool, DiskEngine, read_fully

if TYPE_CHECKING:
    from kvtier.segment_server.protocol import DataPlaneStats

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
_ZEROS = memoryview(bytes(1 << 20))
_IN_TRANSPORT = 4 << 20  # bytes queued on a connection before sending waits for the socket


class DiskReader:
    def __init__(
        self, store: BucketStore, engine: DiskEngine, pool: BufferPool, window: int = 4, send_timeout_s: float = 30.0
    ) -> None:
        self.store = store
        self.engine = engine
        self.pool = pool
        self.window = window
        # A client that stops reading holds read buffers: after this long without being able to
        # send, its connection is aborted and the buffers go back to the pool.
        self.send_timeout_s = send_timeout_s

    async def serve(
        self,
        transport: asyncio.Transport,
        writable: asyncio.Event,
        request_id: int,
        ranges: Sequence[int],
        names: list[tuple[str, str]],
        stats: DataPlaneStats,
        trace: int = 0,
    ) -> None:
        """Answer one READ_DISK request on `transport` (see kvtier.proto.frames); `trace` is the
        client's request id, on every line logged for this request (this task's context)."""
        current_request_id.set(trace)
        count = len(names)
        sizes = ranges[1::2]
        reads: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()
        # Stream positions: bytes queued on this transport since we started, counting what was
        # already buffered then. A pool buffer ending at position E is free once the transport
        # has handed E bytes to the kernel: queued - get_write_buffer_size() >= E.
        queued = transport.get_write_buffer_size()
        pending: deque[tuple[int, memoryview]] = deque()  # (end position, pool buffer), in order

        def release_sent() -> None:
            if transport.is_closing():
                return  # the finally below takes everything back
            sent = queued - transport.get_write_buffer_size()
            while pending and pending[0][0] <= sent:
                self.pool.release(pending.popleft()[1])

        async def drain() -> None:
            """Wait until everything queued is in the kernel; give every pending buffer back."""
            _limits(transport, 0)
            await wait_writable()  # also set when the connection is lost
            _limits(transport, _IN_TRANSPORT)
            release_sent()

        async def wait_writable() -> None:
            if writable.is_set():
                return  # the common case: no timer, no task
            try:
                await asyncio.wait_for(writable.wait(), self.send_timeout_s)
            except TimeoutError:
                logger.warning("READ_DISK client stopped reading for %gs: connection aborted", self.send_timeout_s)
                transport.abort()  # connection_lost sets `writable`; is_closing() is now true

        def write(data: bytes | memoryview) -> None:
            nonlocal queued
            transport.write(data)
            queued += len(data)

        _limits(transport, _IN_TRANSPORT)
        try:
            write(frames.pack_response(Op.READ_DISK, request_id, 0, 4 * count + sum(sizes)))
            for i in range(count):
                for ahead in range(i, min(i + self.window, count)):
                    if ahead not in reads:
                        namespace, key = names[ahead]
                        reads[ahead] = loop.create_task(self._read(ranges[2 * ahead], sizes[ahead], namespace, key))
                # The task stays in `reads` until its result is taken: whatever ends this request
                # (a cut-off, a cancellation) leaves the finally below to cancel it or take its buffer.
                task = reads[i]
                if pending and not task.done():
                    await drain()  # the read may be waiting for pool space our unsent buffers hold
                    if transport.is_closing():
                        # Cut off (or lost) while draining: the unsent buffers are not given back
                        # until the finally, so the read may wait for them forever. Stop here.
                        return
                status, payload, buf, disk_bytes = await task
                del reads[i]
                if buf is not None:
                    pending.append((queued + 4 + sizes[i], buf))
                stats.ssd_bytes_read += disk_bytes
                await wait_writable()  # below the high-water mark (set at empty by resume_writing)
                if transport.is_closing():
                    return
                release_sent()
                write(frames.DISK_STATUS.pack(status))
                if status == _OK:
                    write(payload)
                    stats.ssd_bytes_served += sizes[i]
                else:
                    stats.ssd_read_errors += 1
                    left = sizes[i]
                    while left:
                        chunk = min(left, len(_ZEROS))
                        write(_ZEROS[:chunk])
                        left -= chunk
                payload = None
                release_sent()
            if pending:
                await drain()
        finally:
            for task in reads.values():
                task.cancel()
            if reads:  # read-ahead that will not be sent: wait for it, then take its buffers back
                for result in await asyncio.gather(*reads.values(), return_exceptions=True):
                    if isinstance(result, tuple) and result[2] is not None:
                        self.pool.release(result[2])
            # A closed transport sends nothing more: what it still references is never read again.
            while pending:
                self.pool.release(pending.popleft()[1])
            _limits(transport, None)

    async def _read(
        self, location: int, size: int, namespace: str, key: str
    ) -> tuple[int, memoryview | None, memoryview | None, int]:
        """(status, payload, the pool buffer holding it, bytes read from disk) of one record.

        The caller releases the buffer once the payload is sent; on any failure it is already back.
        """
        store = self.store
        try:
            plan = store.pin(location)
        except KeyError:
            return int(Status.NOT_FOUND), None, None, 0
        buf = None
        try:
            if plan.size != size:
                return int(Status.INVALID_RANGE), None, None, 0
            try:
                buf = await self.pool.acquire(plan.read_length)
            except ValueError:  # larger than the whole pool
                return int(Status.TOO_LARGE), None, None, 0
            got = await read_fully(self.engine, plan.fd, plan.file_offset, buf[: plan.read_length])
            if got < plan.header_len + plan.size:
                return int(Status.NOT_FOUND), None, None, got
            try:
                payload = store.payload_of(buf, plan, namespace, key, store.cluster_id)
            except RecordError as exc:
                fields = {"location": hex(location), "key": key[:80], "error": exc}
                logger.warning("disk record refused", extra={"fields": fields})
                return int(Status.CHECKSUM_MISMATCH), None, None, got
            kept, buf = buf, None  # handed to the caller
            return _OK, payload, kept, got
        except OSError as exc:
            logger.warning("disk read failed location=%#x: %s", location, exc)
            return int(Status.TRANSFER_FAILED), None, None, 0
        finally:
            if buf is not None:
                self.pool.release(buf)
            store.unpin(plan)


def _limits(transport: asyncio.Transport, high: int | None) -> None:
    """Set the write buffer's high-water mark (low 0: resume only when empty); None restores the
    defaults. A closed transport refuses the call: nothing to limit any more."""
    if transport.is_closing():
        return
    if high is None:
        transport.set_write_buffer_limits()
    else:
        transport.set_write_buffer_limits(high=high, low=0)
