"""Groups, all or none (issue 21), with real master and segment processes: a group put becomes visible
all at once, a failed member revokes the whole group, a member gone turns a group read into a miss for
every member, and a master restart forms each group again from the segments' inventories
(docs/architecture.md, "Groups")."""

from __future__ import annotations

import os
import threading
import urllib.request

import pytest

from kvtier.client.master import MasterClient
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.integration.test_faults import flip_byte

MiB = 1 << 20


@pytest.fixture
def small(bare_cluster):
    """A master (with its metrics) and two 16 MiB segments."""
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    bare_cluster.start_segment("seg0", "16MiB")
    bare_cluster.start_segment("seg1", "16MiB")
    return bare_cluster


def _members(i: int) -> list[str]:
    """An SGLang-style group: a request's KV pages and its side-pool (Mamba state) entry."""
    return [f"req{i}/kv/0", f"req{i}/kv/1", f"req{i}/mamba"]


def test_sglang_style_kv_pages_and_side_pool_put_and_read_as_one_group(small):
    client = small.client()
    keys = _members(0)
    values = [os.urandom(4096), os.urandom(4096), os.urandom(777)]
    assert client.put_group(keys, values) == [Status.OK] * 3
    assert client.get_group(keys) == values
    assert client.get_group(list(reversed(keys))) == list(reversed(values))
    buffers = [bytearray(4096), bytearray(4096), bytearray(1024)]
    assert client.get_group_into(keys, buffers) == [4096, 4096, 777]
    assert [bytes(b[: len(v)]) for b, v in zip(buffers, values, strict=True)] == values
    # keys that are not exactly the group: a miss for every key, never a part of it
    assert client.get_group(keys[:2]) == [None, None]
    assert client.get_group_into(keys[:2], buffers[:2]) == [int(Status.NOT_FOUND)] * 2
    assert client.batch_get(keys[:2]) == values[:2]  # members stay ordinary objects
    with pytest.raises(ValueError):
        client.get_group([keys[0], keys[0]])
    assert client.stats()["group_puts"] == 1


def test_a_reader_polling_during_many_group_puts_sees_all_or_none(small):
    writer, reader = small.client(), small.client()
    count = 60
    progress = [0]  # the group the writer is putting now
    done = threading.Event()
    failures: list[Status] = []

    def write() -> None:
        try:
            for i in range(count):
                progress[0] = i
                statuses = writer.put_group(_members(i), [b"k%d" % i, b"v%d" % i, b"m%d" % i])
                failures.extend(s for s in statuses if s != Status.OK)
        finally:
            done.set()

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[tuple[int, str]] = []
    try:
        while not done.is_set():
            i = progress[0]
            for j in (i, i + 1):  # the group being put and the next one
                got = reader.get_group(_members(j))
                if got == [b"k%d" % j, b"v%d" % j, b"m%d" % j]:
                    seen.append((j, "all"))
                else:
                    assert got == [None, None, None], f"group {j} read partially: {got}"
                    seen.append((j, "none"))
                present = reader.batch_exists(_members(j))
                assert present in ([True] * 3, [False] * 3), f"group {j} visible partially: {present}"
    finally:
        thread.join()
    assert not failures
    assert all(reader.get_group(_members(i)) is not None for i in range(count))
    assert {"all", "none"} <= {kind for _, kind in seen} or len(seen) < 4  # both states were observed


def test_a_member_that_cannot_be_stored_fails_and_hides_every_member(small):
    client = small.client()
    keys = ["g/kv", "g/huge", "g/side"]
    statuses = client.put_group(keys, [b"kv", bytes(17 * MiB), b"side"])  # larger than any segment
    assert statuses == [Status.TOO_LARGE] * 3
    assert client.batch_exists(keys) == [False] * 3
    assert client.batch_get(["g/kv", "g/side"]) == [None, None]
    status = client.cluster_status()
    assert (status.objects, status.pending_puts) == (0, 0)  # the stored member revoked, not left pending


