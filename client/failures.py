"""What a client tells the master about failures: the copies that failed verification
(`ReportCorrupt`, kvtier.master.corrupt), and its data-plane failures per segment, which it also
avoids for its own next puts and reports (`ReportSegmentFailures`, kvtier.master.quarantine).

Segment failures counted: a connection that could not be made (refused, timed out), one that stopped answering
(timeout), one that broke mid-frame (transfer). Not counted: a segment's answer, whatever it says
(a checksum mismatch of one object, NOT_FOUND, an expired grant): the segment is reachable.

Bounded whatever happens: at most `MAX_SEGMENTS` segments remembered (the oldest failure is
forgotten first), and the report pending holds at most one counter per (segment, kind). Reports go
out at most every `report_interval_s`, riding on the end of the client's next put or get once due.
Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import ConnectError, TransportError
from kvtier.proto.status import Status

logger = logging.getLogger("kvtier.client.client")

MAX_SEGMENTS = 256  # also the most entries the master reads from one report or avoid list
# The segments whose connections failed during the current read call (kvtier.client.reads sets a fresh
# set for the call; a put attempt sets one for its writes): one call notes a segment once, however
# many of its attempts or parts there fail (a read retries; a shared copy runs in parts), and the read
# path tells by it a failed connection from a segment's answer.
call_failures: ContextVar[set[str] | None] = ContextVar("kvtier_call_failures", default=None)
_seen_lock = threading.Lock()


class Refused(ConnectError):
    """The segment answered, refusing the connection (at its connection limit): busy, not unreachable."""


def failure_kind(exc: BaseException) -> str | None:
    """What a failed transfer says about the segment: "connect" (no connection), "timeout" (a
    connection stopped answering), "transfer" (one broke mid-frame); None for a refusal."""
    if isinstance(exc, Refused):
        return None
    if isinstance(exc, ConnectError):
        return "connect"
    if isinstance(exc, (TimeoutError, BlockingIOError)):  # SO_RCVTIMEO / SO_SNDTIMEO: EAGAIN
        return "timeout"
    return "transfer"


class SegmentFailures:
    def __init__(self, avoid_s: float, report_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.avoid_s = avoid_s
        self.report_interval_s = report_interval_s
        self.clock = clock
        self.reporter = uuid.uuid4().hex[:16]  # distinct clients count towards quarantine_reporters
        self._lock = threading.Lock()
        self._failed_at: OrderedDict[str, float] = OrderedDict()  # segment -> last failure, oldest first
        self._pending: dict[tuple[str, str], int] = {}  # (segment, kind) -> failures not yet reported
        self._next_report = 0.0
        self.reporting = True  # False once the master refused this client's reports (a tenant)

    def note(self, segment: str, kind: str) -> None:
        """A transfer to `segment` failed (kind: "connect", "timeout" or "transfer")."""
        now = self.clock()
        with self._lock:
            self._failed_at.pop(segment, None)
            self._failed_at[segment] = now
            if len(self._failed_at) > MAX_SEGMENTS:
                self._failed_at.popitem(last=False)
            key = (segment, kind)
            if key in self._pending or len(self._pending) < 3 * MAX_SEGMENTS:
                self._pending[key] = self._pending.get(key, 0) + 1

    def avoid(self) -> list[str]:
        """Segments that failed this client within `avoid_s`: its puts ask the master to place
        elsewhere (PutStartRequest.avoid_segments), so a cut segment costs one timeout, not one per put."""
        if not self._failed_at:  # the common case, without the lock (a racing note() shows next time)
            return []
        horizon = self.clock() - self.avoid_s
        with self._lock:
            while self._failed_at:
                name, at = next(iter(self._failed_at.items()))
                if at >= horizon:
                    break
                del self._failed_at[name]
            return list(self._failed_at)

    def recently_failed(self) -> frozenset[str]:
        """`avoid()` as a set: reads try these segments' replicas last."""
        return frozenset(self.avoid())

    def take_report(self) -> list[tuple[str, int, str]]:
        """(segment, count, kind) to report now, or [] when nothing is pending or the last report
        was less than `report_interval_s` ago (what is pending then waits for the next one)."""
        if not self._pending:  # the common case, without the lock
            return []
        now = self.clock()
        with self._lock:
            if not self._pending or now < self._next_report:
                return []
            self._next_report = now + self.report_interval_s
            pending, self._pending = self._pending, {}
        return [(segment, count, kind) for (segment, kind), count in pending.items()]


