"""OffsetAllocator: alignment, no overlap, full coalescing, and refusal of bad releases."""

from __future__ import annotations

import bisect
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.master.allocator import OffsetAllocator


def assert_consistent(alloc: OffsetAllocator, live: dict[int, int]) -> None:
    """Live allocations (offset -> requested size) are aligned, in bounds, disjoint, and account for `used`.

    Overlap is checked with an interval sweep over live allocations and the
    allocator's free extents together: sorted by start, each interval must end
    at or before the next one starts, and together they must tile the region.
    """
    intervals = [(offset, offset + alloc.aligned(size), "live") for offset, size in live.items()]
    intervals += [(start, start + size, "free") for start, size in alloc.free_spans()]
    intervals.sort()
    cursor = 0
    for start, end, kind in intervals:
        assert start % alloc.alignment == 0, f"{kind} interval at unaligned offset {start}"
        assert start >= cursor, f"{kind} interval [{start}, {end}) overlaps the previous one ending at {cursor}"
        assert start == cursor, f"gap [{cursor}, {start}) is neither allocated nor free"
        assert end > start
        cursor = end
    assert cursor == alloc.capacity
    assert alloc.used == sum(alloc.aligned(size) for size in live.values())
    assert alloc.free == alloc.capacity - alloc.used


def assert_live_disjoint(live: dict[int, int], alloc: OffsetAllocator) -> None:
    """Interval sweep over live allocations only (no allocator internals)."""
    previous_end = 0
    for offset in sorted(live):
        assert offset >= previous_end, f"allocation at {offset} overlaps one ending at {previous_end}"
        previous_end = offset + alloc.aligned(live[offset])
    assert previous_end <= alloc.capacity


def assert_empty(alloc: OffsetAllocator) -> None:
    assert alloc.used == 0
    assert alloc.free == alloc.capacity
    assert alloc.free_extents == 1, "freed space did not coalesce into one extent"
    assert dict(alloc.free_spans()) == {0: alloc.capacity}


# ---------------------------------------------------------------- basics


def test_sizes_are_rounded_up_to_the_alignment():
    alloc = OffsetAllocator(4096, alignment=64)
    a = alloc.allocate(1)
    b = alloc.allocate(64)
    c = alloc.allocate(65)
    assert alloc.used == 64 + 64 + 128
    assert {a, b, c} <= set(range(0, 4096, 64))
    assert_consistent(alloc, {a: 1, b: 64, c: 65})


def test_capacity_is_truncated_to_the_alignment():
    alloc = OffsetAllocator(1000, alignment=64)
    assert alloc.capacity == 960
    assert alloc.allocate(960) == 0
    assert alloc.allocate(1) is None


def test_capacity_below_alignment_has_no_space():
    alloc = OffsetAllocator(63, alignment=64)
    assert alloc.capacity == 0
    assert alloc.free_extents == 0
    assert alloc.allocate(1) is None


@pytest.mark.parametrize("alignment", [0, -64, 3, 48, 100])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match="power of two"):
        OffsetAllocator(4096, alignment=alignment)


@pytest.mark.parametrize("size", [0, -1])
def test_allocation_size_must_be_positive(size):
    with pytest.raises(ValueError):
        OffsetAllocator(4096).allocate(size)


def test_allocate_returns_none_when_full():
    alloc = OffsetAllocator(64 * 16, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(16)]
    assert sorted(offsets) == list(range(0, 64 * 16, 64))
    assert alloc.free == 0
    assert alloc.allocate(1) is None
    assert alloc.allocate(64) is None
    # Freeing one block makes exactly that much room again.
    alloc.release(offsets[5], 64)
    assert alloc.allocate(128) is None
    assert alloc.allocate(64) == offsets[5]


def test_allocate_larger_than_free_space_returns_none():
    alloc = OffsetAllocator(4096)
    assert alloc.allocate(4097) is None
    alloc.allocate(4000)
    assert alloc.allocate(128) is None
    assert alloc.used == 4032


