"""The client side of the transport registry: one connector class per URL scheme.

A segment advertises one endpoint URL per transport it serves. The client
connects, per segment, with the first scheme in `PREFERENCE` that both sides
have and that accepts (the `shm` connector refuses a region on another host);
`KVTIER_TRANSPORT=tcp` (or `ClientConfig.transport`) forces one scheme.
Optional transports register only when their imports succeed; otherwise they
are listed in `UNAVAILABLE` with the reason.

Reads of a segment's SSD tier go through the registry too (`connect_disk`):
the first scheme in `PREFERENCE` whose connector `reads_disk` (tcp today; the
segment server reads its own files). A forced transport that cannot read
disk (`shm`) does not apply to them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.client.config import ClientConfig
from kvtier.client.transport.base import Connector, DiskConnector
from kvtier.client.transport.shm import ShmConnector
from kvtier.client.transport.tcp import TcpConnector
from kvtier.proto.errors import ConnectError

logger = logging.getLogger(__name__)

CONNECTORS: dict[str, type] = {"shm": ShmConnector, "tcp": TcpConnector}
# The schemes whose connectors read a segment's SSD tier (`reads_disk`), by preference.
DISK_CONNECTORS: dict[str, type] = {scheme: cls for scheme, cls in CONNECTORS.items() if cls.reads_disk}
UNAVAILABLE: dict[str, str] = {"rdma": "no RDMA connector yet (pyverbs transport is not implemented)"}
PREFERENCE = ("rdma", "shm", "tcp")


def check_transport(forced: str) -> None:
    """Raise ValueError unless `forced` is empty or a transport this client has."""
    if forced and forced not in CONNECTORS:
        reason = UNAVAILABLE.get(forced, f"unknown transport; known: {sorted(CONNECTORS)}")
        raise ValueError(f"transport {forced!r} cannot be used: {reason}")


def connect(endpoints: Sequence[str], config: ClientConfig) -> Connector:
    """A connector for a segment serving `endpoints`; ConnectError when none is usable."""
    by_scheme = {url.split("://", 1)[0]: url for url in endpoints}
    forced = config.transport
    if forced:
        if forced not in CONNECTORS:
            reason = UNAVAILABLE.get(forced, "unknown scheme")
            raise ConnectError(f"transport {forced!r} is not available: {reason}")
        if forced not in by_scheme:
            raise ConnectError(f"segment does not serve transport {forced!r} (it serves {sorted(by_scheme)})")
        return CONNECTORS[forced](by_scheme[forced], config)
    reasons = []
    for scheme in PREFERENCE:
        if scheme in by_scheme and scheme in CONNECTORS:
            try:
                return CONNECTORS[scheme](by_scheme[scheme], config)
            except ConnectError as exc:
                logger.debug("transport %s not usable: %s", scheme, exc.message)
                reasons.append(f"{scheme}: {exc.message}")
    raise ConnectError(f"no usable transport among {list(endpoints)} ({'; '.join(reasons)})")


def connect_disk(endpoints: Sequence[str], config: ClientConfig, segment: str = "") -> DiskConnector:
    """A connector that reads `segment`'s SSD tier; ConnectError when it serves none of them.

    The forced transport (`config.transport`) is used when it reads disk; otherwise (shm, which maps
    the region and cannot read the segment's files) the first in `PREFERENCE` that does."""
    by_scheme = {url.split("://", 1)[0]: url for url in endpoints}
    forced = config.transport
    schemes = (forced,) + PREFERENCE if forced in DISK_CONNECTORS else PREFERENCE
    for scheme in schemes:
        if scheme in by_scheme and scheme in DISK_CONNECTORS:
            return DISK_CONNECTORS[scheme](by_scheme[scheme], config)
    wanted = " or ".join(s.upper() for s in PREFERENCE if s in DISK_CONNECTORS)
    raise ConnectError(f"segment {segment} serves no {wanted} endpoint for its SSD tier")
