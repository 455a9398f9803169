"""A master killed with SIGKILL and restarted loses no complete object (issue 6).

Real master and segment processes on loopback; the master keeps its state in
a state dir; the segments keep their DRAM index and report it after the
restart.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.client import KvtierError
from kvtier.client.master import MasterClient
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.load_worker import allowed_final_values, parse_version


@pytest.fixture
def durable(bare_cluster, tmp_path):
    """A master with a state dir and two segments."""
    state_dir = str(tmp_path / "master-state")
    bare_cluster.start_master("--state-dir", state_dir)
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    bare_cluster.state_dir = state_dir
    return bare_cluster


def _segment_used(client) -> dict[str, int]:
    return {s.name: s.dram_used for s in client.cluster_status().segments}


def test_every_complete_object_is_readable_with_the_same_bytes_after_kill_9(durable):
    client = durable.client(instance="engine-a", rank=1)
    client.register_instance(tp_size=2, pp_size=1, budget=64 << 20)
    rng = random.Random(6)
    keys = [f"obj/{i}" for i in range(600)]
    values = [os.urandom(rng.choice((0, 1, 100, 4096, 65536 + 7))) for _ in keys]
    assert not any(client.batch_put(keys[:400], values[:400]))
    assert not any(client.batch_put(keys[400:500], values[400:500], replicas=2))
    assert not any(client.batch_put(keys[500:], values[500:], pin="hard"))
    removed = keys[10:20]
    assert client.batch_remove(removed) == [Status.OK] * len(removed)
    other_ns = durable.client(namespace="other")
    other_ns.put("obj/0", b"another namespace")
    quotas_before = client.quotas()
    used_before = _segment_used(client)
    epoch_before = client.cluster_status().epoch

    durable.restart_master("--state-dir", durable.state_dir)

    # The same client, no reconnect by the test: it retries while the master recovers.
    got = client.batch_get(keys)
    for i, key in enumerate(keys):
        if key in removed:
            assert got[i] is None, f"{key} was removed before the restart and came back"
        else:
            assert got[i] == values[i], f"{key} lost or changed by the restart"
    assert other_ns.get("obj/0") == b"another namespace"
    status = client.cluster_status()
    assert status.epoch > epoch_before
    assert status.role == "leader"
    assert status.recovery["segments_reported"] == 2
    assert status.recovery["objects"] == len(keys) - len(removed) + 100 + 1  # the 100 have two copies
    assert status.recovery["refused"] == 0
    assert _segment_used(client) == used_before  # the same ranges are allocated, no more
    assert client.quotas() == quotas_before  # registration (saved) and usage (from inventories)
    assert {r["segment"] for r in client.locate(keys[450])} == {"seg0", "seg1"}


def test_objects_survive_two_restarts_and_new_puts_in_between(durable):
    client = durable.client()
    assert not any(client.batch_put([f"a/{i}" for i in range(50)], [b"a%d" % i for i in range(50)]))
    durable.restart_master("--state-dir", durable.state_dir)
    assert not any(client.batch_put([f"b/{i}" for i in range(50)], [b"b%d" % i for i in range(50)]))
    client.remove("a/0")
    durable.restart_master("--state-dir", durable.state_dir)
    assert client.batch_get([f"a/{i}" for i in range(50)]) == [None] + [b"a%d" % i for i in range(1, 50)]
    assert client.batch_get([f"b/{i}" for i in range(50)]) == [b"b%d" % i for i in range(50)]


def test_a_put_that_had_not_reached_put_end_is_rolled_back_on_both_sides(durable):
    client = durable.client()
    client.put("committed", b"x" * 4096)
    used_before = _segment_used(client)
    master = MasterClient(durable.master_address, timeout=5.0)
    try:
        started = master.call(
            "PutStart", pb.PutStartRequest(namespace="default", keys=["pending"], sizes=[1 << 20], replicas=1)
        )
        assert started.replica_counts == [1]
        assert sum(_segment_used(client).values()) > sum(used_before.values())

        durable.restart_master("--state-dir", durable.state_dir)

        ended = master.call(
            "PutEnd", pb.PutEndRequest(namespace="default", keys=["pending"], checksums=[0], put_id=started.put_id)
        )
        assert ended.statuses == [Status.TIMEOUT]  # this master cannot know it never committed
    finally:
        master.close()
    assert client.get("pending") is None
    assert client.get("committed") == b"x" * 4096
    assert _segment_used(client) == used_before  # the pending range is free again


def test_a_segment_restarted_meanwhile_brings_nothing_stale(durable):
    client = durable.client()
    assert not any(client.batch_put([f"k/{i}" for i in range(100)], [b"%d" % i for i in range(100)]))
    placed = {key: client.locate(key)[0]["segment"] for key in (f"k/{i}" for i in range(100))}
    durable.kill(durable.segments["seg1"])  # its region (and index) go with it
    durable.start_segment("seg1")
    durable.restart_master("--state-dir", durable.state_dir)
    got = client.batch_get([f"k/{i}" for i in range(100)])
    for i in range(100):
        if placed[f"k/{i}"] == "seg0":
            assert got[i] == b"%d" % i
        else:
            assert got[i] is None


def test_without_saved_state_a_restarted_master_starts_empty_and_serves_at_once(bare_cluster):
    """Opted out (--state-dir none), it cannot know whom it expelled, so it takes no DRAM index: a
    miss, never a stale object."""
    bare_cluster.start_master("--state-dir", "none")
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    client.put("k", b"v")
    bare_cluster.restart_master("--state-dir", "none")
    assert client.get("k") is None
    assert bare_cluster.wait_for(lambda: [s.state for s in client.cluster_status().segments] == ["ACTIVE"])
    client.put("k", b"w")
    assert client.get("k") == b"w"
    status = client.cluster_status()
    assert status.role == "leader" and status.segments[0].objects == 1


def start_load(cluster, tmp_path, seconds: float, writers: int = 2, readers: int = 2):
    """Writer and reader processes (tests/load_worker.py) against the cluster's master spec."""
    procs = []
    for i in range(writers):
        out = tmp_path / f"writer{i}.keys"
        procs.append((out, _spawn_worker(cluster, "writer", out, seconds, f"w{i}")))
    for i in range(readers):
        out = tmp_path / f"reader{i}.wrong"
        procs.append((out, _spawn_worker(cluster, "reader", out, seconds, str(writers))))
    return procs


