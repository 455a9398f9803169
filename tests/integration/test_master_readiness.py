"""HA readiness (issue 22): a standby that follows the leader is ready on /readyz, so masters can roll
one at a time under a PodDisruptionBudget; /readyz/leader stays leader-only. A real etcd, two masters."""

from __future__ import annotations

import pytest

from tests.integration.test_master_ha import _leader
from tests.integration.test_metrics import probe

TTL = 2.0  # etcd lease seconds; a standby is not ready once etcd has been silent longer than this


@pytest.fixture
def pair(bare_cluster, etcd):
    bare_cluster.start_ha_masters(
        etcd.endpoint, 2, "--etcd-lease-ttl-s", str(TTL), "--recovery-timeout-s", "1", "--metrics", "127.0.0.1:0"
    )
    bare_cluster.etcd = etcd
    bare_cluster.leader = _leader(bare_cluster)
    return bare_cluster


def test_a_following_standby_is_ready_and_only_the_leader_is_leader_ready(pair):
    leader = pair.masters[pair.leader]
    (standby,) = [p for n, p in pair.masters.items() if n != pair.leader]
    assert probe(leader.info["metrics"], "/readyz") == (200, "ready\n")
    assert probe(leader.info["metrics"], "/readyz/leader") == (200, "ready\n")
    assert pair.wait_for(lambda: probe(standby.info["metrics"], "/readyz") == (200, "ready\n"))
    assert probe(standby.info["metrics"], "/readyz/leader") == (503, f"standby; leader={leader.info['address']}\n")

    # etcd frozen: the standby can no longer follow (nor win an election) and says so; the leader steps
    # down after its grace period. Neither is ready; both stay alive.
    pair.etcd.pause()
    try:
        assert pair.wait_for(lambda: probe(standby.info["metrics"], "/readyz")[0] == 503, timeout=4 * TTL + 5)
        code, reason = probe(standby.info["metrics"], "/readyz")
        assert reason.startswith("standby; etcd not heard from for"), reason
        assert pair.wait_for(lambda: probe(leader.info["metrics"], "/readyz/leader")[0] == 503, timeout=4 * TTL + 5)
        assert probe(standby.info["metrics"], "/healthz")[0] == 200
    finally:
        pair.etcd.resume()
    # etcd back: one leader again, and the other follows it
    new_leader = _leader(pair, timeout=20)
    others = [p for n, p in pair.masters.items() if n != new_leader]
    assert pair.wait_for(lambda: probe(others[0].info["metrics"], "/readyz") == (200, "ready\n"), timeout=10)
    assert probe(pair.masters[new_leader].info["metrics"], "/readyz/leader") == (200, "ready\n")
