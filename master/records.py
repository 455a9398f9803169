"""The master's per-object record, packed: a million objects must fit in a few hundred MB.

Issue 4 budgets <= 400 bytes of master RSS per object. What an object costs
(CPython 3.11, measured with tracemalloc; see docs/benchmarks.md):

- one entry in the master's single object dict, keyed by `object_name`
  (namespace + NUL + key), which is also the least-recently-used order;
- the name string itself (the record keeps a reference, not a copy);
- an `ObjectRecord` of ten slots; the batch-wide values (put id, start
  time, lease end, pin end, owner) are one shared object per batch;
- `meta`: size and checksum packed into one integer;
- `replicas`: a tuple of integers, each packing segment id, tier and offset.

Nothing per object lives anywhere else: no per-namespace dicts, no separate
LRU index, no per-allocation table in the allocators.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from kvtier.master.quotas import Owner
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
READS_CAP = 255  # ObjectRecord.reads stops here: small ints are shared, a larger count would cost memory

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


class ObjectRecord:
    """One object: where its replicas are, its size and checksum, who owns it, what protects it.

    `pin_until` is the whole pin: 0.0 unpinned, a time for a soft pin, +inf
    for a hard pin. `lease_until` is when the last granted read lease ends.
    `reads` counts GetReplicas hits while it held DRAM, saturating at
    READS_CAP (a small int: no allocation), for SSD write admission
    (kvtier.master.admission).
    Recency is the record's position in the master's object dict, not a field.
    """

    __slots__ = (
        "name",
        "meta",
        "replicas",
        "state",
        "put_id",
        "started_at",
        "owner",
        "pin_until",
        "lease_until",
        "reads",
    )

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
        self.name = name
        self.meta = size << 32
        self.replicas = replicas
        self.state = ObjectState.PENDING
        self.put_id = put_id
        self.started_at = started_at
        self.owner = owner
        self.pin_until = pin_until
        self.lease_until = 0.0
        self.reads = 0

    @property
    def size(self) -> int:
        return self.meta >> 32

    @property
    def checksum(self) -> int:
        return self.meta & _CHECKSUM_MASK

    @property
    def namespace(self) -> str:
        return split_name(self.name)[0]

    @property
    def key(self) -> str:
        return split_name(self.name)[1]

    @property
    def pin(self) -> int:
        if self.pin_until == math.inf:
            return PIN_HARD
        return PIN_SOFT if self.pin_until else PIN_NONE

    def complete(self, checksum: int) -> None:
        self.meta = self.meta & ~_CHECKSUM_MASK | checksum & _CHECKSUM_MASK
        self.state = ObjectState.COMPLETE

    def __repr__(self) -> str:
        return f"ObjectRecord({self.namespace!r}, {self.key!r}, size={self.size}, {self.state.name})"
