"""Where the time goes on each data path: py-spy profiles of the client and the segment server.

    python -m kvtier.bench.profile [--seconds 4] [--size 4MiB] [--batch 32]

For each path (tcp/shm x batch_put/batch_get_into) a worker process drives
the workload in a loop against a local cluster while py-spy samples it (and,
for TCP, the segment server) with `--idle`, so time blocked in syscalls
(socket sends and receives, where the kernel copies) is counted too. Each
profile is summarised by the innermost kvtier or library frame of every
sample; the report is Markdown, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

from kvtier.common.units import parse_size

PATHS = [("tcp", "put"), ("tcp", "get"), ("shm", "put"), ("shm", "get")]


def worker(master: str, transport: str, op: str, size: int, batch: int, seconds: float) -> None:
    from kvtier.client import Client

    with Client(master, transport=transport, namespace=f"profile-{transport}-{op}", timeout=30) as client:
        source = bytearray(os.urandom(size * batch))
        values = [memoryview(source)[i * size : (i + 1) * size] for i in range(batch)]
        keys = [f"k{i}" for i in range(batch)]
        client.batch_put(keys, values)
        buffers = [bytearray(size) for _ in range(batch)]
        end = time.monotonic() + seconds
        rounds = 0
        while time.monotonic() < end:
            if op == "put":
                fresh = [f"p{rounds}/{i}" for i in range(batch)]
                client.batch_put(fresh, values)
                client.batch_remove(fresh)
            else:
                client.batch_get_into(keys, buffers)
            rounds += 1


def frame_label(stack: str) -> str:
    """The innermost frame worth naming: stdlib/runpy plumbing frames are skipped."""
    frames = stack.split(";")
    for frame in reversed(frames):
        name = frame.split(" (", 1)[0]
        where = frame.split(" (", 1)[1].rstrip(")") if " (" in frame else ""
        if "threading.py" in where or "runpy" in where:
            continue
        return f"{name} ({where.rsplit('/', 2)[-2] + '/' if where.count('/') else ''}{where.rsplit('/', 1)[-1]})"
    return frames[-1]


# Threads that only wait (the heartbeat thread, idle pool workers) are not part of a data path.
IDLE_MARKERS = ("MasterLink._run", "Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py")


def summarise(raw_path: str, top: int = 6) -> list[tuple[str, float]]:
    counts: collections.Counter[str] = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if any(marker in stack for marker in IDLE_MARKERS):
                continue
            if stack and count.isdigit():
                counts[frame_label(stack)] += int(count)
    total = sum(counts.values()) or 1
    return [(label, 100.0 * n / total) for label, n in counts.most_common(top)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.profile", description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--worker", nargs=5, metavar=("MASTER", "TRANSPORT", "OP", "SIZE", "SECONDS"), help=argparse.SUPPRESS
    )
    opts = parser.parse_args(argv)
    if opts.worker:
        master, transport, op, size, seconds = opts.worker
        worker(master, transport, op, int(size), opts.batch, float(seconds))
        return 0
    if shutil.which("py-spy") is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 1
    from kvtier.common.local_cluster import LocalCluster
    from kvtier.common.supervisor import Supervisor

    size = parse_size(opts.size)
    print(f"Profiles: batches of {opts.batch} x {opts.size}, {opts.seconds:.0f} s per path, py-spy --idle.\n")
    with (
        LocalCluster(dram="2GiB", quiet=True, cluster_id=f"profile{os.getpid()}") as cluster,
        tempfile.TemporaryDirectory() as tmp,
        Supervisor() as workers,  # a worker left running by an error is stopped on the way out
    ):
        segment_pid = cluster.children[1].popen.pid
        for transport, op in PATHS:
            warmup = 1.5
            proc = workers.start(
                f"{transport}-{op}",
                [sys.executable, "-m", "kvtier.bench.profile", "--batch", str(opts.batch), "--worker",
                 cluster.master_address, transport, op, str(size), str(opts.seconds + warmup + 1)],
                log=None,
            ).popen  # fmt: skip
            time.sleep(warmup)
            targets = [("client", proc.pid)] + ([("segment server", segment_pid)] if transport == "tcp" else [])
            recorders = []
            for role, pid in targets:
                out = os.path.join(tmp, f"{transport}-{op}-{role.replace(' ', '_')}.txt")
                command = ["py-spy", "record", "--idle", "--nonblocking", "-r", "250", "-d", str(int(opts.seconds))]
                command += ["-f", "raw", "-o", out, "-p", str(pid)]
                recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                recorders.append((role, out, recorder))
            for _, _, rec in recorders:
                rec.wait()
            proc.wait()
            for role, out, _ in recorders:
                print(f"**{transport} batch_{'put' if op == 'put' else 'get_into'} — {role}**\n")
                print("| share | innermost frame |\n|---:|---|")
                for label, share in summarise(out):
                    print(f"| {share:.0f}% | `{label}` |")
                print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
