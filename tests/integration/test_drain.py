"""`kvtier drain`: objects move to other segments, the segment leaves, no byte changes on the way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvtier.proto import master_pb2 as pb

MiB = 1 << 20


def drain_args(cluster, segment: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvtier.cli.main",
        "drain",
        segment,
        "--master",
        cluster.master_address,
        "--json",
        *extra,
    ]


def drain(cluster, segment: str, *extra: str) -> dict:
    result = subprocess.run(drain_args(cluster, segment, *extra), capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def value_of(key: str, size: int) -> bytes:
    seed = key.encode().ljust(32, b".")
    return (seed * (size // len(seed) + 1))[:size]


def offloaded(cluster, tmp_path, target_dram: str = "128MiB") -> tuple:
    """A master, an SSD segment `ssd0` holding 24 objects of 1 MiB put at a pace its offload keeps
    (some on SSD only), then a segment `seg1` of `target_dram`: (client, keys, the SSD-only keys)."""
    from tests.integration.test_ssd_tier import put_and_offload, start_ssd_segment

    cluster.start_master()
    start_ssd_segment(cluster, tmp_path / "ssd")
    client = cluster.client(transport="tcp")
    keys = [f"ssd/{i}" for i in range(24)]
    put_and_offload(cluster, client, keys)
    cluster.start_segment("seg1", target_dram)
    disk_only = [k for k in keys if [r["tier"] for r in client.locate(k)] == ["ssd"]]
    assert len(disk_only) >= 2, "some objects live on SSD only"
    return client, keys, disk_only


def test_drain_moves_every_object_then_the_segment_exits(cluster):
    client = cluster.client(transport="tcp")
    keys = [f"d/{i}" for i in range(20)]
    values = [value_of(k, MiB + i) for i, k in enumerate(keys)]
    assert not any(client.batch_put(keys, values, preferred_segment="seg0"))
    assert all(client.locate(k)[0]["segment"] == "seg0" for k in keys)
    assert client.get(keys[0]) == values[0]  # a leased object moves too

    report = drain(cluster, "seg0")

    assert report["state"] == "DRAINED"
    assert report["moved"] == 20 and report["dropped"] == 0 and report["failed"] == 0
    assert client.batch_get(keys) == values
    assert all([r["segment"] for r in client.locate(k)] == ["seg1"] for k in keys)
    status = client.cluster_status()
    assert [s.name for s in status.segments] == ["seg1"]
    assert status.objects == 20
    # The drained process is refused when it mounts again, and exits cleanly.
    assert cluster.segments["seg0"].popen.wait(timeout=30) == 0


def test_a_draining_segment_takes_no_new_objects(cluster):
    client = cluster.client()
    reply = client._master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg0"))
    assert reply.state == "DRAINING"
    for i in range(10):
        client.put(f"new/{i}", os.urandom(1000), preferred_segment="seg0")
        assert client.locate(f"new/{i}")[0]["segment"] == "seg1"


def test_objects_without_room_elsewhere_are_dropped_never_corrupted(cluster):
    client = cluster.client()
    # seg1 is filled with hard-pinned objects: nothing on seg0 can move there.
    filler = [f"pinned/{i}" for i in range(16)]
    assert not any(
        client.batch_put(filler, [value_of(k, 4 * MiB) for k in filler], pin="hard", preferred_segment="seg1")
    )
    keys = [f"stuck/{i}" for i in range(5)]
    values = [value_of(k, 2 * MiB) for k in keys]
    assert not any(client.batch_put(keys, values, preferred_segment="seg0"))
    assert all(client.locate(k)[0]["segment"] == "seg0" for k in keys)

    report = drain(cluster, "seg0", "--stall-timeout", "1")

    assert report["state"] == "DRAINED"
    assert report["moved"] == 0 and report["no_space"] == 5 and report["dropped"] == 5, "objects, not attempts"
    assert client.batch_get(keys) == [None] * 5
    assert client.batch_get(filler) == [value_of(k, 4 * MiB) for k in filler]


def test_draining_an_unknown_segment_fails_cleanly(cluster):
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "drain", "nope", "--master", cluster.master_address],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert b"SEGMENT_NOT_FOUND" in result.stderr and b"Traceback" not in result.stderr


def test_disk_only_objects_move_into_dram_elsewhere_and_only_redundant_disk_copies_drop(bare_cluster, tmp_path):
    """A drain moved DRAM copies only: every SSD-only object went with the segment (acknowledged puts
    lost while another segment had room for them). Their disk copies are read (READ_DISK, verified)
    and written to DRAM elsewhere now; only disk copies of objects that moved anyway are dropped."""
    from tests.integration.test_ssd_tier import value_for

    client, keys, disk_only = offloaded(bare_cluster, tmp_path, "256MiB")  # room for every object
    disk_copies = sum(1 for k in keys if "ssd" in [r["tier"] for r in client.locate(k)])
    report = drain(bare_cluster, "ssd0")
    assert report["state"] == "DRAINED"
    assert report["moved"] == len(keys) and report["failed"] == 0 and report["dropped"] == 0
    assert report["dropped_ssd"] == disk_copies - len(disk_only), "the moved disk-only copies were tombstoned"
    assert client.batch_get(keys) == [value_for(k, MiB) for k in keys]
    assert all([(r["segment"], r["tier"]) for r in client.locate(k)] == [("seg1", "dram")] for k in keys)


def test_a_drain_waits_for_a_copy_of_a_disk_only_object_in_flight(bare_cluster, tmp_path):
    """`kvtier drain` finished past a disk-only object whose copy (copy_replica, or a second drain's
    batch) was in flight: the object went with the segment, `dropped: 0`, though the copy would have
    kept it. The drain now waits for the copy, and the object lives on."""
    from kvtier.client.replicas import copy_batch
    from tests.integration.test_ssd_tier import value_for

    client, keys, disk_only = offloaded(bare_cluster, tmp_path)
    slow = disk_only[0]
    request = pb.MigrateStartRequest(namespace=client.namespace, keys=[slow], segment="ssd0", target="seg1")
    start = client._master.call("MigrateStart", request)  # a slow copier's copy of it, in flight
    draining = subprocess.Popen(drain_args(bare_cluster, "ssd0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            draining.wait(timeout=3)  # everything else moved; it waits for the copy
        assert copy_batch(client, start) == [0]
        end = pb.MigrateEndRequest(migration_id=start.migration_id, namespaces=[client.namespace], keys=[slow])
        end.moved.append(True)
        assert list(client._master.call("MigrateEnd", end).statuses) == [0]
        out, err = draining.communicate(timeout=60)
    finally:
        draining.kill()
    assert draining.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["state"] == "DRAINED" and report["dropped"] == 0
    assert client.batch_get(keys) == [value_for(k, MiB) for k in keys]


@pytest.mark.slow
def test_objects_without_room_now_are_tried_again_while_the_target_offloads(bare_cluster, tmp_path):
    """The drain gave up at the first batch that found no room anywhere, though the target's DRAM
    frees up as it offloads to its own SSD: 24 of 40 objects lost. Such objects are tried again
    while anything moves (--stall-timeout without a move ends it)."""
    from tests.integration.test_ssd_tier import put_and_offload, start_ssd_segment, value_for

    bare_cluster.start_master()
    start_ssd_segment(bare_cluster, tmp_path / "ssd0")
    client = bare_cluster.client(transport="tcp")
    keys = [f"ssd/{i}" for i in range(40)]
    put_and_offload(bare_cluster, client, keys)
    start_ssd_segment(bare_cluster, tmp_path / "ssd1", name="ssd1")  # 16 MiB of DRAM, 256 MiB of SSD
    report = drain(bare_cluster, "ssd0")
    assert report["state"] == "DRAINED"
    assert report["moved"] == len(keys) and report["dropped"] == 0 and report["no_space"] == 0, report
    assert client.batch_get(keys) == [value_for(k, MiB) for k in keys]


def test_two_drains_of_one_segment_both_end_drained_and_lose_nothing(bare_cluster, tmp_path):
    """Two `kvtier drain` runs at once: one finished while the other's batch was in flight, dropping
    disk-only objects it was moving (`dropped: 0`), and the other failed SEGMENT_NOT_FOUND."""
    from tests.integration.test_ssd_tier import value_for

    client, keys, _ = offloaded(bare_cluster, tmp_path)
    runs = [
        subprocess.Popen(
            drain_args(bare_cluster, "ssd0", "--batch", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    reports = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err.decode()
        reports.append(json.loads(out))
    assert [r["state"] for r in reports] == ["DRAINED", "DRAINED"]
    assert sum(r["moved"] for r in reports) == len(keys), reports
    assert client.batch_get(keys) == [value_for(k, MiB) for k in keys]


def test_a_drained_segment_stays_drained_across_a_master_restart(bare_cluster):
    """A master restarted between a drain's end and its segment noticing had forgotten the drain: the
    drained process mounted again, ACTIVE, and took new objects its host was about to take away."""
    import signal
    import time

    bare_cluster.start_master()
    seg0 = bare_cluster.start_segment("seg0", "64MiB")
    bare_cluster.start_segment("seg1", "64MiB")
    client = bare_cluster.client()
    master = client._master
    assert master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg0")).state == "DRAINING"
    seg0.popen.send_signal(signal.SIGSTOP)  # it cannot notice the drain's end before the restart
    try:
        assert master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg0", finish=True)).state == "DRAINED"
        saved = bare_cluster.state_dir("master") / "master-state.json"
        assert bare_cluster.wait_for(lambda: "seg0" not in json.loads(saved.read_text())["segments"], timeout=10)
        bare_cluster.restart_master()
    finally:
        seg0.popen.send_signal(signal.SIGCONT)
    assert seg0.popen.wait(timeout=60) == 0, "told SEGMENT_DRAINED again, it exits"
    time.sleep(1)
    assert [s.name for s in bare_cluster.client().cluster_status().segments] == ["seg1"]


def test_a_copy_on_a_segment_that_went_silent_does_not_count_as_staying(bare_cluster, tmp_path):
    """Objects on the drained SSD segment (some on its disk only) with their other replica on a
    segment SIGKILLed before the drain, within its TTL: the master still lists that replica, but a
    holder that stopped heartbeating is no place an object stays. The drain moves them; once the
    dead holder is expelled every object still reads back (the drain finished within the TTL and
    dropped them: lost)."""
    from tests.integration.test_ssd_tier import segment_info, start_ssd_segment

    cluster = bare_cluster
    cluster.segment_ttl_s = 8.0  # the drain ends well within the dead one's TTL
    cluster.start_master()
    start_ssd_segment(cluster, tmp_path / "ssd")
    holder = cluster.start_segment("holder", "64MiB")
    client = cluster.client(transport="tcp")
    keys = [f"two/{i}" for i in range(20)]
    for key in keys:  # at the offload's pace (as put_and_offload), two replicas: ssd0 and holder
        assert client.batch_put([key], [value_of(key, MiB)], replicas=2, preferred_segment="ssd0") == [0]
        assert cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.9 * s.dram_capacity, timeout=20)
    where = {k: sorted((r["segment"], r["tier"]) for r in client.locate(k)) for k in keys}
    assert [k for k in keys if where[k] == [("holder", "dram"), ("ssd0", "ssd")]], where
    cluster.start_segment("seg2", "64MiB")
    cluster.kill(holder)
    # silent past the master's suspicion (3 heartbeats, at least 1 s), far from its TTL
    age = lambda: next(s for s in client.cluster_status().segments if s.name == "holder").heartbeat_age_ms  # noqa: E731
    assert cluster.wait_for(lambda: age() > 1500, timeout=10)
    report = drain(cluster, "ssd0")
    assert report["state"] == "DRAINED", report
    assert cluster.wait_for(lambda: not any(s.name == "holder" for s in client.cluster_status().segments), 20)
    got = client.batch_get(keys)
    lost = [k for k, v in zip(keys, got, strict=True) if v is None]
    assert not lost, f"lost {len(lost)} of {len(keys)}: {report}"
    assert got == [value_of(k, MiB) for k in keys]


def test_a_segment_expelled_mid_drain_comes_back_draining_and_the_drain_finishes_it(cluster):
    """SIGSTOP the drained segment past its TTL while `kvtier drain` runs: the master expels it, and
    when it resumes it mounts again (its copies re-adopted through its fence) DRAINING, not ACTIVE
    taking new puts; the drain waits for it and moves everything (it stopped with an error, or
    finished a segment that had come back with objects no walk had seen)."""
    client = cluster.client(transport="tcp")
    keys = [f"blip/{i}" for i in range(16)]
    values = [value_of(k, MiB) for k in keys]
    assert not any(client.batch_put(keys, values, preferred_segment="seg0"))
    segment = cluster.segments["seg0"]
    cluster.freeze(segment)
    mover = subprocess.Popen(drain_args(cluster, "seg0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert cluster.wait_for(lambda: "seg0" not in {s.name for s in client.cluster_status().segments}, 20)
        assert client.put("meanwhile", b"m") is None  # lands on seg1: seg0 is away
    finally:
        segment.popen.send_signal(signal.SIGCONT)
    assert cluster.wait_for(lambda: "seg0" in {s.name for s in client.cluster_status().segments}, 20)
    assert client.put("after", b"a", preferred_segment="seg0") is None
    out, err = mover.communicate(timeout=120)
    assert mover.returncode == 0, err.decode()[-2000:]
    report = json.loads(out)
    assert report["state"] == "DRAINED" and report["dropped"] == 0, report
    assert client.batch_get(keys) == values
    assert client.get("after") == b"a" and client.get("meanwhile") == b"m"
    assert [s.name for s in client.cluster_status().segments] == ["seg1"]


def test_drain_cancel_makes_the_segment_take_new_objects_again(cluster):
    """`kvtier drain --cancel`: a drain interrupted (or not wanted any more) leaves the segment DRAINING,
    and a blip now brings it back DRAINING too; cancelling makes it ACTIVE again."""
    client = cluster.client()
    client._master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg0"))  # what a drain starts with
    client.put("while-draining", b"x", preferred_segment="seg0")
    assert [r["segment"] for r in client.locate("while-draining")] == ["seg1"]
    result = subprocess.run(drain_args(cluster, "seg0", "--cancel"), capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout) == {"segment": "seg0", "state": "ACTIVE", "objects": 0}
    client.put("after-cancel", b"y", preferred_segment="seg0")
    assert [r["segment"] for r in client.locate("after-cancel")] == ["seg0"]
    unknown = subprocess.run(drain_args(cluster, "nope", "--cancel"), capture_output=True, timeout=60)
    assert unknown.returncode != 0 and b"nope" in unknown.stderr
