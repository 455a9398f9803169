"""WatchEvents and `kvtier events` (issue 21) against real processes: what routers see.

A reader thread drains each stream into a queue, so a test waits for events with a timeout (a
safety net for a hung stream, never a bound on how fast anything is) instead of blocking in
`next()`.
"""

from __future__ import annotations

import gc
import json
import queue
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc import _channel as grpc_channel

from kvtier.client import Client, ConnectError, Event, EventStream, Status, WatchEnded
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from tests.cluster import Cluster
from tests.integration.test_master_ha import ha  # noqa: F401 (the fixture)
from tests.integration.test_metrics import scrape, value

WAIT_S = 20.0  # a stream that says nothing this long is broken


class Reader:
    """Drains an EventStream on a thread: `take(n)` the next n events, `end()` the WatchEnded."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self._queue: queue.Queue[Event | BaseException] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for event in self.stream:
                self._queue.put(event)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            self._queue.put(exc)

    def take(self, count: int) -> list[Event]:
        out = []
        while len(out) < count:
            item = self._queue.get(timeout=WAIT_S)
            if isinstance(item, BaseException):
                raise AssertionError(f"stream ended after {[(e.kind, e.key) for e in out]}: {item!r}")
            out.append(item)
        return out

    def end(self) -> WatchEnded:
        while True:
            item = self._queue.get(timeout=WAIT_S)
            if isinstance(item, WatchEnded):
                return item
            assert isinstance(item, Event), repr(item)

    def quiet(self) -> bool:
        """No event waiting (after a marker event was taken, nothing else arrived before it)."""
        return self._queue.empty()


def kinds_keys(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.kind, e.key) for e in events]


def test_puts_and_removes_stream_in_order_with_consecutive_seqs(cluster: Cluster):
    client = cluster.client()
    reader = Reader(client.watch_events())
    assert client.batch_put(["a", "b", "c"], [b"1" * 100, b"2" * 200, b"3" * 300]) == [0, 0, 0]
    assert client.remove("a")
    assert client.batch_put(["p/1", "p/2"], [b"x", b"y"]) == [0, 0]
    assert client.remove_prefix("p/") == 2
    events = reader.take(8)
    assert kinds_keys(events) == [
        ("stored", "a"),
        ("stored", "b"),
        ("stored", "c"),
        ("removed", "a"),
        ("stored", "p/1"),
        ("stored", "p/2"),
        ("removed", "p/1"),
        ("removed", "p/2"),
    ]
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + 8)), "one seq per event, nothing skipped"
    assert len({e.epoch for e in events}) == 1 and events[0].epoch > 0
    stored_b = events[1]
    assert stored_b.size == 200 and stored_b.tiers == ("dram",) and stored_b.segments[0] in ("seg0", "seg1")
    assert stored_b.namespace == "default" and stored_b.reason == "put"
    assert [e.reason for e in events[3:4] + events[6:]] == ["remove", "remove_prefix", "remove_prefix"]
    assert events[3].tiers == () and events[3].segments == ()
    reader.stream.close()


def test_namespace_prefix_and_kind_filters(cluster: Cluster):
    mine, other = cluster.client(namespace="ns1"), cluster.client(namespace="ns2")
    prefixed = Reader(mine.watch_events("x/"))
    everywhere = Reader(mine.watch_events("x/", all_namespaces=True))
    removals = Reader(mine.watch_events(kinds=["removed"]))
    other.put("x/theirs", b"1")
    mine.put("y/mine", b"2")
    mine.put("x/mine", b"3")
    assert mine.remove("y/mine")
    assert mine.remove("x/mine")
    assert kinds_keys(prefixed.take(2)) == [("stored", "x/mine"), ("removed", "x/mine")]
    got = everywhere.take(3)
    assert [(e.kind, e.namespace, e.key) for e in got] == [
        ("stored", "ns2", "x/theirs"),
        ("stored", "ns1", "x/mine"),
        ("removed", "ns1", "x/mine"),
    ]
    assert kinds_keys(removals.take(2)) == [("removed", "y/mine"), ("removed", "x/mine")]
    # Nothing else was queued for the filtered streams: a marker after everything arrives next.
    mine.put("x/marker", b"4")
    assert kinds_keys(prefixed.take(1)) == [("stored", "x/marker")]
    for reader in (prefixed, everywhere, removals):
        reader.stream.close()


def test_resume_from_since_gets_exactly_the_missed_events(cluster: Cluster):
    client = cluster.client()
    first = Reader(client.watch_events())
    client.put("k0", b"0")
    [seen] = first.take(1)
    first.stream.close()
    assert first.stream.last_seq == seen.seq and first.stream.epoch == seen.epoch
    assert client.batch_put([f"k{i}" for i in range(1, 5)], [b"v"] * 4) == [0] * 4
    assert client.remove("k2")
    resumed = Reader(client.watch_events(since=seen.seq + 1, epoch=seen.epoch))
    events = resumed.take(5)
    assert kinds_keys(events) == [
        ("stored", "k1"),
        ("stored", "k2"),
        ("stored", "k3"),
        ("stored", "k4"),
        ("removed", "k2"),
    ]
    assert [e.seq for e in events] == list(range(seen.seq + 1, seen.seq + 6))
    client.put("k5", b"5")  # and it goes on live after the missed ones
    assert kinds_keys(resumed.take(1)) == [("stored", "k5")]
    resumed.stream.close()
    # A seq of another epoch (a restarted master counts again from 1) is refused, not misread.
    with pytest.raises(WatchEnded) as other_epoch:
        next(iter(client.watch_events(since=seen.seq, epoch=seen.epoch - 1)))
    assert other_epoch.value.status == Status.WATCH_EPOCH_CHANGED and "resync" in other_epoch.value.message
    with pytest.raises(WatchEnded) as no_epoch:
        next(iter(client.watch_events(since=seen.seq)))
    assert no_epoch.value.status == Status.INVALID_ARGUMENT


def test_since_older_than_the_buffer_is_told_the_oldest_seq_held(bare_cluster: Cluster):
    master = bare_cluster.start_master(
        "--events-buffer", "16", "--events-watcher-queue", "16", "--metrics", "127.0.0.1:0"
    )
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    probe = Reader(client.watch_events())
    client.put("first", b"0")
    [first] = probe.take(1)
    probe.stream.close()
    keys = [f"k{i:02d}" for i in range(40)]
    assert client.batch_put(keys, [b"v"] * 40) == [0] * 40
    last = first.seq + 40  # the 40 puts' events follow `first`
    oldest = last - 16 + 1  # the ring holds the last 16 events: its size holds, whatever came before
    with pytest.raises(WatchEnded) as missed:
        next(iter(client.watch_events(since=oldest - 1, epoch=first.epoch)))
    assert missed.value.status == Status.WATCH_MISSED
    assert f"oldest event held, seq {oldest}" in missed.value.message
    held = Reader(client.watch_events(since=oldest, epoch=first.epoch))
    events = held.take(16)
    assert [e.seq for e in events] == list(range(oldest, last + 1))
    assert [e.key for e in events] == keys[-16:]
    client.put("marker", b"m")
    assert kinds_keys(held.take(1)) == [("stored", "marker")], "exactly the held ones, then live"
    samples = scrape(master.info["metrics"])
    assert value(samples, "kvtier_master_events_buffered") == 16, "the ring holds events_buffer, no more"
    assert value(samples, "kvtier_master_events_published_total", kind="STORED") == 42
    assert value(samples, "kvtier_master_event_watchers") == 1
    assert value(samples, "kvtier_master_event_watchers_cut_total", reason="missed") == 1
    held.stream.close()


def test_a_watcher_that_never_reads_is_cut_and_puts_carry_on(bare_cluster: Cluster):
    bare_cluster.start_master("--events-watcher-queue", "64")
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    # The stalled watcher's own connection, with gRPC's window auto-tuning (BDP probes) off: a
    # reader that does not read then takes its 64 KiB initial window and no more, as any reader
    # does once its buffers are full (with probes on, gRPC grows a window to MiBs first).
    channel = grpc.insecure_channel(bare_cluster.master_address, options=[("grpc.http2.bdp_probe", 0)])
    stalled = master_pb2_grpc.MasterStub(channel).WatchEvents(pb.WatchEventsRequest(namespace="default"))
    assert dict(stalled.initial_metadata())["kvtier-epoch"]  # subscribed; from now on not read
    live = Reader(client.watch_events(kinds=["removed"]))
    stem = "k" * 200  # 2000 events of ~250 bytes: 8 times that window
    for batch in range(20):
        keys = [f"{stem}{batch}-{i}" for i in range(100)]
        assert client.batch_put(keys, [b"v"] * 100) == [Status.OK] * 100, "puts never wait for a watcher"
    client.remove(f"{stem}19-99")
    assert kinds_keys(live.take(1)) == [("removed", f"{stem}19-99")], "a watcher that reads is not cut"
    handed = [message for message in stalled]  # now read: what was sent before the cut, then the end
    channel.close()
    end = handed.pop()
    assert end.kind == pb.EVENT_END and end.status == Status.WATCH_CUT_SLOW
    assert "events_watcher_queue 64" in end.error
    assert 0 < len(handed) < 2000 and all(m.kind == pb.STORED for m in handed)
    assert [m.seq for m in handed] == list(range(handed[0].seq, handed[0].seq + len(handed)))
    assert f"last seq handed {handed[-1].seq}: resume with since={handed[-1].seq + 1}" in end.error
    live.stream.close()


def test_eviction_streams_evicted_events_for_objects_stored_before(bare_cluster: Cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "8MiB")
    client = bare_cluster.client()
    reader = Reader(client.watch_events())
    keys = [f"big/{i:02d}" for i in range(16)]  # 16 MiB through an 8 MiB region
    for key in keys:
        client.put(key, bytes(512 << 10) * 2)
    client.put("marker", b"m")
    events = []
    while not events or events[-1].key != "marker":
        events += reader.take(1)
    evicted = [e for e in events if e.kind == "evicted"]
    assert evicted, kinds_keys(events)
    for event in evicted:
        stored_at = next(i for i, e in enumerate(events) if e.kind == "stored" and e.key == event.key)
        assert stored_at < events.index(event), "stored before it is evicted"
        assert event.tiers == () and event.reason in ("watermark", "allocation")
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    still = {e.key for e in events if e.kind == "stored"} - {e.key for e in evicted}
    assert all(client.exists(key) for key in still), "what no event removed is still there"
    reader.stream.close()


def test_offload_to_ssd_streams_tier_changed(bare_cluster: Cluster, tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    bare_cluster.start_master()
    bare_cluster.start_segment(
        "ssd0", "16MiB", "--ssd-dir", str(ssd), "--ssd-size", "256MiB", "--ssd-bucket-size", "4MiB"
    )
    client = bare_cluster.client()
    reader = Reader(client.watch_events(kinds=["tier_changed", "evicted"]))

    def under_watermark() -> bool:
        segment = next(s for s in client.cluster_status().segments if s.name == "ssd0")
        return segment.dram_used <= 0.9 * segment.dram_capacity

    for i in range(24):  # 24 MiB through a 16 MiB region, at a pace offload keeps up with
        client.put(f"obj/{i:02d}", bytes(1 << 20))
        assert bare_cluster.wait_for(under_watermark, timeout=WAIT_S)
    [event] = reader.take(1)
    assert event.kind == "tier_changed" and event.reason == "offloaded", event
    assert "ssd" in event.tiers and set(event.segments) == {"ssd0"}
    reader.stream.close()


def test_kvtier_events_json_lines_and_a_clear_end(cluster: Cluster):
    command = [sys.executable, "-m", "kvtier.cli", "events", "--json", "--master", cluster.master_address]
    proc = subprocess.Popen([*command, "--prefix", "cli/"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = cluster.client()
        # The watcher is subscribed once a put makes it print: put new keys until a line comes.
        warm = iter(range(1 << 20))
        first_line: list[str] = []
        threading.Thread(target=lambda: first_line.append(proc.stdout.readline()), daemon=True).start()
        assert cluster.wait_for(
            lambda: client.put(f"cli/warm{next(warm)}", b"w") or bool(first_line), timeout=WAIT_S
        ), proc.stderr.read() if proc.poll() is not None else "no line"
        first = json.loads(first_line[0])
        assert first["kind"] == "stored" and first["key"].startswith("cli/warm") and first["namespace"] == "default"
        assert set(first) >= {"seq", "epoch", "kind", "namespace", "key", "size", "tiers", "segments", "reason", "time"}
        client.put("other/x", b"o")  # filtered out
        client.put("cli/a", b"aa")
        assert client.remove("cli/a")
        lines = []
        while not lines or (lines[-1]["kind"], lines[-1]["key"]) != ("removed", "cli/a"):
            lines.append(json.loads(proc.stdout.readline()))
        assert [(line["kind"], line["key"]) for line in lines if not line["key"].startswith("cli/warm")] == [
            ("stored", "cli/a"),
            ("removed", "cli/a"),
        ]
        seqs = [first["seq"]] + [line["seq"] for line in lines]
        assert seqs == sorted(seqs)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the normal way to stop following
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        proc.stdout.close()
        proc.stderr.close()
    # Ended by the master: says why, non-zero exit, and a last JSON line to resume from.
    ended = subprocess.run(
        [*command, "--since", "1", "--epoch", str(first["epoch"] - 1)], capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 1
    assert "WATCH_EPOCH_CHANGED" in ended.stderr
    assert json.loads(ended.stdout.splitlines()[-1])["end"] == "WATCH_EPOCH_CHANGED"


def test_kvtier_events_leaves_no_stream_for_the_interpreters_final_collection(cluster: Cluster):
    """An ended stream must be freed while gRPC's threads still run: one left to the collection at
    interpreter exit waits for a lock a frozen gRPC daemon thread may hold, and `kvtier events` hung
    after printing its end (1 run in ~100 under load, seen in CI)."""
    from kvtier.cli.main import main

    def live_streams() -> set[int]:
        return {id(o) for o in gc.get_objects() if isinstance(o, grpc_channel._MultiThreadedRendezvous)}

    gc.collect()
    before = live_streams()
    assert main(["events", "--master", cluster.master_address, "--since", "1", "--epoch", "1"]) == 1
    assert live_streams() - before == set()  # no gc.collect() here: what main() leaves behind


def test_watchers_are_bounded(bare_cluster: Cluster):
    bare_cluster.start_master("--events-max-watchers", "2")
    bare_cluster.start_segment("seg0")
    client: Client = bare_cluster.client()
    a, b = client.watch_events(), client.watch_events()  # each returns once subscribed
    assert a.epoch and b.epoch
    refused = client.watch_events()
    assert refused.epoch == 0
    with pytest.raises(WatchEnded) as ended:
        next(refused)
    assert ended.value.status == Status.TOO_MANY_WATCHERS and "events_max_watchers" in ended.value.message
    a.close()  # its slot is free once the master sees the stream go

    def subscribes() -> bool:
        with client.watch_events() as stream:
            return bool(stream.epoch)

    assert bare_cluster.wait_for(subscribes)
    b.close()


def test_a_master_restart_breaks_the_stream_and_its_seqs_are_refused_after(bare_cluster: Cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    reader = Reader(client.watch_events())
    client.put("before", b"b")
    [seen] = reader.take(1)
    bare_cluster.restart_master()
    broken = reader._queue.get(timeout=WAIT_S)
    assert isinstance(broken, ConnectError), repr(broken)
    assert bare_cluster.wait_for(lambda: client.exists("before"), timeout=WAIT_S), "the segment's objects come back"
    with pytest.raises(WatchEnded) as refused:
        next(client.watch_events(since=seen.seq + 1, epoch=seen.epoch))
    assert refused.value.status == Status.WATCH_EPOCH_CHANGED
    with client.watch_events() as fresh:
        assert fresh.epoch > seen.epoch  # a new epoch: the router resyncs, then follows this stream


def test_a_stopping_master_ends_its_streams_with_the_reason(cluster: Cluster):
    reader = Reader(cluster.client().watch_events())
    cluster.kill(cluster.master, signal.SIGTERM)
    ended = reader.end()
    assert ended.status == Status.WATCH_CLOSED and "stopping" in ended.message


def test_a_tenant_watches_its_own_namespaces_only(bare_cluster: Cluster, tmp_path):
    from tests.integration.test_security import secret_file

    bare_cluster.secret_file = secret_file(tmp_path, "cluster.secret")
    alice = secret_file(tmp_path, "alice.secret", b"a" * 32)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\n')
    bare_cluster.start_master("--tenants-file", str(tenants))
    bare_cluster.start_segment("seg0", "16MiB")
    tenant = Client(bare_cluster.master_address, namespace="alice-1", principal="alice", secret_file=alice, timeout=5.0)
    anonymous = Client(bare_cluster.master_address, namespace="alice-1", timeout=5.0)
    try:
        reader = Reader(tenant.watch_events())
        tenant.put("mine", b"m")
        bare_cluster.client(namespace="bob-1").put("theirs", b"t")
        tenant.put("mine2", b"m")
        assert [(e.namespace, e.key) for e in reader.take(2)] == [("alice-1", "mine"), ("alice-1", "mine2")]
        reader.stream.close()
        for stream in (tenant.watch_events(all_namespaces=True), bare_cluster_watch(tenant, "bob-1")):
            with pytest.raises(WatchEnded) as denied:
                next(stream)
            assert denied.value.status == Status.PERMISSION_DENIED
        with pytest.raises(WatchEnded) as unauthenticated:
            next(anonymous.watch_events())
        assert unauthenticated.value.status == Status.UNAUTHENTICATED
    finally:
        tenant.close()
        anonymous.close()


def bare_cluster_watch(client: Client, namespace: str) -> EventStream:
    """A stream of another namespace's events, asked with `client`'s credentials."""
    saved, client.namespace = client.namespace, namespace
    try:
        return client.watch_events()
    finally:
        client.namespace = saved


def test_a_segment_lost_then_back_streams_removed_then_recovered(bare_cluster: Cluster):
    bare_cluster.start_master()
    segment = bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    client.batch_put(["k1", "k2"], [b"1" * 100, b"2" * 100])
    reader = Reader(client.watch_events())
    segment.popen.send_signal(signal.SIGSTOP)  # silent past its TTL: expelled, its objects lost
    try:
        lost = reader.take(2)
    finally:
        segment.popen.send_signal(signal.SIGCONT)
    assert sorted(kinds_keys(lost)) == [("removed", "k1"), ("removed", "k2")]
    assert {e.reason for e in lost} == {"segment:heartbeat ttl expired"}
    back = reader.take(2)  # it mounts again and its index brings back what nothing touched meanwhile
    assert sorted(kinds_keys(back)) == [("stored", "k1"), ("stored", "k2")]
    assert {e.reason for e in back} == {"recovered"} and {e.segments for e in back} == {("seg0",)}
    assert client.get("k1") == b"1" * 100
    reader.stream.close()


def test_under_ha_only_the_leader_streams_and_a_failover_is_a_new_epoch(ha):  # noqa: F811 (the fixture)
    from kvtier.common.discovery import leader_hint

    leader = ha.masters[ha.leader]
    for name, proc in ha.masters.items():
        if name != ha.leader:  # a standby refuses like every data call, naming the leader
            with grpc.insecure_channel(proc.info["address"]) as channel:
                [end] = list(master_pb2_grpc.MasterStub(channel).WatchEvents(pb.WatchEventsRequest(), timeout=5))
            assert end.kind == pb.EVENT_END and end.status == Status.UNAVAILABLE
            assert leader_hint(end.error) == leader.info["address"]
    client = ha.client()  # etcd://...: finds the leader
    reader = Reader(client.watch_events())
    client.put("k", b"v")
    [stored] = reader.take(1)
    ha.kill(leader)
    broken = reader._queue.get(timeout=WAIT_S)
    assert isinstance(broken, ConnectError | WatchEnded), repr(broken)
    assert ha.wait_for(lambda: client.get("k") == b"v", timeout=WAIT_S), "the new leader serves"
    with pytest.raises(WatchEnded) as refused:
        next(client.watch_events(since=stored.seq + 1, epoch=stored.epoch))
    assert refused.value.status == Status.WATCH_EPOCH_CHANGED


def test_opening_a_stream_to_a_stopped_master_ends_within_the_clients_timeout(cluster: Cluster):
    """A master that accepts the connection but never answers (SIGSTOP): opening the stream waited
    for its first answer forever, though every other call gave up at the client's timeout."""
    import signal
    import time

    from kvtier.proto.errors import KvtierError

    client = cluster.client(timeout=2.0)
    client.exists("warm")  # the channel is connected
    cluster.master.popen.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(KvtierError) as raised:
            client.watch_events()
        assert time.monotonic() - started < 4.0
        assert raised.value.status == Status.TIMEOUT
    finally:
        cluster.master.popen.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_an_open_stream_to_a_master_that_stops_answering_breaks(cluster: Cluster):
    """An open stream whose master stopped answering (SIGSTOP: a frozen host, or one cut off with
    no reset) blocked its reader for good, so a router never went looking for the new leader. The
    client's channels ping while a call is open (gRPC keepalive): an unanswered ping breaks the
    stream (ConnectError, as a restart does) within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS."""
    import signal
    import time

    from kvtier.common.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

    client = cluster.client()
    reader = Reader(client.watch_events())
    client.put("before", b"b")
    reader.take(1)
    cluster.master.popen.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        broken = reader._queue.get(timeout=(KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 15)
        assert isinstance(broken, ConnectError), repr(broken)
        assert time.monotonic() - started < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5
    finally:
        cluster.master.popen.send_signal(signal.SIGCONT)
