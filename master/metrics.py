"""The master's Prometheus metrics, read from its tables at scrape time.

"Hit" means one thing here: a *lookup hit*, a key the master found complete
(`kvtier_master_lookup_hits_total` against `kvtier_master_lookup_keys_total`,
per RPC). Whether the bytes then arrived, verified, and from which tier, is
counted where it happens: by the segment servers (bytes served per tier,
physical disk reads) and by clients.

The scrape runs on the HTTP thread; the tables belong to the event loop, so
the collector asks the loop for a snapshot and waits for it (2 s at most).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.common.latency import LatencyHistogram
from kvtier.common.metrics import histogram_family
from kvtier.master import admission, prefetch
from kvtier.master.backpressure import WaitHistogram
from kvtier.master.fastpath import FastPathStats
from kvtier.master.handlers import MasterHandlers

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Snapshot:
    requests: dict[str, int]
    failures: dict[str, int]
    refused: dict[str, int]
    latency: dict[str, LatencyHistogram]
    lookup_keys: dict[str, int]
    lookup_hits: dict[str, int]
    lookup_hits_disk_only: int
    objects: int
    pending: int
    # (name, state, dram capacity, dram used, objects, ssd capacity, ssd used, ssd objects, age,
    # clock skew in seconds, skewed, quarantined)
    segments: list[tuple]
    failure_reports: dict[tuple[str, str], int]  # (segment, kind) -> failures clients reported
    evictions: dict[str, tuple[int, int]]
    corrupt: dict[str, int]  # replicas dropped on readers' reports, by tier
    corrupt_stale: int
    lease_expiries: dict[str, int]
    upserts: dict[str, int]  # outcome -> upserts (kvtier.master.upsert)
    put_leases: int  # put-time leases held now
    group_puts: dict[str, int]  # outcome -> group PutEnds (kvtier.master.groups)
    groups_rebuilt: int  # groups formed again from the segments' inventories (kvtier.master.groups)
    tiering: dict[str, int]
    tier_failures: dict[tuple[str, str], int]  # (op, status) -> tier tasks failed or expired
    dropped_without_ssd_copy: dict[str, int]  # reason -> objects (kvtier.master.backpressure)
    put_waits: WaitHistogram
    put_failed_keys: int
    put_waiting: int
    offload_queues: dict[str, tuple[int, float]]  # segment -> (tasks queued or in flight, oldest's age)
    quotas: list[tuple[str, int, int, int, int]]  # (instance, rank, quota, used, objects)
    epoch: int
    role: str
    eviction_policy: str
    eviction_queues: dict[str, int]  # s3fifo: small, main, ghost entries; empty under lru
    recovering: bool
    fast_path: FastPathStats | None  # a copy; None when the fast path is off
    events_published: dict[str, int]  # kind -> events (kvtier.master.events)
    events_held: int
    event_watchers: int
    event_watchers_ended: dict[str, int]  # why -> streams ended by the master


class MasterCollector(Collector):
    def __init__(
        self, handlers: MasterHandlers, loop: asyncio.AbstractEventLoop, fast_path: FastPathStats | None = None
    ) -> None:
        self._handlers = handlers
        self._loop = loop
        self._fast_path = fast_path

    def _snapshot(self) -> _Snapshot:
        """On the event loop."""
        h = self._handlers
        state = h.state
        now = state.clock()
        snap = state.snapshot()
        return _Snapshot(
            requests=dict(h.requests),
            failures=dict(h.failures),
            refused=dict(h.refused),
            latency={name: LatencyHistogram(list(hist.counts), hist.total) for name, hist in h.latency.items()},
            lookup_keys=dict(h.lookup_keys),
            lookup_hits=dict(h.lookup_hits),
            lookup_hits_disk_only=h.lookup_hits_disk_only,
            objects=snap.objects,
            pending=snap.pending_puts,
            segments=[
                (
                    s.name,
                    s.state.name,
                    s.capacity,
                    s.used,
                    s.objects,
                    s.ssd_capacity,
                    s.ssd_used,
                    s.ssd_objects,
                    now - s.last_heartbeat,
                    s.clock_skew_s,
                    s.clock_skewed,
                    state.quarantine.is_quarantined(s.name),
                    s.releasing,
                )
                for s in snap.segments
            ],
            failure_reports=dict(state.quarantine.reported),
            evictions={reason: (objects, size) for reason, (objects, size) in state.evictions.items()},
            corrupt=dict(state.corrupt.dropped),
            corrupt_stale=state.corrupt.stale,
            lease_expiries=state.lease_expiries | {"tier_task": state.tiering.counters["expired_tasks"]},
            upserts=dict(state.upserts.counters),
            put_leases=len(state.upserts.leases),
            group_puts={"committed": state.groups.groups_committed, "revoked": state.groups.groups_revoked},
            groups_rebuilt=state.groups.groups_rebuilt,
            tiering=h.events(),
            tier_failures=dict(state.tiering.failures),
            dropped_without_ssd_copy=dict(state.pressure.dropped),
            put_waits=WaitHistogram(list(state.pressure.waited.counts), state.pressure.waited.total),
            put_failed_keys=state.pressure.failed_keys,
            put_waiting=state.pressure.waiting,
            offload_queues=state.pressure.offload_queues(),
            quotas=[(o.instance, o.rank, o.quota, o.used, o.objects) for o in state.quotas.snapshot()],
            epoch=h.epoch,
            role=h.role,
            eviction_policy=state.policy.name,
            eviction_queues=state.policy.queue_sizes(),
            recovering=not state.serving,
            fast_path=dataclasses.replace(self._fast_path) if self._fast_path is not None else None,
            events_published=dict(state.events.published),
            events_held=state.events.held,
            event_watchers=state.events.watchers,
            event_watchers_ended=dict(state.events.cuts),
        )

    def collect(self) -> Iterable[Metric]:
        async def take() -> _Snapshot:
            return self._snapshot()

        try:
            snap = asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=2.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("metrics scrape: no snapshot from the event loop (%s)", exc)
            return
        yield from _families(snap)
        yield GaugeMetricFamily(
            "kvtier_master_gc_frozen_objects",
            "Objects moved to the garbage collector's permanent generation (kvtier.master.long_lived).",
            value=gc.get_freeze_count(),
        )


def _families(s: _Snapshot) -> Iterable[Metric]:
    def counter(name: str, doc: str, label: str | tuple[str, ...], values: dict) -> Metric:
        """One label (`values` keyed by its value) or several (keyed by tuples of theirs)."""
        single = isinstance(label, str)
        family = CounterMetricFamily(name, doc, labels=[label] if single else list(label))
        for key, value in sorted(values.items()):
            family.add_metric([key] if single else list(key), value)
        return family

    yield counter("kvtier_master_rpc_requests", "RPCs handled, gRPC and fast path together.", "method", s.requests)
    yield counter(
        "kvtier_master_rpc_failures", "RPCs that failed (invalid input, internal errors).", "method", s.failures
    )
    yield counter(
        "kvtier_master_rpc_refused", "RPCs answered UNAVAILABLE (standby, or recovering).", "method", s.refused
    )
    yield histogram_family(
        "kvtier_master_rpc_latency_seconds",
        "Metadata latency: time in the master's handler per RPC (data-plane latency is the segments').",
        "method",
        s.latency,
    )
    yield counter(
        "kvtier_master_events_published", "Events published for WatchEvents, by kind.", "kind", s.events_published
    )
    yield GaugeMetricFamily(
        "kvtier_master_events_buffered", "Events held for resuming watchers (at most events_buffer).", s.events_held
    )
    yield GaugeMetricFamily("kvtier_master_event_watchers", "WatchEvents streams open.", s.event_watchers)
    yield counter(
        "kvtier_master_event_watchers_cut",
        "WatchEvents streams the master ended or refused: slow (cut), missed, closed, too_many.",
        "reason",
        s.event_watchers_ended,
    )
    yield counter("kvtier_master_lookup_keys", "Keys asked by Exists and GetReplicas.", "rpc", s.lookup_keys)
    yield counter(
        "kvtier_master_lookup_hits",
        "Lookup hits: keys found complete by Exists and GetReplicas (not bytes served).",
        "rpc",
        s.lookup_hits,
    )
    yield CounterMetricFamily(
        "kvtier_master_lookup_hits_disk_only",
        "GetReplicas hits on objects without a DRAM copy: the reader goes to an SSD tier.",
        value=s.lookup_hits_disk_only,
    )
    objects = GaugeMetricFamily("kvtier_master_objects", "Objects by state.", labels=["state"])
    objects.add_metric(["complete"], s.objects)
    objects.add_metric(["pending"], s.pending)
    yield objects
    capacity = GaugeMetricFamily(
        "kvtier_segment_capacity_bytes", "Capacity per segment and tier.", labels=["segment", "tier"]
    )
    used = GaugeMetricFamily(
        "kvtier_segment_used_bytes", "Bytes in use per segment and tier.", labels=["segment", "tier"]
    )
    dram_releasing = GaugeMetricFamily(
        "kvtier_segment_dram_releasing_bytes",
        "Of the DRAM in use: ranges of copies gone whose read leases, write grants or clock-skew margin "
        "have not ended yet (reusable then).",
        labels=["segment"],
    )
    copies = GaugeMetricFamily(
        "kvtier_segment_objects", "Object copies per segment and tier.", labels=["segment", "tier"]
    )
    age = GaugeMetricFamily("kvtier_segment_heartbeat_age_seconds", "Since the last heartbeat.", labels=["segment"])
    state = GaugeMetricFamily("kvtier_segment_state", "1 for the segment's state.", labels=["segment", "state"])
    skew = GaugeMetricFamily(
        "kvtier_master_segment_clock_skew_seconds",
        "The segment's wall clock minus the master's (mount and heartbeats; beyond clock_skew_tolerance_s "
        "it takes no new objects).",
        labels=["segment"],
    )
    skewed = GaugeMetricFamily(
        "kvtier_master_segment_clock_skewed",
        "1 while the segment's clock is beyond clock_skew_tolerance_s (out of placement).",
        labels=["segment"],
    )
    in_quarantine = GaugeMetricFamily(
        "kvtier_master_segment_quarantined",
        "1 while the segment is in quarantine (clients reported repeated data-plane failures): placed on "
        "last, read last.",
        labels=["segment"],
    )
    for (
        name,
        seg_state,
        dram_cap,
        dram_used,
        dram_objects,
        ssd_cap,
        ssd_used,
        ssd_objects,
        heartbeat,
        clock_skew,
        clock_skewed,
        quarantined,
        releasing,
    ) in s.segments:
        dram_releasing.add_metric([name], releasing)
        in_quarantine.add_metric([name], 1 if quarantined else 0)
        skew.add_metric([name], clock_skew)
        skewed.add_metric([name], 1 if clock_skewed else 0)
        capacity.add_metric([name, "dram"], dram_cap)
        used.add_metric([name, "dram"], dram_used)
        copies.add_metric([name, "dram"], dram_objects)
        if ssd_cap:
            capacity.add_metric([name, "ssd"], ssd_cap)
            used.add_metric([name, "ssd"], ssd_used)
            copies.add_metric([name, "ssd"], ssd_objects)
        age.add_metric([name], heartbeat)
        state.add_metric([name, seg_state.lower()], 1)
    yield from (capacity, used, dram_releasing, copies, age, state, skew, skewed, in_quarantine)
    yield counter(
        "kvtier_master_segment_failure_reports",
        "Data-plane failures clients reported on the segment (ReportSegmentFailures), by kind: connect, "
        "timeout, transfer, other.",
        ("segment", "kind"),
        s.failure_reports,
    )
    evicted = CounterMetricFamily("kvtier_master_evictions", "Objects evicted, by reason.", labels=["reason"])
    evicted_bytes = CounterMetricFamily("kvtier_master_evicted_bytes", "Bytes evicted, by reason.", labels=["reason"])
    for reason, (count, size) in sorted(s.evictions.items()):
        evicted.add_metric([reason], count)
        evicted_bytes.add_metric([reason], size)
    yield evicted
    yield evicted_bytes
    yield counter(
        "kvtier_master_corrupt_replicas",
        "Replicas dropped because a reader reported bytes that fail the object's checksum (ReportCorrupt).",
        "tier",
        s.corrupt,
    )
    stale = CounterMetricFamily(
        "kvtier_master_corrupt_reports_stale",
        "ReportCorrupt entries that matched no current replica (late, repeated, or about a moved copy).",
    )
    stale.add_metric([], s.corrupt_stale)
    yield stale
    yield counter(
        "kvtier_master_lease_expiries",
        "Leases that ran out: put (PutStart never ended, reclaimed), segment (expelled for silence), "
        "tier_task (an offload or promotion not reported in time).",
        "kind",
        s.lease_expiries,
    )
    yield counter(
        "kvtier_master_upserts",
        "Upserts' new versions by outcome: swapped (visible), revoked, reclaimed (writer gone), lost (a "
        "segment died), refused (another writer's put of the key pending at PutEnd).",
        "outcome",
        dict.fromkeys(("swapped", "revoked", "reclaimed", "lost", "refused"), 0) | s.upserts,
    )
    leases = GaugeMetricFamily("kvtier_master_put_leases", "Objects under a put-time lease now (Remove needs force).")
    leases.add_metric([], s.put_leases)
    yield leases
    yield counter(
        "kvtier_master_group_puts",
        "Group PutEnds (all or none, issue 21): committed (every member visible at once), revoked (a member "
        "was not pending: every member revoked).",
        "outcome",
        s.group_puts,
    )
    rebuilt = CounterMetricFamily(
        "kvtier_master_groups_rebuilt",
        "Groups formed again from the segments' inventories after a master restart or takeover (every "
        "member reported under its group's id, each still the object adopted).",
    )
    rebuilt.add_metric([], s.groups_rebuilt)
    yield rebuilt
    yield counter(
        "kvtier_master_tiering",
        "Tiering, commit-log and returning-segment events (offloads, promotions, fence re-adoptions, ...).",
        "event",
        {event: count for event, count in s.tiering.items() if not _is_gauge(event)},
    )
    yield counter(
        "kvtier_master_ssd_admission_vetoes",
        "Offloads refused by SSD write admission (min_size, reads): those DRAM copies were dropped instead.",
        "reason",
        {reason: s.tiering.get(f"admission_veto_{reason}", 0) for reason in admission.REASONS},
    )
    yield counter(
        "kvtier_master_prefetches",
        "Prefetches on lookup (Exists with prefetch): promotions started, completed (now in DRAM), failed.",
        "outcome",
        {outcome: s.tiering.get(f"prefetch_{outcome}", 0) for outcome in ("started", "completed", "failed")},
    )
    yield counter(
        "kvtier_master_prefetch_skips",
        "Disk-only objects a prefetch found but did not start promoting, by reason.",
        "reason",
        {reason: s.tiering.get(f"prefetch_skipped_{reason}", 0) for reason in prefetch.SKIP_REASONS},
    )
    yield counter(
        "kvtier_master_tier_task_failures",
        "Tier tasks that failed (the segment's status) or expired (TIMEOUT), by op (offload, promote, "
        "forget) and status: none left a replica the master hands out.",
        ("op", "status"),
        s.tier_failures,
    )
    dropped = CounterMetricFamily(
        "kvtier_master_dropped_without_ssd_copy",
        "Objects dropped (evicted) without any SSD copy, by reason: policy_drop (dram_full_policy drop), "
        "offload_failed (offload paused after a failure), too_large, not_admitted, no_ssd_tier, quota, corrupt.",
        labels=["reason"],
    )
    for reason, count in sorted(s.dropped_without_ssd_copy.items()):
        dropped.add_metric([reason], count)
    yield dropped
    waits = HistogramMetricFamily(
        "kvtier_master_put_backpressure_seconds",
        "How long PutStarts waited for offload to make room (dram_full_policy wait).",
    )
    waits.add_metric([], s.put_waits.buckets(), s.put_waits.total)
    yield waits
    yield CounterMetricFamily(
        "kvtier_master_put_backpressure_failed_keys",
        "Keys answered OFFLOAD_BEHIND: no room after waiting put_backpressure_s; nothing stored.",
        value=s.put_failed_keys,
    )
    yield GaugeMetricFamily(
        "kvtier_master_put_backpressure_waiting", "PutStarts waiting for offload now.", value=s.put_waiting
    )
    depth = GaugeMetricFamily(
        "kvtier_master_offload_queue_depth", "Offload tasks queued or in flight, per segment.", labels=["segment"]
    )
    lag = GaugeMetricFamily(
        "kvtier_master_offload_lag_seconds", "Age of the oldest offload not yet done, per segment.", labels=["segment"]
    )
    for name, (count, age) in sorted(s.offload_queues.items()):
        depth.add_metric([name], count)
        lag.add_metric([name], age)
    yield from (depth, lag)
    # engine_instance, not instance: Prometheus owns the `instance` label (the scrape target) and would
    # rename ours to exported_instance, so per-engine sums would silently add every engine together.
    labels = ["engine_instance", "rank"]
    quota = GaugeMetricFamily("kvtier_master_quota_bytes", "Per-rank quota (0 = none).", labels=labels)
    quota_used = GaugeMetricFamily("kvtier_master_quota_used_bytes", "DRAM bytes a rank holds.", labels=labels)
    quota_objects = GaugeMetricFamily("kvtier_master_quota_objects", "Objects a rank owns.", labels=labels)
    for instance, rank, limit, held, count in s.quotas:
        quota.add_metric([instance, str(rank)], limit)
        quota_used.add_metric([instance, str(rank)], held)
        quota_objects.add_metric([instance, str(rank)], count)
    yield from (quota, quota_used, quota_objects)
    role = GaugeMetricFamily("kvtier_master_role", "1 for this master's role.", labels=["role"])
    role.add_metric([s.role], 1)
    yield role
    policy = GaugeMetricFamily(
        "kvtier_master_eviction_policy_info", "1 for the eviction order in force (eviction_policy).", labels=["policy"]
    )
    policy.add_metric([s.eviction_policy], 1)
    yield policy
    if s.eviction_queues:
        queues = GaugeMetricFamily(
            "kvtier_master_eviction_queue_entries",
            "S3-FIFO's queues: objects in the small and main FIFOs, names remembered in the ghost.",
            labels=["queue"],
        )
        for queue, entries in s.eviction_queues.items():
            queues.add_metric([queue], entries)
        yield queues
    yield GaugeMetricFamily("kvtier_master_epoch", "This master incarnation's epoch.", value=s.epoch)
    if (fast := s.fast_path) is not None:
        yield GaugeMetricFamily(
            "kvtier_master_fast_path_connections", "Fast-path connections open.", value=fast.connections
        )
        yield CounterMetricFamily(
            "kvtier_master_fast_path_refused_connections",
            "Fast-path connections refused over max_connections (an error frame, then the close).",
            value=fast.refused_connections,
        )
        yield CounterMetricFamily(
            "kvtier_master_fast_path_timed_out_connections",
            "Fast-path connections cut: idle, a request or AUTH slower than request_timeout_s, answers unread.",
            value=fast.timed_out_connections,
        )
        yield CounterMetricFamily(
            "kvtier_master_fast_path_protocol_errors",
            "Fast-path frames the master could not trust (an error frame, then the close).",
            value=fast.protocol_errors,
        )
        yield CounterMetricFamily(
            "kvtier_master_fast_path_buffer_waits",
            "Fast-path requests that waited for room in max_buffered_size (backpressure).",
            value=fast.buffer_waits,
        )
        yield GaugeMetricFamily(
            "kvtier_master_fast_path_buffered_bytes",
            "Bytes of max_buffered_size held by fast-path connections for large requests.",
            value=fast.buffered_bytes,
        )


def _is_gauge(event: str) -> bool:
    """Entries of Status's `tiering` map that are levels, not counts: exported as gauges of their own
    (kvtier_master_put_backpressure_waiting, kvtier_master_offload_queue_*), never in a counter,
    where a level going down read as a counter reset to rate()."""
    return event == "put_backpressure_waiting" or event.startswith(("offload_queue_depth.", "offload_lag_ms."))
