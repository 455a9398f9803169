"""`kvtier bench`: put/get throughput (GB/s) and latency (p50/p99) against a cluster.

Workloads per object size: single-key `put`, `get` (returns bytes), `get_into`
(caller's buffer), and `batch` keys at once through `batch_put`,
`batch_get` and `batch_get_into`. The client is this process; the segment
servers are other processes (started here when `--master` is not given), so
every byte crosses a process boundary as it would in production.

Puts always write fresh keys (a put of an existing key is a no-op) and remove
them, untimed, before they are ever read, so their space is freed at once;
gets re-read one set of keys written beforehand. Peak DRAM use is therefore
about two batches per size. Each figure is the median of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvtier.proto.units import format_size, parse_size

DEFAULT_SIZES = "64KiB,1MiB,4MiB"


@dataclass
class Result:
    workload: str
    size: int
    keys_per_op: int
    gbps: float  # decimal GB/s of payload, median over repeats
    ops_per_s: float  # operations (single calls) per second, median
    keys_per_s: float
    p50_ms: float
    p99_ms: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default="", help="master address; default: start a local cluster for the run")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="object sizes (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="keys per batch call (default: %(default)s)")
    parser.add_argument("--bytes-per-run", default="256MiB", help="payload per measured run (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--workloads", default="", help="comma list to run a subset, e.g. batch_put,batch_get_into")
    parser.add_argument("--transport", default="", help="force a transport scheme, e.g. tcp")
    parser.add_argument("--dram", default="1GiB", help="DRAM of the local cluster's segment (default: %(default)s)")
    parser.add_argument("--compare", choices=["redis"], default="", help="also run the workloads against this peer")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def machine_description() -> dict[str, str | int]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "memory": format_size(mem),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, client, batch: int, bytes_per_run: int, repeat: int) -> None:
        self.client = client
        self.batch = batch
        self.bytes_per_run = bytes_per_run
        self.repeat = repeat
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}"

    def measure(
        self,
        name: str,
        size: int,
        keys_per_op: int,
        ops: int,
        op: Callable[[int], None],
        cleanup: Callable[[int], None] | None = None,
    ) -> Result:
        rates, op_rates, latencies = [], [], []
        for rep in range(self.repeat):
            times = []
            for i in range(ops):
                started = time.perf_counter()
                op(rep * ops + i)
                times.append(time.perf_counter() - started)
                if cleanup is not None:
                    cleanup(rep * ops + i)
            total = sum(times)
            rates.append(ops * keys_per_op * size / total / 1e9)
            op_rates.append(ops / total)
            latencies.extend(times)
        ops_per_s = statistics.median(op_rates)
        return Result(
            name,
            size,
            keys_per_op,
            statistics.median(rates),
            ops_per_s,
            ops_per_s * keys_per_op,
            _percentile(latencies, 0.5) * 1e3,
            _percentile(latencies, 0.99) * 1e3,
        )

    def run_size(self, size: int, selected: set[str]) -> list[Result]:
        client, batch = self.client, self.batch
        source = bytearray(os.urandom(size * batch))
        values = [memoryview(source)[i * size : (i + 1) * size] for i in range(batch)]
        if hasattr(client, "prepare"):
            values = client.prepare(values)
        into = getattr(client, "supports_into", True)
        get_keys = [f"{self.prefix}/get/{size}/{i}" for i in range(batch)]
        statuses = client.batch_put(get_keys, values)
        if any(statuses):
            raise RuntimeError(f"could not store the read set: {sorted(set(s.name for s in statuses))}")
        buffers = [bytearray(size) for _ in range(batch)]
        batch_ops = max(3, self.bytes_per_run // (size * batch))
        single_ops = max(3 * batch, self.bytes_per_run // size // 4)
        results = []

        def want(name: str) -> bool:
            if name.endswith("_into") and not into:
                return False
            return not selected or name in selected

        def put_key(i: int) -> str:
            return f"{self.prefix}/put/{size}/{i}"

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise RuntimeError(f"{what} failed during the benchmark")

        if want("put"):
            results.append(
                self.measure(
                    "put",
                    size,
                    1,
                    single_ops,
                    lambda i: client.put(put_key(i), values[i % batch]),
                    lambda i: client.remove(put_key(i)),
                )
            )
        if want("get"):
            results.append(
                self.measure(
                    "get", size, 1, single_ops, lambda i: check(client.get(get_keys[i % batch]) is not None, "get")
                )
            )
        if want("get_into"):
            results.append(
                self.measure(
                    "get_into",
                    size,
                    1,
                    single_ops,
                    lambda i: check(client.get_into(get_keys[i % batch], buffers[i % batch]) == size, "get_into"),
                )
            )

        def batch_keys(i: int) -> list[str]:
            return [f"{self.prefix}/bput/{size}/{i}/{j}" for j in range(batch)]

        if want("batch_put"):
            results.append(
                self.measure(
                    "batch_put",
                    size,
                    batch,
                    batch_ops,
                    lambda i: check(not any(client.batch_put(batch_keys(i), values)), "batch_put"),
                    lambda i: client.batch_remove(batch_keys(i)),
                )
            )
        if want("batch_get"):
            results.append(
                self.measure(
                    "batch_get",
                    size,
                    batch,
                    batch_ops,
                    lambda i: check(None not in client.batch_get(get_keys), "batch_get"),
                )
            )
        if want("batch_get_into"):
            results.append(
                self.measure(
                    "batch_get_into",
                    size,
                    batch,
                    batch_ops,
                    lambda i: check(min(client.batch_get_into(get_keys, buffers)) == size, "batch_get_into"),
                )
            )
        if (want("get_into") or want("batch_get_into")) and bytes(buffers[0]) != bytes(values[0]):
            raise RuntimeError("benchmark read back different bytes")
        client.remove_prefix(self.prefix)
        return results


def print_table(results: list[Result], header: str) -> None:
    print(header)
    columns = ("workload", "size", "keys/op", "GB/s", "ops/s", "keys/s", "p50 ms", "p99 ms")
    widths = (-16, 8, 7, 7, 9, 9, 8, 8)
    print(" ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for r in results:
        print(
            f"{r.workload:<16} {format_size(r.size):>8} {r.keys_per_op:>7} {r.gbps:>7.2f} {r.ops_per_s:>9.0f} "
            f"{r.keys_per_s:>9.0f} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f}"
        )


def run(opts: argparse.Namespace) -> int:
    from kvtier.client import Client
    from kvtier.client.local_cluster import LocalCluster

    try:
        sizes = [parse_size(s) for s in opts.sizes.split(",") if s]
        bytes_per_run = parse_size(opts.bytes_per_run)
    except ValueError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    if opts.batch < 1 or opts.repeat < 1 or not sizes:
        print("kvtier bench: --batch, --repeat and --sizes must be positive", file=sys.stderr)
        return 2
    selected = {w for w in opts.workloads.split(",") if w}
    local = None
    master = opts.master
    if not master:
        local = LocalCluster(dram=opts.dram, quiet=True, cluster_id=f"bench{uuid.uuid4().hex[:6]}").start()
        master = local.master_address
    try:
        with Client(master, namespace="bench", timeout=30.0, transport=opts.transport) as client:
            results = run_driver(client, sizes, selected, opts.batch, bytes_per_run, opts.repeat)
    finally:
        if local is not None:
            local.stop()
    peer_results: list[Result] = []
    peer_name = ""
    if opts.compare == "redis":
        from kvtier.bench.redis_peer import RedisPeer

        try:
            peer = RedisPeer()
        except RuntimeError as exc:
            print(f"kvtier bench: cannot compare with redis: {exc}", file=sys.stderr)
            return 1
        peer_name = f"Redis {peer.version} (redis-py, {peer.parser} parser)"
        try:
            peer_results = run_driver(peer, sizes, selected, opts.batch, bytes_per_run, opts.repeat)
        finally:
            peer.close()
    machine = machine_description()
    transport = opts.transport or "auto"
    if opts.json:
        doc: dict = {"machine": machine, "transport": transport, "repeat": opts.repeat}
        doc["results"] = [asdict(r) for r in results]
        if peer_results:
            doc["peer"] = {"name": peer_name, "results": [asdict(r) for r in peer_results]}
        print(json.dumps(doc, indent=2))
        return 0
    header = (
        f"kvtier bench: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}, "
        f"Python {machine['python']}, transport {transport}, median of {opts.repeat}"
    )
    print_table(results, header)
    if peer_results:
        print()
        print_comparison(results, peer_results, peer_name)
    return 0


def run_driver(driver, sizes: list[int], selected: set[str], batch: int, bytes_per_run: int, repeat: int) -> list:
    bench = Bench(driver, batch, bytes_per_run, repeat)
    results = []
    for size in sizes:
        results.extend(bench.run_size(size, selected))
    return results


def print_comparison(ours: list[Result], peer: list[Result], peer_name: str) -> None:
    print(f"kvtier vs {peer_name}: GB/s side by side (ratio = kvtier / peer)")
    print(f"{'workload':<16} {'size':>9} {'kvtier':>8} {'peer':>8} {'ratio':>7}")
    theirs = {(r.workload, r.size): r for r in peer}
    for r in ours:
        other = theirs.get((r.workload, r.size))
        if other is None:
            continue
        ratio = r.gbps / other.gbps if other.gbps else float("inf")
        print(f"{r.workload:<16} {format_size(r.size):>9} {r.gbps:>8.2f} {other.gbps:>8.2f} {ratio:>6.2f}x")
