"""`Client`: batched, zero-copy put/get against a kvtier cluster.

Contracts every method keeps:
- One master round trip per batch: `batch_put` makes one PutStart and one
  PutEnd (plus one PutRevoke only when some writes failed); `batch_get*` make
  one GetReplicas, whatever the number of keys. When a segment's connection
  failed (kvtier.client.failures): one ReportSegmentFailures at most every
  half second, a put's failed keys are placed once more elsewhere (a
  second PutStart/PutEnd) if that happened in the first half of the timeout,
  and a get's keys that every replica failed are read once more after a
  second GetReplicas if a tenth of the timeout is left (kvtier.client.reads).
- Integrity: a CRC32C of every value goes to the master at PutEnd; every read
  is verified against it. Bytes that fail verification are never returned:
  the key is a miss (counted in `stats()["checksum_mismatches"]`) after the
  other replicas, if any, were tried.
- Visibility: the master shows an object to readers only after PutEnd, which
  the client sends only after every replica's bytes were acknowledged.
- Failure shape: reads degrade to misses (None, or a negative `Status` from
  the `*_into` calls) and log why, within the client's timeout; `batch_put` returns a `Status` per key;
  `put` raises `KvtierError`; invalid keys raise `InvalidKeyError`
  (a `ValueError`) before anything is sent.
- Thread safety: one Client may be shared by threads.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from kvtier.client.chunks import put_checksums
from kvtier.client.commit import MAX_COMMIT_BYTES, SegmentCommit, commit_bytes_bound
from kvtier.client.config import ClientConfig
from kvtier.client.events import EventWatching
from kvtier.client.failures import FailureReports, SegmentFailures, call_failures
from kvtier.client.groups import GroupCalls
from kvtier.client.keys import KeyInspection
from kvtier.client.leases import DoneLeases
from kvtier.client.locations import LocationCache
from kvtier.client.master import MasterClient, closed_error, fork_error
from kvtier.client.ranges import RangedReads
from kvtier.client.reads import _TIERS, Reads, _caps, add_runs
from kvtier.client.replicas import ReplicaOps
from kvtier.client.sockpool import call_deadline
from kvtier.client.tensors import TensorMixin
from kvtier.client.tracing import RequestIds, traced
from kvtier.client.transport import check_transport, connect, connect_disk
from kvtier.client.transport.base import Caps, Connector, DiskConnector
from kvtier.client.transport.shm import local_host_id
from kvtier.common.latency import LatencyHistogram
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import KvtierError, TransportError
from kvtier.proto.keys import check_key, check_prefix
from kvtier.proto.status import Status, to_status

logger = logging.getLogger(__name__)
C = TypeVar("C", bound=Connector)  # a connector kind: one cache per kind (_cached)

_OK = 0
_SEGMENT_FAILED = (int(Status.TRANSFER_FAILED), int(Status.UNAVAILABLE))  # a write's connection failed
_PUT_RETRIED = (*_SEGMENT_FAILED, int(Status.LEASE_EXPIRED))  # + a grant ended, or of an earlier mount
_PINS = {None: pb.PIN_NONE, "soft": pb.PIN_SOFT, "hard": pb.PIN_HARD}
_MAX_PIN_TTL_MS = (1 << 32) - 1  # PutStartRequest.pin_ttl_ms is a uint32


# Why the last batch_put of this thread (or task) failed as a whole: put() names it in its error.
_put_failure: contextvars.ContextVar[str] = contextvars.ContextVar("kvtier_put_failure", default="")


def quota_dict(q: pb.QuotaInfo) -> dict[str, Any]:
    """One rank's quota as plain data (the shape of `Client.quotas()` and `kvtier quotas --json`)."""
    return {
        "instance": q.instance,
        "rank": q.rank,
        "quota": q.quota,
        "used": q.used,
        "objects": q.objects,
        "tp_size": q.tp_size,
        "pp_size": q.pp_size,
    }


