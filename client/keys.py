"""Listing and inspecting keys: what `kvtier keys` and `kvtier stat` use.

`Client.list_keys` / `Client.iter_keys` / `Client.stat` return the typed
records below (the master's `ListKeys` and `StatKeys`, read-only: they grant
no lease and save nothing from eviction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.proto import master_pb2 as pb

if TYPE_CHECKING:
    pass

TIERS = {pb.DRAM: "dram", pb.SSD: "ssd"}
PINS = {pb.PIN_NONE: "none", pb.PIN_SOFT: "soft", pb.PIN_HARD: "hard"}
DEFAULT_PAGE = 1000
MAX_PAGE = 10_000  # the master clamps larger pages (kvtier.master.inspection.MAX_LIST_LIMIT)


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """One listed key."""

    key: str
    size: int
    state: str  # "complete", or "pending" (PutStart done, PutEnd not yet: invisible to readers)
    dram_replicas: int
    ssd_replicas: int
    pin: str  # "none", "soft" or "hard", in force now (an expired soft pin is "none")

    @classmethod
    def from_pb(cls, entry: pb.KeyEntry) -> KeyInfo:
        return cls(
            entry.key,
            entry.size,
            "pending" if entry.pending else "complete",
            entry.dram_replicas,
            entry.ssd_replicas,
            PINS.get(entry.pin, "unknown"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class KeyPage:
    keys: list[KeyInfo]
    next_start_after: str  # "" = the listing is done; else pass it as start_after for the next page


@dataclass(slots=True, frozen=True)
class ReplicaInfo:
    segment_id: int
    segment: str  # the segment's name ("" if it left meanwhile)
    tier: str  # "dram" or "ssd"
    location: int  # DRAM: byte offset in the segment's region; SSD: the disk location
    task: str  # "offloading" / "promoting" when a tier task on this copy is in flight, else ""


@dataclass(slots=True, frozen=True)
class ObjectInfo:
    """One object's record as the master holds it."""

    namespace: str
    key: str
    state: str  # "complete" or "pending"
    size: int
    checksum: int  # CRC32C recorded at PutEnd (0 while pending)
    replicas: list[ReplicaInfo] = field(default_factory=list)
    lease_s: float = 0.0  # read lease time left: its ranges are not freed or reused meanwhile
    pin: str = "none"  # in force now
    pin_ttl_s: float = 0.0  # soft pin: time left
    instance: str = ""  # the quota owner ("" = none) and its rank
    rank: int = 0
    age_s: float = 0.0  # since its PutStart (or since a restarted master rebuilt it)
    disk_reads: int = 0  # reads while it had no DRAM copy, toward promotion

    @classmethod
    def from_pb(cls, namespace: str, info: pb.ObjectInfo) -> ObjectInfo:
        return cls(
            namespace=namespace,
            key=info.key,
            state="pending" if info.pending else "complete",
            size=info.size,
            checksum=info.checksum,
            replicas=[
                ReplicaInfo(r.segment_id, r.segment, TIERS.get(r.tier, "unknown"), r.location, r.task)
                for r in info.replicas
            ],
            lease_s=info.lease_ms / 1000,
            pin=PINS.get(info.pin, "unknown"),
            pin_ttl_s=info.pin_ttl_ms / 1000,
            instance=info.instance,
            rank=info.rank,
            age_s=info.age_ms / 1000,
            disk_reads=info.disk_reads,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
