"""Replica operations (issue 21): drop one segment's replica of a key, copy or move one to a segment.

    client.remove_replica("k", "seg0")          # LAST_REPLICA if seg0 holds its only replica
    client.copy_replica("k", "seg2")            # a second, verified replica on seg2
    client.move_replica("k", "seg2", source="seg0")

Segments are named as `kvtier status` shows them. Each call returns a `Status` per key and
raises KvtierError only when the master cannot be asked (UNAVAILABLE, authentication, ...).

Copies and moves use the drain's machinery (kvtier.master.drain): `MigrateStart` with `keys`
gives each key a read lease on a source (a DRAM range, or where the key has no DRAM replica there
a disk copy, read with READ_DISK) and a freshly allocated DRAM target range; this client reads the
source over the data plane, checks its CRC32C against the checksum recorded at
PutEnd, writes the target and reports in `MigrateEnd`. Only verified bytes are reported, and the
master adds the target (a move drops the source once the target's segment acknowledged the copy)
only if the key still names the very object it was copied from: bytes that fail the check come
back as CHECKSUM_MISMATCH with no new replica, a key removed or put again meanwhile as NOT_FOUND,
and their target ranges are released. The
master never moves bytes. `copy_batch` is the one copy routine: `kvtier drain` uses it too.

Statuses per key: OK; NOT_FOUND; PUT_IN_PROGRESS (pending, or a copy/move/drain of it in flight, or
for remove an SSD offload/promotion of it on that segment);
SEGMENT_NOT_FOUND (unknown segment, or the target went away before it acknowledged the copy: a
move leaves the object where it was); INVALID_ARGUMENT (the target is draining); REPLICA_EXISTS
(copy/move: the target holds one already); REPLICA_NOT_FOUND (remove: none on that segment;
copy/move: no replica on the source to read); LAST_REPLICA (remove:
it is the only complete replica, unless `allow_last`, which removes the object); NO_SPACE (no
room on the target; nothing is evicted for a copy); CHECKSUM_MISMATCH (the source's bytes are
damaged); a data-plane status (TRANSFER_FAILED, ...) when the copy could not be done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import crc32c

from kvtier.client.reads import _caps
from kvtier.client.tracing import traced
from kvtier.client.transport.base import Caps
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import KvtierError
from kvtier.proto.keys import check_key, name_prefix_bytes
from kvtier.proto.status import Status, to_status

if TYPE_CHECKING:
    from kvtier.client.client import Client

_OK = 0
# Whole-request refusals answered as every key's status (an operator's typo, not an outage).
_PER_KEY = (Status.SEGMENT_NOT_FOUND, Status.INVALID_ARGUMENT)


def copy_batch(client: Client, start: pb.MigrateStartResponse) -> list[int]:
    """Copy the movable objects of a `MigrateStart` answer over the data plane, verified.

    Per object: OK (the target holds verified bytes: report it moved), the master's refusal
    (NO_SPACE, ...), CHECKSUM_MISMATCH, or the data plane's status for a failed read or write.
    """
    segments = {s.segment_id: s for s in start.segments}
    out = [int(status) for status in start.statuses]
    todo = [i for i, status in enumerate(start.statuses) if status == _OK]
    buffers = {i: bytearray(start.sizes[i]) for i in todo}
    rank = {i: n for n, i in enumerate(todo)}  # capabilities come for the movable objects, in order

    def caps(tags: bytes, indices: list[int], segment: pb.SegmentEndpoint) -> Caps:
        """The migration's grant on `segment` (kvtier.client.reads._caps: its tags by the objects'
        rank among the movable ones, or without a secret only its expiry, and the segment's mount)."""
        return _caps(tags, start.tag_expiry_ms, [rank[i] for i in indices], segment.session)

    def source_of(i: int) -> tuple[int, int]:
        """(segment, tier) of object i's source: a DRAM range, or a disk copy (SSD)."""
        segment = start.source_segments[i] if start.source_segments else start.source_segment
        return segment, start.source_tiers[i] if start.source_tiers else pb.DRAM

    verified = []
    for (source_id, tier), indices in _grouped(todo, source_of).items():
        source = segments.get(source_id)
        if source is None:
            for i in indices:
                out[i] = int(Status.SEGMENT_NOT_FOUND)
            continue
        source_caps = caps(start.source_tags, indices, source)
        if tier == pb.SSD:  # the segment reads, checks and streams its own disk records
            items = [
                (
                    start.source_offsets[i],
                    start.sizes[i],
                    name_prefix_bytes(start.namespaces[i]) + start.keys[i].encode(),
                )
                for i in indices
            ]
            views = [memoryview(buffers[i]) for i in indices]
            reads = client._disk_connector(source).read_disk(items, views, caps=source_caps)
        else:
            reads = client._connector(source).read_into(
                [(start.source_offsets[i], memoryview(buffers[i])) for i in indices], None, caps=source_caps
            )
        for i, status in zip(indices, reads, strict=True):
            if status != _OK:
                out[i] = int(status)
            elif crc32c.crc32c(buffers[i]) != start.checksums[i]:
                out[i] = int(Status.CHECKSUM_MISMATCH)  # never written anywhere: no new replica
            else:
                verified.append(i)
    for target_id, indices in _grouped(verified, lambda i: start.target_segments[i]).items():
        target = segments.get(target_id)
        if target is None:
            for i in indices:
                out[i] = int(Status.SEGMENT_NOT_FOUND)
            continue
        results = client._connector(target).write(
            [(start.target_offsets[i], memoryview(buffers[i])) for i in indices],
            None,
            caps=caps(start.target_tags, indices, target),
        )
        for i, status in zip(indices, results, strict=True):
            out[i] = int(status)
    return out


