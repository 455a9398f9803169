"""Direct reads across master incarnations (docs/architecture.md, "Direct reads"): a segment may
serve under a lease an earlier master granted, also one it can no longer reach to end it; no master
acknowledges a change before every such lease ran out, whatever its own heartbeats."""

from __future__ import annotations

import json
import signal

KiB = 1 << 10


OLD, NEW = b"o" * 4 * KiB, b"n" * 4 * KiB


def _saved_lease_ms(path) -> int | None:
    try:
        return json.loads(path.read_bytes()).get("direct_read_lease_ms")
    except (OSError, ValueError):
        return None


def _get_or_error(client, key):
    try:
        return client.get(key)
    except Exception as exc:  # noqa: BLE001 - an error is as good as a miss here: not the old value
        return exc


def _read_directly_under_a_long_lease(cluster):
    """A first master with an 8 s direct-read lease, saved; `k` (OLD) on seg0, which a reader (the
    one returned) has read from seg0 alone. Returns (the master, the reader, the state file)."""
    cluster.segment_ttl_s, cluster.heartbeat_interval_s = 10.0, 4.0
    first = cluster.start_master()
    cluster.start_segment("seg0")
    writer = cluster.client(transport="tcp", timeout=30.0)
    reader = cluster.client(transport="tcp", timeout=1.0)
    writer.put("k", OLD)
    assert reader.get("k") == OLD and reader.get("k") == OLD  # the second from seg0 alone
    assert reader.stats()["direct_reads"] == 1
    state_file = cluster.state_dir() / "master-state.json"
    assert cluster.wait_for(lambda: _saved_lease_ms(state_file) == 8000)
    return first, reader, state_file


def _overwrite_from_a_master_elsewhere(cluster):
    """The next incarnation at another address (seg0 knows only the old one: it never mounts again,
    so it goes on serving until its lease ends), with a 0.4 s lease of its own; `k` overwritten
    (NEW) through it, on seg1. Returns once the overwrite is acknowledged."""
    cluster.heartbeat_interval_s = 0.2
    cluster.start_master("--recovery-timeout-s", "0.5")
    cluster.start_segment("seg1")
    writer = cluster.client(transport="tcp", timeout=30.0)
    assert cluster.wait_for(lambda: writer.cluster_status().segments, timeout=10)
    writer.upsert("k", NEW)  # acknowledged: from now on no reader may get the old value


def test_a_master_with_a_shorter_lease_waits_out_its_predecessors_before_any_change(bare_cluster):
    """The next master, configured with shorter heartbeats, must not acknowledge a change before the
    lease of the one before ran out: it reads that lease from the saved state."""
    first, reader, state_file = _read_directly_under_a_long_lease(bare_cluster)
    bare_cluster.kill(first, signal.SIGKILL)
    _overwrite_from_a_master_elsewhere(bare_cluster)
    assert _get_or_error(reader, "k") != OLD  # seg0 refuses (its lease ran out), the old master is gone
    # Its own fence passed: what it saves next (seg2's name) is its own lease, not the inherited one.
    bare_cluster.start_segment("seg2")
    assert bare_cluster.wait_for(lambda: _saved_lease_ms(state_file) == 400)


def test_a_master_that_cannot_read_its_state_waits_a_whole_segment_ttl_before_any_change(bare_cluster):
    """It cannot know its predecessor's lease (found by review: it waited its own 0.4 s while a
    segment served under the 8 s lease before it); a lease is at most segment_ttl_s."""
    first, reader, state_file = _read_directly_under_a_long_lease(bare_cluster)
    bare_cluster.kill(first, signal.SIGKILL)
    state_file.write_bytes(b"{not json")  # unreadable (in HA: etcd failing the reads at election)
    _overwrite_from_a_master_elsewhere(bare_cluster)
    assert _get_or_error(reader, "k") != OLD


def test_a_master_whose_saves_fail_grants_no_direct_read_lease(bare_cluster):
    """A lease is granted only once the saved state holds one at least as long (found by review:
    a master whose every save failed granted its own 8 s lease, which the next incarnation, reading
    its predecessor's 0.4 s, did not wait for)."""
    cluster = bare_cluster
    cluster.segment_ttl_s, cluster.heartbeat_interval_s = 10.0, 0.2
    cluster.start_master()
    cluster.start_segment("seg0")
    writer = cluster.client(transport="tcp", timeout=30.0)
    writer.put("k", OLD)
    state_dir = cluster.state_dir()
    state_file = state_dir / "master-state.json"
    assert cluster.wait_for(lambda: _saved_lease_ms(state_file) == 400)
    (state_dir / "master-state.tmp").mkdir()  # every later save fails: its temporary file is a directory
    cluster.heartbeat_interval_s = 4.0  # an 8 s lease
    failing = cluster.restart_master("--recovery-timeout-s", "5")  # same address: seg0 mounts again
    reader = cluster.client(transport="tcp", timeout=1.0)
    assert cluster.wait_for(lambda: _get_or_error(reader, "k") == OLD, timeout=15)
    assert reader.get("k") == OLD  # looked up: seg0 serves no direct read under a lease never saved
    assert reader.stats().get("direct_reads", 0) == 0
    cluster.kill(failing, signal.SIGKILL)
    (state_dir / "master-state.tmp").rmdir()
    _overwrite_from_a_master_elsewhere(cluster)
    assert _get_or_error(reader, "k") != OLD


def test_a_segment_mounted_while_the_masters_saves_failed_serves_direct_reads_once_one_holds(bare_cluster):
    """Granted none at its mount (the save failed), a segment is granted its lease by the first
    heartbeat answer after a save held, without mounting again."""
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("seg0")
    writer = cluster.client(transport="tcp")
    writer.put("k", OLD)
    state_dir = cluster.state_dir()
    assert cluster.wait_for(lambda: _saved_lease_ms(state_dir / "master-state.json") == 400)
    (state_dir / "master-state.tmp").mkdir()  # every save fails while it is there
    cluster.restart_master()  # same address: seg0 mounts again, granted nothing
    reader = cluster.client(transport="tcp", timeout=2.0)
    assert cluster.wait_for(lambda: _get_or_error(reader, "k") == OLD, timeout=15)
    assert reader.get("k") == OLD and reader.stats().get("direct_reads", 0) == 0
    (state_dir / "master-state.tmp").rmdir()  # the master's next tick saves
    assert cluster.wait_for(lambda: reader.get("k") == OLD and reader.stats().get("direct_reads", 0) > 0)
