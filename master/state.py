"""The master's tables: segments, objects, their replicas and read leases.

Plain Python, no gRPC: the handlers (kvtier.master.handlers) parse requests, call these methods and
map the results to responses. Time comes from an injected `clock` so the
unit tests drive expiry without sleeping. Segment membership (mount, heartbeat, drop) is the
`SegmentTable` mixin of kvtier.master.segment_table, the views of the object tables and the moves
between them the `ObjectTables` mixin of kvtier.master.object_tables.

Concurrency: one owner. Every method is called from the master's event loop
thread; none blocks or awaits, so each call is atomic with respect to others.

Object lifecycle (per namespace and key):

    (absent) --put_start--> PENDING --put_end--> COMPLETE --remove/segment loss--> (absent)
                               |
                               +--put_revoke / put timeout / segment loss--> (absent)

Only COMPLETE objects are visible to `get_replicas` and `exists`. Ranges of a
removed object whose read lease is still running are freed when it ends. An
upsert's new version of a COMPLETE object waits beside it, outside the tables,
until its PutEnd swaps it in (`replace`; kvtier.master.upsert).

Space: complete objects are kept in the order of the cluster's `eviction_policy` (lru or
s3fifo, kvtier.master.eviction_policy; reads count, existence checks do not). A segment
fuller than `high_watermark` evicts down to `high_watermark - eviction_ratio` on the next
tick; an allocation that does not fit evicts from its segment first; a rank over its quota
evicts its own objects first. Victim rules are in `kvtier.master.eviction`.

Public face. MasterState alone touches its tables (`_objects`, `_disk_only`, `_pending`,
`_deferred`, `_segments_by_name`); the policy modules it builds on (tiering, placement, prefetch,
backpressure, drain, recovery, corrupt) get it as a parameter (type-only import) and call:

- reading: `lookup(name)`, `dram_lru()` (eviction's scan order), `records()`, `named_records()`,
  `names()`, `segment_named(name)`, `aligned(size)`, `replica_bytes(record)`, `has_dram_on(id)`;
- changing an object: `adopt(record)` (from an inventory), `now_in_dram(record)`,
  `drop_dram_replica(record, segment_id)`, `evict_one(record, reason, segment_id)`,
  `discard(name, forget_disk=...)`, `replace(old, new)`, `drop_version(record)` (upserts);
- ranges (the RangeBook mixin, master/range_book.py): `free_after_leases(segment_id, offset, size, until)`,
  `release_ranges(replicas, size)`;
- segments (the SegmentTable mixin): `drop_segment(segment_id, reason)`, `mid_inventory()`, `forgive_deafness(gap_s)`;
- names in order and sweeps (docs/architecture.md, "Scans stay bounded"): `names_after(...)`,
  `visible(name)`, `start_remove_prefix(namespace, prefix)`, `sweep(budget, max_s)`.

tests/unit/master/test_state_encapsulation.py fails when another module uses a private member.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

from kvtier.master.backpressure import Pressure
from kvtier.master.commits import CommitLog
from kvtier.master.config import MasterConfig
from kvtier.master.corrupt import CorruptReplicas
from kvtier.master.drain import Drainer
from kvtier.master.events import EventKind, EventLog
from kvtier.master.eviction import evict_to_watermark
from kvtier.master.eviction_policy import make_policy
from kvtier.master.fences import Fences
from kvtier.master.groups import GroupTable
from kvtier.master.history import open_history
from kvtier.master.leases import ReadLeases
from kvtier.master.name_index import NameIndex, prefix_end
from kvtier.master.object_tables import ObjectTables
from kvtier.master.placement import Ranking, full_ranking, place
from kvtier.master.placement_order import PlacementOrder, place_on
from kvtier.master.put_outcomes import PutOutcomes
from kvtier.master.quarantine import Quarantine
from kvtier.master.quotas import QuotaTable
from kvtier.master.range_book import RangeBook
from kvtier.master.records import (
    OFFSET_MASK,
    PIN_HARD,
    PIN_SOFT,
    SEGMENT_SHIFT,
    TIER_DRAM,
    TIER_MASK,
    TIER_SHIFT,
    ObjectRecord,
    ObjectState,
    name_prefix,
    object_name,
)
from kvtier.master.recovery import Recovery
from kvtier.master.segment_table import FEED_SILENT, HEARTBEAT_EXPIRED, SegmentTable
from kvtier.master.state_types import (
    GetResult,
    PutOptions,
    PutStartResult,
    SegmentRecord,
    SegmentState,  # noqa: F401 (re-exported: kvtier.master.recovery and others import it from here)
    master_key_problem,
)
from kvtier.master.sweeps import Removal, Sweeps
from kvtier.master.tier_tasks import dram_key, is_dram
from kvtier.master.tiering import Tiering
from kvtier.master.upsert import Upserts
from kvtier.proto.keys import NAME_SEPARATOR, SHORT_KEY_CHARS
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
_COMPLETE = ObjectState.COMPLETE
_PENDING = ObjectState.PENDING
_DEFAULT_PUT = PutOptions()  # frozen: safe to share as a default


class MasterState(ObjectTables, SegmentTable, RangeBook):
    """Segments, objects and leases of one cluster. See the module docstring."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self.segments: dict[int, SegmentRecord] = {}
        self.placement_order = PlacementOrder()  # the first choice of a put, kept across PutStarts
        self._segments_by_name: dict[str, int] = {}
        # Every object by object_name(namespace, key), in one of two dicts. `_objects`: pending
        # objects and those with a DRAM copy, in recency order (see master/eviction.py): the
        # eviction scan walks it. `_disk_only`: objects whose copies are all on SSD; they free no
        # DRAM, and millions of them must not sit in front of every eviction scan.
        self._objects: dict[str, ObjectRecord] = {}
        # The order eviction takes the complete ones in (kvtier.master.eviction_policy, issue 21).
        self.policy = make_policy(config.eviction_policy, self._objects)
        self._disk_only: dict[str, ObjectRecord] = {}
        # Every name of both dicts in code point order: listings and prefix removals seek in it
        # instead of walking every object (kvtier.master.name_index, issue 19).
        self._index = NameIndex()
        # Prefix removals and dead segments still being cleaned up in slices; until then lookups
        # settle what they meet (`_settled`), so nothing removed or lost is ever handed out.
        self.sweeps = Sweeps()
        # Pending puts in start order, for reclaim: name -> record.
        self._pending: dict[str, ObjectRecord] = {}
        # Ranges of removed objects still under a read lease: (release_at, seq, segment_id, offset, size).
        self._deferred: list[tuple[float, int, int, int, int]] = []
        # Read leases their readers release when the read is over (kvtier.master.leases).
        self.leases = ReadLeases()
        self.leases.on_unread = self._ranges_unread
        self.quotas = QuotaTable()
        self.drainer = Drainer(self)
        self.tiering = Tiering(self)
        self.pressure = Pressure(self)  # which DRAM copies may go for room (kvtier.master.backpressure)
        self.corrupt = CorruptReplicas(self)  # readers' reports of damaged copies (ReportCorrupt)
        self.commits = CommitLog(clock)
        self.upserts = Upserts(self)  # new versions of complete objects, put-time leases (master/upsert.py)
        self.groups = GroupTable(self)  # objects put as one group (kvtier.master.groups, issue 21)
        self.fences = Fences(config.fence_max_keys)  # what returning segments may bring back
        self.quarantine = Quarantine.of(config, clock)  # segments clients cannot use (kvtier.master.quarantine)
        self.quarantined_ids: set[int] = set()  # mounted segments in quarantine: their replicas read last
        # Not recovering until the server says so (begin_recovery): a first start has nothing to wait for.
        self.recovery = Recovery(started_at=self.started_at, finished_at=self.started_at)
        # Segments mounted and instances registered changed since the server last saved them.
        self.saved_state_stale = False
        # Names of segments expelled (silent past segment_ttl_s) whose DRAM index is stale: saved,
        # and told to discard it when they mount again (kvtier.master.commits).
        self.expelled: set[str] = set()
        # Bumped by every change that must be durable before calls waiting on it answer (an
        # expulsion); the server sets durable_generation once a save covering it is durable.
        self.state_generation = 0
        self.durable_generation = 0
        # Why this master saves nothing this epoch (its state store could not be read at start), or
        # "": a call waiting for a save it will never make is answered NOT_DURABLE with it at once.
        self.unsaveable = ""
        # With a state store, a new segment takes allocations only once its name is saved.
        self.save_mounts = False
        self.evictions: dict[str, list[int]] = {}  # reason -> [objects, bytes]
        # Set by the server (kvtier.master.capabilities): how long a PutStart's write grant (tags, frame
        # deadline) lives, and the clock skew allowed past any grant's end; a freed range waits for
        # both before reuse (`_reuse_at`). 0 = a bare state (unit tests): ranges are reused at once.
        self.capability_ttl_s = 0.0
        self.reuse_margin_s = 0.0
        # With a cluster secret write tags stay valid after PutEnd; without one a completed put has no
        # frame in flight (our clients PutEnd only once every WRITE was answered).
        self.capabilities = False
        # Until when (clock) a segment may still serve direct reads the master can no longer stop:
        # one dropped meanwhile, or one under an earlier incarnation (set by the server). Calls that
        # change what a key reads answer only after it (kvtier.master.commit_wait, Barrier).
        self.direct_read_fence = 0.0
        # The direct-read lease this master grants (ReportDramObjects(done), heartbeats): none until a
        # save of this epoch held, whose saved state then names at least as long (set by the server).
        self.granted_lease_ms = 0
        # Leases that ran out: "put" (a PutStart never ended), "segment" (expelled for silence).
        self.lease_expiries: dict[str, int] = dict.fromkeys(("put", "segment"), 0)
        self._segment_ids = itertools.count(1)
        # Put ids, and the committed versions that left, for PutEnds retried after a lost answer.
        self.put_outcomes = PutOutcomes()
        self._seq = itertools.count()
        self.object_count = 0
        # Opt-in record of objects leaving the tables other than by a client's remove (master/history.py).
        self.history = open_history(config.history_log, config.history_log_max_bytes)
        self.events = EventLog(
            config.events_buffer,
            config.events_watcher_queue,
            config.events_max_watchers,
            config.events_max_watchers_per_tenant,
        )
        # Sweeps run to their end inside the call that starts them (a bare state, unit tests); the
        # server clears this and sweeps in slices between requests (kvtier.master.sweeps).
        self.sweep_inline = True

    # ------------------------------------------------------------------ writes

    def put_start(
        self,
        namespace: str,
        keys: Sequence[str],
        sizes: Sequence[int],
        replicas: int,
        options: PutOptions = _DEFAULT_PUT,
        put_id: int = 0,
    ) -> PutStartResult:
        """Allocate `replicas` ranges on distinct segments for each key.

        Per key: OK with ranges to write; OK with zero ranges when the key is
        already complete (idempotent put); PUT_IN_PROGRESS when another put of
        the key is pending; INVALID_KEY; TOO_LARGE when no segment could ever
        hold it; NO_REPLICA when fewer segments take allocations than replicas
        asked; QUOTA_EXCEEDED when the rank's quota is full of objects that
        cannot be evicted; NO_SPACE when the segments are full of objects that
        cannot be evicted; OFFLOAD_BEHIND when room needs DRAM copies not yet on
        SSD (kvtier.master.backpressure: the caller waits and retries the key
        with the same `put_id`). Evicts (in `eviction_policy` order) to make room.
        """
        now = self.clock()
        put_id = put_id or self.put_outcomes.next_id()
        self.pressure.blocked.clear()
        result = PutStartResult(put_id, [], [], [], [])

        if options.instance and not self.quotas.rank_allowed(options.instance, options.rank):
            status = int(Status.INVALID_ARGUMENT)
            result.statuses = [status] * len(keys)
            result.replica_counts = [0] * len(keys)
            result.first_error = f"rank {options.rank} is outside instance {options.instance!r}'s TP x PP"
            return result
        owner = self.quotas.owner(options.instance, options.rank)
        if options.pin == PIN_HARD:
            pin_until = math.inf
        elif options.pin == PIN_SOFT:
            pin_until = now + (options.pin_ttl_s or self.config.soft_pin_ttl_s)
        else:
            pin_until = 0.0
        objects = self._objects
        prefix = name_prefix(namespace)
        alignment = self.config.alignment
        silent_since = now - self.config.segment_suspect_s
        # The full ranking (a pass over every segment), made only for a key the PlacementOrder does not
        # answer or whose first choice has no room (kvtier.master.placement_order).
        ranked: Ranking | None = None
        order: PlacementOrder | None = self.placement_order
        statuses, counts = result.statuses, result.replica_counts
        separator, short = NAME_SEPARATOR, SHORT_KEY_CHARS
        sweeps, index_add = self.sweeps, self._index.insert  # the name is in neither dict: absent
        upserts, overwrite = self.upserts, options.overwrite
        for key, size in zip(keys, sizes, strict=True):
            status = _OK
            name = prefix + key
            replacing = False
            if not key or separator in key or (len(key) > short and master_key_problem(key)):  # inlined: hot
                status = Status.INVALID_KEY
            else:
                existing = objects.get(name) or self._disk_only.get(name)
                if existing is not None and sweeps.active:
                    existing = self._settled(existing)
                if existing is not None:
                    if existing.state is _COMPLETE:
                        if not overwrite:
                            statuses.append(_OK)
                            counts.append(0)
                            continue
                        status, replacing = upserts.admit(name, now), True  # a new version beside it
                    elif now - existing.started_at < self.config.put_timeout_s:
                        status = Status.PUT_IN_PROGRESS
                    else:  # abandoned: reclaim inline so the new writer can proceed
                        if self.history is not None:
                            self.history.left(existing, "replaced")
                        self._delete(objects.pop(name))  # pending: always in _objects
            if status == _OK:
                first = None
                if replicas == 1 and size and order is not None:  # the full ranking's first, without it
                    first = order.first(
                        options.preferred_segment,
                        options.client_host,
                        silent_since,
                        self.quarantine.names,
                        options.avoid_segments,
                    )
                    if first is None:  # the same answer for the rest of this PutStart: rank in full
                        order = None
                if first is None or size > first.capacity:  # whether any segment could take it: ask all
                    first, ranked = None, ranked or full_ranking(self, options, silent_since)
                    active, largest, _ = ranked
                    if replicas > len(active):
                        status = Status.NO_REPLICA
                    elif size > largest:
                        status = Status.TOO_LARGE
            charge = -(-size // alignment) * alignment * replicas
            quota_victims: list[ObjectRecord] = []
            if status == _OK and owner is not None and owner.over_by(charge):
                # Plan the rank's own victims, but evict them only once the put is sure to go
                # through: a refused put must not have destroyed anything.
                over = owner.over_by(charge)
                if owner.quota and charge > owner.quota:
                    status = Status.QUOTA_EXCEEDED
                else:
                    # the rank's own objects that hold DRAM: disk-only ones free no quota
                    quota_victims = self.policy.victims(
                        now,
                        over,
                        self._record_bytes,
                        lambda r, o=owner: r.owner is o and any(is_dram(p) for p in r.replicas),
                    )
                    if sum(self._record_bytes(v) for v in quota_victims) < over:
                        status = Status.QUOTA_EXCEEDED
            if status == _OK:
                placed = None if first is None else place_on(first, size)
                if placed is None:
                    ranked = ranked or full_ranking(self, options, silent_since)
                    placed = place(self, ranked[0], ranked[2], size, replicas)
                if placed is None:
                    status = self.pressure.no_room()
                else:
                    for victim in quota_victims:
                        if owner.over_by(charge) and objects.get(victim.name) is victim:
                            self.evict_one(victim, "quota")
                    record = ObjectRecord(name, size, placed, put_id, now, owner, pin_until)
                    if replacing:
                        upserts.started(record)  # the visible version stays where it is
                    else:
                        objects[name] = record
                        index_add(name)
                        self._pending[name] = record
                    if options.lease_s:
                        upserts.request_lease(record, options.lease_s)
                    self.object_count += 1
                    if owner is not None:
                        owner.used += charge
                        owner.objects += 1
                        if owner.objects == 1:
                            self.quotas.charged(owner)
                    for packed in placed:
                        result.replica_segments.append(packed >> SEGMENT_SHIFT)
                        result.replica_offsets.append(packed & OFFSET_MASK)
                    statuses.append(_OK)
                    counts.append(len(placed))
                    continue
            statuses.append(int(status))
            counts.append(0)
            if not result.first_error:
                result.first_error = f"{Status(status).name} for key {key!r:.80} (size {size})"
        if owner is not None and not owner.objects:
            self.quotas.forget_idle(owner)  # nothing stored under it: no account left behind
        return result

    def put_end(
        self,
        namespace: str,
        keys: Sequence[str],
        checksums: Sequence[int],
        put_id: int,
        committed: list[tuple[int, ObjectRecord, tuple[int, ...]]] | None = None,
    ) -> list[int]:
        """Make pending objects of put `put_id` visible with their checksums. `committed` collects
        (index, record, replicas) of the keys committed now (kvtier.master.commits.PutAcknowledgement).

        Per key: OK (also when already complete with the same checksum: a retried
        PutEnd is harmless); NOT_PENDING when there is no pending put of this
        key under `put_id` (reclaimed, revoked, or another writer's).
        """
        objects = self._objects
        pending = self._pending
        prefix = name_prefix(namespace)
        not_pending = int(Status.NOT_PENDING)
        sweeps = self.sweeps
        done: list[ObjectRecord] = []  # told to their segments in one go after the loop
        inserted = self.policy.inserted
        out = []
        for key, checksum in zip(keys, checksums, strict=True):
            name = prefix + key
            record = objects.get(name) or self._disk_only.get(name)  # a retry may find it offloaded
            if record is not None and sweeps.active:
                record = self._settled(record)
            if record is None or record.put_id != put_id:
                new = self.upserts.end(name, put_id, checksum, record) if self.upserts.pending else None
                if new is not None:  # an upsert: `new` replaced `record` (kvtier.master.upsert)
                    done.append(new)
                    if committed is not None:
                        committed.append((len(out), new, new.replicas))
                if new is not None:
                    out.append(_OK)
                else:  # no pending put of it: was it committed, and gone since?
                    complete = record is not None and record.state is _COMPLETE
                    out.append(self.put_outcomes.retried(name, put_id, checksum, record.checksum if complete else None))
            elif record.state is _COMPLETE:
                out.append(_OK if record.checksum == checksum else not_pending)
            else:
                # Recency starts at PutStart: the record was inserted at the most recently used end
                # then, milliseconds ago; moving it again here would cost more than it tells.
                record.complete(checksum)
                inserted(record)  # lru: nothing (see above); s3fifo: into the small FIFO
                del pending[name]
                done.append(record)
                if committed is not None:
                    committed.append((len(out), record, record.replicas))
                out.append(_OK)
        if done:
            if sweeps.removals:  # completed after a RemovePrefix began: not what it removes
                sweeps.completed(done)
            self.commits.committed_records(done)  # replicas all DRAM while pending
            self.events.stored(done)  # routers' stream (kvtier.master.events)
            self.pressure.committed(done)  # offload starts as soon as objects qualify, not at the next tick
            if self.upserts.lease_requests:
                self.upserts.completed(done)  # put-time leases start at PutEnd
            if self.fences.recording:
                self.fences.touch_many(r.name for r in done)
        return out

    def put_revoke(self, namespace: str, keys: Sequence[str], put_id: int) -> list[int]:
        """Undo pending puts of `put_id`, freeing their ranges. OK or NOT_PENDING per key."""
        objects = self._objects
        prefix = name_prefix(namespace)
        out = []
        for key in keys:
            record = objects.get(prefix + key)
            if record is not None and self.sweeps.active:
                record = self._settled(record)
            if record is None or record.put_id != put_id or record.state is not _PENDING:
                revoked = self.upserts.pending and self.upserts.revoke(prefix + key, put_id)
                out.append(_OK if revoked else int(Status.NOT_PENDING))
                continue
            if self.history is not None:
                self.history.left(record, "revoked")
            self._delete(objects.pop(record.name))
            out.append(_OK)
        return out

    # ------------------------------------------------------------------ reads

    def get_replicas(self, namespace: str, keys: Sequence[str], releasable: bool = False) -> GetResult:
        """Placements of complete objects and a read lease on them.

        Per key OK or NOT_FOUND (absent or still pending) or INVALID_KEY. The
        lease keeps the returned ranges from being freed or reused until it ends.
        With `releasable`, the lease is counted for this reader and ends early
        when it hands `result.lease_id` back (kvtier.master.leases).
        """
        now = self.clock()
        lease_until = now + self.config.lease_s
        objects = self._objects
        prefix = name_prefix(namespace)
        result = GetResult([], [], [], [], [], [], [], int(self.config.lease_s * 1000))
        statuses, sizes, checksums, counts = result.statuses, result.sizes, result.checksums, result.replica_counts
        segments, offsets, tiers = result.replica_segments, result.replica_offsets, result.replica_tiers
        disk_only = self._disk_only
        not_found = int(Status.NOT_FOUND)
        leased: list[ObjectRecord] | None = [] if releasable else None
        leases, sweeps, shunned = self.leases, self.sweeps, self.quarantined_ids
        # lru: a read moves the record to the most recently used end (inlined: hot); others count it
        lru, touched = self.policy.name == "lru", self.policy.touched
        for key in keys:
            name = prefix + key
            record = objects.get(name)
            if sweeps.active:  # a removal or a segment's death in progress: settle what we meet
                record = self.visible(name)
                if record is not None and record.state is _COMPLETE and objects.get(name) is record:
                    touched(record)
                    record.count_read()
            elif record is None:
                record = disk_only.get(name)  # no recency to refresh: not in the eviction order
            elif record.state is _COMPLETE:
                if lru:
                    del objects[name]  # keyed by the record's own string below, not the copy `name`
                    objects[record.name] = record
                else:
                    touched(record)
                record.count_read()  # reads while in DRAM, for SSD admission
            if record is None or record.state is not _COMPLETE:
                statuses.append(int(Status.INVALID_KEY) if master_key_problem(key) else not_found)
                sizes.append(0)
                checksums.append(0)
                counts.append(0)
                continue
            if leased is not None:
                leased.append(record)  # grant() below extends its lease_until
            else:
                leases.uncounted(record, lease_until)
                if record.lease_until < lease_until:
                    record.lease_until = lease_until
            statuses.append(_OK)
            sizes.append(record.size)
            checksums.append(record.checksum)
            replicas = record.replicas
            if shunned and len(replicas) > 1:  # copies on quarantined segments last: read if others fail
                replicas = sorted(replicas, key=lambda p: p >> SEGMENT_SHIFT in shunned)
            counts.append(len(replicas))
            in_dram = False
            for packed in replicas:
                segments.append(packed >> SEGMENT_SHIFT)
                offsets.append(packed & OFFSET_MASK)
                tier = packed >> TIER_SHIFT & TIER_MASK
                tiers.append(tier)
                in_dram = in_dram or tier == TIER_DRAM
            if not in_dram:
                self.tiering.disk_only_read(record)
        if leased:
            result.lease_id = leases.grant(leased, lease_until)
        return result

    def exists(self, namespace: str, keys: Sequence[str]) -> tuple[list[bool], int]:
        """Whether each key is complete, and how many leading keys are. Grants no lease."""
        objects, disk_only = self._objects, self._disk_only
        prefix = name_prefix(namespace)
        found = []
        sweeps = self.sweeps
        for key in keys:
            name = prefix + key
            record = objects.get(name) or disk_only.get(name)
            if sweeps.active and record is not None:
                record = self._settled(record)
            found.append(record is not None and record.state is _COMPLETE)
        return found, found.index(False) if False in found else len(found)

    # ------------------------------------------------------------------ removal

    def remove(self, namespace: str, keys: Sequence[str], force: bool = False) -> list[int]:
        """Remove complete objects. OK, NOT_FOUND, PUT_IN_PROGRESS, or LEASE_HELD (a put-time
        lease runs and not `force`: nothing done; kvtier.master.upsert) per key."""
        prefix = name_prefix(namespace)
        out = []
        leases, now = self.upserts, self.clock()
        for key in keys:
            record = self.visible(prefix + key)
            if record is None:
                out.append(int(Status.NOT_FOUND))
                if self.fences.recording:  # maybe lost with a segment that returns: it must not
                    self.fences.touch(prefix + key)
            elif record.state is _PENDING:
                out.append(int(Status.PUT_IN_PROGRESS))
            elif not force and leases.leases and leases.held(record, now):
                out.append(int(Status.LEASE_HELD))
            else:
                self.events.gone(record, EventKind.REMOVED, "remove")
                self.discard(record.name)
                out.append(_OK)
        return out

    def remove_prefix(self, namespace: str, prefix: str) -> int:
        """Remove every complete object of `namespace` whose key starts with `prefix`, at once; how
        many. (The server removes in slices instead: `start_remove_prefix`.)"""
        removal = self.start_remove_prefix(namespace, prefix)
        while not removal.done:
            self.sweep(1 << 62)
        return removal.removed

    def start_remove_prefix(self, namespace: str, prefix: str) -> Removal:
        """Begin removing every object of `namespace` whose key starts with `prefix` and that is
        complete now. O(1) here: from now on no lookup sees them (each settles the record it meets,
        `_settled`), and `sweep` discards them in slices; `removal.done` once all are gone. Objects
        put or completed after this call are not removed."""
        start = object_name(namespace, prefix)
        if self.fences.recording:
            self.fences.touch_prefix(start)
        removal = self.sweeps.remove_prefix(start, prefix_end(start))
        if self.sweep_inline:
            self.sweep(1 << 62)
        return removal

    def visible(self, name: str) -> ObjectRecord | None:
        """`lookup(name)`, less what a removal or a segment's death in progress took."""
        record = self.lookup(name)
        if record is not None and self.sweeps.active:
            record = self._settled(record)
        return record

    def _delete(self, record: ObjectRecord, forget_disk: bool = True, changed: bool = True) -> None:
        """Forget a record already popped from the object dict; free or defer its DRAM ranges,
        and (with `forget_disk`) have segments tombstone its disk copies. `changed`: the key's
        state changed (not just its last copy lost), so no segment away may bring it back."""
        self.object_count -= 1
        if self.lookup(record.name) is None:  # else another version holds the name (an upsert's)
            self._index.discard(record.name)
        if self.upserts.leases or self.upserts.lease_requests:
            self.upserts.leaving(record)
        self.groups.left(record)
        if self.sweeps.dead_segments:  # copies on a segment being swept: its bytes leave the quota here
            self._strip_dead(record)
        if changed and self.fences.recording:
            self.fences.touch(record.name)
        if record.state is _PENDING:
            if self._pending.get(record.name) is record:  # (an upsert's new version is not there)
                del self._pending[record.name]
        else:
            for packed in record.replicas:
                if is_dram(packed):
                    self.commits.dropped(packed >> SEGMENT_SHIFT, packed & OFFSET_MASK, record)
            self.put_outcomes.left(record.name, record.put_id, record.checksum, lost=not changed)
        disk = [r for r in record.replicas if not is_dram(r)]
        if disk:
            record.replicas = tuple(r for r in record.replicas if is_dram(r))
            for packed in disk:
                segment = self.segments.get(packed >> SEGMENT_SHIFT)
                if segment is not None:
                    segment.ssd_objects -= 1
                    if forget_disk:
                        self.tiering.forget(segment.segment_id, record.name, packed & OFFSET_MASK)
        if self.lookup(record.name) is None:  # else the name's visible version keeps its read count
            self.tiering.forget_reads(record.name)
        if record.owner is not None:
            record.owner.used -= self._record_bytes(record)
            record.owner.objects -= 1
            if not record.owner.objects:
                self.quotas.forget_idle(record.owner)
        now = self.clock()
        reuse_at = self._reuse_at(record)
        replicas = record.replicas
        if record.state is _PENDING and record.size:  # a writer of it may still be copying (range_book)
            replicas = self.held_for_writers(replicas, record.size, reuse_at - now)
        if reuse_at > now:
            for packed in replicas:
                segment_id = packed >> SEGMENT_SHIFT
                segment = self.segments.get(segment_id)
                if segment is not None:
                    segment.objects -= 1
                    if record.size:
                        self.free_after_leases(segment_id, packed & OFFSET_MASK, record.size, reuse_at, record)
        else:
            self.release_ranges(replicas, record.size)

    def evict_one(self, record: ObjectRecord, reason: str, segment_id: int = 0) -> int:
        """Evict one object (or, with `segment_id` and other replicas left, its copy there); bytes freed."""
        self.pressure.evicting(record, reason, segment_id)
        if self.history is not None:
            replica = bool(segment_id) and len(record.replicas) > 1
            name = self.segments[segment_id].name if segment_id in self.segments else ""
            self.history.left(record, f"evicted:{reason}", name, replica=replica)
        if segment_id and len(record.replicas) > 1:
            freed = self.replica_bytes(record)
            self.drop_dram_replica(record, segment_id)
            self.events.changed(record, f"evicted:{reason}")
        else:
            freed = self._record_bytes(record)
            self.events.gone(record, EventKind.EVICTED, reason)
            self._pop(record.name, evicted=True)
            self._delete(record)
        counts = self.evictions.setdefault(reason, [0, 0])
        counts[0] += 1
        counts[1] += freed
        return freed

    def drop_dram_replica(self, record: ObjectRecord, segment_id: int) -> None:
        """Remove the DRAM replica on `segment_id` of a complete object that keeps at least one other.

        Its range is freed now, or when the last read lease ends (offload drops
        a copy that readers may be reading).
        """
        dram = dram_key(segment_id)
        dropped = [r for r in record.replicas if r >> TIER_SHIFT == dram]
        record.replicas = tuple(r for r in record.replicas if r >> TIER_SHIFT != dram)
        for packed in dropped:
            self.commits.dropped(segment_id, packed & OFFSET_MASK, record)
        if record.owner is not None:
            record.owner.used -= self.aligned(record.size) * len(dropped)
        if not any(is_dram(r) for r in record.replicas):
            self._leave_dram(record)
        reuse_at = self._reuse_at(record)
        if reuse_at > self.clock() and record.size:
            segment = self.segments.get(segment_id)
            if segment is not None:
                for packed in dropped:
                    segment.objects -= 1
                    self.free_after_leases(segment_id, packed & OFFSET_MASK, record.size, reuse_at, record)
            return
        self.release_ranges(dropped, record.size)

    def register_instance(self, instance: str, tp_size: int, pp_size: int, budget: int) -> int:
        """Register an engine deployment; the per-rank quota. Raises ValueError when invalid."""
        quota = self.quotas.register(instance, tp_size, pp_size, budget)
        self.saved_state_stale = True
        logger.info("instance registered instance=%s tp=%d pp=%d quota_per_rank=%d", instance, tp_size, pp_size, quota)
        return quota

    # ------------------------------------------------------------------ time

    def never_saved(self, generation: int) -> bool:
        """Whether a wait for the save of `generation` (kvtier.master.commit_wait) would never end:
        this master saves nothing this epoch and has not saved that far."""
        return bool(self.unsaveable) and self.durable_generation < generation

    def direct_reads_fenced(self) -> bool:
        """Whether a segment the master can no longer stop may still serve direct reads (before
        `direct_read_fence`): calls that change what a key reads wait until it is not."""
        return self.clock() < self.direct_read_fence

    def tick(self) -> None:
        """Expire silent segments, reclaim abandoned puts, free ranges whose lease ended, evict to the watermark."""
        now = self.clock()
        ttl = self.config.segment_ttl_s
        for segment_id in [s.segment_id for s in self.segments.values() if now - s.last_heartbeat > ttl]:
            self.drop_segment(segment_id, reason=HEARTBEAT_EXPIRED)
        for segment_id in self.commits.silent(ttl):
            self.drop_segment(segment_id, reason=FEED_SILENT)
        timeout = self.config.put_timeout_s
        while self._pending:
            name, record = next(iter(self._pending.items()))
            if now - record.started_at < timeout:
                break  # insertion order is start order: the rest are younger
            logger.info(
                "reclaiming abandoned put namespace=%s key=%.80s put_id=%d", record.namespace, record.key, record.put_id
            )
            del self._objects[name]
            if self.history is not None:
                self.history.left(record, "reclaimed")
            self._delete(record)
            self.lease_expiries["put"] += 1
        self.upserts.tick(now)
        self.leases.expire(now)
        while self._deferred and self._deferred[0][0] <= now:
            _, _, segment_id, offset, size = heapq.heappop(self._deferred)
            segment = self.segments.get(segment_id)
            if segment is not None:
                segment.allocator.release(offset, size)
                segment.releasing -= self.aligned(size)
        self.drainer.tick(now)
        self.tiering.tick(now)
        if self.quarantine.expire():
            self.refresh_quarantine()
        self.check_recovery()
        high, target = self.config.high_watermark, self.config.high_watermark - self.config.eviction_ratio
        offload_at = self.config.offload_watermark
        for segment in list(self.segments.values()):
            if segment.capacity and segment.used > high * segment.capacity:
                evict_to_watermark(self, segment, segment.used - int(target * segment.capacity))
            elif segment.used > offload_at * segment.capacity:
                # Copy LRU objects to SSD ahead of need (they keep their DRAM copy), so eviction
                # later drops copies already safe instead of objects only DRAM held.
                self.pressure.feed(segment)
