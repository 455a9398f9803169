"""Backpressure on puts: nothing acknowledged is dropped while the SSD tier has room.

A segment whose DRAM is full can make room for a put by dropping DRAM copies.
Copies that are redundant (the object has another replica, e.g. its disk copy)
cost nothing to drop. An object whose only copy is a DRAM copy that its
segment's SSD tier could take is different: dropping it loses bytes a writer
was told were stored. `dram_full_policy` decides:

- `wait` (default): such a copy ("protected") is never dropped to make room.
  The allocation that would need it queues offloads of the least recently used
  uncopied objects at once (the segment's long poll is woken), and the put
  waits, asynchronously, for offload progress (each TierTasksDone, and every
  tick for space freed otherwise), retrying placement, at most
  `put_backpressure_s` (or the caller's `wait_ms`, when shorter). Keys still
  without room then fail with OFFLOAD_BEHIND: nothing was stored for them.
  Copies that will never be offloaded (`Tiering.refusal`: too large for the
  tier, not admitted, no tier) are not protected, nor is anything on a segment
  whose offload is paused after a failure (a broken or full disk: the tier has
  no room, and a cache that waits for it would stall for good).
- `drop`: such copies are dropped (lost to recompute), as before this module.

Every object dropped without an SSD copy is counted by reason
(`dropped_without_ssd_copy`, see `drop_reason`).

`Pressure` is the decision logic, plain and synchronous, owned by
`MasterState`'s thread like everything else. `PutWaiter` is the asynchronous
wait, shared by both doors of the master (the gRPC servicer and the fast path):
a door calls the PutStart handler; when `MasterHandlers.take_put_hold()` gives
a `HeldPut`, it answers with `await PutWaiter.finish(held)` instead, and the
event loop goes on serving everything else meanwhile.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.master import admission
from kvtier.master.eviction import pick_victims
from kvtier.master.placement import REDUNDANT_SCAN
from kvtier.master.records import TIER_SHIFT, ObjectRecord, replica_segment
from kvtier.master.tier_tasks import dram_key, is_dram, ssd_key
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState, PutOptions, PutStartResult, SegmentRecord

POLICIES = ("wait", "drop")
_BEHIND = int(Status.OFFLOAD_BEHIND)
# Seconds a put waited for offload (kvtier_master_put_backpressure_seconds).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Reasons an object went without an SSD copy (kvtier_master_dropped_without_ssd_copy_total).
DROP_REASONS = ("policy_drop", "offload_failed", "too_large", "not_admitted", "no_ssd_tier", "quota", "corrupt")
_CAPACITY_REASONS = ("allocation", "watermark")  # eviction reasons refined by drop_reason


@dataclass(slots=True)
class WaitHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs in the exposition's form, +Inf last."""
        out, running = [], 0
        for bound, count in zip((*WAIT_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class Pressure:
    """Which DRAM copies may be dropped for room, offload feeding, and the counters. See the module docstring."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self.waits = state.config.dram_full_policy == "wait"
        # Segments where this PutStart found room only by dropping protected copies (reset per call).
        self.blocked: set[int] = set()
        self.dropped: Counter[str] = Counter()  # reason -> objects dropped without an SSD copy
        self.waited = WaitHistogram()  # puts that waited, and how long
        self.failed_keys = 0  # keys answered OFFLOAD_BEHIND
        self.waiting = 0  # PutStarts waiting now
        # segment id -> when a PutEnd's feed found nothing to queue there (not tried again for a tick)
        self._nothing_to_feed: dict[int, float] = {}
        self.notify: Callable[[], None] | None = None  # wakes waiting puts (PutWaiter)

    # ------------------------------------------------------------------ decisions

    def protected(self, segment: SegmentRecord) -> Callable[[ObjectRecord], bool] | None:
        """A predicate of the copies on `segment` that must not be dropped for room, or None when
        none is protected there (policy drop, no tier, offload paused after a failure)."""
        tiering = self.state.tiering
        if not self.waits:
            return None
        if not tiering.can_offload(segment):
            # Paused after a failure: drop, except copies whose offload is queued or in flight. Those
            # end soon either way, and dropping one makes its offload fail the segment's checksum
            # check, which would pause offload again (a cascade of drops).
            offloading = tiering.offloading
            return (lambda record: record.name in offloading) if offloading else None
        refusal = tiering.refusal
        # One replica = this DRAM copy is the only one (the caller looks at copies on this segment).
        return lambda record: len(record.replicas) == 1 and refusal(record, segment) is None

    def drop_reason(self, record: ObjectRecord, segment: SegmentRecord | None) -> str:
        """Why the only copy of `record`, a DRAM copy on `segment`, is being dropped for room."""
        if segment is None:
            return "no_ssd_tier"
        tiering = self.state.tiering
        refusal = tiering.refusal(record, segment)
        if refusal in admission.REASONS:
            tiering.counters[f"admission_veto_{refusal}"] += 1  # counted once, as its copy goes
            return "not_admitted"
        if refusal is not None:
            return refusal
        if not tiering.can_offload(segment):
            return "offload_failed"  # a tier that has one, paused after a failed offload
        return "policy_drop"

    def evicting(self, record: ObjectRecord, reason: str, segment_id: int) -> None:
        """`record` (or its copy on `segment_id`) is being evicted for `reason` (as in
        MasterState.evictions): count the object when it goes without ever having reached SSD."""
        if segment_id and len(record.replicas) > 1:
            return  # only this copy goes: another replica (DRAM or disk) keeps the object
        if any(not is_dram(r) for r in record.replicas):
            return  # it had a disk copy (a quota eviction takes the whole object, safe copy included)
        if reason in _CAPACITY_REASONS:
            reason = self.drop_reason(record, self.state.segments.get(segment_id))
        self.dropped[reason] += 1

    # ------------------------------------------------------------------ offload feeding

    def in_flight_budget(self, segment: SegmentRecord) -> int:
        """DRAM bytes a segment may have being offloaded at once: enough to keep its disk busy
        (several fdatasync groups in flight) without copying far ahead of need."""
        config = self.state.config
        floor = int(config.eviction_ratio * segment.capacity)
        return max(floor, min(config.offload_in_flight_bytes, segment.capacity // 4))

    def feed(self, segment: SegmentRecord, need: int = 0) -> int:
        """Queue OFFLOADs of the segment's least recently used uncopied objects up to its in-flight
        budget (at least `need` bytes beyond what is in flight); bytes queued. Each queued task
        wakes the segment's long poll."""
        tiering = self.state.tiering
        if not tiering.can_offload(segment):
            return 0
        segment_id = segment.segment_id
        in_flight = tiering.offloading_bytes(segment_id)
        budget = max(self.in_flight_budget(segment) - in_flight, need - in_flight)
        if budget <= 0:
            return 0
        dram, ssd = dram_key(segment_id), ssd_key(segment_id)
        offloading = tiering.offloading

        refusal = tiering.refusal

        def uncopied(record: ObjectRecord) -> bool:
            tiers = [r >> TIER_SHIFT for r in record.replicas]
            return (
                dram in tiers
                and ssd not in tiers
                and record.name not in offloading
                and refusal(record, segment) is None  # would never be offloaded: takes no budget
            )

        state = self.state
        queued = 0
        victims = pick_victims(
            state.dram_lru(), state.clock(), budget, state.replica_bytes, uncopied, scan_limit=REDUNDANT_SCAN
        )
        for victim in victims:
            if tiering.offload(victim, segment, ahead=True):
                queued += state.replica_bytes(victim)
        return queued

    def committed(self, records: list[ObjectRecord]) -> None:
        """Objects just completed (PutEnd): feed offload on their segments above the offload watermark
        whose pipeline is under half its budget, without waiting for the tick. A segment where a feed
        found nothing to queue is skipped for a tick interval or until an offload completes there
        (no scan per PutEnd when nothing qualifies)."""
        state = self.state
        now = state.clock()
        offload_at = state.config.offload_watermark
        quiet_until = now - state.config.tick_interval_s
        seen: set[int] = set()
        for record in records:
            segment_id = replica_segment(record.replicas[0]) if record.replicas else 0
            if segment_id in seen or self._nothing_to_feed.get(segment_id, -1.0) > quiet_until:
                continue
            seen.add(segment_id)
            segment = state.segments.get(segment_id)
            if (
                segment is not None
                and segment.used > offload_at * segment.capacity
                and state.tiering.offloading_bytes(segment_id) * 2 < self.in_flight_budget(segment)
                and not self.feed(segment)
            ):
                self._nothing_to_feed[segment_id] = now

    def behind(self, segment: SegmentRecord, need: int) -> None:
        """A put found room on `segment` only by dropping protected copies: feed offload now."""
        self.blocked.add(segment.segment_id)
        self.feed(segment, need)

    def progress(self, segment_ids: set[int]) -> None:
        """Offloads completed on these segments: keep their pipelines full, wake waiting puts."""
        offload_at = self.state.config.offload_watermark
        for segment_id in segment_ids:
            self._nothing_to_feed.pop(segment_id, None)
        for segment_id in segment_ids:
            segment = self.state.segments.get(segment_id)
            if segment is not None and segment.used > offload_at * segment.capacity:
                self.feed(segment)
        self.wake()

    def wake(self) -> None:
        if self.notify is not None:
            self.notify()

    @property
    def max_wait_s(self) -> float:
        """put_backpressure_s, at most half of a PutStart's write grant (min(put_timeout_s, lease_s),
        kvtier.master.capabilities): a put that waited keeps the rest to write its bytes."""
        config = self.state.config
        return min(config.put_backpressure_s, min(config.put_timeout_s, config.lease_s) / 2)

    def hold(
        self, namespace: str, request: Any, options: PutOptions, result: PutStartResult, started: float
    ) -> HeldPut | None:
        """After a PutStart: the put to hold (its door awaits PutWaiter.finish) when keys wait for offload."""
        if _BEHIND not in result.statuses:
            return None
        wait_s = min(self.max_wait_s, request.wait_ms / 1000) if request.wait_ms else self.max_wait_s
        return HeldPut(namespace, request, options, result, started, wait_s)

    def no_room(self) -> Status:
        """The status of a key that found no room in this PutStart."""
        return Status.OFFLOAD_BEHIND if self.blocked else Status.NO_SPACE

    # ------------------------------------------------------------------ views

    def offload_queues(self) -> dict[str, tuple[int, float]]:
        """Per segment name: (offload tasks queued or in flight, age in seconds of the oldest)."""
        state = self.state
        now = state.clock()
        out: dict[str, tuple[int, float]] = {s.name: (0, 0.0) for s in state.segments.values() if s.ssd_capacity}
        oldest: dict[int, float] = {}
        depth: Counter[int] = Counter()
        for task in state.tiering.offloading.values():
            depth[task.segment_id] += 1
            oldest[task.segment_id] = min(oldest.get(task.segment_id, now), task.queued_at)
        for segment_id, count in depth.items():
            segment = state.segments.get(segment_id)
            if segment is not None:
                out[segment.name] = (count, max(0.0, now - oldest[segment_id]))
        return out

    def counters(self) -> dict[str, int]:
        """For Status's `tiering` map (`kvtier status --json`)."""
        out = {f"dropped_without_ssd_copy.{reason}": count for reason, count in self.dropped.items()}
        out["put_backpressure_waits"] = sum(self.waited.counts)
        out["put_backpressure_failed_keys"] = self.failed_keys
        out["put_backpressure_waiting"] = self.waiting
        for name, (depth, lag) in self.offload_queues().items():
            out[f"offload_queue_depth.{name}"] = depth
            out[f"offload_lag_ms.{name}"] = int(lag * 1000)
        return out


# ---------------------------------------------------------------------- the wait


@dataclass(slots=True)
class HeldPut:
    """A PutStart answered with keys that wait for offload (OFFLOAD_BEHIND for now)."""

    namespace: str
    request: Any  # pb.PutStartRequest
    options: PutOptions
    result: PutStartResult
    started: float  # the state's clock at the first attempt (its allocations' started_at)
    wait_s: float  # the longest it may wait


def merge(result: PutStartResult, retry: PutStartResult, indexes: list[int]) -> None:
    """Fold `retry` (a PutStart of the keys at `indexes` of `result`, same put id) into `result`."""

    def ranges(of: PutStartResult) -> list[list[tuple[int, int]]]:
        out, cursor = [], 0
        for count in of.replica_counts:
            end = cursor + count
            out.append(list(zip(of.replica_segments[cursor:end], of.replica_offsets[cursor:end], strict=True)))
            cursor = end
        return out

    per_key = ranges(result)
    for index, retried, status, count in zip(indexes, ranges(retry), retry.statuses, retry.replica_counts, strict=True):
        result.statuses[index] = status
        result.replica_counts[index] = count
        per_key[index] = retried
    result.replica_segments = [segment for ranges in per_key for segment, _ in ranges]
    result.replica_offsets = [offset for ranges in per_key for _, offset in ranges]
    result.first_error = retry.first_error


class PutWaiter:
    """The asynchronous wait of a held PutStart (see the module docstring). Shared by both doors."""

    def __init__(self, handlers: Any) -> None:
        self._handlers = handlers  # MasterHandlers: its state may be replaced (a new leader term)
        self._event = asyncio.Event()

    def wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def finish(self, held: HeldPut) -> Any:
        """Retry the waiting keys as offload progresses; the PutStartResponse to send."""
        handlers = self._handlers
        state = handlers.state
        pressure = state.pressure
        pressure.notify = self.wake
        pressure.waiting += 1
        try:
            changed = await self._retry(held, state)
        finally:
            pressure.waiting -= 1
        if changed:
            return pb.PutStartResponse(
                status=Status.UNAVAILABLE, error="master changed while the put waited for offload; retry"
            )
        result, request = held.result, held.request
        waited = state.clock() - held.started
        pressure.waited.observe(waited)
        failed = result.statuses.count(_BEHIND)
        if failed:
            pressure.failed_keys += failed
            result.first_error = (
                f"OFFLOAD_BEHIND for {failed} keys: DRAM is full of objects not yet on SSD; waited "
                f"{waited:.2f}s (put_backpressure_s = {state.config.put_backpressure_s}, request wait_ms = "
                f"{request.wait_ms}); nothing was stored for them"
            )
        return handlers.put_reply(request, result, waited)

    async def _retry(self, held: HeldPut, state: MasterState) -> bool:
        """Retry the OFFLOAD_BEHIND keys of `held` until none is left or its wait is over, merging
        into held.result. True when the master changed meanwhile (its answer is UNAVAILABLE)."""
        handlers = self._handlers
        loop = asyncio.get_running_loop()
        deadline = loop.time() + held.wait_s
        result, request = held.result, held.request
        tick_s = state.config.tick_interval_s
        while True:
            waiting = [i for i, status in enumerate(result.statuses) if status == _BEHIND]
            remaining = deadline - loop.time()
            if not waiting or remaining <= 0:
                return False
            event = self._event
            try:
                # Woken by offload progress; the tick bound catches room freed otherwise (removes, leases).
                await asyncio.wait_for(event.wait(), min(remaining, tick_s))
            except TimeoutError:
                pass
            if handlers.state is not state or not handlers.leadership.is_leader():
                return True
            retry = state.put_start(
                held.namespace,
                [request.keys[i] for i in waiting],
                [request.sizes[i] for i in waiting],
                request.replicas,
                held.options,
                put_id=result.put_id,
            )
            merge(result, retry, waiting)
