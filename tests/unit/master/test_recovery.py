"""Rebuilding a master from segment inventories (kvtier.master.recovery), and the commit log behind them."""

from __future__ import annotations

import math
import random

from kvtier.master.allocator import OffsetAllocator
from kvtier.master.config import MasterConfig
from kvtier.master.records import PIN_HARD, PIN_NONE, PIN_SOFT, TIER_DRAM, replica_segment, replica_tier
from kvtier.master.recovery import DramObjects, inventory_done, report_dram_objects
from kvtier.master.state import MasterState, PutOptions, SegmentState
from kvtier.proto.status import Status
from tests.unit.master.accounting import _INDEXES, assert_consistent, segment_indexes
from tests.unit.master.test_state import FakeClock

OK = Status.OK
MiB = 1 << 20
NS = "ns"


def new_state(clock: FakeClock) -> MasterState:
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0, lease_s=5.0).validate()
    return MasterState(config, clock=clock)


def mount(state: MasterState, name: str, capacity: int = MiB, inventory: bool = False) -> int:
    result = state.mount_segment("unit", name, f"host-{name}", ["tcp://127.0.0.1:9"], capacity, inventory=inventory)
    assert result.status == OK, result.error
    return result.segment.segment_id


def chunk(entries: list[tuple]) -> DramObjects:
    """entries: (key, size, checksum, offset[, instance, rank, pin, pin_ttl_ms])"""
    full = [e + ("", 0, PIN_NONE, 0)[len(e) - 4 :] for e in entries]
    return DramObjects(
        [NS] * len(full),
        [e[0] for e in full],
        [e[1] for e in full],
        [e[2] for e in full],
        [e[3] for e in full],
        [e[4] for e in full],
        [e[5] for e in full],
        [e[6] for e in full],
        [e[7] for e in full],
    )


def inventory_of(old: MasterState, segment_id: int) -> list[tuple]:
    """What a segment would report: its index (built from the commit log), sorted by offset."""
    index = segment_indexes(old)[segment_id]
    out = []
    for where, (name, size, checksum) in index.items():
        record = old.lookup(name)
        owner = record.owner
        ttl_ms = int((record.pin_until - old.clock()) * 1000) if record.pin == PIN_SOFT else 0
        out.append(
            (
                0 if isinstance(where, str) else where,
                name.partition("\x00")[2],
                size,
                checksum,
                owner.instance if owner else "",
                owner.rank if owner else 0,
                record.pin,
                ttl_ms,
            )
        )
    return [(k, s, c, o, i, r, p, t) for o, k, s, c, i, r, p, t in sorted(out)]


def test_the_allocator_reserves_ranges_in_ascending_order_only():
    allocator = OffsetAllocator(1024, 64)
    assert allocator.reserve_ascending(128, 100)  # 128 aligned bytes
    assert allocator.reserve_ascending(512, 64)
    assert not allocator.reserve_ascending(256, 64), "before the last reserved range"
    assert not allocator.reserve_ascending(520, 64), "overlaps"
    assert not allocator.reserve_ascending(577, 1), "misaligned"
    assert not allocator.reserve_ascending(1024 - 64, 128), "past the end"
    assert allocator.used == 192
    assert sorted(allocator.free_spans()) == [(0, 128), (256, 256), (576, 448)]
    allocator.release(128, 100)
    assert sorted(allocator.free_spans()) == [(0, 512), (576, 448)]