def _grouped(indices: list[int], key) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(key(i), []).append(i)
    return groups


class ReplicaOps:
    """`remove_replica`, `copy_replica`, `move_replica` and their batch forms; mixed into `Client`."""

    @traced
    def remove_replica(self: Client, key: str, segment: str, *, allow_last: bool = False) -> Status:
        """Drop the replicas (DRAM and SSD) `segment` holds of `key`; see the module docstring."""
        return self.batch_remove_replica([key], segment, allow_last=allow_last)[0]

    @traced
    def batch_remove_replica(
        self: Client, keys: Sequence[str], segment: str, *, allow_last: bool = False
    ) -> list[Status]:
        """`remove_replica` per key, in one request. The freed DRAM ranges wait for read leases."""
        request = pb.RemoveReplicasRequest(
            namespace=self.namespace, keys=[check_key(k) for k in keys], segment=segment, allow_last=allow_last
        )
        try:
            reply = self._master.call("RemoveReplicas", request)
        except KvtierError as exc:
            if exc.status in _PER_KEY:
                return [Status(exc.status)] * len(keys)
            raise
        return [to_status(s) for s in reply.statuses]

    @traced
    def copy_replica(self: Client, key: str, segment: str, *, source: str = "") -> Status:
        """Add a replica of `key` on `segment`, copied from a DRAM replica (on `source`, if named)."""
        return self._migrate_keys([key], segment, source, keep_source=True)[0]

    @traced
    def batch_copy_replica(self: Client, keys: Sequence[str], segment: str, *, source: str = "") -> list[Status]:
        return self._migrate_keys(keys, segment, source, keep_source=True)

    @traced
    def move_replica(self: Client, key: str, segment: str, *, source: str = "") -> Status:
        """Copy a replica of `key` to `segment`, then drop the one it was read from (on `source`, if
        named, else the master's pick of a DRAM replica). The swap is one step on the master: the key
        is readable throughout, from the old replica until the new one replaces it."""
        return self._migrate_keys([key], segment, source, keep_source=False)[0]

    @traced
    def batch_move_replica(self: Client, keys: Sequence[str], segment: str, *, source: str = "") -> list[Status]:
        return self._migrate_keys(keys, segment, source, keep_source=False)

    def _migrate_keys(
        self: Client, keys: Sequence[str], target: str, source: str, *, keep_source: bool
    ) -> list[Status]:
        request = pb.MigrateStartRequest(
            namespace=self.namespace,
            keys=[check_key(k) for k in keys],
            segment=source,
            target=target,
            keep_source=keep_source,
        )
        try:
            start = self._master.call("MigrateStart", request)
        except KvtierError as exc:
            if exc.status in _PER_KEY:
                return [Status(exc.status)] * len(keys)
            raise
        copied = copy_batch(self, start) if any(s == _OK for s in start.statuses) else list(start.statuses)
        movable = [i for i, status in enumerate(start.statuses) if status == _OK]
        if movable:  # every target the master allocated is reported, moved or not: it is released now
            end = self._master.call(
                "MigrateEnd",
                pb.MigrateEndRequest(
                    migration_id=start.migration_id,
                    namespaces=[start.namespaces[i] for i in movable],
                    keys=[start.keys[i] for i in movable],
                    moved=[copied[i] == _OK for i in movable],
                ),
            )
            for i, status in zip(movable, end.statuses, strict=True):
                if copied[i] == _OK:
                    copied[i] = int(status)  # NOT_FOUND: removed or replaced meanwhile, nothing added
        return [to_status(s) for s in copied]
