"""The segment server's SSD-tier worker: one thread that runs the master's tier tasks.

It long-polls the master for tasks on this segment's bytes (see
kvtier.master.tiering) and runs them against the DRAM region and the
`BucketStore`:

- OFFLOAD: the batch's DRAM ranges are written as one group by
  `GroupWriter` (kvtier.segment_server.group_writer: staged in large aligned
  buffers, each copy checked against the object's checksum, so a range
  reused meanwhile is refused, never stored; several writes in flight), then
  one `sync` (fdatasync) before any location is reported: a disk replica is
  reported only once its bytes are durable, and durability never waits for a
  bucket to fill.
- PROMOTE: read the record, check its header and payload CRC against the
  object's checksum, copy it into the DRAM range the master allocated.
- FORGET: tombstone the copy, so a restart does not bring it back (all FORGETs
  of a poll batch in one tombstone record, written after the other tasks).

After every mount the master link has it report the store's inventory
(`report_inventory`, before the mount's inventory is done) and tombstone the
copies the master refuses as stale. Corrupt records the background verifier
found since the mount (kvtier.segment_server.verifier) are tombstoned here, the
store's writer thread, and reported to the master. When the store passes its
high watermark it tells the master which copies go (`DropDiskReplicas`)
before unlinking their buckets.

Its own thread (a kvtier.common.poller.MasterPoller: back-off from 50 ms to
3 s with jitter while the master is unreachable) and its own gRPC channel: the heartbeat thread and the data
plane never wait behind disk I/O. Offload writes go through the group
writer's fixed pool of writer threads and staging buffers, then one
fdatasync on this thread; the data plane's disk reads go through the
bounded engine of kvtier.segment_server.diskio instead.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import crc32c
import grpc

from kvtier.common.poller import Backoff, MasterPoller, retry_call
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from kvtier.segment_server import failpoints
from kvtier.segment_server.bucket_format import DiskRecord, RecordError
from kvtier.segment_server.buckets import BucketStore, DiskFull
from kvtier.segment_server.dram_index import InventoryRefused
from kvtier.segment_server.group_writer import GroupWriter, OffloadItem, Outcome
from kvtier.segment_server.master_clock import MasterClock, local_s
from kvtier.segment_server.verifier import Verifier
from kvtier.segment_server.write_limit import WriteLimit

logger = logging.getLogger(__name__)

_POLL_WAIT_MS = 1000
_MAX_TASKS = 256
_REPORT_BATCH = 10_000
_RPC_TIMEOUT_S = 10.0
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 3.0
_OK = int(Status.OK)
_PROMOTE_TTL_SHARE = 0.5  # of the task's time: the rest is margin for the report and clocks
_KIND_NAMES = {pb.OFFLOAD: "offload", pb.PROMOTE: "promote", pb.FORGET: "forget"}
# A failed task's status -> the reason label of kvtier_segment_tier_write_failures_total
_FAILURE_REASONS = {
    int(Status.NO_SPACE): "no_space",
    int(Status.INTERNAL): "io_error",
    int(Status.CHECKSUM_MISMATCH): "checksum",
    int(Status.TIMEOUT): "deadline",
    int(Status.NOT_FOUND): "missing",
    int(Status.INVALID_RANGE): "invalid_range",
}


class _BadRange(Exception):
    """An OFFLOAD's DRAM range is outside the region (INVALID_RANGE)."""


