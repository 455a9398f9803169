"""EtcdClient, LeaderElection and MasterLocator against a real etcd (the `etcd` fixture).

Leases are 1 s here (the test etcd's minimum, see tests/etcd.py), so a leader's
belief lasts 0.5 s past its last keep-alive and a crashed leader's key expires
about 1 s after its last one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from kvtier.common.discovery import MasterLocator, leader_key
from kvtier.common.etcd_client import EtcdClient, EtcdError
from kvtier.master.election import LeaderElection
from tests.etcd import EtcdServer, _free_port

TTL_S = 1.0


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll `predicate` until true; return how long it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


class Candidate:
    """A LeaderElection with its callbacks recorded."""

    def __init__(self, etcd: EtcdServer, cluster: str, name: str, **kwargs) -> None:
        self.name = name
        self.address = f"10.0.0.{name[-1]}:5000"
        self.elected: list[int] = []
        self.deposed: list[str] = []
        self.client = EtcdClient(etcd.endpoint, timeout=1.0)
        self.election = LeaderElection(
            self.client,
            cluster,
            {"address": self.address, "fast_endpoint": "", "pid": 1, "name": name},
            ttl_s=kwargs.pop("ttl_s", TTL_S),
            on_elected=self.elected.append,
            on_deposed=self.deposed.append,
            **kwargs,
        )
        self.election.start()

    def close(self, resign: bool = True) -> None:
        self.election.stop(resign=resign)
        self.client.close()


@pytest.fixture
def candidates(etcd: EtcdServer):
    """start(n, cluster="c") -> n running candidates; all stopped at teardown."""
    started: list[Candidate] = []

    def start(n: int, cluster: str = "c", **kwargs) -> list[Candidate]:
        new = [Candidate(etcd, cluster, f"m{len(started) + i}", **kwargs) for i in range(n)]
        started.extend(new)
        return new

    yield start
    for candidate in started:
        candidate.close()


def leaders(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.election.is_leader()]


def the_leader(candidates: list[Candidate], timeout: float = 3.0) -> Candidate:
    wait_for(lambda: len(leaders(candidates)) == 1, timeout, "exactly one leader")
    return leaders(candidates)[0]


# ------------------------------------------------------------------ EtcdClient


def test_client_keys(etcd: EtcdServer):
    with EtcdClient(etcd.url) as client:
        assert client.get("/t/a") is None
        first = client.put("/t/a", b"1")
        second = client.put("/t/b", b"2")
        assert second > first
        value = client.get("/t/a")
        assert value is not None and (value.value, value.create_revision, value.mod_revision) == (b"1", first, first)
        assert client.put("/t/a", b"1bis") > second
        assert client.get("/t/a").create_revision == first  # a rewrite keeps the creation revision
        client.put("/t0", b"outside the prefix")
        assert [(k, v.value) for k, v in client.get_prefix("/t/")] == [("/t/a", b"1bis"), ("/t/b", b"2")]
        assert client.delete("/t/a") and not client.delete("/t/a")
        assert client.delete_prefix("/t/") == 1
        assert client.get_prefix("/t/") == [] and client.get("/t0") is not None


def test_client_create_leases_and_owner_writes(etcd: EtcdServer):
    with EtcdClient(etcd.endpoint) as client:
        lease = client.grant(1)
        won, mine = client.create("/lock", b"me", lease)
        assert won and mine.lease == lease and mine.value == b"me"
        assert client.get("/lock").create_revision == mine.create_revision
        won, holder = client.create("/lock", b"you", 0)
        assert not won and holder == client.get("/lock") and holder.value == b"me"

        assert client.put_if_owner("/lock", b"me, updated", lease)
        assert not client.put_if_owner("/lock", b"usurper", lease + 1)
        assert not client.put_if_owner("/missing", b"x", lease)  # never creates
        assert client.get("/lock").value == b"me, updated" and client.get("/missing") is None

        assert client.keepalive(lease) >= 1
        assert client.keepalive(lease) >= 1  # same stream, second round trip
        assert client.time_to_live(lease) >= 0

        assert client.revoke(lease)
        assert client.get("/lock") is None  # revoking deletes the lease's keys at once
        assert not client.revoke(lease)
        assert client.keepalive(lease) == 0
        assert client.time_to_live(lease) == -1


def test_client_lease_expires_without_keepalive(etcd: EtcdServer):
    with EtcdClient(etcd.endpoint) as client:
        lease = client.grant(1)
        client.put("/ephemeral", b"x", lease)
        wait_for(lambda: client.get("/ephemeral") is None, 3.0, "the key to expire with its lease")
        assert client.keepalive(lease) == 0


def test_client_tries_the_next_endpoint(etcd: EtcdServer):
    dead = f"127.0.0.1:{_free_port()}"
    with EtcdClient([dead, etcd.url]) as client:
        assert client.put("/k", b"v") > 0
        assert client.endpoint == etcd.endpoint
        lease = client.grant(1)
        assert client.keepalive(lease) >= 1
    with EtcdClient([etcd.endpoint, dead]) as client:
        lease = client.grant(5)
        etcd.stop()
        with pytest.raises(EtcdError) as excinfo:
            client.get("/k")
        assert dead in str(excinfo.value) or etcd.endpoint in str(excinfo.value)
        with pytest.raises(EtcdError):
            client.keepalive(lease)


def test_client_times_out_on_a_frozen_etcd(etcd: EtcdServer):
    timeout = 0.3
    with EtcdClient(etcd.endpoint, timeout=timeout) as client:
        lease = client.grant(5)
        etcd.pause()
        start = time.monotonic()
        with pytest.raises(EtcdError, match=etcd.endpoint):
            client.get("/k")
        with pytest.raises(EtcdError, match="timed out"):
            client.keepalive(lease)
        # two calls, each given up after `timeout`: bounded by it (with slack for a loaded machine),
        # not by the lease (5 s) or a TCP timeout
        assert time.monotonic() - start < 2 * timeout + 1, "each call gave up after the client's timeout"
        etcd.resume()
        assert client.keepalive(lease) >= 1  # a fresh stream after the timed-out one


# -------------------------------------------------------------- LeaderElection


@pytest.mark.parametrize("n", [2, 3])
def test_exactly_one_leader(candidates, etcd: EtcdServer, n: int):
    group = candidates(n)
    leader = the_leader(group)
    time.sleep(1.5 * TTL_S)  # several keep-alive rounds and standby polls: still the same single leader
    assert leaders(group) == [leader]
    assert leader.elected == [leader.election.epoch] and leader.deposed == []
    with EtcdClient(etcd.endpoint) as client:
        held = client.get(leader_key("c"))
    assert held.create_revision == leader.election.epoch
    assert json.loads(held.value)["address"] == leader.address
    for c in group:
        assert c.election.leader_info()["address"] == leader.address
        if c is not leader:
            assert c.elected == [] and c.election.epoch == 0


def test_resign_hands_over_fast_and_epochs_grow(candidates):
    group = candidates(3)
    epochs = []
    for _ in range(len(group) - 1):
        leader = the_leader(group)
        epochs.append(leader.election.epoch)
        group.remove(leader)
        leader.election.stop(resign=True)
        assert not leader.election.is_leader()
        handover = wait_for(lambda: len(leaders(group)) == 1, 1.5 * TTL_S, "a standby to take over")
        assert handover < TTL_S, "a resignation is not waited out like a crash (the lease's TTL)"
    epochs.append(the_leader(group).election.epoch)
    assert epochs == sorted(set(epochs)) and len(epochs) == 3


def test_crashed_leader_is_replaced_after_its_ttl(candidates):
    group = candidates(2)
    leader = the_leader(group)
    standby = next(c for c in group if c is not leader)
    leader.election.stop(resign=False)  # the lease stays in etcd until it expires, like after a crash
    takeover = wait_for(standby.election.is_leader, TTL_S + 2.0, "the standby to take over")
    assert takeover >= 0.5  # the key had to expire first
    assert standby.election.epoch > leader.election.epoch
    assert standby.election.leader_info()["address"] == standby.address


def test_frozen_etcd_never_yields_two_leaders(candidates, etcd: EtcdServer):
    group = candidates(2)
    old = the_leader(group)
    old_epoch = old.election.epoch
    overlaps: list[list[bool]] = []
    lost_after = None

    def sample_for(seconds: float) -> None:
        nonlocal lost_after
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            states = [c.election.is_leader() for c in group]
            if all(states):
                overlaps.append(states)
            if lost_after is None and not old.election.is_leader():
                lost_after = time.monotonic() - paused_at

    paused_at = time.monotonic()
    etcd.pause()
    sample_for(1.6)  # longer than the TTL: etcd expires the lease as soon as it runs again
    etcd.resume()
    sample_for(2.0)  # the standby takes the key, the old leader gets its failures and campaigns again
    assert overlaps == []
    assert lost_after is not None and lost_after <= TTL_S  # within its grace (0.5 s after the last keep-alive)
    assert old.deposed and "unreachable" in old.deposed[0]
    new = the_leader(group)
    assert new.election.epoch > old_epoch


def test_a_stopped_process_stops_leading_before_any_round_trip(candidates):
    offset = [0.0]
    (candidate,) = candidates(1, clock=lambda: time.monotonic() + offset[0])
    wait_for(candidate.election.is_leader, 3.0, "election")
    epoch = candidate.election.epoch
    offset[0] += TTL_S  # as if SIGSTOPped for a TTL: the monotonic clock moved, nothing else happened
    assert not candidate.election.is_leader()
    # etcd still had the lease alive, so the next keep-alive restores the belief with the same epoch.
    wait_for(candidate.election.is_leader, 2.0, "renewal")
    assert candidate.election.epoch == epoch and candidate.deposed == []


def test_key_taken_by_someone_else_deposes_the_leader(candidates, etcd: EtcdServer):
    (candidate,) = candidates(1)
    wait_for(candidate.election.is_leader, 3.0, "election")
    epoch = candidate.election.epoch
    with EtcdClient(etcd.endpoint) as client:
        client.put(leader_key("c"), json.dumps({"address": "intruder:1"}).encode())  # by hand, no lease
        wait_for(lambda: candidate.deposed, 2.0, "deposal")
        assert "intruder:1" in candidate.deposed[0]
        assert not candidate.election.is_leader()
        assert candidate.election.leader_info() == {"address": "intruder:1"}
        client.delete(leader_key("c"))
    wait_for(candidate.election.is_leader, 2.0, "re-election with a fresh lease")
    assert candidate.election.epoch > epoch and candidate.elected == [epoch, candidate.election.epoch]


def test_update_info_is_published_by_the_leader_only(candidates, etcd: EtcdServer):
    group = candidates(2)
    leader = the_leader(group)
    standby = next(c for c in group if c is not leader)
    assert leader.election.update_info({"address": leader.address, "fast_endpoint": "tcp://x:1"})
    assert not standby.election.update_info({"address": "standby:1"})
    with EtcdClient(etcd.endpoint) as client:
        assert json.loads(client.get(leader_key("c")).value)["fast_endpoint"] == "tcp://x:1"
    # The standby may not have read the key yet (leader_info() None) or still hold the old value.
    seen = lambda: (standby.election.leader_info() or {}).get("fast_endpoint")  # noqa: E731
    wait_for(lambda: seen() == "tcp://x:1", 2.0, "the standby to see the new info")


def test_clusters_elect_independently(candidates, etcd: EtcdServer):
    a = candidates(2, cluster="a")
    b = candidates(2, cluster="b")
    leader_a, leader_b = the_leader(a), the_leader(b)  # one leader in each, not one among all four
    assert leaders(a + b) == [leader_a, leader_b]
    with EtcdClient(etcd.endpoint) as client:
        held_a, held_b = client.get(leader_key("a")), client.get(leader_key("b"))
    assert json.loads(held_a.value)["address"] == leader_a.address
    assert json.loads(held_b.value)["address"] == leader_b.address
    assert (held_a.create_revision, held_b.create_revision) == (leader_a.election.epoch, leader_b.election.epoch)
    for group, leader in ((a, leader_a), (b, leader_b)):
        for c in group:
            # a standby learns the holder at its next poll of etcd: wait for it, then it must be its own
            wait_for(lambda c=c: c.election.leader_info() is not None, 3.0, "each candidate to see a leader")
            assert c.election.leader_info()["address"] == leader.address, "each sees its own cluster's leader"


# ---------------------------------------------------------------- MasterLocator


def test_locator_follows_the_leader_in_etcd(candidates, etcd: EtcdServer):
    locator = MasterLocator(f"etcd://{etcd.endpoint}/c")
    try:
        assert locator.is_multi
        assert locator.address == ""  # no leader elected yet
        group = candidates(2)
        leader = the_leader(group)
        assert locator.refresh() == leader.address
        assert locator.address == leader.address
        group.remove(leader)
        leader.election.stop(resign=True)
        new = the_leader(group)
        wait_for(lambda: locator.refresh() == new.address, 2.0, "the locator to see the new leader")
        start = time.monotonic()
        locator.refresh()
        locator.refresh()
        assert time.monotonic() - start >= 0.1  # consecutive etcd lookups are at least 100 ms apart
        assert locator.refresh(hint="10.9.9.9:1") == "10.9.9.9:1"  # a standby's hint beats etcd
    finally:
        locator.close()


def test_locator_survives_etcd_outage(etcd: EtcdServer):
    with EtcdClient(etcd.endpoint) as client:
        client.put(leader_key("c"), json.dumps({"address": "h:1"}).encode())
    locator = MasterLocator(f"etcd://{etcd.endpoint}/c", timeout=0.3)
    try:
        assert locator.address == "h:1"
        etcd.stop()
        assert locator.refresh() == "h:1"  # keeps its last guess rather than forgetting the master
    finally:
        locator.close()


def test_locator_concurrent_use(candidates, etcd: EtcdServer):
    leader = the_leader(candidates(1))
    locator = MasterLocator(f"etcd://{etcd.endpoint}/c")
    try:
        results: list[str] = []
        threads = [threading.Thread(target=lambda: results.append(locator.refresh())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [leader.address] * 8
    finally:
        locator.close()


def test_a_leader_whose_renewals_always_land_too_late_steps_down_for_a_standby(candidates, etcd: EtcdServer):
    """Renewals that succeed but return after the belief has lapsed (a host so loaded that each etcd round
    trip outlasts the grace period) keep the lease alive in etcd while the leader never serves: without a
    step-down nobody leads for as long as it lasts (CI saw a minute of "not the leader; leader=<itself>")."""
    slow_clock = [0.0]

    def slow() -> float:
        slow_clock[0] += 0.6  # every reading is later: a round trip between two readings outlasts the grace
        return time.monotonic() + slow_clock[0]

    (slow_one,) = candidates(1, clock=slow)
    taken: list[bytes] = []  # the key as first seen: the slow one may give it up again right after

    def took(client: EtcdClient) -> bool:
        if (value := client.get(leader_key("c"))) is not None:
            taken.append(value.value)
        return bool(taken)

    with EtcdClient(etcd.endpoint) as client:
        wait_for(lambda: took(client), 10.0, "the slow candidate to take the key")
    assert json.loads(taken[0])["address"] == slow_one.address
    (healthy,) = candidates(1)
    wait_for(healthy.election.is_leader, 6 * TTL_S, "the healthy standby to lead")
    assert any("too late" in reason for reason in slow_one.deposed)
    assert not slow_one.election.is_leader()


def test_a_state_snapshot_of_an_earlier_leadership_is_never_saved(candidates):
    """EtcdStateStore.save checks the snapshot's own epoch, not only that this process leads now:
    one taken before it lost and won leadership again must not overwrite what the leader in
    between saved (found by review: a shorter direct-read lease could replace a longer one)."""
    from kvtier.master.ha import EtcdLeadership, EtcdStateStore
    from kvtier.master.persist import SavedState

    (candidate,) = candidates(1, cluster="snap")
    leader = the_leader([candidate])
    epoch = leader.elected[-1]
    leadership = EtcdLeadership(leader.election)
    leadership.active_epoch = epoch
    store = EtcdStateStore(leader.client, "snap", leadership)
    store.save(SavedState(epoch=epoch, direct_read_lease_ms=8000))
    with pytest.raises(EtcdError, match="no longer leads"):
        store.save(SavedState(epoch=epoch - 1, direct_read_lease_ms=400))  # a snapshot of an older epoch
    assert store.load() == SavedState(epoch=epoch, direct_read_lease_ms=8000)
