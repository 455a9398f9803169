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
A line per phase (size and workload) goes to stderr as it starts, so a long
run shows where it is; stdout carries only the results (`--json` stays parseable).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvtier.bench.eviction_bench import add_arguments as add_eviction_arguments
from kvtier.bench.limits import (
    LATENCY_RATIOS,
    ROUND_TRIPS,
    WIRE_SIZES,
    WIRE_WORKLOADS,
    Limits,
    echo_round_trip_ms,
    measure_limits,
    wire_target,
)
from kvtier.bench.master_bench import add_arguments as add_master_arguments
from kvtier.bench.op_cpu import OpCpu, measure_op_cpu, print_op_cpu
from kvtier.bench.placement_bench import add_arguments as add_placement_arguments
from kvtier.bench.recovery_bench import add_arguments as add_recovery_arguments
from kvtier.bench.scan_bench import add_arguments as add_scan_arguments
from kvtier.common.units import format_size, parse_size

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
    parser.add_argument(
        "--threads",
        default="",
        help="client threads sharing one client (default: 1; --tier ssd: a comma list, default 1,4)",
    )
    parser.add_argument("--workloads", default="", help="comma list to run a subset, e.g. batch_put,batch_get_into")
    parser.add_argument(
        "--transport",
        default="",
        help="transport schemes to measure, comma list (default: tcp,shm on the local cluster; auto with --master)",
    )
    parser.add_argument("--dram", default="1GiB", help="DRAM of the local cluster's segment (default: %(default)s)")
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="N client processes at once against 2 local segments, beside one alone: aggregate, fairness, "
        "CPU seconds per GB (32-key batch_put and batch_get_into; default: off)",
    )
    parser.add_argument("--compare", choices=["redis"], default="", help="also run the workloads against this peer")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument(
        "--secure",
        action="store_true",
        help="the local cluster runs with a fresh cluster secret: authentication and data-plane capabilities",
    )
    parser.add_argument("--tier", choices=["dram", "ssd"], default="dram", help="ssd: reads from the SSD tier vs dd")
    parser.add_argument("--ssd-bytes", default="1GiB", help="--tier ssd: bytes put on the SSD tier")
    parser.add_argument("--ssd-dir", default="", help="--tier ssd: a directory on the disk to measure (.kvtier)")
    parser.add_argument(
        "--mount",
        action="store_true",
        help="--tier ssd: time mounting a tier of --ssd-bytes (cold page cache; dropping it needs root)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="--tier ssd: the DRAM->SSD offload rate (per --object-size) beside a dd oflag=direct baseline",
    )
    parser.add_argument(
        "--object-size",
        action="append",
        default=[],
        help="--tier ssd --write: object size, repeatable (default: 64KiB, 1MiB and 4MiB)",
    )
    parser.add_argument(
        "--write-paths",
        default="group,cluster",
        help="--tier ssd --write: what to measure, comma list of group (the segment's write path alone), "
        "serial (one append per record, the path before the group writer), cluster (a local master and "
        "segment under a fast writer) (default: %(default)s)",
    )
    parser.add_argument(
        "--ssd-read-coalesce",
        default="",
        help="--tier ssd: the segment's --ssd-read-coalesce (default: the segment's; 0 reads every record alone)",
    )
    add_master_arguments(parser)
    add_scan_arguments(parser)
    add_placement_arguments(parser)
    add_recovery_arguments(parser)
    add_eviction_arguments(parser)


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
    """Runs each workload `repeat` times from `threads` client threads sharing one client."""

    def __init__(
        self,
        client,
        batch: int,
        bytes_per_run: int,
        repeat: int,
        threads: int = 1,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.progress = progress
        self.batch = batch
        self.bytes_per_run = bytes_per_run
        self.repeat = repeat
        self.threads = threads
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}"

    def measure(
        self,
        name: str,
        size: int,
        keys_per_op: int,
        ops: int,
        op: Callable[[int, int], None],
        cleanup: Callable[[int, int], None] | None = None,
    ) -> Result:
        """Time `ops` calls of op(thread, i) per thread; cleanup(thread, i) runs untimed after each."""
        rates, op_rates, latencies = [], [], []
        for rep in range(self.repeat):
            times = self._run_once(range(rep * ops, (rep + 1) * ops), op, cleanup)
            busy = [sum(per_thread) for per_thread in times]
            # Threads overlap, so the slowest thread's busy time bounds the run.
            elapsed = max(busy)
            rates.append(self.threads * ops * keys_per_op * size / elapsed / 1e9)
            op_rates.append(self.threads * ops / elapsed)
            latencies.extend(x for per_thread in times for x in per_thread)
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

    def _run_once(
        self, indices: range, op: Callable[[int, int], None], cleanup: Callable[[int, int], None] | None
    ) -> list[list[float]]:
        """Per thread, the duration of each op(thread, i) for i in `indices`."""
        times: list[list[float]] = [[] for _ in range(self.threads)]
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for i in indices:
                    started = time.perf_counter()
                    op(t, i)
                    times[t].append(time.perf_counter() - started)
                    if cleanup is not None:
                        cleanup(t, i)
            except BaseException as exc:  # surfaced below, in the calling thread
                errors.append(exc)

        if self.threads == 1:
            worker(0)
        else:
            workers = [threading.Thread(target=worker, args=(t,)) for t in range(self.threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        if errors:
            raise errors[0]
        return times

    def run_size(self, size: int, selected: set[str]) -> list[Result]:
        client, batch, threads = self.client, self.batch, self.threads
        source = bytearray(os.urandom(size * batch))
        values = [memoryview(source)[i * size : (i + 1) * size] for i in range(batch)]
        if hasattr(client, "prepare"):
            values = client.prepare(values)
        into = getattr(client, "supports_into", True)
        get_keys = [f"{self.prefix}/get/{size}/{i}" for i in range(batch)]
        statuses = client.batch_put(get_keys, values)
        if any(statuses):
            raise RuntimeError(f"could not store the read set: {sorted(set(s.name for s in statuses))}")
        buffers = [[bytearray(size) for _ in range(batch)] for _ in range(threads)]  # per thread
        batch_ops = max(3, self.bytes_per_run // (size * batch * threads))
        single_ops = max(3 * batch, self.bytes_per_run // size // 4 // threads)
        results = []

        def want(name: str) -> bool:
            if name.endswith("_into") and not into:
                return False
            return not selected or name in selected

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise RuntimeError(f"{what} failed during the benchmark")

        def put_key(t: int, i: int) -> str:
            return f"{self.prefix}/put/{size}/{t}/{i}"

        def batch_keys(t: int, i: int) -> list[str]:
            return [f"{self.prefix}/bput/{size}/{t}/{i}/{j}" for j in range(batch)]

        workloads: list[tuple[str, int, int, Callable[[int, int], None], Callable[[int, int], None] | None]] = [
            (
                "put",
                1,
                single_ops,
                lambda t, i: client.put(put_key(t, i), values[i % batch]),
                lambda t, i: client.remove(put_key(t, i)),
            ),
            ("get", 1, single_ops, lambda t, i: check(client.get(get_keys[i % batch]) is not None, "get"), None),
            (
                "get_into",
                1,
                single_ops,
                lambda t, i: check(client.get_into(get_keys[i % batch], buffers[t][i % batch]) == size, "get_into"),
                None,
            ),
            (
                "batch_put",
                batch,
                batch_ops,
                lambda t, i: check(not any(client.batch_put(batch_keys(t, i), values)), "batch_put"),
                lambda t, i: client.batch_remove(batch_keys(t, i)),
            ),
            (
                "batch_get",
                batch,
                batch_ops,
                lambda t, i: check(None not in client.batch_get(get_keys), "batch_get"),
                None,
            ),
            (
                "batch_get_into",
                batch,
                batch_ops,
                lambda t, i: check(min(client.batch_get_into(get_keys, buffers[t])) == size, "batch_get_into"),
                None,
            ),
        ]
        chosen = [w for w in workloads if want(w[0])]
        for step, (name, keys_per_op, ops, op, cleanup) in enumerate(chosen, 1):
            if self.progress is not None:
                self.progress(
                    f"{format_size(size)} {name} ({step}/{len(chosen)}): {self.repeat} x {ops} ops "
                    f"of {keys_per_op} key(s) from {threads} thread(s)"
                )
            results.append(self.measure(name, size, keys_per_op, ops, op, cleanup))
        if (want("get_into") or want("batch_get_into")) and bytes(buffers[0][0]) != bytes(values[0]):
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


def _run_ssd_write(opts: argparse.Namespace) -> int:
    from kvtier.bench.ssd_write_bench import print_write_results, run_cluster_write_bench, run_write_bench

    try:
        sizes = [parse_size(s) for s in opts.object_size] or [64 << 10, 1 << 20, 4 << 20]
        total = parse_size(opts.ssd_bytes)
    except ValueError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    paths = [p for p in opts.write_paths.split(",") if p]
    unknown = set(paths) - {"group", "serial", "cluster"}
    if unknown or not paths or opts.repeat < 1 or any(s < 4096 for s in sizes):
        print(
            "kvtier bench: --write-paths takes group, serial, cluster; --repeat >= 1; --object-size >= 4KiB",
            file=sys.stderr,
        )
        return 2
    # A small DRAM (unless --dram says otherwise) so that offload, not DRAM, has to take the writes.
    dram = opts.dram if opts.dram != "1GiB" else "128MiB"
    progress = _progress("ssd write")
    results = []
    for size in sizes:
        isolated = [p for p in paths if p != "cluster"]
        if isolated:
            progress(f"{format_size(size)} objects: {', '.join(isolated)}")
            results += run_write_bench(total, size, opts.repeat, opts.ssd_dir, isolated)
        if "cluster" in paths:
            progress(f"{format_size(size)} objects: cluster")
            results.append(run_cluster_write_bench(total, size, opts.repeat, opts.ssd_dir, dram))
    print_write_results(results, opts.json, machine_description())
    return 0


def _run_clients(opts: argparse.Namespace, sizes: list[int], bytes_per_run: int) -> int:
    """`--clients N`: kvtier.bench.clients against a local cluster of two segments."""
    from kvtier.bench.clients import as_json, needed_dram, print_clients, run_clients
    from kvtier.common.local_cluster import LocalCluster

    if opts.master or opts.clients < 1:
        print("kvtier bench: --clients takes a positive count and runs its own cluster (no --master)", file=sys.stderr)
        return 2
    transports = [t.strip() for t in opts.transport.split(",") if t.strip()] or ["tcp", "shm"]
    dram = max(parse_size(opts.dram), needed_dram(opts.clients, sizes, opts.batch, bytes_per_run, 2))
    results = []
    with LocalCluster(dram=str(dram), segments=2, quiet=True, cluster_id=f"bench{uuid.uuid4().hex[:6]}") as local:
        master_pid, segment_pids = local.children[0].pid, [child.pid for child in local.children[1:]]
        for transport in transports:
            counts = [1, opts.clients] if opts.clients > 1 else [1]
            results += run_clients(
                local.master_address, transport, counts, sizes, opts.batch, bytes_per_run, segment_pids,
                master_pid, _progress(f"kvtier {transport}"),
            )  # fmt: skip
    if opts.json:
        print(json.dumps({"machine": machine_description(), **as_json(results)}, indent=2))
    else:
        print_clients(results)
    return 0


def run(opts: argparse.Namespace) -> int:
    from kvtier.client import Client
    from kvtier.common.local_cluster import LocalCluster

    try:
        sizes = [parse_size(s) for s in opts.sizes.split(",") if s]
        bytes_per_run = parse_size(opts.bytes_per_run)
    except ValueError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    try:
        thread_counts = [int(t) for t in opts.threads.split(",") if t.strip()]
        thread_counts = thread_counts or ([1, 4] if opts.tier == "ssd" else [1])
    except ValueError:
        print(f"kvtier bench: --threads takes whole numbers, got {opts.threads!r}", file=sys.stderr)
        return 2
    if opts.tier != "ssd" and len(thread_counts) != 1:
        print("kvtier bench: a list of --threads is for --tier ssd only", file=sys.stderr)
        return 2
    opts.threads = thread_counts[0]
    if opts.batch < 1 or opts.repeat < 1 or min(thread_counts) < 1 or not sizes:
        print("kvtier bench: --batch, --repeat, --threads and --sizes must be positive", file=sys.stderr)
        return 2
    if opts.secure and opts.master:
        print("kvtier bench: --secure is for the local cluster; for yours, set KVTIER_SECRET_FILE", file=sys.stderr)
        return 2
    if opts.secure:  # the local cluster's processes inherit it; this process's clients read it too
        import secrets

        os.environ["KVTIER_SECRET"] = secrets.token_hex(32)
    if opts.eviction:
        from kvtier.bench.eviction_bench import check_arguments, print_eviction_result, run_eviction_bench

        if problem := check_arguments(opts):
            print(f"kvtier bench: {problem}", file=sys.stderr)
            return 2
        result = run_eviction_bench(
            opts.eviction_capacity,
            opts.eviction_hot,
            opts.eviction_scan,
            opts.eviction_reads,
            opts.eviction_cluster,
            opts.eviction_cluster_scale,
        )
        print_eviction_result(result, opts.json, machine_description())
        return 0
    if opts.master_placement:
        from kvtier.bench.placement_bench import print_placement_result, run_placement_bench, too_many_keys

        try:
            counts = [int(c) for c in opts.placement_segments.split(",") if c.strip()]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1 or opts.batch < 1 or opts.placement_keys < opts.batch:
            print(
                "kvtier bench: --placement-segments (counts >= 1) and --batch must be positive, "
                "--placement-keys at least --batch",
                file=sys.stderr,
            )
            return 2
        if too_many_keys(counts, opts.placement_keys):
            print("kvtier bench: --placement-keys: more 4 KiB keys than the fewest segments hold", file=sys.stderr)
            return 2
        rows = run_placement_bench(counts, opts.batch, opts.placement_keys)
        print_placement_result(rows, opts.batch, opts.json, machine_description())
        return 0
    if opts.master_scan:
        from kvtier.bench.scan_bench import print_scan_result, run_scan_bench
        from kvtier.master.sweeps import DEFAULT_SLICE, DEFAULT_SLICE_MS

        if (
            opts.objects < 1000
            or opts.scan_objects < 0
            or opts.scan_slice < 0
            or opts.scan_slice_ms < 0
            or opts.scan_interval_ms <= 0
        ):
            print("kvtier bench: --objects (>= 1000), --scan-* must be positive", file=sys.stderr)
            return 2
        result = run_scan_bench(
            opts.objects,
            opts.scan_objects,
            opts.scan_slice or DEFAULT_SLICE,
            opts.scan_slice_ms or DEFAULT_SLICE_MS,
            opts.scan_interval_ms,
        )
        print_scan_result(result, opts.json, machine_description())
        return 0
    if opts.master_only:
        from kvtier.bench.master_bench import print_master_result, run_master_bench

        if opts.objects < 1 or opts.master_batch < 1 or opts.cycles < 0:
            print("kvtier bench: --objects and --master-batch must be positive", file=sys.stderr)
            return 2
        checkpoints = None
        if opts.master_checkpoints is not None:
            text = opts.master_checkpoints.strip().lower()
            try:
                checkpoints = [] if text in ("", "none") else [int(parse_size(c)) for c in text.split(",")]
            except ValueError as exc:
                print(f"kvtier bench: --master-checkpoints: {exc}", file=sys.stderr)
                return 2
        result = run_master_bench(opts.objects, opts.master_batch, opts.cycles, checkpoints)
        print_master_result(result, opts.json, machine_description())
        return 0
    if opts.recovery or opts.failover:
        from kvtier.bench.recovery_bench import run_recovery

        return run_recovery(opts, machine_description())
    if opts.tier == "ssd" and opts.mount:
        from kvtier.bench.ssd_mount_bench import print_mount_result, run_mount_bench

        size = sizes[0] if opts.sizes != DEFAULT_SIZES else 1 << 20  # 1 MiB records by default
        print_mount_result(
            run_mount_bench(parse_size(opts.ssd_bytes), size, opts.ssd_dir), opts.json, machine_description()
        )
        return 0
    if opts.tier == "ssd" and opts.write:
        return _run_ssd_write(opts)
    if opts.tier == "ssd":
        from kvtier.bench.ssd_bench import print_ssd_results, run_ssd_bench

        ssd_sizes = sizes if opts.sizes != DEFAULT_SIZES else [1 << 20, 4 << 20]  # issue 17's two sizes
        ssd_results = []
        for size in ssd_sizes:
            ssd_results += run_ssd_bench(
                parse_size(opts.ssd_bytes),
                size,
                opts.batch,
                opts.repeat,
                opts.ssd_dir,
                thread_counts,
                _progress("kvtier"),
                segment_args=("--ssd-read-coalesce", opts.ssd_read_coalesce) if opts.ssd_read_coalesce else (),
            )
        print_ssd_results(ssd_results, opts.json, machine_description(), opts.repeat)
        return 0
    if opts.clients:
        return _run_clients(opts, sizes, bytes_per_run)
    selected = {w for w in opts.workloads.split(",") if w}
    # Both same-host transports by default on the local cluster (issue 19 reads each against its limit);
    # against a given master, whatever the client picks unless told.
    transports = [t.strip() for t in opts.transport.split(",") if t.strip()] or (
        ["tcp", "shm"] if not opts.master else [""]
    )
    local = None
    master = opts.master
    if not master:
        local = LocalCluster(dram=opts.dram, quiet=True, cluster_id=f"bench{uuid.uuid4().hex[:6]}").start()
        master = local.master_address
    _progress("limits")("memcpy and a Python loopback stream, before")
    before = measure_limits(opts.repeat)
    by_transport: dict[str, list[Result]] = {}
    small: list[Result] = []
    peer_small: list[Result] = []
    op_cpu: list[OpCpu] = []
    peer_results: list[Result] = []
    peer_name = ""
    peer = None
    echo_ms = 0.0
    try:
        for transport in transports:
            with Client(master, namespace="bench", timeout=30.0, transport=transport) as client:
                by_transport[transport or "auto"] = run_driver(
                    client, sizes, selected, opts.batch, bytes_per_run, opts.repeat, opts.threads,
                    _progress(f"kvtier {transport or 'auto'}"),
                )  # fmt: skip
        if opts.compare == "redis":
            from kvtier.bench.redis_peer import RedisPeer

            try:
                peer = RedisPeer()
            except RuntimeError as exc:
                print(f"kvtier bench: cannot compare with redis: {exc}", file=sys.stderr)
                return 1
            peer_name = f"Redis {peer.version} (redis-py, {peer.parser} parser)"
            peer_results = run_driver(
                peer, sizes, selected, opts.batch, bytes_per_run, opts.repeat, opts.threads, _progress("redis")
            )
            # Issue 19's small-operation ratios: 4 KiB over TCP, each side in the same run.
            with Client(master, namespace="bench", timeout=30.0, transport="tcp") as client:
                small = run_driver(
                    client, [SMALL], SMALL_WORKLOADS, 32, SMALL_BYTES, opts.repeat, 1, _progress("kvtier tcp")
                )
                if local is not None:  # its processes' CPU is ours to read (/proc)
                    _progress("kvtier tcp")("CPU per small operation, each process")
                    op_cpu = measure_op_cpu(client, local.children[0].pid, [child.pid for child in local.children[1:]])
            peer_small = run_driver(peer, [SMALL], SMALL_WORKLOADS, 32, SMALL_BYTES, opts.repeat, 1, _progress("redis"))
            _progress("limits")("a 64-byte echo round trip to a uvloop server")
            echo_ms = echo_round_trip_ms()
    finally:
        if peer is not None:
            peer.close()
        if local is not None:
            local.stop()
    _progress("limits")("memcpy and a Python loopback stream, after")
    limits = before.best(measure_limits(opts.repeat))  # the higher of each: ratios never flatter us
    machine = machine_description()
    if opts.json:
        doc: dict = {"machine": machine, "repeat": opts.repeat, "threads": opts.threads}
        doc["limits"] = asdict(limits)
        doc["transports"] = {t: [asdict(r) for r in rs] for t, rs in by_transport.items()}
        if len(by_transport) == 1:  # the earlier shape, kept for scripts that read it
            doc["transport"], results = next(iter(by_transport.items()))
            doc["results"] = [asdict(r) for r in results]
        doc["wire"] = [asdict(w) for w in wire_ratios(by_transport, limits)]
        if peer_results:
            doc["peer"] = {"name": peer_name, "results": [asdict(r) for r in peer_results]}
            doc["small_ops"] = [asdict(r) for r in latency_ratios(small, peer_small, echo_ms)]
            doc["echo_round_trip_ms"] = echo_ms
            doc["op_cpu"] = [asdict(r) for r in op_cpu]
        print(json.dumps(doc, indent=2))
        return 0
    for transport, results in by_transport.items():
        header = (
            f"kvtier bench: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}, Python "
            f"{machine['python']}, transport {transport}, {opts.threads} client thread(s), median of {opts.repeat}"
        )
        print_table(results, header)
        print()
    print_wire(wire_ratios(by_transport, limits), limits)
    if peer_results:
        print()
        print_comparison(by_transport[next(iter(by_transport))], peer_results, peer_name)
        print()
        print_latency_ratios(latency_ratios(small, peer_small, echo_ms), peer_name, echo_ms)
        if op_cpu:
            print()
            print_op_cpu(op_cpu)
    return 0


@dataclass
class WireRatio:
    transport: str
    workload: str
    size: int
    gbps: float
    limit_gbps: float
    ratio: float
    target: str  # e.g. ">= 0.80 of loopback", ">= 1.5 GB/s"
    met: bool


@dataclass
class LatencyRatio:
    name: str
    ours_p50_ms: float
    peer_p50_ms: float
    ratio: float
    target: float
    met: bool
    round_trips: int = 0  # the operation's round trips (bench/limits.py: ROUND_TRIPS)
    floor_ratio: float = 0.0  # round_trips x the echo round trip / the peer's p50: no request costs less


SMALL = 4 << 10
SMALL_WORKLOADS = {"put", "get", "batch_put"}
SMALL_BYTES = 4 << 20  # 256 single ops (3 x 32 at least) and 32 batches per run


def wire_ratios(by_transport: dict[str, list[Result]], limits: Limits) -> list[WireRatio]:
    """Each batch put / get_into figure of the wire sizes, as a ratio of its transport's limit."""
    out = []
    for transport, results in by_transport.items():
        limit = limits.of(transport)
        for r in results:
            if r.workload not in WIRE_WORKLOADS or r.size not in WIRE_SIZES:
                continue
            kind, target = wire_target(transport, r.size)
            ratio = r.gbps / limit if limit else 0.0
            if kind == "GB/s":
                out.append(
                    WireRatio(
                        transport, r.workload, r.size, r.gbps, limit, ratio, f">= {target} GB/s", r.gbps >= target
                    )
                )
            else:
                name = "memcpy" if transport == "shm" else "loopback"
                out.append(
                    WireRatio(
                        transport,
                        r.workload,
                        r.size,
                        r.gbps,
                        limit,
                        ratio,
                        f">= {target:.2f} of {name}",
                        ratio >= target,
                    )
                )
    return out


def latency_ratios(ours: list[Result], peer: list[Result], echo_ms: float = 0.0) -> list[LatencyRatio]:
    """Each small-operation ratio, beside its round-trip floor when `echo_ms` (an echo round trip) is known."""
    mine = {r.workload: r for r in ours}
    theirs = {r.workload: r for r in peer}
    out = []
    for name, (workload, peer_workload, target) in LATENCY_RATIOS.items():
        a, b = mine.get(workload), theirs.get(peer_workload)
        if a is None or b is None or not b.p50_ms:
            continue
        ratio = a.p50_ms / b.p50_ms
        trips = ROUND_TRIPS.get(workload, 0)
        floor = trips * echo_ms / b.p50_ms
        out.append(LatencyRatio(name, a.p50_ms, b.p50_ms, ratio, target, ratio <= target, trips, floor))
    return out


def print_wire(ratios: list[WireRatio], limits: Limits) -> None:
    print(
        f"The wire against its limits, measured in this run: memcpy {limits.memcpy_gbps:.2f} GB/s, "
        f"a Python loopback stream {limits.loopback_gbps:.2f} GB/s"
    )
    print(f"{'transport':<9} {'workload':<15} {'size':>8} {'GB/s':>7} {'limit':>7} {'ratio':>6}  target")
    for w in ratios:
        mark = "ok" if w.met else "BELOW"
        print(
            f"{w.transport:<9} {w.workload:<15} {format_size(w.size):>8} {w.gbps:>7.2f} {w.limit_gbps:>7.2f} "
            f"{w.ratio:>6.2f}  {w.target} {mark}"
        )


def print_latency_ratios(ratios: list[LatencyRatio], peer_name: str, echo_ms: float = 0.0) -> None:
    print(f"Small operations over TCP against {peer_name}, p50 in the same run (issue 19's targets)")
    if echo_ms:
        print(f"floor: the operation's round trips x a 64-byte echo round trip to a uvloop server ({echo_ms:.3f} ms)")
    print(f"{'':<34} {'kvtier ms':>9} {'peer ms':>8} {'ratio':>6}  {'target':<11} {'trips':>5} {'floor':>6}")
    for r in ratios:
        mark = "ok" if r.met else "ABOVE"
        floor = f"{r.floor_ratio:>6.2f}" if echo_ms else f"{'-':>6}"
        print(
            f"{r.name:<34} {r.ours_p50_ms:>9.3f} {r.peer_p50_ms:>8.3f} {r.ratio:>6.2f}  "
            f"{'<= ' + format(r.target, 'g') + ' ' + mark:<11} {r.round_trips:>5} {floor}"
        )


def _progress(target: str) -> Callable[[str], None]:
    """Phase lines on stderr, with the time since the run started."""
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"kvtier bench [{time.monotonic() - started:6.1f}s] {target}: {text}", file=sys.stderr, flush=True)

    return say


def run_driver(
    driver,
    sizes: list[int],
    selected: set[str],
    batch: int,
    bytes_per_run: int,
    repeat: int,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list:
    bench = Bench(driver, batch, bytes_per_run, repeat, threads, progress)
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