class FailureReports:
    """What `Client` tells the master about failures (a mixin over its `_failures`, `_master`,
    `namespace` and `_count`): segments it cannot use, and copies that failed verification."""

    _failures: SegmentFailures
    _master: Any
    _count: Callable[..., None]
    namespace: str

    def _transport_failed(self, segment: str, exc: TransportError) -> None:
        """No connector for `segment` (connectors report their own transfers' failures)."""
        kind = failure_kind(exc)
        if kind is not None and exc.retryable:
            self._segment_failed(segment, kind)

    def _segment_failed(self, segment: str, kind: str) -> None:
        """A connection to `segment` failed: noted (avoided, reported) once per call (`call_failures`)."""
        seen = call_failures.get()
        if seen is not None:
            with _seen_lock:  # a call's jobs run on several threads
                if segment in seen:
                    return
                seen.add(segment)
        self._failures.note(segment, kind)

    def _report_failures(self) -> None:
        """Tell the master which segments failed this client (kvtier.master.quarantine), when a report
        is due. Best effort: bounded by the client's timeout, never raising."""
        report = self._failures.take_report()
        if not report or not self._failures.reporting:
            return
        request = pb.SegmentFailuresRequest(
            reporter=self._failures.reporter,
            failures=[pb.SegmentFailure(segment=s, count=c, kind=k) for s, c, k in report],
        )
        try:
            self._master.call("ReportSegmentFailures", request)
        except Exception as exc:  # noqa: BLE001 - a report must never fail the call it rides on
            if getattr(exc, "status", None) == Status.PERMISSION_DENIED:
                # A tenant's credentials: reports are the cluster's (kvtier.master.auth); it still avoids.
                self._failures.reporting = False
                logger.info("segment failure reports are not accepted for this client's principal: not sent")
                return
            logger.warning("reporting failures of %d segments to the master failed: %s", len(report), exc)
            self._count(failure_reports_failed=1)
            return
        self._count(failure_reports=1)

    def _report_corrupt(
        self, keys: Sequence[str], reply: pb.GetReplicasResponse, corrupt: list[tuple[int, int]]
    ) -> None:
        """Tell the master which copies failed verification, so it drops them (kvtier.master.corrupt)
        and the next put of the key writes it anew. Best effort: one call, bounded by the client's
        timeout, never raising; the reads stay misses (or the other replica's bytes) either way."""
        names = {s.segment_id: s.name for s in reply.segments}
        request = pb.ReportCorruptRequest(
            namespace=self.namespace,
            keys=[keys[i] for i, _ in corrupt],
            segment_ids=[reply.replica_segments[j] for _, j in corrupt],
            tiers=[reply.replica_tiers[j] for _, j in corrupt],
            offsets=[reply.replica_offsets[j] for _, j in corrupt],
            checksums=[reply.checksums[i] for i, _ in corrupt],
            segment_names=[names.get(reply.replica_segments[j], "") for _, j in corrupt],
        )
        try:
            statuses = self._master.call("ReportCorrupt", request).statuses
        except Exception as exc:  # noqa: BLE001 - a report must never turn a miss into an error
            logger.warning("reporting %d corrupt copies to the master failed: %s", len(corrupt), exc)
            self._count(corrupt_reports_failed=len(corrupt))
            return
        self._count(corrupt_reported=len(corrupt), corrupt_dropped=sum(1 for st in statuses if st == Status.OK))
