"""Prometheus metrics of the master and the segment servers (issue 7, first part): present, moving,
and honest about what a "hit" is."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_keep_lookup_hits_bytes_served_and_physical_reads_apart(bare_cluster):
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    seg = bare_cluster.start_segment("seg0", "64MiB", "--metrics", "127.0.0.1:0")
    master_metrics, segment_metrics = bare_cluster.master.info["metrics"], seg.info["metrics"]
    assert master_metrics.startswith("127.0.0.1:") and segment_metrics.startswith("127.0.0.1:")
    client = bare_cluster.client(transport="tcp")
    keys = [f"m/{i}" for i in range(40)]
    values = [os.urandom(8192) for _ in keys]
    assert not any(client.batch_put(keys, values))
    client.batch_get(keys[:5])  # warm: connections open, code paths loaded

    m0, s0 = scrape(master_metrics), scrape(segment_metrics)
    assert client.batch_get(keys + ["m/absent"]) == values + [None]
    found = client.batch_exists(keys[:10] + ["nope"])
    assert found == [True] * 10 + [False]
    m1, s1 = scrape(master_metrics), scrape(segment_metrics)

    def delta(before, after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(m0, m1, "kvtier_master_lookup_keys_total", rpc="GetReplicas") == 41
    assert delta(m0, m1, "kvtier_master_lookup_hits_total", rpc="GetReplicas") == 40
    assert delta(m0, m1, "kvtier_master_lookup_keys_total", rpc="Exists") == 11
    assert delta(m0, m1, "kvtier_master_lookup_hits_total", rpc="Exists") == 10
    served = delta(s0, s1, "kvtier_segment_served_bytes_total", segment="seg0", tier="dram", transport="tcp")
    assert served == 40 * 8192, "object bytes sent from DRAM over TCP"
    assert delta(s0, s1, "kvtier_segment_served_bytes_total", segment="seg0", tier="ssd", transport="tcp") == 0
    assert delta(s0, s1, "kvtier_segment_disk_read_bytes_total", segment="seg0") == 0, "served from RAM: no disk"
    assert value(m1, "kvtier_master_rpc_latency_seconds_count", method="GetReplicas") >= 2
    assert value(m1, "kvtier_master_rpc_requests_total", method="PutStart") >= 1
    assert value(m1, "kvtier_master_objects", state="complete") == 40
    assert value(m1, "kvtier_segment_used_bytes", segment="seg0", tier="dram") == 40 * 8192
    assert value(m1, "kvtier_master_role", role="leader") == 1
    assert value(s1, "kvtier_segment_index_objects", segment="seg0") == 40
    # Data-path latency, per op, apart from the master's metadata latency: the 41-key get was one
    # READ frame (40 ranges), the puts one WRITE.
    assert delta(s0, s1, "kvtier_segment_request_latency_seconds_count", segment="seg0", op="READ") == 1
    assert value(s1, "kvtier_segment_request_latency_seconds_count", segment="seg0", op="WRITE") >= 1
    assert delta(s0, s1, "kvtier_segment_request_latency_seconds_sum", segment="seg0", op="READ") > 0
    # Read again, every key remembered (and 128 KiB in all): the segment serves them alone (direct
    # reads), no lookup, and the bytes count as served from DRAM over TCP all the same.
    assert client.batch_get(keys[:16]) == values[:16]
    m2, s2 = scrape(master_metrics), scrape(segment_metrics)
    assert delta(m1, m2, "kvtier_master_lookup_keys_total", rpc="GetReplicas") == 0
    assert delta(s1, s2, "kvtier_segment_direct_reads_total", segment="seg0", outcome="served") == 16
    assert delta(s1, s2, "kvtier_segment_request_latency_seconds_count", segment="seg0", op="READ_KEYED") == 1
    assert delta(s1, s2, "kvtier_segment_served_bytes_total", segment="seg0", tier="dram", transport="tcp") == 16 * 8192
    for samples in (m1, s1):  # process figures of each service
        assert value(samples, "process_open_fds") > 0
        assert value(samples, "process_resident_memory_bytes") > 0
        assert value(samples, "process_threads") >= 2


def test_client_metrics_count_objects_served_and_verified_by_tier_and_transport(cluster):
    from prometheus_client import REGISTRY, generate_latest

    def samples() -> dict:
        out = {}
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    namespace = f"cm{os.getpid()}"
    shm = cluster.client(namespace=namespace, metrics=True)  # same host: shm
    tcp = cluster.client(namespace=namespace, metrics=True, transport="tcp")
    plain = cluster.client(namespace=namespace)  # not tracked
    keys = [f"c/{i}" for i in range(8)]
    assert not any(shm.batch_put(keys, [b"x" * 1000] * 8))
    before = samples()
    assert shm.batch_get(keys) == [b"x" * 1000] * 8
    assert tcp.batch_get(keys[:3] + ["c/none"]) == [b"x" * 1000] * 3 + [None]
    plain.batch_get(keys)
    after = samples()

    def delta(name, **labels):
        key = (name, tuple(sorted({"namespace": namespace, **labels}.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("kvtier_client_served_objects_total", tier="dram", transport="shm") == 8
    assert delta("kvtier_client_served_objects_total", tier="dram", transport="tcp") == 3
    assert delta("kvtier_client_served_bytes_total", tier="dram", transport="tcp") == 3000
    assert delta("kvtier_client_gets_total") == 12 and delta("kvtier_client_misses_total") == 1
    assert delta("kvtier_client_hits_total") == 11, "the untracked client is not counted"
    # Client-side latency per call: one batch_get each on the two tracked clients.
    assert delta("kvtier_client_op_latency_seconds_count", op="batch_get") == 2
    assert delta("kvtier_client_op_latency_seconds_sum", op="batch_get") > 0
    assert delta("kvtier_client_op_latency_seconds_count", op="batch_put") == 0


def test_lease_expiries_count_abandoned_puts_and_expelled_segments(bare_cluster):
    import grpc

    from kvtier.proto import master_pb2 as pb
    from kvtier.proto import master_pb2_grpc

    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--put-timeout-s", "0.5")
    bare_cluster.start_segment("keep", "16MiB")
    lost = bare_cluster.start_segment("lost", "16MiB")
    master_http = bare_cluster.master.info["metrics"]
    with grpc.insecure_channel(bare_cluster.master.info["address"]) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        reply = stub.PutStart(pb.PutStartRequest(namespace="default", keys=["a", "b"], sizes=[8, 8], replicas=1))
        assert list(reply.statuses) == [0, 0]  # started, never ended
    bare_cluster.kill(lost)

    def expiries() -> tuple[float, float]:
        samples = scrape(master_http)
        return (
            value(samples, "kvtier_master_lease_expiries_total", kind="put"),
            value(samples, "kvtier_master_lease_expiries_total", kind="segment"),
        )

    assert bare_cluster.wait_for(lambda: expiries() == (2, 1), timeout=10), expiries()


def probe(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_health_and_readiness_probes_follow_the_service_state(bare_cluster, tmp_path):
    master_args = ("--metrics", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--recovery-timeout-s", "60")
    bare_cluster.start_master(*master_args)
    seg = bare_cluster.start_segment("seg0", "16MiB", "--metrics", "127.0.0.1:0")
    master_http, segment_http = bare_cluster.master.info["metrics"], seg.info["metrics"]
    assert probe(master_http, "/healthz") == (200, "ok\n")
    assert probe(master_http, "/readyz") == (200, "ready\n")
    assert probe(segment_http, "/readyz") == (200, "ready\n")
    assert "kvtier_master_role" in probe(master_http, "/metrics")[1]

    # A restarted master is alive but not ready while it waits for the saved segment's inventory.
    bare_cluster.kill(seg)
    master = bare_cluster.restart_master(*master_args)
    master_http = master.info["metrics"]
    assert probe(master_http, "/healthz")[0] == 200
    code, reason = probe(master_http, "/readyz")
    assert code == 503 and reason.startswith("recovering"), reason
    seg = bare_cluster.start_segment("seg0", "16MiB", "--metrics", "127.0.0.1:0")
    assert bare_cluster.wait_for(lambda: probe(master_http, "/readyz")[0] == 200)
    segment_http = seg.info["metrics"]
    assert probe(segment_http, "/readyz")[0] == 200

    # A segment whose master stopped answering is no longer ready (it still runs: healthz stays 200).
    bare_cluster.kill(master)
    assert bare_cluster.wait_for(lambda: probe(segment_http, "/readyz")[0] == 503, timeout=15)
    code, reason = probe(segment_http, "/readyz")
    assert "no heartbeat answered" in reason or "not mounted" in reason, reason
    assert probe(segment_http, "/healthz")[0] == 200


def test_the_master_freezes_its_long_lived_records_once_it_holds_enough(bare_cluster):
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--gc-freeze-min-objects", "300")
    bare_cluster.start_segment("seg0", "16MiB")
    client = bare_cluster.client()
    master_http = bare_cluster.master.info["metrics"]
    assert not any(client.batch_put([f"few/{i}" for i in range(100)], [b"x"] * 100))
    time.sleep(0.5)  # a few of the master's ticks (0.2 s): under the minimum, nothing is frozen
    assert value(scrape(master_http), "kvtier_master_gc_frozen_objects") == 0
    assert not any(client.batch_put([f"many/{i}" for i in range(300)], [b"x"] * 300))
    assert bare_cluster.wait_for(
        lambda: value(scrape(master_http), "kvtier_master_gc_frozen_objects") >= 400, timeout=10
    )
