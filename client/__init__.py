"""kvtier's thin client: `from kvtier.client import Client, Status`.

Importing this package needs only grpcio, protobuf and crc32c.
"""

from kvtier.client.client import Client
from kvtier.client.events import Event, EventStream, WatchEnded
from kvtier.client.tensors import TensorMismatchError
from kvtier.proto.errors import (
    ConnectError,
    InvalidKeyError,
    KvtierError,
    ProtocolError,
    ReadError,
    TransportError,
)
from kvtier.proto.status import Status

__all__ = [
    "Client",
    "Status",
    "KvtierError",
    "InvalidKeyError",
    "TransportError",
    "ConnectError",
    "ReadError",
    "ProtocolError",
    "TensorMismatchError",
    "Event",
    "EventStream",
    "WatchEnded",
]