def test_a_master_rebuilt_from_its_segments_indexes_has_the_same_books():
    clock = FakeClock()
    old = new_state(clock)
    ids = [mount(old, name) for name in ("a", "b", "c")]
    old.register_instance("eng", 2, 1, 2 * MiB)
    rng = random.Random(3)
    for i in range(300):
        pin = rng.choice((PIN_NONE, PIN_NONE, PIN_SOFT, PIN_HARD))
        options = PutOptions(instance="eng", rank=i % 2, pin=pin, pin_ttl_s=100)
        size = rng.choice((0, 1, 100, 5000, 20000))
        started = old.put_start(NS, [f"k{i}"], [size], rng.choice((1, 1, 2)), options)
        if started.statuses == [OK] and started.replica_counts[0]:
            old.put_end(NS, [f"k{i}"], [rng.getrandbits(32)], started.put_id)
        if i % 7 == 0:
            old.remove(NS, [f"k{rng.randrange(i + 1)}"])
        clock.advance(0.01)
    old.put_start(NS, ["pending"], [1000], 1)  # never ends: must not come back
    old.tick()
    assert_consistent(old)

    clock.advance(1.0)
    new = new_state(clock)
    new.register_instance("eng", 2, 1, 2 * MiB)
    new.begin_recovery({"a", "b", "c"}, timeout_s=5.0)
    assert not new.serving
    for name, old_id in zip(("a", "b", "c"), ids, strict=True):
        new_id = mount(new, name, inventory=True)
        assert new.segments[new_id].state is SegmentState.RECOVERING
        entries = inventory_of(old, old_id)
        statuses = report_dram_objects(new, new_id, chunk(entries))
        assert statuses == [OK] * len(entries)
        _INDEXES.setdefault(new, {})[new_id] = dict(segment_indexes(old)[old_id])  # the segment keeps its index
        inventory_done(new, new_id)
    assert new.serving and new.recovery.objects == sum(len(segment_indexes(old)[i]) for i in ids)
    assert_consistent(new)

    def books(state: MasterState) -> dict:
        out = {}
        for record in state.records():
            if record.state.name == "COMPLETE" and any(replica_tier(r) == TIER_DRAM for r in record.replicas):
                names = sorted(state.segments[replica_segment(r)].name for r in record.replicas)
                out[record.name] = (record.size, record.checksum, names, record.pin)
        return out

    assert books(new) == books(old)
    assert new.lookup(f"{NS}\x00pending") is None
    dram_bytes = dict.fromkeys((s.name for s in old.segments.values()), 0)
    for record in old.records():
        if record.state.name == "COMPLETE":
            for replica in record.replicas:
                if replica_tier(replica) == TIER_DRAM:
                    dram_bytes[old.segments[replica_segment(replica)].name] += -(-record.size // 64) * 64
    assert {s.name: s.used for s in new.segments.values()} == dram_bytes, "only complete objects' ranges"
    used_old = {(o.instance, o.rank): (o.used, o.objects) for o in old.quotas.snapshot()}
    used_new = {(o.instance, o.rank): (o.used, o.objects) for o in new.quotas.snapshot()}
    assert used_new == used_old and any(used for used, _ in used_new.values())
    assert all(math.isinf(r.pin_until) for r in new.records() if r.pin == PIN_HARD)
    assert all(r.lease_until >= clock() + 5.0 for r in new.records()), "rebuilt objects start under a lease"


def test_conflicting_inventory_entries_are_refused_and_the_rest_registered():
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a", "b"}, timeout_s=5.0)
    b = mount(state, "b")
    a = mount(state, "a", inventory=True)
    state.recovery.finished_at = None  # b took no inventory: keep recovering for the test's puts
    started = state.put_start(NS, ["pending"], [100], 1)
    assert started.statuses == [OK] and replica_segment(state.lookup(f"{NS}\x00pending").replicas[0]) == b
    statuses = report_dram_objects(
        state,
        a,
        chunk(
            [
                ("x", 100, 1, 0),
                ("y", 100, 2, 64),  # overlaps x's 128 aligned bytes
                ("x", 100, 1, 128),  # x again on the same segment
                ("z", 100, 3, 256),
                ("z", 100, 3, 512),  # second copy of z here
                ("pending", 100, 9, 640),  # a put of it is pending elsewhere
                ("w", 100, 4, 1 << 30),  # out of the region
            ]
        ),
    )
    assert statuses == [
        OK,
        Status.INVALID_RANGE,
        Status.CHECKSUM_MISMATCH,
        OK,
        Status.CHECKSUM_MISMATCH,
        Status.PUT_IN_PROGRESS,
        Status.INVALID_RANGE,
    ]
    second = report_dram_objects(state, a, chunk([("x", 101, 1, 768)]))
    assert second == [Status.CHECKSUM_MISMATCH], "known with another size: the master's version wins"
    assert state.segments[a].state is SegmentState.RECOVERING
    assert state.put_start(NS, ["new"], [100], 1).replica_segments == [b], "no allocation on a recovering segment"
    inventory_done(state, a)
    assert state.segments[a].state is SegmentState.ACTIVE
    assert report_dram_objects(state, a, chunk([("late", 1, 1, 900)])) == [Status.INVALID_ARGUMENT]


def test_recovery_ends_when_the_expected_segments_are_back_or_at_the_timeout():
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a", "b"}, timeout_s=3.0)
    assert not state.serving
    inventory_done(state, mount(state, "a", inventory=True))
    assert not state.serving
    clock.advance(3.0)
    state.tick()
    assert state.serving and state.recovery.reported == {"a"}
    fresh = new_state(clock)
    assert fresh.serving, "a first start waits for nobody"


def test_commit_log_barriers_wait_for_every_segment_keeping_an_index_until_acknowledged():
    clock = FakeClock()
    state = new_state(clock)
    a, b = mount(state, "a", inventory=True), mount(state, "b", inventory=True)
    legacy = mount(state, "c")  # keeps no index (mounted without inventory): never waited for
    inventory_done(state, a)
    inventory_done(state, b)
    commits = state.commits
    started = state.put_start(NS, ["k"], [100], 3)
    state.put_end(NS, ["k"], [5], started.put_id)
    barrier = commits.barrier()
    assert set(barrier) == {a, b} and legacy not in barrier
    assert not commits.acked(barrier)
    first = {s: commits.poll(s, 0, 100) for s in barrier}
    assert all(n.first_seq == 1 and len(n.items) == 1 for n in first.values())
    assert len(commits.poll(a, 0, 100).items) == 1, "a lost reply is sent again"
    commits.poll(a, 1, 100)
    assert not commits.acked(barrier), "b has not acknowledged"
    commits.poll(b, 1, 100)
    assert commits.acked(barrier) and commits.barrier() == {}


def test_a_silent_segment_is_expelled_its_name_saved_and_fenced_when_it_mounts_again():
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery(set(), timeout_s=1.0)
    a, b = mount(state, "a", inventory=True), mount(state, "b", inventory=True)
    inventory_done(state, a)
    inventory_done(state, b)
    for segment_id in (a, b):
        state.commits.poll(segment_id, 0, 100)
    started = state.put_start(NS, ["k"], [100], 2)
    state.put_end(NS, ["k"], [5], started.put_id)
    state.remove(NS, ["k"])  # and put again with other bytes: a's drop of the first is a change
    started = state.put_start(NS, ["k"], [100], 2)
    state.put_end(NS, ["k"], [6], started.put_id)
    started = state.put_start(NS, ["kept"], [64], 2)
    state.put_end(NS, ["kept"], [8], started.put_id)  # its commit is about the version that stays
    barrier = state.commits.barrier()
    state.commits.poll(b, 4, 100)  # b acknowledges; a never polls again but keeps heartbeating
    for _ in range(11):
        clock.advance(1.0)
        state.heartbeat(a)
        state.heartbeat(b)
        state.commits.poll(b, 4, 100)
        state.tick()
    assert a not in state.segments, "expelled: silent feed with notices waiting"
    assert state.commits.acked(barrier), "the wait for it ends..."
    assert state.expelled == {"a"} and state.state_generation > state.durable_generation, (
        "...once the expulsion is saved (the server's save sets durable_generation)"
    )
    assert state.record(NS, "k").replicas and all(replica_segment(r) == b for r in state.record(NS, "k").replicas)
    started = state.put_start(NS, ["changed"], [64], 1)
    state.put_end(NS, ["changed"], [7], started.put_id)  # put while a is away
    state.remove(NS, ["changed"])
    again = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], MiB, inventory=True)
    assert not again.discard_index, "this master fenced it: it re-adopts what its fence admits"
    segment_id = again.segment.segment_id
    statuses = report_dram_objects(
        state,
        segment_id,
        chunk([("k", 100, 5, 0), ("changed", 64, 7, 128), ("untouched", 64, 9, 256), ("kept", 64, 8, 384)]),
    )
    assert statuses == [Status.CHECKSUM_MISMATCH, Status.CHECKSUM_MISMATCH, OK, OK], (
        "the drop of k's first version was never acknowledged and 'changed' was put and removed "
        "meanwhile: refused; 'kept' is the version its unacknowledged commit named: one more replica"
    )
    assert state.record(NS, "k").checksum == 6 and len(state.record(NS, "kept").replicas) == 2
    assert state.record(NS, "untouched") is not None and state.record(NS, "changed") is None
    inventory_done(state, segment_id)
    assert state.expelled == set() and state.saved_state_stale and state.fences.get("a") is None


