"""Offset allocator for one segment's DRAM region.

Segregated fit: free extents are kept in power-of-two size bins (bin i holds
extents of size [2**i, 2**(i+1))) with a bitmask of non-empty bins, so an
allocation looks at most at a few extents of its own bin and then takes any
extent of the next non-empty larger bin, which always fits. Freed extents
coalesce with free neighbours on both sides through start- and end-indexed
maps, so after every allocation is freed the region is one extent again.

Bump extent: a fill of small ranges cuts one large extent again and again.
After such a cut the rest of the extent is kept aside, outside the maps, and
the next allocations that fit are taken from its front by adding to an
offset (no map updates). It goes back into the maps (`_flush`) before any
release, free-space query, or cut of another extent; its neighbours cannot be
free meanwhile (maps are always coalesced and every release flushes first),
so it goes back without merging.

All sizes are rounded up to `alignment`. Not thread-safe: the master's state
owns one allocator per segment and mutates it from its event loop only.

Releases are checked. With `track=True` (the default) every live allocation
is remembered and any release that does not match one exactly is refused.
The master passes `track=False`: it already holds every range in its object
records, and a second table would cost ~50 bytes per object (issue 4 budgets
400 in all). Untracked releases are still refused when misaligned, out of
bounds or touching a free extent at either edge (an immediate double free);
the unit tests' accounting checker proves the master's books tile each
region exactly, and readers verify checksums whatever happens.
"""

from __future__ import annotations

from collections.abc import Iterator

_MAX_BINS = 64
_SCAN_OWN_BIN = 8  # extents of the request's own bin inspected before going up a bin


