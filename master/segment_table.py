"""Segment membership of `MasterState` (kvtier.master.state): mount and remount, the recovery gate,
heartbeats, and dropping a segment with every replica on it (fencing what its index may still
claim, kvtier.master.fences), and the sweeps that clean up after a segment's death or a prefix
removal in slices (kvtier.master.sweeps). A mixin of `MasterState`: same tables, same single owner
thread."""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence

from kvtier.master.allocator import OffsetAllocator
from kvtier.master.clock_skew import SkewReading
from kvtier.master.events import EventKind
from kvtier.master.records import (
    MAX_SEGMENT_CAPACITY,
    SEGMENT_SHIFT,
    ObjectRecord,
    ObjectState,
)
from kvtier.master.recovery import Recovery
from kvtier.master.state_types import MountResult, SegmentRecord, SegmentState
from kvtier.master.tier_tasks import is_dram
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

_PENDING = ObjectState.PENDING

HEARTBEAT_EXPIRED = "heartbeat ttl expired"
FEED_SILENT = "commit feed silent"
UNMOUNTED = "unmounted"  # by the segment itself
EXPULSIONS = (HEARTBEAT_EXPIRED, FEED_SILENT)  # drops after which the segment's index is stale


class SegmentTable:
    """Segments joining, living and leaving; mixed into `MasterState`, whose tables it updates."""

    def mount_segment(
        self,
        cluster_id: str,
        name: str,
        host_id: str,
        endpoints: Sequence[str],
        capacity: int,
        incarnation: str = "",
        ssd_capacity: int = 0,
        offload: bool = False,
        disk_engine: str = "",
        ssd_max_object: int = 0,
        inventory: bool = False,
        previous_segment_id: int = 0,
        previous_applied_seq: int = 0,
    ) -> MountResult:
        """Register a segment. Returns CLUSTER_MISMATCH, INVALID_ARGUMENT, SEGMENT_DRAINED or OK.

        With `inventory` the segment is RECOVERING (no allocations) until it has
        reported the objects its region holds (kvtier.master.recovery).
        `previous_segment_id` / `previous_applied_seq`: this master's id of the segment's last mount
        session and the last commit-log notice its index applied under it (0: none, or another
        master's); they release what its fence holds only for want of an acknowledgement
        (kvtier.master.fences, invariant 4).

        A name that is already mounted is replaced (its old replicas are dropped) when the mount is
        the same region's (the process mounting again) or the old mount stopped heartbeating (the
        previous process is gone: a restart). A second live process under the name, another region
        that heartbeats (another host, or another --shm-dir: the region file lock guards one host's
        directory only), is refused with SEGMENT_NAME_IN_USE: replacing it each time, the two unmounted
        each other at every heartbeat, for good, and acknowledged puts went with each swap.
        """
        if cluster_id != self.config.cluster_id:
            return MountResult(
                Status.CLUSTER_MISMATCH,
                error=f"segment is in cluster {cluster_id!r}, master in {self.config.cluster_id!r}",
            )
        if self.drainer.is_drained(name, incarnation):
            return MountResult(Status.SEGMENT_DRAINED, error=f"segment {name!r} was drained; restart it to rejoin")
        if not name or not endpoints or capacity < self.config.alignment:
            return MountResult(Status.INVALID_ARGUMENT, error="a segment needs a name, an endpoint and capacity")
        if capacity > MAX_SEGMENT_CAPACITY:
            return MountResult(Status.INVALID_ARGUMENT, error=f"a segment holds at most {MAX_SEGMENT_CAPACITY} bytes")
        old = self._segments_by_name.get(name)
        if old is not None:
            problem, frees_in_s = self._name_in_use(self.segments[old], host_id, endpoints, incarnation)
            if problem:
                return MountResult(Status.SEGMENT_NAME_IN_USE, error=problem, name_frees_in_s=frees_in_s)
        if old is not None:
            logger.info("segment remount name=%s old_id=%d: dropping its replicas", name, old)
            self.drop_segment(old, reason="remounted")
        if inventory and previous_segment_id:
            self.fences.release(name, previous_segment_id, previous_applied_seq)
        now = self.clock()
        # A segment's inventory is taken by a master rebuilding itself (recovering, with saved state
        # telling whom it expelled), or through the fence this master opened when it dropped the
        # segment (kvtier.master.fences). Otherwise removals and new puts may have happened that
        # it would contradict; and an expelled segment without a fence can prove nothing.
        fence = self.fences.get(name)
        if fence is not None:
            accepted = inventory and not fence.everything
            disk_refused = fence.everything
        else:
            accepted = inventory and self.recovery.active and name not in self.expelled
            disk_refused = name in self.expelled
        segment = SegmentRecord(
            segment_id=next(self._segment_ids),
            name=name,
            host_id=host_id,
            endpoints=tuple(endpoints),
            allocator=OffsetAllocator(capacity, self.config.alignment, track=False),
            last_heartbeat=now,
            mounted_at=now,
            incarnation=incarnation,
            ssd_capacity=ssd_capacity,
            offload=offload and ssd_capacity > 0,
            disk_engine=disk_engine,
            ssd_max_object=ssd_max_object,
            state=SegmentState.RECOVERING if inventory else self.drainer.mounted_state(name, incarnation),
            inventory_accepted=accepted,
            disk_refused=inventory and disk_refused,
            saved=not self.save_mounts,
        )
        self.segments[segment.segment_id] = segment
        self._segments_by_name[name] = segment.segment_id
        self.placement_order.add(segment)
        if self.quarantine.is_quarantined(name):  # by name: a re-mount is not a cure
            self.refresh_quarantine()
        self.tiering.mounted(segment)
        self.commits.mounted(segment.segment_id, keeps_index=inventory)
        self.saved_state_stale = True
        if not inventory:
            self.recovery.reported.add(name)
        logger.info(
            "segment mounted id=%d name=%s capacity=%d endpoints=%s", segment.segment_id, name, capacity, endpoints
        )
        return MountResult(Status.OK, segment, discard_index=inventory and not accepted)

    def _name_in_use(
        self, old: SegmentRecord, host_id: str, endpoints: Sequence[str], incarnation: str
    ) -> tuple[str, float]:
        """Why a mount under `old`'s name from another region must wait, and how long until the name
        frees if `old` stays silent; ("", 0) when it may take the name now: the same region mounting
        again; a new process on the same host and shared-memory directory (it holds the region file's
        lock, so `old`'s process is gone: a restart); or `old` silent for segment_ttl_s (what would
        expel it anyway). Silence alone is no proof of death sooner: a holder stopped for a few
        seconds lost every object to a newcomer from another directory."""
        if not incarnation or incarnation == old.incarnation:
            return "", 0.0  # the same region mounting again (or a client that names none: the old rule)
        if (
            host_id
            and host_id == old.host_id
            and (lock := _region_lock(endpoints))
            and lock == _region_lock(old.endpoints)
        ):
            return "", 0.0
        silent = self.clock() - old.last_heartbeat
        window = self.config.segment_ttl_s
        if silent >= window:
            return "", 0.0  # expelled by now anyway
        problem = (
            f"segment name {old.name!r} is mounted by another live segment (host {old.host_id!r}, heartbeat "
            f"{silent:.1f}s ago); give this one another --name, or stop that one"
        )
        return problem, window - silent

    def begin_recovery(
        self, expected: set[str], timeout_s: float, expelled: set[str] = frozenset(), max_s: float = 300.0
    ) -> None:
        """Take segment inventories, and answer data RPCs with UNAVAILABLE until the `expected`
        segments have reported theirs or `timeout_s` has passed (up to `max_s` while one is still
        reporting; kvtier.master.recovery). `expelled` segments (saved by an earlier incarnation)
        must discard their index."""
        self.expelled = set(expelled)
        self.recovery = Recovery(
            started_at=self.clock(), expected=set(expected), timeout_s=timeout_s, max_s=max(max_s, timeout_s)
        )
        self.check_recovery()

    def check_recovery(self) -> None:
        """Finish the recovery when it is due (kvtier.master.recovery.Recovery.check). An expected
        segment not mounted by then (dead, stopped, slower than recovery_timeout_s) is treated as
        one this incarnation expelled: a fence records every key changed from now on, and its name is
        saved as expelled. Otherwise it returned to a master that knew nothing of it, and its SSD
        copies came back unchecked: a key put again and removed meanwhile read its old version."""
        if not self.recovery.check(self.clock(), mid_inventory=self.mid_inventory()):
            return
        # Not those expelled already (saved so by an earlier incarnation): without a fence their copies
        # are refused, and a fence opened now would admit what changed before it.
        expelled = self.expelled
        missing = sorted(self.recovery.expected - self.recovery.reported - self._segments_by_name.keys() - expelled)
        for name in missing:
            self.fences.open(name, ())
            expelled.add(name)
        # Segments still reporting their inventories (past recovery_max_s, or not expected) go on
        # reporting through a fence too: their disk copies were taken unchecked once the master served.
        for segment in self.segments.values():
            if segment.state is SegmentState.RECOVERING and segment.name not in expelled:
                self.fences.open(segment.name, ())
        if missing:
            self.state_generation += 1  # what changes a key from now on is answered once this is saved
            self.saved_state_stale = True

    def forgive_deafness(self, gap_s: float) -> None:
        """The master did not run for `gap_s` (SIGSTOP, a stalled loop, a suspended VM): it heard
        nobody meanwhile, their heartbeats and polls sit unread in its sockets. Silence counts only
        while it listened, so every segment is credited the gap; otherwise the first tick after a long
        stop would expel every segment before reading what they sent, their objects lost to a pause of
        the master's own. The ticker (kvtier.master.server) measures the gap."""
        logger.warning("master was not running for %.1fs: segments are not counted silent for it", gap_s)
        for segment in self.segments.values():
            segment.last_heartbeat += gap_s
        self.commits.forgive(gap_s)

    def segment_named(self, name: str) -> SegmentRecord | None:
        """The mounted segment called `name`, if any (names are unique among mounted segments)."""
        segment_id = self._segments_by_name.get(name)
        return self.segments.get(segment_id) if segment_id else None

    def mid_inventory(self) -> bool:
        """Whether an expected segment is still reporting its inventory: recovery waits for it."""
        expected = self.recovery.expected
        return any(s.state is SegmentState.RECOVERING and s.name in expected for s in self.segments.values())

    @property
    def serving(self) -> bool:
        """False while recovering: data RPCs wait (clients retry) until the inventories are in."""
        return self.recovery.finished_at is not None

    def unmount_segment(self, segment_id: int) -> Status:
        """Remove a segment and every replica on it. SEGMENT_NOT_FOUND or OK."""
        if segment_id not in self.segments:
            return Status.SEGMENT_NOT_FOUND
        self.drop_segment(segment_id, reason=UNMOUNTED)
        return Status.OK

    def heartbeat(self, segment_id: int, ssd_used: int = 0, io_counters: dict[str, int] | None = None) -> Status:
        """Keep a segment alive (and note what it reports). SEGMENT_NOT_FOUND tells it to mount again."""
        segment = self.segments.get(segment_id)
        if segment is None:
            return Status.SEGMENT_NOT_FOUND
        segment.last_heartbeat = self.clock()
        segment.ssd_used = ssd_used
        if io_counters:
            segment.io_counters = io_counters
        return Status.OK

    def note_clock_skew(self, segment_id: int, reading: SkewReading | None) -> None:
        """A mount's or heartbeat's clock reading (kvtier.master.clock_skew): beyond the tolerance
        the segment leaves placement, back within it it returns. Logged when that changes."""
        segment = self.segments.get(segment_id)
        if segment is None or reading is None:
            return
        segment.clock_skew_s = reading.skew_s
        if reading.skewed != segment.clock_skewed:
            segment.clock_skewed = reading.skewed
            if reading.skewed:
                logger.warning(
                    "segment clock skew name=%s skew_s=%.3f tolerance_s=%.3f: no new objects until it is fixed",
                    segment.name,
                    reading.skew_s,
                    self.config.clock_skew_tolerance_s,
                )
            else:
                logger.info("segment clock fixed name=%s skew_s=%.3f: placed on again", segment.name, reading.skew_s)

    def report_segment_failures(self, failures: Sequence[tuple[str, int, str]], reporter: str) -> list[str]:
        """A client's data-plane failures, (segment name, count, kind) each (kvtier.master.quarantine).
        Names not mounted are ignored (a late report about a segment gone, or made up). The names of
        the reported segments now in quarantine."""
        quarantined = []
        for name, count, kind in failures:
            if name in self._segments_by_name and self.quarantine.report(name, count, kind, reporter):
                quarantined.append(name)
        if quarantined:  # kept in memory only: a restarted master starts without (it is advice)
            self.refresh_quarantine()
        return quarantined

    def refresh_quarantine(self) -> None:
        """The ids of the mounted segments in quarantine, after it changed."""
        by_name = self._segments_by_name
        self.quarantined_ids = {by_name[n] for n in self.quarantine.names if n in by_name}

    def drop_segment(self, segment_id: int, reason: str) -> None:
        """Forget a mounted segment and every replica on it (objects left without one go); an
        expulsion or a segment keeping its index opens a fence (kvtier.master.fences)."""
        segment = self.segments.pop(segment_id)
        self.placement_order.remove(segment_id)
        if self._segments_by_name.get(segment.name) == segment_id:
            del self._segments_by_name[segment.name]
        self.tiering.segment_dropped(segment_id)
        self.drainer.segment_dropped(segment_id)
        self.upserts.segment_dropped(segment_id)  # new versions written there can never complete
        if reason in EXPULSIONS:
            self.lease_expiries["segment"] += 1
        if reason != UNMOUNTED and segment.direct_reads:
            # Its direct-read lease (two heartbeat intervals from the last heartbeat it sent, which we
            # received after) may outlive the drop: what changes a key it held waits for its end. A
            # segment that unmounts itself stopped serving them first.
            lease_end = segment.last_heartbeat + self.config.direct_read_lease_s
            self.direct_read_fence = max(self.direct_read_fence, lease_end)
        if self.commits.keeps_index(segment_id):
            # Its index and disk copies miss what happens from now on: fenced while this master runs,
            # and saved as expelled for the next one (kvtier.master.fences).
            # Names of its unacknowledged notices may leave the fence again if it proves, when it
            # returns, that its index applied them (a relayed put's client heard OK before the master
            # had that acknowledgement); those about its SSD copies may not.
            # A notice about the version that is still the key's (its commit, an offload's or a
            # promotion's tier move) changed nothing: fencing it lost verified disk copies of
            # untouched objects to every kill -9 of a busy segment.
            seed = self.tiering.unacked_forget_names(segment.name) | self.tiering.unsettled_offload_names(segment.name)
            # `lookup`, not `visible`: settling a record here (a RemovePrefix sweep in progress) would
            # add drop notices to the feed being read. A record a sweep will take is taken after the
            # fence is open, and touches it then.
            changed = self.commits.unacked_seqs(segment_id, self.lookup)
            self.fences.open(segment.name, seed, changed, segment_id)
            # PutEnds still waiting with a copy here will be answered SEGMENT_NOT_FOUND: fenced now,
            # not when they are answered (the segment could mount again and be re-adopted first).
            self.fences.touch_many(self.commits.written_to(segment_id))
            self.expelled.add(segment.name)
            self.state_generation += 1
        self.commits.segment_dropped(segment_id)
        self.saved_state_stale = True
        self._deferred = [d for d in self._deferred if d[2] != segment_id]
        heapq.heapify(self._deferred)
        # Dead from now on: lookups skip (settle) its copies at once, the walk over every record
        # happens in slices between requests (kvtier.master.sweeps); logged when it ends.
        self.sweeps.segment_died(segment_id, segment.name, reason)
        logger.warning(
            "segment dropped id=%d name=%s reason=%s: its copies are being forgotten", segment_id, segment.name, reason
        )
        if self.sweep_inline:
            while self.sweep(1 << 62):
                pass

    def sweep(self, budget: int, max_s: float = 0.0) -> bool:
        """Clean up after prefix removals and dead segments: visit at most `budget` names (the oldest
        task first), settling each, and stop after `max_s` seconds (0: no limit; checked every 16
        names). Whether work is left. The server calls it between requests
        (kvtier.master.sweeps.run_sweeper); each call is one slice of the event loop."""
        sweeps = self.sweeps
        task = sweeps.current()
        if task is None:
            return False
        lookup = self.lookup
        until = time.perf_counter() + max_s if max_s else 0.0
        left = budget
        while left > 0:
            # A few names at a time, each batch a fresh seek from the cursor: the time bound stops
            # a slice between two batches, and names added or removed meanwhile never derail it.
            names = self._index.after(task.cursor, task.end, min(left, 16), inclusive=not task.started)
            task.started = True
            for name in names:
                record = lookup(name)
                if record is not None:
                    self._settled(record)
            if len(names) < min(left, 16):
                sweeps.finish(task)
                if task.segment_id:
                    logger.warning(
                        "segment dropped id=%d name=%s objects_lost=%d", task.segment_id, task.segment, task.removed
                    )
                break
            task.cursor = names[-1]
            left -= len(names)
            if until and time.perf_counter() > until:
                break
        return sweeps.current() is not None

    def _settled(self, record: ObjectRecord) -> ObjectRecord | None:
        """`record` after applying what a prefix removal or a segment's death still owes it: None
        when that removes it. Called only while `self.sweeps.active`."""
        sweeps = self.sweeps
        removal = sweeps.removing(record)
        if removal is not None:
            removal.removed += 1
            self.events.gone(record, EventKind.REMOVED, "remove_prefix")
            self.discard(record.name)
            return None
        dead = sweeps.dead_segments
        if dead and any(r >> SEGMENT_SHIFT in dead for r in record.replicas):
            return self._lose_dead_replicas(record)
        return record

    def _strip_dead(self, record: ObjectRecord) -> None:
        """Take `record`'s copies on dead segments off it, and their DRAM bytes off its owner."""
        dead = self.sweeps.dead_segments
        replicas = record.replicas
        if not any(r >> SEGMENT_SHIFT in dead for r in replicas):
            return
        if record.owner is not None:
            lost = sum(1 for r in replicas if r >> SEGMENT_SHIFT in dead and is_dram(r))
            record.owner.used -= self.aligned(record.size) * lost
        record.replicas = tuple(r for r in replicas if r >> SEGMENT_SHIFT not in dead)

    def _lose_dead_replicas(self, record: ObjectRecord) -> ObjectRecord | None:
        """What a dead segment's drop does to one record: its copies there go; a record left with
        none, or pending (its writer's copy is lost), goes (None); one left only on disk leaves the
        eviction order."""
        dead = self.sweeps.dead_segments
        task = next(dead[r >> SEGMENT_SHIFT] for r in record.replicas if r >> SEGMENT_SHIFT in dead)
        self._strip_dead(record)
        name = record.name
        if not record.replicas or record.state is _PENDING:
            task.removed += 1
            if self.history is not None:
                self.history.left(record, f"segment:{task.reason}", task.segment)
            self.events.gone(record, EventKind.REMOVED, f"segment:{task.reason}")
            self._delete(self._pop(name), changed=False)  # lost, not changed: no fence needs it
            return None
        if record.state is ObjectState.COMPLETE:
            self.events.changed(record, f"segment:{task.reason}")
        if not any(is_dram(r) for r in record.replicas):
            self._leave_dram(record)
        return record


def _region_lock(endpoints: Sequence[str]) -> str:
    """The region lock's domain a segment's endpoints name: its shared-memory grant socket's path (in
    its --shm-dir, next to the locked region file), "" without an shm endpoint."""
    for endpoint in endpoints:
        if endpoint.startswith("shm://"):
            return endpoint[len("shm://") :].partition("?")[0]
    return ""
