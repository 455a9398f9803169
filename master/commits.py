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

PutEnd and Remove answer only once every segment that keeps an index
acknowledged every notice about the call's names made before the answer
(`barrier` / `acked`; kvtier.master.commit_wait's `Barrier` adds the FORGETs of
SSD copies, see kvtier.master.tiering): an object a client saw committed is in
a segment's index, and one it saw removed is in none, whatever happens to the
master next. Waiting for every segment with a notice about the name, not only
those the call touched, also orders versions: when a key is dropped on one
segment and put again, with other bytes, on another, the drop is acknowledged
before the new put is, so a restart can never bring back the old bytes next
to, or instead of, the new. Notices about other names are not waited for: a
segment cut off with some pending (every busy segment has a few: a relayed
call's are acknowledged ~2 ms after its answer) would otherwise hold every
put in the cluster until it is expelled at `segment_ttl_s`. RemovePrefix,
whose names are a sweep's, waits for every notice (`barrier(names=None)`).

Nobody is ever counted as having acknowledged what it did not. A segment
whose feed has notices waiting and has not polled for `segment_ttl_s` is
expelled by the master (`silent`, then MasterState drops it): its objects
leave the tables, the waits for it end, and its name is saved as expelled
before those waits answer. When it mounts again to this master it re-adopts
what its fence admits (kvtier.master.fences); to a later incarnation it
discards its index, stale from then on.

A move (drain, `move_replica`) keeps its source copy as a replica until the
target acknowledged the commit of its copy (`after_acked`, kvtier.master.drain):
the object is in some index all along, and the source's drop notice, made only
then, comes before any commit of the freed range's next object. If the target
goes away first, the move failed and the source copy simply stays.

A relayed call's notices (RelayPutEnd) go back in its answer and do not wake
the relaying segment's long poll; nor are they due to it (`poll` and
`has_notices` stop before the first of them) until something waits for them
(`barrier`, `after_acked`) or an ordinary notice wakes the poll: handing
them out would only make the feed poll again at once (docs/architecture.md,
"Commit through the segment").

Plain Python, owned by `MasterState`'s thread like everything else; the
waiting itself is asyncio plumbing in kvtier.master.commit_wait.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.master.records import OFFSET_MASK, PIN_SOFT, SEGMENT_SHIFT, ObjectRecord
from kvtier.proto.status import Status

# A relayed PutEnd's answer while a dropped segment may still serve direct reads
# (MasterState.direct_read_fence): the client sends its PutEnd to the master, which waits for it.
FENCED_RELAY = "a direct-read fence is ahead: send the PutEnd to the master"


@dataclass(slots=True, eq=False)
class SegmentFeed:
    """Notices of one mounted segment not yet acknowledged, and how far it got."""

    last_poll: float  # when it last polled (mount time before the first poll)
    keeps_index: bool  # it keeps an index: waited for, and expelled when silent
    notices: deque[tuple[int, ObjectRecord, bool]] = field(default_factory=deque)  # (offset, record, is a drop)
    first_seq: int = 1  # sequence number of notices[0]
    acked: int = 0  # every notice up to this one is applied by the segment
    # Sequence number of the first notice made while its long poll was not woken (a relayed call's:
    # the segment applies them from the call's answer), 0: none. Every notice from there on is such a
    # relayed one (any other notice wakes the poll): not due to the feed (`poll`, `has_notices`) until
    # another call waits for them (`barrier`, `after_acked`) or another notice wakes the poll.
    unwoken_from: int = 0
    unwoken_since: float = 0.0  # when unwoken_from last moved: RELAYED_DUE_AFTER_S later they are due anyway
    # What waits for this segment to acknowledge up to seq: (seq, called with True then, or with False
    # when the segment goes first). A move's source drop (kvtier.master.drain).
    after_ack: deque[tuple[int, Callable[[bool], None]]] = field(default_factory=deque)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.notices) - 1

    @property
    def unwoken(self) -> bool:
        return self.unwoken_from != 0

    def due_seq(self, now: float) -> int:
        """The last notice due to the feed: every one before the first unwoken relayed notice, all
        of them once those waited RELAYED_DUE_AFTER_S unacknowledged (their answer was lost and
        nobody else asked for them: the index still gets them)."""
        if self.unwoken_from and now - self.unwoken_since < RELAYED_DUE_AFTER_S:
            return self.unwoken_from - 1
        return self.last_seq


