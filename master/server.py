"""Runs the master: a grpc.aio server on uvloop plus the periodic tick task."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid

import grpc

from kvtier.master.config import MasterConfig
from kvtier.master.fastpath import start_fast_path
from kvtier.master.servicer import MasterHandlers, MasterServicer
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2_grpc
from kvtier.proto.config import write_ready_file
from kvtier.proto.rpcframe import MESSAGE_LIMIT

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.so_reuseport", 0),  # a second master on the same port must fail, not share it
]


async def serve(config: MasterConfig, stop: asyncio.Event | None = None) -> None:
    state = MasterState(config)
    epoch = uuid.uuid4().hex[:16]
    handlers = MasterHandlers(state, epoch)
    servicer = MasterServicer(handlers)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise SystemExit(f"kvtier-master: cannot bind {config.listen}")
    host = config.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    await server.start()
    fast_server = None
    if config.fast_listen != "off":
        fast_listen = f"{host}:0" if config.fast_listen == "auto" else config.fast_listen
        try:
            fast_server = await start_fast_path(fast_listen, handlers)
        except OSError as exc:
            await server.stop(grace=None)
            raise SystemExit(f"kvtier-master: cannot bind fast path {fast_listen}: {exc.strerror}") from None
    logger.info("master serving address=%s cluster_id=%s epoch=%s", address, config.cluster_id, epoch)
    fast = f", fast path {handlers.fast_endpoint}" if handlers.fast_endpoint else ""
    print(f"kvtier-master listening on {address}{fast} (cluster {config.cluster_id})", flush=True)
    if config.ready_file:
        write_ready_file(
            config.ready_file,
            {"address": address, "fast_endpoint": handlers.fast_endpoint, "epoch": epoch, "pid": os.getpid()},
        )

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(config.tick_interval_s)
            try:
                state.tick()
            except Exception:  # a bug here must not stop expiry forever
                logger.exception("tick failed")

    tick_task = asyncio.create_task(ticker())
    await stop.wait()
    logger.info("master stopping")
    tick_task.cancel()
    if fast_server is not None:
        fast_server.close()
    await server.stop(grace=1.0)
