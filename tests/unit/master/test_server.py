"""The master server's gRPC limits and plumbing, without a server: options from the config, the
open-file limit, and the interceptor that answers undecodable requests INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass

import grpc
import pytest

from kvtier.master import server
from kvtier.master.config import MasterConfig
from kvtier.proto import master_pb2 as pb


def test_grpc_options_come_from_the_config():
    config = MasterConfig(
        max_message_size="1MiB", max_concurrent_streams=7, idle_timeout_s=2.5, max_buffered_size="1MiB"
    ).validate()
    options = dict(server.grpc_options(config))
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.keepalive_time_ms"] > 0 and options["grpc.keepalive_timeout_ms"] > 0
    assert options["grpc.so_reuseport"] == 0
    limits = server.fast_path_limits(config)
    assert (limits.max_message_bytes, limits.max_buffered_bytes, limits.idle_timeout_s) == (1 << 20, 1 << 20, 2.5)


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        (1024, 65536, 4096 + server.FD_RESERVE),  # raised to what max_connections needs
        (1024, 2048, 2048),  # as far as the hard limit allows (and a warning)
        (100_000, 200_000, None),  # already enough: untouched
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, None),
        (1024, resource.RLIM_INFINITY, 4096 + server.FD_RESERVE),
    ],
)
def test_the_open_file_limit_covers_max_connections(monkeypatch, soft, hard, expected):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda _which, limits: calls.append(limits))
    server.raise_fd_limit(MasterConfig())
    assert calls == ([] if expected is None else [(expected, hard)])


@dataclass
class Details:  # grpc.HandlerCallDetails is a protocol
    method: str
    invocation_metadata: tuple = ()


class Context:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # grpc.aio raises too: the behavior never runs on


def test_an_undecodable_request_is_invalid_argument_naming_the_method_and_a_decodable_one_passes():
    seen = []

    async def behavior(request, context):
        seen.append(request)
        return pb.ExistsResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        behavior,
        request_deserializer=pb.KeysRequest.FromString,
        response_serializer=pb.ExistsResponse.SerializeToString,
    )

    async def continuation(details):
        return handler

    details = Details("/kvtier.v1.Master/Exists")

    async def main() -> None:
        check = server.DecodeCheck()
        checked = await check.intercept_service(continuation, details)
        assert checked.request_deserializer is None
        assert await check.intercept_service(continuation, details) is checked, "one wrapper per method"
        context = Context()
        with pytest.raises(RuntimeError, match="aborted"):
            await checked.unary_unary(b"\x0a\x05ab", context)
        assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "undecodable request for /kvtier.v1.Master/Exists")
        assert not seen
        await checked.unary_unary(pb.KeysRequest(namespace="ns").SerializeToString(), Context())
        assert seen == [pb.KeysRequest(namespace="ns")]

    asyncio.run(main())


def test_unknown_methods_stay_unimplemented():
    async def continuation(details):
        return None

    details = Details("/kvtier.v1.Master/Nope")
    assert asyncio.run(server.DecodeCheck().intercept_service(continuation, details)) is None
