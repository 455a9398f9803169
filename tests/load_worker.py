"""A writer or reader process for fault tests: `python -m tests.load_worker ROLE MASTER OUT SECONDS [ID]`.

writer: over a small key space ("load/<id>/<n>", n < KEYS), puts new versions
and removes keys, in batches, until SECONDS have passed. Each batch is logged
to OUT before it is sent ("I op version keys...") and after it is answered
("A op version status,status,..."), flushed each time, so the test can tell
what a key may hold at the end: the result of its last acknowledged
operation, or of any operation after it that failed or was in flight.
reader: gets random keys of the writers' key space; a value that is not a
well-formed version of its own key is a wrong answer, written to OUT.

Values carry their key and version, so any process can check any read.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time
from collections.abc import Iterable

from kvtier.client import Client
from kvtier.proto.status import Status

KEYS = 48
SIZES = (1, 700, 4096, 20_000)
_OK_REMOVE = (int(Status.OK), int(Status.NOT_FOUND))


def versioned_value(key: str, version: int) -> bytes:
    head = f"{key}@{version}#".encode()
    digest = hashlib.sha256(head).digest()
    size = max(SIZES[digest[0] % len(SIZES)], len(head))
    return (head + digest * (size // len(digest) + 1))[:size] if size > len(head) else head


def parse_version(key: str, value: bytes) -> int | None:
    """The version `value` is of `key`, or None when it is not a well-formed value of that key."""
    head, sep, _ = value.partition(b"#")
    name, at, version = head.decode(errors="replace").rpartition("@")
    if not sep or not at or name != key or not version.isdigit():
        return None
    return int(version) if value == versioned_value(key, int(version)) else None


def expected_value(key: str) -> bytes:
    """Version 0 of a key: what tests that only put once store."""
    return versioned_value(key, 0)


def _writer(client: Client, out, seconds: float, worker: str) -> None:
    deadline = time.monotonic() + seconds
    rng = random.Random(worker)
    version = 0
    failed = 0
    while time.monotonic() < deadline:
        version += 1
        keys = sorted({f"load/{worker}/{rng.randrange(KEYS)}" for _ in range(6)})
        op = "remove" if rng.random() < 0.25 else "put"
        out.write(f"I {op} {version} {' '.join(keys)}\n")
        out.flush()
        if op == "put":
            statuses = [int(s) for s in client.batch_put(keys, [versioned_value(k, version) for k in keys])]
            ok = [s == 0 for s in statuses]
        else:
            try:
                statuses = [int(s) for s in client.batch_remove(keys)]
            except Exception as exc:  # the master away past the timeout: the removal is uncertain
                statuses = [int(getattr(exc, "status", Status.INTERNAL))] * len(keys)
            ok = [s in _OK_REMOVE for s in statuses]
        failed += ok.count(False)
        out.write(f"A {op} {version} {','.join(map(str, statuses))}\n")
        out.flush()
    print(f"writer {worker}: {version} batches, {failed} operations failed", flush=True)


def _reader(client: Client, out, seconds: float, writers: int) -> None:
    deadline = time.monotonic() + seconds
    rng = random.Random()
    reads = hits = 0
    while time.monotonic() < deadline:
        keys = [f"load/w{rng.randrange(writers)}/{rng.randrange(KEYS)}" for _ in range(16)]
        for key, value in zip(keys, client.batch_get(keys), strict=True):
            reads += 1
            if value is not None:
                hits += 1
                if parse_version(key, value) is None:
                    out.write(f"WRONG {key} {len(value)}\n")
                    out.flush()
    print(f"reader: {reads} reads, {hits} hits", flush=True)


def allowed_final_values(log_lines: Iterable[str]) -> dict[str, set[int | None]]:
    """Per key, what it may hold at the end: None (absent) or a version.

    Replays each key's operations over the set of states it may be in: a put
    of a key that exists changes nothing (puts are idempotent, objects
    immutable), a removal empties it. An acknowledged operation happened; one
    that failed, or was in flight when the writer stopped, may or may not
    have.
    """
    ops: dict[str, list[tuple[str, int, bool]]] = {}  # key -> [(op, version, acknowledged)]
    intents: dict[int, tuple[str, list[str]]] = {}
    for line in log_lines:
        parts = line.split()
        if not parts:
            continue
        kind, op, version = parts[0], parts[1], int(parts[2])
        if kind == "I":
            intents[version] = (op, parts[3:])
            for key in parts[3:]:
                ops.setdefault(key, []).append((op, version, False))
        else:
            op, keys = intents[version]
            for key, status in zip(keys, (int(s) for s in parts[3].split(",")), strict=True):
                acknowledged = status == 0 if op == "put" else status in _OK_REMOVE
                ops[key][-1] = (op, version, acknowledged)
    allowed: dict[str, set[int | None]] = {}
    for key, history in ops.items():
        states: set[int | None] = {None}
        for op, version, acknowledged in history:
            after = {None} if op == "remove" else {version if s is None else s for s in states}
            states = after if acknowledged else states | after
        allowed[key] = states
    return allowed


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