def _spawn_worker(cluster, role: str, out, seconds: float, worker: str):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.load_worker", role, cluster.master_address, str(out), str(seconds), worker],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish_load(procs) -> tuple[list[str], list[str]]:
    """Wait for the workers; (the writers' operation logs, wrong answers seen by readers)."""
    log, wrong = [], []
    for out, proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output.decode(errors="replace")
        lines = out.read_text().splitlines()
        if out.suffix == ".keys":
            log += lines
        else:
            wrong += [line for line in lines if line]
    return log, wrong


def check_final_state(client, log: list[str]) -> int:
    """Every key the writers touched holds what its last acknowledged operation left (or what a
    later, unacknowledged one did): no acknowledged put lost, no acknowledged removal undone, no
    older version back. Returns the number of keys checked."""
    allowed = allowed_final_values(log)
    keys = sorted(allowed)
    values = client.batch_get(keys)
    bad = []
    for key, value in zip(keys, values, strict=True):
        version = None if value is None else parse_version(key, value)
        if value is not None and version is None:
            bad.append(f"{key}: not a value of this key")
        elif version not in allowed[key]:
            bad.append(f"{key}: holds {version}, allowed {sorted(allowed[key], key=str)}")
    assert not bad, f"{len(bad)} keys in a state no acknowledged history allows, e.g. {bad[:5]}"
    return len(keys)


@pytest.mark.slow  # 6-13 s: runs in make test-slow (CI runs both)
def test_kill_9_under_mixed_load_never_gives_wrong_bytes_and_loses_no_acknowledged_operation(durable, tmp_path):
    procs = start_load(durable, tmp_path, seconds=6.0)
    time.sleep(2.0)
    durable.restart_master("--state-dir", durable.state_dir)
    log, wrong = finish_load(procs)
    assert not wrong, f"readers got wrong bytes: {wrong[:5]}"
    assert sum(1 for line in log if line.startswith("A ")) > 20, "the writers made progress"
    assert check_final_state(durable.client(timeout=10.0), log) > 20


def test_kvtier_status_shows_the_new_epoch_and_what_recovery_rebuilt(durable):
    client = durable.client()
    assert not any(client.batch_put([f"s/{i}" for i in range(20)], [b"x"] * 20))
    before = json.loads(_kvtier("status", "--json", "--master", durable.master_address))
    durable.restart_master("--state-dir", durable.state_dir)
    assert client.get("s/0") == b"x"  # waits out the recovery
    after = json.loads(_kvtier("status", "--json", "--master", durable.master_address))
    assert after["epoch"] > before["epoch"] and after["role"] == "leader"
    assert after["recovery"]["segments_expected"] == 2 == after["recovery"]["segments_reported"]
    assert after["recovery"]["objects"] == 20 and after["recovery"]["active"] == 0
    human = _kvtier("status", "--master", durable.master_address)
    assert "recovery: 2 of 2 expected segments, 20 objects rebuilt" in human


