"""Rebuilding the master's tables from segment inventories (restart and failover).

A new master incarnation (a restart, or a standby elected leader) starts
with empty tables. Segment servers notice the new epoch (their heartbeat
answers SEGMENT_NOT_FOUND, or the leader changed), mount again with
`inventory` set and report what their DRAM region holds
(`ReportDramObjects`, from the index each keeps from the commit log, see
kvtier.master.commits and kvtier.segment_server.dram_index; every object's
bytes verified against its checksum first) and what their SSD tier holds
(`ReportDiskObjects`, as after any mount). A segment takes no allocations
until its inventory is complete: new puts must not land on ranges it has
yet to report.

DRAM inventories are taken while recovering, only from segments not
expelled (saved state): once the master serves, removals and new puts
happen that an index reported later would contradict, and an expelled
segment's index misses what happened after it was expelled. Such segments
are told at mount to discard their index (`discard_index`), and their SSD
copies are refused: lost to recompute, never served stale. The exception:
a segment this master dropped and fenced (kvtier.master.fences) reports
its inventory at any time, and every key its fence admits is re-adopted by
the same rules. A master without saved state
(no `--state-dir`, no etcd) never recovers: it cannot know whom it expelled.

The master answers data RPCs with UNAVAILABLE ("recovering") until every
segment it expects is back, or `recovery_timeout_s` has passed (longer while
an expected segment is still reporting, up to `recovery_max_s`); clients retry
within their timeout. The segments it expects are those mounted when the
previous incarnation last saved its state (kvtier.master.persist).

What is rebuilt, and from where:
- objects, their replicas (DRAM and SSD), sizes and checksums: inventories;
- quota accounting (which rank owns which bytes), pins (hard, and soft with
  the time they had left): the segments' indexes carry them;
- instance registrations (TP x PP and budget): the saved state;
- read leases: every rebuilt object starts under one full lease, because
  readers of the previous incarnation may still be copying its bytes.
Not rebuilt: puts that had not reached PutEnd (their ranges are free in the
new books, their PutEnd answers NOT_PENDING: rolled back on both sides);
pending tier tasks (offloads are chosen again; a disk copy written but not
reported is reported by the next inventory).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.master.records import PIN_HARD, PIN_SOFT, TIER_SHIFT, ObjectRecord, ObjectState, object_name, replica
from kvtier.master.state_types import SegmentState, master_key_problem
from kvtier.master.tier_tasks import dram_key
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState

logger = logging.getLogger(__name__)

_OK = int(Status.OK)


@dataclass(slots=True)
class DramObjects:
    """One ReportDramObjects chunk as parallel lists (see DramObjectsRequest)."""

    namespaces: Sequence[str]
    keys: Sequence[str]
    sizes: Sequence[int]
    checksums: Sequence[int]
    offsets: Sequence[int]
    instances: Sequence[str]
    ranks: Sequence[int]
    pins: Sequence[int]
    pin_ttl_ms: Sequence[int]
    group_ids: Sequence[int] = ()  # empty, or per object: its group (0: none), kvtier.master.groups
    group_sizes: Sequence[int] = ()


@dataclass(slots=True)
class Recovery:
    """Progress of the current incarnation's recovery (all times from the state's clock)."""

    started_at: float
    expected: set[str] = field(default_factory=set)  # segment names to wait for
    reported: set[str] = field(default_factory=set)  # names whose inventory is complete
    objects: int = 0  # DRAM copies registered from inventories
    refused: int = 0  # inventory entries not registered
    finished_at: float | None = None
    timeout_s: float = 5.0
    max_s: float = 300.0  # while an expected segment is mid-inventory (its chunks keep it alive)

    @property
    def active(self) -> bool:
        return self.finished_at is None

    def check(self, now: float, mid_inventory: bool = False) -> bool:
        """Finish when everything expected is back, or time is up and no expected segment is in
        the middle of its inventory (a large one takes a while to verify and report), or at `max_s`
        whatever happens; True when it just finished."""
        if self.finished_at is not None:
            return False
        waited = now - self.started_at
        if self.expected <= self.reported or (waited >= self.timeout_s and not mid_inventory) or waited >= self.max_s:
            self.finished_at = now
            missing = sorted(self.expected - self.reported)
            logger.info(
                "recovery finished seconds=%.3f segments=%d objects=%d refused=%d missing=%s",
                now - self.started_at,
                len(self.reported),
                self.objects,
                self.refused,
                ",".join(missing) or "none",
            )
            return True
        return False

    def figures(self, now: float) -> dict[str, float]:
        return {
            "segments_expected": float(len(self.expected)),
            "segments_reported": float(len(self.reported)),
            "objects": float(self.objects),
            "refused": float(self.refused),
            "seconds": (self.finished_at if self.finished_at is not None else now) - self.started_at,
            "active": 1.0 if self.active else 0.0,
        }


def report_dram_objects(state: MasterState, segment_id: int, chunk: DramObjects) -> list[int]:
    """Register DRAM objects a recovering segment reports. Per object: OK; INVALID_RANGE when its
    range overlaps another, is out of order or out of bounds; CHECKSUM_MISMATCH when the master
    knows the key with other bytes; PUT_IN_PROGRESS when a put of the key is pending;
    INVALID_KEY; INVALID_ARGUMENT for all when the inventory is not taken (recovery is over, or the
    segment was told to discard its index). The segment drops every entry not answered OK from
    its index."""
    segment = state.segments[segment_id]
    fence = state.fences.get(segment.name)
    if (
        segment.state is not SegmentState.RECOVERING
        or not segment.inventory_accepted
        or not (state.recovery.active or fence is not None)
    ):
        return [int(Status.INVALID_ARGUMENT)] * len(chunk.keys)  # too late: the master serves already
    now = state.clock()
    segment.last_heartbeat = now  # a large inventory takes a while: it is alive
    lease_until = now + state.config.lease_s
    allocator = segment.allocator
    dram = dram_key(segment_id)
    out: list[int] = []
    for namespace, key, size, checksum, offset, instance, rank, pin, pin_ttl_ms in zip(
        chunk.namespaces,
        chunk.keys,
        chunk.sizes,
        chunk.checksums,
        chunk.offsets,
        chunk.instances,
        chunk.ranks,
        chunk.pins,
        chunk.pin_ttl_ms,
        strict=True,
    ):
        if master_key_problem(key) or master_key_problem(namespace):
            out.append(int(Status.INVALID_KEY))
            continue
        name = object_name(namespace, key)
        if fence is not None and not fence.admits(name):
            out.append(int(Status.CHECKSUM_MISMATCH))  # changed while the segment was away
            state.fences.refused += 1
            continue
        record = state.visible(name)  # settled: a copy on a dead segment being swept is no copy
        if record is not None:
            if record.state is ObjectState.PENDING:
                out.append(int(Status.PUT_IN_PROGRESS))
                continue
            if record.size != size or record.checksum != checksum:
                out.append(int(Status.CHECKSUM_MISMATCH))
                continue
            if any(r >> TIER_SHIFT == dram for r in record.replicas):
                out.append(int(Status.CHECKSUM_MISMATCH))  # a second copy on one segment: keep the first
                continue
        if size and not allocator.reserve_ascending(offset, size):
            out.append(int(Status.INVALID_RANGE))
            continue
        packed = replica(segment_id, offset)
        owner = state.quotas.owner(instance, rank)
        if record is None:
            record = ObjectRecord(name, size, (packed,), 0, now, owner, _pin_until(pin, pin_ttl_ms, now))
            record.complete(checksum)
            state.adopt(record)
            state.events.stored((record,), "recovered")  # visible again (a returning segment's copy)
            if owner is not None:
                owner.objects += 1
        else:
            record.replicas = (packed, *record.replicas)
            state.now_in_dram(record)
            state.events.changed(record, "recovered")
            record.pin_until = max(record.pin_until, _pin_until(pin, pin_ttl_ms, now))
            if record.owner is None and owner is not None:  # known so far from a disk copy (no owner)
                record.owner = owner
                owner.objects += 1
            elif owner is not None and not owner.objects:
                state.quotas.forget_idle(owner)  # made for this copy, which is charged elsewhere
        record.lease_until = max(record.lease_until, lease_until)
        state.leases.uncounted(record, lease_until)
        if record.owner is not None:
            record.owner.used += state.aligned(size)
        segment.objects += 1
        state.recovery.objects += 1
        if chunk.group_ids and (group_id := chunk.group_ids[len(out)]):  # this object's index: len(out)
            state.groups.adopted(record, group_id, chunk.group_sizes[len(out)])
        out.append(_OK)
    state.recovery.refused += sum(1 for s in out if s != _OK)
    if fence is not None:
        state.fences.readopted += out.count(_OK)
    return out


def inventory_done(state: MasterState, segment_id: int) -> None:
    """The segment reported everything: it takes allocations from now on."""
    segment = state.segments[segment_id]
    if segment.state is SegmentState.RECOVERING:
        # DRAINING while a drain of this process goes on
        segment.state = state.drainer.mounted_state(segment.name, segment.incarnation)
        if segment.name in state.expelled:
            # It emptied its stale index, or re-adopted what its fence admitted: consistent again.
            state.expelled.discard(segment.name)
            state.saved_state_stale = True
        state.fences.close(segment.name)
        state.recovery.reported.add(segment.name)
        state.writers_after_inventory(segment_id)  # copies named at its mount, in what its books left free
        logger.info(
            "segment inventory complete id=%d name=%s objects=%d used=%d",
            segment_id,
            segment.name,
            segment.objects,
            segment.used,
        )
        state.check_recovery()


def _pin_until(pin: int, pin_ttl_ms: int, now: float) -> float:
    if pin == PIN_HARD:
        return math.inf
    if pin == PIN_SOFT and pin_ttl_ms:
        return now + pin_ttl_ms / 1000
    return 0.0
