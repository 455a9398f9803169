"""Quarantine of segments clients report failing (kvtier.master.quarantine): the table on its own,
then through MasterState (placement, replica order, cool-off). Fake clock, no sockets."""

from __future__ import annotations

import logging

import pytest

from kvtier.master import quarantine as q
from kvtier.master.config import MasterConfig
from kvtier.master.quarantine import Quarantine
from kvtier.master.records import replica_segment
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.test_state import NS, FakeClock, mount


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def table(clock: FakeClock, failures: int = 3, reporters: int = 1, window_s: float = 10.0, cooloff_s: float = 30.0):
    return Quarantine(failures, reporters, window_s, cooloff_s, clock)


# ------------------------------------------------------------------ the table


def test_failures_within_the_window_quarantine_and_the_cooloff_ends_it(clock, caplog):
    t = table(clock)
    caplog.set_level(logging.INFO, logger="kvtier.master.quarantine")
    assert not t.report("a", 1, "connect", "c1")
    clock.advance(4)
    assert not t.report("a", 1, "timeout", "c1")
    clock.advance(4)
    assert t.report("a", 1, "transfer", "c1")
    assert t.is_quarantined("a") and t.left_s("a") == 30.0
    assert "segment quarantined name=a" in caplog.text
    clock.advance(29)
    assert t.expire() == [] and t.is_quarantined("a")
    clock.advance(1)
    assert t.expire() == ["a"] and not t.is_quarantined("a") and t.left_s("a") == 0.0
    assert "segment quarantine over name=a" in caplog.text
    assert t.reported == {("a", "connect"): 1, ("a", "timeout"): 1, ("a", "transfer"): 1}


def test_failures_spread_wider_than_the_window_do_not_quarantine(clock):
    t = table(clock)
    for _ in range(5):
        assert not t.report("a", 1, "connect", "c1")
        clock.advance(6)  # never three within 10 s
    assert not t.is_quarantined("a")


def test_one_report_can_carry_the_whole_count(clock):
    t = table(clock)
    assert t.report("a", 3, "connect", "c1")


def test_distinct_reporters_are_required_when_configured(clock):
    t = table(clock, failures=2, reporters=2)
    assert not t.report("a", 5, "connect", "c1"), "one client alone is not enough"
    assert t.report("a", 1, "connect", "c2")


def test_a_fresh_report_after_the_cooloff_quarantines_again_and_one_during_it_extends_it(clock):
    t = table(clock, failures=1, cooloff_s=5.0)
    assert t.report("a", 1, "connect", "c1")
    clock.advance(3)
    assert t.report("a", 1, "connect", "c1")  # still failing: the cool-off starts again
    assert t.left_s("a") == 5.0
    clock.advance(5)
    assert t.expire() == ["a"]
    assert t.report("a", 1, "timeout", "c1"), "re-entry"
    assert t.is_quarantined("a")


def test_quarantine_off_counts_reports_but_never_quarantines(clock):
    t = table(clock, failures=0)
    assert not t.report("a", 100, "connect", "c1")
    assert not t.is_quarantined("a") and t.reported[("a", "connect")] == 100


def test_unknown_kinds_are_counted_as_other(clock):
    t = table(clock)
    t.report("a", 1, "x" * 1000, "c1")
    assert t.reported == {("a", "other"): 1}


def test_memory_stays_bounded_with_many_segments_and_reports(clock, monkeypatch):
    monkeypatch.setattr(q, "MAX_SEGMENTS", 64)
    monkeypatch.setattr(q, "MAX_COUNTERS", 128)
    t = table(clock, failures=1000)  # never quarantines: every track is droppable
    for i in range(10_000):
        t.report(f"seg{i}", 1, q.KINDS[i % 3], f"c{i}")
    assert len(t._tracks) <= 64
    assert len(t.reported) <= 128
    t2 = table(clock, failures=1)
    for i in range(1000):
        t2.report(f"seg{i}", 1, "connect", "c")
    assert len(t2._tracks) <= 65 and len(set(t2.names)) <= 65, "even when all are quarantined"
    for _ in range(q.MAX_EVENTS * 4):
        t.report("hot", 1, "connect", "c")
    assert len(t._tracks["hot"].events) == q.MAX_EVENTS
    clock.advance(3600)
    t.expire()
    t2.expire()
    assert not t._tracks and not t2._tracks and not list(t2.names), "idle tracks are forgotten"


# ------------------------------------------------------------------ through MasterState


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(
        cluster_id="unit", quarantine_failures=1, quarantine_window_s=10.0, quarantine_cooloff_s=20.0
    ).validate()
    return MasterState(config, clock=clock)


