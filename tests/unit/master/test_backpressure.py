"""Backpressure decisions on a fake clock (kvtier.master.backpressure): which DRAM copies a put may
drop for room, the OFFLOAD_BEHIND answer, offload feeding, drop counters, and the asynchronous wait."""

from __future__ import annotations

import asyncio

from kvtier.master.backpressure import HeldPut, PutWaiter
from kvtier.master.records import PIN_HARD
from kvtier.master.state import PutOptions
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_eviction import NS, KiB, make_state, put, put_status, stored
from tests.unit.master.test_state import FakeClock
from tests.unit.master.test_tiering import FakeDisk, mount_ssd, tiers

OK = Status.OK
BEHIND = Status.OFFLOAD_BEHIND


def full_segment(policy: str = "wait", ssd: int = 1 << 30, offload: bool = True):
    """A 4 KiB segment holding k0..k3 (1 KiB each), none of them on SSD yet."""
    state = make_state(FakeClock(), dram_full_policy=policy)
    seg = mount_ssd(state, "a", 4 * KiB, ssd=ssd, offload=offload)
    for i in range(4):
        put(state, f"k{i}")
    return state, seg


def test_wait_policy_never_drops_a_copy_the_tier_could_take_and_kicks_offload_at_once():
    state, seg = full_segment()
    assert put_status(state, "new") == BEHIND
    assert stored(state) == {"k0", "k1", "k2", "k3"}  # nothing acknowledged was dropped
    # the least recently used object is already queued for offload (the segment's poll was woken)
    assert state.tiering.has_tasks(seg) and "ns\x00k0" in state.tiering.offloading
    disk = FakeDisk(state, seg)
    disk.complete(disk.poll())
    assert put_status(state, "new") == OK  # k0's copy is redundant now: it goes
    assert stored(state) == {"k0", "k1", "k2", "k3", "new"}
    assert not state.pressure.dropped
    assert_consistent(state)


def test_drop_policy_drops_as_before_and_counts_it():
    state, _ = full_segment("drop")
    assert put_status(state, "new") == OK
    assert "k0" not in stored(state)
    assert state.pressure.dropped == {"policy_drop": 1}


def test_offload_failing_falls_back_to_dropping_with_its_reason():
    state, seg = full_segment()
    assert put_status(state, "new") == BEHIND
    disk = FakeDisk(state, seg)
    disk.complete(disk.poll(), Status.NO_SPACE)  # the disk is full: offload pauses
    assert put_status(state, "new") == OK  # the cache does not stall: the old copy goes
    assert state.pressure.dropped == {"offload_failed": 1}


def test_while_offload_is_paused_a_copy_with_an_offload_in_flight_is_not_dropped():
    state = make_state(FakeClock(), offload_in_flight="2KiB")
    seg = mount_ssd(state, "a", 4 * KiB)
    for i in range(4):
        put(state, f"k{i}")
    assert put_status(state, "new") == BEHIND  # queues k0 (in flight: at most a quarter of the segment)
    disk = FakeDisk(state, seg)
    first = disk.poll()
    assert [t.name for t in first] == ["ns\x00k0"]
    state.tiering.offload(state.record(NS, "k1"), state.segments[seg])  # another one queued
    disk.complete(first, Status.NO_SPACE)  # offload pauses
    # k1's offload is still queued: dropping its copy would make it fail the checksum check
    assert put_status(state, "new") == OK
    assert "k1" in stored(state) and "k0" not in stored(state)
    assert state.pressure.dropped == {"offload_failed": 1}


def test_objects_the_tier_refuses_are_not_protected():
    state = make_state(FakeClock())
    seg = mount_ssd(state, "a", 4 * KiB)
    state.segments[seg].ssd_max_object = 512  # nothing here would ever be offloaded
    for i in range(4):
        put(state, f"k{i}")
    assert state.tiering.refusal(state.record(NS, "k0"), state.segments[seg]) == "too_large"
    assert put_status(state, "new") == OK
    assert state.pressure.dropped == {"too_large": 1}


def test_a_segment_without_an_ssd_tier_drops_and_counts_no_ssd_tier():
    state = make_state(FakeClock())
    state.mount_segment("unit", "plain", "host-plain", ["tcp://127.0.0.1:9/plain"], 4 * KiB)
    for i in range(5):
        put(state, f"k{i}")
    assert state.pressure.dropped == {"no_ssd_tier": 1}


def test_no_room_for_other_reasons_stays_no_space():
    state = make_state(FakeClock())
    mount_ssd(state, "a", 4 * KiB)
    for i in range(4):
        put(state, f"k{i}", pin=PIN_HARD)  # never evictable, whatever offload does
    assert put_status(state, "new") == Status.NO_SPACE


