"""Case 3: concurrent writers and readers, on one shared Client and on a Client per thread.

Each key has exactly one value (derived from the key), written by two writers
at once (so puts of the same key race: PUT_IN_PROGRESS or OK). Writers also
remove keys and write them again. Readers run until every writer is done and
check that every read is a miss or exactly the key's bytes.
"""

from __future__ import annotations

import random
import threading

import pytest

from kvtier.client import KvtierError, Status

WRITERS = 3
READERS = 3
KEYS = 90
ROUNDS = 2


def key_name(i: int) -> str:
    return f"conc/{i:03d}"


def value_of(key: str) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.choice([0, 1, 100, 4096, 50_000, 300_000]))


EXPECTED = {key_name(i): value_of(key_name(i)) for i in range(KEYS)}
KEY_LIST = list(EXPECTED)


@pytest.mark.parametrize("sharing", ["shared-client", "client-per-thread"])
def test_every_concurrent_read_is_a_miss_or_the_written_bytes(cluster, sharing, transport):
    shared = cluster.client(transport=transport)
    client_for = (lambda: shared) if sharing == "shared-client" else (lambda: cluster.client(transport=transport))
    errors: list[str] = []
    hits = [0] * READERS
    writers_done = threading.Event()
    start = threading.Barrier(WRITERS + READERS)

    def writer(w: int) -> None:
        client = client_for()
        rng = random.Random(w)
        # Writer w owns keys w, w+WRITERS, ... and also writes its neighbour's keys, so every key has two writers.
        mine = [k for i, k in enumerate(KEY_LIST) if i % WRITERS in (w, (w + 1) % WRITERS)]
        start.wait()
        try:
            for round_ in range(ROUNDS):
                rng.shuffle(mine)
                for j in range(0, len(mine), 8):
                    chunk = mine[j : j + 8]
                    if j % 16:
                        statuses = client.batch_put(chunk, [EXPECTED[k] for k in chunk])
                    else:
                        statuses = []
                        for k in chunk:
                            try:
                                client.put(k, EXPECTED[k])
                                statuses.append(Status.OK)
                            except KvtierError as exc:
                                statuses.append(exc.status)
                    for k, status in zip(chunk, statuses, strict=True):
                        if status not in (Status.OK, Status.PUT_IN_PROGRESS):
                            errors.append(f"writer {w}: put {k}: {status.name}")
                if round_ < ROUNDS - 1:
                    client.batch_remove(rng.sample(mine, len(mine) // 3))
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(f"writer {w}: {exc!r}")

    def reader(r: int) -> None:
        client = client_for()
        rng = random.Random(100 + r)
        start.wait()
        try:
            while not writers_done.is_set():
                keys = rng.sample(KEY_LIST, 6)
                mode = rng.randrange(3)
                if mode == 0:
                    results = [client.get(keys[0])]
                    keys = keys[:1]
                elif mode == 1:
                    results = client.batch_get(keys)
                else:
                    buffers = [bytearray(len(EXPECTED[k]) + 8) for k in keys]
                    counts = client.batch_get_into(keys, buffers)
                    results = [bytes(b[:n]) if n >= 0 else None for b, n in zip(buffers, counts, strict=True)]
                    for k, n in zip(keys, counts, strict=True):
                        if n < 0 and n != Status.NOT_FOUND:
                            errors.append(f"reader {r}: get_into {k}: {Status(n).name}")
                for k, got in zip(keys, results, strict=True):
                    if got is None:
                        continue
                    hits[r] += 1
                    if got != EXPECTED[k]:
                        errors.append(f"reader {r}: {k}: {len(got)} wrong bytes (want {len(EXPECTED[k])})")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"reader {r}: {exc!r}")

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    readers = [threading.Thread(target=reader, args=(r,)) for r in range(READERS)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    writers_done.set()
    for t in readers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in writers + readers), "a thread hung"
    assert not errors, "\n".join(errors[:20])
    assert sum(hits) > 0, "readers never overlapped with stored data"

    # Writers finished their last round without removing: every key is there with its bytes.
    assert shared.batch_get(KEY_LIST) == [EXPECTED[k] for k in KEY_LIST]
    assert shared.cluster_status().pending_puts == 0
    # Removed ranges stay leased while read, so no reader ever saw reused bytes.
    assert sum(c.stats().get("checksum_mismatches", 0) for c in cluster._clients) == 0


def test_a_client_used_in_a_forked_child_is_refused_with_a_status_never_hangs(cluster):
    """After os.fork() the child has the client's sockets and channel but none of its threads: a batch
    over two segments waited forever for a pool job that never ran. Every call in the child now raises
    KvtierError(CANCELLED) naming the fork; the parent's client works on."""
    import os
    import signal

    from kvtier.proto.errors import KvtierError

    client = cluster.client(transport="tcp")
    keys = [f"fork/{i}" for i in range(16)]
    values = [os.urandom(1000 + i) for i in range(16)]
    assert client.batch_put(keys, values) == [0] * 16
    assert client.batch_get(keys) == values  # the I/O pool runs now (two segments)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each call did, then leave without running any cleanup
        signal.alarm(20)
        outcomes = []
        for call in (lambda: client.batch_get(keys), lambda: client.get(keys[0]), lambda: client.put("c", b"x")):
            try:
                call()
                outcomes.append("returned")
            except KvtierError as exc:
                outcomes.append(f"{exc.status.name}:{'fork' in str(exc)}")
            except BaseException as exc:  # noqa: BLE001 (reported to the parent)
                outcomes.append(repr(exc))
        os.write(write_end, ",".join(outcomes).encode())
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    report = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, report)
    assert report == ",".join(["CANCELLED:True"] * 3), report
    assert client.batch_get(keys) == values


def test_every_call_on_a_closed_client_is_cancelled_never_a_grpc_error(cluster):
    """Calls after close() raised grpc's ValueError ("Cannot invoke RPC on closed channel!"), which the
    Mooncake-compatible API then reported as bad arguments."""
    from kvtier.proto.errors import KvtierError

    client = cluster.client(transport="tcp")
    client.put("k", b"v")
    client.close()
    calls = {
        "put": lambda: client.put("k2", b"v"),
        "batch_put": lambda: client.batch_put(["k3"], [b"v"]),
        "get": lambda: client.get("k"),
        "batch_get": lambda: client.batch_get(["k", "k3"]),
        "get_into": lambda: client.get_into("k", bytearray(8)),
        "exists": lambda: client.exists("k"),
        "remove": lambda: client.remove("k"),
    }
    outcomes = {}
    for name, call in calls.items():
        try:
            outcomes[name] = call()
        except KvtierError as exc:
            outcomes[name] = exc.status
    assert outcomes == {
        "put": Status.CANCELLED,
        "batch_put": [Status.CANCELLED],  # a status per key, as documented
        "get": None,  # reads never raise: a miss (logged with the reason)
        "batch_get": [None, None],
        "get_into": Status.CANCELLED,  # a negative status in place of the size
        "exists": Status.CANCELLED,
        "remove": Status.CANCELLED,
    }
