"""Every object name in code point order, so that a listing or a prefix removal costs O(log n + what it
touches), never a walk of every object (issue 19: at 1M objects one ListKeys page held the event loop
for 90 ms, at 10M for about a second).

A list of sorted chunks with the largest name of each (the layout of `sortedcontainers.SortedList`,
cut down to what the master needs): finding a name is two C-level bisections, inserting or deleting
one moves at most `2 * LOAD` pointers. It holds references to the record's own name strings, so it
costs one pointer per object (about 8.5 bytes with the chunk slack), nothing per name.

Plain data, no clock, no records: `MasterState` adds a name when a record enters its tables and
discards it when the record leaves (kvtier.master.state).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator

# A chunk is split at 2 * LOAD names: inserts move at most that many pointers (a memmove of 8 KiB),
# and 10M names make about 13,000 chunks, a bisection of 14 steps.
LOAD = 512


def prefix_end(prefix: str) -> str:
    """The least string greater than every string starting with `prefix` ("" = no bound).

    A prefix ending in the largest code point (U+10FFFF, a valid key character) is bounded by its
    shorter prefix's end: nothing sorts between its extensions and that one's."""
    stem = prefix.rstrip(_LARGEST)
    if not stem:
        return ""
    return stem[:-1] + chr(ord(stem[-1]) + 1)


_LARGEST = chr(0x10FFFF)


class NameIndex:
    """A sorted set of strings with O(log n) add, discard and seek. Not thread-safe: one owner."""

    __slots__ = ("_chunks", "_maxes", "_len")

    def __init__(self) -> None:
        self._chunks: list[list[str]] = []
        self._maxes: list[str] = []  # the last (largest) name of each chunk
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, name: str) -> bool:
        maxes = self._maxes
        i = bisect_left(maxes, name)
        if i == len(maxes):
            return False
        chunk = self._chunks[i]
        j = bisect_left(chunk, name)
        return chunk[j] == name

    def add(self, name: str) -> None:
        """Insert `name`; no effect when present."""
        maxes = self._maxes
        if not maxes:
            self._chunks.append([name])
            maxes.append(name)
            self._len = 1
            return
        i = bisect_left(maxes, name)
        if i == len(maxes):  # beyond every name: the last chunk grows
            i -= 1
            chunk = self._chunks[i]
            chunk.append(name)
            maxes[i] = name
        else:
            chunk = self._chunks[i]
            j = bisect_left(chunk, name)
            if chunk[j] == name:
                return
            chunk.insert(j, name)
        self._len += 1
        if len(chunk) > 2 * LOAD:
            self._chunks.insert(i + 1, chunk[LOAD:])
            del chunk[LOAD:]
            maxes.insert(i, chunk[-1])

    def insert(self, name: str) -> None:
        """Add a name known to be absent (the caller's tables say so): `add` less its duplicate
        check, one C-level `insort`. The write path's call: every new object pays it."""
        maxes = self._maxes
        i = bisect_left(maxes, name)
        if i == len(maxes):
            if not maxes:
                self._chunks.append([name])
                maxes.append(name)
                self._len = 1
                return
            i -= 1
            chunk = self._chunks[i]
            chunk.append(name)
            maxes[i] = name
        else:
            chunk = self._chunks[i]
            insort(chunk, name)
        self._len += 1
        if len(chunk) > 2 * LOAD:
            self._chunks.insert(i + 1, chunk[LOAD:])
            del chunk[LOAD:]
            maxes.insert(i, chunk[-1])

    def add_many(self, names: Iterable[str]) -> None:
        add = self.add
        for name in names:
            add(name)

    def discard(self, name: str) -> None:
        """Remove `name`; no effect when absent."""
        maxes = self._maxes
        i = bisect_left(maxes, name)
        if i == len(maxes):
            return
        chunk = self._chunks[i]
        j = bisect_left(chunk, name)
        if chunk[j] != name:
            return
        del chunk[j]
        self._len -= 1
        if not chunk:
            del self._chunks[i]
            del maxes[i]
        elif j == len(chunk):
            maxes[i] = chunk[-1]

    def clear(self) -> None:
        self._chunks.clear()
        self._maxes.clear()
        self._len = 0

    def after(self, start: str, end: str = "", limit: int = 0, inclusive: bool = False) -> list[str]:
        """Up to `limit` names (0 = all) greater than `start` (or equal, with `inclusive`) and less
        than `end` ("" = no bound), in order. O(log n + names returned)."""
        out: list[str] = []
        for name in self._iter_from(start, inclusive):
            if end and name >= end:
                break
            out.append(name)
            if len(out) == limit:
                break
        return out

    def _iter_from(self, start: str, inclusive: bool) -> Iterator[str]:
        maxes, chunks = self._maxes, self._chunks
        seek = bisect_left if inclusive else bisect_right
        i = seek(maxes, start)
        if i == len(maxes):
            return
        j = seek(chunks[i], start)
        for k in range(i, len(chunks)):  # the caller does not mutate the index meanwhile
            yield from chunks[k][j:] if j else chunks[k]
            j = 0