def _kvtier(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_objects_on_the_ssd_tier_survive_and_a_removed_one_stays_removed(bare_cluster, tmp_path):
    from tests.integration.test_ssd_tier import put_and_offload, sources, start_ssd_segment, value_for

    state_dir = str(tmp_path / "state")
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    bare_cluster.start_master("--state-dir", state_dir, "--promote-after-reads", "0")
    start_ssd_segment(bare_cluster, ssd_dir)
    client = bare_cluster.client(timeout=15.0)
    keys = [f"big/{i}" for i in range(40)]
    put_and_offload(bare_cluster, client, keys)
    before = sources(client, keys)
    on_ssd = [k for k in keys if before[k] and before[k].startswith("ssd")]
    in_dram = [k for k in keys if before[k] and before[k].startswith("dram")]
    assert on_ssd and in_dram, before
    removed = [on_ssd[0], in_dram[0]]
    assert client.batch_remove(removed) == [Status.OK, Status.OK]
    bare_cluster.restart_master("--state-dir", state_dir, "--promote-after-reads", "0")  # right after
    after = sources(client, keys)
    assert all(after[k] is None for k in removed), "a removed object came back after the restart"
    kept = [k for k in keys if before[k] and k not in removed]
    assert all(after[k] == before[k] for k in kept), {k: (before[k], after[k]) for k in kept if after[k] != before[k]}
    assert client.get(kept[0]) == value_for(kept[0])


@pytest.mark.slow  # fills 600,000 objects (~30 s): runs in make test-slow
def test_a_segment_whose_inventory_outlasts_the_recovery_gate_keeps_its_objects(bare_cluster, tmp_path):
    """The gate waits for a segment in the middle of its inventory, not for one that has not mounted:
    a segment that checked every byte before mounting (seconds for 600,000 entries, tens at 10M) came
    after a 1 s gate had closed, and every object it held was lost (docs/benchmarks.md, issue 19)."""
    state_dir = str(tmp_path / "master-state")
    bare_cluster.start_master("--state-dir", state_dir, "--recovery-timeout-s", "1")
    bare_cluster.start_segment("seg0", "256MiB")
    client = bare_cluster.client(timeout=30.0)
    count, batch = 600_000, 20_000
    for lo in range(0, count, batch):
        keys = [f"many/{i}" for i in range(lo, lo + batch)]
        assert not any(client.batch_put(keys, [i.to_bytes(8, "little") * 8 for i in range(lo, lo + batch)]))

    bare_cluster.restart_master("--state-dir", state_dir, "--recovery-timeout-s", "1")

    assert bare_cluster.wait_for(lambda: not client.cluster_status().recovery["active"], timeout=60, interval=0.2)
    assert client.cluster_status().recovery["objects"] == count, client.cluster_status().recovery
    sample = random.Random(19).sample(range(count), 2_000)
    got = client.batch_get([f"many/{i}" for i in sample])
    assert got == [i.to_bytes(8, "little") * 8 for i in sample]


def test_a_master_that_cannot_read_its_state_refuses_changes_after_a_segment_left_saying_why(bare_cluster):
    """It serves without recovery and never overwrites the file it could not read, so it cannot
    record that a segment left (the next incarnation would re-adopt that segment's stale index):
    changes after one did are refused with the cause, not "segments did not acknowledge"."""
    state_dir = bare_cluster.state_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "master-state.json").write_bytes(b"{not json")
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0")
    seg1 = bare_cluster.start_segment("seg1")
    client = bare_cluster.client(timeout=30.0)
    client.put("before", b"x" * 100)
    assert client.exists("before")
    bare_cluster.kill(seg1, signal.SIGTERM)  # unmounts: its name would have to be saved as gone
    assert bare_cluster.wait_for(lambda: len(client.cluster_status().segments) == 1)
    # NOT_DURABLE, which no client retries: it fails at once, not after its 30 s of UNAVAILABLE retries
    started = time.monotonic()
    with pytest.raises(KvtierError) as refused:
        client.remove("before")
    assert refused.value.status == Status.NOT_DURABLE and "saved state" in refused.value.message
    for transport in ("tcp", "shm"):  # a put too, its PutEnd relayed by its segment (tcp) or not
        writer = bare_cluster.client(timeout=30.0, transport=transport)
        with pytest.raises(KvtierError) as refused:
            writer.put(f"after-{transport}", b"y" * 100)
        assert refused.value.status == Status.NOT_DURABLE and "saved state" in refused.value.message
    assert time.monotonic() - started < 10
    # Refused before anything changed: the key is still there, the new ones never became visible.
    assert client.exists("before") and not any(client.batch_exists(["after-tcp", "after-shm"]))
    with pytest.raises(KvtierError) as refused:  # a registration is acknowledged only once saved
        bare_cluster.client(instance="llm", rank=0).register_instance(tp_size=1, pp_size=1, budget=1 << 20)
    assert refused.value.status == Status.NOT_DURABLE and "saved state" in refused.value.message
    assert (state_dir / "master-state.json").read_bytes() == b"{not json"  # never overwritten
