from kvtier.proto import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]

class Pin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_NONE: _ClassVar[Pin]
    PIN_SOFT: _ClassVar[Pin]
    PIN_HARD: _ClassVar[Pin]

class Prefetch(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_NONE: _ClassVar[Prefetch]
    PREFETCH_FOUND: _ClassVar[Prefetch]
    PREFETCH_PREFIX: _ClassVar[Prefetch]

class TierTaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_NONE: _ClassVar[TierTaskKind]
    OFFLOAD: _ClassVar[TierTaskKind]
    PROMOTE: _ClassVar[TierTaskKind]
    FORGET: _ClassVar[TierTaskKind]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_UNKNOWN: _ClassVar[EventKind]
    STORED: _ClassVar[EventKind]
    REMOVED: _ClassVar[EventKind]
    EVICTED: _ClassVar[EventKind]
    TIER_CHANGED: _ClassVar[EventKind]
    EVENT_END: _ClassVar[EventKind]
DRAM: Tier
SSD: Tier
PIN_NONE: Pin
PIN_SOFT: Pin
PIN_HARD: Pin
PREFETCH_NONE: Prefetch
PREFETCH_FOUND: Prefetch
PREFETCH_PREFIX: Prefetch
TASK_NONE: TierTaskKind
OFFLOAD: TierTaskKind
PROMOTE: TierTaskKind
FORGET: TierTaskKind
EVENT_UNKNOWN: EventKind
STORED: EventKind
REMOVED: EventKind
EVICTED: EventKind
TIER_CHANGED: EventKind
EVENT_END: EventKind

class HelloRequest(_message.Message):
    __slots__ = ("client_version",)
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    def __init__(self, client_version: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("status", "error", "cluster_id", "master_epoch", "fast_endpoint", "max_batch_keys", "lease_ms", "epoch", "role", "leader")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FAST_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    cluster_id: str
    master_epoch: str
    fast_endpoint: str
    max_batch_keys: int
    lease_ms: int
    epoch: int
    role: str
    leader: str
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., cluster_id: _Optional[str] = ..., master_epoch: _Optional[str] = ..., fast_endpoint: _Optional[str] = ..., max_batch_keys: _Optional[int] = ..., lease_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ...) -> None: ...

class SegmentEndpoint(_message.Message):
    __slots__ = ("segment_id", "name", "host_id", "endpoints", "quarantined", "direct_reads", "session")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    name: str
    host_id: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    quarantined: bool
    direct_reads: bool
    session: int
    def __init__(self, segment_id: _Optional[int] = ..., name: _Optional[str] = ..., host_id: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., quarantined: _Optional[bool] = ..., direct_reads: _Optional[bool] = ..., session: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("cluster_id", "name", "host_id", "endpoints", "dram_capacity", "incarnation", "ssd_capacity", "offload", "disk_engine", "ssd_max_object", "inventory", "wall_clock_ms", "previous_segment_id", "previous_applied_seq", "previous_epoch", "keyed_reads", "lease_grants", "mount_sessions", "writer_slots", "writer_offsets", "writer_lengths")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    DISK_ENGINE_FIELD_NUMBER: _ClassVar[int]
    SSD_MAX_OBJECT_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    WALL_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEYED_READS_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANTS_FIELD_NUMBER: _ClassVar[int]
    MOUNT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WRITER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WRITER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    WRITER_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    name: str
    host_id: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    dram_capacity: int
    incarnation: str
    ssd_capacity: int
    offload: bool
    disk_engine: str
    ssd_max_object: int
    inventory: bool
    wall_clock_ms: int
    previous_segment_id: int
    previous_applied_seq: int
    previous_epoch: int
    keyed_reads: bool
    lease_grants: bool
    mount_sessions: bool
    writer_slots: bool
    writer_offsets: _containers.RepeatedScalarFieldContainer[int]
    writer_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cluster_id: _Optional[str] = ..., name: _Optional[str] = ..., host_id: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., dram_capacity: _Optional[int] = ..., incarnation: _Optional[str] = ..., ssd_capacity: _Optional[int] = ..., offload: _Optional[bool] = ..., disk_engine: _Optional[str] = ..., ssd_max_object: _Optional[int] = ..., inventory: _Optional[bool] = ..., wall_clock_ms: _Optional[int] = ..., previous_segment_id: _Optional[int] = ..., previous_applied_seq: _Optional[int] = ..., previous_epoch: _Optional[int] = ..., keyed_reads: _Optional[bool] = ..., lease_grants: _Optional[bool] = ..., mount_sessions: _Optional[bool] = ..., writer_slots: _Optional[bool] = ..., writer_offsets: _Optional[_Iterable[int]] = ..., writer_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("status", "error", "segment_id", "heartbeat_interval_ms", "ttl_ms", "master_epoch", "epoch", "discard_index", "wall_clock_ms", "direct_read_lease_ms", "mount_sessions", "name_frees_in_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DISCARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    WALL_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READ_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MOUNT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FREES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    segment_id: int
    heartbeat_interval_ms: int
    ttl_ms: int
    master_epoch: str
    epoch: int
    discard_index: bool
    wall_clock_ms: int
    direct_read_lease_ms: int
    mount_sessions: bool
    name_frees_in_ms: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., segment_id: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., master_epoch: _Optional[str] = ..., epoch: _Optional[int] = ..., discard_index: _Optional[bool] = ..., wall_clock_ms: _Optional[int] = ..., direct_read_lease_ms: _Optional[int] = ..., mount_sessions: _Optional[bool] = ..., name_frees_in_ms: _Optional[int] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("segment_id", "epoch")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    epoch: int
    def __init__(self, segment_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("status", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("segment_id", "ssd_used", "dram_bytes_served", "ssd_bytes_served", "disk_bytes_read", "ssd_bytes_offloaded", "epoch", "wall_clock_ms", "rtt_ms", "direct_reads_served", "ssd_usable", "writers_sampled_ms", "writer_offsets", "writer_lengths", "writer_cutoffs_ms")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WALL_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SSD_USABLE_FIELD_NUMBER: _ClassVar[int]
    WRITERS_SAMPLED_MS_FIELD_NUMBER: _ClassVar[int]
    WRITER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    WRITER_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    WRITER_CUTOFFS_MS_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    ssd_used: int
    dram_bytes_served: int
    ssd_bytes_served: int
    disk_bytes_read: int
    ssd_bytes_offloaded: int
    epoch: int
    wall_clock_ms: int
    rtt_ms: int
    direct_reads_served: int
    ssd_usable: int
    writers_sampled_ms: int
    writer_offsets: _containers.RepeatedScalarFieldContainer[int]
    writer_lengths: _containers.RepeatedScalarFieldContainer[int]
    writer_cutoffs_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment_id: _Optional[int] = ..., ssd_used: _Optional[int] = ..., dram_bytes_served: _Optional[int] = ..., ssd_bytes_served: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., ssd_bytes_offloaded: _Optional[int] = ..., epoch: _Optional[int] = ..., wall_clock_ms: _Optional[int] = ..., rtt_ms: _Optional[int] = ..., direct_reads_served: _Optional[int] = ..., ssd_usable: _Optional[int] = ..., writers_sampled_ms: _Optional[int] = ..., writer_offsets: _Optional[_Iterable[int]] = ..., writer_lengths: _Optional[_Iterable[int]] = ..., writer_cutoffs_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "master_epoch", "error", "epoch", "wall_clock_ms", "direct_read_lease_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WALL_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READ_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    master_epoch: str
    error: str
    epoch: int
    wall_clock_ms: int
    direct_read_lease_ms: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., master_epoch: _Optional[str] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., wall_clock_ms: _Optional[int] = ..., direct_read_lease_ms: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("namespace", "keys", "sizes", "replicas", "instance", "rank", "pin", "pin_ttl_ms", "preferred_segment", "client_host", "wait_ms", "released_leases", "request_id", "avoid_segments", "overwrite", "lease_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOST_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AVOID_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    instance: str
    rank: int
    pin: Pin
    pin_ttl_ms: int
    preferred_segment: str
    client_host: str
    wait_ms: int
    released_leases: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    avoid_segments: _containers.RepeatedScalarFieldContainer[str]
    overwrite: bool
    lease_ms: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ..., instance: _Optional[str] = ..., rank: _Optional[int] = ..., pin: _Optional[_Union[Pin, str]] = ..., pin_ttl_ms: _Optional[int] = ..., preferred_segment: _Optional[str] = ..., client_host: _Optional[str] = ..., wait_ms: _Optional[int] = ..., released_leases: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ..., avoid_segments: _Optional[_Iterable[str]] = ..., overwrite: _Optional[bool] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "replica_counts", "replica_segments", "replica_offsets", "segments", "put_id", "replica_tags", "tag_expiry_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TAGS_FIELD_NUMBER: _ClassVar[int]
    TAG_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    replica_counts: _containers.RepeatedScalarFieldContainer[int]
    replica_segments: _containers.RepeatedScalarFieldContainer[int]
    replica_offsets: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentEndpoint]
    put_id: int
    replica_tags: bytes
    tag_expiry_ms: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., replica_counts: _Optional[_Iterable[int]] = ..., replica_segments: _Optional[_Iterable[int]] = ..., replica_offsets: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[_Union[SegmentEndpoint, _Mapping]]] = ..., put_id: _Optional[int] = ..., replica_tags: _Optional[bytes] = ..., tag_expiry_ms: _Optional[int] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("namespace", "keys", "checksums", "put_id", "released_leases", "request_id", "group", "chunk_checksums")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    put_id: int
    released_leases: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    group: bool
    chunk_checksums: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ..., put_id: _Optional[int] = ..., released_leases: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ..., group: _Optional[bool] = ..., chunk_checksums: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RelayPutEndRequest(_message.Message):
    __slots__ = ("put_end", "token", "segment_id", "epoch", "acked_seq")
    PUT_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    put_end: PutEndRequest
    token: str
    segment_id: int
    epoch: int
    acked_seq: int
    def __init__(self, put_end: _Optional[_Union[PutEndRequest, _Mapping]] = ..., token: _Optional[str] = ..., segment_id: _Optional[int] = ..., epoch: _Optional[int] = ..., acked_seq: _Optional[int] = ...) -> None: ...

class RelayPutEndResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "notices")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    notices: PollCommitsResponse
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., notices: _Optional[_Union[PollCommitsResponse, _Mapping]] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("namespace", "keys", "put_id", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    put_id: int
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., put_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("namespace", "keys", "releasable", "released_leases", "request_id", "force", "group", "with_chunk_checksums")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RELEASABLE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WITH_CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    releasable: bool
    released_leases: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    force: bool
    group: bool
    with_chunk_checksums: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., releasable: _Optional[bool] = ..., released_leases: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ..., force: _Optional[bool] = ..., group: _Optional[bool] = ..., with_chunk_checksums: _Optional[bool] = ...) -> None: ...

class KeyStatusResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "direct_read_lease_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READ_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    direct_read_lease_ms: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., direct_read_lease_ms: _Optional[int] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "sizes", "checksums", "replica_counts", "replica_segments", "replica_offsets", "replica_tiers", "segments", "lease_ms", "replica_tags", "tag_expiry_ms", "lease_id", "chunk_checksums")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TIERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TAGS_FIELD_NUMBER: _ClassVar[int]
    TAG_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    replica_counts: _containers.RepeatedScalarFieldContainer[int]
    replica_segments: _containers.RepeatedScalarFieldContainer[int]
    replica_offsets: _containers.RepeatedScalarFieldContainer[int]
    replica_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentEndpoint]
    lease_ms: int
    replica_tags: bytes
    tag_expiry_ms: int
    lease_id: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., replica_counts: _Optional[_Iterable[int]] = ..., replica_segments: _Optional[_Iterable[int]] = ..., replica_offsets: _Optional[_Iterable[int]] = ..., replica_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., segments: _Optional[_Iterable[_Union[SegmentEndpoint, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., replica_tags: _Optional[bytes] = ..., tag_expiry_ms: _Optional[int] = ..., lease_id: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("namespace", "keys", "prefetch", "released_leases", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    prefetch: Prefetch
    released_leases: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., prefetch: _Optional[_Union[Prefetch, str]] = ..., released_leases: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("status", "error", "exists", "prefix_count")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_COUNT_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    exists: _containers.RepeatedScalarFieldContainer[bool]
    prefix_count: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., exists: _Optional[_Iterable[bool]] = ..., prefix_count: _Optional[int] = ...) -> None: ...

class RemovePrefixRequest(_message.Message):
    __slots__ = ("namespace", "prefix", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prefix: str
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., prefix: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("namespace", "keys", "segment_ids", "tiers", "offsets", "checksums", "segment_names", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAMES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    segment_names: _containers.RepeatedScalarFieldContainer[str]
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., segment_ids: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., segment_names: _Optional[_Iterable[str]] = ..., request_id: _Optional[int] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "removed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    removed: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., removed: _Optional[int] = ...) -> None: ...

class DrainSegmentRequest(_message.Message):
    __slots__ = ("segment", "finish", "cancel", "if_draining", "status_only")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    IF_DRAINING_FIELD_NUMBER: _ClassVar[int]
    STATUS_ONLY_FIELD_NUMBER: _ClassVar[int]
    segment: str
    finish: bool
    cancel: bool
    if_draining: bool
    status_only: bool
    def __init__(self, segment: _Optional[str] = ..., finish: _Optional[bool] = ..., cancel: _Optional[bool] = ..., if_draining: _Optional[bool] = ..., status_only: _Optional[bool] = ...) -> None: ...

class DrainSegmentResponse(_message.Message):
    __slots__ = ("status", "error", "objects_left", "bytes_left", "state", "ssd_objects_left", "incarnation")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    BYTES_LEFT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SSD_OBJECTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    objects_left: int
    bytes_left: int
    state: str
    ssd_objects_left: int
    incarnation: str
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., objects_left: _Optional[int] = ..., bytes_left: _Optional[int] = ..., state: _Optional[str] = ..., ssd_objects_left: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class MigrateStartRequest(_message.Message):
    __slots__ = ("segment", "max_objects", "namespace", "keys", "target", "keep_source")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    KEEP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    max_objects: int
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    target: str
    keep_source: bool
    def __init__(self, segment: _Optional[str] = ..., max_objects: _Optional[int] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., target: _Optional[str] = ..., keep_source: _Optional[bool] = ...) -> None: ...

class MigrateStartResponse(_message.Message):
    __slots__ = ("status", "error", "migration_id", "namespaces", "keys", "sizes", "checksums", "source_offsets", "statuses", "target_segments", "target_offsets", "segments", "source_segment", "source_tags", "target_tags", "tag_expiry_ms", "source_segments", "source_tiers", "more", "waiting")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TAGS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TAGS_FIELD_NUMBER: _ClassVar[int]
    TAG_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIERS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    migration_id: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    source_offsets: _containers.RepeatedScalarFieldContainer[int]
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    target_segments: _containers.RepeatedScalarFieldContainer[int]
    target_offsets: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentEndpoint]
    source_segment: int
    source_tags: bytes
    target_tags: bytes
    tag_expiry_ms: int
    source_segments: _containers.RepeatedScalarFieldContainer[int]
    source_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    more: bool
    waiting: bool
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., migration_id: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., source_offsets: _Optional[_Iterable[int]] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., target_segments: _Optional[_Iterable[int]] = ..., target_offsets: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[_Union[SegmentEndpoint, _Mapping]]] = ..., source_segment: _Optional[int] = ..., source_tags: _Optional[bytes] = ..., target_tags: _Optional[bytes] = ..., tag_expiry_ms: _Optional[int] = ..., source_segments: _Optional[_Iterable[int]] = ..., source_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., more: _Optional[bool] = ..., waiting: _Optional[bool] = ...) -> None: ...

class MigrateEndRequest(_message.Message):
    __slots__ = ("migration_id", "namespaces", "keys", "moved")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    migration_id: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    keys: _containers.RepeatedScalarFieldContainer[str]
    moved: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, migration_id: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., keys: _Optional[_Iterable[str]] = ..., moved: _Optional[_Iterable[bool]] = ...) -> None: ...

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("instance", "tp_size", "pp_size", "budget_bytes", "request_id")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    instance: str
    tp_size: int
    pp_size: int
    budget_bytes: int
    request_id: int
    def __init__(self, instance: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("status", "error", "quota_per_rank")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUOTA_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    quota_per_rank: int
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., quota_per_rank: _Optional[int] = ...) -> None: ...

class QuotasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QuotaInfo(_message.Message):
    __slots__ = ("instance", "rank", "quota", "used", "objects", "tp_size", "pp_size")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    rank: int
    quota: int
    used: int
    objects: int
    tp_size: int
    pp_size: int
    def __init__(self, instance: _Optional[str] = ..., rank: _Optional[int] = ..., quota: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class QuotasResponse(_message.Message):
    __slots__ = ("status", "error", "quotas")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    quotas: _containers.RepeatedCompositeFieldContainer[QuotaInfo]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., quotas: _Optional[_Iterable[_Union[QuotaInfo, _Mapping]]] = ...) -> None: ...

class EvictionInfo(_message.Message):
    __slots__ = ("reason", "objects", "bytes")
    REASON_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    reason: str
    objects: int
    bytes: int
    def __init__(self, reason: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment_id", "name", "host_id", "endpoints", "dram_capacity", "dram_used", "objects", "heartbeat_age_ms", "state", "ssd_capacity", "ssd_used", "ssd_objects", "disk_engine", "offload", "dram_bytes_served", "ssd_bytes_served", "disk_bytes_read", "ssd_bytes_offloaded", "direct_reads_served", "ssd_usable", "dram_releasing", "clock_skew_s", "clock_skewed", "quarantined", "quarantine_left_s")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_FIELD_NUMBER: _ClassVar[int]
    SSD_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DISK_ENGINE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SSD_USABLE_FIELD_NUMBER: _ClassVar[int]
    DRAM_RELEASING_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SKEW_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SKEWED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    name: str
    host_id: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    dram_capacity: int
    dram_used: int
    objects: int
    heartbeat_age_ms: int
    state: str
    ssd_capacity: int
    ssd_used: int
    ssd_objects: int
    disk_engine: str
    offload: bool
    dram_bytes_served: int
    ssd_bytes_served: int
    disk_bytes_read: int
    ssd_bytes_offloaded: int
    direct_reads_served: int
    ssd_usable: int
    dram_releasing: int
    clock_skew_s: float
    clock_skewed: bool
    quarantined: bool
    quarantine_left_s: float
    def __init__(self, segment_id: _Optional[int] = ..., name: _Optional[str] = ..., host_id: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., dram_capacity: _Optional[int] = ..., dram_used: _Optional[int] = ..., objects: _Optional[int] = ..., heartbeat_age_ms: _Optional[int] = ..., state: _Optional[str] = ..., ssd_capacity: _Optional[int] = ..., ssd_used: _Optional[int] = ..., ssd_objects: _Optional[int] = ..., disk_engine: _Optional[str] = ..., offload: _Optional[bool] = ..., dram_bytes_served: _Optional[int] = ..., ssd_bytes_served: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., ssd_bytes_offloaded: _Optional[int] = ..., direct_reads_served: _Optional[int] = ..., ssd_usable: _Optional[int] = ..., dram_releasing: _Optional[int] = ..., clock_skew_s: _Optional[float] = ..., clock_skewed: _Optional[bool] = ..., quarantined: _Optional[bool] = ..., quarantine_left_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cluster_id", "master_epoch", "objects", "pending_puts", "capacity", "used", "segments", "uptime_s", "status", "error", "rpc_requests", "rpc_failures", "quotas", "evictions", "tiering", "epoch", "role", "leader", "recovery", "lookup_keys", "lookup_hits", "lookup_hits_disk_only", "eviction_policy")
    class RpcRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RpcFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TieringEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RecoveryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LookupKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LookupHitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RPC_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RPC_FAILURES_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TIERING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_DISK_ONLY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    master_epoch: str
    objects: int
    pending_puts: int
    capacity: int
    used: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    uptime_s: float
    status: _status_pb2.Status
    error: str
    rpc_requests: _containers.ScalarMap[str, int]
    rpc_failures: _containers.ScalarMap[str, int]
    quotas: _containers.RepeatedCompositeFieldContainer[QuotaInfo]
    evictions: _containers.RepeatedCompositeFieldContainer[EvictionInfo]
    tiering: _containers.ScalarMap[str, int]
    epoch: int
    role: str
    leader: str
    recovery: _containers.ScalarMap[str, float]
    lookup_keys: _containers.ScalarMap[str, int]
    lookup_hits: _containers.ScalarMap[str, int]
    lookup_hits_disk_only: int
    eviction_policy: str
    def __init__(self, cluster_id: _Optional[str] = ..., master_epoch: _Optional[str] = ..., objects: _Optional[int] = ..., pending_puts: _Optional[int] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., rpc_requests: _Optional[_Mapping[str, int]] = ..., rpc_failures: _Optional[_Mapping[str, int]] = ..., quotas: _Optional[_Iterable[_Union[QuotaInfo, _Mapping]]] = ..., evictions: _Optional[_Iterable[_Union[EvictionInfo, _Mapping]]] = ..., tiering: _Optional[_Mapping[str, int]] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ..., recovery: _Optional[_Mapping[str, float]] = ..., lookup_keys: _Optional[_Mapping[str, int]] = ..., lookup_hits: _Optional[_Mapping[str, int]] = ..., lookup_hits_disk_only: _Optional[int] = ..., eviction_policy: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("namespace", "prefix", "start_after", "limit", "include_pending")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PENDING_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prefix: str
    start_after: str
    limit: int
    include_pending: bool
    def __init__(self, namespace: _Optional[str] = ..., prefix: _Optional[str] = ..., start_after: _Optional[str] = ..., limit: _Optional[int] = ..., include_pending: _Optional[bool] = ...) -> None: ...

class KeyEntry(_message.Message):
    __slots__ = ("key", "size", "pending", "dram_replicas", "ssd_replicas", "pin")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DRAM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SSD_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    pending: bool
    dram_replicas: int
    ssd_replicas: int
    pin: Pin
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., pending: _Optional[bool] = ..., dram_replicas: _Optional[int] = ..., ssd_replicas: _Optional[int] = ..., pin: _Optional[_Union[Pin, str]] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("status", "error", "entries", "next_start_after")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_START_AFTER_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    entries: _containers.RepeatedCompositeFieldContainer[KeyEntry]
    next_start_after: str
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[KeyEntry, _Mapping]]] = ..., next_start_after: _Optional[str] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("segment_id", "segment", "tier", "location", "task")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    segment: str
    tier: Tier
    location: int
    task: str
    def __init__(self, segment_id: _Optional[int] = ..., segment: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., location: _Optional[int] = ..., task: _Optional[str] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("key", "size", "checksum", "pending", "replicas", "lease_ms", "pin", "pin_ttl_ms", "instance", "rank", "age_ms", "disk_reads")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    checksum: int
    pending: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    lease_ms: int
    pin: Pin
    pin_ttl_ms: int
    instance: str
    rank: int
    age_ms: int
    disk_reads: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., pending: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., pin: _Optional[_Union[Pin, str]] = ..., pin_ttl_ms: _Optional[int] = ..., instance: _Optional[str] = ..., rank: _Optional[int] = ..., age_ms: _Optional[int] = ..., disk_reads: _Optional[int] = ...) -> None: ...

class StatKeysResponse(_message.Message):
    __slots__ = ("status", "error", "statuses", "objects")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    statuses: _containers.RepeatedScalarFieldContainer[_status_pb2.Status]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[_status_pb2.Status, str]]] = ..., objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class PollTierTasksRequest(_message.Message):
    __slots__ = ("segment_id", "max_tasks", "wait_ms", "epoch")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    max_tasks: int
    wait_ms: int
    epoch: int
    def __init__(self, segment_id: _Optional[int] = ..., max_tasks: _Optional[int] = ..., wait_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PollTierTasksResponse(_message.Message):
    __slots__ = ("status", "error", "task_ids", "kinds", "namespaces", "keys", "sizes", "checksums", "dram_offsets", "disk_locations", "task_ttl_ms", "promote_by_ms", "group_ids", "group_sizes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DRAM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TASK_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_BY_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    kinds: _containers.RepeatedScalarFieldContainer[TierTaskKind]
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    dram_offsets: _containers.RepeatedScalarFieldContainer[int]
    disk_locations: _containers.RepeatedScalarFieldContainer[int]
    task_ttl_ms: int
    promote_by_ms: int
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., task_ids: _Optional[_Iterable[int]] = ..., kinds: _Optional[_Iterable[_Union[TierTaskKind, str]]] = ..., namespaces: _Optional[_Iterable[str]] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., dram_offsets: _Optional[_Iterable[int]] = ..., disk_locations: _Optional[_Iterable[int]] = ..., task_ttl_ms: _Optional[int] = ..., promote_by_ms: _Optional[int] = ..., group_ids: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TierTasksDoneRequest(_message.Message):
    __slots__ = ("segment_id", "task_ids", "statuses", "disk_locations", "error", "epoch")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    DISK_LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    statuses: _containers.RepeatedScalarFieldContainer[int]
    disk_locations: _containers.RepeatedScalarFieldContainer[int]
    error: str
    epoch: int
    def __init__(self, segment_id: _Optional[int] = ..., task_ids: _Optional[_Iterable[int]] = ..., statuses: _Optional[_Iterable[int]] = ..., disk_locations: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class DiskObjectsRequest(_message.Message):
    __slots__ = ("segment_id", "namespaces", "keys", "sizes", "checksums", "disk_locations", "epoch", "group_ids", "group_sizes")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    disk_locations: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment_id: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., disk_locations: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., group_ids: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PollCommitsRequest(_message.Message):
    __slots__ = ("segment_id", "acked_seq", "wait_ms", "max_notices", "epoch")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NOTICES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    acked_seq: int
    wait_ms: int
    max_notices: int
    epoch: int
    def __init__(self, segment_id: _Optional[int] = ..., acked_seq: _Optional[int] = ..., wait_ms: _Optional[int] = ..., max_notices: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PollCommitsResponse(_message.Message):
    __slots__ = ("status", "error", "epoch", "first_seq", "drops", "offsets", "sizes", "checksums", "names", "instances", "ranks", "pins", "pin_ttl_ms", "group_ids", "group_sizes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    epoch: int
    first_seq: int
    drops: _containers.RepeatedScalarFieldContainer[bool]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    instances: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    pins: _containers.RepeatedScalarFieldContainer[Pin]
    pin_ttl_ms: _containers.RepeatedScalarFieldContainer[int]
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., drops: _Optional[_Iterable[bool]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., names: _Optional[_Iterable[str]] = ..., instances: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[int]] = ..., pins: _Optional[_Iterable[_Union[Pin, str]]] = ..., pin_ttl_ms: _Optional[_Iterable[int]] = ..., group_ids: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class DramObjectsRequest(_message.Message):
    __slots__ = ("segment_id", "namespaces", "keys", "sizes", "checksums", "offsets", "instances", "ranks", "pins", "pin_ttl_ms", "done", "epoch", "group_ids", "group_sizes")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    instances: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    pins: _containers.RepeatedScalarFieldContainer[Pin]
    pin_ttl_ms: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    epoch: int
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment_id: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., instances: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[int]] = ..., pins: _Optional[_Iterable[_Union[Pin, str]]] = ..., pin_ttl_ms: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., epoch: _Optional[int] = ..., group_ids: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveReplicasRequest(_message.Message):
    __slots__ = ("namespace", "keys", "segment", "allow_last", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_LAST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    segment: str
    allow_last: bool
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., segment: _Optional[str] = ..., allow_last: _Optional[bool] = ..., request_id: _Optional[int] = ...) -> None: ...

class SegmentFailure(_message.Message):
    __slots__ = ("segment", "count", "kind")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    segment: str
    count: int
    kind: str
    def __init__(self, segment: _Optional[str] = ..., count: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class SegmentFailuresRequest(_message.Message):
    __slots__ = ("failures", "reporter", "request_id")
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[SegmentFailure]
    reporter: str
    request_id: int
    def __init__(self, failures: _Optional[_Iterable[_Union[SegmentFailure, _Mapping]]] = ..., reporter: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class SegmentFailuresResponse(_message.Message):
    __slots__ = ("status", "error", "quarantined")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    error: str
    quarantined: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ..., quarantined: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("namespace", "prefix", "since", "epoch", "kinds", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prefix: str
    since: int
    epoch: int
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., prefix: _Optional[str] = ..., since: _Optional[int] = ..., epoch: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ..., request_id: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "epoch", "kind", "namespace", "key", "size", "tiers", "segments", "reason", "time", "status", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    kind: EventKind
    namespace: str
    key: str
    size: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    segments: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    time: float
    status: _status_pb2.Status
    error: str
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., namespace: _Optional[str] = ..., key: _Optional[str] = ..., size: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., segments: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., time: _Optional[float] = ..., status: _Optional[_Union[_status_pb2.Status, str]] = ..., error: _Optional[str] = ...) -> None: ...
