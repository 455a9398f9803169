"""The segment server's SSD-tier worker: one thread that runs the master's tier tasks.

It long-polls the master for tasks on this segment's bytes (see
kvtier.master.tiering) and runs them against the DRAM region and the
`BucketStore`:

- OFFLOAD: append the DRAM range as a record (the store checks the bytes
  against the object's checksum while writing, so a range reused meanwhile
  is refused, never stored), then, for the whole batch, one `sync`
  (fdatasync) before any location is reported: a disk replica is reported
  only once its bytes are durable, and durability never waits for a bucket
  to fill.
- PROMOTE: read the record, check its header and payload CRC against the
  object's checksum, copy it into the DRAM range the master allocated.
- FORGET: tombstone the copy, so a restart does not bring it back (all FORGETs
  of a poll batch in one tombstone record, written after the other tasks).

After every mount the master link has it report the store's inventory
(`report_inventory`, before the mount's inventory is done) and tombstone the
copies the master refuses as stale. When the store passes its
high watermark it tells the master which copies go (`DropDiskReplicas`)
before unlinking their buckets.

Its own thread and its own gRPC channel: the heartbeat thread and the data
plane never wait behind disk I/O. Writes here are synchronous pwritev +
fdatasync on this one thread; the data plane's disk reads go through the
bounded engine of kvtier.segment_server.diskio instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import crc32c
import grpc

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from kvtier.segment_server.buckets import BucketStore, DiskFull, DiskRecord, RecordError
from kvtier.segment_server.dram_index import InventoryRefused
from kvtier.segment_server.write_limit import WriteLimit

logger = logging.getLogger(__name__)

_POLL_WAIT_MS = 1000
_MAX_TASKS = 256
_REPORT_BATCH = 10_000
_RPC_TIMEOUT_S = 10.0
_BACKOFF_MAX_S = 3.0
_OK = int(Status.OK)
_PROMOTE_TTL_SHARE = 0.5  # of the task's time: the rest is margin for the report and clocks


class TierWorker:
    def __init__(
        self,
        stub: Callable[[], Any],
        store: BucketStore,
        region: memoryview,
        session: Callable[[], tuple[int, int]],
    ) -> None:
        """`stub()` gives the current master's stub; `session()` the (segment id, epoch) of the
        current mount, (0, 0) when not mounted."""
        self._stub_of = stub
        self.store = store
        self._region = region
        self._session = session
        self._epoch = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-worker", daemon=True)
        self.write_limit = WriteLimit(0, self._stop)  # --ssd-write-limit (the server sets the rate)
        self.offloaded = 0
        self.offloaded_bytes = 0
        self.promoted = 0
        self.forgotten = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_RPC_TIMEOUT_S + 2)

    @property
    def _stub(self) -> Any:
        return self._stub_of()

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            segment_id, self._epoch = self._session()
            if not segment_id:
                self._stop.wait(0.05)
                continue
            try:
                self._evict_buckets(segment_id)
                reply = self._stub.PollTierTasks(
                    pb.PollTierTasksRequest(
                        segment_id=segment_id,
                        epoch=self._epoch,
                        max_tasks=self.write_limit.max_tasks(_MAX_TASKS),
                        wait_ms=_POLL_WAIT_MS,
                    ),
                    timeout=_POLL_WAIT_MS / 1000 + _RPC_TIMEOUT_S,
                )
                if reply.status != _OK:  # SEGMENT_NOT_FOUND: the master link re-mounts us
                    self._stop.wait(0.1)
                    continue
                if reply.task_ids:
                    self._run_tasks(segment_id, reply)
                backoff = 0.05
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    logger.warning("tier worker: master unreachable code=%s; retrying in %.2fs", exc.code(), backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            except Exception:  # never let the worker die silently: log, back off, go on
                logger.exception("tier worker failed; retrying")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _run_tasks(self, segment_id: int, reply: pb.PollTierTasksResponse) -> None:
        # A PROMOTE may write its DRAM range only well within the task's time: after that the
        # master frees the range, and it may belong to another object by then.
        promote_deadline = time.monotonic() + reply.task_ttl_ms / 1000 * _PROMOTE_TTL_SHARE
        statuses: list[int] = []
        locations: list[int] = []
        first_error = ""
        appended = False
        offloaded = offloaded_bytes = 0
        forgets: list[int] = []  # indexes of FORGET tasks: tombstoned together after the loop
        for i in range(len(reply.task_ids)):
            kind = reply.kinds[i]
            namespace, key, size, checksum = reply.namespaces[i], reply.keys[i], reply.sizes[i], reply.checksums[i]
            status, location, error = _OK, 0, ""
            try:
                if kind == pb.OFFLOAD:
                    offset = reply.dram_offsets[i]
                    if offset + size > len(self._region):
                        status, error = int(Status.INVALID_RANGE), f"offload range {offset}+{size} outside the region"
                    else:
                        self.write_limit.take(size)  # --ssd-write-limit: paced per record
                        location = self._append(
                            segment_id, namespace, key, self._region[offset : offset + size], checksum
                        )
                        appended = True
                        offloaded += 1
                        offloaded_bytes += size
                elif kind == pb.PROMOTE:
                    status, error = self._promote(
                        reply.disk_locations[i], reply.dram_offsets[i], namespace, key, size, checksum, promote_deadline
                    )
                elif kind == pb.FORGET:
                    forgets.append(i)
            except RecordError as exc:  # the DRAM bytes no longer match the object: never store them
                status, error = int(Status.CHECKSUM_MISMATCH), str(exc)
            except DiskFull as exc:
                status, error = int(Status.NO_SPACE), f"SSD tier full: {exc}"
            except OSError as exc:
                status, error = int(Status.INTERNAL), f"disk error: {exc}"
            if status != _OK and not first_error:
                first_error = f"{Status(status).name} {key!r:.80}: {error}"
            statuses.append(status)
            locations.append(location)
        if forgets:
            try:
                self.store.tombstone_many(reply.disk_locations[i] for i in forgets)
                appended = True
                self.forgotten += len(forgets)
            except OSError as exc:
                for i in forgets:
                    statuses[i] = int(Status.INTERNAL)
                first_error = first_error or f"INTERNAL {reply.keys[forgets[0]]!r:.80}: disk error: {exc}"
        if appended:
            try:
                self.store.sync()  # durable before reported: the master may drop the DRAM copy at once
                self.offloaded += offloaded
                self.offloaded_bytes += offloaded_bytes
            except OSError as exc:
                statuses = [s if s != _OK else int(Status.INTERNAL) for s in statuses]
                first_error = first_error or f"fdatasync failed: {exc}"
        if first_error:
            logger.warning("tier tasks failed segment_id=%d: %s", segment_id, first_error)
        done = self._stub.TierTasksDone(
            pb.TierTasksDoneRequest(
                segment_id=segment_id,
                epoch=self._epoch,
                task_ids=list(reply.task_ids),
                statuses=statuses,
                disk_locations=locations,
                error=first_error,
            ),
            timeout=_RPC_TIMEOUT_S,
        )
        # A copy written for an offload the master no longer waits for (it expired) is an orphan
        # nobody will ever read or forget: tombstone it now.
        orphans = [
            location
            for kind, status, location, answer in zip(reply.kinds, statuses, locations, done.statuses, strict=False)
            if kind == pb.OFFLOAD and status == _OK and answer == Status.NOT_PENDING
        ]
        if orphans:
            self.store.tombstone_many(orphans)
            self.store.sync()
            logger.warning("tombstoned %d disk copies of offloads the master had given up on", len(orphans))

    def _append(self, segment_id: int, namespace: str, key: str, payload: memoryview, checksum: int) -> int:
        """Append a record; when the tier is full, delete the oldest buckets (master told first) and retry once."""
        try:
            return self.store.append(namespace, key, payload, checksum)
        except DiskFull:
            if not self._evict_buckets(segment_id):
                raise
            return self.store.append(namespace, key, payload, checksum)

    def _promote(
        self, location: int, dram_offset: int, namespace: str, key: str, size: int, checksum: int, deadline: float
    ) -> tuple[int, str]:
        if dram_offset + size > len(self._region):
            return int(Status.INVALID_RANGE), f"promote range {dram_offset}+{size} outside the region"
        try:
            plan = self.store.pin(location)
        except KeyError:
            return int(Status.NOT_FOUND), f"no disk record at {location:#x}"
        # Page-aligned (an anonymous mapping): the bucket's read fd may be O_DIRECT.
        buf = mmap.mmap(-1, plan.read_length)
        view = memoryview(buf)
        try:
            got = os.preadv(plan.fd, [view], plan.file_offset)
            if got < plan.header_len + plan.size:
                return int(Status.NOT_FOUND), "disk record is torn"
            payload = BucketStore.payload_of(view, plan, namespace, key, self.store.cluster_id)
            if plan.size != size or crc32c.crc32c(payload) != checksum:
                return int(Status.CHECKSUM_MISMATCH), "disk record does not match the object's checksum"
            if time.monotonic() > deadline:
                return int(Status.TIMEOUT), "promotion came too late: its DRAM range may be reused"
            self._region[dram_offset : dram_offset + size] = payload
            self.promoted += 1
            return _OK, ""
        except RecordError as exc:
            return int(Status.CHECKSUM_MISMATCH), str(exc)
        finally:
            payload = None
            view.release()
            buf.close()
            self.store.unpin(plan)

    # ------------------------------------------------------------------ inventory and capacity

    def report_inventory(self, stub: Any, segment_id: int, epoch: int) -> None:
        """Report every disk copy to the master (called by the master link after each mount)."""
        records = self.store.records()
        stale = []
        for lo in range(0, len(records), _REPORT_BATCH):
            chunk = records[lo : lo + _REPORT_BATCH]
            reply = stub.ReportDiskObjects(_disk_objects(segment_id, epoch, chunk), timeout=_RPC_TIMEOUT_S)
            if reply.status != _OK:
                raise InventoryRefused(f"ReportDiskObjects: {Status(reply.status).name}: {reply.error}")
            stale += [r for r, s in zip(chunk, reply.statuses, strict=True) if s == Status.CHECKSUM_MISMATCH]
        if stale:  # the master holds these keys with other bytes: they must never come back
            self.store.tombstone_many(record.location for record in stale)
            self.store.sync()
        logger.info("reported disk inventory segment_id=%d objects=%d stale=%d", segment_id, len(records), len(stale))

    def _evict_buckets(self, segment_id: int) -> bool:
        """Past the high watermark, delete the oldest sealed buckets; whether any were deleted."""
        candidates = self.store.eviction_candidates()
        if not candidates:
            return False
        doomed = {location for _, locations in candidates for location in locations}
        records = [r for r in self.store.records() if r.location in doomed]
        for lo in range(0, max(len(records), 1), _REPORT_BATCH):
            reply = self._stub.DropDiskReplicas(
                _disk_objects(segment_id, self._epoch, records[lo : lo + _REPORT_BATCH]), timeout=_RPC_TIMEOUT_S
            )
            if reply.status != _OK:
                return False  # the master did not take it: keep the buckets, try again later
        bucket_ids = [bucket_id for bucket_id, _ in candidates]
        self.store.delete_buckets(bucket_ids)
        logger.info("deleted SSD buckets count=%d objects=%d (disk watermark)", len(bucket_ids), len(records))
        return True


def _disk_objects(segment_id: int, epoch: int, records: list[DiskRecord]) -> pb.DiskObjectsRequest:
    return pb.DiskObjectsRequest(
        segment_id=segment_id,
        epoch=epoch,
        namespaces=[r.namespace for r in records],
        keys=[r.key for r in records],
        sizes=[r.size for r in records],
        checksums=[r.checksum for r in records],
        disk_locations=[r.location for r in records],
    )
