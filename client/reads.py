"""The read path of `Client` (a mixin): lookup, transfers, verification, and retries (issue 20).

Per key, until a copy's bytes verify against the checksum recorded at PutEnd:

1. The replicas of one GetReplicas answer, one after another: segments that just failed this
   client or are quarantined last, DRAM before SSD, same-host first, then the master's order.
2. When they all failed and at least one failed on its connection (no connection, refused or
   timed out; cut mid-frame; stopped answering) or was answered NOT_FOUND or LEASE_EXPIRED (below),
   and `RETRY_MIN_LEFT` of the caller's timeout is still left: once more after a fresh GetReplicas
   (the lease may have lapsed, the replica set may have changed), its replicas in the same order.
   One such lookup per call, for all its keys.

A segment's answer is final for that copy: a range refused, a checksum mismatch (the copy is
reported to the master, kvtier.client.failures, before the fresh lookup, so that lookup no longer
lists it); NOT_FOUND (a disk copy tombstoned since the lookup) and LEASE_EXPIRED (a grant that ended,
or that belongs to a mount the segment has left since: kvtier.proto.frames) take step 2's lookup
too, which answers what the key holds now.

Bounded by the caller's timeout: every wait of the call's exchanges (free socket, connect, the
socket timeouts) ends at its deadline (kvtier.client.sockpool.call_deadline, set around the data
plane's exchanges only; the master link keeps its own timeouts). An attempt whose keys
have another replica to try may wait at most half the time left (a segment that stopped answering
leaves the other replica time to serve), the fresh lookup gets what is left, and no further attempt
or lookup starts with less than `RETRY_MIN_LEFT` of the timeout left. The first attempt after a
lookup has that much at least, even past the deadline: a lookup that took the whole timeout (a
master failing over) must not make a healthy segment look failed. So a call ends within its
timeout, or a tenth more after such a lookup. A segment whose connection failed is noted once
per call (`call_failures`) in what the client avoids and reports for quarantine.

Results: a key's bytes (or size, for `*_into`) only after they verified; otherwise a negative
Status. A failed attempt may have written part of a caller's buffer: that buffer's content is
unspecified unless the key's result is its size, which only a later, fully verified copy gives.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import crc32c

from kvtier.client.config import ClientConfig
from kvtier.client.failures import SegmentFailures, call_failures
from kvtier.client.leases import DoneLeases
from kvtier.client.locations import DIRECT_READ_MAX_BYTES, Location, LocationCache
from kvtier.client.master import fork_error
from kvtier.client.sockpool import call_deadline
from kvtier.client.transport.base import Caps, Connector, DiskConnector
from kvtier.client.transport.shm import local_host_id
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import KvtierError, TransportError
from kvtier.proto.keys import check_key, name_prefix_bytes
from kvtier.proto.status import Status

logger = logging.getLogger("kvtier.client.client")

_OK = 0
_STAMP_EVERY_S = 1.0
_MISMATCH = int(Status.CHECKSUM_MISMATCH)
_NOT_FOUND = int(Status.NOT_FOUND)
_LEASE_EXPIRED = int(Status.LEASE_EXPIRED)
# What a transfer whose connection failed answers (TcpConnector's results, or a connector that could
# not be made); a segment could answer TRANSFER_FAILED itself (a disk I/O error), so a key counts as
# cut off only when its segment's connection failed in this call too (`call_failures`).
_CONNECTION_FAILED = (int(Status.TRANSFER_FAILED), int(Status.UNAVAILABLE))
_TIERS = {pb.DRAM: "dram", pb.SSD: "ssd"}
# Fraction of a read lease the client relies on: the rest absorbs clock-rate drift between hosts.
LEASE_SAFETY = 0.9
# The share of the caller's timeout that must be left for the fresh lookup of step 2: less leaves the
# segments too little time to answer, and a slow but healthy one would be reported as failing.
RETRY_MIN_LEFT = 0.1


def _caps(tags: bytes, expiry_ms: int, positions: Sequence[int], session: int) -> Caps:
    """The grant of the replicas at `positions` of a reply, all on the segment whose mount is
    `session`: (expiry, their capability tags, session), or (expiry, [], session) where the cluster
    mints no tags: frames then carry the expiry as their deadline (kvtier.proto.frames
    FLAG_DEADLINE). None only from a master that names no expiry."""
    if not tags:
        return (expiry_ms, [], session) if expiry_ms else None
    return expiry_ms, [tags[16 * j : 16 * j + 16] for j in positions], session


def _split(items: list[int], parts: int) -> list[list[int]]:
    """`items` in up to `parts` contiguous chunks of at least 4 (small batches stay whole)."""
    parts = max(1, min(parts, len(items) // 4))
    step = -(-len(items) // parts)
    return [items[lo : lo + step] for lo in range(0, len(items), step)]


# Same-host copies are split only into parts at least this large: below it a part's hand-off to
# another thread (tens of microseconds) costs what the second core saves.
COPY_PART_MIN_BYTES = 512 << 10


T = TypeVar("T")


def split_copy(items: list[T], sizes: list[int], parts: int) -> list[list[T]]:
    """`items` (of `sizes` bytes each) in up to `parts` contiguous runs, cut after the first object
    that reaches each next share of the total and only where both sides keep at least
    COPY_PART_MIN_BYTES: one run per thread that shares a same-host copy. An object is never cut
    (its CRCs are one pass), so an object larger than a share leaves fewer, unequal runs."""
    total = sum(sizes)
    parts = min(parts, len(items), total // COPY_PART_MIN_BYTES)
    if parts <= 1:
        return [items]
    runs: list[list[T]] = []
    run: list[T] = []
    done = 0
    run_bytes = 0
    for item, size in zip(items, sizes, strict=True):
        run.append(item)
        done += size
        run_bytes += size
        if (
            done * parts >= total * (len(runs) + 1)
            and len(runs) + 1 < parts
            and run_bytes >= COPY_PART_MIN_BYTES
            and total - done >= COPY_PART_MIN_BYTES
        ):
            runs.append(run)
            run, run_bytes = [], 0
    if run:
        runs.append(run)
    return runs


def add_runs(parts: list[tuple[Any, list[T]]], copies: set[int], key: Any, runs: list[list[T]]) -> None:
    """Append one segment's `runs` to a call's `parts` as (key, run); all but its first run are the
    further parts of a shared copy, noted in `copies` by position (Client._run_parallel)."""
    copies.update(range(len(parts) + 1, len(parts) + len(runs)))
    parts += [(key, run) for run in runs]


def _add(counts: dict[str, int], name: str, delta: int) -> None:
    counts[name] = counts.get(name, 0) + delta


def _missed(result: bytes | int) -> bool:
    return isinstance(result, int) and result < 0


class Reads:
    """`Client._fetch` and its helpers (a mixin over the client's master, connectors and counters)."""

    config: ClientConfig
    namespace: str
    _master: Any
    _failures: SegmentFailures
    _done_leases: DoneLeases
    _locations: LocationCache | None
    _disk_streams: int
    _connectors: dict[str, tuple[tuple[str, ...], Connector, float]]
    _count: Callable[..., None]
    _connector: Callable[[pb.SegmentEndpoint], Connector]
    _disk_connector: Callable[[pb.SegmentEndpoint], DiskConnector]
    _run_parallel: Callable[..., list]
    _report_corrupt: Callable[..., None]
    _report_failures: Callable[[], None]
    _transport_failed: Callable[[str, TransportError], None]

    def _split_copy(
        self, segment: pb.SegmentEndpoint | None, items: list[T], size_of: Callable[[T], int]
    ) -> list[list[T]]:
        """`items` to transfer with `segment`, in one run per thread that shares the copy: several
        when its connector (one already made: this never connects) copies in the calling thread with
        the GIL released (shm) and every object is large enough for that (`size_of`: its bytes, 0 if
        its copy would hold the GIL); else one run (a socket pool's transfer is the segment's to
        pace: split, it measured slower)."""
        if segment is None or self.config.copy_threads < 2 or len(items) < 2:
            return [items]
        known = self._connectors.get(segment.name)
        if known is None or known[0] != tuple(segment.endpoints):
            return [items]
        least = getattr(known[1], "parallel_copy_min", 0)
        if not least:
            return [items]
        sizes = [size_of(item) for item in items]
        if min(sizes) < least:
            return [items]
        return split_copy(items, sizes, self.config.copy_threads)

    def _get_one(self, key: str, view: memoryview | None, sources: list[str | None] | None) -> bytes | int:
        """`get`'s and `get_into`'s key: `_fetch` of one key, its direct read made without a batch's
        bookkeeping (which cost a single get more CPU than its round trip). Anything but a served,
        verified copy forgets the location, as `_read_direct` does, and leaves the key to `_fetch`
        within the same deadline, failures noted once."""
        key = check_key(key)
        if self._master.forked_from:  # the parent's sockets: never this process's (client/master.py)
            raise fork_error(self._master.forked_from)
        now = time.monotonic()
        location = None if self._locations is None else self._locations.get(key, now)
        if (
            location is None
            or location.size > DIRECT_READ_MAX_BYTES
            or (view is not None and len(view) < location.size)
        ):
            return self._fetch([key], None if view is None else [view], sources)[0]
        deadline = now + self.config.timeout
        seen: set[str] = set()
        result, crc = self._read_keyed_one(key, view, location, deadline, seen)
        size = location.size
        if crc == location.checksum:
            if sources is not None:
                sources[0] = "dram/tcp"
            self._report_failures()
            self._count(
                gets=1, hits=1, direct_reads=1, served_dram_tcp=1, served_bytes_dram_tcp=size,
                bytes_read=size, bytes_read_dram=size,
            )  # fmt: skip
            return result if view is None else size
        self._locations.forget((key,))  # type: ignore[union-attr]
        if crc is None:
            self._count(direct_read_misses=1)
        else:  # another version of the key at the same place: ask the master
            self._count(direct_read_misses=1, bytes_read=size, bytes_read_dram=size)
        # Straight to the lookup: another thread may have remembered the key again meanwhile.
        fallback = self._fetch(
            [key], None if view is None else [view], sources, deadline=deadline, seen=seen, read_directly=False
        )
        return fallback[0]

    def _read_keyed_one(
        self, key: str, view: memoryview | None, location: Location, deadline: float, seen: set[str]
    ) -> tuple[bytes | int, int | None]:
        """`_read_keyed` of one key: its bytes (or OK) or a negative status, and their CRC32C (None
        with a status); no socket wait past half the time left."""
        segment = location.segment
        known = self._connectors.get(segment.name)
        if known is None or known[0] != location.endpoints:  # as in _read_keyed
            return int(Status.UNAVAILABLE), None
        failures = call_failures.set(seen)
        now = time.monotonic()
        until = call_deadline.set(deadline - (deadline - now) / 2)
        try:
            # Its last use is stamped at most once a second, and well within `connector_idle_s`.
            fresh = now - known[2] < min(_STAMP_EVERY_S, self.config.connector_idle_s / 4)
            connector = known[1] if fresh else self._connector(segment)
            read_one = getattr(connector, "read_keyed_one", None)
            if read_one is None:  # this host reaches it by shared memory now: no direct reads there
                return int(Status.UNAVAILABLE), None
            name = name_prefix_bytes(self.namespace) + key.encode()
            return read_one(location.offset, location.size, name, view, location.expiry_ms, location.tag)
        except TransportError as exc:
            logger.info("direct read from segment %s failed, looking the key up: %s", segment.name, exc)
            return int(exc.status), None
        finally:
            call_deadline.reset(until)
            call_failures.reset(failures)

    def _fetch(
        self,
        keys: Sequence[str],
        views: list[memoryview] | None,
        sources: list[str | None] | None = None,
        group: bool = False,  # the keys are one group: the master answers all or none (kvtier.client.groups)
        deadline: float | None = None,  # a call's, when `_get_one` tried a direct read first
        seen: set[str] | None = None,  # and the segments whose connection failed in that try
        read_directly: bool = True,  # False: look every key up (`_get_one`'s direct read did not serve it)
    ) -> list[bytes | int]:
        """Per key its verified bytes (or size, with `views`) or a negative Status; see the module.
        A group is read whole or not at all: never looked up again member by member."""
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        deadline = time.monotonic() + self.config.timeout if deadline is None else deadline
        seen = set() if seen is None else seen  # segments whose connection failed in this call
        tally: dict[str, int] = {}  # this call's counters, added to the client's once at its end
        token = call_failures.set(seen)
        try:
            direct = (
                {}
                if group or not read_directly or self._locations is None
                else self._read_direct(keys, views, sources, deadline, tally)
            )
            if direct:  # what the segments served alone; the rest is looked up as before
                rest = [i for i in range(len(keys)) if i not in direct]
                out: list[Any] = [direct.get(i) for i in range(len(keys))]
                if rest:
                    rest_sources = None if sources is None else [None] * len(rest)
                    found = self._lookup_all(
                        [keys[i] for i in rest],
                        None if views is None else [views[i] for i in rest],
                        rest_sources,
                        seen,
                        deadline,
                        tally,
                    )
                    for n, i in enumerate(rest):
                        out[i] = found[n]
                        if rest_sources is not None and sources is not None:
                            sources[i] = rest_sources[n]
            else:
                out = self._lookup_all(keys, views, sources, seen, deadline, tally, group)
        except BaseException:
            self._count(**tally)  # what was read and checked before the exception still counts
            raise
        finally:
            call_failures.reset(token)
        self._report_failures()
        hits = sum(1 for r in out if not _missed(r))
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits, **tally)
        return out

    def _lookup_all(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        sources: list[str | None] | None,
        seen: set[str],
        deadline: float,
        tally: dict[str, int],
        group: bool = False,
    ) -> list[Any]:
        """The lookup, its reads, and the one fresh lookup of the keys worth it (see the module)."""
        out, cut = self._lookup_and_read(keys, views, sources, seen, deadline, None, group, tally)
        left = deadline - time.monotonic()
        if cut and not group and left >= self.config.timeout * RETRY_MIN_LEFT:
            again_sources: list[str | None] | None = [None] * len(cut) if sources is not None else None
            again, _ = self._lookup_and_read(
                [keys[i] for i in cut],
                None if views is None else [views[i] for i in cut],
                again_sources,
                seen,
                deadline,
                left,
                False,
                tally,
            )
            for n, i in enumerate(cut):
                if again[n] is not None:  # None: the lookup failed; the first answer stands
                    out[i] = again[n]
                if again_sources is not None and sources is not None:
                    sources[i] = again_sources[n]
            _add(tally, "read_retries", len(cut))
            _add(tally, "read_retry_lookups", 1)
        return out

    def _read_direct(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        sources: list[str | None] | None,
        deadline: float,
        tally: dict[str, int],
    ) -> dict[int, Any]:
        """Direct reads (kvtier.client.locations): when this client remembers where every key is, read
        them from their segments alone; by position, the results that verified against the checksum
        remembered with them. Whatever else happened, the key is forgotten and looked up as usual
        (a segment's refusal is its index being right: the object moved, changed or left)."""
        locations = self._locations
        found = locations.find(keys, time.monotonic())
        if views is not None:  # too small a buffer: the lookup answers that
            found = {i: loc for i, loc in found.items() if len(views[i]) >= loc.size}
        if len(found) < len(keys) or sum(loc.size for loc in found.values()) > DIRECT_READ_MAX_BYTES:
            # Some must be looked up anyway: one lookup for all costs two round trips, direct reads
            # before it three (an engine re-reading a prefix's blocks finds them all here). And a
            # large call gains little from one round trip less, less than the segment's copy costs.
            return {}
        # One frame per segment and grant: a frame carries one expiry, which each tag's MAC covers.
        by_segment: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, location in found.items():
            by_segment[(location.segment.name, location.expiry_ms)].append(i)
        # Half the time left at most: a segment that stopped answering leaves the lookup the rest.
        until = deadline - (deadline - time.monotonic()) / 2
        jobs = [(self._read_keyed, keys, views, found, indices, until) for indices in by_segment.values()]
        served: dict[int, Any] = {}
        stale: list[str] = []
        moved = 0
        for indices, (results, crcs) in zip(by_segment.values(), self._run_parallel(jobs), strict=True):
            for i, result, crc in zip(indices, results, crcs, strict=True):
                location = found[i]
                if isinstance(result, int) and result != _OK:
                    stale.append(keys[i])
                    continue
                if crc is None:
                    crc = crc32c.crc32c(result if views is None else views[i][: location.size])
                moved += location.size
                if crc != location.checksum:  # another version of the key (same place): ask the master
                    stale.append(keys[i])
                    continue
                served[i] = result if views is None else location.size
                if sources is not None:
                    sources[i] = "dram/tcp"
        if stale:
            locations.forget(stale)
            _add(tally, "direct_read_misses", len(stale))
        if served:
            size = sum(found[i].size for i in served)
            _add(tally, "direct_reads", len(served))
            _add(tally, "served_dram_tcp", len(served))
            _add(tally, "served_bytes_dram_tcp", size)
        if moved:
            _add(tally, "bytes_read", moved)
            _add(tally, "bytes_read_dram", moved)
        return served

    def _read_keyed(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        found: dict[int, Location],
        indices: list[int],
        until: float,
    ) -> tuple[list[bytes | int], list[int | None]]:
        """One segment's share of the direct reads: per key its bytes (or OK, into its view) or a
        negative status, and the CRCs computed on the way; no socket wait past `until`."""
        crcs: list[int | None] = [None] * len(indices)
        segment = found[indices[0]].segment
        prefix = name_prefix_bytes(self.namespace)
        items = [(found[i].offset, found[i].size, prefix + keys[i].encode()) for i in indices]
        tags = [found[i].tag for i in indices]
        caps: Caps = (found[indices[0]].expiry_ms, tags if all(tags) else [], segment.session)
        into = None if views is None else [views[i][: found[i].size] for i in indices]
        known = self._connectors.get(segment.name)
        if known is None or known[0] != tuple(segment.endpoints):
            # Remembered from the segment's earlier life (it restarted elsewhere since), or its
            # connector was closed: never replace the current one with a stale address.
            return [int(Status.UNAVAILABLE)] * len(indices), crcs
        token = call_deadline.set(until)
        try:
            connector = self._connector(segment)
            read_keyed = getattr(connector, "read_keyed", None)
            if read_keyed is None:  # this host reaches it by shared memory now: no direct reads there
                return [int(Status.UNAVAILABLE)] * len(indices), crcs
            return read_keyed(items, into, crcs, caps=caps), crcs
        except TransportError as exc:
            logger.info("direct read from segment %s failed, looking the keys up: %s", segment.name, exc)
            return [int(exc.status)] * len(indices), crcs
        finally:
            call_deadline.reset(token)

    def _lookup_and_read(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        sources: list[str | None] | None,
        seen: set[str],
        deadline: float,
        timeout: float | None,
        group: bool,
        tally: dict[str, int],
    ) -> tuple[list[Any], list[int]]:
        """One GetReplicas (within `timeout`, else the client's) and the reads of its replicas:
        per key a result (None for every key of a retry's failed lookup) and the keys (indices)
        worth a fresh lookup: missed after a transfer failed on its connection, after the segment
        no longer held the copy the master named, or refused its grant as ended or of another mount."""
        # The master starts the lease when it handles the request, which is after
        # this moment: measuring from here can only under-estimate what is left.
        requested_at = time.monotonic()
        try:
            request = pb.KeysRequest(
                namespace=self.namespace,
                keys=keys,
                releasable=True,
                released_leases=self._done_leases.take(),
                group=group,
            )
            reply = self._master.call("GetReplicas", request, timeout)
        except KvtierError as exc:
            what = "treating %d keys as misses" if timeout is None else "no retry of %d keys"
            logger.warning("GetReplicas failed, " + what + ": %s", len(keys), exc)
            _add(tally, "master_failures", 1)
            return [int(exc.status) if timeout is None else None] * len(keys), []
        lease_deadline = requested_at + reply.lease_ms / 1000 * LEASE_SAFETY
        return self._read_replicas(keys, views, sources, seen, reply, lease_deadline, deadline, tally)

    def _read_replicas(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        sources: list[str | None] | None,
        seen: set[str],
        reply: pb.GetReplicasResponse,
        lease_deadline: float,
        deadline: float,
        tally: dict[str, int],
    ) -> tuple[list[Any], list[int]]:
        out: list[Any] = list(reply.statuses)
        segments = {s.segment_id: s for s in reply.segments}
        # The reply's columns as lists, once: indexing a protobuf repeated field builds a wrapper
        # per access, which a 32-key batch paid several times per key.
        sizes, checksums = list(reply.sizes), list(reply.checksums)
        replica_segments, replica_tiers = list(reply.replica_segments), list(reply.replica_tiers)
        order: Callable[[int], tuple[bool, bool, bool]] | None = None  # made for the first replicated key
        replicas: dict[int, list[int]] = {}  # key index -> positions in the replica columns
        pos = 0
        for i, count in enumerate(reply.replica_counts):
            if out[i] == _OK:
                size = sizes[i]
                if views is not None and len(views[i]) < size:
                    out[i] = int(Status.BUFFER_TOO_SMALL)
                elif size == 0:
                    out[i] = 0 if views is not None else b""
                elif count == 1:  # nothing to order: no sort, and none of the sets the order needs
                    replicas[i] = [pos]
                else:
                    if order is None:
                        order = self._replica_order(reply)
                    replicas[i] = sorted(range(pos, pos + count), key=order)
            pos += count
        attempt = 0
        # Direct reads later (kvtier.client.locations): DRAM copies on segments that serve them.
        remember = self._locations is not None and any(s.direct_reads for s in reply.segments)
        transferred: dict[str, int] = {}  # bytes per tier
        verified: dict[str, int] = {}  # "served_<tier>_<path>" objects and "served_bytes_<tier>_<path>"
        corrupt: list[tuple[int, int]] = []  # (key index, replica position) of copies that failed verification
        cut: set[int] = set()  # keys with a transfer that failed on its connection
        next_replica = 0  # keys tried on their next replica after such a failure
        # The first attempt has a tenth of the timeout at least: after a lookup that took (nearly) all of
        # it (a master failing over), a healthy segment given a millisecond would be reported as failing.
        deadline = max(deadline, time.monotonic() + self.config.timeout * RETRY_MIN_LEFT)
        while replicas:
            left = deadline - time.monotonic()
            if attempt and left < self.config.timeout * RETRY_MIN_LEFT:
                break  # too late for another replica: the keys keep their last status
            groups: dict[tuple[int, int], list[int]] = defaultdict(list)  # (segment id, tier) -> key indices
            for i, positions in replicas.items():
                position = positions[attempt]
                groups[(replica_segments[position], replica_tiers[position])].append(i)
            retry: dict[int, list[int]] = {}
            # Disk reads of one segment are split over parallel connections: the segment serves a
            # connection's requests one at a time, and more in flight keeps its disk busy. A large
            # same-host read is split over threads (the caller's, the copy pool's): each copies and
            # checksums its part.
            parts: list[tuple[tuple[int, int], list[int]]] = []
            copies: set[int] = set()  # the further parts of a shared same-host copy
            for (segment_id, tier), indices in groups.items():
                if tier == pb.SSD:
                    parts += [((segment_id, tier), chunk) for chunk in _split(indices, self._disk_streams)]
                    continue
                # Only copies into the caller's buffers: new bytes objects are made holding the GIL.
                segment = segments.get(segment_id)
                runs = [indices] if views is None else self._split_copy(segment, indices, sizes.__getitem__)
                add_runs(parts, copies, (segment_id, tier), runs)
            # A segment that stops answering may take half the time left when its keys have another
            # replica to try: the call's timeout is shared by the attempts, never exceeded by them.
            jobs = [
                (
                    self._read_segment,
                    segments.get(segment_id),
                    reply,
                    replicas,
                    indices,
                    attempt,
                    views,
                    tier,
                    keys,
                    deadline - left / 2 if any(attempt + 1 < len(replicas[i]) for i in indices) else deadline,
                )
                for (segment_id, tier), indices in parts
            ]
            all_results = self._run_parallel(jobs, copies)
            expired = time.monotonic() > lease_deadline  # checked after every byte has arrived
            for ((segment_id, tier), indices), (results, crcs, path) in zip(parts, all_results, strict=True):
                name = segments[segment_id].name if segment_id in segments else str(segment_id)
                tier_name = _TIERS.get(tier, "unknown")
                source = f"{tier_name}/{path}"
                moved = served = served_bytes = 0  # this part's: counted once below, not per key
                for i, result, crc in zip(indices, results, crcs, strict=True):
                    connection_failed = False
                    if isinstance(result, int) and result != _OK:
                        status = result
                        if status == _MISMATCH:  # the segment found its own copy damaged (a disk record)
                            corrupt.append((i, replicas[i][attempt]))
                        elif status in _CONNECTION_FAILED and name in seen:
                            connection_failed = True
                            cut.add(i)
                        elif status == _NOT_FOUND:
                            # The segment no longer holds the copy the master named: a disk copy
                            # tombstoned since the lookup (an upsert swapped in a new version,
                            # kvtier.master.upsert, or a removal). Asked again, the master answers
                            # the key's current state: the new version, or a miss.
                            cut.add(i)
                        elif status == _LEASE_EXPIRED:
                            # The grant ended, or belongs to a mount the segment left (it was dropped
                            # and mounted again, or its master restarted): the copy may well still be
                            # there, under a grant a fresh lookup gets.
                            cut.add(i)
                    elif expired:  # the bytes may have been reused after the lease: never trust them
                        status = int(Status.LEASE_EXPIRED)
                    else:
                        size = sizes[i]
                        moved += size
                        if crc is None:  # the connector did not checksum on the way
                            crc = crc32c.crc32c(result if views is None else views[i][:size])
                        if crc == checksums[i]:
                            out[i] = result if views is None else size
                            if sources is not None:
                                sources[i] = source
                            served += 1
                            served_bytes += size
                            if remember and path == "tcp" and size <= DIRECT_READ_MAX_BYTES:
                                position = replicas[i][attempt]
                                self._remember(
                                    keys[i], segments[segment_id], reply, position, size, crc, lease_deadline
                                )
                            continue
                        status = _MISMATCH
                        corrupt.append((i, replicas[i][attempt]))
                        _add(tally, "checksum_mismatches", 1)
                        logger.warning(
                            "checksum mismatch namespace=%s key=%.80s segment=%s: treated as a miss",
                            self.namespace,
                            keys[i],
                            name,
                        )
                    out[i] = status
                    if attempt + 1 < len(replicas[i]):
                        retry[i] = replicas[i]
                        next_replica += connection_failed
                if moved:
                    _add(transferred, tier_name, moved)
                if served:
                    _add(verified, f"served_{tier_name}_{path}", served)
                    _add(verified, f"served_bytes_{tier_name}_{path}", served_bytes)
            replicas = retry
            attempt += 1
        # Every transfer of this lease is over (answered, or its connection closed): hand it back.
        self._done_leases.add(reply.lease_id)
        if corrupt:  # before any fresh lookup: the master drops these copies first
            self._report_corrupt(keys, reply, corrupt)
        _add(tally, "bytes_read", sum(transferred.values()))
        _add(tally, "read_retries", next_replica)
        for tier_name, size in transferred.items():
            _add(tally, f"bytes_read_{tier_name}", size)
        for name, value in verified.items():
            _add(tally, name, value)
        return out, sorted(i for i in cut if _missed(out[i]))

    def _remember(
        self,
        key: str,
        segment: pb.SegmentEndpoint,
        reply: pb.GetReplicasResponse,
        position: int,
        size: int,
        checksum: int,
        until: float,
    ) -> None:
        """Where a verified DRAM copy was read over tcp, for direct reads until the lookup's grant ends."""
        if not segment.direct_reads or reply.replica_tiers[position] != pb.DRAM:
            return
        tags = reply.replica_tags
        location = Location(
            segment,
            reply.replica_offsets[position],
            size,
            checksum,
            tags[16 * position : 16 * position + 16] if tags else b"",
            reply.tag_expiry_ms,
            until,
            tuple(segment.endpoints),
        )
        self._locations.remember(key, location)

    def _replica_order(self, reply: pb.GetReplicasResponse) -> Callable[[int], tuple[bool, bool, bool]]:
        """The sort key of a replicated key's positions: segments that just failed this client or are
        quarantined last, DRAM before SSD, same-host replicas first (a memcpy instead of a socket),
        then (the sort is stable) in the master's order."""
        host = local_host_id()
        local = {s.segment_id for s in reply.segments if s.host_id == host}
        failed = self._failures.recently_failed()  # segments that just failed this client, or quarantined
        shunned = {s.segment_id for s in reply.segments if s.quarantined or s.name in failed}
        segments, tiers = reply.replica_segments, reply.replica_tiers
        return lambda j: (segments[j] in shunned, tiers[j] != pb.DRAM, segments[j] not in local)

    def _read_segment(
        self,
        segment: pb.SegmentEndpoint | None,
        reply: pb.GetReplicasResponse,
        replicas: dict[int, list[int]],
        indices: list[int],
        attempt: int,
        views: list[memoryview] | None,
        tier: int,
        keys: Sequence[str],
        deadline: float,
    ) -> tuple[list[bytes | int], list[int | None], str]:
        """Per-key data or status, CRCs where the connector computed them while copying, and the
        transport scheme that carried them; no socket waits past `deadline`."""
        crcs: list[int | None] = [None] * len(indices)
        if segment is None:
            return [int(Status.SEGMENT_NOT_FOUND)] * len(indices), crcs, ""
        # Only the data plane's waits: the master link's pools keep their own timeouts (a fast path
        # timed out by a short deadline would be dropped for gRPC). Set in the job's own context,
        # or reset below when the job runs inline.
        token = call_deadline.set(deadline)
        try:
            return self._read_from(segment, reply, replicas, indices, attempt, views, tier, keys)
        finally:
            call_deadline.reset(token)

    def _read_from(
        self,
        segment: pb.SegmentEndpoint,
        reply: pb.GetReplicasResponse,
        replicas: dict[int, list[int]],
        indices: list[int],
        attempt: int,
        views: list[memoryview] | None,
        tier: int,
        keys: Sequence[str],
    ) -> tuple[list[bytes | int], list[int | None], str]:
        crcs: list[int | None] = [None] * len(indices)
        positions = [replicas[i][attempt] for i in indices]
        column, sizes = reply.replica_offsets, reply.sizes  # each attribute access builds a wrapper: once
        offsets = [column[j] for j in positions]
        caps = _caps(reply.replica_tags, reply.tag_expiry_ms, positions, segment.session)
        try:
            if tier == pb.SSD:  # the segment reads its own files: a connector that reads disk serves them
                disk = self._disk_connector(segment)
                prefix = name_prefix_bytes(self.namespace)  # READ_DISK names: kvtier.proto.keys
                items = [(off, sizes[i], prefix + keys[i].encode()) for off, i in zip(offsets, indices, strict=True)]
                into = None if views is None else [views[i][: sizes[i]] for i in indices]
                return disk.read_disk(items, into, crcs, caps=caps), crcs, disk.scheme
            connector = self._connector(segment)
            if views is None:
                ranges = [(off, sizes[i]) for off, i in zip(offsets, indices, strict=True)]
                return connector.read(ranges, caps=caps), crcs, connector.scheme
            ranges = [(off, views[i][: sizes[i]]) for off, i in zip(offsets, indices, strict=True)]
            return list(connector.read_into(ranges, crcs, caps=caps)), crcs, connector.scheme
        except TransportError as exc:
            logger.warning("read from segment %s failed: %s", segment.name, exc)
            self._transport_failed(segment.name, exc)
            return [int(exc.status)] * len(indices), crcs, ""
