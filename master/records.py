"""The master's per-object record, packed: ten million objects must fit in 2.5 GB.

Issue 19 budgets <= 250 bytes of master RSS per object at 10M objects (issue 4
had 400 at 1M). What an object costs (CPython 3.11; see docs/benchmarks.md):

- one entry in the master's single object dict, keyed by `object_name`
  (namespace + NUL + key), which is also the least-recently-used order
  (about 34-42 bytes, depending on where the dict is between resizes);
- the name string itself (the record keeps a reference, not a copy);
- an `ObjectRecord` of four slots (64 bytes with its GC header);
- one int packing size, checksum, state, read count and the replica (48 bytes
  for a one-replica object; a replica packs segment id, tier and offset);
- the batch-wide values (put id, start time, owner, pin end) are one tuple
  shared by every record of a PutStart batch.
- an object larger than one chunk whose put recorded chunk checksums (ranged
  reads, kvtier.proto.chunks) also holds them: the packed int becomes a
  3-tuple with a bytes blob of 4 B per 64 KiB chunk (about 64 + 33 + 4 per
  chunk bytes: ~160 B for a 1 MiB object, noise next to its data).

Nothing per object lives anywhere else under the default eviction policy (lru): no
per-namespace dicts, no separate LRU index, no per-allocation table in the allocators.
`eviction_policy = "s3fifo"` adds one dict entry per complete DRAM object, about 40 bytes
(kvtier.master.eviction_policy).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from kvtier.master.quotas import Owner
from kvtier.proto.chunks import blob_fits
from kvtier.proto.keys import join_name, split_name
from kvtier.proto.keys import name_prefix as name_prefix  # re-exported: the master's modules import it here

TIER_DRAM = 0
TIER_SSD = 1

PIN_NONE = 0
PIN_SOFT = 1
PIN_HARD = 2

# A replica is one int: segment id << 50 | tier << 48 | offset. Offsets address up to
# 256 TiB per segment (mount refuses larger capacities); segment ids are unbounded.
OFFSET_BITS = 48
OFFSET_MASK = (1 << OFFSET_BITS) - 1
TIER_SHIFT = OFFSET_BITS
TIER_MASK = 0b11
SEGMENT_SHIFT = OFFSET_BITS + 2
MAX_SEGMENT_CAPACITY = 1 << OFFSET_BITS

_CHECKSUM_MASK = 0xFFFF_FFFF
READS_CAP = 255  # ObjectRecord.reads stops here: it is 8 bits of the record's packed int

# ObjectRecord._m, low to high: checksum 32 bits, state 1, reads 8, size 49, then the replica.
_STATE_BIT = 1 << 32
_READS_SHIFT = 33
_READS_ONE = 1 << _READS_SHIFT
_READS_FULL = READS_CAP << _READS_SHIFT
_SIZE_SHIFT = 41
_SIZE_MAX = (1 << 49) - 1  # > MAX_SEGMENT_CAPACITY: any object a segment can hold
_REP_SHIFT = 90
_LOW_MASK = (1 << _REP_SHIFT) - 1

# The master's one index key for (namespace, key) is the joined name kvtier.proto.keys owns
# (`namespace NUL key`); `name_prefix(namespace) + key` builds it once per batch.
object_name = join_name


def replica(segment_id: int, offset: int, tier: int = TIER_DRAM) -> int:
    return segment_id << SEGMENT_SHIFT | tier << TIER_SHIFT | offset


def replica_segment(packed: int) -> int:
    return packed >> SEGMENT_SHIFT


def replica_offset(packed: int) -> int:
    return packed & OFFSET_MASK


def replica_tier(packed: int) -> int:
    return packed >> TIER_SHIFT & TIER_MASK


def on_segment(replicas: Iterable[int], segment_id: int) -> bool:
    return any(r >> SEGMENT_SHIFT == segment_id for r in replicas)


class ObjectState(enum.Enum):
    PENDING = 1  # ranges allocated by PutStart, bytes in flight: invisible to readers
    COMPLETE = 2  # PutEnd received: all bytes are in place, readable


_PENDING, _COMPLETE = ObjectState.PENDING, ObjectState.COMPLETE
_last_batch: tuple = (None, None, None, None)  # the last PutStart batch's shared values (ObjectRecord._b)


class ObjectRecord:
    """One object: where its replicas are, its size and checksum, who owns it, what protects it.

    `pin_until` is the whole pin: 0.0 unpinned, a time for a soft pin, +inf
    for a hard pin. `lease_until` is when the last granted read lease ends.
    `reads` counts GetReplicas hits while it held DRAM, saturating at
    READS_CAP, for SSD write admission (kvtier.master.admission).
    Recency is the record's position in the master's object dict, not a field.

    Packed for ten million objects (issue 19; docs/architecture.md "The master's
    tables"): four slots, 64 bytes. The attributes above are properties over
    - `_m`: one int holding checksum (bits 0-31), state (32), reads (33-40),
      size (41-89) and, when the object has exactly one replica (the usual
      case), that replica (from bit 90 up); otherwise a (low bits, replicas)
      tuple;
    - `_b`: (put_id, started_at, owner, pin_until), one tuple shared by every
      record of a PutStart batch; changing one of them gives the record its own;
    - `lease_until`, a plain slot: it changes on every read.
    """

    __slots__ = ("name", "_m", "_b", "lease_until")

    def __init__(
        self,
        name: str,
        size: int,
        replicas: tuple[int, ...],
        put_id: int,
        started_at: float,
        owner: Owner | None = None,
        pin_until: float = 0.0,
    ) -> None:
        global _last_batch
        if not 0 <= size <= _SIZE_MAX:
            raise ValueError(f"object size {size} outside 0..{_SIZE_MAX}")
        self.name = name
        low = size << _SIZE_SHIFT
        self._m = low | replicas[0] << _REP_SHIFT if len(replicas) == 1 else (low, tuple(replicas))
        b = _last_batch
        if b[0] != put_id or b[1] != started_at or b[2] is not owner or b[3] != pin_until:
            b = _last_batch = (put_id, started_at, owner, pin_until)
        self._b = b
        self.lease_until = 0.0

    # ---- the low bits: checksum, state, reads, size

    def _low(self) -> int:
        m = self._m
        return m & _LOW_MASK if m.__class__ is int else m[0]

    def _set_low(self, low: int) -> None:
        m = self._m
        self._m = m & ~_LOW_MASK | low if m.__class__ is int else (low, *m[1:])

    @property
    def meta(self) -> int:
        """size << 32 | checksum (the form the segments' inventories use)."""
        low = self._low()
        return (low >> _SIZE_SHIFT) << 32 | low & _CHECKSUM_MASK

    @property
    def size(self) -> int:
        return self._low() >> _SIZE_SHIFT & _SIZE_MAX

    @property
    def checksum(self) -> int:
        return self._low() & _CHECKSUM_MASK

    @property
    def state(self) -> ObjectState:
        m = self._m
        return _COMPLETE if (m if m.__class__ is int else m[0]) & _STATE_BIT else _PENDING

    @state.setter
    def state(self, value: ObjectState) -> None:
        low = self._low()
        self._set_low(low | _STATE_BIT if value is _COMPLETE else low & ~_STATE_BIT)

    @property
    def reads(self) -> int:
        return self._low() >> _READS_SHIFT & READS_CAP

    @reads.setter
    def reads(self, value: int) -> None:
        self._set_low(self._low() & ~(READS_CAP << _READS_SHIFT) | min(value, READS_CAP) << _READS_SHIFT)

    def count_read(self) -> None:
        """One more read while in DRAM (saturating): the hot path's `reads += 1`."""
        m = self._m
        if m.__class__ is int:
            if m & _READS_FULL != _READS_FULL:
                self._m = m + _READS_ONE
        elif m[0] & _READS_FULL != _READS_FULL:
            self._m = (m[0] + _READS_ONE, *m[1:])

    def complete(self, checksum: int) -> None:
        """Set the checksum and make the object COMPLETE. Chunk CRCs kept before describe earlier
        bytes (a record completed again, e.g. an overwrite): they go; PutEnd keeps the new ones after."""
        low = self._low() & ~_CHECKSUM_MASK
        self._set_low(low | checksum & _CHECKSUM_MASK | _STATE_BIT)
        m = self._m
        if m.__class__ is not int and len(m) > 2:
            self.keep_chunk_crcs(b"")

    # ---- replicas

    @property
    def replicas(self) -> tuple[int, ...]:
        m = self._m
        return (m >> _REP_SHIFT,) if m.__class__ is int else m[1]

    @replicas.setter
    def replicas(self, value: tuple[int, ...]) -> None:
        low, chunks = self._low(), self.chunk_crcs
        if chunks:
            self._m = (low, tuple(value), chunks)
        else:
            self._m = low | value[0] << _REP_SHIFT if len(value) == 1 else (low, tuple(value))

    # ---- chunk checksums (issue 21, kvtier.proto.chunks)

    @property
    def chunk_crcs(self) -> bytes:
        """The CRC32C of each chunk, as its put recorded them (b"": none; the object is read whole)."""
        m = self._m
        return m[2] if m.__class__ is not int and len(m) > 2 else b""

    def keep_chunk_crcs(self, blob: bytes) -> None:
        """Keep `blob` when it fits this object (kvtier.proto.chunks.blob_fits), else keep none.
        Only an object with a blob pays for it: a third member of `_m`'s tuple form."""
        low, replicas = self._low(), self.replicas
        if blob and blob_fits(blob, self.size):
            self._m = (low, replicas, bytes(blob))
        elif self.chunk_crcs:
            self._m = low | replicas[0] << _REP_SHIFT if len(replicas) == 1 else (low, replicas)

    # ---- the batch-wide values

    @property
    def put_id(self) -> int:
        return self._b[0]

    @put_id.setter
    def put_id(self, value: int) -> None:
        self._set_batch(0, value)

    @property
    def started_at(self) -> float:
        return self._b[1]

    @started_at.setter
    def started_at(self, value: float) -> None:
        self._set_batch(1, value)

    @property
    def owner(self) -> Owner | None:
        return self._b[2]

    @owner.setter
    def owner(self, value: Owner | None) -> None:
        self._set_batch(2, value)

    @property
    def pin_until(self) -> float:
        return self._b[3]

    @pin_until.setter
    def pin_until(self, value: float) -> None:
        self._set_batch(3, value)

    def _set_batch(self, i: int, value: object) -> None:
        b = self._b
        if b[i] is value or (i != 2 and b[i] == value):  # unchanged: keep sharing the batch's tuple
            return  # (the owner compares by identity: quotas count per Owner object)
        self._b = (*b[:i], value, *b[i + 1 :])

    # ---- derived

    @property
    def namespace(self) -> str:
        return split_name(self.name)[0]

    @property
    def key(self) -> str:
        return split_name(self.name)[1]

    @property
    def pin(self) -> int:
        pin_until = self._b[3]
        if pin_until == math.inf:
            return PIN_HARD
        return PIN_SOFT if pin_until else PIN_NONE

    def __repr__(self) -> str:
        return f"ObjectRecord({self.namespace!r}, {self.key!r}, size={self.size}, {self.state.name})"
