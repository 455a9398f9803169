"""One client process of a chaos run: `python -m tests.chaos.worker --master ADDR --id w0 ...`.

The worker owns the keys `h/<id>.<incarnation>/<n>` (one writer per key: a restarted worker is a
new incarnation with fresh keys, so an op its killed predecessor left in flight can never be
confused with a new one), and reads its own keys and other workers' (all incarnations up to the
ones named in `<run-dir>/incarnations.json`).

Per key the writer alternates: put a new version only after a remove of the key was acknowledged
(OK or NOT_FOUND) -- puts are idempotent, a put onto a complete object answers OK without writing
-- and after any put, acknowledged or not, remove before the next one. So an acknowledged put
stored exactly its value.

Every op is two JSON lines in `--out`: {"k": "i", ...} when invoked and {"k": "c", ...} when it
completed, each flushed at once (a SIGKILL loses nothing handed to the kernel) and fsynced every
FSYNC_EVERY ops. An op with no completion line is indeterminate. Times are time.monotonic()
(CLOCK_MONOTONIC), comparable with the master's history log and the harness's fault log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import crc32c

from kvtier.client import Client
from kvtier.proto.status import Status
from tests.chaos.values import Identity, identify, make_value

FSYNC_EVERY = 32
SIZES = (64, 900, 4096, 40_000, 200_000)  # small to several frames; batches of large ones keep frames in flight
MAX_SIZE = max(SIZES)


def key_of(writer: str, incarnation: int, n: int) -> str:
    return f"h/{writer}.{incarnation}/{n}"


class Recorder:
    def __init__(self, path: str, proc: str) -> None:
        self.out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.proc = proc
        self.next_id = 0
        self.unsynced = 0

    def invoke(self, op: str, keys: list[str], **extra) -> int:
        op_id = self.next_id
        self.next_id += 1
        self._line({"k": "i", "p": self.proc, "id": op_id, "op": op, "keys": keys, "t": time.monotonic(), **extra})
        return op_id

    def complete(self, op_id: int, results: list, **extra) -> None:
        self._line({"k": "c", "p": self.proc, "id": op_id, "t": time.monotonic(), "r": results, **extra})
        self.unsynced += 1
        if self.unsynced >= FSYNC_EVERY:
            os.fsync(self.out.fileno())
            self.unsynced = 0

    def _line(self, record: dict) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")


def status_name(status) -> str:
    try:
        return Status(int(status)).name
    except ValueError:
        return str(int(status))


def failure(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"EXC:{type(exc).__name__}:{status_name(status) if status is not None else ''}"


def read_result(result: int, buf: bytearray) -> object:
    """A get's outcome for the record: {"v": [key, writer, version]}, "miss" (NOT_FOUND), {"corrupt": why},
    or the failure status (unavailable: no claim either way)."""
    if result >= 0:
        ident = identify(memoryview(buf)[:result])
        if isinstance(ident, Identity):
            return {"v": [ident.key, ident.writer, ident.version]}
        return {"corrupt": ident}
    if result == int(Status.NOT_FOUND):
        return "miss"
    return status_name(result)


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(f"{args.seed}/{args.id}/{args.incarnation}")
        self.proc = f"{args.id}.{args.incarnation}"
        self.keys = [key_of(args.id, args.incarnation, n) for n in range(args.keys)]
        self.version = dict.fromkeys(self.keys, 0)
        self.may_hold = dict.fromkeys(self.keys, False)  # False only after an acknowledged remove
        self.record = Recorder(args.out, self.proc)
        self.client = Client(args.master, timeout=args.timeout, transport=args.transport)
        self.buffers = [bytearray(MAX_SIZE) for _ in range(args.batch)]
        self.incarnations: dict[str, int] = {}
        self.incarnations_read = 0.0

    def run(self) -> None:
        deadline = time.monotonic() + self.args.seconds
        stop_file = Path(self.args.run_dir) / "stop"
        while time.monotonic() < deadline and not stop_file.exists():
            choice = self.rng.random()
            if choice < 0.45:
                self.write()
            elif choice < 0.75:
                self.get(self.rng.sample(self.keys, self.batch_size()))
            else:
                self.get([self.foreign_key() for _ in range(self.batch_size())])
        self.client.close()

    def batch_size(self) -> int:
        return 1 if self.rng.random() < 0.4 else self.rng.randint(2, self.args.batch)

    def foreign_key(self) -> str:
        now = time.monotonic()
        if now - self.incarnations_read > 1.0:
            self.incarnations_read = now
            try:
                self.incarnations = json.loads((Path(self.args.run_dir) / "incarnations.json").read_text())
            except (OSError, ValueError):
                pass  # being rewritten: keep the last one
        writer = f"w{self.rng.randrange(self.args.workers)}"
        incarnation = self.rng.randint(0, self.incarnations.get(writer, 0))
        return key_of(writer, incarnation, self.rng.randrange(self.args.keys))

    def write(self) -> None:
        keys = self.rng.sample(self.keys, self.batch_size())
        removes = [k for k in keys if self.may_hold[k]]
        puts = [k for k in keys if not self.may_hold[k]]
        if removes:
            self.remove(removes)
        if puts:
            self.put(puts)

    def put(self, keys: list[str]) -> None:
        values, versions = [], []
        for key in keys:
            self.version[key] += 1
            versions.append(self.version[key])
            values.append(make_value(key, self.args.id, self.version[key], self.rng.choice(SIZES)))
            self.may_hold[key] = True
        replicas = 2 if self.args.replicas > 1 and self.rng.random() < 0.25 else 1
        crcs = [crc32c.crc32c(v) for v in values]  # what the master's history log names the object by
        op = self.record.invoke("put", keys, versions=versions, crcs=crcs, replicas=replicas, tr=self.args.transport)
        try:
            if len(keys) == 1 and self.rng.random() < 0.5:
                try:
                    self.client.put(keys[0], values[0], replicas=replicas)
                    results = ["OK"]
                except Exception as exc:  # noqa: BLE001 - every failure is recorded, none is fatal
                    results = [status_name(exc.status) if hasattr(exc, "status") else failure(exc)]
            else:
                results = [status_name(s) for s in self.client.batch_put(keys, values, replicas=replicas)]
        except Exception as exc:  # noqa: BLE001
            results = [failure(exc)] * len(keys)
        self.record.complete(op, results)

    def remove(self, keys: list[str]) -> None:
        op = self.record.invoke("remove", keys, tr=self.args.transport)
        try:
            results = [status_name(s) for s in self.client.batch_remove(keys)]
        except Exception as exc:  # noqa: BLE001
            results = [failure(exc)] * len(keys)
        for key, result in zip(keys, results, strict=True):
            if result in ("OK", "NOT_FOUND"):
                self.may_hold[key] = False
        self.record.complete(op, results)

    def get(self, keys: list[str]) -> None:
        buffers = self.buffers[: len(keys)]
        op = self.record.invoke("get", keys, tr=self.args.transport)
        direct = self.client.stats().get("direct_reads", 0)
        try:
            if len(keys) == 1:
                raw = [self.client.get_into(keys[0], buffers[0])]
            else:
                raw = self.client.batch_get_into(keys, buffers)
            results = [read_result(int(r), b) for r, b in zip(raw, buffers, strict=True)]
        except Exception as exc:  # noqa: BLE001
            results = [failure(exc)] * len(keys)
        # How many of them the segments served alone (direct reads, kvtier.client.locations).
        self.record.complete(op, results, dr=self.client.stats().get("direct_reads", 0) - direct)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--keys", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3.0)
    Worker(parser.parse_args(argv)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
