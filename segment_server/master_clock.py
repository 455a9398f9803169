"""The master's wall clock as this segment keeps it: what grant expiries are judged against.

A grant's expiry (a capability tag's, or FLAG_DEADLINE's) is a time on the master's wall clock;
the master reuses the range CLOCK_SKEW_MS after it (kvtier.proto.auth). Judged on the segment's
own wall clock, a segment whose clock is behind would accept a grant that already ended, after
the range went to another object; one whose clock is ahead refuses every grant. So the segment
judges them on the master's clock instead: every mount and heartbeat reply carries the master's
wall clock, and the segment keeps the offset between it and its own clock. The master stamped the
reply somewhere between our send and our receipt, so its clock now is at most the stamp plus the
time since our send: that latest possible time is the estimate (kept while later replies agree with
it: then it may lag the truth by the quickest recent round trip, milliseconds, far inside the 2 s
margin), and a grant ends early by at most a round trip. (Taken at the middle of the round
trip, a reply held up for seconds, by a master or segment stopped while it was in flight, put the
estimate seconds behind and grants that had ended, ranges the master had reused, were served.) The
local clock is CLOCK_BOOTTIME: it never steps, so neither a wrong wall clock nor a correction of it
(NTP stepping it) moves the estimate, and unlike the monotonic clock it counts a suspended host's
sleep, during which the master's clock went on. Until the first reply the segment's own wall clock
is all there is; no grant can be valid then anyway
(kvtier.segment_server.protocol: nothing is granted before a mount).

`skew_ms` is this segment's wall clock minus the master's (logged; the master measures and shows
its own estimate, kvtier.master.segment_table).
"""

from __future__ import annotations

import time

from kvtier.proto.auth import wall_ms


def local_s() -> float:
    """The clock grant windows are kept on: CLOCK_BOOTTIME (counts a suspend; never steps)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class MasterClock:
    """Written by the master link's thread, read by the event loop: one float, swapped whole."""

    def __init__(self) -> None:
        self._offset_ms: float | None = None  # master wall clock - our monotonic clock, ms
        self.skew_ms = 0
        self.rtt_ms = 0  # of the last exchange

    def observe(self, sent: float, received: float, master_wall_ms: int) -> None:
        """A reply carrying the master's wall clock arrived: `sent`/`received` are `local_s()`."""
        if master_wall_ms <= 0:  # an older master that does not send it: keep what we had
            return
        latest = master_wall_ms - sent * 1000.0  # the master stamped it after our send...
        earliest = master_wall_ms - received * 1000.0  # ...and before our receipt
        current = self._offset_ms
        # An estimate the reply agrees with stays (an earlier, quicker round trip made it tighter: a
        # reply held up for seconds would otherwise run the clock ahead, refusing valid grants for an
        # interval); one it proves behind (a step of the master's clock) or ahead goes to `latest`.
        if current is None or not earliest <= current <= latest:
            self._offset_ms = latest
        self.rtt_ms = max(0, int((received - sent) * 1000))
        self.skew_ms = wall_ms() - self.now_ms()

    def now_ms(self) -> int:
        """The master's wall clock now, as well as this segment knows it."""
        offset = self._offset_ms
        if offset is None:
            return wall_ms()
        return int(local_s() * 1000.0 + offset)
