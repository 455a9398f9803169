"""Upsert (atomic overwrite) and put-time leases against real processes (issue 21).

A reader of a key being upserted gets a complete old value or a complete new
one (checksums verified by the client, and each value carries its version in
its first bytes, checked against the bytes derived from it), never a miss.
"""

from __future__ import annotations

import random
import threading

import pytest

from kvtier.client import Status
from kvtier.proto import master_pb2 as pb
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ssd_tier import put_and_offload, start_ssd_segment, value_for

KiB, MiB = 1 << 10, 1 << 20


def version_value(version: int, size: int = 256 * KiB) -> bytes:
    """A value that says which version it is, and whose every byte follows from that."""
    return version.to_bytes(8, "little") + random.Random(version).randbytes(size - 8)


def dram_used(client, name: str) -> int:
    return next(s for s in client.cluster_status().segments if s.name == name).dram_used


def test_upsert_replaces_the_value_and_put_does_not(cluster):
    with cluster.client() as client:
        client.put("k", b"old")
        client.put("k", b"ignored")  # a put never overwrites
        assert client.get("k") == b"old"
        client.upsert("k", b"new-and-longer")
        assert client.get("k") == b"new-and-longer"
        client.upsert("fresh", b"first")  # an upsert of a missing key is a put
        assert client.get("fresh") == b"first"
        assert client.batch_upsert(["k", "fresh", "other"], [b"a", b"b", b"c"]) == [Status.OK] * 3
        assert client.batch_get(["k", "fresh", "other"]) == [b"a", b"b", b"c"]


def test_reader_during_many_upserts_sees_old_or_new_never_a_miss_or_a_mix(cluster):
    versions = 40
    with cluster.client() as writer, cluster.client() as reader:
        writer.put("hot", version_value(0), replicas=2)
        first_read, done = threading.Event(), threading.Event()
        seen: list[int] = []
        bad: list[str] = []

        def read() -> None:
            while not done.is_set():
                value = reader.get("hot")
                first_read.set()
                if value is None:
                    bad.append("miss")
                    continue
                version = int.from_bytes(value[:8], "little")
                if value != version_value(version):
                    bad.append(f"mixed bytes claiming version {version}")
                seen.append(version)

        thread = threading.Thread(target=read)
        thread.start()
        try:
            assert first_read.wait(30)
            for version in range(1, versions + 1):
                writer.upsert("hot", version_value(version), replicas=2)
        finally:
            done.set()
            thread.join(30)
        assert not bad, bad[:5]
        assert seen == sorted(seen), "a reader went back to an older version"
        assert len(set(seen)) > 1, "the reader never saw a swap"
        assert reader.get("hot") == version_value(versions)


def test_revoked_and_abandoned_upserts_keep_the_old_value(cluster):
    with cluster.client() as client:
        client.put("k", b"old")
        master = client._master  # raw master calls: a writer that never writes its bytes
        started = master.call(
            "PutStart",
            pb.PutStartRequest(namespace=client.namespace, keys=["k"], sizes=[3], replicas=1, overwrite=True),
        )
        assert list(started.statuses) == [Status.OK] and list(started.replica_counts) == [1]
        assert client.get("k") == b"old"  # visible while the new version is written
        # a second upsert meanwhile answers as a second put of a pending key does
        assert client.batch_upsert(["k"], [b"other"]) == [Status.PUT_IN_PROGRESS]
        revoked = master.call(
            "PutRevoke", pb.PutRevokeRequest(namespace=client.namespace, keys=["k"], put_id=started.put_id)
        )
        assert list(revoked.statuses) == [Status.OK]
        assert client.get("k") == b"old"
        ended = master.call(
            "PutEnd", pb.PutEndRequest(namespace=client.namespace, keys=["k"], checksums=[0], put_id=started.put_id)
        )
        assert list(ended.statuses) == [Status.NOT_PENDING]
        assert client.get("k") == b"old"
        with pytest.raises(ValueError):
            client.upsert("k", b"x", replicas=0)  # refused before anything is sent
        assert client.batch_upsert(["k"], [bytes(65 * MiB)]) == [Status.TOO_LARGE]  # larger than any segment
        assert client.batch_upsert(["k"], [b"x"], replicas=3) == [Status.NO_REPLICA]  # two segments only
        assert client.get("k") == b"old"


