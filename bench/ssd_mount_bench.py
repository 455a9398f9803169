"""`kvtier bench --tier ssd --mount`: how long an SSD tier of `--ssd-bytes` takes to mount.

Writes a tier of 1 MiB records (by default) with `BucketStore` directly into a
fresh directory under `--ssd-dir` (on the disk to measure; removed after),
then, from a cold page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`,
which needs root: the result says whether it worked), times:
- `BucketStore.recover()` of a fresh store over those files (what mounting
  reads from the disk);
- a real segment server (with a master already running) from spawn to
  "mounted and inventory reported" (its ready file is written only after
  the master took the inventory), next to the same start with an empty tier,
  so process start-up can be told apart from the mount.
Payload verification runs in the background after a mount (`--ssd-verify-rate`),
so neither figure includes it; the physical bytes read by `recover()` are
reported from /proc/self/io.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20
_SYNC_EVERY = 64  # records per fdatasync while filling (the tier worker's group commit does the same)


@dataclass
class MountResult:
    tier_bytes: int
    records: int
    record_size: int
    buckets: int
    fill_seconds: float
    caches_dropped: bool  # False: the figures below may come from the page cache (not root?)
    recover_seconds: float  # BucketStore.recover() from a cold cache
    recover_disk_bytes: int  # physical bytes this process read during recover()
    segment_start_seconds: float  # segment spawn to mounted + inventory reported (cold cache)
    empty_segment_start_seconds: float  # the same with an empty tier
    objects_reported: int  # disk objects the master holds after the segment's mount


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def drop_caches() -> bool:
    """Write back and drop the page cache; False when this process may not (not root)."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fill_tier(directory: Path, cluster_id: str, tier_bytes: int, size: int, bucket_size: int) -> int:
    """Write tier_bytes of `size`-byte records; the number written."""
    import crc32c

    from kvtier.segment_server.buckets import BucketStore

    store = BucketStore(directory, tier_bytes + tier_bytes // 4, cluster_id, bucket_size=bucket_size)
    store.recover()
    value = os.urandom(size)
    checksum = crc32c.crc32c(value)
    count = tier_bytes // size
    try:
        for i in range(count):
            store.append("mount-bench", f"mount-bench/{i:08d}", value, checksum)
            if i % _SYNC_EVERY == _SYNC_EVERY - 1:
                store.sync()
        store.sync()
    finally:
        store.close()
    return count


def _time_recover(directory: Path, cluster_id: str, tier_bytes: int, bucket_size: int) -> tuple[float, int, int, int]:
    """(seconds, physical bytes read, records, buckets) of a fresh store's recover()."""
    from kvtier.segment_server.buckets import BucketStore

    store = BucketStore(directory, tier_bytes + tier_bytes // 4, cluster_id, bucket_size=bucket_size, direct_io=True)
    before = _read_bytes()
    started = time.perf_counter()
    records = store.recover()
    seconds = time.perf_counter() - started
    read = _read_bytes() - before
    buckets = store.bucket_count
    store.close()
    return seconds, read, len(records), buckets


def _time_segment_start(directory: Path, cluster_id: str, tier_bytes: int, bucket_size: int) -> tuple[float, int]:
    """(seconds from spawn to mounted with the inventory reported, disk objects the master holds)."""
    from kvtier.client import Client
    from kvtier.common.local_cluster import LocalCluster
    from kvtier.common.supervisor import Supervisor

    cluster = LocalCluster(quiet=True, cluster_id=cluster_id, segments=0).start()  # the master alone
    ready = directory.parent / f"{directory.name}.ready"
    try:
        # The segment's log: <dir>.log beside the tier; 30 s to stop cleanly before a SIGKILL.
        with Supervisor(directory.parent, grace_s=30.0) as supervisor:
            started = time.perf_counter()
            # Ready once mounted: the ready file is written after the master took the inventory.
            # No deadline to speak of: a large tier on a slow disk may take long, which is the figure.
            supervisor.start(
                directory.name,
                [
                    sys.executable, "-m", "kvtier.segment_server",
                    "--master", cluster.master_address,
                    "--listen", "127.0.0.1:0",
                    "--dram", "64MiB",
                    "--cluster-id", cluster_id,
                    "--name", "mount-bench",
                    "--ssd-dir", str(directory),
                    "--ssd-size", str(tier_bytes + tier_bytes // 4),
                    "--ssd-bucket-size", str(bucket_size),
                    "--ready-file", str(ready),
                    "--log-level", "WARNING",
                ],
                ready_file=ready,
                timeout=24 * 3600.0,
                poll_s=0.005,
            )  # fmt: skip
            seconds = time.perf_counter() - started
            with Client(cluster.master_address, namespace="mount-bench", timeout=60.0) as client:
                objects = client.cluster_status().segments[0].ssd_objects
        return seconds, objects
    finally:
        ready.unlink(missing_ok=True)
        cluster.stop()


def run_mount_bench(tier_bytes: int, size: int, ssd_dir: str, bucket_size: int = 256 * MiB) -> MountResult:
    base = Path(ssd_dir or ".kvtier")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-mount-", dir=base))
    cluster_id = f"mbench{uuid.uuid4().hex[:6]}"
    tier = work / "full"
    empty = work / "empty"
    try:
        tier.mkdir(parents=True)
        empty.mkdir(parents=True)
        started = time.perf_counter()
        count = fill_tier(tier, cluster_id, tier_bytes, size, bucket_size)
        fill_seconds = time.perf_counter() - started
        dropped = drop_caches()
        recover_s, recover_read, records, buckets = _time_recover(tier, cluster_id, tier_bytes, bucket_size)
        if records != count:
            raise RuntimeError(f"recover() found {records} records, {count} were written")
        dropped = drop_caches() and dropped
        segment_s, reported = _time_segment_start(tier, cluster_id, tier_bytes, bucket_size)
        empty_s, _ = _time_segment_start(empty, cluster_id, tier_bytes, bucket_size)
        return MountResult(
            tier_bytes=count * size,
            records=count,
            record_size=size,
            buckets=buckets,
            fill_seconds=fill_seconds,
            caches_dropped=dropped,
            recover_seconds=recover_s,
            recover_disk_bytes=recover_read,
            segment_start_seconds=segment_s,
            empty_segment_start_seconds=empty_s,
            objects_reported=reported,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_mount_result(result: MountResult, as_json: bool, machine: dict) -> None:
    if as_json:
        print(json.dumps({"machine": machine, "ssd_mount": asdict(result)}, indent=2))
        return
    print(f"kvtier bench --tier ssd --mount: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print(
        f"{result.records} records of {result.record_size // 1024} KiB ({result.tier_bytes / 2**30:.1f} GiB) "
        f"in {result.buckets} buckets, written in {result.fill_seconds:.1f} s"
    )
    if not result.caches_dropped:
        print("  WARNING: could not drop the page cache (needs root): figures may be warm")
    print(
        f"  BucketStore.recover()          {result.recover_seconds:8.2f} s "
        f"({result.recover_disk_bytes / 2**20:.1f} MiB read from disk)"
    )
    print(
        f"  segment start to mounted       {result.segment_start_seconds:8.2f} s "
        f"(inventory of {result.objects_reported} objects reported)"
    )
    print(f"  same, empty tier               {result.empty_segment_start_seconds:8.2f} s")
