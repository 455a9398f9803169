"""The segment side of the transport registry: one listener class per scheme.

A listener serves the region over one transport and returns the endpoint URL
it advertises to the master (`tcp://host:port`). The client side of each
scheme lives in `kvtier.client.transport`. Optional transports are imported
under try/except and listed in `UNAVAILABLE` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Protocol
from urllib.parse import quote, urlencode

from kvtier.common.framed_listener import serve
from kvtier.common.units import parse_hostport
from kvtier.segment_server.commit_relay import CommitRelay
from kvtier.segment_server.data_plane_stats import ConnectionLimits, Connections, DataPlaneStats
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.keyed_reads import KeyedReads
from kvtier.segment_server.master_clock import MasterClock
from kvtier.segment_server.mount_session import CapabilityCheck, MountSession
from kvtier.segment_server.protocol import DataProtocol
from kvtier.segment_server.shm_grant import MAX_CONNECTIONS, TIMEOUT_S, GrantServer, GrantStats, reopen
from kvtier.segment_server.shm_writers import WriterTable

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
        limits: ConnectionLimits | None = None,
        caps: CapabilityCheck | None = None,
        clock: MasterClock | None = None,
        relay: CommitRelay | None = None,
        keyed: KeyedReads | None = None,
        mount: MountSession | None = None,
    ) -> None:
        self._host, self._port = parse_hostport(listen)
        self._mount = mount
        self._caps = caps
        self._clock = clock
        self._relay = relay
        self._keyed = keyed
        self._connections = Connections(limits or ConnectionLimits(), stats)
        self._advertise = advertise  # the host put in the endpoint URL (default: the bound one)
        self._region = region
        self._stats = stats
        self._disk = disk  # serves READ_DISK when the segment has an SSD tier
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server, endpoint = await serve(
            (self._host, self._port),
            lambda: DataProtocol(
                self._region,
                self._stats,
                self._disk,
                self._connections,
                self._caps,
                self._clock,
                self._relay,
                self._keyed,
                self._mount,
            ),
            self._connections,
            self._advertise,
        )
        logger.info("listening endpoint=%s", endpoint)
        return endpoint

    def mount_ended(self) -> None:
        """The segment's mount ended: READ responses of it still queued are cut (event loop)."""
        self._connections.mount_ended()

    async def stop(self) -> None:
        self._connections.stop()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass  # open client connections die with the process


class ShmListener:
    """Grants the region to same-host clients of allowed uids, who map it and copy directly.

    Serves the grant socket (kvtier.segment_server.shm_grant) and advertises
    `shm://<socket path>?host=<host id>&nonce=<hex>&uid=<service uid>`: a client
    checks the host id before connecting, the server's uid on the socket and the
    fd, and the nonce in the mapped header (kvtier.client.transport.shm).
    Allowed: this process's uid and `allowed_uids`. `region_fd` is reopened
    (a second open file description, without the region's lock) and that one
    is what clients receive; it is closed at stop. With `writers`, each granted
    client holds a block of its writer slots while it maps the region.
    """

    scheme = "shm"

    def __init__(
        self,
        socket_path: str,
        region_fd: int,
        host_id: str,
        nonce: bytes,
        allowed_uids: frozenset[int] = frozenset(),
        stats: GrantStats | None = None,
        *,
        timeout_s: float = TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        writers: WriterTable | None = None,
    ) -> None:
        self.socket_path = socket_path
        self._writers = writers
        self.stats = stats if stats is not None else GrantStats()
        self._region_fd = region_fd
        self._nonce = nonce
        self._allowed = frozenset({os.geteuid(), *allowed_uids})
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        query = urlencode({"host": host_id, "nonce": nonce.hex(), "uid": os.geteuid()})
        self._endpoint = f"shm://{quote(socket_path)}?{query}"
        self._fd = -1
        self._server: GrantServer | None = None

    async def start(self) -> str:
        self._fd = reopen(self._region_fd)
        server = GrantServer(
            self.socket_path,
            self._fd,
            self._nonce,
            self._allowed,
            self.stats,
            timeout_s=self._timeout_s,
            max_connections=self._max_connections,
            writers=self._writers,
        )
        try:
            await server.start()
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self._server = server
        logger.info("listening endpoint=%s", self._endpoint)
        return self._endpoint

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


LISTENERS: dict[str, type] = {"tcp": TcpListener, "shm": ShmListener}
UNAVAILABLE: dict[str, str] = {"rdma": "no RDMA listener yet (pyverbs transport is not implemented)"}
