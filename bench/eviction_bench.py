"""`kvtier bench --eviction`: hit ratio of each eviction policy on a trace with a one-shot scan (issue 21).

The trace is what a KV cache in front of an engine sees: a lookup (GetReplicas) per block; a miss
is recomputed and stored (PutStart + PutEnd). Three phases, the same for every policy (seeded):
1. `hot`: `--eviction-reads` lookups over a hot set of `--eviction-hot` keys, Zipf-distributed
   (alpha 0.9: a few keys very often, most a few times), in a cache of `--eviction-capacity` objects;
2. `scan`: one lookup (a miss, then a put) for each of `--eviction-scan` cold keys, never seen again;
3. the same hot-set distribution again, as many lookups, reported in two parts: `after scan` (the
   first `--eviction-hot` lookups: what the scan left of the hot set shows here) and `later`.
The headline is the `after scan` hit ratio.

In process, the policies are the master's own (kvtier.master.state with `eviction_policy` set, one
segment of exactly `capacity` objects, no watermark: the puts evict): nothing is a copy. With
`--eviction-cluster`, the same trace, shorter (`--eviction-cluster-scale`), is also replayed through
a real local cluster per policy: a master started with `--eviction-policy` and one segment, over
the client library.

Also reported: the policy's own memory per DRAM object (tracemalloc, beyond what lru costs), and
the in-process lookups per second (the master's tables alone, puts included: no RPC).
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import tracemalloc
import uuid
from dataclasses import asdict, dataclass, field

NS = "eviction-bench"
POLICIES = ("lru", "s3fifo")
ZIPF_ALPHA = 0.9
OBJECT_SIZE = 1024  # in process: any size will do, the segment holds exactly `capacity` of them


@dataclass
class PhaseResult:
    name: str
    lookups: int
    hits: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class PolicyRun:
    policy: str
    where: str  # "in-process" or "cluster"
    phases: list[PhaseResult]
    lookups_per_s: float = 0.0  # in process only


@dataclass
class EvictionResult:
    capacity: int
    hot: int
    scan: int
    reads: int
    cluster_scale: float = 0.0  # the cluster runs' trace, as a fraction of this one (0: none)
    runs: list[PolicyRun] = field(default_factory=list)
    policy_bytes_per_object: dict[str, float] = field(default_factory=dict)


def trace(capacity: int, hot: int, scan: int, reads: int, seed: int = 21) -> list[tuple[str, list[str]]]:
    """The phases' keys, in lookup order."""
    rng = random.Random(seed)
    hot_keys = [f"hot/{i:06d}" for i in range(hot)]
    weights = list(itertools.accumulate(1 / (rank + 1) ** ZIPF_ALPHA for rank in range(hot)))
    rng.shuffle(hot_keys)  # which keys are hottest: not their names' order
    first = rng.choices(hot_keys, cum_weights=weights, k=reads)
    again = rng.choices(hot_keys, cum_weights=weights, k=reads)
    return [
        ("hot", first),
        ("scan", [f"scan/{i:08d}" for i in range(scan)]),
        ("after scan", again[:hot]),
        ("later", again[hot:]),
    ]


def _in_process(policy: str, capacity: int, phases: list[tuple[str, list[str]]]) -> PolicyRun:
    from kvtier.master.config import MasterConfig
    from kvtier.master.state import MasterState

    now = [0.0]
    config = MasterConfig(
        cluster_id="evictbench",
        eviction_policy=policy,
        high_watermark=1.0,
        lease_s=0.5,
        segment_ttl_s=3600.0,
        heartbeat_interval_s=1.0,
    )
    state = MasterState(config.validate(), clock=lambda: now[0])
    alignment = config.alignment
    result = state.mount_segment("evictbench", "seg", "seg", ["tcp://127.0.0.1:9/seg"], capacity * OBJECT_SIZE)
    assert OBJECT_SIZE % alignment == 0 and result.segment is not None
    out = []
    lookups = 0
    started = time.perf_counter()
    for name, keys in phases:
        hits = 0
        for key in keys:
            now[0] += 1.0  # the last lookup's lease (0.5 s) has ended: leases protect nothing here
            if state.get_replicas(NS, [key]).statuses[0] == 0:
                hits += 1
                continue
            put = state.put_start(NS, [key], [OBJECT_SIZE], 1)
            if put.statuses[0] == 0:
                state.put_end(NS, [key], [0], put.put_id)
        lookups += len(keys)
        out.append(PhaseResult(name, len(keys), hits))
    elapsed = time.perf_counter() - started
    return PolicyRun(policy, "in-process", out, lookups / elapsed if elapsed else 0.0)


def _in_cluster(policy: str, capacity: int, phases: list[tuple[str, list[str]]], value_size: int) -> PolicyRun:
    from kvtier.client import Client
    from kvtier.common.local_cluster import LocalCluster

    dram = max(16 << 20, capacity * value_size + (1 << 20))
    master_args = ("--eviction-policy", policy, "--high-watermark", "1.0")
    cluster_id = f"evict{uuid.uuid4().hex[:6]}"
    out = []
    with LocalCluster(dram=str(dram), quiet=True, cluster_id=cluster_id, master_args=master_args) as cluster:
        with Client(cluster.master_address, timeout=60.0) as client:
            # exactly `capacity` objects fit: the segment's DRAM less what one more would need
            size = client.cluster_status().capacity // capacity // 4096 * 4096
            value = b"v" * size
            for name, keys in phases:
                hits = 0
                for key in keys:
                    if client.get(key) is not None:
                        hits += 1
                    else:
                        client.put(key, value)
                out.append(PhaseResult(name, len(keys), hits))
    return PolicyRun(policy, "cluster", out)


