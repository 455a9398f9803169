"""The event log routers watch (WatchEvents, `kvtier events`; docs/events.md): objects stored,
removed, evicted and moved between tiers, in one sequence per master epoch.

Plain Python, no gRPC: `MasterState` and its policy modules publish (`stored`, `gone`,
`changed`); the servicer (kvtier.master.servicer) subscribes a watcher per stream and writes what
`take` hands it.

Bounded, and never in a writer's way:

- The log is a ring of the last `capacity` events (config `events_buffer`; 0 = off: publishing
  costs one attribute test). An entry holds references, to the object's record and the
  replicas tuple after the event: no copy per event, nothing formatted on the hot path (a ring
  entry costs ~100 bytes, plus a removed object's record, kept until its slot is reused).
  Publishing is O(1): write one slot, bump the sequence, and wake watchers that wait for one.
- Watchers read the ring, each from its own cursor; a watcher's queue is its span of the ring.
  One more than `watcher_queue` events behind (its stream is not being read fast enough, so
  gRPC's writes wait) is cut: it ends with WATCH_CUT_SLOW and the last seq it was handed, and
  can resume after it while that is still in the ring. The lag is looked at every CHECK_EVERY
  events, so a watcher is cut at most CHECK_EVERY events late; the config keeps
  `watcher_queue <= capacity` and the ring holds CHECK_EVERY more than that (`_ring_size`), so a
  watcher is always cut before the ring overwrites an event it has not been handed.
- At most `max_watchers` streams at once (TOO_MANY_WATCHERS beyond), cut ones included until their
  RPC ends: a reader that stopped reading holds at most its slot and what gRPC buffered for it.

Sequence numbers start at 1 in every epoch (a new MasterState: a restart, a failover): the
servicer stamps each event with the epoch and refuses to resume one epoch's seq in another.
Only complete objects make events; pending puts (revoked, reclaimed) never were visible.

Owned by the master's event loop thread like the rest of `MasterState`.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvtier.master.records import ObjectState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import NAME_SEPARATOR, name_prefix
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.records import ObjectRecord

CHECK_EVERY = 256  # events between two looks at the watchers' lag (their cost spread over these)


class EventKind(enum.IntEnum):
    """What happened to an object (master.proto's EventKind)."""

    STORED = pb.STORED  # visible: its PutEnd committed it (or a segment's inventory brought it back)
    REMOVED = pb.REMOVED  # removed by a client, or lost with the last segment holding a copy
    EVICTED = pb.EVICTED  # evicted for room or dropped as corrupt: its next read misses
    TIER_CHANGED = pb.TIER_CHANGED  # still readable; its copies changed (offload, promotion, one dropped)


class Published(NamedTuple):
    """One event in the ring. `replicas`: the object's packed copies after the event (records.py)."""

    seq: int
    kind: int
    name: str  # object_name(namespace, key)
    size: int
    replicas: tuple[int, ...]
    reason: str
    time: float  # wall clock, seconds since 1970


@dataclass(slots=True, eq=False)
class Watcher:
    """One stream's filter and position. `end` is set once it must end: (Status, error)."""

    name_start: str  # object-name prefix every event it wants starts with ("" = any namespace)
    key_prefix: str  # with any namespace: the key prefix, tested on the key part
    kinds: frozenset[int]  # empty = every kind
    cursor: int  # the next seq to look at
    wake: Callable[[], None]
    waiting: bool = False  # parked until the next publish (set by the servicer before it waits)
    end: tuple[Status, str] | None = None
    handed: int = 0  # the last seq handed to it (0 = none yet)
    tenant: str = ""  # the tenant whose stream it is ("": the cluster credentials)

    def wants(self, kind: int, name: str) -> bool:
        if self.kinds and kind not in self.kinds:
            return False
        if self.name_start:
            return name.startswith(self.name_start)
        return not self.key_prefix or name.partition(NAME_SEPARATOR)[2].startswith(self.key_prefix)


@dataclass(slots=True)
class EventLog:
    """The ring and its watchers (see the module docstring)."""

    capacity: int  # events held for resuming (config events_buffer); 0 = off
    watcher_queue: int  # events a watcher may be behind before it is cut (events_watcher_queue)
    max_watchers: int  # streams of the cluster credentials at once (events_max_watchers)
    max_per_tenant: int = 8  # streams of one tenant at once (events_max_watchers_per_tenant)
    clock: Callable[[], float] = time.time
    next_seq: int = 1
    published: Counter[str] = field(default_factory=Counter)  # kind name -> events
    cuts: Counter[str] = field(default_factory=Counter)  # why watchers were ended: "slow", "missed", ...
    # Entries are plain tuples (seq, kind, record, replicas, reason, time), made into `Published`
    # only when taken: on PutEnd's path a tuple costs ~70 ns a key, a NamedTuple and the record's
    # packed size and replicas ten times that. STORED's replicas are None: read when taken (its
    # name and size never change; a watcher behind may see copies a later event tells of).
    _ring: list[tuple | None] = field(default_factory=list)
    _watchers: list[Watcher] = field(default_factory=list)
    _check_at: int = CHECK_EVERY
    # Streams open, `max_watchers` at most. A cut stream whose reader stopped reading waits in gRPC's
    # write until the reader reads or goes (keepalive finds a dead one): it keeps its slot till then.
    _open: int = 0
    _by_tenant: Counter[str] = field(default_factory=Counter)  # tenants' streams, outside `_open`

    def __post_init__(self) -> None:
        self._ring = [None] * self._ring_size() if self.capacity else []

    def _ring_size(self) -> int:
        return self.capacity + CHECK_EVERY if self.capacity else 0

    @property
    def enabled(self) -> bool:
        return bool(self.capacity)

    @property
    def oldest(self) -> int:
        """The oldest seq a watcher may still ask for (`since`)."""
        return max(1, self.next_seq - self.capacity)

    @property
    def held(self) -> int:
        """Events held for resuming: at most `capacity`."""
        return self.next_seq - self.oldest

    @property
    def watchers(self) -> int:
        """Streams open: fed, or ended and still delivering their end (counted until `unwatch`)."""
        return self._open + sum(self._by_tenant.values())

    # ------------------------------------------------------------------ publishing (hot path)

    def stored(self, records: Iterable[ObjectRecord], reason: str = "put") -> None:
        """Complete objects became visible (PutEnd's commit, an inventory's adoption)."""
        if not self.capacity:
            return
        now = self.clock()
        ring, size, seq = self._ring, len(self._ring), self.next_seq
        kind = EventKind.STORED
        for record in records:
            ring[seq % size] = (seq, kind, record, None, reason, now)  # see _ring
            seq += 1
        self.published["STORED"] += seq - self.next_seq
        self.next_seq = seq
        self._after_publish()

    def gone(self, record: ObjectRecord, kind: EventKind, reason: str) -> None:
        """A complete object left the tables: REMOVED or EVICTED (a pending one makes no event)."""
        if self.capacity and record.state is ObjectState.COMPLETE:
            self._publish(kind, record, (), reason)

    def changed(self, record: ObjectRecord, reason: str) -> None:
        """A complete object's copies changed and it stays readable (TIER_CHANGED)."""
        if self.capacity:
            self._publish(EventKind.TIER_CHANGED, record, record.replicas, reason)

    def _publish(self, kind: EventKind, record: ObjectRecord, replicas: tuple[int, ...], reason: str) -> None:
        seq = self.next_seq
        ring = self._ring
        ring[seq % len(ring)] = (seq, kind, record, replicas, reason, self.clock())
        self.next_seq = seq + 1
        self.published[kind.name] += 1
        self._after_publish()

    def _after_publish(self) -> None:
        if self.next_seq >= self._check_at:
            self._check_at = self.next_seq + CHECK_EVERY
            self._cut_slow()
        for watcher in self._watchers:
            if watcher.waiting:
                watcher.waiting = False
                watcher.wake()

    def _cut_slow(self) -> None:
        """End the watchers more than `watcher_queue` events behind. One parked until now (it had
        caught up) is not slow, only handed a big batch at once: it is woken and catches up."""
        limit = self.next_seq - self.watcher_queue
        for watcher in list(self._watchers):
            if not watcher.waiting and watcher.cursor < limit:
                behind = self.next_seq - watcher.cursor
                self._end(
                    watcher,
                    Status.WATCH_CUT_SLOW,
                    "slow",
                    f"cut: {behind} events behind (events_watcher_queue {self.watcher_queue}); last seq handed "
                    f"{watcher.handed}: resume with since={watcher.handed + 1} or resync",
                )

    # ------------------------------------------------------------------ watching

    def watch(
        self,
        namespace: str,
        prefix: str,
        since: int,
        kinds: Iterable[int],
        wake: Callable[[], None],
        tenant: str = "",
    ) -> Watcher | tuple[Status, str]:
        """A new watcher from `since` (0 = from the next event), or why not (a Status and words):
        EVENTS_DISABLED, TOO_MANY_WATCHERS, WATCH_MISSED (since is older than the oldest held: the
        words name the oldest seq; `since` past the next seq is INVALID_ARGUMENT). `tenant`: whose
        stream ("" = the cluster credentials'): each tenant has slots of its own."""
        if not self.capacity:
            return Status.EVENTS_DISABLED, "events are off on this master (events_buffer = 0)"
        if tenant and self._by_tenant[tenant] >= self.max_per_tenant:
            self.cuts["too_many"] += 1
            return Status.TOO_MANY_WATCHERS, (
                f"tenant {tenant!r} has {self.max_per_tenant} event streams open (events_max_watchers_per_tenant)"
            )
        if not tenant and self._open >= self.max_watchers:
            self.cuts["too_many"] += 1
            return Status.TOO_MANY_WATCHERS, f"{self.max_watchers} event streams are open (events_max_watchers)"
        if since and since < self.oldest:
            self.cuts["missed"] += 1
            return Status.WATCH_MISSED, self.missed_words(since)
        if since > self.next_seq:
            return Status.INVALID_ARGUMENT, f"since={since} is ahead of this epoch's next seq {self.next_seq}"
        start = since or self.next_seq
        watcher = Watcher(
            name_start=name_prefix(namespace) + prefix if namespace else "",
            key_prefix=prefix,
            kinds=frozenset(kinds),
            cursor=start,
            wake=wake,
            handed=start - 1,
            tenant=tenant,
        )
        self._watchers.append(watcher)
        if tenant:
            self._by_tenant[tenant] += 1
        else:
            self._open += 1
        return watcher

    def missed_words(self, since: int) -> str:
        return (
            f"since={since} is older than the oldest event held, seq {self.oldest} (events_buffer "
            f"{self.capacity}): events were missed, resync"
        )

    def take(self, watcher: Watcher, limit: int) -> list[Published]:
        """Up to `limit` events the watcher wants, from its cursor on (advanced past every event
        looked at, wanted or not). Empty when it is up to date or must end (`watcher.end`)."""
        if watcher.end is not None:
            return []
        ring, size = self._ring, len(self._ring)
        seq, last = watcher.cursor, self.next_seq
        if seq < last - size:  # overwritten: cannot happen while _cut_slow keeps up, never a gap
            self._end(watcher, Status.WATCH_MISSED, "missed", self.missed_words(seq))
            return []
        out: list[Published] = []
        wants = watcher.wants
        while seq < last and len(out) < limit:
            event = ring[seq % size]
            seq += 1
            if event is not None and wants(event[1], (record := event[2]).name):
                replicas = record.replicas if event[3] is None else event[3]
                out.append(Published(event[0], event[1], record.name, record.size, replicas, event[4], event[5]))
        watcher.cursor = seq
        if out:
            watcher.handed = out[-1].seq
        return out

    def unwatch(self, watcher: Watcher) -> None:
        """The watcher's stream is over (its RPC ended): its slot is free. Once per watcher."""
        if watcher in self._watchers:
            self._watchers.remove(watcher)
        if not watcher.tenant:
            self._open -= 1
        elif self._by_tenant[watcher.tenant] > 1:
            self._by_tenant[watcher.tenant] -= 1
        else:
            del self._by_tenant[watcher.tenant]

    def close(self, words: str) -> None:
        """Every watcher ends WATCH_CLOSED (this log's tables are being replaced: a new epoch, or
        this master no longer leads)."""
        for watcher in list(self._watchers):
            if watcher.end is None:
                self._end(watcher, Status.WATCH_CLOSED, "closed", words)

    def _end(self, watcher: Watcher, status: Status, why: str, words: str) -> None:
        watcher.end = (status, words)
        self.cuts[why] += 1
        self._watchers.remove(watcher)  # no longer fed nor looked at (its slot: until `unwatch`)
        watcher.waiting = False
        watcher.wake()
