"""The cluster's eviction policy (issue 21) against real processes: under s3fifo a hot set read twice
survives a one-shot scan that flushes it under lru.

Deterministic by construction: the segment holds exactly ten objects; the watermark is off
(`--high-watermark 1`), so only the puts evict, one object each, at the moment they need room;
each read's lease is handed back by the client's next request, so no lease protects a key when a
put picks its victim. Nothing depends on timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvtier.client import Status
from tests.integration.test_metrics import scrape, value

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]
OBJECTS = 10  # the segment's room, in objects
HOT, SCAN = 4, 20


@pytest.mark.parametrize(("policy", "hot_survives"), [("lru", False), ("s3fifo", True)])
def test_a_hot_set_read_twice_survives_a_one_shot_scan_under_s3fifo_not_lru(bare_cluster, policy, hot_survives):
    cluster = bare_cluster
    cluster.start_master("--eviction-policy", policy, "--high-watermark", "1.0", "--metrics", "127.0.0.1:0")
    cluster.start_segment("seg0", "16MiB")
    client = cluster.client()
    assert cluster.wait_for(lambda: len(client.cluster_status().segments) == 1)
    capacity = client.cluster_status().capacity
    size = capacity // OBJECTS // 4096 * 4096  # OBJECTS fit, one more does not
    assert (OBJECTS + 1) * size > capacity

    # given a hot set, each key read twice
    hot = [f"hot/{i}" for i in range(HOT)]
    for key in hot:
        client.put(key, key.encode().ljust(size, b"h"))
    for _ in range(2):
        assert client.batch_get(hot) == [key.encode().ljust(size, b"h") for key in hot]
    # when a scan writes and reads once SCAN cold keys, one after the other (the last SCAN - 6 puts evict)
    for i in range(SCAN):
        key = f"scan/{i:02d}"
        assert client.batch_put([key], [key.encode().ljust(size, b"s")]) == [Status.OK]
        assert client.get(key) == key.encode().ljust(size, b"s")
    # then the hot set is all there under s3fifo (the scan left from the small FIFO), all gone under lru
    present = [client.exists(key) for key in hot]
    assert present == [hot_survives] * HOT
    if hot_survives:
        assert client.batch_get(hot) == [key.encode().ljust(size, b"h") for key in hot]  # the right bytes
    status = client.cluster_status()
    assert status.objects == OBJECTS
    assert {e.reason: e.objects for e in status.evictions} == {"allocation": HOT + SCAN - OBJECTS}
    # and the policy in force is shown by its metrics (with S3-FIFO's queues) and by `kvtier status`
    metrics = scrape(cluster.master.info["metrics"])
    assert value(metrics, "kvtier_master_eviction_policy_info", policy=policy) == 1
    if policy == "s3fifo":
        entries = "kvtier_master_eviction_queue_entries"
        queues = {q: value(metrics, entries, queue=q) for q in ("small", "main", "ghost")}
        assert queues == {"small": OBJECTS - HOT, "main": HOT, "ghost": HOT + SCAN - OBJECTS}
    shown = subprocess.run(
        [*KVTIER, "status", "--master", cluster.master_address, "--json"], capture_output=True, timeout=60, check=True
    )
    assert json.loads(shown.stdout)["eviction_policy"] == policy
    text = subprocess.run(
        [*KVTIER, "status", "--master", cluster.master_address], capture_output=True, timeout=60, check=True
    )
    assert f"eviction {policy}" in text.stdout.decode().splitlines()[0]


@pytest.mark.parametrize(("before", "after"), [("lru", "s3fifo"), ("s3fifo", "lru")])
def test_changing_the_policy_across_a_restart_keeps_every_object_and_rebuilds_the_order(bare_cluster, before, after):
    cluster = bare_cluster
    cluster.start_master("--eviction-policy", before)
    cluster.start_segment("seg0")
    client = cluster.client()
    keys = [f"k/{i:02d}" for i in range(20)]
    values = [key.encode() * 100 for key in keys]
    assert not any(client.batch_put(keys, values))
    for _ in range(2):
        assert client.batch_get(keys[:10]) == values[:10]  # under s3fifo: these are in main

    cluster.restart_master("--eviction-policy", after, "--metrics", "127.0.0.1:0")

    # the same client retries while the master recovers from the segment's inventory
    assert client.batch_get(keys) == values
    status = client.cluster_status()
    assert (status.eviction_policy, status.objects, status.recovery["objects"]) == (after, 20, 20)
    metrics = scrape(cluster.master.info["metrics"])
    assert value(metrics, "kvtier_master_eviction_policy_info", policy=after) == 1
    assert value(metrics, "kvtier_master_eviction_policy_info", policy=before) == 0
    if after == "s3fifo":  # every recovered object is in the order: the small FIFO (one read since)
        entries = "kvtier_master_eviction_queue_entries"
        assert value(metrics, entries, queue="small") + value(metrics, entries, queue="main") == 20


@pytest.mark.parametrize("case", ["second_replica", "ranges_not_free_yet"])
def test_a_put_refused_no_space_evicts_nothing(bare_cluster, case):
    """A refused put must not destroy anything: not a replicated put whose second replica found no room
    (its first had evicted 3 objects), nor a put whose victims' ranges were still inside their lease's
    clock-skew margin (evicted 2 objects for room that only came 2 s later)."""
    MiB = 1 << 20
    cluster = bare_cluster
    cluster.start_master("--lease-s", "1")
    cluster.start_segment("s0", "8MiB")
    client = cluster.client()
    if case == "second_replica":
        cluster.start_segment("s1", "8MiB")
        for i in range(7):
            assert client.batch_put([f"pin{i}"], [bytes(MiB)], pin="hard", preferred_segment="s1") == [0]
        keep = [f"keep{i}" for i in range(6)]
        for key in keep:
            assert client.batch_put([key], [bytes(MiB)], preferred_segment="s0") == [0]
        status = client.batch_put(["big"], [bytes(3 * MiB)], replicas=2)
    else:
        keep = [f"k{i}" for i in range(7)]
        for key in keep:
            assert client.batch_put([key], [bytes(MiB)], lease_s=1.0) == [0]
        time.sleep(1.2)  # the put-time leases are over; their ranges' 2 s margin is not
        status = client.batch_put(["big"], [bytes(2 * MiB)])
    assert status == [Status.NO_SPACE]
    assert client.batch_exists(keep) == [True] * len(keep), "the refused put evicted objects"
    assert not [e for e in client.cluster_status().evictions if e.objects]