def test_old_version_ranges_are_freed_after_the_readers_lease(bare_cluster):
    bare_cluster.start_master("--lease-s", "2")
    bare_cluster.start_segment("seg0")
    with bare_cluster.client() as client:
        client.put("big", version_value(1, MiB))
        base = dram_used(client, "seg0")
        # a reader that holds its lease to the end (no release): the old bytes must stay for it
        held = client._master.call("GetReplicas", pb.KeysRequest(namespace=client.namespace, keys=["big"]))
        assert list(held.statuses) == [Status.OK]
        client.upsert("big", version_value(2, MiB))
        assert dram_used(client, "seg0") >= 2 * MiB  # both versions: the reader's and the visible one
        assert client.get("big") == version_value(2, MiB)
        assert bare_cluster.wait_for(lambda: dram_used(client, "seg0") == base, timeout=2 * 2 + 10)


def test_offloaded_old_version_is_never_served_after_the_swap(bare_cluster, tmp_path):
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    bare_cluster.start_master()
    start_ssd_segment(bare_cluster, ssd_dir)
    keys = [f"obj/{i:03d}" for i in range(24)]  # 24 MiB through a 16 MiB region: the first go to SSD
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        target = keys[0]
        assert bare_cluster.wait_for(lambda: {r["tier"] for r in client.locate(target)} == {"ssd"}, timeout=20)
        old_copy = [r["offset"] for r in client.locate(target)]
        new = value_for("the new version", MiB)
        client.upsert(target, new)
        assert client.get(target) == new
        # the disk copy was the old version's: gone (the new version may get one of its own)
        assert not {r["offset"] for r in client.locate(target) if r["tier"] == "ssd"} & set(old_copy)
    # the segment dies and comes back on the same directory: its disk copy of the old version was
    # tombstoned before the upsert answered, so it can never come back
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    start_ssd_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(
            lambda: next(s for s in client.cluster_status().segments if s.name == "ssd0").ssd_objects > 0, timeout=15
        )
        assert client.get(target) in (None, new)  # the new version lived in DRAM only: a miss, never the old


@pytest.mark.slow  # ~20 s: 24 MiB through the SSD tier first; runs in make test-slow (CI runs both)
def test_readers_of_disk_only_versions_never_miss_across_upserts(bare_cluster, tmp_path):
    """The old version lives only on SSD: the swap tombstones its disk copy (FORGET) while readers
    may hold its placements; a read that finds the copy gone asks the master again and gets the
    new version, never a miss."""
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    bare_cluster.start_master("--promote-after-reads", "0")  # disk-only copies stay disk-only
    start_ssd_segment(bare_cluster, ssd_dir)
    keys = [f"obj/{i:03d}" for i in range(24)]  # 24 MiB through a 16 MiB region: the first go to SSD
    with bare_cluster.client() as writer, bare_cluster.client() as reader:
        put_and_offload(bare_cluster, writer, keys)
        cold = [k for k in keys if {r["tier"] for r in writer.locate(k)} == {"ssd"}][:8]
        assert len(cold) >= 4, "too few disk-only objects"
        for key in keys[-12:]:  # DRAM room for the new versions (the removed ranges free after their leases)
            writer.remove(key)
        assert bare_cluster.wait_for(lambda: dram_used(writer, "ssd0") <= 6 * MiB, timeout=20)
        new = {k: value_for("new " + k, MiB) for k in cold}
        done, first_read = threading.Event(), threading.Event()
        bad: list[str] = []
        reads = [0]

        def read() -> None:
            while not done.is_set():
                for key, value in zip(cold, reader.batch_get(cold), strict=True):
                    if value is None:
                        bad.append(f"miss {key}")
                    elif value != new[key] and value != value_for(key):
                        bad.append(f"wrong bytes {key}")
                reads[0] += 1
                first_read.set()

        thread = threading.Thread(target=read)
        thread.start()
        try:
            assert first_read.wait(30)
            for key in cold:
                writer.upsert(key, new[key])
        finally:
            done.set()
            thread.join(30)
        assert not bad, bad[:5]
        assert reader.batch_get(cold) == [new[k] for k in cold]


