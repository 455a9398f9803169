"""What one small operation costs each process (`kvtier bench --compare redis`, local cluster only).

A 4 KiB put, get or 32-key batch_put crosses the client, the master and a segment server, each a
Python process; on loopback their round trips are a small part of its latency, the CPU each spends
on its share is most of it (docs/benchmarks.md, "Where a small operation's time goes"). This runs
each operation in a loop of its own over TCP and divides every process's CPU time (utime + stime,
/proc/<pid>/stat: its threads and its kernel time included) by the operations: the figures that
say where a latency target has to come from. The loop's own bookkeeping is the client's; the
keys it writes are removed afterwards, outside the measured loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvtier.bench.clients import cpu_seconds

SIZE = 4 << 10
BATCH = 32


@dataclass
class OpCpu:
    workload: str  # put, get, batch_put (of BATCH keys)
    ops: int
    wall_us: float  # mean wall time per operation
    client_us: float  # CPU per operation, this process (the client library and the loop)
    master_us: float
    segment_us: float  # the segments together


def measure_op_cpu(client, master_pid: int, segment_pids: list[int], ops: int = 3000) -> list[OpCpu]:
    """Per workload, mean wall time and CPU per operation of each process; `client` talks TCP to the
    cluster whose master and segments run as `master_pid` and `segment_pids`."""
    value = os.urandom(SIZE)
    values = [value] * BATCH
    read_set = [f"opcpu/get/{i}" for i in range(BATCH)]
    client.batch_put(read_set, values)
    for key in read_set:  # the get loop below re-reads them: found once, then read directly
        client.get(key)
    loops = {
        "put": (ops, lambda i: client.put(f"opcpu/put/{i}", value)),
        "get": (ops, lambda i: client.get(read_set[i % BATCH])),
        "batch_put": (
            max(1, ops // 4),
            lambda i: client.batch_put([f"opcpu/bput/{i}/{j}" for j in range(BATCH)], values),
        ),
    }
    out = []
    try:
        for name, (count, op) in loops.items():
            before = (time.process_time(), cpu_seconds(master_pid), sum(cpu_seconds(p) for p in segment_pids))
            started = time.perf_counter()
            for i in range(count):
                op(i)
            wall = time.perf_counter() - started
            after = (time.process_time(), cpu_seconds(master_pid), sum(cpu_seconds(p) for p in segment_pids))
            per_op = [(b - a) / count * 1e6 for a, b in zip(before, after, strict=True)]
            out.append(OpCpu(name, count, wall / count * 1e6, *per_op))
    finally:
        client.remove_prefix("opcpu/")
    return out


def print_op_cpu(rows: list[OpCpu]) -> None:
    print("What one operation costs each process over TCP (4 KiB; CPU from /proc: utime + stime, threads included)")
    print(f"{'workload':<16} {'ops':>6} {'wall us':>8} {'client us':>10} {'master us':>10} {'segment us':>11}")
    for r in rows:
        name = f"{r.workload} ({BATCH} keys)" if r.workload == "batch_put" else r.workload
        print(
            f"{name:<16} {r.ops:>6} {r.wall_us:>8.0f} {r.client_us:>10.0f} {r.master_us:>10.0f} {r.segment_us:>11.0f}"
        )
