"""The exception hierarchy shared by every kvtier component.

Socket and gRPC errors are mapped to these at the boundary where they occur,
so callers match on classes and `Status` values, never on message strings.

    KvtierError(status)              any failure that carries a Status
      InvalidKeyError                INVALID_KEY: fix the key, do not retry
      TransportError                 data plane or master connection trouble
        ConnectError                 could not connect (retryable)
        ReadError                    connection failed mid-transfer (retryable)
        ProtocolError                peer sent a malformed frame (fatal: not retried)
"""

from __future__ import annotations

from kvtier.proto.status import Status


class KvtierError(Exception):
    """A failed kvtier operation; `status` says which kind of failure."""

    retryable = False
    request_id = ""  # of the client call that failed (kvtier.common.logs): find it in server logs

    def __init__(self, status: Status, message: str = "") -> None:
        self.status = Status(status)
        self.message = message or self.status.name
        super().__init__(f"{self.status.name}: {self.message}")

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} (request_id={self.request_id})" if self.request_id else text


class InvalidKeyError(KvtierError, ValueError):
    """A key or namespace is not acceptable; retrying cannot help."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.INVALID_KEY, message)


class TransportError(KvtierError):
    """A connection to a master or segment server failed."""

    retryable = True

    def __init__(self, message: str, status: Status = Status.TRANSFER_FAILED) -> None:
        super().__init__(status, message)


class ConnectError(TransportError):
    """No connection could be established."""

    def __init__(self, message: str) -> None:
        super().__init__(message, Status.UNAVAILABLE)


class ReadError(TransportError):
    """The connection broke or timed out during a transfer."""


class ProtocolError(TransportError):
    """The peer violated the frame protocol; the connection is unusable."""

    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message, Status.PROTOCOL_ERROR)