def policy_bytes_per_object(policy: str, objects: int = 200_000) -> float:
    """The policy's memory per complete DRAM object beyond lru's (which has none of its own): the
    queues of `objects` records, a tenth of them read twice (in main), the rest in the small FIFO."""
    from kvtier.master.eviction_policy import make_policy
    from kvtier.master.records import ObjectRecord, replica

    if policy == "lru":
        return 0.0  # its order is the object dict itself (a read moves an entry): nothing of its own
    records: dict = {}
    for i in range(objects):
        record = ObjectRecord(f"{NS}\x00block/{i:016x}-hash-suffix", 4096, (replica(1, i * 4096),), 1, 0.0)
        record.complete(1)
        records[record.name] = record
    inserted = list(records.values())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    order = make_policy(policy, records)
    for i, record in enumerate(inserted):
        order.inserted(record)
        if i % 10 == 0:
            order.touched(record)
            order.touched(record)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / objects


def run_eviction_bench(
    capacity: int,
    hot: int,
    scan: int,
    reads: int,
    cluster: bool = False,
    cluster_scale: float = 0.1,
    memory_objects: int = 200_000,
) -> EvictionResult:
    result = EvictionResult(capacity, hot, scan, reads)
    phases = trace(capacity, hot, scan, reads)
    for policy in POLICIES:
        result.runs.append(_in_process(policy, capacity, phases))
        result.policy_bytes_per_object[policy] = round(policy_bytes_per_object(policy, memory_objects), 1)
    if cluster:
        result.cluster_scale = cluster_scale

        def scaled(n: int) -> int:
            return max(1, int(n * cluster_scale))

        small = trace(scaled(capacity), scaled(hot), scaled(scan), scaled(reads))
        for policy in POLICIES:
            result.runs.append(_in_cluster(policy, scaled(capacity), small, 64 << 10))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eviction", action="store_true", help="hit ratio of lru vs s3fifo on a trace with a one-shot scan"
    )
    parser.add_argument("--eviction-capacity", type=int, default=2_000, help="--eviction: cache size in objects")
    parser.add_argument("--eviction-hot", type=int, default=1_000, help="--eviction: hot-set keys (Zipf)")
    parser.add_argument("--eviction-scan", type=int, default=10_000, help="--eviction: cold keys of the one-shot scan")
    parser.add_argument("--eviction-reads", type=int, default=20_000, help="--eviction: lookups per hot phase")
    parser.add_argument(
        "--eviction-cluster", action="store_true", help="--eviction: also replay the trace through a local cluster"
    )
    parser.add_argument(
        "--eviction-cluster-scale",
        type=float,
        default=0.1,
        help="--eviction-cluster: the cluster's trace, as a fraction of the in-process one (default: %(default)s)",
    )


def check_arguments(opts: argparse.Namespace) -> str:
    """An error message for bad --eviction-* values, or ""."""
    if min(opts.eviction_capacity, opts.eviction_hot, opts.eviction_reads) < 1 or opts.eviction_scan < 0:
        return "--eviction-capacity, --eviction-hot and --eviction-reads must be positive, --eviction-scan >= 0"
    if opts.eviction_reads <= opts.eviction_hot:
        return "--eviction-reads must exceed --eviction-hot (the phase after the scan starts with that many lookups)"
    if not 0 < opts.eviction_cluster_scale <= 1:
        return "--eviction-cluster-scale must be in (0, 1]"
    return ""


def print_eviction_result(result: EvictionResult, as_json: bool, machine: dict) -> None:
    import json

    if as_json:
        runs = [
            {**asdict(run), "phases": [{**asdict(p), "hit_ratio": round(p.hit_ratio, 4)} for p in run.phases]}
            for run in result.runs
        ]
        print(json.dumps({"machine": machine, "eviction": {**asdict(result), "runs": runs}}, indent=2))
        return
    print(f"kvtier bench --eviction: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print(
        f"cache of {result.capacity:,} objects; hot set {result.hot:,} keys (Zipf {ZIPF_ALPHA}), "
        f"{result.reads:,} lookups per hot phase; one-shot scan of {result.scan:,} keys"
    )
    if result.cluster_scale:
        print(f"  (cluster rows: the same trace scaled by {result.cluster_scale}, 64 KiB values)")
    print(f"  {'policy':<8} {'where':<11} {'hot':>7} {'scan':>7} {'after scan':>10} {'later':>7}  lookups/s")
    for run in result.runs:
        ratios = " ".join(f"{p.hit_ratio:>{w}.1%}" for p, w in zip(run.phases, (7, 7, 10, 7), strict=True))
        speed = f"{run.lookups_per_s:,.0f}" if run.lookups_per_s else "-"
        print(f"  {run.policy:<8} {run.where:<11} {ratios}  {speed}")
    per_object = ", ".join(f"{p} {b:.0f} B" for p, b in result.policy_bytes_per_object.items())
    print(f"  policy memory per DRAM object (beyond the tables): {per_object}")
