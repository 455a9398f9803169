"""`kvtier bench --master-placement` (issue 19, many hosts): the in-process run puts through the
master's own state and spreads the keys over every segment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench.placement_bench import run_placement_bench

ARGS = [sys.executable, "-m", "kvtier.cli.main", "bench", "--master-placement"]


def test_each_segment_count_is_measured_and_every_segment_takes_keys():
    rows = run_placement_bench([1, 4, 16], batch=8, keys=64)
    assert [(r.segments, r.keys, r.segments_used) for r in rows] == [(1, 64, 1), (4, 64, 4), (16, 64, 16)]
    assert rows[0].vs_first == 1.0
    assert all(r.us_per_key > 0 and r.keys_per_s > 0 for r in rows)


def test_the_command_prints_json_and_refuses_bad_counts():
    args = [*ARGS, "--placement-keys", "32", "--json"]
    done = subprocess.run([*args, "--placement-segments", "1,3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["master_placement"]
    assert [(r["segments"], r["segments_used"]) for r in rows] == [(1, 1), (3, 3)]
    for bad_args in (["--placement-segments", "0,x"], ["--placement-segments", "2", "--batch", "64"]):
        bad = subprocess.run([*args, *bad_args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "--placement-segments" in bad.stderr, bad_args


def test_a_run_that_would_evict_is_refused_instead_of_measuring_eviction():
    with pytest.raises(ValueError, match="without eviction"):
        run_placement_bench([4, 1], batch=256, keys=256 * 1100)  # 1.1 GiB of 4 KiB keys, 1 GiB in one
    done = subprocess.run(
        [*ARGS, "--placement-segments", "1", "--placement-keys", str(300_000)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "--placement-keys" in done.stderr
