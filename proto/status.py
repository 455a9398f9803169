"""`Status`: the one error enum of kvtier, as a Python IntEnum.

Built from `status.proto` (the single definition; its comments document each
member), so servers, clients and the wire always agree. `OK` is 0; errors are
negative, grouped in ranges by domain. `GRPC_CODE` maps each status to the gRPC
status code used when a whole RPC fails with it.
"""

from __future__ import annotations

import enum

import grpc

from kvtier.proto import status_pb2

Status = enum.IntEnum(  # type: ignore[misc]
    "Status",
    {v.name: v.number for v in status_pb2.DESCRIPTOR.enum_types_by_name["Status"].values},
    module=__name__,
)
Status.__doc__ = "kvtier result codes: OK = 0, errors negative (see proto/status.proto)."

_GRPC_BY_NAME = {
    "OK": grpc.StatusCode.OK,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "BATCH_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "NOT_DURABLE": grpc.StatusCode.FAILED_PRECONDITION,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "INVALID_KEY": grpc.StatusCode.INVALID_ARGUMENT,
    "PUT_IN_PROGRESS": grpc.StatusCode.ABORTED,
    "CHECKSUM_MISMATCH": grpc.StatusCode.DATA_LOSS,
    "TOO_LARGE": grpc.StatusCode.OUT_OF_RANGE,
    "BUFFER_TOO_SMALL": grpc.StatusCode.OUT_OF_RANGE,
    "NOT_PENDING": grpc.StatusCode.FAILED_PRECONDITION,
    "LEASE_HELD": grpc.StatusCode.FAILED_PRECONDITION,
    "NO_SPACE": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "QUOTA_EXCEEDED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "OFFLOAD_BEHIND": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SEGMENT_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "INVALID_RANGE": grpc.StatusCode.OUT_OF_RANGE,
    "CLUSTER_MISMATCH": grpc.StatusCode.FAILED_PRECONDITION,
    "PROTOCOL_ERROR": grpc.StatusCode.INVALID_ARGUMENT,
    "TRANSFER_FAILED": grpc.StatusCode.UNAVAILABLE,
    "NO_REPLICA": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SEGMENT_DRAINED": grpc.StatusCode.FAILED_PRECONDITION,
    "SEGMENT_NAME_IN_USE": grpc.StatusCode.ALREADY_EXISTS,
    "LEASE_EXPIRED": grpc.StatusCode.ABORTED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "CAPABILITY_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "TOO_MANY_CONNECTIONS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "LAST_REPLICA": grpc.StatusCode.FAILED_PRECONDITION,
    "REPLICA_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "REPLICA_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "WATCH_CUT_SLOW": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "WATCH_MISSED": grpc.StatusCode.OUT_OF_RANGE,
    "WATCH_EPOCH_CHANGED": grpc.StatusCode.FAILED_PRECONDITION,
    "TOO_MANY_WATCHERS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "EVENTS_DISABLED": grpc.StatusCode.FAILED_PRECONDITION,
    "WATCH_CLOSED": grpc.StatusCode.UNAVAILABLE,
}

GRPC_CODE: dict[Status, grpc.StatusCode] = {Status[name]: code for name, code in _GRPC_BY_NAME.items()}


def status_name(value: int) -> str:
    """The name of a wire value for messages; the number itself when unknown (a newer peer)."""
    return Status(value).name if value in Status._value2member_map_ else str(value)


# Wire value -> member, looked up without the enum's call (clients map every key's status of a batch).
_BY_VALUE: dict[int, Status] = {int(s): s for s in Status}


def to_status(value: int) -> Status:
    """Map a wire value to `Status`; unknown values (a newer peer) become INTERNAL."""
    return _BY_VALUE.get(value, Status.INTERNAL)
