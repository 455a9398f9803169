"""`kvtier bench --tier ssd --write`: the DRAM -> SSD offload rate next to a direct-I/O write baseline.

Two figures per object size, each beside `dd` run in the same directory in the same run:

- **segment write path** (`path`): the tier worker's offload code driven directly from an anonymous
  DRAM region of random bytes, in a child process (`python -m kvtier.segment_server.write_probe`, so
  the bench imports no server code): batches of `_POLL_TASKS` OFFLOAD tasks (the worker's poll size)
  written by the GroupWriter ("group", what the segment runs) or by one `BucketStore.append` per
  record ("serial", the path before the group writer), each batch followed by the `sync`
  (fdatasync) that precedes the report. Measured: object bytes of the batches / wall time from the
  first task to the last batch's sync. Nothing of a master or a network: the write path alone.
- **cluster offload** (`--cluster`): a local master and one segment (`--dram`, 128 MiB by default, and
  an SSD tier in `--ssd-dir`); one client puts `--ssd-bytes` in 32-key `batch_put`s as fast as it
  goes; measured: the segment's `ssd_bytes_offloaded` counter (object bytes made durable on SSD)
  / time from the first put until the segment process's physical writes (/proc/<pid>/io
  write_bytes, sampled every 10 ms) stop growing. The client's put rate is printed beside it: when
  it is lower than the disk, the figure measures the client, not the offload.

Baseline: `dd if=/dev/zero of=<file in the same directory> bs=<B> count=<bytes/B> oflag=direct
conv=fdatasync`, with B = the object size and with B = 4 MiB (the disk's best sequential rate),
run just before each measured pass (a VM disk's speed drifts: compare like with like). Ratios are
given against both, computed pass by pass (each pass over the dd runs just before it), then the
median; rates are medians over `--repeat` passes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 1 << 20
_POLL_TASKS = 256  # the tier worker's max_tasks per poll (segment_server.tier_worker._MAX_TASKS)


@dataclass
class WriteResult:
    object_size: int
    total_bytes: int
    path: str  # "group" (the segment's write path), "serial" (one append per record), "cluster"
    gb_per_s: float  # median
    dd_same_bs_gb_per_s: float  # dd oflag=direct bs=object size, median, next to each pass
    dd_4m_gb_per_s: float  # dd oflag=direct bs=4M, median, next to each pass
    ratio_same_bs: float  # median over passes of pass rate / its dd bs=object size
    ratio_4m: float  # median over passes of pass rate / its dd bs=4M
    put_gb_per_s: float = 0.0  # cluster only: the client's batch_put rate
    passes: list[float] = field(default_factory=list)


def dd_direct_write(directory: Path, total: int, block: int) -> float:
    """GB/s of `dd oflag=direct conv=fdatasync` writing `total` bytes in `block`-byte writes into `directory`."""
    target = directory / f"dd-baseline-{uuid.uuid4().hex[:6]}"
    count = max(1, total // block)
    started = time.perf_counter()
    result = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "oflag=direct", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - started
    target.unlink()
    match = re.search(r"^(\d+) bytes", result.stderr, re.MULTILINE)
    return (int(match.group(1)) if match else count * block) / elapsed / 1e9


def _write_pass(work: Path, path: str, size: int, total: int) -> float:
    """One pass of the segment's write path alone, in a child process (kvtier.segment_server.write_probe)."""
    result = subprocess.run(
        [
            sys.executable, "-m", "kvtier.segment_server.write_probe", "--dir", str(work), "--path", path,
            "--object-size", str(size), "--bytes", str(total), "--batch", str(_POLL_TASKS),
        ],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"write probe failed: {result.stderr.strip()[-2000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["gb_per_s"])


def run_write_bench(ssd_bytes: int, size: int, repeat: int, ssd_dir: str, paths: list[str]) -> list[WriteResult]:
    base = Path(ssd_dir or ".kvtier")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ssdw-", dir=base))
    results = []
    try:
        for path in paths:
            rates, same, best = [], [], []
            for _ in range(repeat):
                same.append(dd_direct_write(work, ssd_bytes, size))
                best.append(dd_direct_write(work, ssd_bytes, 4 * MiB))
                rates.append(_write_pass(work, path, size, ssd_bytes))
            results.append(_result(size, ssd_bytes, path, rates, same, best))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _result(size: int, total: int, path: str, rates: list, same: list, best: list, put: float = 0.0) -> WriteResult:
    rate, dd_same, dd_best = statistics.median(rates), statistics.median(same), statistics.median(best)
    # Ratios pass by pass (each pass against the dd runs just before it), then their median: the
    # shared disk's speed drifts between passes more than within one.
    return WriteResult(
        object_size=size,
        total_bytes=total,
        path=path,
        gb_per_s=rate,
        dd_same_bs_gb_per_s=dd_same,
        dd_4m_gb_per_s=dd_best,
        ratio_same_bs=statistics.median(r / d for r, d in zip(rates, same, strict=True) if d),
        ratio_4m=statistics.median(r / d for r, d in zip(rates, best, strict=True) if d),
        put_gb_per_s=put,
        passes=rates,
    )


def _pid_write_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def run_cluster_write_bench(ssd_bytes: int, size: int, repeat: int, ssd_dir: str, dram: str) -> WriteResult:
    """Offload rate of a local segment under a writer putting as fast as it can (see the module doc)."""
    from kvtier.client import Client
    from kvtier.common.local_cluster import LocalCluster

    base = Path(ssd_dir or ".kvtier")
    base.mkdir(parents=True, exist_ok=True)
    rates, puts, same, best = [], [], [], []
    value = os.urandom(size)
    for rep in range(repeat):
        work = Path(tempfile.mkdtemp(prefix="bench-ssdw-", dir=base))
        cluster = LocalCluster(
            dram=dram,
            quiet=True,
            cluster_id=f"swbench{uuid.uuid4().hex[:6]}",
            ssd=str(2 * ssd_bytes + 256 * MiB),
            ssd_dir=str(work),
            master_args=("--tick-interval-s", "0.02"),
            segment_args=("--ssd-bucket-size", "1GiB"),
        )
        try:
            same.append(dd_direct_write(work, ssd_bytes, size))
            best.append(dd_direct_write(work, ssd_bytes, 4 * MiB))
            cluster.start()
            pid = cluster.children[1].popen.pid
            with Client(cluster.master_address, namespace="ssd-wbench", timeout=60.0) as client:
                keys = [f"w{rep}/{i:07d}" for i in range(ssd_bytes // size)]
                written0 = _pid_write_bytes(pid)
                started = time.perf_counter()
                for lo in range(0, len(keys), 32):
                    chunk = keys[lo : lo + 32]
                    client.batch_put(chunk, [value] * len(chunk))
                put_done = time.perf_counter()
                # Until the segment's physical writes stop growing for a second (offload has drained).
                last, last_change = _pid_write_bytes(pid), time.perf_counter()
                while time.perf_counter() - last_change < 1.0:
                    time.sleep(0.01)
                    now = _pid_write_bytes(pid)
                    if now != last:
                        last, last_change = now, time.perf_counter()
                if last == written0:
                    raise RuntimeError("the segment wrote nothing to its SSD tier")
                time.sleep(1.2)  # one heartbeat carries the segment's counters to the master
                offloaded = client.cluster_status().segments[0].ssd_bytes_offloaded
            rates.append(offloaded / (last_change - started) / 1e9)
            puts.append(len(keys) * size / (put_done - started) / 1e9)
        finally:
            cluster.stop()
            shutil.rmtree(work, ignore_errors=True)
    return _result(size, ssd_bytes, "cluster", rates, same, best, statistics.median(puts))


def print_write_results(results: list[WriteResult], as_json: bool, machine: dict) -> None:
    if as_json:
        print(json.dumps({"machine": machine, "ssd_write": [asdict(r) for r in results]}, indent=2))
        return
    print(f"kvtier bench --tier ssd --write: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print("offload GB/s beside dd oflag=direct conv=fdatasync in the same directory (medians)")
    print(f"{'size':>8} {'path':>8} {'GB/s':>7} {'dd bs=size':>11} {'ratio':>6} {'dd bs=4M':>9} {'ratio':>6}  puts")
    for r in results:
        put = f"{r.put_gb_per_s:.2f} GB/s" if r.path == "cluster" else ""
        print(
            f"{r.object_size // 1024:>5}KiB {r.path:>8} {r.gb_per_s:7.2f} {r.dd_same_bs_gb_per_s:11.2f} "
            f"{r.ratio_same_bs:6.0%} {r.dd_4m_gb_per_s:9.2f} {r.ratio_4m:6.0%}  {put}"
        )
