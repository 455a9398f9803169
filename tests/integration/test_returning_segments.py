"""Segments that come back: what they may bring with them, and what a put acknowledges.

Real processes (tests/cluster.py). A segment that returns after a crash, a
restart or a partition past segment_ttl_s re-adopts every copy nothing
touched while it was away, and never one of a key removed or put again
meanwhile (master/fences.py). A put is acknowledged only when every replica
it reports is on a segment still alive (kvtier.master.commits.PutAcknowledgement).
Values are derived from their keys, so every hit is checked byte for byte.
"""

from __future__ import annotations

import random
import signal
import threading
import zlib
from pathlib import Path

import pytest

from kvtier.client import Client, Status
from tests.cluster import Cluster
from tests.netns import NetNs, require_netns

MiB = 1 << 20
KiB = 1 << 10


def value_for(key: str, size: int = 64 * KiB, version: int = 1) -> bytes:
    return random.Random(zlib.crc32(f"{key}/{version}".encode())).randbytes(size)


def segment_names(client: Client) -> set[str]:
    return {s.name for s in client.cluster_status().segments}


def mounted(client: Client, name: str) -> bool:
    """Mounted with its inventory complete (takes allocations again)."""
    return any(s.name == name and s.state == "ACTIVE" for s in client.cluster_status().segments)


def start_ssd_segment(cluster: Cluster, name: str, ssd_dir: Path):
    return cluster.start_segment(
        name, "16MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "64MiB", "--ssd-bucket-size", "4MiB"
    )


def wait_on_disk(cluster: Cluster, client: Client, keys: list[str], segment: str = "s0") -> None:
    """Until every object of `segment` is on its SSD (offloaded ahead, least recently used first). The
    wait reads no object: a read would make it the most recently used."""

    def ssd_objects() -> int:
        return next((s.ssd_objects for s in client.cluster_status().segments if s.name == segment), 0)

    assert cluster.wait_for(lambda: ssd_objects() >= len(keys), timeout=30), ssd_objects()
    for key in keys:
        assert any(r["tier"] == "ssd" for r in client.locate(key)), client.locate(key)


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


# ---------------------------------------------------------------------------- obs 3: SSD copies


def test_a_segment_back_from_the_dead_brings_back_untouched_disk_copies_never_removed_keys(bare_cluster, ssd_dir):
    cluster = bare_cluster
    cluster.start_master()
    start_ssd_segment(cluster, "s0", ssd_dir)
    cluster.start_segment("s1")
    changed, untouched = "obs3/changed", "obs3/untouched"
    fillers = [f"obs3/fill/{i:02d}" for i in range(12)]
    with cluster.client() as client:
        # 14 MiB on a 16 MiB region: over the offload watermark (0.80), so the least recently used
        # (the first two) are copied to s0's SSD
        for key in [changed, untouched, *fillers]:
            client.put(key, value_for(key, MiB), preferred_segment="s0")
        wait_on_disk(cluster, client, [changed, untouched, *fillers])
        cluster.kill(cluster.segments["s0"])  # SIGKILL, down past segment_ttl_s
        assert cluster.wait_for(lambda: "s0" not in segment_names(client), timeout=cluster.segment_ttl_s * 5)
        client.put(changed, value_for(changed, MiB, version=2))  # V2, on s1
        assert client.get(changed) == value_for(changed, MiB, version=2)
        assert client.remove(changed)  # acknowledged
        start_ssd_segment(cluster, "s0", ssd_dir)  # with its SSD directory
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=10)
        assert client.get(changed) is None, "a removed key came back from a returning segment's disk"
        assert client.get(untouched) == value_for(untouched, MiB), "an untouched disk copy was not re-adopted"
        assert not client.exists(changed)


