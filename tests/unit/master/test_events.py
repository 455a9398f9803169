"""The event log (kvtier.master.events) and its hooks in MasterState: scenario style, no sockets."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.events import CHECK_EVERY, EventKind, EventLog, Watcher
from kvtier.master.handlers import Leadership, MasterHandlers
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status


class Record:
    """What the log reads of an ObjectRecord."""

    def __init__(self, name: str, size: int = 10) -> None:
        from kvtier.master.records import ObjectState

        self.name, self.size, self.replicas, self.state = name, size, (), ObjectState.COMPLETE


def subscribe(log: EventLog, namespace: str = "", prefix: str = "", since: int = 0, kinds=()) -> Watcher:
    watcher = log.watch(namespace, prefix, since, kinds, lambda: None)
    assert isinstance(watcher, Watcher), watcher
    return watcher


def names(events) -> list[str]:
    return [e.name for e in events]


def test_the_ring_holds_capacity_events_and_older_since_is_missed():
    log = EventLog(capacity=8, watcher_queue=8, max_watchers=4)
    log.stored([Record(f"ns\x00k{i}") for i in range(100)])
    assert log.held == 8 and len(log._ring) == 8 + CHECK_EVERY  # bounded whatever was published
    assert log.oldest == 93
    refused = log.watch("", "", 92, (), lambda: None)
    assert refused[0] == Status.WATCH_MISSED and "seq 93" in refused[1]
    watcher = subscribe(log, since=93)
    assert names(log.take(watcher, 100)) == [f"ns\x00k{i}" for i in range(92, 100)]
    assert log.watch("", "", 102, (), lambda: None)[0] == Status.INVALID_ARGUMENT


def test_filters_by_namespace_prefix_and_kind():
    log = EventLog(capacity=64, watcher_queue=64, max_watchers=4)
    ns_prefix = subscribe(log, "a", "x/")
    any_ns = subscribe(log, "", "x/")
    removals = subscribe(log, kinds=[EventKind.REMOVED])
    log.stored([Record("a\x00x/1"), Record("b\x00x/2"), Record("a\x00y/3"), Record("ab\x00x/4")])
    log.gone(Record("a\x00x/1"), EventKind.REMOVED, "remove")
    assert names(log.take(ns_prefix, 10)) == ["a\x00x/1", "a\x00x/1"]
    assert names(log.take(any_ns, 10)) == ["a\x00x/1", "b\x00x/2", "ab\x00x/4", "a\x00x/1"]
    assert [(e.kind, e.reason) for e in log.take(removals, 10)] == [(EventKind.REMOVED, "remove")]


def test_a_watcher_behind_by_more_than_its_queue_is_cut_a_parked_one_is_not():
    log = EventLog(capacity=1024, watcher_queue=100, max_watchers=4)
    slow, parked = subscribe(log), subscribe(log)
    parked.waiting = True  # caught up and waiting for the next publish
    woken = []
    parked.wake = lambda: woken.append(1)
    log.take(slow, 10)
    log.stored([Record(f"n\x00{i}") for i in range(CHECK_EVERY)])
    assert slow.end is not None and slow.end[0] == Status.WATCH_CUT_SLOW
    assert "last seq handed 0" in slow.end[1] and log.take(slow, 10) == []
    assert parked.end is None and woken == [1]
    assert log.cuts == {"slow": 1}
    assert log.watchers == 2, "a cut stream keeps its slot until its RPC ends"
    log.unwatch(slow)
    assert log.watchers == 1


def test_watchers_are_bounded_and_a_disabled_log_publishes_nothing():
    log = EventLog(capacity=16, watcher_queue=16, max_watchers=1)
    first = subscribe(log)
    assert log.watch("", "", 0, (), lambda: None)[0] == Status.TOO_MANY_WATCHERS
    log.unwatch(first)
    subscribe(log)
    off = EventLog(capacity=0, watcher_queue=1, max_watchers=1)
    off.stored([Record("n\x00k")])
    assert off.next_seq == 1 and off.watch("", "", 0, (), lambda: None)[0] == Status.EVENTS_DISABLED


def test_kinds_match_the_proto():
    assert {k.name: int(k) for k in EventKind} == {
        name: pb.EventKind.Value(name) for name in ("STORED", "REMOVED", "EVICTED", "TIER_CHANGED")
    }


@pytest.fixture
def state() -> MasterState:
    s = MasterState(MasterConfig(cluster_id="unit", events_buffer=64, events_watcher_queue=64))
    s.mount_segment("unit", "seg0", "host-seg0", ["tcp://127.0.0.1:9/seg0"], 1 << 20)
    return s


def put(state: MasterState, keys: list[str], size: int = 100) -> None:
    started = state.put_start("ns", keys, [size] * len(keys), 1)
    assert state.put_end("ns", keys, [0] * len(keys), started.put_id) == [0] * len(keys)


def test_state_publishes_stored_removed_evicted_and_nothing_for_pending(state: MasterState):
    watcher = subscribe(state.events)
    put(state, ["a", "b", "p/1", "p/2"])
    pending = state.put_start("ns", ["never"], [100], 1)
    state.put_revoke("ns", ["never"], pending.put_id)
    state.remove("ns", ["a"])
    state.remove_prefix("ns", "p/")
    state.evict_one(state.record("ns", "b"), "quota")
    got = [(EventKind(e.kind).name, e.name.split("\x00")[1], e.reason) for e in state.events.take(watcher, 100)]
    assert got == [
        ("STORED", "a", "put"),
        ("STORED", "b", "put"),
        ("STORED", "p/1", "put"),
        ("STORED", "p/2", "put"),
        ("REMOVED", "a", "remove"),
        ("REMOVED", "p/1", "remove_prefix"),
        ("REMOVED", "p/2", "remove_prefix"),
        ("EVICTED", "b", "quota"),
    ]


def test_a_standby_refuses_to_stream():
    class Standby(Leadership):
        def is_leader(self) -> bool:
            return False

        def leader(self) -> str:
            return "10.0.0.1:50051"

    handlers = MasterHandlers(MasterState(MasterConfig(cluster_id="t")), epoch=7, leadership=Standby())
    reply = handlers.WatchEvents(pb.WatchEventsRequest())
    assert reply.status == Status.UNAVAILABLE and "leader=10.0.0.1:50051" in reply.error
    assert handlers.take_watcher() is None and handlers.state.events.watchers == 0


def test_new_tables_close_the_old_tables_watchers_and_keep_the_totals():
    from kvtier.master.commit_wait import CommitWaiter
    from kvtier.master.servicer import MasterServicer

    config = MasterConfig(cluster_id="t")
    handlers = MasterHandlers(MasterState(config), epoch=7)
    servicer = MasterServicer(handlers, CommitWaiter(handlers, 1.0))
    assert handlers.WatchEvents(pb.WatchEventsRequest()).status == Status.OK
    watcher = handlers.take_watcher()
    old = handlers.state
    old.events.stored([Record("n\x00k")])
    new = MasterState(config)
    servicer.attach(new)  # what Roles.lead and Roles.stand_by do before swapping the tables
    assert watcher.end is not None and watcher.end[0] == Status.WATCH_CLOSED
    assert new.events.published == {"STORED": 1} and new.events.cuts == {"closed": 1}


def test_a_batch_bigger_than_the_ring_ends_a_parked_watcher_missed_never_with_a_gap():
    log = EventLog(capacity=16, watcher_queue=16, max_watchers=2)
    watcher = subscribe(log)
    watcher.waiting = True  # caught up: not cut as slow
    log.stored([Record(f"n\x00{i}") for i in range(16 + CHECK_EVERY + 1)])
    assert log.take(watcher, 1000) == []
    assert watcher.end is not None and watcher.end[0] == Status.WATCH_MISSED


def test_an_upsert_is_one_stored_event_and_replica_ops_are_told(state: MasterState):
    from kvtier.master.replicas import remove_replicas
    from kvtier.master.state_types import PutOptions

    state.mount_segment("unit", "seg1", "host-seg1", ["tcp://127.0.0.1:9/seg1"], 1 << 20)
    put(state, ["k"])
    watcher = subscribe(state.events)
    started = state.put_start("ns", ["k"], [100], 1, PutOptions(overwrite=True))
    assert state.put_end("ns", ["k"], [7], started.put_id) == [0]
    started = state.put_start("ns", ["two"], [100], 2)
    assert state.put_end("ns", ["two"], [0], started.put_id) == [0]
    assert remove_replicas(state, "ns", ["two"], "seg0", False) == (Status.OK, [Status.OK])
    assert remove_replicas(state, "ns", ["two"], "seg1", True) == (Status.OK, [Status.OK])
    got = [(EventKind(e.kind).name, e.name.split("\x00")[1], e.reason) for e in state.events.take(watcher, 100)]
    assert got == [
        ("STORED", "k", "put"),  # the upsert's new version: once
        ("STORED", "two", "put"),
        ("TIER_CHANGED", "two", "removed:replica"),
        ("REMOVED", "two", "remove:replica"),
    ]


def test_removing_the_last_replica_of_a_leased_key_is_refused_like_remove(state: MasterState):
    from kvtier.master.replicas import remove_replicas
    from kvtier.master.state_types import PutOptions

    started = state.put_start("ns", ["leased"], [100], 1, PutOptions(lease_s=60.0))
    assert state.put_end("ns", ["leased"], [0], started.put_id) == [0]
    assert remove_replicas(state, "ns", ["leased"], "seg0", True) == (Status.OK, [Status.LEASE_HELD])
    assert state.record("ns", "leased") is not None


def test_each_tenant_has_stream_slots_of_its_own():
    log = EventLog(capacity=16, watcher_queue=16, max_watchers=1, max_per_tenant=2)
    alice = [log.watch("", "", 0, (), lambda: None, "alice") for _ in range(2)]
    refused = log.watch("", "", 0, (), lambda: None, "alice")
    assert refused[0] == Status.TOO_MANY_WATCHERS and "events_max_watchers_per_tenant" in refused[1]
    assert isinstance(log.watch("", "", 0, (), lambda: None, "bob"), Watcher)  # another tenant: its own
    operator = log.watch("", "", 0, (), lambda: None)  # the cluster's slots: untouched by tenants
    assert isinstance(operator, Watcher) and log.watchers == 4
    log.unwatch(alice[0])
    assert isinstance(log.watch("", "", 0, (), lambda: None, "alice"), Watcher)
