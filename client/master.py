"""The client's link to the master: a synchronous gRPC stub with retry.

`call` retries UNAVAILABLE (master restarting, connection refused) with
exponential back-off from 50 ms to 1 s until the caller's deadline, then maps
the gRPC error to a `KvtierError`. Thread-safe: a gRPC channel may be shared.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
from kvtier.proto import master_pb2_grpc
from kvtier.proto.errors import ConnectError, KvtierError
from kvtier.proto.status import Status, to_status

logger = logging.getLogger(__name__)

GRPC_MESSAGE_LIMIT = 256 << 20
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


class MasterClient:
    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
                ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
            ],
        )
        self.stub = master_pb2_grpc.MasterStub(self._channel)

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Invoke `method`, retrying while the master is unavailable; raise KvtierError on failure.

        A response whose whole-request `status` is not OK raises KvtierError with it.
        """
        deadline = time.monotonic() + (timeout or self.timeout)
        backoff = 0.05
        rpc = getattr(self.stub, method)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KvtierError(Status.TIMEOUT, f"{method}: master {self.address} did not answer in time")
            try:
                reply = rpc(request, timeout=remaining)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in _RETRYABLE and deadline - time.monotonic() > backoff:
                    logger.debug("master unavailable method=%s; retrying in %.2fs", method, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise KvtierError(Status.TIMEOUT, f"{method}: master {self.address} timed out") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise ConnectError(f"{method}: master {self.address} unavailable: {exc.details()}") from None
                raise KvtierError(Status.INTERNAL, f"{method}: {code.name}: {exc.details()}") from None
            status = getattr(reply, "status", 0)
            if status:
                raise KvtierError(to_status(status), f"{method}: {reply.error}")
            return reply

    def close(self) -> None:
        self._channel.close()
