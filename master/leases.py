"""Read leases that end with the read: counted per reader, released by the reader when done.

A read lease (GetReplicas) keeps the ranges it returned from being freed or
reused until it ends (`lease_s`), because the reader's bytes may still be in
flight. Most reads finish in microseconds, so a removed or evicted object's
space used to sit idle for the rest of `lease_s`, and a burst of new puts
evicted live objects instead (issue 19). A reader that asks for it
(`KeysRequest.releasable`) gets a `lease_id` with its lease and hands it back
once its read is over (`released_leases`, piggybacked on its next request);
the lease then ends at once.

Counted per reader: each record holds a count of the releasable leases on it
and the end of every other lease on it (`floor`: leases of readers that do
not release, a drain's read of the source). Only when the count drops to zero
does the record's `lease_until` fall back to that floor, so one reader's
release never frees a range another one still reads. A reader that dies
never releases: its lease ends at its time, as every lease did before (the
tick, `expire`).

Ranges of removed or dropped copies that wait for readers are parked here
(`park`) and handed back (`on_unread`) when the last reader left, so the
master frees them then instead of `lease_s` later.

Releasable leases are granted to the cluster principal only (every caller
when authentication is off): with capabilities, a tenant's read tag stays
valid until the lease's original end whatever it releases, and a range freed
early could hand it another tenant's bytes.

Plain Python, owned by the master's event loop thread like `MasterState`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable, Iterator

from kvtier.master.records import ObjectRecord

# A record's entry while releasable leases are on it: [readers, floor, parked ranges or None].
_COUNT, _FLOOR, _PARKED = 0, 1, 2
Range = tuple[int, int, int]  # (segment id, offset, size)


class ReadLeases:
    def __init__(self) -> None:
        self._leases: dict[int, tuple[float, list[ObjectRecord]]] = {}  # lease id -> (end, records)
        self._ends: list[tuple[float, int]] = []  # (end, lease id), a heap
        self._held: dict[ObjectRecord, list] = {}
        # Called with (record, ranges parked for it) when its last releasable lease ended.
        self.on_unread: Callable[[ObjectRecord, list[Range]], None] | None = None
        self.released = 0  # leases handed back by their readers
        self.expired = 0  # leases that ran out (the reader never released them)

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, records: list[ObjectRecord], until: float) -> int:
        """A releasable lease on `records` until `until`; its id (never 0). Extends each record's
        `lease_until` as any lease does, after noting what it was (the floor a release returns to)."""
        lease_id = random.getrandbits(63) or 1
        while lease_id in self._leases:
            lease_id = random.getrandbits(63) or 1
        held = self._held
        for record in records:
            entry = held.get(record)
            if entry is None:
                held[record] = [1, record.lease_until, None]
            else:
                entry[_COUNT] += 1
            if record.lease_until < until:
                record.lease_until = until
        self._leases[lease_id] = (until, records)
        heapq.heappush(self._ends, (until, lease_id))
        return lease_id

    def uncounted(self, record: ObjectRecord, until: float) -> None:
        """A lease on `record` that nobody will release (a reader that does not, a drain's read)
        runs until `until`: the record's lease never falls back below it."""
        entry = self._held.get(record)
        if entry is not None and entry[_FLOOR] < until:
            entry[_FLOOR] = until

    def cap(self, record: ObjectRecord, until: float) -> None:
        """No lease on `record` runs past `until` any more (its put-time lease ended early,
        kvtier.master.upsert): a release no longer falls back to a floor beyond it."""
        entry = self._held.get(record)
        if entry is not None and entry[_FLOOR] > until:
            entry[_FLOOR] = until

    def holds(self, record: ObjectRecord) -> bool:
        return record in self._held

    def park(self, record: ObjectRecord, segment_id: int, offset: int, size: int) -> bool:
        """Keep a range of `record` (removed or dropped) until its last releasable lease ends;
        False when none is on it (the caller frees the range itself)."""
        entry = self._held.get(record)
        if entry is None:
            return False
        if entry[_PARKED] is None:
            entry[_PARKED] = []
        entry[_PARKED].append((segment_id, offset, size))
        return True

    def parked(self) -> Iterator[Range]:
        """Every range waiting for its readers (the books: such a range is neither free nor an object's)."""
        for entry in self._held.values():
            if entry[_PARKED]:
                yield from entry[_PARKED]

    def release(self, lease_ids: Iterable[int]) -> int:
        """The readers are done with these leases (unknown or already ended ids are ignored: a
        release may be repeated); how many ended now."""
        ended = 0
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                ended += 1
                self._end(lease[1], released=True)
        self.released += ended
        return ended

    def expire(self, now: float) -> None:
        """End the leases whose time is over (their readers never released them)."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, lease_id = heapq.heappop(ends)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:  # else released already
                self.expired += 1
                self._end(lease[1], released=False)
        # Released leases leave their heap entries behind: compact when they dominate.
        if len(ends) > 64 and len(ends) > 4 * len(self._leases):
            self._ends = [(end, i) for end, i in ends if i in self._leases]
            heapq.heapify(self._ends)

    def _end(self, records: list[ObjectRecord], released: bool) -> None:
        held = self._held
        for record in records:
            entry = held.get(record)
            if entry is None:
                continue
            entry[_COUNT] -= 1
            if entry[_COUNT]:
                continue
            del held[record]
            if released:
                # Every counted reader is done: only the uncounted leases still protect the bytes.
                record.lease_until = entry[_FLOOR]
            if entry[_PARKED] and self.on_unread is not None:
                self.on_unread(record, entry[_PARKED])
