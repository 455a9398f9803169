"""`kvtier bench --master-only`: metadata throughput and memory of a real master process.

Against a local cluster (a master and one segment server, started here), in
batches of `--master-batch` keys (default 10,000) through the client's master
link (the framed fast path, as engines use it):
- fill `--objects` objects (64-byte values; the bytes are not written, only
  metadata is measured) with PutStart + PutEnd -> keys/s;
- batched Exists and GetReplicas over random stored keys -> keys/s;
- the master's RSS (from /proc) per stored object at the end of the fill,
  and after `--cycles` fill/remove cycles, the RSS growth over the first;
- the segment server's RSS growth per object over the fill: its DRAM index
  (kvtier.segment_server.dram_index; the values' bytes are never written).
`--objects 10000000 --cycles 0` is the issue 19 scale run (about 4 GB of RAM).

Issue 19 also asks that the metadata rates at 10M objects hold within 20% of
those at 1M, which only means something when both are taken in the same run
(this machine's speed drifts by more than that between sittings). So the fill
stops at each `--master-checkpoints` size (default: 1M when filling 2M or more)
and at the end, and measures there: PutStart + PutEnd of a window of new keys
(removed again, untimed), then Exists and GetReplicas over the stored keys.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from dataclasses import asdict, dataclass

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import status_name

VALUE_SIZE = 64


@dataclass
class Checkpoint:
    """The rates measured with `objects` stored (the same run's other checkpoints beside it)."""

    objects: int
    put_keys_per_s: float  # PutStart + PutEnd of a window of new keys on top of `objects`
    exists_keys_per_s: float
    get_replicas_keys_per_s: float
    rss_bytes_per_object: float


@dataclass
class MasterResult:
    objects: int
    batch: int
    put_keys_per_s: float  # PutStart + PutEnd
    exists_keys_per_s: float
    get_replicas_keys_per_s: float
    rss_bytes_per_object: float
    segment_rss_bytes_per_object: float
    rss_growth_after_cycles_bytes: int
    cycles: int
    checkpoints: list[Checkpoint]


RATE_TOLERANCE = 0.8  # issue 19: the rates at the largest size within 20% of the first checkpoint's
PUT_WINDOW = 200_000  # new keys timed at a checkpoint (at most a fifth of what is stored)


def default_checkpoints(objects: int) -> list[int]:
    return [1_000_000] if objects >= 2_000_000 else []


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fill(master, namespace: str, keys: list[str], batch: int) -> float:
    # Real CRC32C values are random 32-bit numbers: a constant (0) would flatter the RSS figure.
    rng = random.Random(11)
    checksums = [rng.getrandbits(32) for _ in range(batch)]
    started = time.perf_counter()
    for lo in range(0, len(keys), batch):
        chunk = keys[lo : lo + batch]
        reply = master.call(
            "PutStart", pb.PutStartRequest(namespace=namespace, keys=chunk, sizes=[VALUE_SIZE] * len(chunk), replicas=1)
        )
        if any(reply.statuses):
            raise RuntimeError(f"PutStart failed: {reply.error}")
        ended = master.call(
            "PutEnd",
            pb.PutEndRequest(namespace=namespace, keys=chunk, checksums=checksums[: len(chunk)], put_id=reply.put_id),
        )
        if any(ended.statuses):
            failed = sorted({status_name(s) for s in ended.statuses if s})
            raise RuntimeError(f"PutEnd failed at object {lo:,}: {status_name(ended.status)} {failed} {ended.error}")
    return len(keys) / (time.perf_counter() - started)


def _remove(master, namespace: str, keys: list[str], batch: int) -> None:
    for lo in range(0, len(keys), batch):
        master.call("Remove", pb.KeysRequest(namespace=namespace, keys=keys[lo : lo + batch]))


def _read_rate(master, method: str, namespace: str, keys: list[str], batch: int, rounds: int) -> float:
    rng = random.Random(7)
    samples = [rng.sample(keys, min(batch, len(keys))) for _ in range(rounds)]
    started = time.perf_counter()
    for sample in samples:
        master.call(method, pb.KeysRequest(namespace=namespace, keys=sample))
    return rounds * len(samples[0]) / (time.perf_counter() - started)


def _checkpoint(master, master_pid: int, rss_before: int, namespace: str, keys: list[str], batch: int) -> Checkpoint:
    """Rates with `keys` stored: a window of new keys put and removed, then reads of stored keys."""
    window = [f"probe-{len(keys)}-{i:012x}" for i in range(min(PUT_WINDOW, max(batch, len(keys) // 5)))]
    rss = (_rss(master_pid) - rss_before) / len(keys)
    put_rate = _fill(master, namespace, window, batch)
    _remove(master, namespace, window, batch)
    exists_rate, get_rate = _read_rates(master, namespace, keys, batch)
    return Checkpoint(len(keys), put_rate, exists_rate, get_rate, rss)


def _read_rates(master, namespace: str, keys: list[str], batch: int) -> tuple[float, float]:
    """(Exists, GetReplicas) keys/s over random stored keys."""
    rounds = max(5, 200_000 // batch)
    return (
        _read_rate(master, "Exists", namespace, keys, batch, rounds),
        _read_rate(master, "GetReplicas", namespace, keys, batch, rounds),
    )


def run_master_bench(objects: int, batch: int, cycles: int, checkpoints: list[int] | None = None) -> MasterResult:
    from kvtier.client import Client
    from kvtier.common.local_cluster import LocalCluster

    # Values are 64 B but allocations are aligned: leave the segment room for all of them.
    dram = max(256 << 20, objects * 128)
    with LocalCluster(dram=str(dram), quiet=True, cluster_id=f"mbench{uuid.uuid4().hex[:6]}") as cluster:
        master_pid = cluster.children[0].popen.pid
        segment_pid = cluster.children[1].popen.pid
        with Client(cluster.master_address, timeout=120.0) as client:
            client.exists("warm-up")  # discovers the fast path
            master = client._master
            namespace = "master-bench"
            keys = [f"{i:016x}{'-block-hash-suffix'}" for i in range(objects)]
            rss_before, segment_before = _rss(master_pid), _rss(segment_pid)
            stops = sorted({c for c in (default_checkpoints(objects) if checkpoints is None else checkpoints)})
            stops = [c for c in stops if 0 < c < objects]
            measured, filled, fill_s = [], 0, 0.0
            for stop in [*stops, objects]:
                started = time.perf_counter()
                _fill(master, namespace, keys[filled:stop], batch)
                fill_s += time.perf_counter() - started
                filled = stop
                if stops:
                    measured.append(_checkpoint(master, master_pid, rss_before, namespace, keys[:stop], batch))
            put_rate = objects / fill_s
            rss_full, segment_full = _rss(master_pid), _rss(segment_pid)
            if measured:  # the last checkpoint read them with every object stored: not twice
                exists_rate, get_rate = measured[-1].exists_keys_per_s, measured[-1].get_replicas_keys_per_s
            else:
                exists_rate, get_rate = _read_rates(master, namespace, keys, batch)
            # GetReplicas leased the sampled keys; removal frees them once the lease ends, which
            # does not matter for RSS (records are dropped at once).
            _remove(master, namespace, keys, batch)
            rss_first_cycle = _rss(master_pid)
            for _ in range(cycles):
                _fill(master, namespace, keys, batch)
                _remove(master, namespace, keys, batch)
            rss_last = _rss(master_pid)
    return MasterResult(
        objects=objects,
        batch=batch,
        put_keys_per_s=put_rate,
        exists_keys_per_s=exists_rate,
        get_replicas_keys_per_s=get_rate,
        rss_bytes_per_object=(rss_full - rss_before) / objects,
        segment_rss_bytes_per_object=(segment_full - segment_before) / objects,
        rss_growth_after_cycles_bytes=rss_last - rss_first_cycle,
        cycles=cycles,
        checkpoints=measured,
    )


def rate_ratios(result: MasterResult) -> dict[str, float]:
    """Each rate at the last checkpoint over the first's (issue 19: within 20%, i.e. >= 0.8)."""
    if len(result.checkpoints) < 2:
        return {}
    first, last = result.checkpoints[0], result.checkpoints[-1]
    return {
        name: getattr(last, name) / getattr(first, name)
        for name in ("put_keys_per_s", "exists_keys_per_s", "get_replicas_keys_per_s")
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master-only", action="store_true", help="measure the master's metadata path only")
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects for --master-only (default 1M)")
    parser.add_argument("--master-batch", type=int, default=10_000, help="keys per RPC for --master-only")
    parser.add_argument("--cycles", type=int, default=3, help="fill/remove cycles for the RSS growth check")
    parser.add_argument(
        "--master-checkpoints",
        default=None,
        help="--master-only: comma list of sizes where the fill stops to measure the rates, beside the "
        "end (default: 1M when --objects is 2M or more; 'none' for none)",
    )


def print_master_result(result: MasterResult, as_json: bool, machine: dict) -> None:
    import json

    ratios = rate_ratios(result)
    if as_json:
        doc = {"machine": machine, "master": asdict(result)}
        if ratios:
            doc["rate_ratios"] = ratios
        print(json.dumps(doc, indent=2))
        return
    print(f"kvtier bench --master-only: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print(f"{result.objects:,} objects, {result.batch:,} keys per RPC, fast path")
    print(f"  PutStart+PutEnd   {result.put_keys_per_s:>12,.0f} keys/s")
    print(f"  Exists            {result.exists_keys_per_s:>12,.0f} keys/s")
    print(f"  GetReplicas       {result.get_replicas_keys_per_s:>12,.0f} keys/s")
    print(f"  master RSS        {result.rss_bytes_per_object:>12,.0f} bytes/object")
    print(f"  segment RSS       {result.segment_rss_bytes_per_object:>12,.0f} bytes/object (its DRAM index)")
    print(f"  RSS growth after {result.cycles} fill/remove cycles: {result.rss_growth_after_cycles_bytes:,} bytes")
    if result.checkpoints:
        print("  rates measured with N objects stored, in this run (PutStart+PutEnd: a window of new keys)")
        print(f"  {'objects':>12} {'put keys/s':>12} {'Exists':>12} {'GetReplicas':>12} {'RSS B/obj':>10}")
        for c in result.checkpoints:
            print(
                f"  {c.objects:>12,} {c.put_keys_per_s:>12,.0f} {c.exists_keys_per_s:>12,.0f} "
                f"{c.get_replicas_keys_per_s:>12,.0f} {c.rss_bytes_per_object:>10,.0f}"
            )
        for name, ratio in ratios.items():
            verdict = "ok" if ratio >= RATE_TOLERANCE else "BELOW"
            print(
                f"  {name} at {result.checkpoints[-1].objects:,} / at {result.checkpoints[0].objects:,}: {ratio:.2f} "
                f"(target >= {RATE_TOLERANCE}) {verdict}"
            )
