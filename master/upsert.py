"""Atomic overwrite (upsert) and put-time leases: the master's side (issue 21).

Upsert. A PutStart with `overwrite` on a key whose object is complete
allocates a *new version* beside the visible one: a record of its own, kept
here (`Upserts.pending`), never in MasterState's tables, so readers keep
getting the old version, its ranges and its checksum, while the new bytes are
written. PutEnd swaps the record (`MasterState.replace`): from that call on
every GetReplicas answers the new version; the old one leaves as by a
removal, so its DRAM ranges are freed only once the read leases on them end
(a reader that got the old placements reads the old bytes, verified against
the old checksum) and its disk copies are tombstoned (FORGET): an SSD copy
belongs to the version it was written from and never serves another. The
swap is one call on the master's single thread, so there is no instant with
no version: a reader gets the old or the new value, never a miss, never a
mix (checksums are per version). PutEnd answers once the segments
acknowledged the commit of the new copies and the drop of the old ones
(kvtier.master.commits), as a put's does.

A new version that never ends (PutRevoke, its writer gone past
put_timeout_s, a segment holding one of its copies lost) is dropped; the old
version stays visible. A second upsert of a key whose upsert is pending
answers PUT_IN_PROGRESS, as a second put of a pending key does (after
put_timeout_s the abandoned one is reclaimed and the new one proceeds). An
upsert of a missing key is a put. When the old version went meanwhile
(removed, evicted) the PutEnd makes the new one visible all the same (it
is the later write); when another writer's put of the key is pending by then,
the upsert answers NOT_PENDING and stores nothing.

Put-time lease. A put with `lease_ms` gives its version a lease starting
at its PutEnd: until it ends, Remove without `force` answers LEASE_HELD for
the key and does nothing to it, and eviction skips it (it holds the read
lease's protection, `lease_until`, so no watermark, quota or offload pass
picks it). `force` removes anyway; RemovePrefix always removes (it is the
operator's bulk removal). An upsert's new version keeps what is left of the
key's lease (or its own, when longer). When a leased version leaves before
its lease ends, its ranges wait only for the read leases that may still run
(at most lease_s), not for the rest of the put-time lease.

Plain Python, owned by MasterState's thread; it calls MasterState's public
methods only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from typing import TYPE_CHECKING

from kvtier.master.records import SEGMENT_SHIFT, ObjectRecord, ObjectState
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState

logger = logging.getLogger(__name__)

_COMPLETE = ObjectState.COMPLETE


class Upserts:
    """Pending new versions of complete objects, and the put-time leases of complete ones."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        # name -> the pending new version of that complete object, in start order (reclaim walks it)
        self.pending: dict[str, ObjectRecord] = {}
        # pending record (a put's or an upsert's) -> the put-time lease it asked for, seconds
        self.lease_requests: dict[ObjectRecord, float] = {}
        # name -> (the version holding a put-time lease, its end); ends in a heap to expire them
        self.leases: dict[str, tuple[ObjectRecord, float]] = {}
        self._ends: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.counters: Counter[str] = Counter()  # swapped, revoked, reclaimed, lost, refused

    # ------------------------------------------------------------------ upsert

    def admit(self, name: str, now: float) -> int:
        """An upsert of complete object `name` may start: OK, or PUT_IN_PROGRESS while another
        upsert of it is pending (one past put_timeout_s is reclaimed here)."""
        pending = self.pending.get(name)
        if pending is None:
            return int(Status.OK)
        if now - pending.started_at < self.state.config.put_timeout_s:
            return int(Status.PUT_IN_PROGRESS)
        self._drop(pending, "reclaimed")
        return int(Status.OK)

    def started(self, record: ObjectRecord) -> None:
        """PutStart allocated `record` as the new version of its (complete) object."""
        self.pending[record.name] = record

    def end(self, name: str, put_id: int, checksum: int, visible: ObjectRecord | None) -> ObjectRecord | None:
        """PutEnd of an upsert: the new version, complete and swapped in for `visible` (the
        version readers saw until now, None when it went meanwhile); None when `put_id` has no
        pending upsert of `name`, or another writer's put of the key is pending now."""
        record = self.pending.get(name)
        if record is None or record.put_id != put_id:
            return None
        del self.pending[name]
        if visible is not None and visible.state is not _COMPLETE:
            self.counters["refused"] += 1
            self._forget(record, "refused")
            return None
        record.complete(checksum)
        state = self.state
        if visible is not None:
            held = self.leases.get(name)
            if held is not None and held[0] is visible and held[1] > state.clock():
                # the key's put-time lease carries over to the version that replaces it
                self.lease_requests[record] = max(self.lease_requests.get(record, 0.0), held[1] - state.clock())
            if state.history is not None:
                state.history.replaced(visible)
        state.replace(visible, record)
        self.counters["swapped"] += 1
        return record

    def revoke(self, name: str, put_id: int) -> bool:
        """PutRevoke of an upsert: its new version goes, the old one stays. False when none."""
        record = self.pending.get(name)
        if record is None or record.put_id != put_id:
            return False
        self._drop(record, "revoked")
        return True

    def segment_dropped(self, segment_id: int) -> None:
        """A segment is gone: pending new versions with a copy there can never complete."""
        lost = [r for r in self.pending.values() if any(p >> SEGMENT_SHIFT == segment_id for p in r.replicas)]
        for record in lost:
            self._drop(record, "lost")

    def _drop(self, record: ObjectRecord, why: str) -> None:
        del self.pending[record.name]
        self.counters[why] += 1
        logger.info("upsert dropped why=%s key=%.80s put_id=%d", why, record.key, record.put_id)
        self._forget(record, why)

    def _forget(self, record: ObjectRecord, why: str) -> None:
        self.lease_requests.pop(record, None)
        if self.state.history is not None:
            self.state.history.left(record, f"upsert:{why}")
        self.state.drop_version(record)  # its ranges after its write grant, as a revoked put's

    # ------------------------------------------------------------------ put-time leases

    def request_lease(self, record: ObjectRecord, lease_s: float) -> None:
        """PutStart of `record` asked for a put-time lease of `lease_s`, starting at its PutEnd."""
        self.lease_requests[record] = lease_s

    def completed(self, records: list[ObjectRecord]) -> None:
        """PutEnd made `records` visible: the leases they asked for start now."""
        requests, now = self.lease_requests, self.state.clock()
        for record in records:
            lease_s = requests.pop(record, None)
            if lease_s:
                until = now + lease_s
                self.leases[record.name] = (record, until)
                heapq.heappush(self._ends, (until, next(self._seq), record.name))
                if record.lease_until < until:
                    record.lease_until = until  # what eviction skips (kvtier.master.eviction)

    def held(self, record: ObjectRecord, now: float) -> bool:
        """Whether `record`'s put-time lease is running (Remove without force answers LEASE_HELD)."""
        entry = self.leases.get(record.name)
        return entry is not None and entry[0] is record and entry[1] > now

    def leaving(self, record: ObjectRecord) -> None:
        """`record` leaves the tables: its lease ends, and its ranges wait only for the read
        leases that may still run (each ends within lease_s of now), not for the put-time lease."""
        self.lease_requests.pop(record, None)
        entry = self.leases.get(record.name)
        if entry is None or entry[0] is not record:
            return
        del self.leases[record.name]
        if len(self._ends) > 2 * len(self.leases) + 1024:  # ends of leases gone early: keep it bounded
            self._ends = [e for e in self._ends if (held := self.leases.get(e[2])) is not None and held[1] == e[0]]
            heapq.heapify(self._ends)
        now = self.state.clock()
        if entry[1] > now:
            until = now + self.state.config.lease_s  # every read lease granted so far ends by then
            record.lease_until = min(record.lease_until, until)
            self.state.leases.cap(record, until)

    def tick(self, now: float) -> None:
        """Expire put-time leases and reclaim upserts abandoned past put_timeout_s."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, _, name = heapq.heappop(ends)
            entry = self.leases.get(name)
            if entry is not None and entry[1] <= now:
                del self.leases[name]
        timeout = self.state.config.put_timeout_s
        while self.pending:
            record = next(iter(self.pending.values()))
            if now - record.started_at < timeout:
                break  # insertion order is start order
            self.state.lease_expiries["put"] += 1
            self._drop(record, "reclaimed")
