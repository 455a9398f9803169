"""Verified ranged reads (issue 21): `get_ranges` and `get_into_ranges`, a mixin of `Client`.

What a ranged read returns is verified, as every kvtier read is:
- An object larger than one chunk (kvtier.proto.chunks, 64 KiB) whose put recorded chunk CRCs,
  read from a DRAM copy: only the chunks covering the ranges cross the wire (a READ with
  windows, kvtier.proto.frames FLAG_WINDOW, under the object's own grant), each chunk is checked
  against its CRC, then the ranges are sliced out of them.
- Otherwise (one chunk or less, put before chunk CRCs existed or by a master that lost them, or a
  copy on the SSD tier): the whole object is read, checked against its whole checksum (the
  segment also checks a disk record before sending it), and sliced.
A copy that fails either check is never used: it is reported like any corrupt read (the master
drops it) and the next replica is tried; with none left the call is a miss (CHECKSUM_MISMATCH),
even when the damaged chunk lies outside the ranges asked for (it was not read) - a chunk the
call read and found damaged fails the whole call, never only the ranges it covers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import crc32c

from kvtier.client.tracing import traced
from kvtier.client.transport.shm import local_host_id
from kvtier.proto import master_pb2 as pb
from kvtier.proto.chunks import CHUNK_BYTES, blob_fits, covering, unpack_crcs
from kvtier.proto.errors import KvtierError, TransportError
from kvtier.proto.keys import check_key
from kvtier.proto.status import Status, status_name

if TYPE_CHECKING:
    from kvtier.client.client import Client

logger = logging.getLogger(__name__)

_OK = 0
_MISMATCH = int(Status.CHECKSUM_MISMATCH)
_TIERS = {pb.DRAM: "dram", pb.SSD: "ssd"}


# The buffers a ranged read fills, or (get_ranges) what allocates them once the object's size is known.
Views = list[memoryview] | Callable[[], list[memoryview]]


def check_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) pairs of non-negative ints; ValueError otherwise (before anything is sent)."""
    out = []
    for r in ranges:
        offset, length = r
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise ValueError(f"a range is (offset, length) of non-negative ints, got {r!r}")
        out.append((offset, length))
    return out


