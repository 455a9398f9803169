"""Master HA on a real etcd: one leader, standbys that refuse with its address, failover without
loss, a paused old leader that cannot commit, and a leader that steps down when etcd is gone."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from kvtier.common.discovery import leader_hint
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.status import Status
from tests.integration.test_master_restart import check_final_state, finish_load, start_load
from tests.integration.test_metrics import probe
from tests.load_worker import expected_value

TTL = "2"  # etcd lease seconds: failover takes about this long


def _hello(address: str) -> pb.HelloResponse:
    with grpc.insecure_channel(address) as channel:
        return master_pb2_grpc.MasterStub(channel).Hello(pb.HelloRequest(), timeout=2)


def _roles(cluster) -> dict[str, str]:
    out = {}
    for name, proc in cluster.masters.items():
        if proc.alive:
            try:
                out[name] = _hello(proc.info["address"]).role
            except grpc.RpcError:
                out[name] = "unreachable"
    return out


def _leader(cluster, timeout: float = 15.0) -> str:
    """Name of the master that leads and serves (waits for one)."""
    found: list[str] = []

    def one_leader() -> bool:
        leaders = [n for n, role in _roles(cluster).items() if role == "leader"]
        found[:] = leaders
        return len(leaders) == 1

    assert cluster.wait_for(one_leader, timeout=timeout, interval=0.1), f"no single leader: {_roles(cluster)}"
    return found[0]


@pytest.fixture
def ha(bare_cluster, etcd):
    bare_cluster.start_ha_masters(
        etcd.endpoint, 3, "--etcd-lease-ttl-s", TTL, "--recovery-timeout-s", "3", "--metrics", "127.0.0.1:0"
    )
    leader = _leader(bare_cluster)
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    bare_cluster.etcd = etcd
    bare_cluster.leader = leader
    return bare_cluster


def test_one_leader_and_standbys_refuse_with_its_address(ha):
    client = ha.client()
    client.put("k", b"v")
    assert client.get("k") == b"v"
    roles = _roles(ha)
    assert sorted(roles.values()) == ["leader", "standby", "standby"]
    assert probe(ha.masters[ha.leader].info["metrics"], "/readyz") == (200, "ready\n")
    assert probe(ha.masters[ha.leader].info["metrics"], "/readyz/leader") == (200, "ready\n")
    leader_address = ha.masters[ha.leader].info["address"]
    for name, proc in ha.masters.items():
        if name == ha.leader:
            continue
        hello = _hello(proc.info["address"])
        assert hello.role == "standby" and hello.leader == leader_address
        # A standby following the leader is ready (it can roll, a PodDisruptionBudget counts it);
        # the leader-only probe says it does not lead.
        assert probe(proc.info["metrics"], "/healthz")[0] == 200
        assert probe(proc.info["metrics"], "/readyz") == (200, "ready\n")
        assert probe(proc.info["metrics"], "/readyz/leader") == (503, f"standby; leader={leader_address}\n")
        with grpc.insecure_channel(proc.info["address"]) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            reply = stub.PutStart(pb.PutStartRequest(namespace="default", keys=["x"], sizes=[10], replicas=1))
            assert reply.status == Status.UNAVAILABLE
            assert leader_hint(reply.error) == leader_address
            assert stub.GetReplicas(pb.KeysRequest(namespace="default", keys=["k"])).status == Status.UNAVAILABLE


def test_a_client_given_a_list_of_masters_follows_the_standbys_to_the_leader(ha):
    from kvtier.client import Client

    addresses = ",".join(p.info["address"] for n, p in ha.masters.items() if n != ha.leader)
    with Client(addresses + "," + ha.masters[ha.leader].info["address"], timeout=5.0) as client:
        client.put("listed", b"yes")
        assert client.get("listed") == b"yes"


@pytest.mark.slow  # 6-13 s: runs in make test-slow (CI runs both)
def test_killing_the_leader_under_load_fails_over_without_losing_a_complete_object(ha, tmp_path):
    client = ha.client(timeout=15.0)
    keys = [f"before/{i}" for i in range(300)]
    assert not any(client.batch_put(keys, [expected_value(k) for k in keys]))
    procs = start_load(ha, tmp_path, seconds=8.0)
    time.sleep(2.0)
    old = ha.leader
    killed_at = time.monotonic()
    ha.kill(ha.masters[old])
    new = _leader(ha, timeout=20.0)
    assert new != old
    probe = ha.client(timeout=20.0)
    probe.put("after-failover", b"ok")  # waits (retrying) until the new leader serves
    gap = time.monotonic() - killed_at
    print(f"failover: writes served again {gap:.2f}s after the leader was killed")
    log, wrong = finish_load(procs)
    assert not wrong, f"readers got wrong bytes: {wrong[:5]}"
    got = client.batch_get(keys)
    lost = [k for k, v in zip(keys, got, strict=True) if v != expected_value(k)]
    assert not lost, f"{len(lost)} complete objects lost or changed in the failover, e.g. {lost[:5]}"
    assert check_final_state(client, log) > 20
    status = client.cluster_status()
    assert status.role == "leader" and status.recovery["segments_reported"] == 2


@pytest.mark.slow  # 6-13 s: runs in make test-slow (CI runs both)
def test_a_paused_old_leader_that_wakes_after_a_new_election_cannot_commit(ha):
    client = ha.client(timeout=15.0)
    client.put("before", b"1")
    old = ha.masters[ha.leader]
    old.popen.send_signal(signal.SIGSTOP)
    try:
        new = _leader(ha, timeout=20.0)
        assert ha.masters[new] is not old
        client.put("during", b"2")  # served by the new leader
    finally:
        old.popen.send_signal(signal.SIGCONT)
    # At once, before the old leader's election thread could notice anything through etcd:
    with grpc.insecure_channel(old.info["address"]) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        started = stub.PutStart(
            pb.PutStartRequest(namespace="default", keys=["stale"], sizes=[3], replicas=1), timeout=5
        )
        assert started.status == Status.UNAVAILABLE, "a deposed leader accepted a PutStart"
        ended = stub.PutEnd(pb.PutEndRequest(namespace="default", keys=["before"], checksums=[0], put_id=1), timeout=5)
        assert ended.status == Status.UNAVAILABLE
        removed = stub.Remove(pb.KeysRequest(namespace="default", keys=["before"]), timeout=5)
        assert removed.status == Status.UNAVAILABLE
    assert client.get("before") == b"1" and client.get("during") == b"2"
    assert client.get("stale") is None
    assert sorted(_roles(ha).values()) == ["leader", "standby", "standby"]


def test_etcd_gone_the_leader_serves_its_grace_period_then_steps_down_and_no_one_leads(ha):
    client = ha.client(timeout=2.0)
    client.put("k", b"v")
    ha.etcd.pause()
    try:
        paused_at = time.monotonic()
        client.put("within-grace", b"w")  # the leader keeps serving while its lease surely lives
        assert time.monotonic() - paused_at < float(TTL) / 2, "served well within the lease, not after a retry"
        assert ha.wait_for(lambda: "leader" not in _roles(ha).values(), timeout=int(TTL) + 3)
        assert "leader" not in _roles(ha).values()
        time.sleep(1.0)
        assert "leader" not in _roles(ha).values(), "a master took the lead without etcd"
    finally:
        ha.etcd.resume()
    _leader(ha, timeout=20.0)
    reader = ha.client(timeout=15.0)
    assert reader.get("k") == b"v" and reader.get("within-grace") == b"w"
