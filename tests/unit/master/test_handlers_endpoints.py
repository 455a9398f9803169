"""The segment endpoints an answer carries (MasterHandlers._endpoints): built once per segment and
kept (session 9), yet always what the tables say now: quarantine, re-mounts, segments gone."""

from __future__ import annotations

from kvtier.master.config import MasterConfig
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2 as pb

MiB = 1 << 20


def mount(state: MasterState, name: str, endpoint: str) -> int:
    return state.mount_segment("unit", name, f"host-{name}", [endpoint], MiB).segment.segment_id


def endpoints(handlers: MasterHandlers, *segment_ids: int) -> list[pb.SegmentEndpoint]:
    return sorted(handlers._endpoints(list(segment_ids)), key=lambda e: e.segment_id)


def test_endpoints_follow_quarantine_remounts_and_departures():
    handlers = MasterHandlers(MasterState(MasterConfig(cluster_id="unit").validate()), 1)
    state = handlers.state
    a, b = mount(state, "a", "tcp://10.0.0.1:1"), mount(state, "b", "tcp://10.0.0.2:1")
    [ea, eb] = endpoints(handlers, a, b, a)  # each segment once
    assert (ea.segment_id, ea.name, ea.host_id, list(ea.endpoints), ea.quarantined) == (
        a,
        "a",
        "host-a",
        ["tcp://10.0.0.1:1"],
        False,
    )
    assert eb.name == "b"

    state.quarantined_ids.add(a)  # clients reported it failing: its answers say so at once
    assert [e.quarantined for e in endpoints(handlers, a, b)] == [True, False]
    state.quarantined_ids.discard(a)
    assert [e.quarantined for e in endpoints(handlers, a)] == [False]

    again = mount(state, "a", "tcp://10.0.0.9:7")  # re-mounted elsewhere: a new record, a new id
    assert again != a and endpoints(handlers, a) == []
    [moved] = endpoints(handlers, again)
    assert list(moved.endpoints) == ["tcp://10.0.0.9:7"]

    state.unmount_segment(b)
    assert endpoints(handlers, b) == []


def test_the_cache_forgets_segments_that_left():
    handlers = MasterHandlers(MasterState(MasterConfig(cluster_id="unit").validate()), 1)
    state = handlers.state
    for i in range(500):  # churn: each segment mounts, answers once, and leaves
        segment_id = mount(state, f"s{i}", f"tcp://10.0.0.1:{i + 1}")
        assert [e.name for e in endpoints(handlers, segment_id)] == [f"s{i}"]
        state.unmount_segment(segment_id)
    assert len(handlers._endpoint_cache) <= 2 * len(state.segments) + 65