def cool_off(state: MasterState, clock: FakeClock) -> None:
    """The cool-off passes; the segments heartbeat meanwhile (they are alive, only cut from clients)."""
    clock.advance(state.config.quarantine_cooloff_s)
    for segment_id in state.segments:
        state.heartbeat(segment_id)
    state.tick()


def placed_on(state: MasterState, key: str, size: int = 1000, **options) -> list[int] | None:
    replicas = options.pop("replicas", 1)
    started = state.put_start(NS, [key], [size], replicas, PutOptions(**options))
    if started.statuses != [Status.OK]:
        return None
    state.put_end(NS, [key], [7], started.put_id)
    return list(started.replica_segments)


def test_a_quarantined_segment_takes_new_objects_only_where_no_other_can(state, clock):
    a, b = mount(state, "a"), mount(state, "b")
    assert placed_on(state, "k0", preferred_segment="a") == [a]
    assert state.report_segment_failures([("a", 1, "connect")], "c1") == ["a"]
    assert placed_on(state, "k1", preferred_segment="a") == [b]
    # b full of objects that cannot be evicted (hard-pinned): a is the last resort, not refused
    assert placed_on(state, "big", size=state.segments[b].capacity - 4096, pin=2) == [b]
    assert placed_on(state, "k2", size=8192) == [a]
    cool_off(state, clock)
    assert placed_on(state, "k3", preferred_segment="a") == [a], "placed on again after the cool-off"


def test_a_quarantined_segment_is_passed_over_even_when_the_others_must_evict(state, clock):
    mount(state, "a", capacity=1 << 20)
    b = mount(state, "b", capacity=1 << 20)
    for i in range(4):  # b full of evictable objects
        assert placed_on(state, f"b{i}", size=256 << 10, preferred_segment="b") == [b]
    state.report_segment_failures([("a", 1, "timeout")], "c1")
    assert placed_on(state, "new", size=256 << 10) == [b], "evicting on b beats a put that would hang on a"


def test_a_writer_avoids_the_segments_it_just_failed_on(state):
    a, b = mount(state, "a"), mount(state, "b")
    assert placed_on(state, "k0", preferred_segment="a", avoid_segments=frozenset({"a"})) == [b]
    assert placed_on(state, "k1", preferred_segment="a") == [a], "only that put: the master heard no report"


def test_replicas_on_a_quarantined_segment_are_listed_last_for_reads(state, clock):
    a, b = mount(state, "a"), mount(state, "b")
    assert placed_on(state, "k", replicas=2, preferred_segment="a") == [a, b]
    assert state.get_replicas(NS, ["k"]).replica_segments == [a, b]
    state.report_segment_failures([("a", 2, "transfer")], "c1")
    assert state.get_replicas(NS, ["k"]).replica_segments == [b, a]
    cool_off(state, clock)
    assert state.get_replicas(NS, ["k"]).replica_segments == [a, b]


def test_a_drain_moves_objects_to_other_segments_before_a_quarantined_one(state):
    a, b, c = mount(state, "a"), mount(state, "b"), mount(state, "c")
    assert placed_on(state, "x", preferred_segment="a") == [a]
    placed_on(state, "fill-c", size=4096, preferred_segment="c")  # c the fuller: freest-first would pick b
    state.report_segment_failures([("b", 1, "connect")], "c1")
    assert state.drainer.drain("a", finish=False)[0] == Status.OK
    status, batch = state.drainer.migrate_start("a", 10)
    targets = [replica_segment(item.target) for item in batch.items]
    assert status == Status.OK and targets == [c] and b not in targets


def test_reports_about_segments_not_mounted_are_ignored(state):
    mount(state, "a")
    assert state.report_segment_failures([("ghost", 5, "connect")], "c1") == []
    assert not state.quarantine.is_quarantined("ghost") and not state.quarantine.reported


def test_a_remounted_segment_stays_in_quarantine_by_name(state):
    mount(state, "a")
    state.report_segment_failures([("a", 1, "connect")], "c1")
    again = mount(state, "a")
    assert state.quarantined_ids == {again}


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("quarantine_failures", -1, "quarantine_failures must be >= 0"),
        ("quarantine_reporters", 0, "quarantine_reporters must be at least 1"),
        ("quarantine_window_s", 0, "quarantine_window_s must be positive"),
        ("quarantine_cooloff_s", -1, "quarantine_cooloff_s must be positive"),
    ],
)
def test_bad_quarantine_options_are_one_line_errors(option, value, message):
    with pytest.raises(ValueError, match=message):
        MasterConfig(cluster_id="unit", **{option: value}).validate()
