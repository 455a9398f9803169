"""Clock skew between a segment and the master, from the wall clocks mounts and heartbeats carry.

A segment stamps each mount and heartbeat with its wall clock when it sends it (`sent_ms`) and the
round trip of its previous heartbeat (`rtt_ms`); the master notes its own wall clock when the call
reaches its handler (`received_ms`). With θ the segment's clock minus the master's and d the
one-way delay (0 <= d <= rtt): sent_ms = true send time + θ and received_ms = true send time + d,
so θ lies in [sent_ms - received_ms, sent_ms - received_ms + rtt_ms]. The estimate is the middle;
the segment is skewed only when the whole interval is beyond the tolerance, so a slow round trip
never makes a segment look skewed. Why it matters: grants carry expiries on the master's clock,
and a segment judging them on a clock that is off refuses every write (ahead) or could accept an
ended grant (behind; kvtier.segment_server.master_clock judges them on the master's clock since),
so a skewed segment takes no new objects until its clock is fixed (docs/architecture.md,
"Segment liveness"). Pure functions: no grpc, no clock read here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SkewReading:
    skew_s: float  # the estimate: segment wall clock minus master wall clock
    skewed: bool  # beyond the tolerance whatever the one-way delay was


def read_skew(sent_ms: int, received_ms: int, rtt_ms: int, tolerance_s: float) -> SkewReading | None:
    """None when the segment sent no clock (an older segment: nothing is known, nothing changes)."""
    if sent_ms <= 0:
        return None
    low_ms = sent_ms - received_ms
    high_ms = low_ms + max(rtt_ms, 0)
    tolerance_ms = tolerance_s * 1000.0
    skewed = low_ms > tolerance_ms or high_ms < -tolerance_ms
    return SkewReading((low_ms + high_ms) / 2000.0, skewed)