def as_bytes_view(value: Any) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, numpy, ...)."""
    view = value if isinstance(value, memoryview) else memoryview(value)
    if not view.c_contiguous:  # also a 1-D byte view with a stride (a numpy column): sockets refuse it
        raise ValueError("buffers must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.nbytes:  # a zero-size array, e.g. shape (0, 8): memoryview cannot cast zeros in its shape
        return memoryview(bytearray() if not view.readonly else b"")
    return view.cast("B")


def as_writable_view(buffer: Any) -> memoryview:
    view = as_bytes_view(buffer)
    if view.readonly:
        raise TypeError(f"buffer of type {type(buffer).__name__} is read-only; pass a bytearray, memoryview or array")
    return view


def _pin_ttl_ms(pin_ttl: float, name: str = "pin_ttl") -> int:
    """`pin_ttl` seconds as the wire's milliseconds; a positive TTL never rounds to 0 (the master's default)."""
    if pin_ttl == 0:  # the common case, without the rounding (NaN is not 0: refused below)
        return 0
    if not 0 <= pin_ttl <= _MAX_PIN_TTL_MS / 1000:  # also refuses NaN
        raise ValueError(f"{name} must be between 0 and {_MAX_PIN_TTL_MS // 1000} seconds, got {pin_ttl!r}")
    return math.ceil(round(pin_ttl * 1000, 6))  # round first: 1.1 * 1000 is 1100.0000000000002


class Client(
    TensorMixin, KeyInspection, ReplicaOps, FailureReports, EventWatching, GroupCalls, RangedReads, Reads
):  # mixins: client.tensors, .keys, .replicas, .failures, .events, .groups, .ranges, .reads
    """A thread-safe handle on one kvtier cluster, scoped to one namespace.

    `Client(master, namespace=..., timeout=...)`; use as a context manager or
    call `close()`. Keys are non-empty UTF-8 strings of at most 1 KiB without
    NUL; clients in different namespaces never see each other's objects.
    """

    def __init__(
        self,
        master: str,
        *,
        namespace: str = "default",
        timeout: float = 5.0,
        connections_per_segment: int = 4,
        io_threads: int = 4,
        copy_threads: int = 2,
        transport: str = "",
        instance: str = "",
        rank: int = 0,
        metrics: bool | None = None,
        secret: bytes | None = None,
        secret_file: str = "",
        principal: str = "",
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
        commit_through_segment: bool = True,
        location_cache_keys: int = 4096,
    ) -> None:
        self.config = ClientConfig(
            master=master,
            namespace=namespace,
            timeout=timeout,
            connections_per_segment=connections_per_segment,
            io_threads=io_threads,
            copy_threads=copy_threads,
            transport=(transport or ClientConfig.transport_override()).strip().lower(),
            secret_file=secret_file,
            principal=principal,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            commit_through_segment=commit_through_segment,
            location_cache_keys=location_cache_keys,
        ).validate()
        check_transport(self.config.transport)
        self.namespace = namespace
        self.instance = instance  # engine deployment whose per-rank quota this client's puts count against
        self.rank = rank
        if rank < 0:
            raise ValueError(f"rank must not be negative, got {rank}")
        self._master = MasterClient(master, timeout, credentials=self.config.credentials(secret))
        # How long PutStart may wait for room while the SSD tier catches up (OFFLOAD_BEHIND, see
        # batch_put): the call's timeout but a second (half of it when under 2 s), kept for the answer.
        self._put_wait_ms = int(max(timeout / 2, timeout - 1.0) * 1000)
        self._request_ids = RequestIds()
        # by segment name: (endpoints, connector, last used); those for the SSD tier apart
        self._connectors: dict[str, tuple[tuple[str, ...], Connector, float]] = {}
        self._disk_connectors: dict[str, tuple[tuple[str, ...], DiskConnector, float]] = {}
        self._next_prune = 0.0
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._latency: dict[str, LatencyHistogram] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._copy_pool: ThreadPoolExecutor | None = None  # the further parts of shared same-host copies
        self._closed = False
        self._done_leases = DoneLeases()  # handed back on the next request (kvtier.client.leases)
        # Where small DRAM objects were found, for direct reads (kvtier.client.locations).
        keys = self.config.location_cache_keys
        self._locations = LocationCache(keys) if keys else None
        # Segments whose transfers failed: avoided by the next puts, reported to the master (quarantine).
        self._failures = SegmentFailures(self.config.avoid_failed_s, self.config.failure_report_interval_s)
        # Connections one batch's disk reads of a segment are spread over (each has --ssd-read-ahead
        # reads in flight on the segment): more of them start the disk sooner after each batch's
        # GetReplicas and shorten its tail; measured in docs/benchmarks.md (2 -> 4 with issue 17).
        self._disk_streams = min(self.config.io_threads, self.config.connections_per_segment, 4)
        if metrics if metrics is not None else ClientConfig.metrics_override():
            from kvtier.client.metrics import track  # prometheus-client only when asked for

            track(self)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connectors = list(self._connectors.values()) + list(self._disk_connectors.values())
            self._connectors, self._disk_connectors = {}, {}
            pools = [self._pool, self._copy_pool]
            self._pool = self._copy_pool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        for _, connector, _ in connectors:
            connector.close()
        self._master.close()

    def stats(self) -> dict[str, int]:
        """Counters of this client: gets, hits, misses, checksum_mismatches, bytes_read, ..."""
        with self._lock:
            return dict(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            stats = self._stats
            for name, delta in deltas.items():  # as Counter.update, without its per-call Mapping check
                stats[name] += delta

    def _observe_latency(self, method: str, seconds: float) -> None:
        with self._lock:
            histogram = self._latency.get(method) or self._latency.setdefault(method, LatencyHistogram())
            histogram.observe(seconds)

    def latency(self) -> dict[str, LatencyHistogram]:
        """Per public method (outermost calls only): a copy of its latency histogram."""
        with self._lock:
            return {m: LatencyHistogram(list(h.counts), h.total) for m, h in self._latency.items()}

    def _connector(self, segment: pb.SegmentEndpoint) -> Connector:
        """The connector for a segment's DRAM region (kvtier.client.transport.connect), by name."""
        return self._cached(self._connectors, segment, lambda endpoints: connect(endpoints, self.config))

    def _disk_connector(self, segment: pb.SegmentEndpoint) -> DiskConnector:
        """The connector for reads of a segment's SSD tier (kvtier.client.transport.connect_disk): the
        segment server reads its own files; a client never maps or opens them."""
        return self._cached(
            self._disk_connectors, segment, lambda endpoints: connect_disk(endpoints, self.config, segment.name)
        )

    def _cached(
        self, table: dict[str, tuple[tuple[str, ...], C, float]], segment: pb.SegmentEndpoint, make: Callable[..., C]
    ) -> C:
        """`table`'s connector for a segment, by name, or `make(endpoints)`'s when the segment is new or
        restarted (new endpoints). Connectors unused for `connector_idle_s` are closed (a dead segment's
        mapping would otherwise pin its region's memory), after the copies already in flight."""
        if self._master.forked_from:  # the parent's sockets and mappings: not this process's to use
            raise fork_error(self._master.forked_from)
        endpoints, name, now = tuple(segment.endpoints), segment.name, time.monotonic()
        stale: list[Connector] = []
        with self._lock:
            if now >= self._next_prune:
                self._next_prune = now + min(self.config.connector_idle_s, 10.0)
                for idle in (self._connectors, self._disk_connectors):
                    for idle_name, (_, old, used) in list(idle.items()):
                        if now - used > self.config.connector_idle_s:
                            del idle[idle_name]
                            stale.append(old)
            known = table.get(name)
            if known is not None and known[0] == endpoints:
                connector = known[1]
            else:
                if self._closed:
                    raise closed_error()
                connector = make(endpoints)
                if hasattr(connector, "on_failure"):  # told each failed transfer's kind (client.failures)
                    connector.on_failure = functools.partial(self._segment_failed, name)
                if known is not None:
                    stale.append(known[1])
            table[name] = (endpoints, connector, now)
        for old in stale:
            old.close()
        return connector

    # ------------------------------------------------------------------ writes

    @traced
    def put(self, key: str, value: Any, *, replicas: int = 1, **placement: Any) -> None:
        """Store `value` (any bytes-like buffer) under `key`. Raises KvtierError on failure.

        Idempotent: putting a key that is already complete succeeds without
        rewriting it (`upsert` replaces it). `placement` as for `batch_put`
        (pin, pin_ttl, preferred_segment, lease_s).
        """
        self._raise_put(key, self.batch_put([key], [value], replicas=replicas, **placement)[0], "put")

    put_from = put  # zero-copy already: the value's buffer is sent as is

    @traced
    def upsert(self, key: str, value: Any, *, replicas: int = 1, **placement: Any) -> None:
        """Store `value` under `key`, replacing the object it holds, atomically: a concurrent reader
        gets the old value or the new one, never a mix and never a miss. Raises KvtierError on
        failure: refused before its end (PUT_IN_PROGRESS while another put or upsert of the key is
        in flight, NO_SPACE, ...) the old value stays; failed once its end was sent (UNAVAILABLE,
        TIMEOUT: the answer was lost) the key holds either value, never a mix. `placement` as for
        `batch_put`. docs/architecture.md, "Atomic overwrite"."""
        self._raise_put(key, self.batch_upsert([key], [value], replicas=replicas, **placement)[0], "upsert")

    upsert_from = upsert

    @traced
    def batch_upsert(self, keys: Sequence[str], values: Sequence[Any], **options: Any) -> list[Status]:
        """`upsert` for many keys: one `Status` per key, as `batch_put` (options alike)."""
        return self.batch_put(keys, values, _overwrite=True, **options)

    @staticmethod
    def _raise_put(key: str, status: Status, what: str) -> None:
        if status != Status.OK:
            reason = _put_failure.get()
            raise KvtierError(status, f"{what} of {key!r:.80} failed" + (f": {reason}" if reason else ""))

    @traced
    def batch_put(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        *,
        replicas: int = 1,
        pin: str | None = None,
        pin_ttl: float = 0.0,
        preferred_segment: str = "",
        lease_s: float = 0.0,
        _overwrite: bool = False,
    ) -> list[Status]:
        """Store many values; one `Status` per key (OK also for keys that already existed).

        `replicas` copies go to distinct segments (distinct hosts when there
        are enough). `pin="soft"` protects the objects from eviction while
        anything unpinned can go, for `pin_ttl` seconds (0: the master's
        default); `pin="hard"` protects them for good (they still count against
        the rank's quota). `preferred_segment` names the segment for the first
        replica when it has room; otherwise segments on this host come first,
        then the emptiest. `lease_s` > 0: a put-time lease from the put's end on, for that
        long: `remove` without `force` answers LEASE_HELD and eviction skips the object.

        `Status.OFFLOAD_BEHIND` for a key: the segments' DRAM is full of objects
        not yet copied to their SSD tier; the master waited for offload (its
        put_backpressure_s, at most this client's timeout less a second) and
        stored nothing for the key. Slow down or retry; `put` raises it as
        KvtierError. NO_SPACE and QUOTA_EXCEEDED likewise store nothing.
        """
        keys = [check_key(k) for k in keys]
        if pin not in _PINS:
            raise ValueError(f"pin must be one of {sorted(k for k in _PINS if k)} or None, got {pin!r}")
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        pin_ttl_ms = _pin_ttl_ms(pin_ttl)
        lease_ms = _pin_ttl_ms(lease_s, "lease_s")  # same wire type and rounding (uint32 ms)
        _put_failure.set("")
        if not keys:
            return []
        views = [as_bytes_view(v) for v in values]
        if self._locations is not None and _overwrite:  # a hint only (the segment would refuse the old copy)
            self._locations.forget(keys)
        started = time.monotonic()
        placement = (replicas, _PINS[pin], pin_ttl_ms, preferred_segment, _overwrite, lease_ms)
        statuses, retry, written = self._put_once(keys, views, *placement)
        # A write that failed on its segment (no connection, cut mid-frame, a grant refused as ended or
        # of an earlier mount) is retried once, placed anew: the failed keys were revoked first, a failed
        # connection's segment is in this client's avoid list. Only when the failure came in the first
        # half of the timeout, so the retry has time of its own.
        if retry and time.monotonic() - started < self.config.timeout / 2:
            again = self._put_once([keys[i] for i in retry], [views[i] for i in retry], *placement)
            for i, status in zip(retry, again[0], strict=True):
                statuses[i] = status
            written += again[2]
            self._count(put_retries=len(retry))
        self._report_failures()
        self._count(puts=len(keys), put_failures=sum(1 for s in statuses if s != _OK), bytes_written=written)
        return [to_status(s) for s in statuses]

    def _put_once(
        self,
        keys: list[str],
        views: list[memoryview],
        replicas: int,
        pin: int,
        pin_ttl_ms: int,
        preferred: str,
        overwrite: bool,
        lease_ms: int,
        group: bool = False,
    ) -> tuple[list[int], list[int], int]:
        """One PutStart, the writes, PutEnd and PutRevoke: per-key statuses, the keys (indices) whose
        write failed on its segment's connection (revoked: worth another placement), bytes written.
        With `group`, all or none (kvtier.client.groups): one failure revokes every key."""
        sizes = [len(v) for v in views]
        checksums: list[int | None] = [None] * len(keys)  # filled by connectors that checksum while copying
        blobs: list[bytes | None] = [None] * len(keys)  # and chunk CRCs with them (kvtier.client.chunks)
        try:
            reply = self._master.call(
                "PutStart",
                pb.PutStartRequest(
                    namespace=self.namespace,
                    keys=keys,
                    sizes=sizes,
                    replicas=replicas,
                    instance=self.instance,
                    rank=self.rank,
                    pin=pin,
                    pin_ttl_ms=pin_ttl_ms,
                    preferred_segment=preferred,
                    client_host=local_host_id(),
                    wait_ms=self._put_wait_ms,
                    released_leases=self._done_leases.take(),
                    avoid_segments=self._failures.avoid(),
                    overwrite=overwrite,
                    lease_ms=lease_ms,
                ),
            )
        except KvtierError as exc:
            logger.warning("batch_put failed: %s", exc)
            _put_failure.set(exc.message)
            return [int(exc.status)] * len(keys), [], 0
        statuses = list(reply.statuses)
        counts = reply.replica_counts
        if reply.error:
            logger.debug("PutStart: %s", reply.error)
            _put_failure.set(reply.error)
        segments = {s.segment_id: s for s in reply.segments}
        per_segment: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # (key index, offset, replica)
        pos = 0
        replica_segments, replica_offsets = reply.replica_segments, reply.replica_offsets  # one wrapper each
        for i, count in enumerate(counts):
            for j in range(pos, pos + count):
                per_segment[replica_segments[j]].append((i, replica_offsets[j], j))
            pos += count
        commit = None if group else self._commit_behind(per_segment, segments, keys, sizes, reply.put_id)
        # A large same-host write is split, each thread copying and checksumming its part (never one
        # that carries the PutEnd: that goes behind the whole write, over tcp). A read-only value
        # (bytes) is copied holding the GIL: no thread would gain.
        parts: list[tuple[int, list[tuple[int, int, int]]]] = []
        copies: set[int] = set()
        for segment_id, items in per_segment.items():
            runs = (
                [items]
                if commit is not None
                else self._split_copy(
                    segments.get(segment_id), items, lambda item: 0 if views[item[0]].readonly else sizes[item[0]]
                )
            )
            add_runs(parts, copies, segment_id, runs)
        jobs = [
            (
                self._write_segment,
                segments.get(segment_id),
                [(off, views[i]) for i, off, _ in items],
                _caps(
                    reply.replica_tags,
                    reply.tag_expiry_ms,
                    [j for _, _, j in items],
                    getattr(segments.get(segment_id), "session", 0),
                ),
                commit,
            )
            for segment_id, items in parts
        ]
        # A segment whose connection failed is noted once for this attempt, however many parts failed.
        token = call_failures.set(set()) if call_failures.get() is None else None
        # The writes end within the call's timeout, however the segments pace their bytes (sockpool).
        until = call_deadline.set(time.monotonic() + self.config.timeout) if call_deadline.get() is None else None
        try:
            done = self._run_parallel(jobs, copies)
        finally:
            if token is not None:
                call_failures.reset(token)
            if until is not None:
                call_deadline.reset(until)
        for (_, items), (results, crcs, chunks) in zip(parts, done, strict=True):
            for (i, _, _), result, crc, blob in zip(items, results, crcs, chunks, strict=True):
                if result != _OK and statuses[i] == _OK:
                    statuses[i] = result
                if checksums[i] is None:
                    checksums[i], blobs[i] = crc, blob
        if group and (first := next((s for s in statuses if s != _OK), _OK)) != _OK:
            if started := [keys[i] for i, count in enumerate(counts) if count]:
                self._revoke(started, reply.put_id)  # a member failed: none of them may become visible
            return [first] * len(keys), list(range(len(keys))) if first in _SEGMENT_FAILED else [], 0
        # A group's PutEnd names every member, those already complete too: they join the group.
        written = [i for i, count in enumerate(counts) if (count or group) and statuses[i] == _OK]
        chunks = put_checksums(views, written, checksums, blobs)  # what no connector computed
        failed = [i for i, count in enumerate(counts) if count and statuses[i] != _OK]
        if commit is not None and commit.statuses is not None:  # the segment relayed PutEnd
            by_key = dict(zip(commit.keys, commit.statuses, strict=True))
            for i in written:
                statuses[i] = by_key[keys[i]]
            self._count(commits_relayed=1)
        elif not written and commit is not None:  # nothing to end: the leases it took go with the next call
            for lease_id in commit.released_leases:
                self._done_leases.add(lease_id)
        elif written:
            if commit is not None:
                logger.debug("PutEnd not relayed by the segment (%s): sent to the master", commit.refused)
                self._count(commits_not_relayed=1)
            try:
                ended = self._master.call(
                    "PutEnd",
                    pb.PutEndRequest(
                        namespace=self.namespace,
                        keys=[keys[i] for i in written],
                        checksums=[checksums[i] for i in written],
                        put_id=reply.put_id,
                        # with those a COMMIT that was not relayed took along
                        released_leases=[*(commit.released_leases if commit else ()), *self._done_leases.take()],
                        group=group,
                        chunk_checksums=chunks if any(chunks) else (),
                    ),
                )
                for i, status in zip(written, ended.statuses, strict=True):
                    statuses[i] = status
            except KvtierError as exc:  # the master reclaims the pending puts after its timeout
                logger.warning("PutEnd failed: %s", exc)
                _put_failure.set(exc.message)  # what `put` raises with
                for i in written:
                    statuses[i] = int(exc.status)
        if failed:
            self._revoke([keys[i] for i in failed], reply.put_id)
        retry = [i for i in failed if statuses[i] in _PUT_RETRIED]
        return statuses, retry, sum(sizes[i] * counts[i] for i in written)

    batch_put_from = batch_put

    def _run_parallel(self, jobs: list[tuple], copies: frozenset[int] | set[int] = frozenset()) -> list:
        """Run transfer jobs (one per segment, or per part of a shared copy) concurrently; results in order.

        The calling thread runs the first job itself. Sockets release the GIL, so the other
        segments are served in parallel by a pool of `io_threads` threads per client; the jobs
        numbered in `copies` (the further parts of a same-host copy, kvtier.client.reads.split_copy)
        go to a pool of their own (`copy_threads` - 1 threads), so they never queue behind another
        call's transfer to a slow segment, and a part still queued there behind other calls' copies
        when the caller is done with its own is taken back and copied by the caller. Both pools are
        constants of the configuration, whatever the batch. The call returns (or raises the first
        error) only once every job has ended: none writes into the caller's buffers afterwards.
        """
        if self._master.forked_from:
            raise fork_error(self._master.forked_from)
        if len(jobs) <= 1:
            return [fn(*args) for fn, *args in jobs]
        with self._lock:
            if self._closed:
                raise closed_error()
            if self._pool is None and len(copies) < len(jobs) - 1:
                self._pool = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-io")
            if self._copy_pool is None and copies:
                self._copy_pool = ThreadPoolExecutor(self.config.copy_threads - 1, thread_name_prefix="kvtier-copy")
            io_pool, copy_pool = self._pool, self._copy_pool
        futures: dict[int, Future] = {}
        try:
            for n, (fn, *args) in enumerate(jobs):
                if n:  # each in a copy of this call's context: its frames carry the call's request id
                    pool = copy_pool if n in copies else io_pool
                    futures[n] = pool.submit(contextvars.copy_context().run, fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # close() shut the pools after the check above
            # Those already running end first (a cancelled one is never "done" to wait() until a
            # worker has dequeued it, which may be long after).
            wait([future for future in futures.values() if not future.cancel()])
            raise closed_error() from None
        results: list[Any] = [None] * len(jobs)
        errors: list[BaseException] = []
        fn, *args = jobs[0]
        try:
            results[0] = fn(*args)
        except BaseException as exc:  # raised below, once the other jobs ended
            errors.append(exc)
        for n, future in futures.items():
            if n in copies and future.cancel():  # still queued: the caller copies it now
                fn, *args = jobs[n]
                try:
                    results[n] = fn(*args)
                except BaseException as exc:
                    errors.append(exc)
        for n, future in futures.items():
            if not future.cancelled():
                try:
                    results[n] = future.result()
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def _commit_behind(
        self,
        per_segment: dict[int, list],
        segments: dict[int, pb.SegmentEndpoint],
        keys: list[str],
        sizes: list[int],
        put_id: int,
    ) -> SegmentCommit | None:
        """The PutEnd to send behind the write (kvtier.client.commit), when the put's ranges all go to
        one segment whose connector takes it, the PutEnd fits a COMMIT frame, and this client reaches
        the master's fast path (no TLS: the token travels like the fast path's own); None: PutEnd
        goes to the master."""
        if len(per_segment) != 1 or not self.config.commit_through_segment or not self._master.fast_path_active:
            return None
        ((segment_id, items),) = per_segment.items()
        names = [keys[i] for i, _, _ in items]  # in the order of the write's ranges
        if commit_bytes_bound(names, [sizes[i] for i, _, _ in items]) > MAX_COMMIT_BYTES:
            return None
        segment = segments.get(segment_id)
        if segment is None or not getattr(self._connector(segment), "commits", False):
            return None
        token = self._master.credentials.token
        return SegmentCommit(self.namespace, names, put_id, token, self._done_leases.take())

    def _write_segment(
        self, segment: pb.SegmentEndpoint | None, ranges: list, caps: Caps = None, commit: SegmentCommit | None = None
    ) -> tuple[list[int], list, list]:
        """Per-range statuses, and CRCs (whole, and chunks) where the connector computed them while
        copying; with `commit`, the connector sends it behind the write (kvtier.client.commit)."""
        crcs: list[int | None] = [None] * len(ranges)
        blobs: list[bytes | None] = [None] * len(ranges)
        if segment is None:
            return [int(Status.SEGMENT_NOT_FOUND)] * len(ranges), crcs, blobs
        try:
            connector = self._connector(segment)
            if commit is not None:
                return connector.write(ranges, crcs, caps=caps, chunks=blobs, commit=commit), crcs, blobs  # type: ignore[call-arg]
            return connector.write(ranges, crcs, caps=caps, chunks=blobs), crcs, blobs
        except TransportError as exc:
            logger.warning("write to segment %s failed: %s", segment.name, exc)
            self._transport_failed(segment.name, exc)
            return [int(exc.status)] * len(ranges), crcs, blobs

    def _revoke(self, keys: list[str], put_id: int) -> None:
        try:
            self._master.call("PutRevoke", pb.PutRevokeRequest(namespace=self.namespace, keys=keys, put_id=put_id))
        except KvtierError as exc:  # harmless: the master reclaims abandoned puts itself
            logger.warning("PutRevoke failed (master will reclaim): %s", exc)

    # ------------------------------------------------------------------ reads

    @traced
    def get(self, key: str, *, with_source: bool = False) -> Any:
        """The value of `key`, or None on a miss (absent, unreachable or failing verification).

        With `with_source`, a (value, source) pair: see `batch_get`.
        """
        sources: list[str | None] | None = [None] if with_source else None
        result = self._get_one(key, None, sources)
        value = result if isinstance(result, bytes) else None
        return (value, sources[0]) if sources is not None else value

    @traced
    def batch_get(self, keys: Sequence[str], *, with_source: bool = False) -> list[Any]:
        """Values of many keys (None per miss), with at most one GetReplicas round trip (none for keys
        read directly from their segments: docs/architecture.md, "Direct reads").

        With `with_source`, one (value, source) pair per key instead, where
        source says which tier and path served the bytes: "dram/shm",
        "dram/tcp", "ssd/tcp" (None on a miss).
        """
        sources: list[str | None] | None = [None] * len(keys) if with_source else None
        results = self._fetch(keys, None, sources)
        values = [r if isinstance(r, bytes) else None for r in results]
        return list(zip(values, sources, strict=True)) if sources is not None else values

    @traced
    def get_into(self, key: str, buffer: Any, *, with_source: bool = False) -> Any:
        """Read `key` into `buffer`: bytes written, or a negative Status (NOT_FOUND, BUFFER_TOO_SMALL, ...).

        What it writes past the returned count is as for `batch_get_into`. With `with_source`, a
        (result, source) pair: see `batch_get`.
        """
        sources: list[str | None] | None = [None] if with_source else None
        result = self._get_one(key, as_writable_view(buffer), sources)
        return (result, sources[0]) if sources is not None else result

    @traced
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any], *, with_source: bool = False) -> list[Any]:
        """Read many keys into caller-owned writable buffers; per key bytes written or a negative Status.

        The first `n` bytes (the returned count) are the object's. Bytes past them
        may be overwritten up to the size the object had when this client last
        read it: a direct read of a remembered location answered "changed since"
        lands as zeros before the key is looked up again (receiving into the
        buffer directly is what makes a get_into cost no copy). On a negative
        result the buffer's contents are unspecified. With `with_source`,
        (result, source) pairs as in `batch_get`.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_writable_view(b) for b in buffers]
        sources: list[str | None] | None = [None] * len(keys) if with_source else None
        results = self._fetch(keys, views, sources)
        return list(zip(results, sources, strict=True)) if sources is not None else results

    # ------------------------------------------------------------------ presence

    # With `prefetch`, objects found only on an SSD tier start moving into DRAM at once (bounded by the
    # master's promotion budget and task TTL), so a get that follows is likely a DRAM hit; the answer
    # itself is the same. Meant for an engine's lookup-then-load (docs/architecture.md, "The SSD tier").

    @traced
    def exists(self, key: str, *, prefetch: bool = False) -> bool:
        """Whether a complete object is stored under `key`. Grants no lease."""
        return self.batch_exists([key], prefetch=prefetch)[0]

    @traced
    def batch_exists(self, keys: Sequence[str], *, prefetch: bool = False) -> list[bool]:
        return list(self._exists(keys, pb.PREFETCH_FOUND if prefetch else pb.PREFETCH_NONE).exists)

    @traced
    def longest_prefix(self, keys: Sequence[str], *, prefetch: bool = False) -> int:
        """How many leading keys are all present: what an engine may load instead of recomputing.
        With `prefetch`, only the objects of that prefix are prefetched."""
        return self._exists(keys, pb.PREFETCH_PREFIX if prefetch else pb.PREFETCH_NONE).prefix_count

    def _exists(self, keys: Sequence[str], prefetch: int = pb.PREFETCH_NONE) -> pb.ExistsResponse:
        keys = [check_key(k) for k in keys]
        if not keys:
            return pb.ExistsResponse()
        request = pb.ExistsRequest(
            namespace=self.namespace, keys=keys, prefetch=prefetch, released_leases=self._done_leases.take()
        )
        return self._master.call("Exists", request)

    # ------------------------------------------------------------------ removal and inspection

    @traced
    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove `key`; True if an object was removed. Readers holding a lease finish first. A key
        under a put-time lease (`lease_s`) is kept (False) unless `force`."""
        return self.batch_remove([key], force=force)[0] == Status.OK

    @traced
    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[Status]:
        """One `Status` per key: OK, NOT_FOUND, PUT_IN_PROGRESS, or LEASE_HELD (a put-time lease
        runs and not `force`: nothing removed)."""
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        if self._locations is not None:  # a hint only (the segment would refuse): saves a round trip
            self._locations.forget(keys)
        request = pb.KeysRequest(
            namespace=self.namespace, keys=keys, released_leases=self._done_leases.take(), force=force
        )
        reply = self._master.call("Remove", request)
        return [to_status(s) for s in reply.statuses]

    @traced
    def remove_prefix(self, prefix: str) -> int:
        """Remove every object of this namespace whose key starts with `prefix`; the count removed.
        Put-time leases do not hold it back (as `force`)."""
        request = pb.RemovePrefixRequest(namespace=self.namespace, prefix=check_prefix(prefix))
        reply = self._master.call("RemovePrefix", request)
        return reply.removed

    @traced
    def locate(self, key: str) -> list[dict[str, Any]]:
        """Where `key`'s replicas live (segment, endpoints, offset, size, tier, checksum); [] on a miss."""
        reply = self._master.call("GetReplicas", pb.KeysRequest(namespace=self.namespace, keys=[check_key(key)]))
        if reply.statuses[0] != _OK:
            return []
        segments = {s.segment_id: s for s in reply.segments}
        out = []
        for j in range(reply.replica_counts[0]):
            segment = segments.get(reply.replica_segments[j])
            out.append(
                {
                    "segment_id": reply.replica_segments[j],
                    "segment": segment.name if segment else "",
                    "endpoints": list(segment.endpoints) if segment else [],
                    "offset": reply.replica_offsets[j],
                    "size": reply.sizes[0],
                    "tier": _TIERS.get(reply.replica_tiers[j], "unknown"),
                    "checksum": reply.checksums[0],
                }
            )
        return out

    @traced
    def register_instance(self, tp_size: int, pp_size: int, budget: int) -> int:
        """Register this client's engine deployment (`instance`); returns the quota of each of its ranks.

        The budget is for the whole deployment: each of its TP x PP ranks may
        hold budget / (TP x PP) bytes of DRAM, every replica counted. A put
        beyond a rank's quota evicts that rank's own least recently used
        objects first and fails with QUOTA_EXCEEDED only when none can go.
        Idempotent; registering again with other values updates the quotas.
        """
        if not self.instance:
            raise ValueError("register_instance needs a client created with instance=...")
        request = pb.RegisterInstanceRequest(
            instance=self.instance, tp_size=tp_size, pp_size=pp_size, budget_bytes=budget
        )
        return self._master.call("RegisterInstance", request).quota_per_rank

    @traced
    def quotas(self) -> list[dict[str, Any]]:
        """Per instance and rank: quota (0 = none), used bytes, objects, TP and PP sizes."""
        return [quota_dict(q) for q in self._master.call("Quotas", pb.QuotasRequest()).quotas]

    @traced
    def cluster_status(self) -> pb.StatusResponse:
        """The master's view of the cluster (segments, capacity, objects)."""
        return self._master.call("Status", pb.StatusRequest())
