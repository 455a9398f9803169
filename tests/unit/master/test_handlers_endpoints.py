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


def test_a_segment_that_judges_mounts_gets_its_session_named_and_keyed_and_an_older_one_gets_neither():
    from kvtier.master.capabilities import Minter
    from kvtier.proto.auth import CapabilityKey, capability_key
    from kvtier.proto.frames import Op, mount_session
    from kvtier.proto.status import Status

    # given a master with a secret, and a new and an older segment mounting on it
    secret = b"s" * 32
    handlers = MasterHandlers(MasterState(MasterConfig(cluster_id="unit").validate()), 7)
    handlers.minter = Minter(secret)
    replies = {}
    for name, sessions in (("new", True), ("old", False)):
        request = pb.MountSegmentRequest(
            name=name, cluster_id="unit", endpoints=[f"tcp://{name}:1"], dram_capacity=MiB, mount_sessions=sessions
        )
        replies[name] = handlers.MountSegment(request)
        assert replies[name].status == Status.OK and replies[name].mount_sessions
    new, old = (replies[n].segment_id for n in ("new", "old"))
    # then answers name the new one's session and no session for the older one
    [e_new, e_old] = endpoints(handlers, new, old)
    assert e_new.session == mount_session(new, 7) and e_old.session == 0
    # and their tags are keyed with the session, or as before sessions (what an older segment checks)
    keys = {
        name: handlers.minter.key(handlers.state.segments[segment_id], 7)
        for name, segment_id in (("new", new), ("old", old))
    }
    before_sessions = CapabilityKey(capability_key(secret, "old", 7, ""))
    assert keys["old"].tag(Op.READ, 1, 0, 64) == before_sessions.tag(Op.READ, 1, 0, 64)
    with_session = CapabilityKey(capability_key(secret, "new", 7, "", mount_session(new, 7)))
    assert keys["new"].tag(Op.READ, 1, 0, 64) == with_session.tag(Op.READ, 1, 0, 64)