def test_an_acknowledged_upsert_survives_a_master_kill_9(bare_cluster, tmp_path):
    """PutEnd answered once the segments acknowledged the old copies' drops and the new ones'
    commits: a new master rebuilt from their indexes knows the new versions only."""
    state_dir = str(tmp_path / "master-state")
    bare_cluster.start_master("--state-dir", state_dir)
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    keys = [f"v/{i:02d}" for i in range(20)]
    with bare_cluster.client() as client:
        assert not any(client.batch_put(keys, [version_value(1, 4 * KiB)] * 20, replicas=2))
        assert not any(client.batch_upsert(keys[:10], [version_value(2, 4 * KiB)] * 10, replicas=2))
        client.upsert("zero", b"")  # a zero-size object, which an index keys by name
        client.upsert("zero", b"")
        used = {s.name: s.dram_used for s in client.cluster_status().segments}
    bare_cluster.restart_master("--state-dir", state_dir)
    with bare_cluster.client() as client:
        got = client.batch_get(keys)
        assert got[:10] == [version_value(2, 4 * KiB)] * 10
        assert got[10:] == [version_value(1, 4 * KiB)] * 10
        assert client.get("zero") == b""
        status = client.cluster_status()
        # one copy per segment of each key (the old versions' copies are in no index) and "zero"
        assert status.recovery["objects"] == 2 * 20 + 1 and status.recovery["refused"] == 0
        # the old versions' ranges (still held for their leases before the kill) are not brought back
        assert all(s.dram_used <= used[s.name] for s in status.segments)


def test_put_time_lease_refuses_remove_until_force(cluster):
    with cluster.client() as client:
        client.put("leased", b"v", lease_s=600)
        client.put("free", b"v")
        assert client.batch_remove(["leased", "free"]) == [Status.LEASE_HELD, Status.OK]
        assert client.remove("leased") is False
        assert client.get("leased") == b"v"
        assert client.remove("leased", force=True) is True
        assert client.get("leased") is None
        client.put("leased2", b"v", lease_s=600)
        assert client.remove_prefix("leased") == 1  # RemovePrefix is the operator's forced bulk removal
        with pytest.raises(ValueError):
            client.put("x", b"v", lease_s=-1)


def test_put_time_lease_ends(cluster):
    with cluster.client() as client:
        client.put("short", b"v", lease_s=5)
        assert client.batch_remove(["short"]) == [Status.LEASE_HELD]
        assert cluster.wait_for(lambda: client.batch_remove(["short"]) == [Status.OK], timeout=5 + 10, interval=0.2)
        assert client.get("short") is None


def test_eviction_skips_keys_under_a_put_time_lease(bare_cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    with bare_cluster.client() as client:
        client.put("leased", version_value(1, MiB), lease_s=600)  # the least recently used of all
        keys = [f"fill/{i:02d}" for i in range(40)]  # 40 MiB through 16 MiB: eviction must run
        for key in keys:
            assert client.batch_put([key], [version_value(2, MiB)]) == [Status.OK]
        assert client.get("leased") == version_value(1, MiB)
        assert None in client.batch_get(keys[:8])  # others were evicted meanwhile


def test_upsert_and_lease_metrics_count_what_happened(bare_cluster):
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    bare_cluster.start_segment("seg0")
    with bare_cluster.client() as client:
        client.put("k", b"old", lease_s=600)
        client.upsert("k", b"new")
        assert client.batch_upsert(["k"], [b"x"] * 1) == [Status.OK]
    samples = scrape(bare_cluster.master.info["metrics"])
    assert value(samples, "kvtier_master_upserts_total", outcome="swapped") == 2
    assert value(samples, "kvtier_master_upserts_total", outcome="revoked") == 0
    assert value(samples, "kvtier_master_put_leases") == 1


def test_a_replicated_upsert_losing_one_new_replica_before_put_end_is_stored_and_answered_ok(bare_cluster):
    """One of the new version's two segments dies after the bytes were written, before it
    acknowledged the commit: the other kept the version (and the old one is gone), so the writer hears
    OK. It heard SEGMENT_NOT_FOUND ("not stored") while readers read the new version."""
    import signal

    bare_cluster.start_master()
    for name in ("seg0", "seg1", "seg2"):
        bare_cluster.start_segment(name, "16MiB")
    client = bare_cluster.client(transport="tcp", timeout=8.0)
    old, new = b"O" * 50_000, b"N" * 50_000
    client.put("k", old, replicas=2)
    run_parallel = client._run_parallel
    victims = []

    def write_then_kill(jobs, copies=frozenset()):
        out = run_parallel(jobs, copies)
        victims.append(jobs[-1][1].name)  # one of the new version's two segments
        bare_cluster.kill(bare_cluster.segments[victims[-1]], signal.SIGKILL)
        return out

    client._run_parallel = write_then_kill
    assert client.batch_upsert(["k"], [new], replicas=2) == [Status.OK]
    client._run_parallel = run_parallel
    reader = bare_cluster.client(transport="tcp")
    assert reader.get("k") == new
    assert victims[0] not in [replica["segment"] for replica in reader.locate("k")]