def test_a_segment_away_across_a_master_restart_can_prove_nothing():
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a"}, timeout_s=1.0, expelled={"a"})  # saved by the previous incarnation
    result = state.mount_segment("unit", "a", "host-a", ["tcp://127.0.0.1:9"], MiB, inventory=True)
    assert result.discard_index and result.segment.disk_refused
    statuses = state.tiering.report_disk_objects(result.segment.segment_id, [NS], ["k"], [10], [1], [4096])
    assert statuses == [Status.CHECKSUM_MISMATCH], "its disk copy may be of a key removed meanwhile: tombstoned"
    assert state.record(NS, "k") is None


def test_a_segment_that_missed_the_recovery_returns_through_a_fence_of_what_changed_since():
    """An expected segment not back when the recovery ends is fenced as if this incarnation expelled
    it (and saved as expelled): when it returns, copies of keys changed since are refused, the rest
    re-adopted, DRAM and SSD alike. Without it, its disk copy of a key put again and removed
    meanwhile came back (nothing checked a segment this incarnation had never seen)."""
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a", "b"}, timeout_s=3.0)
    inventory_done(state, mount(state, "a", inventory=True))
    generation = state.state_generation
    clock.advance(3.0)
    state.tick()
    assert state.serving and "b" in state.expelled and state.fences.get("b") is not None
    assert state.state_generation > generation and state.saved_state_stale  # saved before a change answers
    for key in ("removed", "replaced"):
        started = state.put_start(NS, [key], [10], 1)
        assert state.put_end(NS, [key], [2], started.put_id) == [OK]
    assert state.remove(NS, ["removed"]) == [OK]
    result = state.mount_segment("unit", "b", "host-b", ["tcp://127.0.0.1:9"], MiB, inventory=True)
    assert not result.discard_index and not result.segment.disk_refused
    b = result.segment.segment_id
    assert report_dram_objects(state, b, chunk([("in-dram", 10, 1, 0)])) == [OK]
    statuses = state.tiering.report_disk_objects(
        b, [NS] * 3, ["removed", "replaced", "on-disk"], [10] * 3, [1] * 3, [4096, 8192, 12288]
    )
    assert statuses == [Status.CHECKSUM_MISMATCH] * 2 + [OK]
    assert state.record(NS, "removed") is None and state.record(NS, "replaced").checksum == 2
    inventory_done(state, b)
    assert "b" not in state.expelled and state.fences.get("b") is None


