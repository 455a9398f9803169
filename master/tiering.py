"""The SSD tier as the master sees it: disk copies, offload on eviction, promotion, forgetting.

The master never moves bytes. For a segment with an SSD tier it queues tasks
on that segment's own bytes, which the segment fetches with a long poll
(`PollTierTasks`) and reports back (`TierTasksDone`):

- OFFLOAD: when watermark eviction picks an object whose DRAM copy lives on
  a segment with offload on, the copy is written to that segment's SSD
  instead of being dropped. The DRAM range stays allocated (and readable)
  until the segment reports the disk location; then the disk copy becomes a
  replica (tier SSD) and the DRAM replica is dropped. The segment checks the
  bytes it writes against the object's checksum, so a range reused meanwhile
  can never become a disk copy.
- PROMOTE: a disk-only object read `promote_after_reads` times gets a DRAM
  range on the same segment when one is free (no eviction for it); the
  segment copies the verified disk bytes in; the range becomes a replica.
- FORGET: a disk copy the master dropped (object removed or replaced) is
  tombstoned by the segment so a restart does not bring it back. Forgets are
  acknowledged and remembered by segment name until they are: a segment that
  was away (dropped, restarted) gets them again when it mounts, and a disk
  copy it reports that is still to be forgotten is refused, never registered.
  Otherwise a removed object could come back with its old bytes and a valid
  checksum after a re-put of its key had been answered "already stored".
  A change waits for its FORGETs (kvtier.master.commit_wait), but not for a
  segment whose tier worker stalled past that wait: such a FORGET is *owed*
  and saved with the master's state (kvtier.master.persist) before the change
  is answered, so the next incarnation refuses that copy too. The book of FORGETs is the
  `ForgetBook` mixin (kvtier.master.tier_forgets), the tasks themselves kvtier.master.tier_tasks.

A segment reports its disk copies after every mount (`ReportDiskObjects`,
its recovered inventory) and before it deletes buckets (`DropDiskReplicas`).

Disk replicas are packed like DRAM ones (kvtier.master.records) with tier
SSD and the segment's disk location in place of the offset. They cost the
segment's disk, not its DRAM allocator nor any rank's quota.

Owned by `MasterState`'s thread like everything else.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.master.events import EventKind
from kvtier.master.records import (
    MAX_SEGMENT_CAPACITY,
    OFFSET_MASK,
    TIER_SHIFT,
    TIER_SSD,
    ObjectRecord,
    ObjectState,
    object_name,
    replica,
)
from kvtier.master.state_types import master_key_problem
from kvtier.master.tier_forgets import ForgetBook
from kvtier.master.tier_tasks import TaskKind, TierTask, dram_key, ssd_key
from kvtier.proto.status import Status, status_name

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, SegmentRecord

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
# The part of a task's time (from its handing out) a PROMOTE may still write its DRAM range in; the
# rest is margin for its report and the clocks (PollTierTasksResponse.promote_by_ms).
PROMOTE_WRITE_SHARE = 0.5
OFFLOAD_BACKOFF_S = 5.0  # after a segment failed an offload (disk full, I/O error), drop instead for this long
_REPORTED_KEPT = 65536  # OFFLOAD reports remembered, so a segment's retried TierTasksDone is answered alike


class Tiering(ForgetBook):
    def __init__(self, state: MasterState) -> None:
        self.state = state
        self._queues: dict[int, deque[TierTask]] = {}  # per segment, not yet handed out
        self._in_flight: dict[int, TierTask] = {}  # task id -> handed out, waiting for TierTasksDone
        self.offloading: dict[str, TierTask] = {}  # object name -> its OFFLOAD task (queued or in flight)
        self._offloading_bytes: Counter[int] = Counter()  # segment id -> DRAM bytes being offloaded
        self._evicting_bytes: Counter[int] = Counter()  # ... of which to free room (not ahead)
        self._promoting: dict[str, TierTask] = {}
        self._promoting_bytes: Counter[int] = Counter()  # segment id -> DRAM bytes being promoted
        self.admission = state.config.admission  # SSD write admission (kvtier.master.admission)
        self.promotion_budget = state.config.promotion_budget_bytes
        self._disk_reads: dict[str, int] = {}  # reads of disk-only objects, for promotion
        self._offload_paused_until: dict[int, float] = {}
        self._ids = itertools.count(1)
        # segment name -> location -> FORGET not yet acknowledged (survives the segment's absence)
        self._unacked_forgets: dict[str, dict[int, TierTask]] = {}
        self._names: dict[int, str] = {}  # segment id -> name, for every segment ever mounted
        self.counters: Counter[str] = Counter()
        # (op, status name) -> tasks that failed (reported so, or expired): kvtier_master_tier_task_failures_total
        self.failures: Counter[tuple[str, str]] = Counter()
        # segment id -> task id -> OFFLOADs handed out whose outcome the segment has not reported yet
        # (an expiry does not settle one: the copy may be durable on its disk all the same), and the
        # names taken from them when the segment is dropped (see `unsettled_offload_names`)
        self._unsettled: dict[int, dict[int, TierTask]] = {}
        self._unsettled_at_drop: dict[str, set[str]] = {}
        # task id -> (segment id, location) of OFFLOADs their segment reported (bounded, oldest out): a
        # TierTasksDone retried after a lost answer gets OK again, not NOT_PENDING (which would make
        # the segment withdraw a copy this master registered)
        self._reported: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.notify: Callable[[int], None] | None = None  # wakes a long poll of that segment
        self.on_ack: Callable[[], None] | None = None  # wakes Removes waiting for their forgets
        self.on_owed: Callable[[], None] | None = None  # saves the state soon: an answer waits for that
        # segment name -> location -> owed FORGET (`_owe`; acknowledged ones leave it): what is saved
        self._owed: dict[str, dict[int, TierTask]] = {}
        self._owed_bytes: Counter[str] = Counter()  # segment name -> their size in the saved JSON
        self._forgets_stalled: set[str] = set()  # segments not waited for until they acknowledge again
        self._forgets_failing: set[str] = set()  # of those, the ones whose disk failed one: until one succeeds
        self._forget_retries: deque[tuple[float, TierTask]] = deque()  # (when, task): failed, sent again by tick

    # ------------------------------------------------------------------ queueing

    def _enqueue(self, task: TierTask) -> None:
        self._queues.setdefault(task.segment_id, deque()).append(task)
        self.counters[f"{task.kind.name.lower()}_tasks"] += 1
        if self.notify is not None:
            self.notify(task.segment_id)

    def has_tasks(self, segment_id: int) -> bool:
        return bool(self._queues.get(segment_id))

    def mounted(self, segment: SegmentRecord) -> None:
        """A segment (re)mounted: hand it the forgets it has not acknowledged yet."""
        self._names[segment.segment_id] = segment.name
        self._unsettled_at_drop.pop(segment.name, None)  # taken by its fence, or it has none to take it
        for task in self._unacked_forgets.get(segment.name, {}).values():
            task.segment_id = segment.segment_id
            self._enqueue(task)

    @property
    def task_ttl_s(self) -> float:
        return self.state.config.put_timeout_s

    def poll(self, segment_id: int, max_tasks: int) -> list[TierTask]:
        """Hand out up to `max_tasks` queued tasks of a segment; they must be reported by their deadline."""
        queue = self._queues.get(segment_id)
        out: list[TierTask] = []
        if not queue:
            return out
        deadline = self.state.clock() + self.task_ttl_s
        forgets = self._unacked_forgets.get(self._names.get(segment_id, ""), {})
        while queue and len(out) < max_tasks:
            task = queue.popleft()
            if task.kind is TaskKind.FORGET and forgets.get(task.disk_location) is not task:
                continue  # moot: the location holds a newer record (`_offload_done`)
            task.deadline = deadline
            self._in_flight[task.task_id] = task
            if task.kind is TaskKind.OFFLOAD:
                self._unsettled.setdefault(segment_id, {})[task.task_id] = task
            out.append(task)
        return out

    # ------------------------------------------------------------------ offload

    def can_offload(self, segment: SegmentRecord) -> bool:
        return (
            segment.offload
            and segment.ssd_capacity > 0
            and self._offload_paused_until.get(segment.segment_id, 0.0) <= self.state.clock()
        )

    def offloading_bytes(self, segment_id: int) -> int:
        return self._offloading_bytes[segment_id]

    def refusal(self, record: ObjectRecord, segment: SegmentRecord) -> str | None:
        """Why `record` will never be offloaded to `segment`'s SSD tier, or None when it can be (now or
        once a paused offload resumes): "no_ssd_tier", "too_large" (the segment could never serve it
        back), or an admission veto ("min_size", "reads": kvtier.master.admission). Pure: counts
        nothing. The one place that decides it: eviction does not wait for such objects
        (kvtier.master.backpressure), and drops them to recompute."""
        if not segment.offload or segment.ssd_capacity <= 0:
            return "no_ssd_tier"
        if segment.ssd_max_object and record.size > segment.ssd_max_object:
            return "too_large"
        return self.admission.veto(record)

    def evicting_bytes(self, segment_id: int) -> int:
        """DRAM bytes being offloaded to free room: freed when their disk copies are durable."""
        return self._evicting_bytes[segment_id]

    def evicting(self, name: str) -> bool:
        task = self.offloading.get(name)
        return task is not None and not task.ahead

    def offload(self, record: ObjectRecord, segment: SegmentRecord, ahead: bool = False) -> bool:
        """Queue an OFFLOAD of `record`'s DRAM copy on `segment`; False when it cannot be offloaded there.
        `ahead`: a copy ahead of need, whose DRAM copy stays when done (eviction later drops the least
        recently used such copies first); otherwise its DRAM copy goes when done, to free room. An
        offload queued ahead becomes one to free room when asked for again without `ahead`."""
        segment_id = segment.segment_id
        queued = self.offloading.get(record.name)
        if queued is not None:
            # (queued.record is not record: an upsert replaced the version being copied)
            if ahead or not queued.ahead or queued.segment_id != segment_id or queued.record is not record:
                return False
            queued.ahead = False
            self._evicting_bytes[segment_id] += self.state.aligned(record.size)
            return True
        if not self.can_offload(segment):
            return False
        if self.refusal(record, segment) is not None:
            return False  # drop it instead
        dram = dram_key(segment_id)
        source = next((r for r in record.replicas if r >> TIER_SHIFT == dram), None)
        if source is None or any(r >> TIER_SHIFT == ssd_key(segment_id) for r in record.replicas):
            return False
        task = TierTask(
            next(self._ids),
            TaskKind.OFFLOAD,
            segment_id,
            record,
            record.name,
            record.size,
            record.checksum,
            dram_offset=source & OFFSET_MASK,
            queued_at=self.state.clock(),
            ahead=ahead,
        )
        self.offloading[record.name] = task
        self._offloading_bytes[segment_id] += self.state.aligned(record.size)
        if not ahead:
            self._evicting_bytes[segment_id] += self.state.aligned(record.size)
        self._enqueue(task)
        return True

    # ------------------------------------------------------------------ promotion

    def disk_only_read(self, record: ObjectRecord) -> None:
        """A read of an object without a DRAM copy: promote it after enough of them."""
        after = self.state.config.promote_after_reads
        name = record.name
        if not after or name in self._promoting:
            return
        reads = self._disk_reads.get(name, 0) + 1
        if reads < after:
            self._disk_reads[name] = reads
            return
        self._disk_reads.pop(name, None)
        for packed in record.replicas:
            segment = self.state.segments.get(packed >> TIER_SHIFT >> 2)
            if (
                segment is None
                or segment.state.name != "ACTIVE"
                or not self.promotion_room(segment, record.size, record)
            ):
                continue
            allocator = segment.allocator
            if allocator.used + record.size > self.state.config.high_watermark * allocator.capacity:
                continue  # it would only push the watermark pass to offload something else
            offset = allocator.allocate(record.size) if record.size else 0
            if offset is None:
                continue  # promotion only "when space allows": no eviction for it
            self.promote(record, segment, packed, offset)
            return

    def promoting(self, name: str) -> bool:
        return name in self._promoting

    def promotion_of(self, name: str) -> TierTask | None:
        """The PROMOTE task of object `name` queued or in flight, if any (`kvtier keys` shows it)."""
        return self._promoting.get(name)

    def disk_reads(self, name: str) -> int:
        """Reads of disk-only object `name` counted towards its promotion (promote_after_reads)."""
        return self._disk_reads.get(name, 0)

    def promotion_room(self, segment: SegmentRecord, size: int, record: ObjectRecord | None = None) -> bool:
        """Whether a promotion of `size` bytes fits `segment`'s promotion budget (bytes in flight) and,
        with `record`, its owner's quota: a promotion is a DRAM copy charged to the rank (it took
        ranks over their quota, with nothing to bring them back until their next put). Promotions
        already in flight are charged when they land, so a rank can pass its quota by at most those."""
        if record is not None and record.owner is not None and record.owner.over_by(self.state.aligned(size)):
            return False
        in_flight = self._promoting_bytes[segment.segment_id]
        return not in_flight or in_flight + self.state.aligned(size) <= self.promotion_budget

    def promote(
        self, record: ObjectRecord, segment: SegmentRecord, packed: int, offset: int, prefetch: bool = False
    ) -> None:
        """Queue a PROMOTE of `record`'s disk copy `packed` into the DRAM range at `offset` (allocated)."""
        task = TierTask(
            next(self._ids),
            TaskKind.PROMOTE,
            segment.segment_id,
            record,
            record.name,
            record.size,
            record.checksum,
            dram_offset=offset,
            disk_location=packed & OFFSET_MASK,
            prefetch=prefetch,
        )
        self._promoting[record.name] = task
        self._promoting_bytes[segment.segment_id] += self.state.aligned(record.size)
        self._disk_reads.pop(record.name, None)
        self._enqueue(task)

    # ------------------------------------------------------------------ forgetting

    # ------------------------------------------------------------------ outcomes

    def done(
        self, segment_id: int, task_ids: list[int], statuses: list[int], locations: list[int], *, expired: bool = False
    ) -> list[int]:
        """Apply a segment's reports (or, with `expired`, `tick`'s verdict on tasks not reported in time).
        Per task: OK (applied now, or the same report applied before: a segment retries a report
        whose answer it lost), or NOT_PENDING for a task it does not hold (expired): the segment then
        withdraws a copy it wrote for it."""
        if not expired:
            unsettled = self._unsettled.get(segment_id)
            if unsettled:
                for task_id in task_ids:
                    unsettled.pop(task_id, None)
        out = []
        offloaded = forget_failed = forget_ok = False
        for task_id, status, location in zip(task_ids, statuses, locations, strict=True):
            task = self._in_flight.get(task_id)
            if task is None or task.segment_id != segment_id:
                again = not expired and self._reported.get(task_id) == (segment_id, location)
                out.append(_OK if again else int(Status.NOT_PENDING))
                continue
            del self._in_flight[task_id]
            if status != _OK:
                self.failures[task.kind.name.lower(), status_name(status)] += 1
            answer = _OK
            if task.kind is TaskKind.OFFLOAD:
                answer = self._offload_done(task, status, location)
                offloaded = True
                if answer == _OK and not expired:
                    self._reported[task_id] = (segment_id, location)
                    if len(self._reported) > _REPORTED_KEPT:
                        self._reported.popitem(last=False)
            elif task.kind is TaskKind.PROMOTE:
                self._promote_done(task, status, expired)
            else:
                self._forget_done(task, status)
                forget_failed = forget_failed or status != _OK
                forget_ok = forget_ok or status == _OK
            out.append(answer)
        name = self._names.get(segment_id, "")
        if not (expired or forget_failed or (name in self._forgets_failing and not forget_ok)):
            # It answers again (and a failing disk tombstoned one): its FORGETs are waited for again.
            # A report with a failed FORGET, or none after failures, proves nothing of its disk.
            self._forgets_stalled.discard(name)
            self._forgets_failing.discard(name)
        if offloaded:
            self.state.pressure.progress({segment_id})  # refill its pipeline at once, wake waiting puts
        if self.on_ack is not None:
            self.on_ack()
        return out

    def _alive(self, task: TierTask) -> bool:
        record = task.record
        return record is not None and self.state.visible(task.name) is record and record.state is ObjectState.COMPLETE

    def _offload_done(self, task: TierTask, status: int, location: int) -> int:
        """The answer to the segment's report: OK, or NOT_PENDING for a copy of an object removed or
        replaced while it was written (the segment tombstones it itself, before anything else of it
        is answered: a FORGET from here would leave a master restart in between to bring it back)."""
        self._end_offload(task)
        state = self.state
        if status == Status.CHECKSUM_MISMATCH and not self._alive(task):
            # Removed or replaced while it was read: its range was freed and may hold another
            # object's bytes now. That says nothing of the disk; a pause here would make a burst
            # of puts drop acknowledged copies for nothing (the segment wrote no copy).
            self.counters["offloads_of_removed_objects"] += 1
            return _OK
        if status != _OK:
            # Any other failure pauses offload on that segment for a while (the watermark pass drops
            # instead): retrying the same victim every tick would stop eviction there.
            self.counters["offload_failures"] += 1
            logger.warning(
                "offload failed segment_id=%d status=%s: offload paused %.0fs",
                task.segment_id,
                status_name(status),
                OFFLOAD_BACKOFF_S,
            )
            self._offload_paused_until[task.segment_id] = state.clock() + OFFLOAD_BACKOFF_S
            if status == Status.CHECKSUM_MISMATCH and self._alive(task):
                self._drop_corrupt_dram_copy(task)
            return _OK
        record = task.record
        if task.segment_id not in state.segments:
            self.forget(task.segment_id, task.name, location)  # owed: it mounts again to learn it
            return _OK
        if not self._alive(task):  # removed or replaced while it was being written
            self.counters["offloads_of_removed_objects"] += 1
            # The FORGET too: if the segment's own tombstone is lost (killed before it is durable), its
            # next mount's report of the copy is refused (the offload is settled: no fence names it).
            self.forget(task.segment_id, task.name, location)
            return int(Status.NOT_PENDING)
        assert record is not None
        self._newer_record_at(self._names.get(task.segment_id, ""), location)
        record.replicas = (*record.replicas, replica(task.segment_id, location, TIER_SSD))
        state.segments[task.segment_id].ssd_objects += 1
        self.counters["offloaded_objects"] += 1
        self.counters["offloaded_bytes"] += task.size
        dram = dram_key(task.segment_id)
        segment = state.segments[task.segment_id]
        target = (state.config.high_watermark - state.config.eviction_ratio) * segment.capacity
        # Offloaded to make room (and still above the eviction target): the DRAM copy goes, an
        # eviction of reason "offload". Copied ahead of need: both stay (nothing evicted, so nothing
        # counted: it was, and counted again when the copy later left under its own reason), and
        # eviction drops the least recently used such copies first.
        if not task.ahead and segment.used > target and any(r >> TIER_SHIFT == dram for r in record.replicas):
            counts = state.evictions.setdefault("offload", [0, 0])
            counts[0] += 1
            counts[1] += state.aligned(task.size)
            state.drop_dram_replica(record, task.segment_id)
        state.events.changed(record, "offloaded")
        return _OK

    def _drop_corrupt_dram_copy(self, task: TierTask) -> None:
        """The segment found the DRAM bytes do not match the object's checksum: that copy can only
        ever be a miss, so it goes (the object too if it has no other replica)."""
        state = self.state
        record = task.record
        assert record is not None
        source = replica(task.segment_id, task.dram_offset)
        if source not in record.replicas:
            return  # it moved meanwhile (drain, eviction): what failed was not this copy
        self.counters["corrupt_dram_copies"] += 1
        state.evict_one(record, "corrupt", task.segment_id)

    def _drop_corrupt_disk_copy(self, record: ObjectRecord, packed: int) -> None:
        """A disk copy that failed verification can only ever be a miss: drop and tombstone it."""
        self.counters["corrupt_disk_copies"] += 1
        if self.state.history is not None:
            segment = self.state.segments.get(packed >> TIER_SHIFT >> 2)
            name = segment.name if segment else ""
            self.state.history.left(record, "evicted:corrupt disk", name, replica=len(record.replicas) > 1)
        self.remove_disk_copy(record, packed, forget=True, reason="corrupt")

    def remove_disk_copy(self, record: ObjectRecord, packed: int, forget: bool, reason: str = "disk") -> None:
        """Take one disk replica off a live record (the object goes when it was the last replica:
        EVICTED for `reason`); with `forget`, the segment is told to tombstone it."""
        state = self.state
        segment_id = packed >> TIER_SHIFT >> 2
        if len(record.replicas) == 1:
            state.events.gone(record, EventKind.EVICTED, reason)
            state.discard(record.name, forget_disk=forget)
            return
        record.replicas = tuple(r for r in record.replicas if r != packed)
        state.events.changed(record, reason)
        state.segments[segment_id].ssd_objects -= 1
        if forget:
            self.forget(segment_id, record.name, packed & OFFSET_MASK)

    def _end_offload(self, task: TierTask) -> None:
        if self.offloading.get(task.name) is task:
            del self.offloading[task.name]
            self._offloading_bytes[task.segment_id] -= self.state.aligned(task.size)
            if not task.ahead:
                self._evicting_bytes[task.segment_id] -= self.state.aligned(task.size)

    def _promote_done(self, task: TierTask, status: int, expired: bool = False) -> None:
        state = self.state
        if self._promoting.get(task.name) is task:
            del self._promoting[task.name]
            self._promoting_bytes[task.segment_id] -= state.aligned(task.size)
        segment = state.segments.get(task.segment_id)
        if segment is None:
            if task.prefetch:
                self.counters["prefetch_failed"] += 1
            return  # its allocator went with it
        record = task.record
        ssd = replica(task.segment_id, task.disk_location, TIER_SSD)
        dram = dram_key(task.segment_id)
        if (
            status != _OK
            or not self._alive(task)
            or ssd not in record.replicas  # type: ignore[union-attr]
            or any(r >> TIER_SHIFT == dram for r in record.replicas)  # type: ignore[union-attr]
        ):
            if status != _OK:
                self.counters["promote_failures"] += 1
            if task.prefetch:
                self.counters["prefetch_failed"] += 1  # nothing new in DRAM for the reader
            if task.size and expired and state.reuse_margin_s:
                # Not reported: the segment may still be about to write (stopped between its deadline
                # check and the copy): the range waits out the clock-skew margin before reuse.
                until = state.clock() + state.reuse_margin_s
                state.free_after_leases(task.segment_id, task.dram_offset, task.size, until)
            elif task.size:
                segment.allocator.release(task.dram_offset, task.size)
            if status == Status.CHECKSUM_MISMATCH and self._alive(task) and ssd in record.replicas:  # type: ignore[union-attr]
                self._drop_corrupt_disk_copy(task.record, ssd)  # type: ignore[arg-type]
            return
        assert record is not None
        record.replicas = (replica(task.segment_id, task.dram_offset), *record.replicas)
        state.now_in_dram(record)
        state.events.changed(record, "promoted")
        state.commits.committed(task.segment_id, task.dram_offset, record)
        segment.objects += 1
        if record.owner is not None:
            record.owner.used += state.aligned(record.size)
        self.counters["promoted_objects"] += 1
        self.counters["promoted_bytes"] += task.size
        if task.prefetch:
            self.counters["prefetch_completed"] += 1

    # ------------------------------------------------------------------ inventories

    def report_disk_objects(
        self,
        segment_id: int,
        namespaces: list[str],
        keys: list[str],
        sizes: list[int],
        checksums: list[int],
        locations: list[int],
        groups: list[tuple[int, int]] | None = None,
    ) -> list[int]:
        """Register a segment's disk copies. Per copy: OK (now a replica, or already one);
        CHECKSUM_MISMATCH (the master knows the key with other bytes: the segment must forget the
        copy); PUT_IN_PROGRESS (a put of the key is pending: not registered); INVALID_KEY; INVALID_ARGUMENT
        (a size no segment could hold). `groups`: empty, or per copy the group tag its record carries
        (id, member count): a copy registered joins the forming of its group (GroupTable.adopted)."""
        state = self.state
        segment = state.segments[segment_id]
        now = state.clock()
        out = []
        forgotten = self._unacked_forgets.get(segment.name, {})
        fence = state.fences.get(segment.name)
        refused = int(Status.CHECKSUM_MISMATCH)  # the segment tombstones the copy
        for namespace, key, size, checksum, location in zip(namespaces, keys, sizes, checksums, locations, strict=True):
            if master_key_problem(key) or master_key_problem(namespace) or location > OFFSET_MASK:
                out.append(int(Status.INVALID_KEY))
                continue
            if size > MAX_SEGMENT_CAPACITY:  # no segment could hold it: garbage, not a copy
                out.append(int(Status.INVALID_ARGUMENT))
                continue
            name = object_name(namespace, key)
            if location in forgotten:
                if forgotten[location].name == name:  # removed while the segment was away: never back
                    out.append(refused)
                    continue
                self._newer_record_at(segment.name, location)  # another object's record there now
            if segment.disk_refused or (fence is not None and not fence.admits(name)):
                # Changed while the segment was away, or nothing can be proven about its previous
                # life (a master restart since, or an overflowed fence): kvtier.master.fences.
                state.fences.refused += 1
                out.append(refused)
                continue
            packed = replica(segment_id, location, TIER_SSD)
            record = state.visible(name)
            if record is None:
                record = ObjectRecord(name, size, (packed,), 0, now)
                record.complete(checksum)
                state.adopt(record)
                state.events.stored((record,), "recovered")
            elif record.state is ObjectState.PENDING:
                out.append(int(Status.PUT_IN_PROGRESS))
                continue
            elif record.size != size or record.checksum != checksum:
                out.append(int(Status.CHECKSUM_MISMATCH))
                continue
            elif packed in record.replicas:
                self._adopt_member(record, groups, len(out))
                out.append(_OK)
                continue
            elif any(r >> TIER_SHIFT == ssd_key(segment_id) for r in record.replicas):
                out.append(int(Status.CHECKSUM_MISMATCH))  # a second copy on one segment: keep the first
                continue
            else:
                record.replicas = (*record.replicas, packed)
                state.events.changed(record, "recovered")
            segment.ssd_objects += 1
            self._adopt_member(record, groups, len(out))
            out.append(_OK)
        if fence is not None:
            state.fences.readopted += out.count(_OK)
        return out

    def _adopt_member(self, record: ObjectRecord, groups: list[tuple[int, int]] | None, index: int) -> None:
        """The copy `index` of a disk inventory was registered as `record`: if its record carries a
        group tag, the record counts toward forming that group again (after a master restart, or a
        segment's return)."""
        if groups and (tag := groups[index])[0]:
            self.state.groups.adopted(record, *tag)

    def drop_disk_replicas(self, segment_id: int, namespaces: list[str], keys: list[str], locations: list[int]) -> int:
        """The segment is deleting these disk copies; objects left without replicas go. Copies dropped."""
        state = self.state
        dropped = 0
        for namespace, key, location in zip(namespaces, keys, locations, strict=True):
            name = object_name(namespace, key)
            record = state.visible(name)
            packed = replica(segment_id, location, TIER_SSD)
            if record is None or packed not in record.replicas:
                continue
            dropped += 1
            if state.history is not None:
                segment = state.segments.get(segment_id)
                where = segment.name if segment else ""
                state.history.left(record, "evicted:disk", where, replica=len(record.replicas) > 1)
            self.remove_disk_copy(record, packed, forget=False)  # the segment deletes it itself
        self.counters["disk_copies_dropped"] += dropped
        return dropped

    # ------------------------------------------------------------------ time and loss

    def tick(self, now: float) -> None:
        """Tasks not reported by their deadline failed (the segment died or hung). A PROMOTE's
        segment skips the DRAM write once its share of the deadline is gone (see PollTierTasks),
        so its range is free to go now."""
        expired = [t for t in self._in_flight.values() if t.deadline <= now]
        for task in expired:
            logger.warning(
                "tier task expired task_id=%d kind=%s segment_id=%d", task.task_id, task.kind.name, task.segment_id
            )
            self.done(task.segment_id, [task.task_id], [int(Status.TIMEOUT)], [0], expired=True)
        if expired:
            self.counters["expired_tasks"] += len(expired)
        self._retry_forgets(now)

    def segment_dropped(self, segment_id: int) -> None:
        """Forget every task of a segment that is gone (its ranges went with its allocator). Its FORGETs
        not acknowledged yet are owed: no answer waits for them any more (one whose barrier was not
        made yet, a prefix removal's, would not see them at all)."""
        segment_name = self._names.get(segment_id, "")
        for task in self._unacked_forgets.get(segment_name, {}).values():
            self._owe(segment_name, task)
        unsettled = self._unsettled.pop(segment_id, {})
        changed = {task.name for task in unsettled.values() if not self._alive(task)}
        if changed and segment_id in self._names:
            self._unsettled_at_drop.setdefault(self._names[segment_id], set()).update(changed)
        self._queues.pop(segment_id, None)
        self._offload_paused_until.pop(segment_id, None)
        for task in [t for t in self._in_flight.values() if t.segment_id == segment_id]:
            del self._in_flight[task.task_id]
        for name, task in list(self.offloading.items()):
            if task.segment_id == segment_id:
                del self.offloading[name]
        self._offloading_bytes.pop(segment_id, None)
        self._evicting_bytes.pop(segment_id, None)
        for name, task in list(self._promoting.items()):
            if task.segment_id == segment_id:
                del self._promoting[name]
        self._promoting_bytes.pop(segment_id, None)

    def forget_reads(self, name: str) -> None:
        self._disk_reads.pop(name, None)