def test_fragmented_free_space_returns_none_for_a_too_large_request():
    alloc = OffsetAllocator(64 * 8, alignment=64)
    blocks = [alloc.allocate(64) for _ in range(8)]
    for offset in blocks[::2]:  # free every other block: 4 x 64 bytes free, none adjacent
        alloc.release(offset, 64)
    assert alloc.free == 256
    assert alloc.free_extents == 4
    assert alloc.allocate(128) is None


def test_release_coalesces_with_both_neighbours():
    alloc = OffsetAllocator(64 * 3, alignment=64)
    a, b, c = (alloc.allocate(64) for _ in range(3))
    alloc.release(a, 64)
    alloc.release(c, 64)
    assert alloc.free_extents == 2
    alloc.release(b, 64)
    assert_empty(alloc)
    assert alloc.allocate(64 * 3) == 0


# ---------------------------------------------------------------- bad releases


def test_release_inside_free_space_raises():
    alloc = OffsetAllocator(1024)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(64, 64)
    assert_empty(alloc)


def test_release_at_start_of_free_extent_raises():
    alloc = OffsetAllocator(1024)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(0, 64)
    assert_empty(alloc)


def test_double_release_raises_even_after_coalescing():
    alloc = OffsetAllocator(1024)
    x, y, z = (alloc.allocate(64) for _ in range(3))
    alloc.release(y, 64)
    alloc.release(x, 64)  # merges with y: y's offset is now inside a free extent
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(y, 64)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(x, 64)
    assert_consistent(alloc, {z: 64})


def test_release_with_another_size_than_allocated_raises():
    alloc = OffsetAllocator(1024)
    a = alloc.allocate(128)
    b = alloc.allocate(64)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(a, 64)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(a, 256)
    assert_consistent(alloc, {a: 128, b: 64})
    alloc.release(a, 100)  # same size after alignment rounding: fine
    assert_consistent(alloc, {b: 64})


@pytest.mark.parametrize("offset", [-64, 1024, 960 + 64])
def test_release_out_of_bounds_raises(offset):
    alloc = OffsetAllocator(1024)
    alloc.allocate(1024)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(offset, 64)
    assert alloc.used == 1024


# ---------------------------------------------------------------- randomised


