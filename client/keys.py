"""Listing and inspecting keys: what `kvtier keys` and `kvtier stat` use.

`Client.list_keys` / `Client.iter_keys` / `Client.stat` return the typed
records below (the master's `ListKeys` and `StatKeys`, read-only: they grant
no lease and save nothing from eviction).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import check_key, check_prefix
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.client.master import MasterClient

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


class KeyInspection:
    """`Client`'s read-only inspection calls (the master's ListKeys and StatKeys), kept beside the
    records they return. Needs the client's `namespace` and master link (`_master`)."""

    namespace: str
    _master: MasterClient

    def list_keys(
        self, prefix: str = "", *, start_after: str = "", limit: int = DEFAULT_PAGE, include_pending: bool = False
    ) -> KeyPage:
        """One page of this namespace's keys that start with `prefix`, after `start_after`, in code
        point order: at most `limit` (the master caps a page at 10,000). Pass the page's
        `next_start_after` back as `start_after` until it is "": every key present throughout is
        listed exactly once. Read-only: no lease, no recency refresh."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        request = pb.ListKeysRequest(
            namespace=self.namespace,
            prefix=check_prefix(prefix),
            start_after=start_after,
            limit=limit,
            include_pending=include_pending,
        )
        reply = self._master.call("ListKeys", request)
        return KeyPage([KeyInfo.from_pb(e) for e in reply.entries], reply.next_start_after)

    def iter_keys(
        self, prefix: str = "", *, start_after: str = "", page_size: int = DEFAULT_PAGE, include_pending: bool = False
    ) -> Iterator[KeyInfo]:
        """Every key under `prefix` after `start_after`, one `list_keys` page at a time."""
        while True:
            page = self.list_keys(prefix, start_after=start_after, limit=page_size, include_pending=include_pending)
            yield from page.keys
            if not page.next_start_after:
                return
            start_after = page.next_start_after

    def stat(self, key: str) -> ObjectInfo | None:
        """`key`'s whole record (size, checksum, state, replicas with tier and location, lease, pin,
        owner), pending objects included; None when the master has none. Read-only."""
        return self.batch_stat([key])[0]

    def batch_stat(self, keys: Sequence[str]) -> list[ObjectInfo | None]:
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        reply = self._master.call("StatKeys", pb.KeysRequest(namespace=self.namespace, keys=keys))
        return [
            ObjectInfo.from_pb(self.namespace, info) if status == Status.OK else None
            for status, info in zip(reply.statuses, reply.objects, strict=True)
        ]
