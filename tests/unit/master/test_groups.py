"""Groups, all or none (kvtier.master.groups, issue 21): scenarios on a bare MasterState."""

from __future__ import annotations

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.handlers_segment import fill_notices
from kvtier.master.records import replica_segment
from kvtier.master.recovery import DramObjects, inventory_done, report_dram_objects
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.test_state import FakeClock, mount

NS = "ns"
OK = int(Status.OK)
MISS = int(Status.NOT_FOUND)


@pytest.fixture
def state() -> MasterState:
    config = MasterConfig(
        cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0, put_timeout_s=30.0
    ).validate()
    state = MasterState(config, clock=FakeClock())
    mount(state, "seg0")
    mount(state, "seg1")
    return state


def start(state: MasterState, keys: list[str], size: int = 1000) -> int:
    result = state.put_start(NS, keys, [size] * len(keys), 1)
    assert result.statuses == [OK] * len(keys)
    return result.put_id


def put_group(state: MasterState, keys: list[str]) -> list[int]:
    put_id = start(state, keys)
    return state.groups.put_end(NS, keys, [7] * len(keys), put_id)


def test_a_group_becomes_visible_in_one_step_and_reads_whole(state):
    assert put_group(state, ["kv", "side"]) == [OK, OK]
    assert state.exists(NS, ["kv", "side"])[0] == [True, True]
    assert state.groups.get_replicas(NS, ["side", "kv"]).statuses == [OK, OK]  # any order


def test_a_member_not_pending_revokes_every_member_and_fails_every_key(state):
    put_id = start(state, ["kv", "side"])
    assert state.put_revoke(NS, ["side"], put_id) == [OK]  # its write failed: the writer revoked it
    assert state.groups.put_end(NS, ["kv", "side"], [7, 7], put_id) == [int(Status.NOT_PENDING)] * 2
    assert state.exists(NS, ["kv", "side"])[0] == [False, False]
    assert state.record(NS, "kv") is None  # revoked, not left pending until the put timeout
    assert state.groups.groups_revoked == 1


def test_keys_that_are_not_exactly_the_group_read_as_a_miss_for_every_key(state):
    put_group(state, ["a", "b", "c"])
    assert state.put_start(NS, ["x"], [10], 1).statuses == [OK]
    for keys in (["a", "b"], ["a", "b", "c", "x"], ["a", "b", "b"], ["x"], []):
        result = state.groups.get_replicas(NS, keys)
        assert result.statuses == [MISS] * len(keys), keys
        assert result.replica_counts == [0] * len(keys)


@pytest.mark.parametrize("how", ["remove", "evict", "segment_lost"])
def test_a_member_gone_makes_the_group_a_miss_for_every_member(state, how):
    put_group(state, ["a", "b"])
    record = state.record(NS, "b")
    if how == "remove":
        assert state.remove(NS, ["b"]) == [OK]
    elif how == "evict":
        state.evict_one(record, "test")
    else:
        state.drop_segment(replica_segment(record.replicas[0]), reason="test")
    assert state.groups.get_replicas(NS, ["a", "b"]).statuses == [MISS, MISS]
    if state.record(NS, "a") is not None:  # the others stay ordinary objects
        assert state.get_replicas(NS, ["a"]).statuses == [OK]
    assert len(state.groups) <= 1  # the gone member's entry went with its record


def test_a_member_put_again_alone_is_not_the_member_the_group_was_put_with(state):
    put_group(state, ["a", "b"])
    state.remove(NS, ["b"])
    put_id = start(state, ["b"])
    assert state.put_end(NS, ["b"], [7], put_id) == [OK]
    assert state.groups.get_replicas(NS, ["a", "b"]).statuses == [MISS, MISS]


def test_putting_the_group_again_adopts_members_already_complete(state):
    put_group(state, ["a", "b"])
    state.remove(NS, ["b"])
    assert put_group(state, ["a", "b"]) == [OK, OK]  # "a" was complete: it joins as it is
    assert state.groups.get_replicas(NS, ["a", "b"]).statuses == [OK, OK]
    assert len(state.groups) == 2


