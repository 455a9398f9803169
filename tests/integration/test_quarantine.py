"""Quarantine (issue 21, and issue 20's leftover): a segment the master hears but clients cannot reach.

The segment "cut" advertises its data plane at 127.0.0.5:P, where a FaultProxy (tests/faultproxy.py)
forwards to its real listener at 127.0.0.1:P; its heartbeats go to the master directly. Turning the
proxy into a black hole (every chunk held for an hour) cuts the segment from the clients only: it
stays ACTIVE and heartbeating, so before quarantine the master kept placing puts there, each failing
at the writer's timeout. Clients use tcp (shm would bypass the proxy).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.cluster import Cluster
from tests.faultproxy import FaultProxy
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ops_cli import as_json, kvtier

TIMEOUT_S = 2.0  # the clients' timeout: what a put sent to the cut segment waits
COOLOFF_S = 8.0  # long enough for the checks below on a busy machine
PROXY_HOST = "127.0.0.5"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segment_info(client, name: str):
    return next((s for s in client.cluster_status().segments if s.name == name), None)


def quarantined(client, name: str) -> bool:
    info = segment_info(client, name)
    return info is not None and info.quarantined


def timed_put(client, key: str, value: bytes, **placement) -> tuple[Status, float]:
    started = time.monotonic()
    status = client.batch_put([key], [value], **placement)[0]
    return status, time.monotonic() - started


@pytest.fixture
def proxied(bare_cluster) -> Iterator[tuple[Cluster, FaultProxy]]:
    """A master (quarantine after one failure), segment "good", and segment "cut" behind the proxy."""
    cluster: Cluster = bare_cluster
    cluster.start_master(
        "--metrics", "127.0.0.1:0", "--quarantine-failures", "1", "--quarantine-cooloff-s", str(COOLOFF_S)
    )
    cluster.start_segment("good")
    port = free_port()
    with FaultProxy((PROXY_HOST, port), ("127.0.0.1", port)) as proxy:
        cluster.start_segment("cut", "64MiB", "--listen", f"127.0.0.1:{port}", "--advertise", PROXY_HOST)
        yield cluster, proxy


def test_a_segment_clients_cannot_reach_costs_one_timeout_then_is_quarantined_and_returns_after_healing(proxied):
    cluster, proxy = proxied
    master = cluster.master
    value_bytes = b"v" * 65536
    with cluster.client(transport="tcp", timeout=TIMEOUT_S) as writer:
        assert cluster.wait_for(lambda: segment_info(writer, "good") and segment_info(writer, "cut"))
        # Before the fault: both replicas, the cut segment's first (it is preferred).
        assert writer.put("both", value_bytes, replicas=2, preferred_segment="cut") is None
        assert [r["segment"] for r in writer.locate("both")] == ["cut", "good"]
        assert writer.get("both") == value_bytes

        proxy.set(loss=1.0, loss_mode="stall", stall_s=3600.0)  # a black hole for the clients only

        status, took = timed_put(writer, "first", value_bytes, preferred_segment="cut")
        assert status != Status.OK and took >= TIMEOUT_S * 0.9, (status, took)
        # Only the first put waits: the writer avoids the segment and reported it.
        for i in range(5):
            status, took = timed_put(writer, f"after/{i}", value_bytes, preferred_segment="cut")
            assert status == Status.OK and took < TIMEOUT_S / 2, (i, status, took)
            assert [r["segment"] for r in writer.locate(f"after/{i}")] == ["good"]
            assert writer.get(f"after/{i}") == value_bytes
        assert writer.stats().get("failure_reports", 0) >= 1, writer.stats()

    # The master quarantined it: a client that never failed on it is placed elsewhere too.
    with cluster.client(transport="tcp", timeout=TIMEOUT_S) as fresh:
        assert quarantined(fresh, "cut"), segment_info(fresh, "cut")
        info = segment_info(fresh, "cut")
        assert info.state == "ACTIVE" and 0 < info.quarantine_left_s <= COOLOFF_S, info
        status, took = timed_put(fresh, "fresh", value_bytes, preferred_segment="cut")
        assert status == Status.OK and took < TIMEOUT_S / 2, (status, took)
        assert [r["segment"] for r in fresh.locate("fresh")] == ["good"]
        # Reads: the replica on the quarantined segment is listed last, so tried last.
        assert [r["segment"] for r in fresh.locate("both")] == ["good", "cut"]
        reply = fresh._master.call("GetReplicas", pb.KeysRequest(namespace=fresh.namespace, keys=["both"]))
        assert {e.name: e.quarantined for e in reply.segments} == {"cut": True, "good": False}
        started = time.monotonic()
        assert fresh.get("both") == value_bytes
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert fresh.stats().get("failure_reports", 0) == 0, "it never touched the cut segment"

    shown = {s["name"]: s for s in as_json(cluster, "status")["segments"]}
    assert shown["cut"]["quarantined"] and not shown["good"]["quarantined"], shown
    assert shown["cut"]["quarantine_left_s"] > 0, shown["cut"]
    table = kvtier(cluster, "status").stdout.decode()
    assert "ACTIVE QUARANTINED" in table, table
    metrics = scrape(master.info["metrics"])
    assert value(metrics, "kvtier_master_segment_quarantined", segment="cut") == 1
    assert value(metrics, "kvtier_master_segment_quarantined", segment="good") == 0
    reported = sum(
        value(metrics, "kvtier_master_segment_failure_reports_total", segment="cut", kind=kind)
        for kind in ("connect", "timeout", "transfer")
    )
    assert reported >= 1, {k: v for k, v in metrics.items() if "failure_reports" in k[0]}
    assert 'msg="segment quarantined" name=cut' in cluster.master.tail()

    proxy.set()  # healed
    with cluster.client(transport="tcp", timeout=TIMEOUT_S) as healed:
        assert cluster.wait_for(lambda: not quarantined(healed, "cut"), timeout=COOLOFF_S * 3)
        assert healed.put("healed", value_bytes, preferred_segment="cut") is None
        assert [r["segment"] for r in healed.locate("healed")] == ["cut"], "placed on again"
        assert healed.get("healed") == value_bytes
        assert [r["segment"] for r in healed.locate("both")] == ["cut", "good"]
    metrics = scrape(master.info["metrics"])
    assert value(metrics, "kvtier_master_segment_quarantined", segment="cut") == 0
    assert 'msg="segment quarantine over" name=cut' in cluster.master.tail()


def test_a_write_cut_mid_frame_is_retried_once_on_another_segment_within_the_put(proxied):
    cluster, proxy = proxied
    with cluster.client(transport="tcp", timeout=TIMEOUT_S) as client:
        assert cluster.wait_for(lambda: segment_info(client, "good") and segment_info(client, "cut"))
        proxy.set(loss=1.0, loss_mode="drop")  # every connection reset at its first bytes: a fast failure
        assert client.put("k", b"x" * 65536, preferred_segment="cut") is None, "the caller sees one successful put"
        assert [r["segment"] for r in client.locate("k")] == ["good"]
        assert client.get("k") == b"x" * 65536
        stats = client.stats()
        assert stats["put_retries"] == 1 and stats.get("put_failures", 0) == 0, stats
        assert quarantined(client, "cut")