def test_dram_inventories_are_taken_only_while_recovering():
    clock = FakeClock()
    state = new_state(clock)
    assert state.mount_segment("unit", "x", "h", ["tcp://h:1"], MiB, inventory=True).discard_index
    state.begin_recovery({"a"}, timeout_s=5.0, expelled={"gone"})
    assert not state.mount_segment("unit", "a", "h", ["tcp://h:1"], MiB, inventory=True).discard_index
    assert state.mount_segment("unit", "gone", "h", ["tcp://h:1"], MiB, inventory=True).discard_index
    late = mount(state, "late", inventory=True)
    state.recovery.finished_at = clock()
    assert report_dram_objects(state, late, chunk([("k", 1, 1, 0)])) == [Status.INVALID_ARGUMENT]


def test_a_moved_object_leaves_the_source_index_only_after_the_target_acknowledged():
    clock = FakeClock()
    state = new_state(clock)
    a, b = mount(state, "a", inventory=True), mount(state, "b", inventory=True)
    for segment_id in (a, b):
        inventory_done(state, segment_id)
        state.commits.poll(segment_id, 0, 100)
    started = state.put_start(NS, ["k"], [100], 1, PutOptions(preferred_segment="a"))
    state.put_end(NS, ["k"], [5], started.put_id)
    state.commits.poll(a, 1, 100)
    record = state.record(NS, "k")
    target = state.segments[b].allocator.allocate(100)
    from kvtier.master.drain import Migration

    state.drainer._finish(Migration(record, record.replicas[0], (b << 50) | target), moved=True)
    assert not state.commits.poll(a, 1, 100).items, "no drop on the source before the target has it"
    assert [drop for _, _, drop in state.commits.poll(b, 0, 100).items] == [False]
    state.commits.poll(b, 1, 100)  # the target acknowledges its commit
    assert [drop for _, _, drop in state.commits.poll(a, 1, 100).items] == [True]


