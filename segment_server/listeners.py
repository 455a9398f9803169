"""The segment side of the transport registry: one listener class per scheme.

A listener serves the region over one transport and returns the endpoint URL
it advertises to the master (`tcp://host:port`). The client side of each
scheme lives in `kvtier.client.transport`. Optional transports are imported
under try/except and listed in `UNAVAILABLE` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol
from urllib.parse import urlencode

from kvtier.proto.units import parse_hostport
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.protocol import DataPlaneStats, DataProtocol

logger = logging.getLogger(__name__)


class Listener(Protocol):
    scheme: str

    async def start(self) -> str:
        """Start serving; return the endpoint URL to advertise."""

    async def stop(self) -> None: ...


class TcpListener:
    """Framed protocol over TCP on uvloop, bound to exactly the configured address."""

    scheme = "tcp"

    def __init__(
        self,
        listen: str,
        region: memoryview,
        stats: DataPlaneStats,
        disk: DiskReader | None = None,
        advertise: str = "",
    ) -> None:
        self._host, self._port = parse_hostport(listen)
        self._advertise = advertise  # the host put in the endpoint URL (default: the bound one)
        self._region = region
        self._stats = stats
        self._disk = disk  # serves READ_DISK when the segment has an SSD tier
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: DataProtocol(self._region, self._stats, self._disk),
            host=self._host,
            port=self._port,
            reuse_address=True,
            backlog=512,
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        host = self._advertise or host
        endpoint = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        logger.info("listening endpoint=%s", endpoint)
        return endpoint

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass  # open client connections die with the process


class ShmListener:
    """Advertises the region file for same-host clients, who map it and copy directly.

    Nothing is served: the URL carries the path, this host's id and the
    region's nonce, which a client checks against the mapped file's header
    before trusting it (see kvtier.client.transport.shm).
    """

    scheme = "shm"

    def __init__(self, region_path: str, host_id: str, nonce: bytes) -> None:
        self._endpoint = f"shm://{region_path}?{urlencode({'host': host_id, 'nonce': nonce.hex()})}"

    async def start(self) -> str:
        return self._endpoint

    async def stop(self) -> None:
        return None


LISTENERS: dict[str, type] = {"tcp": TcpListener, "shm": ShmListener}
UNAVAILABLE: dict[str, str] = {"rdma": "no RDMA listener yet (pyverbs transport is not implemented)"}
