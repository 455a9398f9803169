"""The records and results of `kvtier.master.state.MasterState`: segments, put options, the
results of put_start / get_replicas / mount, and the cluster snapshot. Plain data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.master.allocator import OffsetAllocator
from kvtier.master.records import PIN_NONE
from kvtier.proto.keys import wire_key_invalid
from kvtier.proto.status import Status


class SegmentState(enum.Enum):
    ACTIVE = 1  # mounted and heartbeating: takes allocations and serves reads
    DRAINING = 2  # takes no new allocations; serves reads until its objects have moved away
    RECOVERING = 3  # mounted, still reporting its inventory (kvtier.master.recovery): no allocations


@dataclass(slots=True, eq=False)
class SegmentRecord:
    segment_id: int
    name: str
    host_id: str
    endpoints: tuple[str, ...]
    allocator: OffsetAllocator
    last_heartbeat: float
    mounted_at: float
    state: SegmentState = SegmentState.ACTIVE
    objects: int = 0  # replicas (pending or complete) held by this segment
    incarnation: str = ""  # the segment process's region nonce: tells a restart from a re-mount
    ssd_capacity: int = 0  # bytes of its SSD tier; 0 = none
    offload: bool = False  # evicted DRAM copies go to its SSD tier instead of being dropped
    disk_engine: str = ""
    ssd_max_object: int = 0  # larger objects are not offloaded there; 0 = any
    ssd_used: int = 0  # as last reported by its heartbeat, like the counters below
    io_counters: dict[str, int] = field(default_factory=dict)
    ssd_objects: int = 0  # disk replicas on it
    # DRAM bytes of copies gone (evicted, removed, replaced) whose ranges are not reusable yet: read
    # leases, write grants, the clock-skew margin (kvtier.master.range_book). Counted in `used`, and
    # on their way back: the watermark pass does not evict live objects for them.
    releasing: int = 0
    inventory_accepted: bool = False  # RECOVERING: its DRAM inventory is taken (else it discards its index)
    # RECOVERING: its SSD copies are refused (nothing can be proven about its previous life:
    # kvtier.master.fences)
    disk_refused: bool = False
    # Its name is in the durably saved state (kvtier.master.persist): only then does it take
    # allocations, so a restart right after still waits for it and takes its inventory.
    saved: bool = True
    # Its wall clock minus ours, seconds (kvtier.master.clock_skew), and whether that is beyond
    # clock_skew_tolerance_s: then it takes no new objects (its reads are still served).
    clock_skew_s: float = 0.0
    clock_skewed: bool = False
    # It serves direct reads (MountSegmentRequest.keyed_reads, with this master's direct_reads on).
    direct_reads: bool = False
    # It judges grants by their mount session (MountSegmentRequest.mount_sessions): answers name the
    # session for it and its tags are keyed with it; an older segment gets neither.
    mount_sessions: bool = False
    # It reports the copies same-host clients have in progress into its region (writer slots,
    # MountSegmentRequest.writer_slots): the range of a put that never completed is `held` until a
    # report taken after its grant shows no writer in it (kvtier.master.range_book). Entries are
    # (reuse_at on the master's clock, due_ms on the segment's wall clock, offset, size), their bytes
    # counted in `releasing`; `writer_ranges` is the last report's (offset, length) of copies in progress.
    writer_slots: bool = False
    held: list[tuple[float, int, int, int]] = field(default_factory=list)
    writer_ranges: tuple[tuple[int, int], ...] = ()
    mount_writers: tuple[tuple[int, int], ...] = ()  # named at mount, held once its inventory is in

    @property
    def placeable(self) -> bool:
        """Takes new objects: active, durably known, its clock within tolerance."""
        return self.state is SegmentState.ACTIVE and self.saved and not self.clock_skewed

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used


@dataclass(slots=True, frozen=True)
class PutOptions:
    """Who puts, and how the objects are placed and protected."""

    instance: str = ""  # engine deployment (quota owner); empty = no quota
    rank: int = 0
    pin: int = PIN_NONE
    pin_ttl_s: float = 0.0  # PIN_SOFT lifetime; 0 = config.soft_pin_ttl_s
    preferred_segment: str = ""
    client_host: str = ""  # host id of the writer: same-host segments are preferred
    # Segments the writer's transfers just failed on (names): placed on only where nothing else fits.
    avoid_segments: frozenset[str] = frozenset()
    overwrite: bool = False  # upsert: a complete key gets a new version (kvtier.master.upsert)
    lease_s: float = 0.0  # put-time lease from PutEnd on (kvtier.master.upsert); 0 = none


@dataclass(slots=True)
class PutStartResult:
    put_id: int
    statuses: list[int]
    replica_counts: list[int]
    replica_segments: list[int]
    replica_offsets: list[int]
    first_error: str = ""


@dataclass(slots=True)
class GetResult:
    statuses: list[int]
    sizes: list[int]
    checksums: list[int]
    replica_counts: list[int]
    replica_segments: list[int]
    replica_offsets: list[int]
    replica_tiers: list[int]
    lease_ms: int
    lease_id: int = 0  # a releasable lease's id (kvtier.master.leases); 0 = none


@dataclass(slots=True)
class MountResult:
    status: Status
    segment: SegmentRecord | None = None
    error: str = ""
    discard_index: bool = False  # the segment must empty its DRAM index before reporting it
    name_frees_in_s: float = 0.0  # SEGMENT_NAME_IN_USE: until the name's mount counts as gone if silent


@dataclass(slots=True)
class ClusterSnapshot:
    objects: int
    pending_puts: int
    segments: list[SegmentRecord] = field(default_factory=list)


# True when a key (or namespace) received by the master is invalid: the rule is kvtier.proto.keys'.
master_key_problem = wire_key_invalid
