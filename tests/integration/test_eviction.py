"""Eviction, pins, per-rank quotas and replica failover against real processes.

Values are derived from their keys (`value_for`), so any process can check
what it reads without being told what was written: a read must be either a
miss or exactly those bytes. Writers under load run as separate client
processes (`python -c` importing `_writer` from this module).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from kvtier.client import Client, KvtierError, Status

MiB = 1 << 20
KiB = 1 << 10
SEGMENT = 64 * MiB
ROOT = Path(__file__).resolve().parents[2]
KVTIER = [sys.executable, "-m", "kvtier.cli.main"]
EVICTION_REASONS = {"watermark", "allocation", "quota"}


def value_for(key: str, low: int = MiB, high: int = 4 * MiB) -> bytes:
    """The bytes stored under `key`: a size in [low, high] and a content, both derived from the key."""
    seed = zlib.crc32(key.encode())
    return random.Random(seed).randbytes(low + seed % (high - low + 1))


def kvtier(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*KVTIER, *args], capture_output=True, timeout=60)
    assert result.returncode == 0, f"kvtier {args} exited {result.returncode}: {result.stderr.decode()}"
    return result


def _writer(master: str, writer: str, count: str) -> None:
    """Body of a writer process: put `count` distinct objects one by one; print the failures as JSON."""
    failures = []
    with Client(master, timeout=30.0) as client:
        for i in range(int(count)):
            key = f"load/{writer}/{i:03d}"
            status = client.batch_put([key], [value_for(key)])[0]
            if status != Status.OK:
                failures.append([key, status.name])
    print(json.dumps({"failures": failures}), flush=True)


def start_writer(master: str, writer: str, count: int) -> subprocess.Popen:
    code = "import sys; from tests.integration.test_eviction import _writer; _writer(*sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, master, writer, str(count)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


class Reader(threading.Thread):
    """Reads keys at random until stopped; records every read that is neither a miss nor the right bytes.

    Every other read picks among the keys `exists` reports (no lease, no recency), so reads mostly hit.
    """

    def __init__(self, client: Client, keys: list[str], pause: float = 0.03) -> None:
        super().__init__(daemon=True)
        self.client, self.keys, self.pause = client, keys, pause
        self.stop = threading.Event()
        self.hits = self.misses = 0
        self.wrong: list[str] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        rng = random.Random(1)
        try:
            while not self.stop.is_set():
                candidates = self.keys
                if self.hits + self.misses & 1:
                    found = self.client.batch_exists(self.keys)
                    present = [k for k, there in zip(self.keys, found, strict=True) if there]
                    candidates = present or self.keys
                key = rng.choice(candidates)
                got = self.client.get(key)
                if got is None:
                    self.misses += 1
                elif got == value_for(key):
                    self.hits += 1
                else:
                    self.wrong.append(key)
                self.stop.wait(self.pause)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


# ------------------------------------------------------------------ (a) + (b): sustained load from several processes


@pytest.mark.slow  # a soak: ~300 MiB from three processes; test_concurrency.py covers reads under writes
def test_sustained_writes_from_several_processes_evict_and_never_serve_wrong_bytes(bare_cluster):
    # given a master with short read leases (the reader's leases must not hold much of the cluster), 2 x 64 MiB
    cluster = bare_cluster
    cluster.start_master("--lease-s", "0.5")
    cluster.start_segment("seg0")
    cluster.start_segment("seg1")
    main = cluster.client(timeout=30.0)
    # and ~20 MiB of hard-pinned objects, written first (the least recently used of all)
    pinned = {f"pinned/{i}": value_for(f"pinned/{i}") for i in range(8)}
    assert main.batch_put(list(pinned), list(pinned.values()), pin="hard") == [Status.OK] * len(pinned)

    # when 3 writer processes each put 40 distinct objects of 1-4 MiB (~300 MiB in all) while a thread reads
    writers, count = ["w0", "w1", "w2"], 40
    keys = [f"load/{w}/{i:03d}" for w in writers for i in range(count)]
    assert sum(len(value_for(k)) for k in keys) > 2 * (2 * SEGMENT), "the load must be over twice the capacity"
    reader = Reader(cluster.client(timeout=30.0), keys + list(pinned))
    reader.start()
    procs = [start_writer(cluster.master_address, w, count) for w in writers]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"writer exited {proc.returncode}:\n{err.decode()[-3000:]}"
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.stop.set()
        reader.join(timeout=30)

    # then no put failed: eviction always made room
    assert [r["failures"] for r in results] == [[], [], []]
    # every read during the load was a miss or the right bytes, and never failed verification
    assert not reader.errors, reader.errors
    assert reader.wrong == []
    assert reader.client.stats().get("checksum_mismatches", 0) == 0, "a range was reused under a reader's lease"
    assert reader.hits > 0, "the reader never found an object: the test checked nothing"
    # and afterwards too, once the cluster is quiet: the reader's 0.5 s leases ended and the watermark
    # pass brought both segments under 0.90 (otherwise it may still evict between the reads below and
    # the status call, and the object count would race)
    assert cluster.wait_for(
        lambda: all(s.dram_used <= 0.9 * s.dram_capacity for s in main.cluster_status().segments), timeout=20
    )
    got = main.batch_get(keys)
    kept = [k for k, v in zip(keys, got, strict=True) if v is not None]
    assert all(v is None or v == value_for(k) for k, v in zip(keys, got, strict=True))
    assert kept, "eviction must keep the most recent objects"
    assert main.stats().get("checksum_mismatches", 0) == 0
    # (b) the hard-pinned objects survived all of it
    assert main.batch_get(list(pinned)) == list(pinned.values())

    status = main.cluster_status()
    evicted = {e.reason: (e.objects, e.bytes) for e in status.evictions}
    assert sum(objects for objects, _ in evicted.values()) > 0
    assert set(evicted) <= EVICTION_REASONS and "quota" not in evicted
    assert status.used <= status.capacity == 2 * SEGMENT
    assert all(s.dram_used <= s.dram_capacity for s in status.segments)
    assert status.pending_puts == 0
    assert status.objects == len(kept) + len(pinned)


# ------------------------------------------------------------------ (c): per-rank quota end to end


def test_per_rank_quota_keeps_a_ranks_newest_objects_and_leaves_other_ranks_alone(cluster):
    rank0 = cluster.client(instance="llm", rank=0)
    rank1 = cluster.client(instance="llm", rank=1)
    # TP=2, PP=1 and a 16 MiB budget: 8 MiB per rank
    assert rank0.register_instance(tp_size=2, pp_size=1, budget=16 * MiB) == 8 * MiB
    assert rank1.register_instance(tp_size=2, pp_size=1, budget=16 * MiB) == 8 * MiB, "idempotent"

    def values(prefix: str, n: int) -> dict[str, bytes]:
        return {f"{prefix}/{i:02d}": value_for(f"{prefix}/{i:02d}", MiB, MiB) for i in range(n)}

    ones = values("r1", 4)
    assert rank1.batch_put(list(ones), list(ones.values())) == [Status.OK] * 4
    # rank 0 writes 20 MiB, one 1 MiB object at a time: every put succeeds, its oldest objects make room
    zeros = values("r0", 20)
    for key, value in zeros.items():
        rank0.put(key, value)
    keys0 = list(zeros)
    assert rank0.batch_exists(keys0) == [False] * 12 + [True] * 8, "rank 0 keeps exactly its 8 newest MiB"
    assert rank0.batch_get(keys0[12:]) == [zeros[k] for k in keys0[12:]]
    assert rank1.batch_get(list(ones)) == list(ones.values()), "rank 1's objects are untouched"

    quotas = {(q["instance"], q["rank"]): q for q in rank0.quotas()}
    assert quotas[("llm", 0)] == {
        "instance": "llm",
        "rank": 0,
        "quota": 8 * MiB,
        "used": 8 * MiB,
        "objects": 8,
        "tp_size": 2,
        "pp_size": 1,
    }
    assert (quotas[("llm", 1)]["quota"], quotas[("llm", 1)]["used"], quotas[("llm", 1)]["objects"]) == (
        8 * MiB,
        4 * MiB,
        4,
    )
    status = rank0.cluster_status()
    assert {e.reason: (e.objects, e.bytes) for e in status.evictions} == {"quota": (12, 12 * MiB)}

    # the command line shows the same numbers as the client, and no rank above its quota
    from_cli = json.loads(kvtier("quotas", "--master", cluster.master_address, "--json").stdout)
    assert from_cli == rank0.quotas()
    assert all(q["used"] <= q["quota"] for q in from_cli if q["quota"])
    table = kvtier("quotas", "--master", cluster.master_address).stdout.decode()
    assert "llm" in table and "2x1" in table

    # a rank beyond TP x PP is refused, and so is an invalid registration
    with pytest.raises(KvtierError) as info:
        cluster.client(instance="llm", rank=2).put("r2/00", b"x")
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvtierError) as info:
        rank0.register_instance(tp_size=0, pp_size=1, budget=MiB)
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        cluster.client().register_instance(1, 1, MiB)  # no instance to register


def test_a_hard_pinned_rank_is_quota_exceeded_end_to_end(cluster):
    client = cluster.client(instance="pinned", rank=0)
    assert client.register_instance(1, 1, 4 * MiB) == 4 * MiB
    client.batch_put(["h0", "h1"], [bytes(2 * MiB), bytes(2 * MiB)], pin="hard")
    with pytest.raises(KvtierError) as info:
        client.put("more", b"x")
    assert info.value.status == Status.QUOTA_EXCEEDED
    assert client.batch_get(["h0", "h1"]) == [bytes(2 * MiB)] * 2


# ------------------------------------------------------------------ (d): replica failover while a segment dies


class FailoverReader(threading.Thread):
    """Reads every key in a loop over TCP; every value must be the right bytes (a miss is a failure too)."""

    def __init__(self, client: Client, values: dict[str, bytes]) -> None:
        super().__init__(daemon=True)
        self.client, self.values = client, values
        self.stop = threading.Event()
        self.rounds = 0
        self.bad: list[tuple[str, str]] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        keys = list(self.values)
        try:
            while not self.stop.is_set():
                for key, got in zip(keys, self.client.batch_get(keys), strict=True):
                    if got != self.values[key]:
                        self.bad.append((key, "miss" if got is None else "wrong bytes"))
                self.rounds += 1
        except BaseException as exc:
            self.errors.append(exc)

    def rounds_from_now(self, n: int):
        start = self.rounds
        return lambda: self.rounds >= start + n or not self.is_alive()


def test_reads_fall_back_to_the_other_replica_when_a_segment_dies_mid_read(cluster):
    writer = cluster.client(transport="tcp")
    values = {f"r/{i:02d}": os.urandom(256 * KiB + i) for i in range(24)}
    assert writer.batch_put(list(values), list(values.values()), replicas=2) == [Status.OK] * len(values)
    assert all({r["segment"] for r in writer.locate(k)} == {"seg0", "seg1"} for k in values)
    # the segment to kill: the one the master lists first (the client, with both on this host, tries it first)
    doomed = writer.locate(next(iter(values)))[0]["segment"]
    survivor = ({"seg0", "seg1"} - {doomed}).pop()

    reader = FailoverReader(cluster.client(transport="tcp"), values)
    reader.start()
    try:
        assert cluster.wait_for(reader.rounds_from_now(3), timeout=30)
        # when that segment is SIGKILLed while the reader is reading
        cluster.kill(cluster.segments[doomed])
        # then reads go on returning the right bytes, first while the master still lists it ...
        assert writer.batch_get(list(values)) == list(values.values())
        assert cluster.wait_for(reader.rounds_from_now(3), timeout=30)
        # ... and after the master dropped it (its heartbeats stopped)
        assert cluster.wait_for(
            lambda: [s.name for s in writer.cluster_status().segments] == [survivor],
            timeout=cluster.segment_ttl_s + 10,
        )
        assert all([r["segment"] for r in writer.locate(k)] == [survivor] for k in values)
        assert cluster.wait_for(reader.rounds_from_now(3), timeout=30)
    finally:
        reader.stop.set()
        reader.join(timeout=30)
    assert not reader.errors, reader.errors
    assert reader.bad == []
    assert writer.batch_get(list(values)) == list(values.values())
    assert reader.client.stats().get("checksum_mismatches", 0) == 0
    assert cluster.client(transport="tcp").batch_get(list(values)) == list(values.values()), "a fresh client too"


# ------------------------------------------------------------------ (e): `kvtier status --json` reports evictions


def test_status_json_reports_evictions_by_reason(bare_cluster):
    # given one 64 MiB segment
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("seg0")
    client = cluster.client(timeout=30.0)
    chunk = 4 * MiB

    # watermark: 15 x 4 MiB is 93.75% full; the master's tick evicts down to at most 85%
    for i in range(15):
        client.put(f"w/{i:02d}", value_for(f"w/{i:02d}", chunk, chunk))

    def evictions() -> dict:
        return {e.reason: (e.objects, e.bytes) for e in client.cluster_status().evictions}

    assert cluster.wait_for(lambda: "watermark" in evictions(), timeout=15)
    assert cluster.wait_for(lambda: client.cluster_status().used <= 0.85 * SEGMENT, timeout=15)
    # allocation: a 32 MiB object does not fit in what is free (at most 16 MiB) and evicts to make room
    big = value_for("big", 32 * MiB, 32 * MiB)
    client.put("big", big)
    assert "allocation" in evictions()
    # quota: a rank of 8 MiB putting a third 4 MiB object evicts its first
    ranked = cluster.client(instance="engine", rank=0, timeout=30.0)
    assert ranked.register_instance(1, 1, 8 * MiB) == 8 * MiB
    for i in range(3):
        ranked.put(f"q/{i}", value_for(f"q/{i}", chunk, chunk))
    assert ranked.batch_exists(["q/0", "q/1", "q/2"]) == [False, True, True]
    assert "quota" in evictions()
    # once the segment is back under the watermark nothing changes any more: compare the CLI with the RPC
    assert cluster.wait_for(lambda: client.cluster_status().used <= 0.9 * SEGMENT, timeout=15)

    data = json.loads(kvtier("status", "--master", cluster.master_address, "--json").stdout)
    assert set(data["evictions"]) == EVICTION_REASONS
    for reason, counts in data["evictions"].items():
        assert set(counts) == {"objects", "bytes"}
        assert counts["objects"] >= 1 and counts["bytes"] >= counts["objects"] * chunk, reason
    assert data["evictions"] == {r: {"objects": o, "bytes": b} for r, (o, b) in evictions().items()}
    assert data["evictions"]["quota"] == {"objects": 1, "bytes": chunk}
    assert data["used"] <= data["capacity"] == SEGMENT
    engine = [q for q in data["quotas"] if q["instance"] == "engine"]
    assert engine == [
        {"instance": "engine", "rank": 0, "quota": 8 * MiB, "used": 8 * MiB, "objects": 2, "tp_size": 1, "pp_size": 1}
    ]
    assert client.get("big") in (None, big)
