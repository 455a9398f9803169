"""The client's remembered locations for direct reads (kvtier.client.locations)."""

from __future__ import annotations

from kvtier.client.locations import Location, LocationCache
from kvtier.proto import master_pb2 as pb


def _at(offset: int, until: float) -> Location:
    return Location(pb.SegmentEndpoint(name="s"), offset, 64, 1, b"", 0, until)


def test_entries_live_until_their_grant_ends_and_the_least_recently_used_leave_first():
    cache = LocationCache(2)
    cache.remember("a", _at(0, until=10.0))
    cache.remember("b", _at(64, until=20.0))
    assert cache.find(["x", "a", "b"], now=5.0) == {1: _at(0, 10.0), 2: _at(64, 20.0)}
    assert cache.find(["a"], now=5.0) == {0: _at(0, 10.0)}  # a is now the most recently used
    cache.remember("c", _at(128, until=20.0))  # over capacity: b leaves
    assert cache.find(["a", "b", "c"], now=5.0) == {0: _at(0, 10.0), 2: _at(128, 20.0)}
    assert cache.find(["a", "c"], now=10.0) == {1: _at(128, 20.0)}  # a's grant ended: dropped
    assert len(cache) == 1
    cache.forget(["c", "never"])
    assert len(cache) == 0 and cache.find(["c"], now=0.0) == {}
