"""`kvtier bench --tier ssd`: reads served from the SSD tier next to a direct-I/O baseline of the same disk.

Against a local cluster started here (a master and one segment server with a
small DRAM region and an SSD tier in `--ssd-dir`, promotion off so reads stay
on disk):
- fill `--ssd-bytes` of 1 MiB objects (by default) at a pace the offload
  keeps up with, so they land on SSD;
- read the disk-only ones back with `batch_get_into` in batches of `--batch`,
  `--repeat` times (median), every object verified by its checksum;
- before each pass, read the same bucket files with `dd iflag=direct bs=1M`
  (the baseline: what the disk gives one sequential direct reader, under the
  same conditions as the pass that follows; medians of both are compared);
- report both, their ratio, and the segment's own counters: object bytes
  served from SSD vs physical bytes the process read (/proc/<pid>/io), so
  the figure cannot come from the page cache unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20


@dataclass
class SsdResult:
    object_size: int
    objects_on_disk: int
    batch: int
    get_gb_per_s: float  # median over repeats
    baseline_gb_per_s: float  # dd iflag=direct over the same bucket files, median, next to each pass
    ratio: float
    disk_engine: str
    ssd_bytes_served: int  # segment's counter over the measured reads
    disk_bytes_read: int  # segment process's physical reads over the measured reads (/proc/<pid>/io)


def _pid_read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _dd_direct(files: list[Path]) -> float:
    """GB/s of `dd iflag=direct bs=1M` reading every file in turn."""
    total = 0
    started = time.perf_counter()
    for path in files:
        result = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], capture_output=True, text=True, check=True
        )
        match = re.search(r"^(\d+) bytes", result.stderr, re.MULTILINE)
        total += int(match.group(1)) if match else path.stat().st_size
    return total / (time.perf_counter() - started) / 1e9


def run_ssd_bench(ssd_bytes: int, size: int, batch: int, repeat: int, ssd_dir: str) -> SsdResult:
    from kvtier.client import Client
    from kvtier.client.local_cluster import LocalCluster

    base = Path(ssd_dir or ".kvtier")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ssd-", dir=base))
    dram = 256 * MiB
    cluster = LocalCluster(
        dram="256MiB",
        quiet=True,
        cluster_id=f"sbench{uuid.uuid4().hex[:6]}",
        ssd=str(ssd_bytes + ssd_bytes // 4),
        ssd_dir=str(work),
        master_args=("--promote-after-reads", "0", "--tick-interval-s", "0.02"),
        segment_args=("--ssd-bucket-size", "256MiB"),
    )
    try:
        cluster.start()
        pid = cluster.children[1].popen.pid
        with Client(cluster.master_address, namespace="ssd-bench", timeout=60.0) as client:
            value = os.urandom(size)
            keys = [f"ssd-bench/{i:07d}" for i in range(ssd_bytes // size)]
            step = max(1, (dram // 20) // size)  # 5% of DRAM per batch: the watermark pass keeps up
            for lo in range(0, len(keys), step):
                chunk = keys[lo : lo + step]
                statuses = client.batch_put(chunk, [value] * len(chunk))
                if any(statuses):
                    raise RuntimeError(f"put failed: {statuses[:4]}")
                deadline = time.monotonic() + 30
                while True:
                    seg = client.cluster_status().segments[0]
                    if seg.dram_used <= 0.9 * seg.dram_capacity or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            disk_keys = []
            probe = [bytearray(size) for _ in range(batch)]
            for lo in range(0, len(keys), batch):
                chunk = keys[lo : lo + batch]
                got = client.batch_get_into(chunk, probe[: len(chunk)], with_source=True)
                disk_keys += [k for k, (n, src) in zip(chunk, got, strict=True) if n == size and src == "ssd/tcp"]
            if not disk_keys:
                raise RuntimeError("no object ended on the SSD tier")
            engine = client.cluster_status().segments[0].disk_engine
            buffers = [bytearray(size) for _ in range(batch)]
            buckets = sorted(work.rglob("bucket-*.kvb"))
            served_before = client.cluster_status().segments[0].ssd_bytes_served
            disk_read = 0
            rates, baselines = [], []
            for _ in range(repeat):
                # The baseline runs next to each measured pass, under the same conditions (a VM's
                # virtual disk is faster on data it read recently: compare like with like).
                baselines.append(_dd_direct(buckets))
                disk_before = _pid_read_bytes(pid)
                started = time.perf_counter()
                moved = 0
                for lo in range(0, len(disk_keys), batch):
                    chunk = disk_keys[lo : lo + batch]
                    results = client.batch_get_into(chunk, buffers[: len(chunk)])
                    if any(r != size for r in results):
                        raise RuntimeError(f"read failed: {[r for r in results if r != size][:4]}")
                    moved += size * len(chunk)
                rates.append(moved / (time.perf_counter() - started) / 1e9)
                disk_read += _pid_read_bytes(pid) - disk_before
            time.sleep(0.5)  # one heartbeat carries the segment's counters to the master
            served = client.cluster_status().segments[0].ssd_bytes_served - served_before
        baseline = statistics.median(baselines)
        get_rate = statistics.median(rates)
        return SsdResult(
            object_size=size,
            objects_on_disk=len(disk_keys),
            batch=batch,
            get_gb_per_s=get_rate,
            baseline_gb_per_s=baseline,
            ratio=get_rate / baseline if baseline else 0.0,
            disk_engine=engine,
            ssd_bytes_served=served,
            disk_bytes_read=disk_read,
        )
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def print_ssd_result(result: SsdResult, as_json: bool, machine: dict) -> None:
    if as_json:
        print(json.dumps({"machine": machine, "ssd": asdict(result)}, indent=2))
        return
    print(f"kvtier bench --tier ssd: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print(
        f"{result.objects_on_disk} objects of {result.object_size // 1024} KiB on the SSD tier "
        f"({result.disk_engine}), batches of {result.batch}"
    )
    print(f"  batch_get_into from SSD   {result.get_gb_per_s:8.2f} GB/s (median)")
    print(f"  dd iflag=direct bs=1M     {result.baseline_gb_per_s:8.2f} GB/s (same bucket files)")
    print(f"  ratio                     {result.ratio:8.0%}")
    print(
        f"  segment: {result.ssd_bytes_served / 1e9:.2f} GB served from SSD, "
        f"{result.disk_bytes_read / 1e9:.2f} GB physically read from disk"
    )
