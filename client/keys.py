"""Listing, inspecting and evicting keys: what `kvtier keys`, `kvtier stat` and `kvtier evict` use.

`Client.list_keys` / `Client.iter_keys` / `Client.stat` return the typed
records below (the master's `ListKeys` and `StatKeys`, read-only: they grant
no lease and save nothing from eviction). `evict_prefix` removes the objects
under a prefix one page at a time, so the master never handles an unbounded
batch and the caller can report progress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.client.client import Client

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


@dataclass
class EvictReport:
    """What `evict_prefix` did. Object bytes count each object once, whatever its replicas."""

    namespace: str
    prefix: str
    removed: int = 0
    removed_bytes: int = 0
    skipped_pinned: int = 0  # hard pins and soft pins in force, kept (unless include_pinned)
    skipped_pending: int = 0  # puts not finished: not removable yet
    gone: int = 0  # listed, but removed or evicted by someone else before our Remove
    listed: int = 0  # keys seen under the prefix
    pages: int = 0
    dry_run: bool = False


_REMOVE_BATCH = 1000  # keys per Remove: well under any sensible --max-batch-keys


def evict_prefix(
    client: Client,
    prefix: str,
    *,
    page_size: int = MAX_PAGE,
    include_pinned: bool = False,
    dry_run: bool = False,
    progress: Callable[[EvictReport], None] | None = None,
) -> EvictReport:
    """Remove this client's namespace's objects whose key starts with `prefix`, page by page.

    Each page is one `ListKeys` (pending puts included, to count them) and one
    batched `Remove` of the page's removable keys; `progress` is called after
    each. Pinned objects (hard, or soft with time left) are skipped unless
    `include_pinned`: a pin is the writer's promise that the cache keeps them.
    Pending puts are skipped (they may complete afterwards). Objects being
    read are removed like `Client.remove` does: readers holding a lease
    finish, the space is freed when the lease ends. With `dry_run` nothing is
    removed; `removed` counts what would have been. Keys put under the prefix
    while it runs may survive it. Raises KvtierError when the master refuses.
    """
    report = EvictReport(client.namespace, prefix, dry_run=dry_run)
    start_after = ""
    while True:
        page = client.list_keys(prefix, start_after=start_after, limit=page_size, include_pending=True)
        report.pages += 1
        report.listed += len(page.keys)
        doomed = []
        for info in page.keys:
            if info.state == "pending":
                report.skipped_pending += 1
            elif info.pin != "none" and not include_pinned:
                report.skipped_pinned += 1
            else:
                doomed.append(info)
        if dry_run:
            report.removed += len(doomed)
            report.removed_bytes += sum(info.size for info in doomed)
        elif doomed:
            # Removed in sub-batches: a master may allow fewer keys per request than a page holds.
            statuses = []
            for lo in range(0, len(doomed), _REMOVE_BATCH):
                statuses += client.batch_remove([info.key for info in doomed[lo : lo + _REMOVE_BATCH]])
            for info, status in zip(doomed, statuses, strict=True):
                if status == Status.OK:
                    report.removed += 1
                    report.removed_bytes += info.size
                elif status == Status.PUT_IN_PROGRESS:  # removed and put again since the listing
                    report.skipped_pending += 1
                else:
                    report.gone += 1
        if progress is not None:
            progress(report)
        if not page.next_start_after:
            return report
        start_after = page.next_start_after
