"""Least-recently-used order of complete objects, and the choice of eviction victims.

`LruIndex` is a dict used as an ordered set of object records: insertion
appends at the most-recently-used end, `touch` moves a record there (a read),
and iteration runs from the least recently used. Both are O(1).

Victim rules, in this order (they are what makes eviction safe):
- a record whose read lease has not ended is never a victim (its bytes may
  be in flight to a reader);
- a hard-pinned record is never a victim;
- a soft-pinned record whose pin has not expired is a victim only when the
  unpinned candidates do not free enough;
- otherwise least recently used first, among the records the caller's
  predicate accepts (on this segment, of this rank, ...).
Existence checks never touch the order: only reads refresh recency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

PIN_NONE = 0
PIN_SOFT = 1
PIN_HARD = 2


class LruIndex:
    def __init__(self) -> None:
        self._order: dict[Any, None] = {}

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._order)

    def add(self, record: Any) -> None:
        self._order[record] = None

    def touch(self, record: Any) -> None:
        order = self._order
        if record in order:
            del order[record]
            order[record] = None

    def discard(self, record: Any) -> None:
        self._order.pop(record, None)

    def victims(
        self,
        now: float,
        need: int,
        weight: Callable[[Any], int],
        eligible: Callable[[Any], bool],
    ) -> list[Any]:
        """LRU-first records that `eligible` accepts, until their `weight` adds up to `need`.

        Returns fewer when not enough can be evicted; the caller decides
        whether that is a failure.
        """
        chosen: list[Any] = []
        soft: list[Any] = []
        freed = 0
        if need <= 0:
            return chosen
        for record in self._order:
            if record.lease_until > now or record.pin == PIN_HARD or not eligible(record):
                continue
            if record.pin == PIN_SOFT and record.pin_until > now:
                soft.append(record)
                continue
            chosen.append(record)
            freed += weight(record)
            if freed >= need:
                return chosen
        for record in soft:
            chosen.append(record)
            freed += weight(record)
            if freed >= need:
                break
        return chosen
