"""The client side of the transport registry: one connector class per URL scheme.

A segment advertises one endpoint URL per transport it serves. The client
picks, per segment, the first scheme in `PREFERENCE` that both sides have;
`KVTIER_TRANSPORT=tcp` (or `ClientConfig.transport`) forces one scheme.
Optional transports register only when their imports succeed; otherwise they
are listed in `UNAVAILABLE` with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.client.config import ClientConfig
from kvtier.client.transport.base import Connector
from kvtier.client.transport.tcp import TcpConnector
from kvtier.proto.errors import ConnectError

CONNECTORS: dict[str, type] = {"tcp": TcpConnector}
UNAVAILABLE: dict[str, str] = {"rdma": "no RDMA connector yet (pyverbs transport is not implemented)"}
PREFERENCE = ("rdma", "shm", "tcp")


def choose_endpoint(endpoints: Sequence[str], forced: str = "") -> tuple[str, str]:
    """(scheme, endpoint) to use for a segment; ConnectError when none is usable."""
    by_scheme = {url.split("://", 1)[0]: url for url in endpoints}
    if forced:
        if forced not in CONNECTORS:
            raise ConnectError(f"transport {forced!r} is not available: {UNAVAILABLE.get(forced, 'unknown scheme')}")
        if forced not in by_scheme:
            raise ConnectError(f"segment does not serve transport {forced!r} (it serves {sorted(by_scheme)})")
        return forced, by_scheme[forced]
    for scheme in PREFERENCE:
        if scheme in by_scheme and scheme in CONNECTORS:
            return scheme, by_scheme[scheme]
    raise ConnectError(f"no usable transport among {list(endpoints)}")


def open_connector(scheme: str, endpoint: str, config: ClientConfig) -> Connector:
    return CONNECTORS[scheme](endpoint, config)