class OffsetAllocator:
    def __init__(self, capacity: int, alignment: int = 64, track: bool = True) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self.used = 0
        self._free_by_start: dict[int, int] = {}  # start -> size
        self._free_by_end: dict[int, int] = {}  # end -> start
        self._bins: list[dict[int, int]] = [{} for _ in range(_MAX_BINS)]  # per bin: start -> size
        self._nonempty = 0  # bit i set when bin i has an extent
        # start -> aligned size of every live allocation; None when untracked
        self._allocated: dict[int, int] | None = {} if track else None
        self._bump = self._bump_end = 0  # the bump extent [_bump, _bump_end); empty when equal
        # Who wants to know that `used` changed (kvtier.master.placement_order): this allocator puts
        # itself on the list at its first change since `watched` was cleared; None: nobody.
        self.watch: list[OffsetAllocator] | None = None
        self.watched = False
        if self.capacity:
            self._insert(0, self.capacity)

    def _changed(self) -> None:
        if self.watch is not None and not self.watched:
            self.watched = True
            self.watch.append(self)

    def aligned(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def free_extents(self) -> int:
        self._flush()
        return len(self._free_by_start)

    def free_spans(self) -> Iterator[tuple[int, int]]:
        """(start, size) of every free extent, in no particular order."""
        self._flush()
        return iter(self._free_by_start.items())

    def _flush(self) -> None:
        """Put the bump extent back into the maps."""
        if self._bump_end > self._bump:
            self._insert(self._bump, self._bump_end - self._bump)
        self._bump = self._bump_end = 0

    def allocate(self, size: int) -> int | None:
        """Offset of a new range of `size` bytes (> 0), or None when no extent fits."""
        if size <= 0:
            raise ValueError("allocation size must be positive")
        alignment = self.alignment
        size = -(-size // alignment) * alignment
        if size > self.capacity - self.used:
            return None
        start = self._bump
        if self._bump_end - start >= size:  # the hot path of a fill: no map is touched
            self._bump = start + size
            self.used += size
            self._changed()
            if self._allocated is not None:
                self._allocated[start] = size
            return start
        self._flush()
        own = size.bit_length() - 1
        bucket = self._bins[own]
        if bucket:
            for scanned, (start, extent) in enumerate(bucket.items()):
                if extent >= size:
                    return self._take(start, extent, size)
                if scanned >= _SCAN_OWN_BIN:
                    break
        larger = self._nonempty >> (own + 1)
        if not larger:
            return None
        index = own + 1 + ((larger & -larger).bit_length() - 1)
        # popitem is O(1); iterating a dict from the front skips every entry ever deleted
        # there, which grows without bound in a bin that once held many extents.
        bucket = self._bins[index]
        start, extent = bucket.popitem()
        if not bucket:
            self._nonempty &= ~(1 << index)
        del self._free_by_start[start]
        del self._free_by_end[start + extent]
        # A small range cut from a larger bin's extent: keep the rest aside as the bump extent.
        self._bump, self._bump_end = start + size, start + extent
        self.used += size
        self._changed()
        if self._allocated is not None:
            self._allocated[start] = size
        return start

    def reserve_ascending(self, offset: int, size: int) -> bool:
        """Mark [offset, offset + size) allocated, for rebuilding a region's books from an
        inventory sent in increasing offset order (ranges may only come after every range already
        reserved, so the range must lie in the free extent that ends the region). False, and
        nothing changes, when it does not: overlapping, out of order, misaligned or out of bounds.
        """
        size = self.aligned(size)
        self._flush()
        tail = self._free_by_end.get(self.capacity)
        if size <= 0 or offset % self.alignment or tail is None or not tail <= offset <= self.capacity - size:
            return False
        self._remove(tail, self.capacity - tail)
        if offset > tail:
            self._insert(tail, offset - tail)
        if offset + size < self.capacity:
            self._insert(offset + size, self.capacity - offset - size)
        self.used += size
        self._changed()
        if self._allocated is not None:
            self._allocated[offset] = size
        return True

    def reserve_free(self, offset: int, size: int) -> list[tuple[int, int]]:
        """Mark allocated whatever of [offset, offset + size) (widened to the alignment) is free now;
        the (start, size) pieces taken, each released later like any allocation of its size. For
        ranges something outside the books may still write (kvtier.master.range_book): a scan of the
        free extents, so for the rare caller, never the allocation path."""
        start = max(offset - offset % self.alignment, 0)
        end = min(self.aligned(offset + size), self.capacity)
        if start >= end:
            return []
        self._flush()
        taken = []
        for extent_start, extent in [(s, n) for s, n in self._free_by_start.items() if s < end and start < s + n]:
            cut_start, cut_end = max(extent_start, start), min(extent_start + extent, end)
            self._remove(extent_start, extent)
            if cut_start > extent_start:
                self._insert(extent_start, cut_start - extent_start)
            if extent_start + extent > cut_end:
                self._insert(cut_end, extent_start + extent - cut_end)
            self.used += cut_end - cut_start
            if self._allocated is not None:
                self._allocated[cut_start] = cut_end - cut_start
            taken.append((cut_start, cut_end - cut_start))
        if taken:
            self._changed()
        return taken

    def release(self, offset: int, size: int) -> None:
        """Return a range obtained from `allocate(size)`; merges with free neighbours."""
        size = self.aligned(size)
        self._flush()
        allocated = self._allocated
        if allocated is not None:
            if allocated.get(offset) != size:
                raise ValueError(f"release of a range that is not allocated: offset={offset} size={size}")
            del allocated[offset]
        elif (
            offset < 0
            or offset % self.alignment
            or offset + size > self.capacity
            or offset in self._free_by_start
            or offset + size in self._free_by_end
        ):
            raise ValueError(f"release of a range that is not allocated: offset={offset} size={size}")
        self.used -= size
        self._changed()
        end = offset + size
        after = self._free_by_start.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        before_start = self._free_by_end.get(offset)
        if before_start is not None:
            self._remove(before_start, offset - before_start)
            offset = before_start
        self._insert(offset, end - offset)

    def _take(self, start: int, extent: int, size: int) -> int:
        self._remove(start, extent)
        return self._carve(start, extent, size)

    def _carve(self, start: int, extent: int, size: int) -> int:
        """Allocate `size` bytes at the start of a free extent already unlinked from the free maps."""
        if extent > size:
            self._insert(start + size, extent - size)
        self.used += size
        self._changed()
        if self._allocated is not None:
            self._allocated[start] = size
        return start

    def _insert(self, start: int, size: int) -> None:
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start
        index = size.bit_length() - 1
        self._bins[index][start] = size
        self._nonempty |= 1 << index

    def _remove(self, start: int, size: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        index = size.bit_length() - 1
        bucket = self._bins[index]
        del bucket[start]
        if not bucket:
            self._nonempty &= ~(1 << index)