def test_random_fill_and_free_rounds_return_to_one_extent():
    rng = random.Random(20240611)
    capacity = 1 << 20
    alloc = OffsetAllocator(capacity, alignment=64)
    operations = 0
    for _ in range(12):
        live: dict[int, int] = {}
        starts: list[int] = []  # the live offsets, sorted: each new one is checked against its neighbours
        max_size = rng.choice([100, 4096, 40_000, capacity // 8])
        # Fill phase: mostly allocations, some frees, until several allocations are refused.
        refusals = 0
        while refusals < 5:
            operations += 1
            if live and rng.random() < 0.3:
                offset = starts.pop(rng.randrange(len(starts)))
                alloc.release(offset, live.pop(offset))
                continue
            size = rng.randint(1, max_size)  # rarely a multiple of 64: exercises rounding
            offset = alloc.allocate(size)
            if offset is None:
                refusals += 1
                continue
            assert offset % 64 == 0
            assert offset + alloc.aligned(size) <= capacity
            assert offset not in live
            at = bisect.bisect_left(starts, offset)
            assert at == 0 or starts[at - 1] + alloc.aligned(live[starts[at - 1]]) <= offset, "overlaps the one before"
            assert at == len(starts) or offset + alloc.aligned(size) <= starts[at], "overlaps the one after"
            starts.insert(at, offset)
            live[offset] = size
        assert_live_disjoint(live, alloc)
        assert_consistent(alloc, live)
        # Free phase: everything, in random order.
        order = list(live)
        rng.shuffle(order)
        for offset in order:
            operations += 1
            alloc.release(offset, live.pop(offset))
        assert_empty(alloc)
    assert operations > 3000


def test_random_interleaved_operations_keep_invariants():
    rng = random.Random(7)
    alloc = OffsetAllocator(256 * 1024 + 100, alignment=256)
    live: dict[int, int] = {}
    for step in range(5000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        else:
            size = rng.choice([1, 255, 256, 257, rng.randint(1, 20_000)])
            offset = alloc.allocate(size)
            if offset is not None:
                live[offset] = size
        if step % 250 == 0:
            assert_consistent(alloc, live)
    assert_consistent(alloc, live)
    for offset in list(live):
        alloc.release(offset, live.pop(offset))
    assert_empty(alloc)


# ---------------------------------------------------------------- property


@settings(max_examples=150, deadline=None)
@given(
    alignment=st.sampled_from([1, 8, 64, 4096]),
    capacity=st.integers(min_value=0, max_value=1 << 16),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(min_value=1, max_value=1 << 14), st.integers(min_value=0)),
        max_size=120,
    ),
)
def test_property_allocations_never_overlap_and_coalesce_fully(alignment, capacity, ops):
    alloc = OffsetAllocator(capacity, alignment=alignment)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            offset = alloc.allocate(size)
            if offset is None:
                assert alloc.aligned(size) > alloc.free or alloc.free_extents > 1
                continue
            assert offset % alignment == 0
            assert 0 <= offset and offset + alloc.aligned(size) <= alloc.capacity
            live[offset] = size
        else:
            offset = sorted(live)[pick % len(live)]
            alloc.release(offset, live.pop(offset))
        assert_live_disjoint(live, alloc)
    assert_consistent(alloc, live)
    if live:  # a stale second release of something already freed must raise
        offset = next(iter(live))
        alloc.release(offset, live.pop(offset))
        with pytest.raises(ValueError):
            alloc.release(offset, alignment)
    for offset in list(live):
        alloc.release(offset, live.pop(offset))
    assert alloc.used == 0
    assert alloc.free_extents == (1 if alloc.capacity else 0)


@pytest.mark.parametrize("track", [True, False])
def test_fills_from_the_bump_extent_interleaved_with_releases_keep_the_region_tiled(track):
    # given a fill of small ranges (served from the bump extent, no map updates), with releases
    # and other sizes interleaved and no consistency check in between (that would flush the bump)
    alloc = OffsetAllocator(1 << 20, 64, track=track)
    rng = random.Random(5)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and rng.random() < 0.3:
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        else:
            size = 64 if rng.random() < 0.8 else rng.choice([1, 100, 4096, 9000])
            offset = alloc.allocate(size)
            if offset is not None:
                live[offset] = size
        if step % 997 == 0:
            assert alloc.used == sum(alloc.aligned(s) for s in live.values())
    # then the live ranges and the free extents tile the region exactly
    assert_consistent(alloc, live)
    # and (tracked: always; untracked, the master's mode, only at a free extent's edge) a double
    # release is still refused after the bump extent went back into the maps
    offset = next(iter(live))
    alloc.release(offset, live.pop(offset))
    if track:
        with pytest.raises(ValueError, match="not allocated"):
            alloc.release(offset, 64)
    for offset, size in list(live.items()):
        alloc.release(offset, size)
    assert_empty(alloc)


def test_reserve_free_takes_only_the_free_parts_of_a_range_and_they_release_like_allocations():
    allocator = OffsetAllocator(1 << 16, alignment=64)
    first = allocator.allocate(1024)  # [0, 1024)
    second = allocator.allocate(1024)  # [1024, 2048)
    allocator.release(first, 1024)
    # a range over [0, 3000): [0, 1024) is free, [1024, 2048) allocated, [2048, 3008) free once aligned
    taken = allocator.reserve_free(10, 2990)
    assert sorted(taken) == [(0, 1024), (2048, 960)]
    assert allocator.used == 1024 + 1024 + 960
    assert allocator.reserve_free(0, 3000) == [], "nothing of it is free any more"
    assert all(allocator.allocate(64) >= 3008 for _ in range(4))
    for start, size in taken:
        allocator.release(start, size)
    allocator.release(second, 1024)
    assert allocator.reserve_free(1 << 16, 64) == [] and allocator.reserve_free(-64, 64) == []
    assert allocator.used == 4 * 64


def test_reserve_free_keeps_a_tracked_allocator_exact():
    allocator = OffsetAllocator(1 << 12, alignment=64, track=True)
    assert allocator.reserve_free(100, 100) == [(64, 192)]
    with pytest.raises(ValueError):
        allocator.release(64, 64)  # not what was taken
    allocator.release(64, 192)
    assert allocator.used == 0 and allocator.free_extents == 1