def test_a_segment_killed_right_after_a_burst_gets_back_every_disk_copy_it_had(bare_cluster, ssd_dir):
    """A write-once burst into a small DRAM offloads to make room as it goes, and each offload frees
    a DRAM copy with a drop notice the segment acknowledges a moment later. Killed right after the
    last put, the segment leaves such notices unacknowledged; they change no key (the object stays,
    on disk), so started again on its SSD directory it gets back every copy the master knew on disk
    (they were fenced and tombstoned: a kill -9 of a busy segment lost acknowledged objects)."""
    cluster = bare_cluster
    cluster.start_master()
    start_ssd_segment(cluster, "s0", ssd_dir)
    keys = [f"burst/{i:03d}" for i in range(48)]
    with cluster.client(timeout=cluster.segment_ttl_s * 5) as client:
        for start in range(0, len(keys), 4):
            batch = keys[start : start + 4]
            assert client.batch_put(batch, [value_for(k, MiB) for k in batch]) == [Status.OK] * len(batch)
        cluster.kill(cluster.segments["s0"])
        on_disk = [k for k in keys if any(r["tier"] == "ssd" for r in client.locate(k))]  # before expulsion
        assert len(on_disk) >= 24, len(on_disk)
        start_ssd_segment(cluster, "s0", ssd_dir)
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=15)
        assert client.cluster_status().tiering["fence_copies_refused"] == 0
        assert client.batch_get(on_disk) == [value_for(k, MiB) for k in on_disk]


def test_a_segment_killed_before_acknowledging_a_forget_never_brings_the_removed_key_back(bare_cluster, ssd_dir):
    """Issue 16, with a real segment: removed while its FORGET cannot be acknowledged (the segment is dead)."""
    cluster = bare_cluster
    cluster.start_master()
    start_ssd_segment(cluster, "s0", ssd_dir)
    keys = [f"forget/{i:02d}" for i in range(14)]
    with cluster.client() as client:
        for key in keys:
            client.put(key, value_for(key, MiB))
        wait_on_disk(cluster, client, keys)
        cluster.kill(cluster.segments["s0"])
        assert client.remove(keys[0])  # its FORGET waits for a segment that is gone; answered at expulsion
        start_ssd_segment(cluster, "s0", ssd_dir)
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=10)
        assert client.get(keys[0]) is None, "a removed object came back from a disk copy"


def test_a_segment_away_across_a_master_restart_brings_nothing_back(bare_cluster, ssd_dir, tmp_path):
    """Fences live in the master's memory: a restarted master can prove nothing about a segment that
    was away, so its disk copies are refused (tombstoned), whatever happened meanwhile."""
    cluster = bare_cluster
    state_dir = str(tmp_path / "state")
    cluster.start_master("--state-dir", state_dir)
    start_ssd_segment(cluster, "s0", ssd_dir)
    cluster.start_segment("s1")
    changed = "restart/changed"
    keys = [changed, *(f"restart/fill/{i:02d}" for i in range(13))]
    with cluster.client() as client:
        for key in keys:
            client.put(key, value_for(key, MiB), preferred_segment="s0")
        wait_on_disk(cluster, client, keys)
        cluster.kill(cluster.segments["s0"])
        assert cluster.wait_for(lambda: "s0" not in segment_names(client), timeout=cluster.segment_ttl_s * 5)
        client.put(changed, value_for(changed, MiB, version=2))
        assert client.remove(changed)
    cluster.restart_master("--state-dir", state_dir)
    start_ssd_segment(cluster, "s0", ssd_dir)
    with cluster.client() as client:
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=15)
        assert client.get(changed) is None, "a removed key came back through a master restart"
        assert client.batch_get(keys) == [None] * len(keys), "copies from before a master restart: unprovable"
        assert client.cluster_status().tiering["fence_copies_refused"] == len(keys)


# ---------------------------------------------------------------------------- obs 4: partitions


def put_objects(client: Client, keys: list[str], segment: str) -> None:
    assert client.batch_put(keys, [value_for(k) for k in keys], preferred_segment=segment) == [Status.OK] * len(keys)