def test_a_retried_group_put_end_answers_ok_again(state):
    put_id = start(state, ["a", "b"])
    assert state.groups.put_end(NS, ["a", "b"], [1, 2], put_id) == [OK, OK]
    tag = state.groups.tag_of(state.record(NS, "a"))
    assert state.groups.put_end(NS, ["a", "b"], [1, 2], put_id) == [OK, OK]
    # the same group, not a second one: the id its members' notices named stays theirs
    assert state.groups.tag_of(state.record(NS, "b")) == tag and state.groups.groups_committed == 1
    assert state.groups.put_end(NS, ["a", "b"], [1, 3], put_id) == [int(Status.NOT_PENDING)] * 2


def test_a_key_named_twice_is_refused(state):
    put_id = start(state, ["a"])
    assert state.groups.put_end(NS, ["a", "a"], [1, 1], put_id) == [int(Status.INVALID_ARGUMENT)] * 2
    assert state.record(NS, "a").state.name == "PENDING"


def test_records_adopted_without_a_group_id_are_ungrouped(state):
    """Records adopted with no group id (a disk copy, a member stored before its group was put) are
    new records, never the ones the group was put with, so the group reads as a miss."""
    put_group(state, ["a", "b"])
    fresh = MasterState(state.config, clock=state.clock)
    for name in ("a", "b"):
        old = state.record(NS, name)
        record = type(old)(old.name, old.size, old.replicas, 1, 0.0)
        record.complete(old.checksum)
        fresh.adopt(record)
    assert fresh.groups.get_replicas(NS, ["a", "b"]).statuses == [MISS, MISS]


def test_a_member_lost_before_the_answer_fails_every_key_of_the_group(state):
    """PutEnd answers once the segments acknowledged; a member's segment gone meanwhile fails every
    key of a group, not just that member's (kvtier.master.commits.PutAcknowledgement)."""
    from kvtier.master.commits import PutAcknowledgement

    keys = ["a", "b", "c"]
    put_id = start(state, keys)
    ack = PutAcknowledgement(group=True)
    statuses = state.groups.put_end(NS, keys, [7, 7, 7], put_id, ack.committed)
    assert sorted(i for i, _, _ in ack.committed) == [0, 1, 2]  # numbered in the group's keys
    lost = replica_segment(state.record(NS, "b").replicas[0])
    mounted = {s for s in state.segments if s != lost}
    assert ack.settle(mounted, statuses, sweeping=True) >= 1
    assert statuses == [int(Status.SEGMENT_NOT_FOUND)] * 3


# ---------------------------------------------------------------- rebuilt after a restart (group ids)


def _feed(state: MasterState) -> dict[int, pb.PollCommitsResponse]:
    """Every segment's pending notices as its poll would get them (kvtier.master.handlers_segment)."""
    out = {}
    for segment_id in state.segments:
        notices = state.commits.poll(segment_id, 0, 4096)
        reply = pb.PollCommitsResponse(first_seq=notices.first_seq)
        fill_notices(reply, notices.items, state.clock, state.groups)
        out[segment_id] = reply
    return out


def _inventory(state: MasterState, names: list[str], tags: dict[str, tuple[int, int]]) -> DramObjects:
    """What one segment would report of `names` (complete records of `state`), each with its tag."""
    records = [state.record(NS, name) for name in names]
    n = len(records)
    return DramObjects(
        [NS] * n,
        names,
        [r.size for r in records],
        [r.checksum for r in records],
        [ord(name[0]) * 4096 for name in names],  # ascending across chunks, as an inventory is
        [""] * n,
        [0] * n,
        [0] * n,
        [0] * n,
        [tags.get(name, (0, 0))[0] for name in names],
        [tags.get(name, (0, 0))[1] for name in names],
    )


