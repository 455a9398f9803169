"""The master's object tables, as `MasterState` keeps them: the mixin of its views and of the changes
that move a record between its dicts (`ObjectTables`; `self` is a MasterState, whose `__init__` makes
the tables: `_objects`, `_disk_only`, `_index`, `_pending`, `policy`, `object_count`).

Two dicts hold every object by `object_name(namespace, key)`: `_objects`, the pending ones and those
with a DRAM copy, in the eviction policy's order (what eviction scans walk), and `_disk_only`, those
whose copies are all on SSD (they free no DRAM; millions of them must not sit in front of every
eviction scan). `_index` keeps every name of both in code point order for listings and prefix
removals (kvtier.master.name_index). Called from the master's event loop thread only, like the rest
of MasterState.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from kvtier.master.records import ObjectRecord, object_name
from kvtier.master.state_types import ClusterSnapshot
from kvtier.master.tier_tasks import is_dram


class ObjectTables:
    """Views of the object tables and the moves between them (a mixin of MasterState)."""

    def record(self, namespace: str, key: str) -> ObjectRecord | None:
        """The record of `key` as readers see it (`visible`), pending or complete, or None."""
        return self.visible(object_name(namespace, key))

    def names_after(self, start: str, end: str = "", limit: int = 0, inclusive: bool = False) -> list[str]:
        """Up to `limit` object names (0 = all) after `start` (or from it, `inclusive`) and before `end`
        ("" = no bound), in code point order: O(log n + limit) (kvtier.master.name_index)."""
        return self._index.after(start, end, limit, inclusive)

    def records(self) -> Iterable[ObjectRecord]:
        """Every record, pending or complete: those holding DRAM in recency order (least recent first;
        the eviction order under `lru` only), then the disk-only ones. Do not mutate while iterating."""
        return itertools.chain(self._objects.values(), self._disk_only.values())

    def named_records(self) -> Iterable[tuple[str, ObjectRecord]]:
        return itertools.chain(self._objects.items(), self._disk_only.items())

    def names(self) -> Iterable[str]:
        """Every object name (kvtier.master.records.object_name), in no useful order."""
        return itertools.chain(self._objects, self._disk_only)

    def lookup(self, name: str) -> ObjectRecord | None:
        """The record of object `name` (kvtier.proto.keys.join_name), pending or complete, or None."""
        return self._objects.get(name) or self._disk_only.get(name)

    def dram_lru(self) -> Iterable[ObjectRecord]:
        """Records with a DRAM copy in eviction order, first to go first (kvtier.master.eviction_policy:
        under lru also the pending ones, least recently used first): what bounded opportunistic scans
        walk. Disk-only records free no DRAM and are not in it. Do not mutate while iterating."""
        return self.policy.order()

    def adopt(self, record: ObjectRecord) -> None:
        """Add a complete record a segment's inventory brought (kvtier.master.recovery, tiering):
        into the eviction order when it has a DRAM copy, among the disk-only ones otherwise. The
        caller has checked that no record of its name exists and counts its owner."""
        in_dram = any(is_dram(r) for r in record.replicas)
        (self._objects if in_dram else self._disk_only)[record.name] = record
        if in_dram:
            self.policy.inserted(record)
        self._index.add(record.name)
        self.object_count += 1

    def discard(self, name: str, *, forget_disk: bool = True) -> None:
        """Take object `name` out of the tables (KeyError when absent): its DRAM ranges are freed,
        or when its leases and write grant end; with `forget_disk` its segments tombstone its disk
        copies (without: the segment deletes them itself)."""
        self._delete(self._pop(name), forget_disk=forget_disk)

    def replace(self, old: ObjectRecord | None, new: ObjectRecord) -> None:
        """An upsert's swap (kvtier.master.upsert): complete `new` takes the place of `old` (None:
        gone meanwhile) under its name, most recently used; `old` leaves as a removed object does
        (ranges after its leases, disk copies tombstoned). One call: no reader sees neither."""
        if old is not None:
            self._delete(self._pop(old.name))  # its drop notices go before `new`'s commits
        self._objects[new.name] = new
        self.policy.inserted(new)
        self._index.add(new.name)  # put_end publishes its STORED event with the other keys

    def drop_version(self, record: ObjectRecord) -> None:
        """Forget an upsert's pending new version (never in the tables): its ranges are freed
        after its write grant, as a revoked put's are."""
        self._delete(record)

    def _pop(self, name: str, evicted: bool = False) -> ObjectRecord:
        """Take a record out of whichever dict holds it (KeyError when none does)."""
        record = self._objects.pop(name, None)
        if record is None:
            return self._disk_only.pop(name)
        self.policy.removed(record, evicted)
        return record

    def _leave_dram(self, record: ObjectRecord) -> None:
        """Its last DRAM copy went (evicted after offload, lost with a segment): out of the eviction order."""
        if self._objects.get(record.name) is record:
            self._disk_only[record.name] = self._objects.pop(record.name)
            self.policy.removed(record, True)

    def now_in_dram(self, record: ObjectRecord) -> None:
        """A disk-only record got a DRAM copy: back into the eviction order, most recently used."""
        if self._disk_only.get(record.name) is record:
            self._objects[record.name] = self._disk_only.pop(record.name)
            self.policy.inserted(record)

    def snapshot(self) -> ClusterSnapshot:
        pending = len(self._pending) + len(self.upserts.pending)
        return ClusterSnapshot(self.object_count - pending, pending, list(self.segments.values()))
