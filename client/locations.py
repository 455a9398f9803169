"""Where the last lookups found small DRAM objects: the client's side of direct reads.

A get of a key found here asks the object's segment alone (READ_KEYED, one round trip, no master);
the segment serves it only if its own index still says the range holds that object, complete, with
matching bytes, and only while the master acknowledges its heartbeats (kvtier.segment_server.
keyed_reads, docs/architecture.md "Direct reads"). So an entry is a hint, never trusted: whatever
the segment does not serve, or serves with bytes that do not match the checksum remembered here,
is looked up through the master as before and the entry is forgotten.

An entry lives as long as the read grant of the lookup it came from (the segment checks that
grant's capability where the cluster has a secret), and at most `location_cache_keys` entries are
kept (least recently used leave first). Only DRAM copies read over TCP are kept, and only calls of
at most `DIRECT_READ_MAX_BYTES` in all are read so: the segment copies and checksums what it serves
(which is what makes the check sound), and for larger reads that costs more than the master's round
trip it saves (a 32 x 64 KiB batch ran at a third of its lookup-and-READ throughput).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.proto import master_pb2 as pb

DIRECT_READ_MAX_BYTES = 256 << 10


@dataclass(slots=True, frozen=True)
class Location:
    """One object's DRAM copy as a lookup named it, and the grant that lets this client read it."""

    segment: pb.SegmentEndpoint
    offset: int
    size: int
    checksum: int
    tag: bytes  # its capability tag (b"": the cluster has no secret)
    expiry_ms: int  # the grant's expiry on the master's clock (what the tag covers)
    until: float  # monotonic: the grant's end as this client counts it (kvtier.client.reads.LEASE_SAFETY)
    endpoints: tuple[str, ...] = ()  # the segment's, as a tuple once: a get compares them with its connector's


class LocationCache:
    """key -> Location, least recently used first out; safe for the client's threads."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, Location] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, keys: Iterable[str], now: float) -> dict[int, Location]:
        """The live entries of `keys`, by position; expired ones are dropped."""
        found: dict[int, Location] = {}
        if not self._entries:
            return found
        with self._lock:
            for i, key in enumerate(keys):
                location = self._live(key, now)
                if location is not None:
                    found[i] = location
        return found

    def get(self, key: str, now: float) -> Location | None:
        """`find` of one key (a get's): its live entry, or None."""
        if not self._entries:
            return None
        with self._lock:
            return self._live(key, now)

    def _live(self, key: str, now: float) -> Location | None:
        """`key`'s entry, most recently used now, unless absent or expired (then dropped); under `_lock`."""
        entries = self._entries
        location = entries.get(key)
        if location is None:
            return None
        if location.until <= now:
            del entries[key]
            return None
        entries.move_to_end(key)
        return location

    def remember(self, key: str, location: Location) -> None:
        with self._lock:
            entries = self._entries
            entries[key] = location
            entries.move_to_end(key)
            if len(entries) > self._capacity:
                entries.popitem(last=False)

    def forget(self, keys: Iterable[str]) -> None:
        entries = self._entries
        if not entries:
            return
        with self._lock:
            for key in keys:
                entries.pop(key, None)