def _successor(state: MasterState) -> tuple[MasterState, int]:
    """A new incarnation recovering one segment's inventory (the old state's names, one segment)."""
    fresh = MasterState(state.config, clock=state.clock)
    fresh.begin_recovery({"seg0"}, timeout_s=60.0)
    result = fresh.mount_segment("unit", "seg0", "host-seg0", ["tcp://127.0.0.1:9/seg0"], 1 << 20, inventory=True)
    assert result.status == OK, result.error
    return fresh, result.segment.segment_id


def test_a_group_members_commit_notices_name_its_group_and_plain_puts_and_drops_none(state):
    put_group(state, ["kv", "side"])
    put_id = start(state, ["plain"])
    assert state.put_end(NS, ["plain"], [7], put_id) == [OK]
    tags = {}
    for reply in _feed(state).values():
        n = len(reply.names)  # the group columns are empty in a reply naming no group
        for name, drop, group_id, size in zip(
            reply.names, reply.drops, reply.group_ids or [0] * n, reply.group_sizes or [0] * n, strict=True
        ):
            tags[name.partition("\x00")[2]] = (drop, group_id, size)
    group_id = state.groups.tag_of(state.record(NS, "kv"))[0]
    assert group_id and tags["kv"] == tags["side"] == (False, group_id, 2)
    assert tags["plain"] == (False, 0, 0)
    state.remove(NS, ["kv"])
    drops = [
        (name, group_id)
        for reply in _feed(state).values()
        for name, drop, group_id in zip(
            reply.names, reply.drops, reply.group_ids or [0] * len(reply.names), strict=True
        )
        if drop
    ]
    assert drops == [(f"{NS}\x00kv", 0)]


def test_a_successor_forms_the_group_again_once_every_member_is_reported_under_its_id(state):
    put_group(state, ["a", "b", "c"])
    tags = {k: state.groups.tag_of(state.record(NS, k)) for k in "abc"}
    fresh, segment_id = _successor(state)
    assert report_dram_objects(fresh, segment_id, _inventory(state, ["a", "b"], tags)) == [OK, OK]
    assert fresh.groups.get_replicas(NS, ["a", "b", "c"]).statuses == [MISS] * 3  # c not reported yet
    assert report_dram_objects(fresh, segment_id, _inventory(state, ["c"], tags)) == [OK]
    assert fresh.groups.get_replicas(NS, ["c", "a", "b"]).statuses == [OK] * 3
    assert fresh.groups.get_replicas(NS, ["a", "b"]).statuses == [MISS] * 2  # still exactly the group
    assert fresh.groups.groups_rebuilt == 1
    # its members' later notices name the same group, so a third incarnation can form it too
    assert fresh.groups.tag_of(fresh.record(NS, "a")) == tags["a"]


def test_a_group_missing_a_member_or_reported_with_other_counts_is_never_formed(state):
    put_group(state, ["a", "b", "c"])
    tags = {k: state.groups.tag_of(state.record(NS, k)) for k in "abc"}
    group_id = tags["a"][0]
    fresh, segment_id = _successor(state)
    # c was removed before the restart (its drop acknowledged): only a and b come back
    report_dram_objects(fresh, segment_id, _inventory(state, ["a", "b"], tags))
    inventory_done(fresh, segment_id)
    assert fresh.groups.get_replicas(NS, ["a", "b", "c"]).statuses == [MISS] * 3
    assert fresh.groups.get_replicas(NS, ["a", "b"]).statuses == [MISS] * 2
    # a member that leaves while the group forms takes the forming group with it: nothing lingers
    fresh.remove(NS, ["a"])
    assert not fresh.groups._forming and not fresh.groups._forming_of
    # counts that disagree are not one group put
    other, other_id = _successor(state)
    odd = dict(tags, b=(group_id, 2), c=(group_id, 2))
    report_dram_objects(other, other_id, _inventory(state, ["a", "b", "c"], odd))
    assert other.groups.groups_rebuilt == 0
    assert other.groups.get_replicas(NS, ["b", "c"]).statuses == [MISS] * 2


