"""`kvtier bench --clients N`: N client processes at once against the cluster's segments (issue 19).

Each workload (32-key `batch_put` and `batch_get_into` per object size, per
transport) runs twice: one client process alone, then N client processes
together, every one doing the same work. The processes start each workload at
the same moment (a barrier with this process), and this process reads the
CPU time (utime + stime, /proc/<pid>/stat) of every client, every segment
server and the master right before and right after it, so the figures are:

- **aggregate GB/s**: payload bytes of all clients / the wall time from the
  start barrier until the last client finished;
- **per-client GB/s**: what each client moved while *every* client was
  running (from the last client's start to the first one's finish, the
  batch in flight at either end counted in proportion), and the largest
  deviation from their mean (issue 19: within 20%). Each client does the
  same fixed work, so its own bytes over its own time would not do: once the
  first one finishes, the others have the machine to themselves;
- **CPU seconds per GB** moved, clients, segment servers and the master
  apart: on a host with more cores than this one, that number decides how
  far it scales.

Puts write fresh keys and leave them until the workload is over (removing
them meanwhile would put the removals inside another client's window), so the
local cluster's segments get room for every client's puts of one workload:
N x ops x batch x size, spread over the segments.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.common.units import format_size

WORKLOADS = ("batch_put", "batch_get_into")
FAIRNESS = 0.2  # each client within 20% of the mean (issue 19)
_TICKS = os.sysconf("SC_CLK_TCK")
_BARRIER_S = 600.0  # a stuck client fails the run instead of hanging it


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` so far (its threads included), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # fields 14 and 15 of proc(5)


@dataclass
class ClientsResult:
    transport: str
    workload: str
    size: int
    clients: int
    aggregate_gbps: float
    per_client_gbps: list[float]
    max_deviation: float  # largest |client - mean| / mean
    errors: int
    client_cpu_s_per_gb: float
    segment_cpu_s_per_gb: float
    master_cpu_s_per_gb: float
    gb_moved: float
    fair: bool = field(default=False)


def _worker(
    master: str,
    transport: str,
    index: int,
    plan: list[tuple[int, str, int]],
    batch: int,
    start: Any,
    done: Any,
    results: Any,
) -> None:
    """One client process: for each (size, workload, ops) of `plan`, wait for the start barrier, run
    `ops` batches, report (bytes, busy seconds, errors, its start and each batch's end on the
    system-wide monotonic clock), wait for the end barrier."""
    from kvtier.client import Client

    prefix = f"clients-{os.getpid()}-{index}"
    with Client(master, namespace="bench-clients", timeout=30.0, transport=transport) as client:
        for size, workload, ops in plan:
            source = bytearray(os.urandom(size * batch))
            values = [memoryview(source)[i * size : (i + 1) * size] for i in range(batch)]
            read_keys = [f"{prefix}/get/{size}/{j}" for j in range(batch)]
            errors = sum(1 for s in client.batch_put(read_keys, values) if s)
            buffers = [bytearray(size) for _ in range(batch)]
            written: list[str] = []
            busy = 0.0
            start.wait(_BARRIER_S)
            marks = [time.monotonic()]  # CLOCK_MONOTONIC: one clock for every process of the host
            for i in range(ops):
                started = time.perf_counter()
                if workload == "batch_put":
                    keys = [f"{prefix}/put/{size}/{i}/{j}" for j in range(batch)]
                    errors += sum(1 for s in client.batch_put(keys, values) if s)
                    written += keys
                else:
                    errors += sum(1 for r in client.batch_get_into(read_keys, buffers) if r != size)
                busy += time.perf_counter() - started
                marks.append(time.monotonic())
            done.wait(_BARRIER_S)
            if workload == "batch_get_into" and bytes(buffers[0]) != bytes(values[0]):
                errors += 1  # read back other bytes than were written: never a figure
            results.put((index, size, workload, ops * batch * size, busy, errors, marks))
            client.batch_remove(written + read_keys)


def run_clients(
    master: str,
    transport: str,
    counts: list[int],
    sizes: list[int],
    batch: int,
    bytes_per_run: int,
    segment_pids: list[int],
    master_pid: int = 0,
    progress: Any = None,
) -> list[ClientsResult]:
    """Every (size, workload) with each client count of `counts` (e.g. [1, 4]), in that order."""
    context = multiprocessing.get_context("spawn")  # no inherited sockets, threads or mappings
    out: list[ClientsResult] = []
    for clients in counts:
        plan = [(size, w, max(3, bytes_per_run // (size * batch))) for size in sizes for w in WORKLOADS]
        start, done = context.Barrier(clients + 1), context.Barrier(clients + 1)
        results = context.Queue()
        procs = [
            context.Process(target=_worker, args=(master, transport, i, plan, batch, start, done, results), daemon=True)
            for i in range(clients)
        ]
        for p in procs:
            p.start()
        try:
            for size, workload, _ in plan:
                if progress is not None:
                    progress(f"{clients} client(s), {format_size(size)} {workload}")
                start.wait(_BARRIER_S)
                cpu_clients = [cpu_seconds(p.pid) for p in procs if p.pid is not None]
                cpu_segments = [cpu_seconds(pid) for pid in segment_pids]
                cpu_master = cpu_seconds(master_pid) if master_pid else 0.0
                began = time.perf_counter()
                done.wait(_BARRIER_S)
                wall = time.perf_counter() - began
                client_cpu = sum(cpu_seconds(p.pid) for p in procs if p.pid is not None) - sum(cpu_clients)
                segment_cpu = sum(cpu_seconds(pid) for pid in segment_pids) - sum(cpu_segments)
                master_cpu = cpu_seconds(master_pid) - cpu_master if master_pid else 0.0
                reports = [results.get(timeout=_BARRIER_S) for _ in procs]
                moved = sum(r[3] for r in reports)
                overlap = overlap_rates([r[6] for r in reports], batch * size)
                if overlap is None:  # never all at once (tiny runs): each client's bytes over its own time
                    rates = [r[3] / r[4] / 1e9 if r[4] else 0.0 for r in reports]
                else:
                    rates = [bytes_per_s / 1e9 for bytes_per_s in overlap]
                mean = statistics.mean(rates)
                deviation = max(abs(r - mean) for r in rates) / mean if mean else 1.0
                gb = moved / 1e9
                out.append(
                    ClientsResult(
                        transport,
                        workload,
                        size,
                        clients,
                        gb / wall,
                        [round(r, 3) for r in rates],
                        deviation,
                        sum(r[5] for r in reports),
                        client_cpu / gb,
                        segment_cpu / gb,
                        master_cpu / gb,
                        gb,
                        fair=deviation <= FAIRNESS,
                    )
                )
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return out


def overlap_rates(marks: list[list[float]], batch_bytes: int) -> list[float] | None:
    """Each client's bytes per second while every client ran: `marks` per client are its start and
    each batch's end (one clock); the window runs from the last start to the first finish, and the
    batch in flight at either edge counts in proportion to its time inside the window. None when
    the clients never all ran at once (one finished before another started)."""
    begin, end = max(m[0] for m in marks), min(m[-1] for m in marks)
    if end <= begin:
        return None
    return [(_bytes_by(m, end, batch_bytes) - _bytes_by(m, begin, batch_bytes)) / (end - begin) for m in marks]


def _bytes_by(marks: list[float], at: float, batch_bytes: int) -> float:
    """Bytes a client had moved at time `at`, linear within the batch in flight then."""
    if at <= marks[0]:
        return 0.0
    for done, (before, after) in enumerate(zip(marks, marks[1:], strict=False)):
        if at <= after:
            return (done + (at - before) / (after - before) if after > before else done + 1) * batch_bytes
    return (len(marks) - 1) * batch_bytes


def needed_dram(clients: int, sizes: list[int], batch: int, bytes_per_run: int, segments: int) -> int:
    """Bytes of DRAM per segment that one workload's puts of every client need, with room to spare."""
    per_client = max(max(3, bytes_per_run // (size * batch)) * size * batch + size * batch for size in sizes)
    return -(-2 * clients * per_client // segments)


def verdicts(results: list[ClientsResult]) -> list[dict[str, Any]]:
    """Per (transport, workload, size): issue 19's many-clients checks against the single client."""
    single = {(r.transport, r.workload, r.size): r for r in results if r.clients == 1}
    out = []
    for r in results:
        alone = single.get((r.transport, r.workload, r.size))
        if r.clients == 1 or alone is None:
            continue
        out.append(
            {
                "transport": r.transport,
                "workload": r.workload,
                "size": r.size,
                "clients": r.clients,
                "aggregate_vs_single": r.aggregate_gbps / alone.aggregate_gbps if alone.aggregate_gbps else 0.0,
                "fair": r.fair,
                "errors": r.errors,
                "met": r.aggregate_gbps >= alone.aggregate_gbps and r.fair and r.errors == 0,
            }
        )
    return out


def as_json(results: list[ClientsResult]) -> dict[str, Any]:
    return {"clients": [asdict(r) for r in results], "clients_verdicts": verdicts(results)}


def print_clients(results: list[ClientsResult]) -> None:
    print("Many clients: client processes at once against the segments (issue 19)")
    print(
        f"{'transport':<9} {'workload':<15} {'size':>8} {'clients':>7} {'agg GB/s':>8} {'dev':>5} {'errors':>6} "
        f"{'cpu s/GB client':>15} {'segment':>8} {'master':>7}  per-client GB/s"
    )
    for r in results:
        print(
            f"{r.transport:<9} {r.workload:<15} {format_size(r.size):>8} {r.clients:>7} {r.aggregate_gbps:>8.2f} "
            f"{r.max_deviation:>5.2f} {r.errors:>6} {r.client_cpu_s_per_gb:>15.3f} {r.segment_cpu_s_per_gb:>8.3f} "
            f"{r.master_cpu_s_per_gb:>7.3f}  " + " ".join(f"{x:.2f}" for x in r.per_client_gbps)
        )
    for v in verdicts(results):
        mark = "ok" if v["met"] else "NOT MET"
        print(
            f"{v['transport']} {v['workload']} {format_size(v['size'])}: {v['clients']} clients "
            f"{v['aggregate_vs_single']:.2f}x of one, fair={v['fair']}, errors={v['errors']}: {mark}"
        )
