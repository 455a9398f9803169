from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Status]
    INTERNAL: _ClassVar[Status]
    INVALID_ARGUMENT: _ClassVar[Status]
    TIMEOUT: _ClassVar[Status]
    UNAVAILABLE: _ClassVar[Status]
    CANCELLED: _ClassVar[Status]
    BATCH_TOO_LARGE: _ClassVar[Status]
    NOT_FOUND: _ClassVar[Status]
    INVALID_KEY: _ClassVar[Status]
    PUT_IN_PROGRESS: _ClassVar[Status]
    CHECKSUM_MISMATCH: _ClassVar[Status]
    TOO_LARGE: _ClassVar[Status]
    BUFFER_TOO_SMALL: _ClassVar[Status]
    NOT_PENDING: _ClassVar[Status]
    LEASE_HELD: _ClassVar[Status]
    NO_SPACE: _ClassVar[Status]
    QUOTA_EXCEEDED: _ClassVar[Status]
    OFFLOAD_BEHIND: _ClassVar[Status]
    SEGMENT_NOT_FOUND: _ClassVar[Status]
    INVALID_RANGE: _ClassVar[Status]
    CLUSTER_MISMATCH: _ClassVar[Status]
    PROTOCOL_ERROR: _ClassVar[Status]
    TRANSFER_FAILED: _ClassVar[Status]
    NO_REPLICA: _ClassVar[Status]
    SEGMENT_DRAINED: _ClassVar[Status]
    LEASE_EXPIRED: _ClassVar[Status]
    UNAUTHENTICATED: _ClassVar[Status]
    PERMISSION_DENIED: _ClassVar[Status]
    CAPABILITY_DENIED: _ClassVar[Status]
    TOO_MANY_CONNECTIONS: _ClassVar[Status]
OK: Status
INTERNAL: Status
INVALID_ARGUMENT: Status
TIMEOUT: Status
UNAVAILABLE: Status
CANCELLED: Status
BATCH_TOO_LARGE: Status
NOT_FOUND: Status
INVALID_KEY: Status
PUT_IN_PROGRESS: Status
CHECKSUM_MISMATCH: Status
TOO_LARGE: Status
BUFFER_TOO_SMALL: Status
NOT_PENDING: Status
LEASE_HELD: Status
NO_SPACE: Status
QUOTA_EXCEEDED: Status
OFFLOAD_BEHIND: Status
SEGMENT_NOT_FOUND: Status
INVALID_RANGE: Status
CLUSTER_MISMATCH: Status
PROTOCOL_ERROR: Status
TRANSFER_FAILED: Status
NO_REPLICA: Status
SEGMENT_DRAINED: Status
LEASE_EXPIRED: Status
UNAUTHENTICATED: Status
PERMISSION_DENIED: Status
CAPABILITY_DENIED: Status
TOO_MANY_CONNECTIONS: Status
