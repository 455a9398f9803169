"""Prometheus exposition shared by the master and the segment servers (`--metrics HOST:PORT`).

Each service gives a collector that reads its own counters at scrape time:
nothing on a hot path touches prometheus-client. The HTTP listener binds
exactly the address it is given, on its own thread; `/metrics` also carries
the process's CPU, RSS and open fds (prometheus-client's process collector)
and its thread count.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.proto.units import parse_hostport

# Seconds; metadata calls take tens of microseconds to tens of milliseconds.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class LatencyHistogram:
    """A fixed-bucket histogram cheap enough for every RPC (one bisect, two adds)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs in the exposition's form, +Inf last."""
        out, running = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


def histogram_family(name: str, documentation: str, label: str, histograms: dict[str, LatencyHistogram]) -> Metric:
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.buckets(), histogram.total)
    return family


class _Threads(Collector):
    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("process_threads", "Threads of this process.", value=threading.active_count())


def serve_metrics(listen: str, collector: Collector) -> str:
    """Serve `/metrics` on exactly `listen` (HOST:PORT, port 0 = any); the bound address."""
    host, port = parse_hostport(listen)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(_Threads())
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound_host, bound_port = server.server_address[:2]
    return f"{bound_host}:{bound_port}"