class RangedReads:
    """`Client.get_ranges` and `Client.get_into_ranges` (the module docstring says what they verify)."""

    @traced
    def get_ranges(self: Client, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes of each (offset, length) range of `key`'s object, or None on a miss (absent,
        unreachable, or failing verification). Raises KvtierError(INVALID_ARGUMENT) when a range
        ends past the object, ValueError for a malformed range."""
        spans = check_ranges(ranges)
        buffers: list[bytearray] = []

        def allocate() -> list[memoryview]:  # once the ranges are known to lie inside the object
            buffers[:] = [bytearray(length) for _, length in spans]
            return [memoryview(b) for b in buffers]

        result, message = self._read_ranges(key, spans, allocate)
        if result == Status.INVALID_ARGUMENT:
            raise KvtierError(Status.INVALID_ARGUMENT, message)
        return [bytes(b) for b in buffers] if result >= 0 else None

    @traced
    def get_into_ranges(self: Client, key: str, ranges: Sequence[tuple[int, int]], buffers: Sequence[Any]) -> int:
        """Read each (offset, length) range of `key`'s object into the writable buffer of the same
        position (its first `length` bytes): the bytes written in all, or a negative Status
        (NOT_FOUND, CHECKSUM_MISMATCH, INVALID_ARGUMENT when a range ends past the object,
        BUFFER_TOO_SMALL, ...). On a negative result the buffers' contents are unspecified."""
        from kvtier.client.client import as_writable_view

        spans = check_ranges(ranges)
        if len(spans) != len(buffers):
            raise ValueError(f"{len(spans)} ranges but {len(buffers)} buffers")
        views = [as_writable_view(b) for b in buffers]
        if any(len(v) < length for v, (_, length) in zip(views, spans, strict=True)):
            return int(Status.BUFFER_TOO_SMALL)
        return self._read_ranges(key, spans, [v[:length] for v, (_, length) in zip(views, spans, strict=True)])[0]

    def _read_ranges(self: Client, key: str, spans: list[tuple[int, int]], views: Views) -> tuple[int, str]:
        """(bytes written in all, "") or (negative status, why). A copy refused LEASE_EXPIRED (its grant
        ended, or belongs to a mount its segment has left) is read once more after a fresh lookup, as
        kvtier.client.reads does, while a tenth of the timeout is left."""
        from kvtier.client.reads import RETRY_MIN_LEFT

        started = time.monotonic()
        status, message = self._read_ranges_once(key, spans, views)
        if status == Status.LEASE_EXPIRED and time.monotonic() - started < self.config.timeout * (1 - RETRY_MIN_LEFT):
            self._count(read_retries=1)
            status, message = self._read_ranges_once(key, spans, views)
        self._count(ranged_gets=1, ranged_hits=int(status >= 0), ranged_misses=int(status < 0))
        return status, message

    def _read_ranges_once(self: Client, key: str, spans: list[tuple[int, int]], views: Views) -> tuple[int, str]:
        from kvtier.client.reads import LEASE_SAFETY

        key = check_key(key)
        requested_at = time.monotonic()
        request = pb.KeysRequest(
            namespace=self.namespace,
            keys=[key],
            releasable=True,
            released_leases=self._done_leases.take(),
            with_chunk_checksums=True,
        )
        try:
            reply = self._master.call("GetReplicas", request)
        except KvtierError as exc:
            logger.warning("GetReplicas failed, ranged read of %.80s is a miss: %s", key, exc)
            self._count(master_failures=1)
            return int(exc.status), exc.message
        lease_deadline = requested_at + reply.lease_ms / 1000 * LEASE_SAFETY
        try:
            status, message = self._ranges_of(key, reply, spans, views, lease_deadline)
        finally:
            self._done_leases.add(reply.lease_id)  # every transfer of this lease is over
            self._report_failures()
        return status, message

    def _ranges_of(
        self: Client,
        key: str,
        reply: pb.GetReplicasResponse,
        spans: list[tuple[int, int]],
        views: Views,
        lease_deadline: float,
    ) -> tuple[int, str]:
        status = reply.statuses[0]
        if status != _OK:
            return status, status_name(status)
        size = reply.sizes[0]
        for offset, length in spans:
            if offset + length > size:
                return int(Status.INVALID_ARGUMENT), (
                    f"range offset={offset} length={length} ends past {key!r:.80}'s {size} bytes"
                )
        if callable(views):  # get_ranges allocates only what an existing object can fill
            views = views()
        if not any(length for _, length in spans):
            return 0, ""  # nothing to return, so nothing to read or verify
        blob = reply.chunk_checksums[0] if reply.chunk_checksums else b""
        chunked = blob_fits(blob, size)
        segments = {s.segment_id: s for s in reply.segments}
        failed = self._failures.recently_failed()
        host = local_host_id()

        def order(j: int) -> tuple[bool, bool, bool]:
            # As batch_get: copies on segments that just failed this client or are quarantined last,
            # DRAM before SSD, same-host copies first.
            segment = segments.get(reply.replica_segments[j])
            if segment is None:
                return True, True, True
            shunned = segment.quarantined or segment.name in failed
            return shunned, reply.replica_tiers[j] != pb.DRAM, segment.host_id != host

        positions = sorted(range(reply.replica_counts[0]), key=order)
        corrupt: list[tuple[int, int]] = []
        status, message = int(Status.NOT_FOUND), "no replica"
        try:
            for position in positions:
                segment = segments.get(reply.replica_segments[position])
                tier = reply.replica_tiers[position]
                if segment is None:
                    status, message = int(Status.SEGMENT_NOT_FOUND), "segment unknown"
                    continue
                if chunked and tier == pb.DRAM:
                    status, message = self._read_chunks(segment, reply, position, blob, spans, views, lease_deadline)
                else:
                    status, message = self._read_whole(key, segment, reply, position, spans, views, lease_deadline)
                if status == _MISMATCH:
                    corrupt.append((0, position))
                    self._count(checksum_mismatches=1)
                    logger.warning(
                        "checksum mismatch namespace=%s key=%.80s segment=%s (ranged read): treated as a miss",
                        self.namespace,
                        key,
                        segment.name,
                    )
                if status >= 0:
                    return status, ""
        finally:
            if corrupt:
                self._report_corrupt([key], reply, corrupt)
        return status, message

    def _read_chunks(
        self: Client,
        segment: pb.SegmentEndpoint,
        reply: pb.GetReplicasResponse,
        position: int,
        blob: bytes,
        spans: list[tuple[int, int]],
        views: list[memoryview],
        lease_deadline: float,
    ) -> tuple[int, str]:
        """Read only the chunks covering `spans` from a DRAM copy, verify each, slice."""
        from kvtier.client.reads import _caps

        size = reply.sizes[0]
        runs = [(first * CHUNK_BYTES, min(size, end * CHUNK_BYTES)) for first, end in covering(spans)]
        buffers = [bytearray(end - start) for start, end in runs]
        windows = [(start, memoryview(buf)) for (start, _), buf in zip(runs, buffers, strict=True)]
        caps = _caps(reply.replica_tags, reply.tag_expiry_ms, [position], segment.session)
        try:
            connector = self._connector(segment)
            results = connector.read_windows((reply.replica_offsets[position], size), windows, caps)
        except TransportError as exc:
            logger.warning("read from segment %s failed: %s", segment.name, exc)
            self._transport_failed(segment.name, exc)
            return int(exc.status), exc.message
        if bad := next((r for r in results if r != _OK), None):
            return bad, f"segment {segment.name}: {status_name(bad)}"
        if time.monotonic() > lease_deadline:  # the bytes may have been reused after the lease
            return int(Status.LEASE_EXPIRED), "the read lease ended during the transfer"
        read = sum(len(b) for b in buffers)
        self._count(bytes_read=read, bytes_read_dram=read, ranged_bytes_read=read)
        crcs = unpack_crcs(blob)
        for (start, end), buf in zip(runs, buffers, strict=True):
            view = memoryview(buf)
            for lo in range(0, end - start, CHUNK_BYTES):
                if crc32c.crc32c(view[lo : lo + CHUNK_BYTES]) != crcs[(start + lo) // CHUNK_BYTES]:
                    return _MISMATCH, f"chunk {(start + lo) // CHUNK_BYTES} of the copy on {segment.name}"
        written = 0
        for (offset, length), out in zip(spans, views, strict=True):
            if not length:
                continue
            start, buf = next((s, b) for (s, e), b in zip(runs, buffers, strict=True) if s <= offset < e)
            out[:length] = buf[offset - start : offset - start + length]
            written += length
        self._count(
            ranged_bytes_verified=read,
            ranged_bytes_returned=written,
            **{f"served_dram_{connector.scheme}": 1, f"served_bytes_dram_{connector.scheme}": read},
        )
        return written, ""

    def _read_whole(
        self: Client,
        key: str,
        segment: pb.SegmentEndpoint,
        reply: pb.GetReplicasResponse,
        position: int,
        spans: list[tuple[int, int]],
        views: list[memoryview],
        lease_deadline: float,
    ) -> tuple[int, str]:
        """Read the whole copy (DRAM or SSD), verify its checksum, slice."""
        size = reply.sizes[0]
        whole = memoryview(bytearray(size))
        tier = reply.replica_tiers[position]
        deadline = time.monotonic() + self.config.timeout  # bounds this attempt's socket waits (client/reads.py)
        results, crcs, path = self._read_segment(
            segment, reply, {0: [position]}, [0], 0, [whole], tier, [key], deadline
        )
        if (result := results[0]) != _OK:
            return int(result), f"segment {segment.name}: read failed"
        if time.monotonic() > lease_deadline:
            return int(Status.LEASE_EXPIRED), "the read lease ended during the transfer"
        tier_name = _TIERS.get(tier, "unknown")
        self._count(bytes_read=size, **{f"bytes_read_{tier_name}": size}, ranged_bytes_read=size)
        if (crcs[0] if crcs[0] is not None else crc32c.crc32c(whole)) != reply.checksums[0]:
            return _MISMATCH, f"the copy on {segment.name}"
        written = 0
        for (offset, length), out in zip(spans, views, strict=True):
            out[:length] = whole[offset : offset + length]
            written += length
        self._count(
            ranged_bytes_verified=size,
            ranged_bytes_returned=written,
            **{f"served_{tier_name}_{path}": 1, f"served_bytes_{tier_name}_{path}": size},
        )
        return written, ""
