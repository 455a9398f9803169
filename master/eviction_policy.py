"""The order eviction takes DRAM copies in: one policy per cluster (`eviction_policy`, issue 21).

MasterState keeps every pending record and every record with a DRAM copy in one dict (its
membership table); the policy decides in which order those are eviction candidates. The
victim RULES (pending, read leases, hard and soft pins, the caller's predicate: this segment,
this rank, not being offloaded, ...) stay in one place, `kvtier.master.eviction.pick_victims`;
a policy only supplies the order it walks, so every policy honours them the same way. What
happens to a victim (offload first when its only copy is in DRAM, kvtier.master.backpressure
and tiering) is the caller's, not the policy's.

The interface (MasterState calls it; nothing else does):
- `inserted(record)`: a complete record entered the DRAM order (PutEnd, an inventory's adoption,
  a promotion back from SSD);
- `touched(record)`: a read hit (GetReplicas) on a record in the DRAM order;
- `removed(record, evicted)`: it left the DRAM order (removed, lost, evicted, or now disk-only);
  `evicted` when it left because room was wanted (that is what S3-FIFO's ghost remembers);
- `order()`: every candidate, first to go first, read-only (views, opportunistic bounded scans);
- `victims(...)`: pick_victims over the policy's order; the only call that may age the policy.

Policies:
- `lru` (the default; the behaviour before issue 21): the membership dict itself is the order,
  a read moves the record to the most recently used end. No memory beyond the dict.
- `s3fifo` (S3-FIFO, Yang et al., SOSP 2023): new objects enter a small FIFO (~10% of the DRAM
  objects); one read later they are still one-hit wonders and leave from there, their name
  remembered in a ghost FIFO; an object read twice while in the small FIFO moves to the main
  FIFO, where a clock-style frequency (0..3, +1 per read) gives it that many second chances; an
  object whose name is in the ghost goes straight to main. A one-shot scan through many cold keys
  therefore passes through the small FIFO without pushing the re-read hot set out of main,
  which plain LRU does. Per object: one entry in the small or the main dict (name -> frequency;
  the name string is the record's own, the frequency a cached small int): about 35-45 bytes on
  top of the membership dict. The ghost holds 64-bit name hashes (an int and its entry: ~88
  bytes), at most as many as DRAM objects; a hash collision only sends a new object to main.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from kvtier.master.eviction import pick_victims
from kvtier.master.records import ObjectRecord

POLICIES = ("lru", "s3fifo")

FREQ_MAX = 3  # S3-FIFO's two frequency bits
SMALL_SHARE = 0.10  # of the DRAM objects the small FIFO holds before it is evicted from first
PROMOTE_READS = 2  # reads while in the small FIFO that move an object to main
GHOST_MIN = 1024  # the ghost may remember this many names even when few objects hold DRAM


class EvictionPolicy(Protocol):
    name: str

    def inserted(self, record: ObjectRecord) -> None: ...

    def touched(self, record: ObjectRecord) -> None: ...

    def removed(self, record: ObjectRecord, evicted: bool) -> None: ...

    def order(self) -> Iterable[ObjectRecord]: ...

    def queued(self) -> Iterable[str] | None: ...

    def queue_sizes(self) -> dict[str, int]: ...

    def victims(
        self,
        now: float,
        need: int,
        weight: Callable[[ObjectRecord], int],
        eligible: Callable[[ObjectRecord], bool],
        scan_limit: int = 0,
    ) -> list[ObjectRecord]: ...


def make_policy(name: str, objects: dict[str, ObjectRecord]) -> EvictionPolicy:
    """The policy `name` (one of POLICIES) over MasterState's membership dict `objects`."""
    if name == "lru":
        return LruPolicy(objects)
    if name == "s3fifo":
        return S3FifoPolicy(objects)
    raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {name!r}")


class LruPolicy:
    """Least recently used first: the membership dict's own order (see the module docstring)."""

    name = "lru"

    def __init__(self, objects: dict[str, ObjectRecord]) -> None:
        self._objects = objects

    def inserted(self, record: ObjectRecord) -> None:
        """Nothing: PutStart inserted it at the most recently used end (its PutEnd follows within
        milliseconds); an adopted or promoted record was appended by MasterState."""

    def touched(self, record: ObjectRecord) -> None:
        objects = self._objects
        del objects[record.name]  # move to the most recently used end
        objects[record.name] = record

    def removed(self, record: ObjectRecord, evicted: bool) -> None:
        """Nothing: leaving the membership dict is leaving the order."""

    def order(self) -> Iterable[ObjectRecord]:
        return self._objects.values()

    def queued(self) -> Iterable[str] | None:
        """None: the membership dict is the order (nothing of its own to check)."""
        return None

    def queue_sizes(self) -> dict[str, int]:
        return {}

    def victims(
        self,
        now: float,
        need: int,
        weight: Callable[[ObjectRecord], int],
        eligible: Callable[[ObjectRecord], bool],
        scan_limit: int = 0,
    ) -> list[ObjectRecord]:
        return pick_victims(self._objects.values(), now, need, weight, eligible, scan_limit)


