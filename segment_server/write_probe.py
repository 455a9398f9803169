"""The offload write path measured alone: `python -m kvtier.segment_server.write_probe`.

Drives exactly what the tier worker runs for OFFLOAD tasks, in this process, on a BucketStore in
`--dir`: batches of `--batch` records (the worker's poll size, 256) copied from an anonymous DRAM
region of random bytes (up to 256 MiB, objects cycle through it) and written by the GroupWriter
(`--path group`, what the segment runs) or by one `BucketStore.append` per record (`--path serial`,
the path before the group writer), each batch followed by the `sync` (fdatasync) that precedes the
report. Prints one JSON line: object bytes / wall time from the first task to the last sync. The
bucket files are deleted afterwards. Used by `kvtier bench --tier ssd --write` (kvtier.bench), which
runs it as a child process: the bench never imports the segment server.
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import sys
import time
from pathlib import Path

import crc32c

from kvtier.common.units import parse_size
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.group_writer import DEFAULT_BUFFER_BYTES, DEFAULT_THREADS, GroupWriter, OffloadItem

_SOURCE_BYTES = 256 << 20


def source(size: int, total: int) -> tuple[memoryview, list[tuple[int, int]]]:
    """A DRAM region of random bytes and (offset, crc32c) of each object slot in it."""
    slots = max(1, min(_SOURCE_BYTES, total) // size)
    region = mmap.mmap(-1, slots * size)
    rng = random.Random(size)
    view = memoryview(region)
    for i in range(slots):
        view[i * size : (i + 1) * size] = rng.randbytes(size)
    return view, [(i * size, crc32c.crc32c(view[i * size : (i + 1) * size])) for i in range(slots)]


def write_pass(
    directory: Path,
    path: str,
    size: int,
    total: int,
    *,
    batch: int = 256,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    threads: int = DEFAULT_THREADS,
) -> float:
    """GB/s of one pass (see the module doc)."""
    region, slots = source(size, total)
    store = BucketStore(directory, 2 * total + (64 << 20), "wprobe", bucket_size=1 << 30, direct_io=True)
    store.recover()
    writer = GroupWriter(store, buffer_bytes=buffer_bytes, threads=threads) if path == "group" else None
    count = max(1, total // size)
    try:
        started = time.perf_counter()
        for lo in range(0, count, batch):
            items = []
            for i in range(lo, min(count, lo + batch)):
                offset, crc = slots[i % len(slots)]
                items.append(OffloadItem("probe", f"k{i:08d}", region[offset : offset + size], crc))
            if writer is not None:
                failed = [r for r in writer.write(items) if isinstance(r, Exception)]
                if failed:
                    raise RuntimeError(f"offload failed: {failed[0]}")
            else:
                for item in items:
                    store.append(item.namespace, item.key, item.payload, item.checksum)
            store.sync()
        elapsed = time.perf_counter() - started
    finally:
        if writer is not None:
            writer.close()
        store.close()
        for entry in directory.glob("bucket-*.kvb"):
            entry.unlink()
    return count * size / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.segment_server.write_probe", description=__doc__)
    parser.add_argument("--dir", required=True, help="directory for the bucket files (on the disk to measure)")
    parser.add_argument("--path", choices=["group", "serial"], default="group")
    parser.add_argument("--object-size", default="1MiB")
    parser.add_argument("--bytes", default="1GiB", help="object bytes written in the pass")
    parser.add_argument("--batch", type=int, default=256, help="records per batch (the worker's poll size)")
    parser.add_argument("--write-buffers", default="64MiB")
    parser.add_argument("--write-threads", type=int, default=DEFAULT_THREADS)
    opts = parser.parse_args(argv)
    try:
        size, total, buffers = parse_size(opts.object_size), parse_size(opts.bytes), parse_size(opts.write_buffers)
        if size < 1 or total < size or opts.batch < 1:
            raise ValueError("need 1 <= --object-size <= --bytes and --batch >= 1")
        Path(opts.dir).mkdir(parents=True, exist_ok=True)
        rate = write_pass(
            Path(opts.dir), opts.path, size, total, batch=opts.batch, buffer_bytes=buffers, threads=opts.write_threads
        )
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"write_probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"path": opts.path, "object_size": size, "bytes": total, "gb_per_s": rate}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
