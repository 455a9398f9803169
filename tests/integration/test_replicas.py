"""Replica operations (issue 21): remove one replica, copy or move one to a named segment.

Real master and segment processes. Copies go over the data plane and are verified against the
object's checksum before the master records them; the master never moves bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvtier.client.replicas import copy_batch
from kvtier.client.transport.shm import ShmConnector
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import InvalidKeyError
from kvtier.proto.status import Status

KiB = 1024
MiB = 1 << 20


def segments_of(client, key: str) -> list[str]:
    info = client.stat(key)
    return sorted(r.segment for r in info.replicas) if info else []


def scribble(cluster, client, segment: str, offset: int, length: int = 16) -> None:
    """Flip bytes of a stored DRAM replica through a granted mapping of its region."""
    (endpoint,) = [e for e in cluster.segments[segment].info["endpoints"] if e.startswith("shm://")]
    connector = ShmConnector(endpoint, client.config)
    try:
        (old,) = connector.read([(offset, length)])
        assert connector.write([(offset, bytes(b ^ 0xFF for b in old))]) == [0]
    finally:
        connector.close()


@pytest.fixture
def three(cluster):
    """The shared two-segment cluster plus seg2."""
    cluster.start_segment("seg2")
    return cluster


def test_a_copy_is_a_second_replica_readable_with_the_first_segment_killed(three):
    cluster = three
    client = cluster.client(transport="tcp")
    value = os.urandom(300 * KiB)
    client.put("k", value, preferred_segment="seg0")
    assert segments_of(client, "k") == ["seg0"]

    assert client.copy_replica("k", "seg1") == Status.OK

    assert segments_of(client, "k") == ["seg0", "seg1"]
    assert client.get("k") == value
    cluster.kill(cluster.segments["seg0"], signal.SIGKILL)
    assert cluster.wait_for(lambda: "seg0" not in [s.name for s in client.cluster_status().segments])
    assert segments_of(client, "k") == ["seg1"]
    assert client.get("k") == value


def test_a_copy_of_damaged_bytes_is_refused_and_adds_no_replica(bare_cluster):
    cluster = bare_cluster
    cluster.start_master("--lease-s", "1")  # the refused copies' targets are held as long as their grant
    cluster.start_segment("seg0")
    cluster.start_segment("seg1")
    client = cluster.client()
    value = os.urandom(64 * KiB)
    client.put("k", value, preferred_segment="seg0")
    (replica,) = client.locate("k")
    scribble(cluster, client, "seg0", replica["offset"] + 1000)
    used_before = {s.name: s.dram_used for s in client.cluster_status().segments}

    assert client.copy_replica("k", "seg1") == Status.CHECKSUM_MISMATCH
    assert client.move_replica("k", "seg1") == Status.CHECKSUM_MISMATCH

    assert segments_of(client, "k") == ["seg0"], "no replica of unverified bytes"
    # The targets allocated for the refused copies go back (after the copy's grant ends).
    assert cluster.wait_for(
        lambda: {s.name: s.dram_used for s in client.cluster_status().segments} == used_before, timeout=30
    )


def test_remove_replica_drops_one_and_refuses_the_last(cluster):
    client = cluster.client()
    value = os.urandom(100 * KiB)
    client.put("k", value, replicas=2)
    assert segments_of(client, "k") == ["seg0", "seg1"]

    assert client.remove_replica("k", "seg0") == Status.OK

    assert segments_of(client, "k") == ["seg1"]
    assert client.get("k") == value
    assert client.remove_replica("k", "seg0") == Status.REPLICA_NOT_FOUND
    assert client.remove_replica("k", "seg1") == Status.LAST_REPLICA
    assert client.get("k") == value, "a refused removal changes nothing"
    assert client.remove_replica("k", "seg1", allow_last=True) == Status.OK
    assert client.get("k") is None and not client.exists("k")


def test_move_copies_then_drops_the_source(three):
    client = three.client()
    values = {f"m/{i}": os.urandom(50 * KiB + i) for i in range(4)}
    assert not any(client.batch_put(list(values), list(values.values()), preferred_segment="seg0"))

    assert client.move_replica("m/0", "seg1") == Status.OK
    assert client.batch_move_replica(["m/1", "m/2"], "seg2", source="seg0") == [Status.OK, Status.OK]

    assert segments_of(client, "m/0") == ["seg1"]
    assert segments_of(client, "m/1") == segments_of(client, "m/2") == ["seg2"]
    assert segments_of(client, "m/3") == ["seg0"]
    assert client.batch_get(list(values)) == list(values.values())


def test_bad_input_gets_clear_statuses(cluster):
    client = cluster.client()
    client.put("k", b"v" * 1000, preferred_segment="seg0")
    for call in (client.remove_replica, client.copy_replica, client.move_replica):
        assert call("k", "no-such-segment") == Status.SEGMENT_NOT_FOUND
        assert call("missing", "seg1") == Status.NOT_FOUND
    assert client.copy_replica("k", "seg1", source="no-such-segment") == Status.SEGMENT_NOT_FOUND
    assert client.copy_replica("k", "seg0") == Status.REPLICA_EXISTS
    assert client.move_replica("k", "seg0") == Status.REPLICA_EXISTS
    assert client.copy_replica("k", "seg1", source="seg1") == Status.REPLICA_NOT_FOUND
    assert client.remove_replica("k", "seg1") == Status.REPLICA_NOT_FOUND
    assert client.batch_copy_replica(["k", "missing", "k"], "seg1") == [
        Status.OK,
        Status.NOT_FOUND,
        Status.PUT_IN_PROGRESS,  # the key's first copy in this batch is in flight
    ]
    with pytest.raises(InvalidKeyError):
        client.copy_replica("", "seg1")
    assert segments_of(client, "k") == ["seg0", "seg1"]


def test_no_room_on_the_target_is_no_space(cluster):
    client = cluster.client()
    filler = [f"pinned/{i}" for i in range(16)]
    assert not any(
        client.batch_put(filler, [os.urandom(4 * MiB) for _ in filler], pin="hard", preferred_segment="seg1")
    )
    client.put("big", os.urandom(2 * MiB), preferred_segment="seg0")

    assert client.copy_replica("big", "seg1") == Status.NO_SPACE
    assert segments_of(client, "big") == ["seg0"]


def test_a_draining_target_takes_no_replica(cluster):
    client = cluster.client()
    client.put("k", b"v" * 1000, preferred_segment="seg0")
    client._master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg1"))

    assert client.copy_replica("k", "seg1") == Status.INVALID_ARGUMENT
    assert segments_of(client, "k") == ["seg0"]


@pytest.mark.parametrize("again", [False, True], ids=["removed", "put-again"])
def test_a_key_removed_during_its_copy_leaves_no_orphan_replica(cluster, again):
    client = cluster.client()
    old = os.urandom(64 * KiB)
    client.put("k", old, preferred_segment="seg0")
    start = client._master.call(
        "MigrateStart",
        pb.MigrateStartRequest(namespace="default", keys=["k"], target="seg1", keep_source=True),
    )
    assert list(start.statuses) == [0]
    assert copy_batch(client, start) == [0]  # the bytes are on seg1, verified, not yet recorded

    assert client.remove("k")
    new = os.urandom(32 * KiB)
    if again:
        client.put("k", new, preferred_segment="seg0")
    end = client._master.call(
        "MigrateEnd",
        pb.MigrateEndRequest(migration_id=start.migration_id, namespaces=["default"], keys=["k"], moved=[True]),
    )

    assert list(end.statuses) == [Status.NOT_FOUND]
    assert segments_of(client, "k") == (["seg0"] if again else [])
    assert client.get("k") == (new if again else None)


def kvtier(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "replica", *args, "--master", cluster.master_address],
        capture_output=True,
        timeout=60,
    )


def test_the_replica_command(cluster):
    client = cluster.client(namespace="ns")
    value = os.urandom(10 * KiB)
    client.put("k", value, preferred_segment="seg0")

    copied = kvtier(cluster, "copy", "k", "seg1", "--namespace", "ns", "--json")
    assert copied.returncode == 0, copied.stderr.decode()
    report = json.loads(copied.stdout)
    assert report["operation"] == "copy" and report["status"] == "OK" and report["key"] == "k"
    assert sorted(r["segment"] for r in report["replicas"]) == ["seg0", "seg1"]

    refused = kvtier(cluster, "remove", "k", "seg0", "--namespace", "ns")
    assert refused.returncode == 0, refused.stderr.decode()
    assert b"replicas now seg1 (dram)" in refused.stdout
    last = kvtier(cluster, "remove", "k", "seg1", "--namespace", "ns", "--json")
    assert last.returncode == 1
    assert json.loads(last.stdout)["status"] == "LAST_REPLICA"
    assert b"LAST_REPLICA" in last.stderr and b"--allow-last" in last.stderr and b"Traceback" not in last.stderr

    moved = kvtier(cluster, "move", "k", "seg0", "--namespace", "ns")
    assert moved.returncode == 0, moved.stderr.decode()
    assert segments_of(client, "k") == ["seg0"] and client.get("k") == value

    unknown = kvtier(cluster, "copy", "k", "nope", "--namespace", "ns")
    assert unknown.returncode == 1 and b"SEGMENT_NOT_FOUND" in unknown.stderr
    usage = kvtier(cluster, "copy", "k")
    assert usage.returncode == 2


def test_with_a_cluster_secret_copies_carry_capabilities_and_tenants_are_refused(bare_cluster, tmp_path):
    """Capabilities on: the copy reads and writes with per-range tags minted for its own source and
    target segments; replica operations are the operator's (cluster principal), never a tenant's."""
    from kvtier.client import Client, KvtierError
    from tests.integration.test_security import secret_file

    cluster = bare_cluster
    cluster.secret_file = secret_file(tmp_path, "cluster.secret")
    alice = secret_file(tmp_path, "alice.secret", b"a" * 32)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\n')
    cluster.start_master("--tenants-file", str(tenants))
    for name in ("seg0", "seg1", "seg2"):
        cluster.start_segment(name, "16MiB")
    client = cluster.client(transport="tcp", namespace="alice-ns")
    values = {f"s/{i}": os.urandom(20 * KiB + i) for i in range(3)}
    client.put("s/0", values["s/0"], preferred_segment="seg0")
    client.put("s/1", values["s/1"], preferred_segment="seg1")
    client.put("s/2", values["s/2"], preferred_segment="seg0")

    # one batch, two sources (seg0, seg1): each read needs its own segment's tags
    assert client.batch_copy_replica(["s/0", "s/1"], "seg2") == [Status.OK, Status.OK]
    assert client.move_replica("s/2", "seg1") == Status.OK
    assert segments_of(client, "s/0") == ["seg0", "seg2"] and segments_of(client, "s/1") == ["seg1", "seg2"]
    assert segments_of(client, "s/2") == ["seg1"]
    assert client.batch_get(list(values)) == list(values.values())

    with Client(cluster.master_address, namespace="alice-ns", principal="alice", secret_file=alice) as tenant:
        for call in (tenant.copy_replica, tenant.remove_replica):
            with pytest.raises(KvtierError) as refused:
                call("s/0", "seg1")
            assert refused.value.status == Status.PERMISSION_DENIED
    assert segments_of(client, "s/0") == ["seg0", "seg2"]


def test_ssd_only_objects_are_copied_and_moved_from_their_disk_copies_with_capabilities(bare_cluster, tmp_path):
    """An object whose only copy is on SSD answered REPLICA_NOT_FOUND to a copy or move. The copier
    reads the disk copy now (READ_DISK, under its own tag when the cluster has a secret) into a
    DRAM replica elsewhere; a move then tombstones the disk copy."""
    from tests.integration.test_drain import offloaded
    from tests.integration.test_security import secret_file
    from tests.integration.test_ssd_tier import value_for

    bare_cluster.secret_file = secret_file(tmp_path, "cluster.secret")
    client, _, disk_only = offloaded(bare_cluster, tmp_path, "64MiB")
    copied, moved = disk_only[0], disk_only[1]

    assert client.copy_replica(copied, "seg1") == Status.OK
    assert client.move_replica(moved, "seg1", source="ssd0") == Status.OK

    where = {k: sorted((r["segment"], r["tier"]) for r in client.locate(k)) for k in (copied, moved)}
    assert where == {copied: [("seg1", "dram"), ("ssd0", "ssd")], moved: [("seg1", "dram")]}
    assert client.batch_get([copied, moved]) == [value_for(copied, MiB), value_for(moved, MiB)]
    assert client.remove_replica(copied, "seg1") == Status.OK, "the disk copy is still a replica"
    assert client.get(copied) == value_for(copied, MiB)


def _freeze_after_copy(monkeypatch, cluster, segment: str, sig: int) -> None:
    """The copy is written and verified on `segment`, which then gets `sig` before MigrateEnd (a
    frozen VM, a GC pause, a crash between the copy and the master's bookkeeping)."""
    import kvtier.client.replicas as replicas

    original = replicas.copy_batch

    def copy_then_signal(client, start):
        out = original(client, start)
        cluster.segments[segment].popen.send_signal(sig)
        return out

    monkeypatch.setattr(replicas, "copy_batch", copy_then_signal)


@pytest.mark.parametrize("op", ["move", "copy"])
def test_a_target_killed_before_acknowledging_its_copy_leaves_the_object_where_it_was(cluster, monkeypatch, op):
    """The target dies after the copy, before its index has the object: the move is answered
    SEGMENT_NOT_FOUND and the object stays on its source, readable (before: OK, and the object was
    gone with the target)."""
    client = cluster.client(transport="tcp")
    value = os.urandom(100 * KiB)
    client.put("k", value, preferred_segment="seg0")
    _freeze_after_copy(monkeypatch, cluster, "seg1", signal.SIGKILL)
    status = (client.move_replica if op == "move" else client.copy_replica)("k", "seg1", source="seg0")
    assert status == Status.SEGMENT_NOT_FOUND
    assert client.get("k") == value
    assert segments_of(client, "k") == ["seg0"]


def test_a_moves_source_range_is_not_reused_before_the_source_forgets_the_object(bare_cluster, monkeypatch):
    """The target stalls (SIGSTOP, less than the segment TTL) after the copy; meanwhile puts fill the
    source. The source's range goes to another object only after the source's index dropped the moved
    one: a late drop by offset once took that object's entry, and a master restart then lost it."""
    cluster = bare_cluster
    cluster.segment_ttl_s = 10.0
    cluster.start_master("--lease-s", "1")
    cluster.start_segment("seg0", "8MiB")
    cluster.start_segment("seg1", "8MiB")
    client = cluster.client(transport="tcp", timeout=20.0)
    client.put("k", b"k" * MiB, preferred_segment="seg0")
    _freeze_after_copy(monkeypatch, cluster, "seg1", signal.SIGSTOP)
    moved = []
    mover = threading.Thread(target=lambda: moved.append(client.move_replica("k", "seg1", source="seg0")))
    mover.start()
    time.sleep(4.0)  # past the move's lease (1 s) and the clock-skew margin (2 s)
    writer = cluster.client(transport="tcp", timeout=10.0)
    values = {f"x{i}": bytes([65 + i]) * MiB for i in range(6)}
    for key, value in values.items():
        writer.put(key, value, preferred_segment="seg0")
    cluster.segments["seg1"].popen.send_signal(signal.SIGCONT)
    mover.join(timeout=30)
    assert moved == [Status.OK]
    cluster.restart_master("--lease-s", "1")
    reader = cluster.client(transport="tcp", timeout=20.0)
    assert cluster.wait_for(lambda: reader.get("k") == b"k" * MiB, timeout=15)
    assert {key: reader.get(key) for key in values} == values, "every acknowledged put survives the restart"
