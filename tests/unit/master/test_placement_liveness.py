"""Placement and liveness: a silent segment ranks last, a clock-skewed one takes nothing (fake clock)."""

from __future__ import annotations

import pytest

from kvtier.master.clock_skew import SkewReading
from kvtier.master.config import MasterConfig
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.test_state import NS, FakeClock, mount


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0).validate()
    return MasterState(config, clock=clock)


def placed_on(state: MasterState, key: str, preferred: str = "") -> int | None:
    started = state.put_start(NS, [key], [1000], 1, PutOptions(preferred_segment=preferred))
    if started.statuses != [Status.OK]:
        return None
    return started.replica_segments[0]


def test_a_segment_whose_heartbeats_stopped_ranks_last_even_when_preferred(state, clock: FakeClock):
    a, b = mount(state, "a"), mount(state, "b")
    assert placed_on(state, "k0", preferred="a") == a
    # a goes silent (a cut link, a frozen process) for three heartbeat intervals, b does not
    clock.advance(state.config.segment_suspect_s + 0.1)
    assert state.heartbeat(b) == Status.OK
    assert placed_on(state, "k1", preferred="a") == b, "a put sent to a silent segment hangs"
    # heard again: preferred again
    assert state.heartbeat(a) == Status.OK
    assert placed_on(state, "k2", preferred="a") == a


def test_a_silent_segment_still_takes_what_no_other_segment_can(state, clock: FakeClock):
    a = mount(state, "a")
    clock.advance(state.config.segment_suspect_s + 0.1)
    assert placed_on(state, "k", preferred="a") == a  # ranked last, not excluded: expelled only at the TTL


def test_a_segment_with_a_skewed_clock_takes_no_new_object_until_fixed(state):
    a, b = mount(state, "a"), mount(state, "b")
    state.note_clock_skew(a, SkewReading(30.0, True))
    assert state.segments[a].clock_skewed
    assert placed_on(state, "k0", preferred="a") == b
    state.note_clock_skew(b, SkewReading(-30.0, True))
    assert placed_on(state, "k1", preferred="a") is None, "only skewed segments: nothing to place on"
    state.note_clock_skew(a, SkewReading(0.2, False))
    assert placed_on(state, "k2", preferred="a") == a
    assert state.segments[a].clock_skew_s == 0.2