def test_offload_feeding_keeps_a_budget_in_flight_and_refills_on_completion():
    state = make_state(FakeClock(), offload_in_flight="2KiB")
    seg = mount_ssd(state, "a", 16 * KiB)
    for i in range(14):  # 87.5%: above the offload watermark
        put(state, f"k{i}")
    state.tick()
    tiering = state.tiering
    assert tiering.offloading_bytes(seg) == 2 * KiB  # min(offload_in_flight, a quarter of the segment)
    disk = FakeDisk(state, seg)
    disk.complete(disk.poll())
    assert tiering.offloading_bytes(seg) == 2 * KiB  # refilled by the completion, not the next tick
    depth, lag = state.pressure.offload_queues()["a"]
    assert depth == 2 and lag == 0.0


def test_offload_starts_at_the_put_end_that_crosses_the_offload_watermark():
    state = make_state(FakeClock())
    seg = mount_ssd(state, "a", 10 * KiB)
    for i in range(8):
        put(state, f"k{i}")  # 80%: not above the offload watermark yet
    assert not state.tiering.has_tasks(seg)
    put(state, "k8")  # 90%: this PutEnd queues the LRU objects' offload, no tick needed
    assert state.tiering.has_tasks(seg) and "ns\x00k0" in state.tiering.offloading


def test_an_offload_ahead_keeps_the_dram_copy_unless_the_watermark_pass_claims_it():
    state = make_state(FakeClock())
    seg = mount_ssd(state, "a", 10 * KiB)
    for i in range(9):
        put(state, f"k{i}")  # 90%: k8's PutEnd queues copies ahead of need (k0..k2: a quarter)
    tiering = state.tiering
    assert tiering.offloading_bytes(seg) == 3 * KiB and tiering.evicting_bytes(seg) == 0
    put(state, "k9")  # 100%: over the high watermark
    state.tick()  # the watermark pass (down to 85%) claims k0 and k1 (LRU): their offloads free room now
    assert tiering.evicting("ns\x00k0") and tiering.evicting("ns\x00k1") and not tiering.evicting("ns\x00k2")
    disk = FakeDisk(state, seg)
    disk.complete(disk.poll())
    dram = [f"k{i}" for i in range(10) if any(t == 0 for _, t in tiers(state, f"k{i}"))]
    assert "k0" not in dram and "k1" not in dram and "k2" in dram  # freed to make room / copied ahead, kept
    assert_consistent(state)


def test_waiter_retries_as_offload_completes_with_the_same_put_id():
    async def scenario():
        state, seg = full_segment()
        handlers = _Handlers(state)
        request = pb.PutStartRequest(namespace=NS, keys=["x", "new"], sizes=[0, KiB], replicas=1)
        result = state.put_start(NS, ["x", "new"], [0, KiB], 1, PutOptions())
        assert result.statuses == [OK, BEHIND]
        held = HeldPut(NS, request, PutOptions(), result, 0.0, wait_s=5.0)
        waiter = handlers.put_waiter
        answer = asyncio.ensure_future(waiter.finish(held))
        await asyncio.sleep(0)
        assert not answer.done()  # waiting, the loop free
        disk = FakeDisk(state, seg)
        disk.complete(disk.poll())  # TierTasksDone wakes it
        reply = await asyncio.wait_for(answer, 5.0)
        assert reply.statuses == [OK, OK] and reply.put_id == result.put_id
        assert list(reply.replica_counts) == [1, 1] and len(reply.replica_segments) == 2
        assert state.put_end(NS, ["x", "new"], [7, 7], result.put_id) == [OK, OK]
        assert sum(state.pressure.waited.counts) == 1

    asyncio.run(scenario())


def test_waiter_fails_the_keys_visibly_past_its_bound():
    async def scenario():
        state, _ = full_segment()
        handlers = _Handlers(state)
        request = pb.PutStartRequest(namespace=NS, keys=["new"], sizes=[KiB], replicas=1, wait_ms=50)
        result = state.put_start(NS, ["new"], [KiB], 1, PutOptions())
        reply = await handlers.put_waiter.finish(HeldPut(NS, request, PutOptions(), result, 0.0, wait_s=0.05))
        assert reply.statuses == [BEHIND] and "put_backpressure_s" in reply.error
        assert state.pressure.failed_keys == 1
        assert "new" not in stored(state)

    asyncio.run(scenario())


class _Handlers:
    """What PutWaiter needs of MasterHandlers: the state, leadership, and the reply builder."""

    class _Leader:
        @staticmethod
        def is_leader() -> bool:
            return True

    def __init__(self, state) -> None:
        self.state = state
        self.leadership = self._Leader()
        self.put_waiter = PutWaiter(self)

    def put_reply(self, request, result, waited_s: float):
        return pb.PutStartResponse(
            status=OK,
            error=result.first_error,
            statuses=result.statuses,
            replica_counts=result.replica_counts,
            replica_segments=result.replica_segments,
            replica_offsets=result.replica_offsets,
            put_id=result.put_id,
        )
