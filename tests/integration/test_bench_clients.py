"""`kvtier bench --clients N`: client processes at once against two local segments (issue 19)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


@pytest.mark.slow  # ~7 s: make test-slow (CI runs it)
def test_bench_clients_runs_processes_together_and_accounts_cpu_per_gb():
    args = ["bench", "--clients", "2", "--sizes", "64KiB", "--batch", "4", "--bytes-per-run", "1MiB", "--json"]
    result = subprocess.run([*KVTIER, *args], capture_output=True, timeout=240)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    doc = json.loads(result.stdout)
    rows = {(r["transport"], r["workload"], r["clients"]): r for r in doc["clients"]}
    assert set(rows) == {(t, w, n) for t in ("tcp", "shm") for w in ("batch_put", "batch_get_into") for n in (1, 2)}
    for (_, _, clients), row in rows.items():
        assert row["errors"] == 0, row
        assert len(row["per_client_gbps"]) == clients and min(row["per_client_gbps"]) > 0
        # 4 batches of 4 x 64 KiB per client (1 MiB per run), read from /proc for every process
        assert row["gb_moved"] == clients * 4 * 4 * (64 << 10) / 1e9
        assert min(row[f"{role}_cpu_s_per_gb"] for role in ("client", "segment", "master")) >= 0
    # /proc counts in clock ticks (10 ms): a workload this small shows CPU in some rows, not in all
    assert sum(row["client_cpu_s_per_gb"] for row in rows.values()) > 0
    assert len(doc["clients_verdicts"]) == 4  # one per transport and workload, 2 clients against 1


def test_bench_clients_refuses_a_given_master():
    result = subprocess.run([*KVTIER, "bench", "--clients", "4", "--master", "127.0.0.1:1"], capture_output=True)
    assert result.returncode == 2 and b"--clients" in result.stderr
