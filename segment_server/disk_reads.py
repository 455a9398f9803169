"""Serving READ_DISK: objects of the SSD tier, read, checked and streamed in request order.

For each requested (location, size, namespace, key): pin the record's bucket
(so it is not unlinked under the read), read header and payload with one
aligned read into a buffer of the bounded `BufferPool`, check the header
names the object asked for (`BucketStore.payload_of`), and queue the payload.
The payload's CRC32C is checked by the client against the master's
checksum, as for DRAM reads: anything that cannot be verified is a miss.

Bounds: at most `window` records of one request are read ahead of the one
being sent, the engine caps I/Os in flight (its queue depth), the pool caps
read buffers in bytes, and sending waits while the transport's write buffer
is above its high-water mark. A payload is copied once out of its pool
buffer before it is queued, so buffers are reused as soon as they are read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from kvtier.segment_server.buckets import BucketStore, RecordError
from kvtier.segment_server.diskio import BufferPool, DiskEngine, read_fully

if TYPE_CHECKING:
    from kvtier.segment_server.protocol import DataPlaneStats

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
_ZEROS = memoryview(bytes(1 << 20))


class DiskReader:
    def __init__(self, store: BucketStore, engine: DiskEngine, pool: BufferPool, window: int = 16) -> None:
        self.store = store
        self.engine = engine
        self.pool = pool
        self.window = window

    async def serve(
        self,
        transport: asyncio.Transport,
        writable: asyncio.Event,
        request_id: int,
        ranges: Sequence[int],
        names: list[tuple[str, str]],
        stats: DataPlaneStats,
    ) -> None:
        """Answer one READ_DISK request on `transport` (see kvtier.proto.frames)."""
        count = len(names)
        sizes = ranges[1::2]
        transport.write(frames.pack_response(Op.READ_DISK, request_id, 0, 4 * count + sum(sizes)))
        reads: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()
        try:
            for i in range(count):
                for ahead in range(i, min(i + self.window, count)):
                    if ahead not in reads:
                        namespace, key = names[ahead]
                        reads[ahead] = loop.create_task(self._read(ranges[2 * ahead], sizes[ahead], namespace, key))
                status, payload, disk_bytes = await reads.pop(i)
                stats.ssd_bytes_read += disk_bytes
                await writable.wait()
                if transport.is_closing():
                    return
                transport.write(frames.DISK_STATUS.pack(status))
                if status == _OK:
                    transport.write(payload)
                    stats.ssd_bytes_served += sizes[i]
                else:
                    stats.ssd_read_errors += 1
                    left = sizes[i]
                    while left:
                        chunk = min(left, len(_ZEROS))
                        transport.write(_ZEROS[:chunk])
                        left -= chunk
        finally:
            for task in reads.values():
                task.cancel()

    async def _read(self, location: int, size: int, namespace: str, key: str) -> tuple[int, bytes, int]:
        """(status, payload, bytes read from disk) of one record."""
        store = self.store
        try:
            plan = store.pin(location)
        except KeyError:
            return int(Status.NOT_FOUND), b"", 0
        try:
            if plan.size != size:
                return int(Status.INVALID_RANGE), b"", 0
            try:
                buf = await self.pool.acquire(plan.read_length)
            except ValueError:  # larger than the whole pool
                return int(Status.TOO_LARGE), b"", 0
            try:
                got = await read_fully(self.engine, plan.fd, plan.file_offset, buf[: plan.read_length])
                if got < plan.header_len + plan.size:
                    return int(Status.NOT_FOUND), b"", got
                try:
                    payload = store.payload_of(buf, plan, namespace, key)
                except RecordError as exc:
                    logger.warning("disk record refused location=%#x key=%.80s: %s", location, key, exc)
                    return int(Status.CHECKSUM_MISMATCH), b"", got
                return _OK, bytes(payload), got
            finally:
                self.pool.release(buf)
        except OSError as exc:
            logger.warning("disk read failed location=%#x: %s", location, exc)
            return int(Status.TRANSFER_FAILED), b"", 0
        finally:
            store.unpin(plan)