def test_a_successor_forms_a_group_from_disk_copies_and_dram_copies_alike(state):
    """Offloaded members keep their tag in their disk records (kvtier.segment_server.bucket_format,
    version 2): a successor forms the group from a disk inventory, from a DRAM one, or from both."""
    put_group(state, ["a", "b", "c"])
    tags = {k: state.groups.tag_of(state.record(NS, k)) for k in "abc"}
    fresh = MasterState(state.config, clock=state.clock)
    fresh.begin_recovery({"seg0"}, timeout_s=60.0)
    mounted = fresh.mount_segment(
        "unit", "seg0", "host-seg0", ["tcp://127.0.0.1:9/seg0"], 1 << 20, inventory=True, ssd_capacity=1 << 30
    )
    segment_id = mounted.segment.segment_id
    disk = ["a", "b"]
    records = [state.record(NS, k) for k in disk]
    statuses = fresh.tiering.report_disk_objects(
        segment_id, [NS] * 2, disk, [r.size for r in records], [r.checksum for r in records], [1, 2],
        [tags["a"], tags["b"]],
    )  # fmt: skip
    assert statuses == [OK, OK]
    assert fresh.groups.get_replicas(NS, ["a", "b", "c"]).statuses == [MISS] * 3  # c not reported yet
    assert report_dram_objects(fresh, segment_id, _inventory(state, ["c"], tags)) == [OK]
    assert fresh.groups.get_replicas(NS, ["a", "b", "c"]).statuses == [OK] * 3
    assert fresh.groups.groups_rebuilt == 1
    # a copy reported again (a second inventory of the same records) changes nothing
    again = fresh.tiering.report_disk_objects(
        segment_id, [NS], ["a"], [records[0].size], [records[0].checksum], [1], [tags["a"]]
    )
    assert again == [OK] and fresh.groups.groups_rebuilt == 1
    assert fresh.groups.get_replicas(NS, ["a", "b", "c"]).statuses == [OK] * 3


def test_an_offload_of_a_group_member_names_its_group_and_other_tasks_none():
    """PollTierTasks: an OFFLOAD of a member carries its group's tag (kept in its disk record); a plain
    object's carries 0; a batch naming no group has no group columns."""
    from kvtier.master.handlers import MasterHandlers

    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0).validate()
    state = MasterState(config, clock=FakeClock())
    result = state.mount_segment(
        "unit", "ssd", "host", ["tcp://127.0.0.1:9/ssd"], 1 << 20, ssd_capacity=1 << 30, offload=True
    )
    segment = result.segment
    handlers = MasterHandlers(state, 1)
    request = pb.PollTierTasksRequest(segment_id=segment.segment_id, max_tasks=16, epoch=1)
    started = state.put_start(NS, ["plain"], [1000], 1)
    assert state.put_end(NS, ["plain"], [7], started.put_id) == [OK]
    assert state.tiering.offload(state.record(NS, "plain"), segment)
    alone = handlers.PollTierTasks(request)
    assert list(alone.keys) == ["plain"] and not alone.group_ids and not alone.group_sizes
    assert put_group(state, ["kv", "side"]) == [OK, OK]
    group_id, size = state.groups.tag_of(state.record(NS, "kv"))
    for key in ("kv", "side"):
        assert state.tiering.offload(state.record(NS, key), segment)
    started = state.put_start(NS, ["plain2"], [1000], 1)
    assert state.put_end(NS, ["plain2"], [7], started.put_id) == [OK]
    assert state.tiering.offload(state.record(NS, "plain2"), segment)
    statuses = state.tiering.report_disk_objects(segment.segment_id, [NS], ["gone"], [100], [5], [4096])
    assert statuses == [OK] and state.remove(NS, ["gone"]) == [OK]  # a FORGET of its disk copy
    reply = handlers.PollTierTasks(request)
    assert pb.FORGET in reply.kinds
    tags = dict(zip(reply.keys, zip(reply.group_ids, reply.group_sizes, strict=True), strict=True))
    assert tags == {"kv": (group_id, 2), "side": (group_id, 2), "plain2": (0, 0), "gone": (0, 0)} and size == 2
