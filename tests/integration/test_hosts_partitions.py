"""Partitions between test hosts (tests/hosts.py): master, segments and clients each on a host of its own.

Real processes; values derived from their keys, so every hit is checked byte for byte. Targets
for unavailability are docs/benchmarks.md's ("Unavailability under partitions").
"""

from __future__ import annotations

import random
import threading
import time
import zlib

import pytest

from kvtier.client import Client, KvtierError, Status
from kvtier.proto.region import host_id as local_host_id
from tests.cluster import Cluster
from tests.hosts import Network

KiB = 1 << 10
INSECURE = ("--allow-insecure", "true")  # addresses of test-only namespaces, no secret


def value_for(key: str, size: int = 64 * KiB, version: int = 1) -> bytes:
    return random.Random(zlib.crc32(f"{key}/{version}".encode())).randbytes(size)


def segments(client: Client) -> dict[str, str]:
    return {s.name: s.state for s in client.cluster_status().segments}


@pytest.fixture
def hosts(bare_cluster: Cluster):
    with Network(["master", "s0", "s1"]) as net:
        cluster = bare_cluster
        # A TTL well above the client's 3 s timeout (the was 10 s): what happens between a
        # cut and the expulsion is seen.
        cluster.segment_ttl_s = 6.0
        cluster.start_master("--listen", f"{net['master'].address}:0", *INSECURE, prefix=net["master"].prefix())
        for name in ("s0", "s1"):
            host = net[name]
            cluster.start_segment(name, "64MiB", "--listen", f"{host.address}:0", *INSECURE, prefix=host.prefix())
        try:
            yield net, cluster
        finally:
            net.heal()
            cluster.stop()  # before the namespaces go


def remove_quietly(cluster: Cluster, key: str) -> None:
    """A Remove, from a client of its own, whatever it answers (it waits for the segment's acknowledgement)."""
    with cluster.client(transport="tcp", timeout=3.0) as remover:
        try:
            remover.remove(key)
        except KvtierError:
            pass


def first_ok_put(client: Client, key: str, limit_s: float, **placement) -> float:
    """Seconds until a put of `key` is acknowledged (retrying at once after each failure)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            client.put(key, value_for(key), **placement)
            return time.monotonic() - t0
        except KvtierError:
            pass
    return float("inf")


@pytest.mark.slow  # ~15 s: make test-slow (CI runs it)
def test_a_segment_cut_off_for_longer_than_its_ttl_keeps_its_objects_and_puts_go_elsewhere(hosts):
    """The issue's observation: a link outage longer than segment_ttl_s made the master expel the
    segment, which then discarded all 50 objects it still held intact; a put during the outage
    failed after the client's timeout."""
    net, cluster = hosts
    keys = [f"outage/{i:02d}" for i in range(50)]
    with cluster.client(transport="tcp", timeout=3.0) as client:
        hosts = {s.host_id for s in client.cluster_status().segments} | {local_host_id()}
        assert len(hosts) == 3, "test hosts share a host identity: their clients would take shm"
        assert client.batch_put(keys, [value_for(k) for k in keys], preferred_segment="s0") == [Status.OK] * 50
        client.put("outage/removed", value_for("outage/removed"), preferred_segment="s0")
        net.cut("s0")
        # A notice s0 cannot acknowledge while cut off: the drop of a key removed now. (A busy segment
        # always has some pending: a relayed put's are acknowledged ~2 ms after its answer.) Before,
        # every PutEnd in the cluster waited for it until s0 was expelled at segment_ttl_s.
        remover = threading.Thread(target=lambda: remove_quietly(cluster, "outage/removed"), daemon=True)
        remover.start()
        try:
            # Puts preferring s0 (an engine on its host) from the moment of the cut, each retried at
            # once after a failure: the first may be placed on s0 before anyone can know and fail at
            # the client's timeout; the next must land on s1, long before the master expels s0
            # (segment_ttl_s). Before the fix every put preferring s0 failed until the expulsion.
            took = first_ok_put(client, "outage/during", cluster.segment_ttl_s * 2, preferred_segment="s0")
            assert took < cluster.segment_ttl_s - 1, f"first acknowledged put {took:.1f}s into the outage"
            assert "s0" in segments(client), "s0 already expelled: the test measured nothing"
            assert cluster.wait_for(lambda: "s0" not in segments(client), timeout=cluster.segment_ttl_s * 5)
            time.sleep(2.0)  # away a while past its expulsion, like the 12 s outage
        finally:
            net.restore("s0")
            remover.join(timeout=10)  # its Remove ends at the client's 3 s timeout or the expulsion
        assert not remover.is_alive()
        assert cluster.wait_for(lambda: segments(client).get("s0") == "ACTIVE", timeout=15)
        assert cluster.wait_for(lambda: all(client.batch_exists(keys)), timeout=10), (
            f"objects not re-adopted: {sum(client.batch_exists(keys))}/50\n{cluster.logs()}"
        )
        assert client.batch_get(keys) == [value_for(k) for k in keys]
        assert all(r["segment"] == "s0" for k in keys for r in client.locate(k))
        assert client.get("outage/during") == value_for("outage/during")