@dataclass(slots=True)
class Notices:
    """One poll's answer: notices first_seq, first_seq + 1, ..."""

    first_seq: int
    items: list[tuple[int, ObjectRecord, bool]]


# Relayed notices unacknowledged this long are due to the feed even if nobody waits for them: the
# segment acknowledges its relays within milliseconds (on its next relay, or ~2 ms later alone), so
# only an answer lost on its way (its client gone too, or it would PutEnd itself) gets here.
RELAYED_DUE_AFTER_S = 1.0
# A poll's answer stays far below the 64 MiB gRPC message limit whatever the key lengths.
POLL_BYTES = 4 << 20
_NOTICE_OVERHEAD = 64  # protobuf bytes of a notice besides its names


class CommitLog:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._feeds: dict[int, SegmentFeed] = {}
        self.counters: Counter[str] = Counter()
        # Object name -> {segment id: sequence number of its last notice about the name not yet
        # acknowledged}, for segments that keep an index: what a call about the name waits for.
        self._unacked_by_name: dict[str, dict[int, int]] = {}
        self.notify: Callable[[int], None] | None = None  # wakes a long poll of that segment
        self.on_ack: Callable[[], None] | None = None  # wakes PutEnds waiting for acknowledgements
        # The segment relaying the call being handled (RelayPutEnd): its notices do not wake its poll.
        self.relaying = 0
        # PutEnds not answered yet (kvtier.master.commit_wait settles them): a segment dropped now
        # takes their copies there, and their writers will hear SEGMENT_NOT_FOUND.
        self.waiting_puts: weakref.WeakSet[PutAcknowledgement] = weakref.WeakSet()

    # ------------------------------------------------------------------ segments

    def mounted(self, segment_id: int, keeps_index: bool) -> None:
        self._feeds[segment_id] = SegmentFeed(self._clock(), keeps_index)

    def keeps_index(self, segment_id: int) -> bool:
        feed = self._feeds.get(segment_id)
        return feed is not None and feed.keeps_index

    def written_to(self, segment_id: int) -> list[str]:
        """Names committed by PutEnds not answered yet with a copy on `segment_id`: dropped now, the
        segment takes them, so their writers will be told SEGMENT_NOT_FOUND (PutAcknowledgement)."""
        return [
            record.name
            for ack in list(self.waiting_puts)
            for _, record, replicas in ack.committed
            if any(p >> SEGMENT_SHIFT == segment_id for p in replicas)
        ]

    def unacked_names(self, segment_id: int) -> set[str]:
        """Object names of the segment's notices not acknowledged yet (the seed of its fence,
        kvtier.master.fences): its index may or may not have applied them."""
        feed = self._feeds.get(segment_id)
        if feed is None:
            return set()
        return {record.name for _, record, _ in feed.notices}

    def unacked_seqs(
        self, segment_id: int, current: Callable[[str], ObjectRecord | None] | None = None
    ) -> dict[str, int]:
        """`unacked_names` with, for each name, the sequence number of its last unacknowledged notice
        (a name can have a commit and a drop pending): a segment whose index applied up to it under
        this mount reflects every notice about the name (kvtier.master.fences `release`).

        With `current` (name -> the key's record now), only the names of which some unacknowledged
        notice names another version than the current one (removed, replaced, evicted): a notice
        about the current version (its commit, a copy of it moved between tiers or segments) changed
        nothing a returning copy of that version could contradict."""
        feed = self._feeds.get(segment_id)
        if feed is None:
            return {}
        seq = feed.first_seq
        seqs = {record.name: seq + i for i, (_, record, _) in enumerate(feed.notices)}  # later wins
        if current is None:
            return seqs
        notices = list(feed.notices)  # `current` must not change the feed, but never iterate it live
        changed = {record.name for _, record, _ in notices if current(record.name) is not record}
        return {name: n for name, n in seqs.items() if name in changed}

    def segment_dropped(self, segment_id: int) -> None:
        feed = self._feeds.pop(segment_id, None)
        if feed is not None:
            self._forget_names(segment_id, feed)
            for _, then in feed.after_ack:  # it never acknowledged: what waited for it is told so
                then(False)
        if self.on_ack is not None:
            self.on_ack()  # waiters for it are done: it was expelled or left

    def forgive(self, gap_s: float) -> None:
        """The master did not run for `gap_s`: no feed is counted silent for that time."""
        for feed in self._feeds.values():
            feed.last_poll += gap_s

    def silent(self, ttl_s: float) -> list[int]:
        """Segments keeping an index with notices waiting that have not polled for `ttl_s`."""
        now = self._clock()
        return [
            segment_id
            for segment_id, feed in self._feeds.items()
            if feed.keeps_index and feed.last_seq > feed.acked and now - feed.last_poll > ttl_s
        ]

    # ------------------------------------------------------------------ notices

    def committed(self, segment_id: int, offset: int, record: ObjectRecord) -> None:
        """A DRAM copy at `offset` on the segment became readable."""
        feed = self._feeds.get(segment_id)
        if feed is not None:
            feed.notices.append((offset, record, False))
            if feed.keeps_index:
                self._unacked(record.name, segment_id, feed.last_seq)
            self._wake(segment_id, feed, feed.last_seq)

    def committed_records(self, records: list[ObjectRecord]) -> None:
        """Every (DRAM) replica of each record became readable: `committed` in bulk (PutEnd's path)."""
        feeds = self._feeds
        touched: dict[int, int] = {}  # segment id -> sequence number of its first notice of this call
        for record in records:
            for packed in record.replicas:
                segment_id = packed >> SEGMENT_SHIFT
                feed = feeds.get(segment_id)
                if feed is not None:
                    feed.notices.append((packed & OFFSET_MASK, record, False))
                    seq = feed.last_seq
                    if feed.keeps_index:
                        self._unacked(record.name, segment_id, seq)
                    if segment_id not in touched:
                        touched[segment_id] = seq
        for segment_id, first in touched.items():
            self._wake(segment_id, feeds[segment_id], first)

    def dropped(self, segment_id: int, offset: int, record: ObjectRecord) -> None:
        """The DRAM copy of `record` at `offset` on the segment is no longer one (its range may be reused)."""
        feed = self._feeds.get(segment_id)
        if feed is not None:
            feed.notices.append((offset, record, True))
            if feed.keeps_index:
                self._unacked(record.name, segment_id, feed.last_seq)
            self._wake(segment_id, feed, feed.last_seq)

    def _unacked(self, name: str, segment_id: int, seq: int) -> None:
        segments = self._unacked_by_name.get(name)
        if segments is None:
            self._unacked_by_name[name] = {segment_id: seq}
        else:
            segments[segment_id] = seq

    def _acked_name(self, name: str, segment_id: int, seq: int) -> None:
        """The segment applied its notice `seq` about `name`: forgotten, unless a later one is pending."""
        segments = self._unacked_by_name.get(name)
        if segments is not None and segments.get(segment_id, seq) <= seq:
            segments.pop(segment_id, None)
            if not segments:
                del self._unacked_by_name[name]

    def _forget_names(self, segment_id: int, feed: SegmentFeed) -> None:
        """The segment's feed is gone: nothing waits for its notices any more."""
        for _, record, _ in feed.notices:
            segments = self._unacked_by_name.get(record.name)
            if segments is not None and segments.pop(segment_id, None) is not None and not segments:
                del self._unacked_by_name[record.name]

    def _wake(self, segment_id: int, feed: SegmentFeed, first: int) -> None:
        """New notices for the segment, from `first` on: wake its long poll (every notice is due to
        it now), unless it relays the call making them (they wait, not due, from the first such)."""
        if segment_id == self.relaying:
            if not feed.unwoken_from:
                feed.unwoken_from, feed.unwoken_since = first, self._clock()
        else:
            feed.unwoken_from = 0
            if self.notify is not None:
                self.notify(segment_id)

    def after_acked(self, segment_id: int, then: Callable[[bool], None]) -> None:
        """`then(True)` once the segment acknowledged every notice queued for it so far (at once when
        none is outstanding, or it keeps no index), `then(False)` if it goes away before: a move's
        source copy leaves only when the target's index has the object (kvtier.master.drain)."""
        feed = self._feeds.get(segment_id)
        if feed is None or not feed.keeps_index or feed.acked >= feed.last_seq:
            then(feed is not None)
            return
        feed.after_ack.append((feed.last_seq, then))
        if feed.unwoken_from and segment_id != self.relaying:  # something waits for them: due now
            self._wake(segment_id, feed, 0)

    def next_seq(self, segment_id: int) -> int:
        """The sequence number the segment's next notice will get (0: not mounted)."""
        feed = self._feeds.get(segment_id)
        return 0 if feed is None else feed.last_seq + 1

    def first_unacked(self, segment_id: int) -> int:
        """The sequence number of the segment's first notice not acknowledged yet (0: not mounted)."""
        feed = self._feeds.get(segment_id)
        return 0 if feed is None else feed.acked + 1

    def since(self, segment_id: int, first: int) -> list[tuple[int, ObjectRecord, bool]]:
        """The segment's notices from `first` on that it has not acknowledged (a RelayPutEnd's
        answer: from the segment's first unacknowledged notice, or a backlog's worth before the
        call's own, through the call's)."""
        feed = self._feeds.get(segment_id)
        if feed is None or first > feed.last_seq:
            return []
        skip = max(first - feed.first_seq, 0)
        return [feed.notices[i] for i in range(skip, len(feed.notices))]

    def ack(self, segment_id: int, acked_seq: int) -> None:
        """The segment applied every notice up to `acked_seq` (a RelayPutEnd's, like a poll's)."""
        feed = self._feeds.get(segment_id)
        if feed is not None:
            self._ack(segment_id, feed, acked_seq)

    def _ack(self, segment_id: int, feed: SegmentFeed, acked_seq: int) -> None:
        acked_seq = min(acked_seq, feed.last_seq)
        if acked_seq > feed.acked:
            if feed.keeps_index:
                for seq in range(feed.first_seq, acked_seq + 1):
                    self._acked_name(feed.notices.popleft()[1].name, segment_id, seq)
            else:
                for _ in range(acked_seq - feed.first_seq + 1):
                    feed.notices.popleft()
            feed.first_seq = acked_seq + 1
            feed.acked = acked_seq
            if acked_seq == feed.last_seq:
                feed.unwoken_from = 0  # nothing left unacknowledged, unwoken or not
            elif feed.unwoken_from and acked_seq >= feed.unwoken_from:
                # the rest are relayed too (any other notice wakes the poll): their own grace starts
                feed.unwoken_from, feed.unwoken_since = acked_seq + 1, self._clock()
            while feed.after_ack and feed.after_ack[0][0] <= acked_seq:
                feed.after_ack.popleft()[1](True)
            if self.on_ack is not None:
                self.on_ack()

    def has_notices(self, segment_id: int, acked: int) -> bool:
        """Whether notices after `acked` are due to the segment's feed (unwoken relayed ones are not)."""
        feed = self._feeds.get(segment_id)
        return feed is not None and feed.due_seq(self._clock()) > acked

    def poll(self, segment_id: int, acked_seq: int, limit: int) -> Notices | None:
        """Apply the acknowledgement, then the notices after it that are due (at most `limit`, and
        at most POLL_BYTES of them; none from the first unwoken relayed one on: the segment has them
        from its relay's answer, and handing them out would only make its feed poll again at once);
        None when the segment is not mounted."""
        feed = self._feeds.get(segment_id)
        if feed is None:
            return None
        now = feed.last_poll = self._clock()
        self._ack(segment_id, feed, acked_seq)
        start = feed.acked + 1  # a segment that lost a reply polls with an older ack: resend
        skip = start - feed.first_seq
        items = []
        budget = POLL_BYTES
        notices = feed.notices
        for i in range(skip, min(feed.due_seq(now) - feed.first_seq + 1, skip + limit)):
            item = notices[i]
            budget -= len(item[1].name) + _NOTICE_OVERHEAD
            if budget < 0 and items:
                break
            items.append(item)
        return Notices(start, items)

    # ------------------------------------------------------------------ waiting

    def barrier(self, relayed_by: int = 0, names: Iterable[str] | None = None) -> dict[int, int]:
        """Every notice about `names` made so far and not yet acknowledged (every notice when
        `names` is None): segment id -> sequence number to wait for. Segments that keep no index are
        left out, and `relayed_by` (a RelayPutEnd's segment: it applies its notices itself, in
        order, before it answers the client)."""
        if names is None:
            waits = {
                s: f.last_seq
                for s, f in self._feeds.items()
                if f.keeps_index and f.last_seq > f.acked and s != relayed_by
            }
        else:
            waits = {}
            unacked = self._unacked_by_name
            for name in names:
                segments = unacked.get(name)
                if segments:
                    for s, seq in segments.items():
                        if s != relayed_by and seq > waits.get(s, 0):
                            waits[s] = seq
        for segment_id in waits:  # relayed notices someone waits for now: the segment's poll brings the ack
            feed = self._feeds[segment_id]
            if feed.unwoken:
                self._wake(segment_id, feed, 0)
        return waits

    def acked(self, barrier: dict[int, int]) -> bool:
        """Whether every segment of `barrier` acknowledged its notices, or is gone (left or expelled)."""
        feeds = self._feeds
        for segment_id, seq in barrier.items():
            feed = feeds.get(segment_id)
            if feed is not None and feed.acked < seq:
                return False
        return True

    def any_gone(self, barrier: dict[int, int]) -> bool:
        """Whether a segment of `barrier` left or was expelled (its notices count as acknowledged)."""
        feeds = self._feeds
        return any(segment_id not in feeds for segment_id in barrier)

    def backlog(self) -> int:
        return sum(len(f.notices) for f in self._feeds.values())

    def unacked_name_count(self) -> int:
        """Names with a notice not yet acknowledged (bounded like the notices themselves)."""
        return len(self._unacked_by_name)


