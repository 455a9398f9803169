"""`kvtier bench --eviction` (issue 21): the in-process trace runs the master's own policies."""

from __future__ import annotations

from kvtier.bench.eviction_bench import run_eviction_bench, trace


def test_the_trace_is_seeded_and_has_its_four_phases():
    first, again = trace(100, 50, 300, 400), trace(100, 50, 300, 400)
    assert first == again
    assert [name for name, _ in first] == ["hot", "scan", "after scan", "later"]
    assert [len(keys) for _, keys in first] == [400, 300, 50, 350]


def test_s3fifo_keeps_more_of_the_hot_set_across_the_scan_than_lru():
    result = run_eviction_bench(capacity=100, hot=50, scan=500, reads=1000, memory_objects=20_000)
    by_policy = {run.policy: {p.name: p.hit_ratio for p in run.phases} for run in result.runs}
    assert set(by_policy) == {"lru", "s3fifo"}
    assert by_policy["lru"]["hot"] == by_policy["s3fifo"]["hot"]  # the same until the scan
    assert by_policy["lru"]["scan"] == by_policy["s3fifo"]["scan"] == 0.0
    assert by_policy["s3fifo"]["after scan"] > by_policy["lru"]["after scan"] + 0.2
    assert result.policy_bytes_per_object["lru"] == 0.0
    assert 0 < result.policy_bytes_per_object["s3fifo"] < 100