class TierWorker:
    def __init__(
        self,
        stub: Callable[[], Any],
        store: BucketStore,
        region: memoryview,
        session: Callable[[], tuple[int, int]],
        writer: GroupWriter | None = None,
        verifier: Verifier | None = None,
        clock: MasterClock | None = None,
    ) -> None:
        """`stub()` gives the current master's stub; `session()` the (segment id, epoch) of the
        current mount, (0, 0) when not mounted; `writer` writes offloads into `store` (default: a
        GroupWriter with its default buffers and threads); the worker closes it at `stop`;
        `verifier` the background payload verifier, whose findings this thread (the store's
        writer) tombstones and reports."""
        self._stub_of = stub
        self.store = store
        self._region = region
        self._session = session
        self._writer = writer if writer is not None else GroupWriter(store)
        self.verifier = verifier
        self._clock = clock  # the master's clock as this segment keeps it: a PROMOTE's time is on it
        self._epoch = 0
        self._stop = threading.Event()
        self._poller = MasterPoller(
            "tier worker",
            self._step,
            retryable=(grpc.RpcError,),
            backoff=Backoff(_BACKOFF_MIN_S, _BACKOFF_MAX_S),
            stop=self._stop,
            thread_name="kvtier-tier-worker",
            logger=logger,
        )
        self.write_limit = WriteLimit(0, self._stop)  # --ssd-write-limit (the server sets the rate)
        self._writer.pace = self.write_limit.take
        self.offloaded = 0
        self.offloaded_bytes = 0
        self.promoted = 0
        self.forgotten = 0
        # (op, reason) -> tasks that failed here: kvtier_segment_tier_write_failures_total. A failed
        # task never leaves a copy the master hands out (see `_run_tasks`).
        self.failures: Counter[tuple[str, str]] = Counter()
        # Locations written for OFFLOADs of the batch in hand, not yet answered by a master: left out
        # of an inventory reported meanwhile (a re-mount), since no master may ever register them.
        self._unreported: set[int] = set()
        self._unreported_lock = threading.Lock()
        # Taken around each store write: the store has one writer at a time, and besides this thread
        # the master link's writes tombstones of stale copies during a mount (report_inventory).
        self._store_lock = threading.RLock()

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        if self._poller.stop(timeout=_RPC_TIMEOUT_S + 2):
            self._writer.close()

    @property
    def _stub(self) -> Any:
        return self._stub_of()

    # ------------------------------------------------------------------ loop

    def _step(self) -> float:
        """One poll for tasks, and their run and report (the poller's step): the wait before the next."""
        segment_id, self._epoch = self._session()
        if not segment_id:
            return 0.05
        with self._store_lock:
            self._evict_buckets(segment_id)
            if self.verifier is not None:
                self.verifier.apply(self._stub, segment_id)
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
            return 0.1
        if reply.task_ids:
            self._run_tasks(segment_id, reply)
        return 0.0

    def _run_tasks(self, segment_id: int, reply: pb.PollTierTasksResponse) -> None:
        # A PROMOTE may write its DRAM range only well within the task's time: after that the
        # master frees the range, and it may belong to another object by then.
        now = local_s()
        if reply.promote_by_ms and self._clock is not None:  # on the master's clock (its latest estimate)
            promote_deadline = now + (reply.promote_by_ms - self._clock.now_ms()) / 1000
        else:
            promote_deadline = now + reply.task_ttl_ms / 1000 * _PROMOTE_TTL_SHARE
        statuses: list[int] = []
        locations: list[int] = []
        first_error = ""
        appended = False
        offloaded = offloaded_bytes = 0
        forgets: list[int] = []  # indexes of FORGET tasks: tombstoned together after the loop
        offloads = self._offload_all(segment_id, reply)  # task index -> location or error, one group write
        for i in range(len(reply.task_ids)):
            kind = reply.kinds[i]
            namespace, key, size, checksum = reply.namespaces[i], reply.keys[i], reply.sizes[i], reply.checksums[i]
            status, location, error = _OK, 0, ""
            try:
                if kind == pb.OFFLOAD:
                    outcome = offloads[i]
                    if isinstance(outcome, Exception):
                        raise outcome
                    location = outcome
                    appended = True
                    offloaded += 1
                    offloaded_bytes += size
                elif kind == pb.PROMOTE:
                    status, error = self._promote(
                        reply.disk_locations[i],
                        reply.dram_offsets[i],
                        namespace,
                        key,
                        size,
                        checksum,
                        promote_deadline,
                        (segment_id, self._epoch),
                    )
                elif kind == pb.FORGET:
                    forgets.append(i)
            except _BadRange as exc:
                status, error = int(Status.INVALID_RANGE), str(exc)
            except RecordError as exc:  # the DRAM bytes no longer match the object: never store them
                status, error = int(Status.CHECKSUM_MISMATCH), str(exc)
            except ValueError as exc:  # a name too long for the record format
                status, error = int(Status.INVALID_ARGUMENT), str(exc)
            except DiskFull as exc:
                status, error = int(Status.NO_SPACE), f"SSD tier full: {exc}"
            except OSError as exc:
                status, error = int(Status.INTERNAL), f"disk error: {exc}"
            if status != _OK and not first_error:
                first_error = f"{Status(status).name} {key!r:.80}: {error}"
            statuses.append(status)
            locations.append(location)
        if forgets:
            failpoints.hit("tier.forget")
            try:
                # A location this batch's own offloads just wrote holds the new copy, whichever FORGET
                # of its previous life came with them (a bucket id taken again after a restart).
                written = {at for at in offloads.values() if isinstance(at, int)}
                with self._store_lock:
                    moot = self.store.tombstone_named(
                        (reply.disk_locations[i], reply.namespaces[i], reply.keys[i])
                        for i in forgets
                        if reply.disk_locations[i] not in written
                    )
                if moot:
                    logger.warning("%d FORGETs named another object than the copy at their location: left it", moot)
                appended = True
                self.forgotten += len(forgets)
            except OSError as exc:  # the master sends them again (after a pause)
                failed = int(Status.NO_SPACE if isinstance(exc, DiskFull) else Status.INTERNAL)
                for i in forgets:
                    statuses[i] = failed
                first_error = first_error or f"{Status(failed).name} {reply.keys[forgets[0]]!r:.80}: disk error: {exc}"
        if appended:
            try:
                if offloaded:
                    failpoints.hit("tier.offload_sync")
                with self._store_lock:
                    self.store.sync()  # durable before reported: the master may drop the DRAM copy at once
                self.offloaded += offloaded
                self.offloaded_bytes += offloaded_bytes
            except OSError as exc:
                first_error = first_error or f"fdatasync failed: {exc}"
                unsynced = [
                    location
                    for kind, status, location in zip(reply.kinds, statuses, locations, strict=True)
                    if kind == pb.OFFLOAD and status == _OK
                ]
                failed = int(Status.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else Status.INTERNAL)
                statuses = [s if s != _OK else failed for s in statuses]
                locations = [0] * len(locations)
                self._withdraw(unsynced)
            if offloaded and all(s == _OK for s in statuses):
                failpoints.hit("tier.offload_synced")
        for kind, status in zip(reply.kinds, statuses, strict=True):
            if status != _OK:
                self.failures[_KIND_NAMES.get(kind, "unknown"), _FAILURE_REASONS.get(status, "other")] += 1
        if first_error:
            logger.warning("tier tasks failed segment_id=%d error=%s", segment_id, first_error)
        try:
            done = self._report(
                segment_id,
                pb.TierTasksDoneRequest(
                    segment_id=segment_id,
                    epoch=self._epoch,
                    task_ids=list(reply.task_ids),
                    statuses=statuses,
                    disk_locations=locations,
                    error=first_error,
                ),
            )
            written = [
                location
                for kind, status, location in zip(reply.kinds, statuses, locations, strict=True)
                if kind == pb.OFFLOAD and status == _OK
            ]
            if done is None or done.status != _OK:
                # No master took the report (it restarted, or dropped this segment meanwhile): these
                # copies are registered nowhere, and the inventory of any new mount left them out.
                orphans = written
            else:
                # A copy written for an offload the master no longer waits for (it expired) is an
                # orphan nobody will ever read or forget.
                orphans = [
                    location
                    for kind, status, location, answer in zip(
                        reply.kinds, statuses, locations, done.statuses, strict=False
                    )
                    if kind == pb.OFFLOAD and status == _OK and answer == Status.NOT_PENDING
                ]
            if orphans:
                self._withdraw(orphans)
                # Counted once tombstoned: whoever sees the count sees the copies gone (a test raced it).
                self.failures["offload", "abandoned"] += len(orphans)
                logger.warning("tombstoned %d disk copies of offloads no master registered", len(orphans))
        finally:
            with self._unreported_lock:
                self._unreported.clear()

    def _report(self, segment_id: int, request: pb.TierTasksDoneRequest) -> Any:
        """TierTasksDone, retried while this mount lasts (the master answers a repeated report alike);
        None once it is over (a re-mount, or stopping): then no master holds these outcomes."""
        return retry_call(
            lambda: self._stub.TierTasksDone(request, timeout=_RPC_TIMEOUT_S),
            retryable=(grpc.RpcError,),
            go_on=lambda: self._session() == (segment_id, self._epoch),
            stop=self._stop,
            what="tier tasks report",
            backoff=Backoff(_BACKOFF_MIN_S, _BACKOFF_MAX_S),
            logger=logger,
        )

    def _withdraw(self, locations: list[int]) -> None:
        """Records appended for offloads that are reported failed: never served, never reported at a
        mount, and tombstoned so a restart does not bring them back (their key may be removed meanwhile,
        and the master never knew these copies). If even the tombstone cannot be written (the disk is
        failing), they are dropped from the live set all the same; a restart re-verifies every record."""
        if not locations:
            return
        with self._store_lock:
            try:
                self.store.tombstone_many(locations)
                self.store.sync()
            except OSError as exc:
                logger.warning("cannot tombstone %d disk copies: %s", len(locations), exc)
            self.store.withdraw(locations)

    def _offload_all(self, segment_id: int, reply: pb.PollTierTasksResponse) -> dict[int, Outcome]:
        """Write the batch's OFFLOADs as one group (kvtier.segment_server.group_writer): task index ->
        location or the error that kept it out. When the tier is full, the oldest buckets are deleted
        (master told first) and the record is tried again, once per batch."""
        items: list[OffloadItem] = []
        indexes: list[int] = []
        out: dict[int, Outcome] = {}
        tagged = len(reply.group_ids) == len(reply.kinds)  # else no task of the batch names a group
        for i, kind in enumerate(reply.kinds):
            if kind != pb.OFFLOAD:
                continue
            offset, size = reply.dram_offsets[i], reply.sizes[i]
            if offset + size > len(self._region):
                out[i] = _BadRange(f"offload range {offset}+{size} outside the region")
                continue
            group = (reply.group_ids[i], reply.group_sizes[i]) if tagged and reply.group_ids[i] else (0, 0)
            region = self._region[offset : offset + size]
            items.append(OffloadItem(reply.namespaces[i], reply.keys[i], region, reply.checksums[i], group))
            indexes.append(i)
        if items:
            with self._store_lock:  # the master link writes tombstones and reports during a mount
                outcomes = self._writer.write(items, on_full=lambda: self._evict_buckets(segment_id))
                with self._unreported_lock:  # before a mount's inventory can see them (see report_inventory)
                    self._unreported.update(o for o in outcomes if isinstance(o, int))
            out.update(zip(indexes, outcomes, strict=True))
        return out

    def _promote(
        self,
        location: int,
        dram_offset: int,
        namespace: str,
        key: str,
        size: int,
        checksum: int,
        deadline: float,
        mount: tuple[int, int],
    ) -> tuple[int, str]:
        """Copy a disk record into the DRAM range the master granted under `mount` (segment id, epoch):
        only well within the task's time, and only while that mount lasts (a segment dropped and
        mounted again, or whose master restarted, has its ranges handed out afresh)."""
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
            failpoints.hit("tier.promote_read")
            if local_s() > deadline:
                return int(Status.TIMEOUT), "promotion came too late: its DRAM range may be reused"
            if self._session() != mount:
                return int(Status.LEASE_EXPIRED), "the mount this promotion was granted under ended"
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
        with self._unreported_lock:
            unreported = set(self._unreported)
        records = [r for r in self.store.records() if r.location not in unreported]
        stale = []
        for lo in range(0, len(records), _REPORT_BATCH):
            chunk = records[lo : lo + _REPORT_BATCH]
            reply = stub.ReportDiskObjects(_disk_objects(segment_id, epoch, chunk), timeout=_RPC_TIMEOUT_S)
            if reply.status != _OK:
                raise InventoryRefused(f"ReportDiskObjects: {Status(reply.status).name}: {reply.error}")
            stale += [r for r, s in zip(chunk, reply.statuses, strict=True) if s == Status.CHECKSUM_MISMATCH]
        if stale:  # the master holds these keys with other bytes: they must never come back
            locations = [record.location for record in stale]
            with self._store_lock:
                try:
                    self.store.tombstone_many(locations)
                    self.store.sync()
                except OSError as exc:
                    # Never served or reported again by this process, and refused by this master at
                    # any later mount; the mount goes on (a failing disk must not keep DRAM out of service).
                    failed = "no_space" if isinstance(exc, DiskFull) else "io_error"
                    self.failures["forget", failed] += len(locations)
                    logger.error("stale disk copies not tombstoned count=%d error=%s", len(locations), exc)
                self.store.withdraw(locations)
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
    request = pb.DiskObjectsRequest(
        segment_id=segment_id,
        epoch=epoch,
        namespaces=[r.namespace for r in records],
        keys=[r.key for r in records],
        sizes=[r.size for r in records],
        checksums=[r.checksum for r in records],
        disk_locations=[r.location for r in records],
    )
    if any(r.group_id for r in records):  # groups are rare: the columns only when one is there
        request.group_ids.extend(r.group_id for r in records)
        request.group_sizes.extend(r.group_size for r in records)
    return request