def test_a_member_revoked_before_put_end_revokes_the_whole_group(small):
    client = small.client()
    master = MasterClient(small.master_address, timeout=5.0)
    try:
        keys = ["r/kv", "r/side"]
        started = master.call("PutStart", pb.PutStartRequest(namespace="default", keys=keys, sizes=[8, 8], replicas=1))
        assert list(started.statuses) == [0, 0]
        # the side pool's write failed: its writer revoked it (or the master reclaimed it)
        revoked = master.call(
            "PutRevoke", pb.PutRevokeRequest(namespace="default", keys=["r/side"], put_id=started.put_id)
        )
        assert list(revoked.statuses) == [0]
        ended = master.call(
            "PutEnd",
            pb.PutEndRequest(namespace="default", keys=keys, checksums=[1, 2], put_id=started.put_id, group=True),
        )
        assert list(ended.statuses) == [int(Status.NOT_PENDING)] * 2
        assert client.batch_exists(keys) == [False, False]
        # the kv member is revoked too, not left pending: the group can be put at once
        assert client.put_group(keys, [b"kv", b"side"]) == [Status.OK] * 2
        assert client.get_group(keys) == [b"kv", b"side"]
        metrics = urllib.request.urlopen(f"http://{small.master.info['metrics']}/metrics", timeout=5).read().decode()
        assert 'kvtier_master_group_puts_total{outcome="revoked"} 1.0' in metrics
        assert 'kvtier_master_group_puts_total{outcome="committed"} 1.0' in metrics
    finally:
        master.close()


def test_a_failed_write_on_a_dead_segment_revokes_every_member(bare_cluster):
    bare_cluster.segment_ttl_s = 60.0  # the master keeps placing on the dead segment: the writes fail
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    bare_cluster.start_segment("seg1", "16MiB")
    client = bare_cluster.client()
    bare_cluster.kill(bare_cluster.segments["seg1"])
    keys = _members(1)
    statuses = client.put_group(keys, [b"a" * 100, b"b" * 100, b"c" * 100], replicas=2)
    assert len(set(statuses)) == 1 and statuses[0] != Status.OK, statuses
    # every member's copy on seg0 was written, and none of them is visible
    assert client.batch_exists(keys) == [False] * 3
    assert client.get_group(keys) == [None] * 3


@pytest.mark.parametrize("how", ["remove", "evict"])
def test_a_member_removed_or_evicted_makes_get_group_miss_for_every_member(bare_cluster, how):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    client = bare_cluster.client()
    keys = ["e/kv", "e/side"]
    values = [os.urandom(MiB), os.urandom(MiB)]
    assert client.put_group(keys, values) == [Status.OK] * 2
    if how == "remove":
        assert client.remove("e/side")
    else:
        # fill the segment, reading the kv member each time: it stays the most recently used, so the
        # side member goes first
        i = 0
        while client.exists("e/side"):
            assert client.get("e/kv") == values[0]
            client.put(f"fill/{i}", os.urandom(MiB))
            i += 1
            assert i < 64, "the side member was never evicted"
    assert client.get("e/kv") == values[0]  # still an ordinary object
    assert client.get_group(keys) == [None, None]
    assert client.get_group_into(keys, [bytearray(MiB), bytearray(MiB)]) == [int(Status.NOT_FOUND)] * 2


def test_a_member_lost_with_its_segment_makes_get_group_miss_for_every_member(small):
    client = small.client()
    keys = [f"l/{i}" for i in range(6)]
    values = [os.urandom(64 << 10) for _ in keys]
    assert client.put_group(keys, values) == [Status.OK] * 6
    on_seg1 = [k for k in keys if {r["segment"] for r in client.locate(k)} == {"seg1"}]
    assert on_seg1, "placement spread the members over both segments"
    small.kill(small.segments["seg1"])
    assert small.wait_for(lambda: not client.exists(on_seg1[0]), timeout=15)
    assert client.get_group(keys) == [None] * 6
    kept = [k for k in keys if k not in on_seg1]
    assert client.batch_get(kept) == [values[keys.index(k)] for k in kept]


