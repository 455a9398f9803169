"""The SSD tier's tasks as the master queues them for a segment (kvtier.master.tiering: OFFLOAD,
PROMOTE, FORGET), and the packing of a replica's tier into its key (`dram_key`, `ssd_key`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.master.records import TIER_DRAM, TIER_SHIFT, TIER_SSD, ObjectRecord


class TaskKind(enum.IntEnum):
    OFFLOAD = 1
    PROMOTE = 2
    FORGET = 3


@dataclass(slots=True, eq=False)
class TierTask:
    task_id: int
    kind: TaskKind
    segment_id: int
    record: ObjectRecord | None  # None for FORGET
    name: str
    size: int
    checksum: int
    dram_offset: int = 0
    disk_location: int = 0
    deadline: float = 0.0  # set when handed out
    prefetch: bool = False  # a PROMOTE started by a lookup's prefetch (kvtier.master.prefetch)
    queued_at: float = 0.0  # OFFLOAD: when queued (the offload lag, kvtier.master.backpressure)
    # OFFLOAD: copied ahead of need (the DRAM copy stays when done) rather than to free room (it goes)
    ahead: bool = False
    owed: bool = False  # FORGET: a change was answered without it: saved until acknowledged (`_owe`)
    owed_generation: int = 0  # the state generation whose save holds it: that answer waits for it


def dram_key(segment_id: int) -> int:
    """`replica >> TIER_SHIFT` of a DRAM replica on `segment_id`."""
    return segment_id << 2 | TIER_DRAM


def ssd_key(segment_id: int) -> int:
    return segment_id << 2 | TIER_SSD


def is_dram(packed: int) -> bool:
    return packed >> TIER_SHIFT & 0b11 == TIER_DRAM
