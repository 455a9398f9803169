"""The master's opt-in history log (`--history-log`): what leaves the tables, and why; nothing when off."""

from __future__ import annotations

import json

from kvtier.master.config import MasterConfig
from kvtier.master.segment_table import HEARTBEAT_EXPIRED
from kvtier.master.state import MasterState
from kvtier.proto.status import Status
from tests.unit.master.test_state import NS, FakeClock, mount, put

KiB = 1 << 10


def make_state(tmp_path, **overrides) -> tuple[MasterState, FakeClock]:
    clock = FakeClock()
    config = MasterConfig(
        cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, put_timeout_s=30.0, **overrides
    ).validate()
    return MasterState(config, clock=clock), clock


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_by_default_writes_nothing(tmp_path):
    state, _ = make_state(tmp_path)
    assert state.history is None


def test_client_removes_are_not_recorded_but_losses_evictions_and_reclaims_are(tmp_path):
    log = tmp_path / "history.jsonl"
    state, clock = make_state(tmp_path, history_log=str(log))
    seg = mount(state, "a", capacity=64 * KiB)
    put(state, "removed", checksum=11)
    assert state.remove(NS, ["removed"]) == [Status.OK]
    put(state, "lost", checksum=22)
    state.put_start(NS, ["abandoned"], [100], 1)
    clock.advance(31)  # past put_timeout_s: the pending put is reclaimed...
    state.heartbeat(seg)
    state.tick()
    clock.advance(11)  # ...and past segment_ttl_s: the segment is expelled with what it held
    state.tick()
    assert seg not in state.segments
    got = [(e["event"], e.get("reason"), e.get("key"), e.get("checksum"), e.get("segment")) for e in events(log)]
    assert got[0][0] == "start"
    assert ("object", "reclaimed", "abandoned", 0, "") in got
    assert ("object", f"segment:{HEARTBEAT_EXPIRED}", "lost", 22, "a") in got
    assert not any(e[2] == "removed" for e in got), "a client's remove is not an event"
    state.history.close()


def test_evictions_name_the_object_and_its_checksum(tmp_path):
    log = tmp_path / "history.jsonl"
    state, _ = make_state(tmp_path, history_log=str(log))
    mount(state, "a", capacity=64 * KiB)
    for i in range(12):  # 12 x 8 KiB into 64 KiB: allocations evict the oldest
        put(state, f"k{i}", size=8 * KiB, checksum=100 + i)
    evicted = [e for e in events(log) if e["event"] == "object" and e["reason"].startswith("evicted:")]
    assert evicted, "a full segment evicts"
    assert all(e["checksum"] == 100 + int(e["key"][1:]) and e["size"] == 8 * KiB for e in evicted)
    assert all(e["ns"] == NS and e["complete"] for e in evicted)
    state.history.close()


def test_the_log_is_bounded_and_says_where_it_stopped(tmp_path):
    log = tmp_path / "history.jsonl"
    state, _ = make_state(tmp_path, history_log=str(log), history_log_max_size="1KiB")
    mount(state, "a", capacity=64 * KiB)
    for i in range(40):
        put(state, f"key-{i}", size=8 * KiB)
    lines = events(log)
    assert log.stat().st_size <= 1024 + 100
    assert lines[-1]["event"] == "truncated"
    assert state.history.dropped > 0
    state.history.close()
