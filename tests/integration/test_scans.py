"""Scans that no longer stall the master (issue 19) keep their answers right under concurrent load:
a RemovePrefix swept in slices, a listing, and a segment's death cleaned up in slices, each while
other clients put and get. The master runs tiny slices (`--sweep-slice-objects 8`) so that every
scan spans many turns of its event loop, with requests served in between."""

from __future__ import annotations

import threading

from tests.cluster import Cluster

SLICES = ("--sweep-slice-objects", "8")


def value(key: str) -> bytes:
    return key.encode() * 4


class Load(threading.Thread):
    """Puts fresh keys under `put_prefix` and reads `read_keys` back until stopped; any wrong bytes
    are recorded (a miss is allowed where the key may be gone, wrong bytes never)."""

    def __init__(self, cluster: Cluster, put_prefix: str, read_keys: list[str], must_hit: bool) -> None:
        super().__init__(daemon=True)
        self.client = cluster.client()
        self.put_prefix, self.read_keys, self.must_hit = put_prefix, read_keys, must_hit
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.put_done: list[str] = []  # keys whose put returned, in order
        self.rounds = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                key = f"{self.put_prefix}{self.rounds:06d}"
                self.client.put(key, value(key))
                self.put_done.append(key)
                sample = self.read_keys[self.rounds % len(self.read_keys) :][:16]
                for k, got in zip(sample, self.client.batch_get(sample), strict=True):
                    if got is None and self.must_hit:
                        self.errors.append(f"{k}: missing")
                    elif got is not None and bytes(got) != value(k):
                        self.errors.append(f"{k}: wrong bytes")
                self.rounds += 1
        except Exception as exc:  # surfaced by the test
            self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=30)
        assert not self.is_alive()


def fill(client, keys: list[str]) -> None:
    for lo in range(0, len(keys), 256):
        chunk = keys[lo : lo + 256]
        client.batch_put(chunk, [value(k) for k in chunk])


def test_remove_prefix_in_slices_under_concurrent_puts_and_gets(bare_cluster):
    cluster = bare_cluster
    cluster.start_master(*SLICES)
    cluster.start_segment("seg0")
    client = cluster.client()
    doomed = [f"p/{i:05d}" for i in range(3000)]
    kept = [f"q/{i:05d}" for i in range(300)]
    fill(client, doomed + kept)
    load = Load(cluster, "p/new-", kept, must_hit=True)
    load.start()
    assert cluster.wait_for(lambda: load.rounds >= 3)
    started_after = len(load.put_done)  # every put returned before this may be removed, none after
    removed = client.remove_prefix("p/")
    survivors_from = len(load.put_done)  # puts returned after RemovePrefix answered: kept
    assert cluster.wait_for(lambda: len(load.put_done) >= survivors_from + 3)
    load.finish()
    assert not load.errors, load.errors[:5]
    assert 3000 + started_after <= removed <= 3000 + survivors_from
    # nothing complete before it began is left; the puts after it answered all are
    assert not any(client.batch_exists(doomed))
    assert all(client.batch_exists(load.put_done[survivors_from:]))
    listed = [k.key for k in client.iter_keys("p/")]
    assert listed == sorted(listed) and not set(listed) & set(doomed)
    assert set(load.put_done[survivors_from:]) <= set(listed)
    assert [bytes(v) for v in client.batch_get(kept)] == [value(k) for k in kept]


def test_paging_lists_every_key_present_throughout_once_under_concurrent_puts_and_removes(bare_cluster):
    cluster = bare_cluster
    cluster.start_master(*SLICES)
    cluster.start_segment("seg0")
    client = cluster.client()
    stable = [f"l/{i:05d}" for i in range(1500)]
    churn = [f"l/{i:05d}x" for i in range(0, 1500, 3)]  # interleaved with the stable ones
    fill(client, stable + churn)
    load = Load(cluster, "l/", stable, must_hit=True)  # new keys l/000000.. interleave too
    load.start()
    listed = []
    for i, info in enumerate(client.iter_keys("l/", page_size=37)):
        listed.append(info.key)
        if i % 50 == 0:
            client.remove(churn[i // 50])
    load.finish()
    assert not load.errors, load.errors[:5]
    assert listed == sorted(set(listed)), "a key listed twice or out of order"
    assert set(stable) <= set(listed)


def test_a_dead_segments_copies_are_never_handed_out_while_its_cleanup_runs(bare_cluster):
    cluster = bare_cluster
    cluster.start_master(*SLICES)
    doomed_segment = cluster.start_segment("seg0")
    client = cluster.client()
    lost = [f"d/{i:05d}" for i in range(2000)]
    fill(client, lost)  # only seg0 is mounted: all of them live there
    cluster.start_segment("seg1", "64MiB")
    kept = [f"k/{i:05d}" for i in range(400)]
    assert cluster.wait_for(lambda: len(client.cluster_status().segments) == 2)
    fill(client, kept)
    on_seg1 = [k for k, where in zip(kept, map(client.locate, kept), strict=True) if where[0]["segment"] == "seg1"]
    assert on_seg1
    load = Load(cluster, "n/", on_seg1, must_hit=True)
    load.start()
    cluster.kill(doomed_segment)
    # expelled at segment_ttl_s: from then on none of its objects exists, at once for all of them
    assert cluster.wait_for(lambda: not client.exists(lost[-1]), timeout=30)
    assert not any(client.batch_exists(lost))
    assert client.batch_get(lost[:50]) == [None] * 50
    assert cluster.wait_for(lambda: len(load.put_done) >= 5)
    load.finish()
    assert not load.errors, load.errors[:5]
    assert all(client.batch_exists(on_seg1 + load.put_done))
    assert not [k.key for k in client.iter_keys("d/")]


def test_a_prefix_ending_in_the_largest_code_point_lists_and_removes_its_keys(cluster):
    # given keys under a prefix that ends in U+10FFFF (a valid key character), and one outside it
    largest = chr(0x10FFFF)
    client = cluster.client()
    for key in ("a" + largest, "a" + largest + "x", "b"):
        client.put(key, key.encode())
    # when they are listed and removed by that prefix
    listed = sorted(info.key for info in client.list_keys(prefix="a" + largest).keys)
    removed = client.remove_prefix("a" + largest)
    # then exactly its keys were listed and removed, and the master still serves
    assert listed == ["a" + largest, "a" + largest + "x"] and removed == 2
    assert client.get("b") == b"b" and not client.exists("a" + largest)
