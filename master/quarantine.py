"""Quarantine of segments that clients cannot use (issue 21; Mooncake #2704: a dead segment kept
being chosen).

The master hears a segment's heartbeats, which says nothing about whether clients reach its data
plane: a segment cut from the clients but not from the master would keep taking puts, each failing
only at the writer's timeout. Clients therefore report their data-plane failures per segment
(`ReportSegmentFailures`: connect refused or timed out, a connection that stopped answering or
broke mid-frame; never a checksum mismatch or a miss). Reports of at least
`quarantine_reporters` distinct clients adding up to `quarantine_failures` within
`quarantine_window_s` put the segment in quarantine for `quarantine_cooloff_s`; a report while
quarantined starts the cool-off again. A quarantined segment is placed on only where no other
segment can take the object (kvtier.master.placement) and its replicas are listed last for reads.

Plain logic with an injected clock, no gRPC; owned by `MasterState` and called on its thread.
Memory is bounded: at most `MAX_SEGMENTS` segments tracked (the least recently reported goes
first), `MAX_EVENTS` reports kept per segment, counters for at most `MAX_COUNTERS` (segment, kind).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.master.config import MasterConfig

logger = logging.getLogger(__name__)

KINDS = ("connect", "timeout", "transfer")  # what a client reports; anything else counts as "other"
MAX_SEGMENTS = 4096
MAX_EVENTS = 256  # reports kept per segment within the window (each carries a count)
MAX_COUNTERS = 4 * MAX_SEGMENTS


@dataclass(slots=True)
class _Track:
    """One segment's recent reports and quarantine."""

    events: deque[tuple[float, str, int]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    until: float = 0.0  # quarantined while now < until
    reason: str = ""


class Quarantine:
    """Failure reports per segment name, and which segments are in quarantine."""

    def __init__(
        self,
        failures: int,
        reporters: int,
        window_s: float,
        cooloff_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.failures = failures  # 0: quarantine off (reports are still counted)
        self.reporters = reporters
        self.window_s = window_s
        self.cooloff_s = cooloff_s
        self.clock = clock
        self._tracks: OrderedDict[str, _Track] = OrderedDict()  # least recently reported first
        # (segment, kind) -> failures reported, for kvtier_master_segment_failure_reports_total
        self.reported: dict[tuple[str, str], int] = {}
        self._quarantined: set[str] = set()  # names with until > now, as of the last expire()

    @classmethod
    def of(cls, config: MasterConfig, clock: Callable[[], float]) -> Quarantine:
        c = config
        return cls(c.quarantine_failures, c.quarantine_reporters, c.quarantine_window_s, c.quarantine_cooloff_s, clock)

    def report(self, segment: str, count: int, kind: str, reporter: str) -> bool:
        """Note `count` failures of `kind` on `segment` by `reporter`. Whether the segment is in
        quarantine now (entered, or its cool-off started again)."""
        if count <= 0:
            return segment in self._quarantined
        kind = kind if kind in KINDS else "other"
        key = (segment, kind)
        if key in self.reported or len(self.reported) < MAX_COUNTERS:
            self.reported[key] = self.reported.get(key, 0) + count
        now = self.clock()
        track = self._tracks.pop(segment, None) or _Track()
        self._tracks[segment] = track  # most recently reported last
        if len(self._tracks) > MAX_SEGMENTS:
            self._drop_oldest(now, keep=segment)
        track.events.append((now, reporter, count))
        if not self.failures:
            return False
        horizon = now - self.window_s
        while track.events and track.events[0][0] < horizon:
            track.events.popleft()
        total = sum(e[2] for e in track.events)
        who = {e[1] for e in track.events}
        if total < self.failures or len(who) < self.reporters:
            return segment in self._quarantined
        reason = f"{total} failures from {len(who)} clients within {self.window_s:g}s (last: {kind})"
        if track.until <= now:
            # placed on last, read last, until the cool-off ends
            logger.warning("segment quarantined name=%s cooloff_s=%g reason=%s", segment, self.cooloff_s, reason)
        track.until = now + self.cooloff_s
        track.reason = reason
        self._quarantined.add(segment)
        return True

    def _drop_oldest(self, now: float, keep: str) -> None:
        """Forget the least recently reported segment not in quarantine (the oldest one at all when
        every tracked segment is in quarantine: memory stays bounded)."""
        for name, track in self._tracks.items():
            if track.until <= now and name != keep:
                del self._tracks[name]
                return
        name, _ = self._tracks.popitem(last=False)  # never `keep`: it was just moved to the end
        self._quarantined.discard(name)

    def expire(self) -> list[str]:
        """End the quarantines whose cool-off is over (logged); the names that left. Called by the
        master's tick: until then a segment stays quarantined a tick longer at most."""
        now = self.clock()
        left = []
        for name in list(self._quarantined):
            track = self._tracks.get(name)
            if track is None or track.until <= now:
                self._quarantined.discard(name)
                left.append(name)
                reason = track.reason if track is not None else ""
                logger.info("segment quarantine over name=%s was=%s", name, reason)  # placed on again
        horizon = now - self.window_s
        # Segments with nothing recent and no quarantine need no memory.
        idle = [n for n, t in self._tracks.items() if t.until <= now and (not t.events or t.events[-1][0] < horizon)]
        for name in idle:
            del self._tracks[name]
        return left

    def is_quarantined(self, segment: str) -> bool:
        return segment in self._quarantined

    @property
    def names(self) -> Iterable[str]:
        return self._quarantined

    def left_s(self, segment: str) -> float:
        """Seconds of cool-off left (0 when not quarantined)."""
        track = self._tracks.get(segment)
        if track is None or segment not in self._quarantined:
            return 0.0
        return max(0.0, track.until - self.clock())
