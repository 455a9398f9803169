"""The master's wall clock as this segment keeps it: what grant expiries are judged against.

A grant's expiry (a capability tag's, or FLAG_DEADLINE's) is a time on the master's wall clock;
the master reuses the range CLOCK_SKEW_MS after it (kvtier.proto.auth). Judged on the segment's
own wall clock, a segment whose clock is behind would accept a grant that already ended, after
the range went to another object; one whose clock is ahead refuses every grant. So the segment
judges them on the master's clock instead: every mount and heartbeat reply carries the master's
wall clock, and the segment keeps the offset between it and its own monotonic clock (taken at the
middle of the round trip, so the error is at most half of it). The monotonic clock never steps,
so neither a wrong wall clock nor a correction of it (NTP stepping it) moves the estimate. Until
the first reply the segment's own wall clock is all there is; no grant can be valid then anyway
(kvtier.segment_server.protocol: nothing is granted before a mount).

`skew_ms` is this segment's wall clock minus the master's (logged; the master measures and shows
its own estimate, kvtier.master.segment_table).
"""

from __future__ import annotations

import time

from kvtier.proto.auth import wall_ms


class MasterClock:
    """Written by the master link's thread, read by the event loop: one float, swapped whole."""

    def __init__(self) -> None:
        self._offset_ms: float | None = None  # master wall clock - our monotonic clock, ms
        self.skew_ms = 0
        self.rtt_ms = 0  # of the last exchange

    def observe(self, sent: float, received: float, master_wall_ms: int) -> None:
        """A reply carrying the master's wall clock arrived: `sent`/`received` are time.monotonic()."""
        if master_wall_ms <= 0:  # an older master that does not send it: keep what we had
            return
        middle_ms = (sent + received) * 500.0
        self._offset_ms = master_wall_ms - middle_ms
        self.rtt_ms = max(0, int((received - sent) * 1000))
        self.skew_ms = wall_ms() - self.now_ms()

    def now_ms(self) -> int:
        """The master's wall clock now, as well as this segment knows it."""
        offset = self._offset_ms
        if offset is None:
            return wall_ms()
        return int(time.monotonic() * 1000.0 + offset)
