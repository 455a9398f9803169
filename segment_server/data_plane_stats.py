"""What the data plane counts, what one client connection may hold, and the live connections
(kvtier.segment_server.protocol's DataProtocol is one).

Shared by every connection of one segment server (its event loop's thread); read by the
metrics (kvtier.segment_server.metrics) and the disk reads (kvtier.segment_server.disk_reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.common.framed_listener import ConnectionSet
from kvtier.common.latency import LatencyHistogram


@dataclass(slots=True)
class DataPlaneStats:
    """Counters shared by every connection of one segment server (single thread)."""

    connections: int = 0
    requests: int = 0
    bytes_written: int = 0  # payload bytes received into the region
    bytes_read: int = 0  # payload bytes queued to clients from the region (the DRAM tier)
    # object bytes queued to clients from the SSD tier, of records whose header checked out (the
    # payload's checksum is the client's to verify: its served_* counters count verified objects only)
    ssd_bytes_served: int = 0
    ssd_bytes_read: int = 0  # bytes this server's disk reads returned (records, headers, padding)
    ssd_read_errors: int = 0  # READ_DISK ranges answered with an error status
    range_errors: int = 0
    protocol_errors: int = 0
    capability_denials: int = 0  # requests without valid capabilities (CAPABILITY_DENIED)
    refused_connections: int = 0  # over max_connections
    timed_out_connections: int = 0  # idle, or a request (or its response) stalled past the limit
    # READ/WRITE frames cut because their grant ended while they were served, by op name.
    frames_cut: dict[str, int] = field(default_factory=lambda: {"READ": 0, "WRITE": 0})
    # Data-path latency per op name, header received -> response queued (WRITE: all bytes in
    # the region; READ_DISK: the last record queued). Completed requests only.
    latency: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {
            op: LatencyHistogram() for op in ("READ", "WRITE", "READ_DISK", "COMMIT", "READ_KEYED")
        }
    )
    commits_refused: int = 0  # COMMIT frames not right behind a completed WRITE, or undecodable


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client connection may hold (kvtier.segment_server.config)."""

    max_connections: int = 4096
    idle_timeout_s: float = 600.0  # between requests
    request_timeout_s: float = 60.0  # from a request's first byte to its response handed to the kernel


class Connections(ConnectionSet["DataProtocol"]):
    """The live connections of one listener, their limit, and a sweep that closes stalled ones
    (kvtier.common.framed_listener).

    A sweep every second (one timer per listener, none per connection) aborts a
    connection idle past `idle_timeout_s`, one whose request has been arriving
    for longer than `request_timeout_s` (a slow sender holds no more than that),
    and one whose responses the peer has not read for as long (backpressure
    keeps what is queued bounded; this bounds how long).
    """

    def __init__(self, limits: ConnectionLimits, stats: DataPlaneStats) -> None:
        super().__init__(limits, stats)

    def mount_ended(self) -> None:
        """The segment's mount ended (kvtier.segment_server.mount_session): cut the READ responses of
        that mount still queued (a WRITE in progress stops at its next receive by itself)."""
        for connection in list(self.live):
            connection.cut_reads_of_ended_mounts()
