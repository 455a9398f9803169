"""Direct reads: READ_KEYED frames, served from the DRAM region only where this segment's own
index says the range holds the object asked for (docs/architecture.md, "Direct reads").

A client that looked an object up once may read it again from its segment alone, without asking
the master, for as long as the lookup's grant lasts (kvtier.client.locations). Nothing it
remembers is trusted: per range, the frame names the object ("namespace NUL key") and the segment
serves its bytes only if

- the segment holds a direct-read lease (`DirectReadLease`): it is mounted, and the master
  acknowledged a heartbeat it sent less than the lease's length ago. While it does, every call that
  changes what a key reads (PutEnd, Remove, RemovePrefix) answers only after this segment applied
  its notices (kvtier.master.commits), so the index is never behind an acknowledged change; once it
  lapses the master may drop the segment and answer without it, so the segment stops serving (the
  master waits for the lease's end after a drop: MasterState.direct_read_fence);
- the index has an entry at that offset with that name and size: the object is complete there and
  no notice since removed it;
- the bytes, copied out of the region, match the entry's checksum, and the entry is still the same
  after the copy: a range the master reuses before this segment applied the drop (it may, once the
  drop is out of the object's grant) fails the checksum, so neither torn nor another object's bytes
  ever leave (a copy, not a view: nothing of the region is read after the check).

Anything else answers that range NOT_FOUND (UNAVAILABLE for every range without a lease), and the
client asks the master as before. The response has READ_DISK's shape: per range an i32 status,
then `size` bytes (zeros unless OK). Only small objects (`MAX_KEYED_FRAME_BYTES` a frame) are read
so: the copy is what makes them safe, and for large ones the master's round trip is a small part
of the read.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c

from kvtier.proto.frames import DISK_STATUS, MAX_KEYED_FRAME_BYTES
from kvtier.proto.status import Status
from kvtier.segment_server.dram_index import DramIndex

_OK = struct.pack("<i", 0)
_NOT_FOUND = DISK_STATUS.pack(int(Status.NOT_FOUND))
_UNAVAILABLE = DISK_STATUS.pack(int(Status.UNAVAILABLE))
_ZEROS = memoryview(bytes(MAX_KEYED_FRAME_BYTES))  # what a refused range answers: no allocation per miss


def _boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class DirectReadLease:
    """Whether this segment may serve direct reads now: renewed by the master link with the send time
    (`now()`) of each heartbeat (and mount) the master acknowledged, ended when the mount ends. Set
    from the link's thread, read on the event loop: one float, replaced whole. Its clock counts a
    suspended host's sleep (CLOCK_BOOTTIME), which the monotonic clock does not: a host woken from
    suspend must not think its lease still runs while the master's clock went on."""

    def __init__(self, clock: Callable[[], float] = _boot_clock) -> None:
        self._clock = clock
        self._cap_s = 0.0  # the master's MountSegmentResponse.direct_read_lease_ms (0: none)
        self._length_s = 0.0  # what it granted (at most the cap): once its saved state holds the lease
        self._until = 0.0
        self._closed = False  # the server stops: no mount starts a lease again
        self._lock = threading.Lock()  # renew and end from the link's thread; end also from stop()

    def now(self) -> float:
        return self._clock()

    def start(self, cap_s: float, sent: float, granted_s: float | None = None) -> None:
        """A mount the master acknowledged: serve for the lease granted (`granted_s`, None: an older
        master, which grants the cap at once), at most `cap_s`, after `sent` (0: not at all)."""
        with self._lock:
            if self._closed:
                return
            self._cap_s = cap_s
            self._length_s = cap_s if granted_s is None else min(cap_s, granted_s)
            self._until = sent + self._length_s if self._length_s > 0 else 0.0

    def renew(self, sent: float, granted_s: float | None = None) -> None:
        """A heartbeat sent at `sent` (this lease's clock, `now()`) was acknowledged under the current
        mount; `granted_s`, the lease its answer grants now (it grows from 0 once the master's save
        held), never past the mount's cap: nothing revives a lease after `end`."""
        with self._lock:
            if granted_s is not None:
                self._length_s = min(self._cap_s, granted_s)
            if self._length_s > 0:
                self._until = max(self._until, sent + self._length_s)

    def end(self) -> None:
        """The mount ends (the master dropped us, we mount again, or we unmount): stop at once."""
        with self._lock:
            self._cap_s = 0.0
            self._length_s = 0.0
            self._until = 0.0

    def close(self) -> None:
        """The server stops: end, for good. A mount the link was still finishing (its stop waits
        only so long) must not start a lease after the commit feed stopped following the master."""
        with self._lock:
            self._closed = True
        self.end()

    def valid(self) -> bool:
        return self._clock() < self._until

    @property
    def left_s(self) -> float:
        return max(0.0, self._until - self._clock())


@dataclass(slots=True)
class KeyedStats:
    """READ_KEYED ranges by outcome (kvtier_segment_direct_reads_total)."""

    served: int = 0  # checked and sent
    not_found: int = 0  # no entry there, another object, or bytes that did not match
    no_lease: int = 0  # answered UNAVAILABLE: not mounted, or heartbeats not acknowledged lately


class KeyedReads:
    """The check and copy behind READ_KEYED (the protocol parses the frame and sends the answer)."""

    def __init__(self, index: DramIndex, region: memoryview, lease: DirectReadLease) -> None:
        self._index = index
        self._region = region
        self.lease = lease
        self.stats = KeyedStats()

    def serve(self, ranges: Sequence[int], names: Sequence[bytes]) -> tuple[list[bytes | memoryview], int]:
        """The response payload's parts for flat (offset, size, ...) `ranges` and their joined names,
        and how many of its bytes are objects served (the rest: statuses and zeros)."""
        count = len(names)
        stats = self.stats
        if not self.lease.valid() or not self._index.session[0]:
            stats.no_lease += count
            return [part for i in range(count) for part in (_UNAVAILABLE, _ZEROS[: ranges[2 * i + 1]])], 0
        parts: list[bytes | memoryview] = []
        served = 0
        region, holding = self._region, self._index.holding
        for i, name in enumerate(names):
            offset, size = ranges[2 * i], ranges[2 * i + 1]
            entry = holding(offset, name, size)
            if entry is not None:
                data = bytes(region[offset : offset + size])
                if crc32c.crc32c(data) == DramIndex.checksum_of(entry) and holding(offset, name, size) is entry:
                    parts += (_OK, data)
                    stats.served += 1
                    served += size
                    continue
            parts += (_NOT_FOUND, _ZEROS[:size])
            stats.not_found += 1
        return parts, served
