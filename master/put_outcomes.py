"""What became of a put whose record has gone: the answer to a PutEnd retried after its first was lost.

A PutEnd's first attempt can commit and still reach its writer as a failure: a relayed PutEnd
(kvtier.segment_server.commit_relay) answers only once the segments acknowledged its notices, and
the segment gives up after its bound when one of them is stalled; a direct PutEnd can time out the
same way. The client then sends the PutEnd itself. By then the key may have been read, removed or
replaced by others, so the record that committed is gone, and "no pending put of this key"
(NOT_PENDING, "stores nothing") would tell the writer its bytes were never stored while readers had
them.

So the master keeps, for the last `KEPT` committed versions that left the tables (removed, replaced
by an upsert, evicted, lost with a segment), (name, put id) -> (checksum, lost). A retried PutEnd
of one of them is answered OK (the put was stored; a later change superseded it), or
SEGMENT_NOT_FOUND when it left because its last segment was lost (what the first answer would have
said: acknowledged means stored), unless a copy with its checksum came back since. Put ids of this
incarnation are issued in increasing order from a random start, so the bound is exact: every put
id above the highest one forgotten was remembered if it committed and left, and NOT_PENDING for it
is the truth; at or below it, a put that left no trace may have committed, and the answer is
TIMEOUT ("its outcome is no longer known"), never NOT_PENDING. A put id of another incarnation (a
restart or failover came between the attempts) is OK when the key holds a complete object with the
put's checksum (recovered from a segment's inventory), TIMEOUT otherwise: it may have committed there
and been removed since, which nothing here can tell. This incarnation's ids are the 2**40 from its
random start (another's 62-bit start lands among them with a chance of 2**-22); one of them not issued
yet was issued by nobody: NOT_PENDING.

Memory: at most KEPT entries (183 B each measured, plus the name, the gone record's own string):
about 12 MB and the names at the default, whatever the object count or the rate.
"""

from __future__ import annotations

import itertools
import random

from kvtier.proto.status import Status

KEPT = 65_536  # committed versions remembered after they left; a retry comes within seconds of its put

_OK = int(Status.OK)
_NOT_PENDING = int(Status.NOT_PENDING)
_UNKNOWN = int(Status.TIMEOUT)
_LOST = int(Status.SEGMENT_NOT_FOUND)
_OWN_IDS = 1 << 40  # this incarnation's put ids: [first_id, first_id + _OWN_IDS)


class PutOutcomes:
    """Issues this incarnation's put ids and remembers the recent committed versions that left."""

    __slots__ = ("first_id", "_ids", "_issued", "_left", "_kept", "_forgotten_upto")

    def __init__(self, kept: int = KEPT) -> None:
        # Random start per incarnation: a late PutEnd or PutRevoke of the previous one never matches.
        self.first_id = random.getrandbits(62) + 1
        self._ids = itertools.count(self.first_id)
        self._issued = self.first_id  # ids below this one were issued by this incarnation
        self._left: dict[tuple[str, int], tuple[int, bool]] = {}  # (name, put id) -> (checksum, lost), oldest first
        self._kept = kept
        self._forgotten_upto = 0  # the highest put id forgotten (0: none)

    def __len__(self) -> int:
        return len(self._left)

    def next_id(self) -> int:
        put_id = next(self._ids)
        self._issued = put_id + 1
        return put_id

    def left(self, name: str, put_id: int, checksum: int, lost: bool = False) -> None:
        """A committed version of this incarnation left the tables (`lost`: with its last segment)."""
        if not self.first_id <= put_id < self._issued:
            return  # recovered (put id 0) or of an earlier incarnation: nothing a retry could ask here
        left = self._left
        left[(name, put_id)] = (checksum, lost)
        if len(left) > self._kept:
            oldest = next(iter(left))
            del left[oldest]
            if oldest[1] > self._forgotten_upto:
                self._forgotten_upto = oldest[1]

    def retried(self, name: str, put_id: int, checksum: int, visible_checksum: int | None) -> int:
        """The answer to PutEnd of `put_id` for `name` when no pending put of it is there and the
        key's record (complete: `visible_checksum`, else None) is not this put's."""
        if not self.first_id <= put_id < self.first_id + _OWN_IDS:
            # Another incarnation's put: it may have committed there (its answer lost) and left since;
            # nothing here can tell, so unless its bytes are the key's the outcome is unknown.
            return _OK if visible_checksum == checksum else _UNKNOWN
        if put_id >= self._issued:
            return _NOT_PENDING  # this incarnation's, not issued yet: nobody's
        outcome = self._left.get((name, put_id))
        if outcome is not None:
            stored, lost = outcome
            if stored != checksum:
                return _NOT_PENDING  # not this put's bytes
            return _LOST if lost and visible_checksum != checksum else _OK
        return _UNKNOWN if put_id <= self._forgotten_upto else _NOT_PENDING
