"""Case 12: the master's Status RPC reports segments, capacity, use and objects as they are."""

from __future__ import annotations

from collections import Counter

from kvtier.client import Status

MiB = 1 << 20
SEGMENT = 64 * MiB
ALIGNMENT = 64  # the master's default allocation granularity


def aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def test_status_of_a_fresh_cluster(cluster):
    status = cluster.client().cluster_status()
    assert status.status == Status.OK
    assert status.cluster_id == cluster.cluster_id
    assert status.master_epoch == str(cluster.master.info["epoch"])
    assert (status.objects, status.pending_puts, status.used) == (0, 0, 0)
    assert status.capacity == 2 * SEGMENT
    assert status.uptime_s > 0
    assert sorted(s.name for s in status.segments) == ["seg0", "seg1"]
    for seg in status.segments:
        assert seg.dram_capacity == SEGMENT and seg.dram_used == 0 and seg.objects == 0
        assert list(seg.endpoints) == cluster.segments[seg.name].info["endpoints"]
        assert seg.state == "ACTIVE"
        assert seg.heartbeat_age_ms < cluster.segment_ttl_s * 1000
    assert len({s.segment_id for s in status.segments}) == 2


def test_status_counts_what_was_put_and_removed(cluster):
    client = cluster.client()
    sizes = {"s/a": 1000, "s/b": 4096, "s/c": MiB + 1, "s/d": 0, "s/e": 65}
    for key, size in sizes.items():
        client.put(key, bytes(size))
    client.batch_put(["r/a", "r/b"], [bytes(3000), bytes(0)], replicas=2)

    status = client.cluster_status()
    expected_used = sum(aligned(s) for s in sizes.values()) + 2 * aligned(3000)
    assert status.objects == len(sizes) + 2 and status.pending_puts == 0
    assert status.used == expected_used
    assert sum(s.dram_used for s in status.segments) == expected_used
    assert sum(s.objects for s in status.segments) == len(sizes) + 2 * 2, "replicas counted per segment"
    assert status.capacity == 2 * SEGMENT

    # Per segment, the numbers match where locate() says each replica lives.
    used, objects = Counter(), Counter()
    for key, size in {**sizes, "r/a": 3000, "r/b": 0}.items():
        for replica in client.locate(key):
            assert replica["size"] == size
            used[replica["segment"]] += aligned(size)
            objects[replica["segment"]] += 1
    status = client.cluster_status()
    assert {s.name: s.dram_used for s in status.segments} == {n: used[n] for n in ("seg0", "seg1")}
    assert {s.name: s.objects for s in status.segments} == {n: objects[n] for n in ("seg0", "seg1")}

    # Idempotent re-puts change nothing.
    client.put("s/a", bytes(1000))
    assert client.cluster_status().used == expected_used and client.cluster_status().objects == len(sizes) + 2

    # Removed objects leave the counts at once; their space, leased by the reads above, comes back later.
    assert client.remove_prefix("") == len(sizes) + 2
    status = client.cluster_status()
    assert status.objects == 0 and all(s.objects == 0 for s in status.segments)
    assert status.used == expected_used, "ranges under a read lease are not freed early"

    # Objects never read are freed at once.
    client.batch_put(["x/1", "x/2"], [bytes(5000), bytes(70)])
    assert client.cluster_status().used == expected_used + aligned(5000) + aligned(70)
    assert client.batch_remove(["x/1", "x/2"]) == [Status.OK, Status.OK]
    assert client.cluster_status().used == expected_used