def notice_pin(record: ObjectRecord, now: float) -> tuple[int, int]:
    """(pin, pin_ttl_ms) of a notice: a soft pin carries the time it has left."""
    pin = record.pin
    return pin, int(max(0.0, record.pin_until - now) * 1000) if pin == PIN_SOFT else 0


@dataclass(slots=True, eq=False, weakref_slot=True)
class PutAcknowledgement:
    """What a PutEnd answered OK must still hold when its answer goes out ("acknowledged means
    stored"): a segment the object was written to is still mounted under the same incarnation
    (segment ids are never reused), and so acknowledged it (a replicated key may have lost others).

    A PutEnd waits for its segments' acknowledgements; a segment that dies instead is expelled,
    which ends the wait, and its copies are gone (with shm, a writer may even have copied the
    bytes into a dead segment's still-mapped region). Such keys are answered SEGMENT_NOT_FOUND,
    never OK. Cheap on the hot path: dropping a segment gives every record on it new replicas once
    its sweep reached it, so while no dead segment is being swept, a record whose replicas still equal
    the ones committed (segment ids are never reused) needs no further look. (Equal, not identical: a
    packed record builds the tuple on each read, kvtier.master.records.)
    """

    # (index in the answer, the committed record, its replicas then), from MasterState.put_end
    committed: list[tuple[int, ObjectRecord, tuple[int, ...]]] = field(default_factory=list)
    group: bool = False  # a group's PutEnd (kvtier.master.groups): one key lost fails every key

    def settle(self, mounted: Container[int], statuses: Any, sweeping: bool = False) -> int:
        """Turn the OK of every key whose every replica's segment is gone into SEGMENT_NOT_FOUND; how
        many. A key with a replica left is stored (that segment acknowledged it): OK, with fewer
        copies, as if the segment had died right after the answer. (Failing it while its version
        stayed visible told a writer "not stored" of bytes readers had, and an upsert's old version
        gone.) `sweeping`: a dead segment's records are still being swept (kvtier.master.sweeps), so
        an unchanged tuple proves nothing and every key is checked."""
        lost = 0
        for i, record, replicas in self.committed:
            if record.replicas == replicas and not sweeping:
                continue
            if not any(p >> SEGMENT_SHIFT in mounted for p in replicas):
                statuses[i] = int(Status.SEGMENT_NOT_FOUND)
                lost += 1
        if lost and self.group:
            for i in range(len(statuses)):
                statuses[i] = int(Status.SEGMENT_NOT_FOUND)
        return lost