def test_a_segment_already_expelled_that_misses_the_recovery_gets_no_fence_and_proves_nothing():
    """A name saved both as a segment and as expelled (a mounted segment whose owed FORGETs overflowed,
    a crash while an expelled one reported its inventory): an empty fence opened at the recovery's end
    re-adopted its SSD copies, of keys removed in its earlier life among them (review finding)."""
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a", "b"}, timeout_s=3.0, expelled={"b"})
    inventory_done(state, mount(state, "a", inventory=True))
    clock.advance(3.0)
    state.tick()
    assert state.serving and state.fences.get("b") is None
    result = state.mount_segment("unit", "b", "host-b", ["tcp://127.0.0.1:9"], MiB, inventory=True)
    assert result.discard_index and result.segment.disk_refused
    statuses = state.tiering.report_disk_objects(result.segment.segment_id, [NS], ["stale"], [10], [1], [4096])
    assert statuses == [Status.CHECKSUM_MISMATCH] and state.record(NS, "stale") is None


def test_a_segment_still_reporting_when_the_recovery_ends_reports_the_rest_through_a_fence():
    """Mounted, still RECOVERING when recovery_max_s ends the recovery: its disk copies were taken
    unchecked from then on, a key put and removed meanwhile among them (review finding)."""
    clock = FakeClock()
    state = new_state(clock)
    state.begin_recovery({"a", "b"}, timeout_s=3.0, max_s=10.0)
    inventory_done(state, mount(state, "a", inventory=True))
    b = mount(state, "b", inventory=True)
    clock.advance(10.0)
    state.segments[b].last_heartbeat = clock()
    state.tick()
    assert state.serving and state.fences.get("b") is not None
    for key in ("removed", "kept-elsewhere"):
        started = state.put_start(NS, [key], [10], 1)
        assert state.put_end(NS, [key], [2], started.put_id) == [OK]
    assert state.remove(NS, ["removed"]) == [OK]
    assert report_dram_objects(state, b, chunk([("untouched", 10, 1, 0)])) == [OK]
    statuses = state.tiering.report_disk_objects(b, [NS] * 2, ["removed", "on-disk"], [10] * 2, [1] * 2, [4096, 8192])
    assert statuses == [Status.CHECKSUM_MISMATCH, OK]
    inventory_done(state, b)
    assert state.fences.get("b") is None and state.record(NS, "removed") is None
