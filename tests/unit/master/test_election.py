"""LeaderElection's own arithmetic and its state before any campaign (kvtier.master.election).

Winning, keeping and losing the leadership need etcd: tests/integration/test_etcd_election.py runs
them against a real one (tests/etcd.py). Here the EtcdClient points at a port nothing listens on,
and nothing below may call it: a call would fail or hang, and the tests say so.
"""

from __future__ import annotations

import pytest

from kvtier.common.etcd_client import EtcdClient
from kvtier.master.election import LeaderElection, safety_margin

INFO = {"address": "10.0.0.1:50051", "pid": 1, "name": "m1"}


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def etcd():
    client = EtcdClient("127.0.0.1:1", timeout=0.2)  # never reached: no call may go out
    yield client
    client.close()


@pytest.mark.parametrize(("ttl_s", "margin_s"), [(1.0, 0.5), (5.0, 0.5), (10.0, 1.0), (30.0, 3.0)])
def test_the_leader_stops_believing_at_least_half_a_second_and_a_tenth_of_the_ttl_early(ttl_s, margin_s):
    assert safety_margin(ttl_s) == pytest.approx(margin_s)


def test_keep_alives_leave_room_for_two_late_or_failed_renewals(etcd):
    election = LeaderElection(etcd, "c1", INFO, ttl_s=6.0)
    assert election.margin_s == pytest.approx(0.6)
    assert election.grace_s == pytest.approx(6.0 - 0.6), "how long it serves with etcd unreachable"
    assert election.keepalive_interval_s == pytest.approx(election.grace_s / 3)


@pytest.mark.parametrize("cluster", ["", "has space", "a/b", "x" * 65], ids=["empty", "space", "slash", "long"])
def test_a_cluster_id_that_cannot_name_an_etcd_key_is_refused(etcd, cluster: str):
    with pytest.raises(ValueError, match="cluster_id"):
        LeaderElection(etcd, cluster, INFO)


@pytest.mark.parametrize("ttl_s", [0.0, 0.5, -1.0])
def test_a_ttl_under_a_second_is_refused(etcd, ttl_s: float):
    with pytest.raises(ValueError, match="whole seconds"):
        LeaderElection(etcd, "c1", INFO, ttl_s=ttl_s)


def test_before_any_campaign_it_leads_nothing_whatever_the_clock_says(etcd):
    clock = Clock()
    election = LeaderElection(etcd, "c1", INFO, clock=clock)
    for now in (0.0, 1e9, float("inf")):
        clock.now = now
        assert not election.is_leader()
    assert election.epoch == 0
    assert election.leader_info() is None
    assert election.key.endswith("/c1/leader")


def test_info_updated_before_a_win_waits_for_the_next_campaign(etcd):
    election = LeaderElection(etcd, "c1", INFO)
    new = {**INFO, "address": "10.0.0.1:50052"}
    assert election.update_info(new) is False, "no lease: nothing written, nothing sent to etcd"
    assert election.leader_info() is None, "it holds nothing, so it shows nobody"


def test_stop_without_start_is_idempotent_and_sends_nothing(etcd):
    election = LeaderElection(etcd, "c1", INFO)
    election.stop()
    election.stop(resign=False)
    assert not election.is_leader()
