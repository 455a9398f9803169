"""Engine-side Prometheus metrics, opt-in: `Client(..., metrics=True)` or KVTIER_CLIENT_METRICS=1.

One collector for the whole process, registered once in prometheus-client's
default registry (the engine's own `/metrics` exposes it), summing every
live tracked client by namespace. Counters come from `Client.stats()`; the
client's hot paths only add to its own counters.

What the engine side knows and the servers cannot: objects *served and
verified* (checksum passed, handed to the caller), by tier and transport,
including same-host `shm` copies that never pass through a segment server.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.common.latency import LatencyHistogram

if TYPE_CHECKING:
    from kvtier.client.client import Client

_clients: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_registered = False

_SIMPLE = (
    ("gets", "kvtier_client_gets", "Keys asked by gets."),
    ("hits", "kvtier_client_hits", "Keys handed to the caller (served and verified)."),
    ("misses", "kvtier_client_misses", "Keys that were misses (absent, unreachable or unverifiable)."),
    ("checksum_mismatches", "kvtier_client_checksum_mismatches", "Copies whose bytes failed verification."),
    ("puts", "kvtier_client_puts", "Keys put."),
    ("put_failures", "kvtier_client_put_failures", "Keys whose put failed."),
    ("put_retries", "kvtier_client_put_retries", "Keys placed once more after a write failed on its segment."),
    (
        "commits_relayed",
        "kvtier_client_commits_relayed",
        "Puts whose PutEnd their segment relayed to the master (a COMMIT frame behind the WRITE).",
    ),
    (
        "commits_not_relayed",
        "kvtier_client_commits_not_relayed",
        "Puts that sent a COMMIT frame but then their PutEnd to the master (the segment could not relay it).",
    ),
    (
        "direct_reads",
        "kvtier_client_direct_reads",
        "Keys served by their segment alone (direct reads: no lookup), verified against the checksum.",
    ),
    (
        "direct_read_misses",
        "kvtier_client_direct_read_misses",
        "Keys asked of their segment directly that it did not serve (moved, changed, gone, no lease): looked up.",
    ),
    ("group_puts", "kvtier_client_group_puts", "Group puts (all or none, kvtier.client.groups), any outcome."),
    ("group_misses", "kvtier_client_group_misses", "Group reads answered with a miss for every member."),
    (
        "read_retries",
        "kvtier_client_read_retries",
        "Keys read again after a transfer failed on its connection: on another replica, or after a fresh lookup.",
    ),
    (
        "read_retry_lookups",
        "kvtier_client_read_retry_lookups",
        "Fresh GetReplicas calls made to retry keys whose transfers failed (at most one per get call).",
    ),
    (
        "failure_reports",
        "kvtier_client_segment_failure_reports",
        "Reports of data-plane failures per segment sent to the master (quarantine).",
    ),
    ("bytes_written", "kvtier_client_written_bytes", "Object bytes written (every replica)."),
    ("bytes_read", "kvtier_client_transferred_bytes", "Object bytes transferred to the client, verified or not."),
    ("ranged_gets", "kvtier_client_ranged_gets", "Ranged reads (get_ranges, get_into_ranges), one per key."),
    ("ranged_misses", "kvtier_client_ranged_misses", "Ranged reads that were misses (or bad ranges)."),
    (
        "ranged_bytes_read",
        "kvtier_client_ranged_transferred_bytes",
        "Bytes ranged reads transferred: the chunks covering the ranges, or whole objects without chunk CRCs.",
    ),
    (
        "ranged_bytes_returned",
        "kvtier_client_ranged_returned_bytes",
        "Bytes ranged reads handed to the caller, every one inside a verified chunk or object.",
    ),
)


def track(client: Client) -> None:
    global _registered
    with _lock:
        _clients.add(client)
        first, _registered = not _registered, True
    if first:  # outside the lock: registering collects once (to learn the metric names)
        REGISTRY.register(_ClientCollector())


class _ClientCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        totals: dict[str, Counter] = {}
        latency: dict[tuple[str, str], LatencyHistogram] = {}
        with _lock:
            clients = list(_clients)
        for client in clients:
            totals.setdefault(client.namespace, Counter()).update(client.stats())
            for method, histogram in client.latency().items():
                into = latency.setdefault((client.namespace, method), LatencyHistogram())
                into.counts = [a + b for a, b in zip(into.counts, histogram.counts, strict=True)]
                into.total += histogram.total
        for stat, name, documentation in _SIMPLE:
            family = CounterMetricFamily(name, documentation, labels=["namespace"])
            for namespace, stats in sorted(totals.items()):
                family.add_metric([namespace], stats.get(stat, 0))
            yield family
        served = CounterMetricFamily(
            "kvtier_client_served_objects",
            "Objects served and verified (checksum passed, handed to the caller), by tier and transport.",
            labels=["namespace", "tier", "transport"],
        )
        served_bytes = CounterMetricFamily(
            "kvtier_client_served_bytes",
            "Bytes of objects served and verified, by tier and transport.",
            labels=["namespace", "tier", "transport"],
        )
        for namespace, stats in sorted(totals.items()):
            for key, count in sorted(stats.items()):
                if key.startswith("served_bytes_"):
                    tier, _, transport = key.removeprefix("served_bytes_").partition("_")
                    served_bytes.add_metric([namespace, tier, transport], count)
                elif key.startswith("served_"):
                    tier, _, transport = key.removeprefix("served_").partition("_")
                    served.add_metric([namespace, tier, transport], count)
        yield served
        yield served_bytes
        family = HistogramMetricFamily(
            "kvtier_client_op_latency_seconds",
            "Latency of client calls by method (outermost call: put -> batch_put counts as put).",
            labels=["namespace", "op"],
        )
        for (namespace, method), histogram in sorted(latency.items()):
            family.add_metric([namespace, method], histogram.buckets(), histogram.total)
        yield family
