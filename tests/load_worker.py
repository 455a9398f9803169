"""A writer or reader process for fault tests: `python -m tests.load_worker ROLE MASTER OUT SECONDS [ID]`.

writer: puts keys "load/<id>/<n>" (n = 0, 1, ...) with `expected_value(key)`,
appending each key whose put returned OK to OUT (one per line, flushed), until
SECONDS have passed. Failures (the master away) are counted, not fatal.
reader: gets random keys of the writers' key space; any value that is not
None and not `expected_value(key)` is a wrong answer, written to OUT.

Values depend only on the key, so any process can check any read.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time

from kvtier.client import Client
from kvtier.proto.status import Status

SIZES = (1, 700, 4096, 20_000)


def expected_value(key: str) -> bytes:
    digest = hashlib.sha256(key.encode()).digest()
    size = SIZES[digest[0] % len(SIZES)]
    return (digest * (size // len(digest) + 1))[:size]


def _writer(client: Client, out, seconds: float, worker: str) -> None:
    deadline = time.monotonic() + seconds
    n = 0
    failed = 0
    while time.monotonic() < deadline:
        keys = [f"load/{worker}/{n + i}" for i in range(8)]
        statuses = client.batch_put(keys, [expected_value(k) for k in keys])
        for key, status in zip(keys, statuses, strict=True):
            if status == Status.OK:
                out.write(key + "\n")
            else:
                failed += 1
        out.flush()
        n += len(keys)
    print(f"writer {worker}: {n} keys tried, {failed} failed", flush=True)


def _reader(client: Client, out, seconds: float, writers: int) -> None:
    deadline = time.monotonic() + seconds
    rng = random.Random()
    reads = hits = 0
    while time.monotonic() < deadline:
        keys = [f"load/w{rng.randrange(writers)}/{rng.randrange(2000)}" for _ in range(16)]
        for key, value in zip(keys, client.batch_get(keys), strict=True):
            reads += 1
            if value is not None:
                hits += 1
                if value != expected_value(key):
                    out.write(f"WRONG {key} {len(value)}\n")
                    out.flush()
    print(f"reader: {reads} reads, {hits} hits", flush=True)


def main(argv: list[str]) -> int:
    role, master, path, seconds = argv[0], argv[1], argv[2], float(argv[3])
    worker = argv[4] if len(argv) > 4 else "w0"
    with Client(master, timeout=15.0) as client, open(path, "w") as out:
        if role == "writer":
            _writer(client, out, seconds, worker)
        else:
            _reader(client, out, seconds, int(worker))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
