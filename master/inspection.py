"""Read-only views of the master's tables for ops tooling (`kvtier keys`, `kvtier stat`, `kvtier top`).

Plain functions over a `MasterState`, called on its event loop like every
other state method. None of them mutates anything: no read lease is granted,
no recency refreshed (listing or inspecting a key does not save it from
eviction), no lookup counted, no promotion read counted.

Cost of `list_keys`: a seek per 64 names (O(log n) each) plus the page's
entries. The master keeps every object name in code point order
(kvtier.master.name_index); a page seeks to the first name after `start_after`
within the prefix and takes the next names 64 at a time (issue 19: walking
every name cost 90 ms of the event loop per page at 1M objects). The memory a
call takes and the reply it sends are bounded by the page. And a page's time is
bounded too: a call given `budget_s` (the handler passes the config's
`list_page_ms`) stops once that much time went by and answers a shorter page
with `next_start_after` set, as a page that skipped pending objects does. A
page of 10,000 keys cost tens of ms of the loop at 10M objects (every other
request waited that long); now no page holds the loop much longer than the
budget, and the caller's paging loop asks for the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.master.name_index import prefix_end
from kvtier.master.records import (
    PIN_HARD,
    PIN_NONE,
    PIN_SOFT,
    TIER_DRAM,
    TIER_SSD,
    ObjectRecord,
    ObjectState,
    name_prefix,
    object_name,
    replica_offset,
    replica_segment,
    replica_tier,
)
from kvtier.master.state import MasterState, master_key_problem
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

DEFAULT_LIST_LIMIT = 1000
# Largest page: 10,000 keys of at most 1 KiB keep a reply near 10 MiB.
MAX_LIST_LIMIT = 10_000

_PENDING = ObjectState.PENDING


# The records a listing and a stat return are master.proto's own messages (KeyEntry, ObjectInfo,
# ReplicaInfo): the handlers send them as built, and the client reads them into its typed view
# (kvtier.client.keys). Only the page, which the reply carries as two fields, is a shape of its own.
KeyEntry = pb.KeyEntry
ReplicaInfo = pb.ReplicaInfo
ObjectInfo = pb.ObjectInfo


@dataclass(slots=True, frozen=True)
class KeyPage:
    entries: list[pb.KeyEntry]
    next_start_after: str  # "" = nothing after this page


def pin_in_force(record: ObjectRecord, now: float) -> tuple[int, int]:
    """(pin, soft pin time left in ms) as eviction sees it now: an expired soft pin protects nothing."""
    if record.pin_until == math.inf:
        return PIN_HARD, 0
    if record.pin_until > now:
        return PIN_SOFT, math.ceil((record.pin_until - now) * 1000)
    return PIN_NONE, 0


def clamp_limit(limit: int) -> int:
    """A page size within 1..MAX_LIST_LIMIT; 0 means DEFAULT_LIST_LIMIT."""
    return min(limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)


def list_keys(
    state: MasterState,
    namespace: str,
    prefix: str = "",
    start_after: str = "",
    limit: int = DEFAULT_LIST_LIMIT,
    include_pending: bool = False,
    budget_s: float = 0.0,
) -> KeyPage:
    """The first `limit` keys of `namespace` starting with `prefix` and after `start_after`, in
    code point order, with their size, state, replica counts per tier and pin.

    Paging with `start_after = page.next_start_after` until it is "" lists every key present
    throughout the listing exactly once, whatever is put or removed meanwhile (keys that come
    or go during it may or may not appear). Pending objects are left out unless
    `include_pending`; a page may then hold fewer than `limit` entries while more follow.
    With `budget_s` > 0 the page also ends, shorter, once that much time went by (at least one
    name is visited, so paging always moves on).
    """
    limit = clamp_limit(limit)
    start = object_name(namespace, prefix)
    end = prefix_end(start)
    after = object_name(namespace, start_after) if start_after else ""
    cursor, inclusive = (after, False) if after and after >= start else (start, True)
    clock = time.perf_counter
    deadline = clock() + budget_s if budget_s > 0 else math.inf
    skip = len(name_prefix(namespace))
    now = state.clock()
    entries = []
    visited = 0
    last = ""
    out_of_time = False
    while visited < limit and not out_of_time:
        names = state.names_after(cursor, end, min(_NAME_CHUNK, limit - visited), inclusive)
        if not names:
            return KeyPage(entries, "")  # nothing follows
        for name in names:
            visited += 1
            last = name
            record = state.visible(name)
            if record is not None and (include_pending or record.state is not _PENDING):
                entries.append(_key_entry(record, name[skip:], now))
            if clock() >= deadline:
                out_of_time = True  # a shorter page; the caller asks for the rest
                break
        cursor, inclusive = last, False
    more = bool(state.names_after(last, end, 1))
    return KeyPage(entries, last[skip:] if more else "")


# Names fetched from the index at a time: a page's seek cost is paid once per chunk, and a page cut
# short by its time budget fetched few names it did not visit.
_NAME_CHUNK = 64


def _key_entry(record: ObjectRecord, key: str, now: float) -> pb.KeyEntry:
    dram = ssd = 0
    for replica in record.replicas:
        tier = replica_tier(replica)
        if tier == TIER_DRAM:
            dram += 1
        elif tier == TIER_SSD:
            ssd += 1
    return KeyEntry(
        key=key,
        size=record.size,
        pending=record.state is _PENDING,
        dram_replicas=dram,
        ssd_replicas=ssd,
        pin=pin_in_force(record, now)[0],
    )


def stat_keys(state: MasterState, namespace: str, keys: Sequence[str]) -> tuple[list[int], list[ObjectInfo | None]]:
    """Per key: OK and its `ObjectInfo` (pending objects too), or NOT_FOUND / INVALID_KEY and None."""
    now = state.clock()
    statuses: list[int] = []
    infos: list[ObjectInfo | None] = []
    for key in keys:
        record = state.record(namespace, key) if key else None
        if record is None:
            statuses.append(int(Status.INVALID_KEY if master_key_problem(key) else Status.NOT_FOUND))
            infos.append(None)
            continue
        statuses.append(int(Status.OK))
        infos.append(_object_info(state, record, now))
    return statuses, infos


def _object_info(state: MasterState, record: ObjectRecord, now: float) -> ObjectInfo:
    tiering = state.tiering
    offloading = tiering.offloading.get(record.name)
    promoting = tiering.promotion_of(record.name)
    replicas = []
    for packed in record.replicas:
        segment_id, tier, location = replica_segment(packed), replica_tier(packed), replica_offset(packed)
        task = ""
        if offloading is not None and tier == TIER_DRAM and offloading.segment_id == segment_id:
            task = "offloading"
        elif promoting is not None and tier != TIER_DRAM and promoting.segment_id == segment_id:
            task = "promoting" if promoting.disk_location == location else ""
        segment = state.segments.get(segment_id)
        replicas.append(
            ReplicaInfo(
                segment_id=segment_id,
                segment=segment.name if segment else "",
                tier=tier,
                location=location,
                task=task,
            )
        )
    pin, pin_ttl_ms = pin_in_force(record, now)
    owner = record.owner
    return ObjectInfo(
        key=record.key,
        size=record.size,
        checksum=record.checksum,
        pending=record.state is _PENDING,
        replicas=replicas,
        lease_ms=math.ceil(max(0.0, record.lease_until - now) * 1000),
        pin=pin,
        pin_ttl_ms=pin_ttl_ms,
        instance=owner.instance if owner is not None else "",
        rank=owner.rank if owner is not None else 0,
        age_ms=int(max(0.0, now - record.started_at) * 1000),
        disk_reads=tiering.disk_reads(record.name),
    )


def disk_only_hits(replica_counts: Sequence[int], replica_tiers: Sequence[int]) -> int:
    """Of a GetReplicas answer (flat columns), the keys found whose replicas are all on SSD.

    Costs one C-level scan when no replica is on SSD (the DRAM-only cluster's every call)."""
    if TIER_SSD not in replica_tiers:
        return 0
    hits = pos = 0
    for count in replica_counts:
        if count and TIER_DRAM not in replica_tiers[pos : pos + count]:
            hits += 1
        pos += count
    return hits
