"""Runs a segment server: region, listeners, master link, clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from kvtier.proto import master_pb2 as pb
from kvtier.proto.config import write_ready_file
from kvtier.proto.region import host_id
from kvtier.segment_server.config import SegmentConfig
from kvtier.segment_server.listeners import ShmListener, TcpListener
from kvtier.segment_server.master_link import MasterLink
from kvtier.segment_server.protocol import DataPlaneStats
from kvtier.segment_server.region import DramRegion, region_path, remove_orphans

logger = logging.getLogger(__name__)


async def serve(config: SegmentConfig) -> int:
    """Serve until SIGINT/SIGTERM; return the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[tuple[str, int]] = []  # (why, exit code) when the master will not have us
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    orphans = remove_orphans(config.shm_dir, config.cluster_id)
    if orphans:
        logger.warning("removed orphaned region files count=%d", orphans)
    region = DramRegion(
        region_path(config.shm_dir, config.cluster_id, config.name), config.dram_bytes, config.cluster_id, config.name
    ).open()
    stats = DataPlaneStats()
    listeners = [TcpListener(config.listen, region.view, stats), ShmListener(region.path, host_id(), region.nonce)]
    link = None
    try:
        endpoints = [await listener.start() for listener in listeners]
        mounted = asyncio.Event()

        def on_fatal(message: str, exit_code: int) -> None:
            fatal.append((message, exit_code))
            loop.call_soon_threadsafe(stop.set)

        link = MasterLink(
            config.master,
            pb.MountSegmentRequest(
                cluster_id=config.cluster_id,
                name=config.name,
                host_id=host_id(),
                endpoints=endpoints,
                dram_capacity=region.capacity,
                incarnation=region.nonce.hex(),
            ),
            on_mounted=lambda _id: loop.call_soon_threadsafe(mounted.set),
            on_fatal=on_fatal,
        )
        link.start()
        print(f"kvtier-segment {config.name} serving {', '.join(endpoints)} dram={region.capacity}", flush=True)
        waiter = asyncio.create_task(mounted.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if mounted.is_set() and config.ready_file:
            write_ready_file(
                config.ready_file,
                {"name": config.name, "endpoints": endpoints, "region": region.path, "pid": os.getpid()},
            )
        await stopper
        waiter.cancel()
    finally:
        logger.info("segment server stopping name=%s", config.name)
        if link is not None:
            link.stop(unmount=not fatal)
        for listener in listeners:
            await listener.stop()
        region.close()
    if fatal:
        message, exit_code = fatal[0]
        (logger.info if exit_code == 0 else logger.error)("segment server exiting: %s", message)
        return exit_code
    return 0