def test_after_a_master_restart_a_group_reads_whole_again_and_a_broken_one_stays_a_miss(small):
    """kill -9 of the master: the segments' inventories bring every member back under its group's id
    (kept in their DRAM indexes from the commit notices), and the new incarnation forms the groups
    whose members all came back; a group with a member removed before the restart stays a miss."""
    client = small.client()
    whole, broken = _members(7), _members(8)
    values = [os.urandom(5000), os.urandom(3000), b"mamba"]
    assert client.put_group(whole, values) == [Status.OK] * 3
    assert client.put_group(broken, values) == [Status.OK] * 3
    segments = {client.locate(key)[0]["segment"] for key in whole}
    assert client.remove(broken[1])
    small.restart_master("--metrics", "127.0.0.1:0")
    assert client.get_group(whole) == values  # formed again, whole
    assert client.get_group(list(reversed(whole))) == list(reversed(values))
    assert client.get_group(broken) == [None] * 3 and client.get_group(broken[::2]) == [None, None]
    assert client.batch_get(broken[::2]) == [values[0], values[2]]  # ordinary objects still
    metrics = urllib.request.urlopen(f"http://{small.master.info['metrics']}/metrics", timeout=5).read().decode()
    assert "kvtier_master_groups_rebuilt_total 1.0" in metrics, f"members on {sorted(segments)}"
    # putting the broken group again regroups its members as they are
    assert client.put_group(broken, [b"x", values[1], b"y"]) == [Status.OK] * 3
    assert client.get_group(broken) == values


def test_a_member_failing_verification_makes_the_whole_group_a_miss_and_counts_honestly(small):
    """The master found the group whole, but one member's bytes fail their checksum here: every key is
    a miss, and the members read fine are counted as misses, not hits."""
    client = small.client()
    keys = _members(3)
    values = [os.urandom(8192), os.urandom(8192), os.urandom(100)]
    assert client.put_group(keys, values) == [Status.OK] * 3
    flip_byte(small, client.locate(keys[2])[0], 10)  # the side-pool entry is damaged
    before = client.stats()
    assert client.get_group(keys) == [None] * 3
    after = client.stats()
    assert after["checksum_mismatches"] - before.get("checksum_mismatches", 0) == 1
    assert after.get("hits", 0) - before.get("hits", 0) == 0
    assert after["misses"] - before.get("misses", 0) == 3
    assert after["group_misses"] - before.get("group_misses", 0) == 1
    assert not any(k.startswith("served_") and v != before.get(k, 0) for k, v in after.items())
    assert client.batch_get(keys[:2]) == values[:2]  # the sound members stay readable one by one


@pytest.mark.parametrize("restarted", ["master", "segment"])
def test_a_group_whose_members_live_on_ssd_reads_whole_again_after_a_restart(bare_cluster, tmp_path, restarted):
    """Members offloaded to the SSD tier (some on disk only) keep their group's id in their disk
    records: after kill -9 of the master (its successor rebuilds from the inventories) or of the
    segment (it mounts again from its buckets), every group reads whole, none partial."""
    from tests.integration.test_ssd_tier import segment_info, start_ssd_segment

    bare_cluster.start_master("--promote-after-reads", "0")
    ssd_dir = tmp_path / "ssd"
    segment = start_ssd_segment(bare_cluster, ssd_dir)
    client = bare_cluster.client(transport="tcp")
    groups = [_members(i) for i in range(24)]  # 24 MiB through a 16 MiB region
    values = [[os.urandom(700 * 1024), os.urandom(300 * 1024), os.urandom(4096 + i)] for i in range(24)]
    for members, member_values in zip(groups, values, strict=True):
        assert client.put_group(members, member_values) == [Status.OK] * 3
        # at the offload's pace: no member is evicted before its disk copy exists
        assert bare_cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.9 * s.dram_capacity, timeout=20)
    tiers = {key: [r["tier"] for r in client.locate(key)] for members in groups for key in members}
    disk_only = [members for members in groups if all(tiers[k] == ["ssd"] for k in members)]
    assert disk_only, f"no group lives on SSD only: {tiers}"
    inventories = lambda: segment.tail(2000).count("reported disk inventory")  # noqa: E731
    if restarted == "master":
        bare_cluster.restart_master("--promote-after-reads", "0")
        assert bare_cluster.wait_for(lambda: inventories() >= 2, timeout=20), "the segment mounted on the new master"
    else:
        bare_cluster.kill(segment)
        segment = start_ssd_segment(bare_cluster, ssd_dir)
        assert bare_cluster.wait_for(lambda: inventories() >= 1, timeout=20), "the segment mounted again"
    with bare_cluster.client(transport="tcp") as reader:
        for members, member_values in zip(groups, values, strict=True):
            got = reader.get_group(members)
            if members in disk_only or restarted == "master":  # every copy came back
                assert got == member_values, f"{members} on {[tiers[k] for k in members]}"
            else:  # a DRAM copy may be lost with the segment: then a miss for every member
                assert got in (member_values, [None] * 3), members