def check_returned(cluster: Cluster, client: Client, keys: list[str], removed: str, reput: str) -> None:
    """After the segment returned: every untouched object with its exact bytes, the others not."""
    assert cluster.wait_for(lambda: mounted(client, "s0") and all(client.batch_exists(keys)), timeout=15), (
        f"objects not re-adopted: {sum(client.batch_exists(keys))}/{len(keys)}"
    )
    assert client.batch_get(keys) == [value_for(k) for k in keys]
    assert all(r["segment"] == "s0" for k in keys[:3] for r in client.locate(k)), client.locate(keys[0])
    assert client.get(removed) is None, "a key removed while the segment was away came back"
    assert client.get(reput) == value_for(reput, version=2), "a key put again while the segment was away went back"
    events = client.cluster_status().tiering
    assert events["fence_copies_readopted"] >= len(keys) and events["fence_copies_refused"] >= 2, events


def test_a_stopped_segment_resumed_past_its_ttl_gets_back_every_untouched_object(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("s0")
    cluster.start_segment("s1")
    keys = [f"blip/{i:02d}" for i in range(50)]
    removed, reput = "blip/removed", "blip/reput"
    with cluster.client() as client:
        put_objects(client, [*keys, removed, reput], "s0")
        segment = cluster.segments["s0"]
        cluster.freeze(segment)
        try:
            assert cluster.wait_for(lambda: "s0" not in segment_names(client), timeout=cluster.segment_ttl_s * 5)
            client.remove(removed)  # already lost with s0 (NOT_FOUND), but removed all the same
            client.put(reput, value_for(reput, version=2))  # on s1
        finally:
            segment.popen.send_signal(signal.SIGCONT)
        check_returned(cluster, client, keys, removed, reput)


def test_a_partitioned_segment_gets_back_every_untouched_object_when_its_link_returns(bare_cluster):
    require_netns()
    cluster = bare_cluster
    with NetNs() as netns:
        insecure = ("--allow-insecure", "true")  # addresses of a test-only namespace, no secret
        cluster.start_master("--listen", f"{netns.host_address}:0", *insecure)
        cluster.start_segment("s0", "64MiB", "--listen", f"{netns.address}:0", *insecure, prefix=netns.prefix())
        cluster.start_segment("s1", "64MiB", "--listen", f"{netns.host_address}:0", *insecure)
        keys = [f"netns/{i:02d}" for i in range(50)]
        removed, reput = "netns/removed", "netns/reput"
        with cluster.client(transport="tcp") as client:
            put_objects(client, [*keys, removed, reput], "s0")
            netns.link_down()
            try:
                assert cluster.wait_for(lambda: "s0" not in segment_names(client), timeout=cluster.segment_ttl_s * 5)
                client.remove(removed)
                client.put(reput, value_for(reput, version=2))
            finally:
                netns.link_up()
            check_returned(cluster, client, keys, removed, reput)
        cluster.stop()  # before the namespace goes


def relayed_put(client: Client, keys: list[str]) -> bool:
    """Put `keys` (all OK); whether the segment relayed the PutEnd ("Commit through the segment")."""
    before = client.stats().get("commits_relayed", 0)
    put_objects(client, keys, "s0")
    return client.stats().get("commits_relayed", 0) > before


def test_a_segment_stopped_before_acknowledging_its_relayed_puts_gets_them_back_when_expelled_and_resumed(
    bare_cluster,
):
    """Relayed puts are acknowledged to the client before the master hears the segment's
    acknowledgement. Stopped right after the put returns, the segment cannot send it (its ~2 ms timer
    cannot fire); expelled past segment_ttl_s, it comes back saying how far its index applied under
    the old mount, and the master's fence lets those objects back (master/fences.py, invariant 4)."""
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("s0")
    keys = [f"relayed/{i:02d}" for i in range(50)]
    removed = "relayed/removed"
    with cluster.client(transport="tcp") as client:
        # the segment relays once it knows the master's fast path: shortly after its mount
        warm = iter(range(1000))
        assert cluster.wait_for(lambda: relayed_put(client, [f"relayed/warm/{next(warm)}"]), timeout=15)
        assert relayed_put(client, [removed])
        assert relayed_put(client, keys)
        segment = cluster.segments["s0"]
        cluster.freeze(segment)  # before its acknowledgement can go
        try:
            assert cluster.wait_for(lambda: "s0" not in segment_names(client), timeout=cluster.segment_ttl_s * 5)
            client.remove(removed)  # lost with s0 (NOT_FOUND), but removed all the same
        finally:
            segment.popen.send_signal(signal.SIGCONT)
        assert cluster.wait_for(lambda: mounted(client, "s0") and all(client.batch_exists(keys)), timeout=15), (
            f"objects not re-adopted: {sum(client.batch_exists(keys))}/{len(keys)}"
        )
        assert client.batch_get(keys) == [value_for(k) for k in keys]
        assert client.get(removed) is None, "a key removed while the segment was away came back"
        assert not client.exists(removed)


# ---------------------------------------------------------------------------- obs 6: acknowledged means stored


def test_puts_into_a_dead_segments_mapped_region_are_failures_not_ok(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("s0")
    with cluster.client(transport="shm", timeout=cluster.segment_ttl_s * 5) as client:
        client.put("warm", value_for("warm"))  # the client maps s0's region
        cluster.kill(cluster.segments["s0"])
        keys = [f"dead/{i}" for i in range(8)]
        statuses = client.batch_put(keys, [value_for(k, MiB) for k in keys])
        assert all(s != Status.OK for s in statuses), statuses
        assert client.batch_get(keys) == [None] * len(keys)
        assert client.cluster_status().tiering["put_keys_lost_with_segment"] == len(keys)


@pytest.mark.parametrize("how", ["put", "upsert"])
def test_a_put_answered_segment_not_found_does_not_come_back_with_its_segment(bare_cluster, how):
    """A same-host put into a stopped segment's region commits on the master and waits for the
    segment's acknowledgement; the segment is expelled instead, so the writer hears SEGMENT_NOT_FOUND
    ("lost with its segment"). When the segment resumes, the commit notice it finds waiting is
    applied, and the index proves it: the master must still not bring back a version whose writer
    was told it was not stored."""
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("s0")
    with cluster.client(transport="shm", timeout=cluster.segment_ttl_s * 5) as client:
        client.put("k", value_for("k"))
        segment = cluster.segments["s0"]
        cluster.freeze(segment)
        try:
            write = client.batch_upsert if how == "upsert" else client.batch_put
            key = "k" if how == "upsert" else "fresh"
            assert write([key], [value_for(key, version=2)]) == [Status.SEGMENT_NOT_FOUND]
        finally:
            segment.popen.send_signal(signal.SIGCONT)
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=15)
        assert client.get(key) is None, "a put told SEGMENT_NOT_FOUND came back with its segment"
        assert client.exists("k") == (how == "put")  # an untouched key comes back


def test_under_load_every_key_answered_ok_after_a_segment_kill_is_readable(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("s0")
    cluster.start_segment("s1")
    killed = threading.Event()
    batches: list[tuple[bool, list[str], list[Status]]] = []  # (started after the kill, keys, statuses)
    errors: list[str] = []

    def writer(client: Client) -> None:
        n = 0
        after = 0
        while after < 4:
            started_after = killed.is_set()
            keys = [f"load/{n}/{i:03d}" for i in range(192)]
            n += 1
            # s0 first while it is mounted (then the puts after the kill meet it), else s1
            statuses = client.batch_put(keys, [value_for(k, 4 * KiB) for k in keys], preferred_segment="s0")
            if started_after:
                after += 1
                ok = [k for k, s in zip(keys, statuses, strict=True) if s == Status.OK]
                got = client.batch_get(ok)  # right after the answer
                errors.extend(k for k, v in zip(ok, got, strict=True) if v != value_for(k, 4 * KiB))
            batches.append((started_after, keys, statuses))
            if n >= 2 and not killed.is_set():
                with lock:
                    ready.notify()
            if n > 200:
                errors.append("writer never saw the kill")
                return

    lock = threading.Condition()
    ready = lock
    with cluster.client(transport="shm", timeout=cluster.segment_ttl_s * 5) as client:
        thread = threading.Thread(target=writer, args=(client,))
        with lock:
            thread.start()
            assert lock.wait(timeout=30)
        cluster.kill(cluster.segments["s0"])
        killed.set()
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert not errors, f"{len(errors)} keys answered OK are missing or wrong: {errors[:5]}"
    assert any(s != Status.OK for _, _, statuses in batches for s in statuses), (
        "no put met the dead segment: the test did not test anything"
    )


# ---------------------------------------------------------------- a segment that missed the recovery


@pytest.mark.parametrize("change", ["removed", "lost"])
def test_a_segment_that_missed_a_master_restart_brings_back_no_key_changed_since(bare_cluster, tmp_path, change):
    """s1 dies; the master is killed before s1's TTL (so never saved as expelled) and its successor
    finishes recovery without s1. The key s1 held on SSD is then put again on s0 and removed, or its
    new version lost with s0: when s1 returns on its SSD directory, its old copy must not come back
    (it did: the acknowledged upsert and remove undone). A key nothing touched comes back."""
    cluster = bare_cluster
    cluster.start_master()
    s1 = start_ssd_segment(cluster, "s1", tmp_path / "ssd")
    client = cluster.client(transport="tcp", timeout=15)
    on_disk = ["victim", "kept"]
    assert client.batch_put(on_disk, [value_for(k, 256 * KiB) for k in on_disk], preferred_segment="s1") == [0, 0]
    info = lambda: next(s for s in client.cluster_status().segments if s.name == "s1")  # noqa: E731
    for i in range(30):  # at the offload's pace, until both live on s1's SSD only
        assert client.batch_put([f"fill/{i}"], [value_for(f"fill/{i}", MiB)], preferred_segment="s1") == [0]
        assert cluster.wait_for(lambda: info().dram_used <= 0.9 * info().dram_capacity, timeout=20)
    tiers = lambda key: [(r["segment"], r["tier"]) for r in client.locate(key)]  # noqa: E731
    assert cluster.wait_for(lambda: all(tiers(k) == [("s1", "ssd")] for k in on_disk), timeout=20), [
        tiers(k) for k in on_disk
    ]
    s0 = cluster.start_segment("s0", "32MiB")
    assert client.put("on-s0", b"x", preferred_segment="s0") is None  # s0's name is saved
    cluster.kill(s1)
    cluster.restart_master("--recovery-timeout-s", "1")  # within s1's TTL: s1 was never expelled
    assert client.batch_upsert(["victim"], [value_for("victim", 256 * KiB, version=2)]) == [Status.OK]
    assert tiers("victim") == [("s0", "dram")]
    if change == "removed":
        assert client.remove("victim")
    else:  # its only copy lived in s0's DRAM
        cluster.kill(s0)
        cluster.start_segment("s0", "32MiB")
        assert cluster.wait_for(lambda: mounted(client, "s0"), timeout=15)
    assert client.get("victim") is None
    start_ssd_segment(cluster, "s1", tmp_path / "ssd")
    assert cluster.wait_for(lambda: mounted(client, "s1"), timeout=15)
    assert client.get("victim") is None, f"the old version came back from s1: {tiers('victim')}"
    assert client.get("kept") == value_for("kept", 256 * KiB)  # untouched: s1's copy is still good
