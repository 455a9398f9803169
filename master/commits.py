"""What each segment is told about the objects in its DRAM region: the commit log.

A master restart must not lose objects whose bytes still sit in live
segments, so each segment keeps an index of the complete objects in its
region, and a new master incarnation rebuilds its tables from those indexes
(`ReportDramObjects`). The segment learns them from here: every DRAM copy
that becomes readable (PutEnd, promotion from SSD, a drain's move) is a
*commit* notice to its segment, every DRAM copy that stops being one
(removal, eviction, offload, a move away) a *drop* notice. Notices are
numbered per segment and handed out in order by a long poll
(`PollCommits`); each poll acknowledges everything up to `acked_seq`.

PutEnd, Remove and RemovePrefix answer only once every segment acknowledged
every notice made before the answer (`barrier` / `acked`; the servicer's
`Barrier` adds the FORGETs of SSD copies, kvtier.master.tiering): an object a
client saw committed is in a segment's index, and one it saw removed is in
none, whatever happens to the master next. Waiting for all segments, not
only those the call touched, also orders versions: when a key is dropped on
one segment and put again, with other bytes, on another, the drop is
acknowledged before the new put is, so a restart can never bring back the
old bytes next to, or instead of, the new ones. A segment whose poll
has stalled (it hung, or its link is down) is waited for at most
`commit_wait_s`; its feed then counts as stalled, PutEnd stops waiting for
it until it polls again, and the `commit_waits_timed_out` counter says so.
Segments that never poll (older segment servers) are never waited for.

A segment the master drops while drops are still unacknowledged (its
heartbeats stopped, but the process lives on) keeps the stale entries in its
index; when it mounts again they would come back, removed objects included.
So those drops are remembered by segment name (`undelivered_drop`) until the
segment's next inventory is in, and entries matching one are refused.

Plain Python, owned by `MasterState`'s thread like everything else; the
waiting itself is asyncio plumbing in the servicer.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.master.records import PIN_SOFT, ObjectRecord


@dataclass(slots=True, eq=False)
class SegmentFeed:
    """Notices of one mounted segment not yet acknowledged, and how far it got."""

    notices: deque[tuple[int, ObjectRecord, bool]] = field(default_factory=deque)  # (offset, record, is a drop)
    first_seq: int = 1  # sequence number of notices[0]
    acked: int = 0  # every notice up to this one is applied by the segment
    polling: bool = False  # the segment polls its feed (it is waited for)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.notices) - 1


@dataclass(slots=True)
class Notices:
    """One poll's answer: notices first_seq, first_seq + 1, ..."""

    first_seq: int
    items: list[tuple[int, ObjectRecord, bool]]


class CommitLog:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._feeds: dict[int, SegmentFeed] = {}
        # segment name -> (offset, object name) of drops it never acknowledged before it was dropped
        self._undelivered: dict[str, set[tuple[int, str]]] = {}
        self.counters: Counter[str] = Counter()
        self.notify: Callable[[int], None] | None = None  # wakes a long poll of that segment
        self.on_ack: Callable[[], None] | None = None  # wakes PutEnds waiting for acknowledgements

    # ------------------------------------------------------------------ segments

    def mounted(self, segment_id: int) -> None:
        self._feeds[segment_id] = SegmentFeed()

    def segment_dropped(self, segment_id: int, name: str) -> None:
        feed = self._feeds.pop(segment_id, None)
        if feed is not None:
            drops = {(offset, record.name) for offset, record, drop in feed.notices if drop}
            if drops:
                self._undelivered.setdefault(name, set()).update(drops)
        if self.on_ack is not None:
            self.on_ack()  # waiters for it are done: nothing more can be acknowledged

    # ------------------------------------------------------------------ notices

    def committed(self, segment_id: int, offset: int, record: ObjectRecord) -> None:
        """A DRAM copy at `offset` on the segment became readable."""
        feed = self._feeds.get(segment_id)
        if feed is not None:
            feed.notices.append((offset, record, False))
            if self.notify is not None:
                self.notify(segment_id)

    def dropped(self, segment_id: int, offset: int, record: ObjectRecord) -> None:
        """The DRAM copy of `record` at `offset` on the segment is no longer one (its range may be reused)."""
        feed = self._feeds.get(segment_id)
        if feed is not None:
            feed.notices.append((offset, record, True))
            if self.notify is not None:
                self.notify(segment_id)

    def has_notices(self, segment_id: int, acked: int) -> bool:
        feed = self._feeds.get(segment_id)
        return feed is not None and feed.last_seq > acked

    def poll(self, segment_id: int, acked_seq: int, limit: int) -> Notices | None:
        """Apply the acknowledgement, then the notices after it (at most `limit`); None when the
        segment is not mounted."""
        feed = self._feeds.get(segment_id)
        if feed is None:
            return None
        if not feed.polling:
            feed.polling = True
        acked_seq = min(acked_seq, feed.last_seq)
        if acked_seq > feed.acked:
            for _ in range(acked_seq - feed.first_seq + 1):
                feed.notices.popleft()
            feed.first_seq = acked_seq + 1
            feed.acked = acked_seq
            if self.on_ack is not None:
                self.on_ack()
        start = feed.acked + 1  # a segment that lost a reply polls with an older ack: resend
        skip = start - feed.first_seq
        items = [feed.notices[i] for i in range(skip, min(len(feed.notices), skip + limit))]
        return Notices(start, items)

    # ------------------------------------------------------------------ waiting

    def barrier(self) -> dict[int, int]:
        """Every notice made so far and not yet acknowledged: segment id -> sequence number to wait
        for. Segments that do not poll their feed are left out."""
        return {s: f.last_seq for s, f in self._feeds.items() if f.polling and f.last_seq > f.acked}

    def acked(self, barrier: dict[int, int]) -> bool:
        """Whether every segment of `barrier` acknowledged its commits (or is gone, or stalled)."""
        feeds = self._feeds
        for segment_id, seq in barrier.items():
            feed = feeds.get(segment_id)
            if feed is not None and feed.polling and feed.acked < seq:
                return False
        return True

    def stalled(self, barrier: dict[int, int]) -> None:
        """A wait for `barrier` timed out: stop waiting for the segments that did not acknowledge
        until they poll again."""
        for segment_id, seq in barrier.items():
            feed = self._feeds.get(segment_id)
            if feed is not None and feed.polling and feed.acked < seq:
                feed.polling = False
                self.counters["commit_waits_timed_out"] += 1

    def undelivered_drop(self, segment_name: str, offset: int, name: str) -> bool:
        """Whether the segment of this name was dropped before it acknowledged dropping this entry."""
        drops = self._undelivered.get(segment_name)
        return drops is not None and (offset, name) in drops

    def inventory_done(self, segment_name: str) -> None:
        """The segment reported its index again: what it still had of those drops was refused."""
        self._undelivered.pop(segment_name, None)

    def backlog(self) -> int:
        return sum(len(f.notices) for f in self._feeds.values())


def notice_fields(record: ObjectRecord, now: float) -> tuple[str, str, int, int, str, int, int, int]:
    """(namespace, key, size, checksum, instance, rank, pin, pin_ttl_ms) of a commit notice."""
    namespace, _, key = record.name.partition("\x00")
    owner = record.owner
    pin = record.pin
    ttl_ms = int(max(0.0, record.pin_until - now) * 1000) if pin == PIN_SOFT else 0
    meta = record.meta
    return (
        namespace,
        key,
        meta >> 32,
        meta & 0xFFFF_FFFF,
        owner.instance if owner is not None else "",
        owner.rank if owner is not None else 0,
        pin,
        ttl_ms,
    )
