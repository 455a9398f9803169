"""Fixed-bucket latency histograms, cheap enough for every request on a hot path.

Kept apart from kvtier.common.metrics so that the client library can time its
calls without importing prometheus-client (the engine's metrics are opt-in).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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