class S3FifoPolicy:
    """S3-FIFO over complete records with a DRAM copy (see the module docstring).

    Pending records are in no queue: they are never victims, and one that is revoked or reclaimed
    never was. Promotion from the small FIFO happens at the read that earns it (O(1)), not when
    the small FIFO's head reaches it; main's clock is aged by `victims` as it passes records.
    """

    name = "s3fifo"

    def __init__(self, objects: dict[str, ObjectRecord]) -> None:
        self._objects = objects  # name -> record: where a queue's name finds its record
        self._small: dict[str, int] = {}  # name -> reads while in the small FIFO, oldest first
        self._main: dict[str, int] = {}  # name -> clock frequency 0..FREQ_MAX, oldest first
        self._ghost: dict[int, None] = {}  # hash(name) of recent one-hit wonders, oldest first
        self._passed: list[str] = []  # main's names the clock hand passed in the current `victims`
        self.ghost_hits = 0  # objects sent straight to main by the ghost (a counter, for tests and stats)

    # ---- what the state tells

    def inserted(self, record: ObjectRecord) -> None:
        name = record.name
        if name in self._small or name in self._main:
            return
        ghost, key = self._ghost, hash(name)
        if key in ghost:  # evicted from the small FIFO lately and wanted again: it was not a one-hit wonder
            del ghost[key]
            self.ghost_hits += 1
            self._main[name] = 0
        else:
            self._small[name] = 0

    def touched(self, record: ObjectRecord) -> None:
        name = record.name
        main = self._main
        freq = main.get(name)
        if freq is not None:
            if freq < FREQ_MAX:
                main[name] = freq + 1
            return
        small = self._small
        reads = small.get(name)
        if reads is None:
            return  # pending (not in a queue yet): nothing to count
        if reads + 1 >= PROMOTE_READS:
            del small[name]
            main[name] = min(reads + 1, FREQ_MAX)  # the clock keeps the reads it has earned
        else:
            small[name] = reads + 1

    def removed(self, record: ObjectRecord, evicted: bool) -> None:
        name = record.name
        if self._small.pop(name, None) is not None:
            if evicted:
                ghost = self._ghost
                ghost[hash(name)] = None
                bound = max(GHOST_MIN, len(self._small) + len(self._main))
                while len(ghost) > bound:
                    del ghost[next(iter(ghost))]
        else:
            self._main.pop(name, None)

    # ---- the order

    def _small_first(self) -> bool:
        small = len(self._small)
        return small > 0 and small >= SMALL_SHARE * (small + len(self._main))

    def _records(self, names: Iterable[str]) -> Iterator[ObjectRecord]:
        """The records of `names` (C-level iteration: bounded scans walk this per put)."""
        return filter(None, map(self._objects.get, names))

    def order(self) -> Iterable[ObjectRecord]:
        """Small FIFO then main (main first while the small FIFO is under its share), each oldest
        first, ignoring main's frequencies: read-only, for views and bounded opportunistic scans."""
        small, main = self._records(self._small), self._records(self._main)
        return itertools.chain(small, main) if self._small_first() else itertools.chain(main, small)

    def _main_candidates(self) -> Iterator[ObjectRecord]:
        """Main's records in clock order: a pass yields those at frequency 0 and notes the others
        in `_passed`; between passes the hand has gone round once, so every passed record loses one
        (`_age`). At most FREQ_MAX + 1 passes. Iterates no dict while it changes."""
        main, objects, passed = self._main, self._objects, self._passed
        names: Iterable[str] = main
        for _ in range(FREQ_MAX + 1):
            for name in names:
                freq = main.get(name)
                if freq is None:
                    continue
                if freq:
                    passed.append(name)
                    continue
                record = objects.get(name)
                if record is not None:
                    yield record
            if not passed:
                return
            names = list(passed)  # they are main's tail after _age, in this order
            self._age()

    def _age(self) -> None:
        """The clock hand passed these: one frequency less each, and to main's tail."""
        main = self._main
        for name in self._passed:
            freq = main.pop(name, None)
            if freq is not None:
                main[name] = freq - 1 if freq else 0
        self._passed.clear()

    def victims(
        self,
        now: float,
        need: int,
        weight: Callable[[ObjectRecord], int],
        eligible: Callable[[ObjectRecord], bool],
        scan_limit: int = 0,
    ) -> list[ObjectRecord]:
        """S3-FIFO's victims among those `eligible` accepts: the small FIFO's oldest first when it
        holds its share, else main's clock first. The rules of pick_victims apply to each. The
        clock hand's progress (frequencies lost by records passed) is kept even when the caller
        evicts nothing: it is where the hand is, not a decision."""
        small = self._records(self._small)  # not changed before pick_victims returns
        main = self._main_candidates()
        candidates = itertools.chain(small, main) if self._small_first() else itertools.chain(main, small)
        try:
            return pick_victims(candidates, now, need, weight, eligible, scan_limit)
        finally:
            self._age()

    # ---- introspection (tests, stats)

    def queued(self) -> Iterable[str]:
        """Every name in the small and main FIFOs (tests check them against the tables)."""
        return [*self._small, *self._main]

    def sizes(self) -> tuple[int, int, int]:
        """(small, main, ghost) entries."""
        return len(self._small), len(self._main), len(self._ghost)

    def queue_sizes(self) -> dict[str, int]:
        """kvtier_master_eviction_queue_entries{queue}."""
        return {"small": len(self._small), "main": len(self._main), "ghost": len(self._ghost)}

    def where(self, name: str) -> str:
        """ "small", "main" or "" (in no queue): for tests and `kvtier inspect`-style views."""
        return "small" if name in self._small else "main" if name in self._main else ""

    def frequency(self, name: str) -> int | None:
        return self._main.get(name, self._small.get(name))
