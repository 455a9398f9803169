"""`kvtier bench --tier ssd --write` runs end to end on tiny sizes and reports figures that add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KVTIER = [sys.executable, "-m", "kvtier.cli.main", "bench", "--tier", "ssd", "--write"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=120)


def run_json(tmp_path: Path, *args: str) -> list[dict]:
    result = bench(*args, "--repeat", "1", "--ssd-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)["ssd_write"]
    for row in rows:
        assert row["gb_per_s"] > 0 and row["dd_same_bs_gb_per_s"] > 0 and row["dd_4m_gb_per_s"] > 0
        (rate,) = row["passes"]
        assert abs(row["ratio_same_bs"] - rate / row["dd_same_bs_gb_per_s"]) < 1e-9
        assert abs(row["ratio_4m"] - rate / row["dd_4m_gb_per_s"]) < 1e-9
        assert (row["put_gb_per_s"] > 0) == (row["path"] == "cluster")
    assert not list(tmp_path.rglob("*.kvb")) and not list(tmp_path.rglob("dd-baseline-*"))  # cleaned up
    return rows


def test_write_bench_reports_the_write_path_beside_its_dd_baseline(tmp_path: Path):
    sizes = ["--object-size", "64KiB", "--object-size", "1MiB"]
    rows = run_json(tmp_path, *sizes, "--ssd-bytes", "8MiB", "--write-paths", "group,serial")
    assert [(r["object_size"], r["path"]) for r in rows] == [
        (64 << 10, "group"), (64 << 10, "serial"), (1 << 20, "group"), (1 << 20, "serial"),
    ]  # fmt: skip


def test_write_bench_measures_a_local_cluster_offloading(tmp_path: Path):
    rows = run_json(
        tmp_path, "--object-size", "1MiB", "--ssd-bytes", "32MiB", "--dram", "16MiB", "--write-paths", "cluster"
    )
    assert [(r["object_size"], r["path"]) for r in rows] == [(1 << 20, "cluster")]


def test_write_bench_rejects_bad_options_in_one_line(tmp_path: Path):
    for args in (["--write-paths", "fast"], ["--object-size", "1000"], ["--object-size", "lots"]):
        result = bench(*args, "--ssd-dir", str(tmp_path))
        assert result.returncode == 2, args
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
