"""A segment server's Prometheus metrics, read from its counters at scrape time.

Kept apart on purpose (a field report saw a "store hit" served from RAM
while the NVMe read almost nothing): object bytes this server sent from its
DRAM region over TCP and from its SSD tier (`kvtier_segment_served_bytes`,
by tier and transport; same-host `shm` reads never pass through the server
and are counted by clients), the physical bytes the process read from
storage (`kvtier_segment_disk_read_bytes`, the kernel's own counter), and the
offload direction, DRAM to SSD (`kvtier_segment_offloaded_bytes`).
Counters are plain integers updated on the event loop; reading them from the
HTTP thread needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.commit_relay import CommitRelay
from kvtier.segment_server.dram_index import CommitFeed
from kvtier.segment_server.keyed_reads import KeyedReads, KeyedStats
from kvtier.segment_server.protocol import DataPlaneStats
from kvtier.segment_server.shm_grant import GrantStats
from kvtier.segment_server.shm_writers import WriterTable
from kvtier.segment_server.tier_worker import TierWorker


class SegmentCollector(Collector):
    def __init__(
        self,
        name: str,
        stats: DataPlaneStats,
        disk_bytes_read: Callable[[], int],
        capacity: int,
        store: BucketStore | None,
        worker: Callable[[], TierWorker | None],
        feed: Callable[[], CommitFeed | None],
        grants: GrantStats | None = None,
        relay: CommitRelay | None = None,
        keyed: KeyedReads | None = None,
        writers: WriterTable | None = None,
    ) -> None:
        self._name = name
        self._writers = writers
        self._relay = relay
        self._keyed = keyed
        self._stats = stats
        self._disk_bytes_read = disk_bytes_read
        self._capacity = capacity
        self._store = store
        self._worker = worker
        self._feed = feed
        self._grants = grants

    def collect(self) -> Iterable[Metric]:
        s = self._stats
        feed = self._feed()
        if feed is not None:
            objects, size = feed.index.totals()
            indexed = GaugeMetricFamily(
                "kvtier_segment_indexed_objects",
                "Complete objects in this segment's DRAM region by its own index (the master's count is "
                "kvtier_segment_objects{tier=dram}: equal once puts and removes settle).",
                labels=["segment"],
            )
            indexed.add_metric([self._name], objects)
            yield indexed
            indexed_bytes = GaugeMetricFamily(
                "kvtier_segment_indexed_bytes",
                "Bytes of those objects (the master's kvtier_segment_used_bytes{tier=dram} adds alignment).",
                labels=["segment"],
            )
            indexed_bytes.add_metric([self._name], size)
            yield indexed_bytes
        served = CounterMetricFamily(
            "kvtier_segment_served_bytes",
            "Object bytes sent to clients, by tier and transport (shm reads bypass the server).",
            labels=["segment", "tier", "transport"],
        )
        served.add_metric([self._name, "dram", "tcp"], s.bytes_read)
        served.add_metric([self._name, "ssd", "tcp"], s.ssd_bytes_served)
        yield served
        latency = HistogramMetricFamily(
            "kvtier_segment_request_latency_seconds",
            "Data-path latency per op: request header received to response queued (completed requests).",
            labels=["segment", "op"],
        )
        for op, histogram in sorted(s.latency.items()):
            latency.add_metric([self._name, op], histogram.buckets(), histogram.total)
        yield latency
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_written_bytes",
            "Payload bytes received into the region.",
            self._name,
            s.bytes_written,
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_disk_read_bytes",
            "Physical bytes this process read from storage (/proc/self/io), whatever the cause.",
            self._name,
            self._disk_bytes_read(),
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_ssd_read_bytes",
            "Bytes the SSD tier's reads returned (records, headers, padding).",
            self._name,
            s.ssd_bytes_read,
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_ssd_read_errors",
            "Disk reads answered with an error.",
            self._name,
            s.ssd_read_errors,
        )
        yield _one(
            CounterMetricFamily, "kvtier_segment_requests", "Data-plane requests handled.", self._name, s.requests
        )
        if self._grants is not None:
            grants = CounterMetricFamily(
                "kvtier_segment_shm_grants",
                "Requests for the region on the shm grant socket, by result (granted, refused_uid, busy, ...).",
                labels=["segment", "result"],
            )
            for result, count in self._grants.results.items():
                grants.add_metric([self._name, result], count)
            yield grants
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_shm_clients",
                "Same-host clients mapping the region now (each holds a block of writer slots).",
                self._name,
                self._grants.held,
            )
        if self._writers is not None and self._writers.last is not None:
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_shm_writes_stalled",
                "Same-host copies into the region still in progress past the grant they started under, at the "
                "last heartbeat (a writer stopped mid-copy: the master keeps their ranges from other objects).",
                self._name,
                self._writers.last.stalled,
            )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_range_errors",
            "Requests refused for a range outside the region.",
            self._name,
            s.range_errors,
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_protocol_errors",
            "Malformed frames (connection closed).",
            self._name,
            s.protocol_errors,
        )
        yield _one(
            GaugeMetricFamily, "kvtier_segment_connections", "Open data-plane connections.", self._name, s.connections
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_capability_denials",
            "Requests refused CAPABILITY_DENIED: no valid capability from the master for their ranges.",
            self._name,
            s.capability_denials,
        )
        cut = CounterMetricFamily(
            "kvtier_segment_frames_cut",
            "READ/WRITE frames cut because their grant ended while they were served (a WRITE stops writing "
            "into the region and answers LEASE_EXPIRED; a READ's connection is aborted with its response queued).",
            labels=["segment", "op"],
        )
        for op, count in sorted(s.frames_cut.items()):
            cut.add_metric([self._name, op], count)
        yield cut
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_refused_connections",
            "Data-plane connections refused at the max_connections limit.",
            self._name,
            s.refused_connections,
        )
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_timed_out_connections",
            "Data-plane connections cut: idle past idle_timeout_s, or a request or response stalled past "
            "request_timeout_s.",
            self._name,
            s.timed_out_connections,
        )
        yield _one(
            GaugeMetricFamily,
            "kvtier_segment_dram_capacity_bytes",
            "Bytes of the DRAM region.",
            self._name,
            self._capacity,
        )
        worker = self._worker()
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_offloaded_bytes",
            "Object bytes written DRAM to SSD (the offload direction, not serving).",
            self._name,
            worker.offloaded_bytes if worker is not None else 0,
        )
        verifier = worker.verifier if worker is not None else None
        if verifier is not None:
            yield _one(
                CounterMetricFamily,
                "kvtier_segment_ssd_verified_records",
                "Records found at mount whose payload the background verifier has found good.",
                self._name,
                verifier.verified,
            )
            yield _one(
                CounterMetricFamily,
                "kvtier_segment_ssd_verified_bytes",
                "Payload bytes of those records.",
                self._name,
                verifier.verified_bytes,
            )
            yield _one(
                CounterMetricFamily,
                "kvtier_segment_ssd_corrupt_records",
                "Records the background verifier found corrupt (payload CRC, header, cluster tag, torn or "
                "unreadable): tombstoned and reported to the master.",
                self._name,
                verifier.corrupt,
            )
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_ssd_tombstones_unreadable",
                "Tombstone records found damaged when the SSD tier was mounted (a sealed bucket's footer says "
                "what they were, or their payload CRC failed). Each is written twice: one damaged copy loses "
                "nothing; both would bring the objects it named back. Alert on it.",
                self._name,
                verifier.store.tombstones_unreadable,
            )
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_ssd_verify_backlog_bytes",
                "Payload bytes of live records found at mount that are not verified yet.",
                self._name,
                verifier.store.unverified_bytes,
            )
        failures = CounterMetricFamily(
            "kvtier_segment_tier_write_failures",
            "Tier tasks that failed here and left no copy the master hands out, by op (offload, promote, "
            "forget) and reason (no_space, io_error, checksum, deadline, missing, invalid_range, abandoned: "
            "copies written for offloads the master had given up on or no longer wants (their object was "
            "removed or replaced meanwhile), or whose report no master took).",
            labels=["segment", "op", "reason"],
        )
        for (op, reason), count in sorted(
            dict(worker.failures).items() if worker is not None else ()
        ):  # copied at once (GIL)
            failures.add_metric([self._name, op, reason], count)
        yield failures
        if self._store is not None:
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_ssd_capacity_bytes",
                "Bytes of the SSD tier.",
                self._name,
                self._store.capacity,
            )
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_ssd_used_bytes",
                "Bytes of bucket files.",
                self._name,
                self._store.used,
            )
            yield _one(
                GaugeMetricFamily,
                "kvtier_segment_ssd_usable_bytes",
                "Bytes the SSD tier can hold now: its capacity, or less when its file system has less room "
                "(bucket files plus the file system's free space).",
                self._name,
                self._store.usable,
            )
        feed = self._feed()
        yield _one(
            GaugeMetricFamily,
            "kvtier_segment_index_objects",
            "Complete objects in this segment's DRAM index (what a restarted master rebuilds from).",
            self._name,
            len(feed.index) if feed is not None else 0,
        )
        polls = CounterMetricFamily(
            "kvtier_segment_commit_polls",
            "Commit-feed polls answered, by the master's door they went through (fast: framed, grpc: fallback).",
            labels=["segment", "door"],
        )
        fast = feed.fast_polls if feed is not None else 0
        polls.add_metric([self._name, "fast"], fast)
        polls.add_metric([self._name, "grpc"], (feed.polls - fast) if feed is not None else 0)
        yield polls
        relay = self._relay
        commits = CounterMetricFamily(
            "kvtier_segment_commits",
            "COMMIT frames (a client's PutEnd behind its WRITE), by outcome: relayed (the master's answer went "
            "back), unavailable (no answer: the client sent its PutEnd itself), refused (not right behind a "
            "completed WRITE, or undecodable).",
            labels=["segment", "outcome"],
        )
        commits.add_metric([self._name, "relayed"], relay.relayed if relay is not None else 0)
        commits.add_metric([self._name, "unavailable"], relay.failed if relay is not None else 0)
        commits.add_metric([self._name, "refused"], s.commits_refused)
        yield commits
        yield _one(
            CounterMetricFamily,
            "kvtier_segment_commit_feed_waits",
            "Relayed PutEnds not applicable at once: the commit feed had not applied earlier notices yet, or "
            "was applying a batch (the event loop never waits for it).",
            self._name,
            relay.feed_waits if relay is not None else 0,
        )
        keyed = self._keyed.stats if self._keyed is not None else KeyedStats()
        direct = CounterMetricFamily(
            "kvtier_segment_direct_reads",
            "Ranges of READ_KEYED frames (direct reads: a client reading a small DRAM object it looked up "
            "before, without the master), by outcome: served (the index names that object there and its bytes "
            "matched), not_found (it does not, or the bytes did not match: the client asks the master), "
            "no_lease (not mounted, or heartbeats not acknowledged lately: UNAVAILABLE).",
            labels=["segment", "outcome"],
        )
        direct.add_metric([self._name, "served"], keyed.served)
        direct.add_metric([self._name, "not_found"], keyed.not_found)
        direct.add_metric([self._name, "no_lease"], keyed.no_lease)
        yield direct
        yield _one(
            GaugeMetricFamily,
            "kvtier_segment_direct_read_lease_seconds",
            "How long this segment may still serve direct reads without another acknowledged heartbeat.",
            self._name,
            self._keyed.lease.left_s if self._keyed is not None else 0.0,
        )


def _one(kind: type, name: str, documentation: str, segment: str, value: float) -> Metric:
    family = kind(name, documentation, labels=["segment"])
    family.add_metric([segment], value)
    return family
