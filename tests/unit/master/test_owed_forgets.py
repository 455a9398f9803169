"""Waits for FORGETs that run out (kvtier.master.commit_wait, kvtier.master.tiering): a segment's tier
worker stalls past the wait, its FORGETs are owed (saved) from then on, and every answer waiting for
them, not only the first whose deadline passed, is answered OK once that save holds, UNAVAILABLE if it
never comes."""

from __future__ import annotations

import asyncio

from kvtier.master.commit_wait import Barrier, CommitWaiter
from kvtier.master.handlers import MasterHandlers
from kvtier.master.recovery import inventory_done
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.test_eviction import NS, KiB, make_state, put
from tests.unit.master.test_state import FakeClock
from tests.unit.master.test_tiering import FakeDisk

OK = Status.OK
TIMEOUT_S = 0.2


def removes_behind_a_stalled_tier() -> tuple[MasterState, CommitWaiter, list[Barrier]]:
    """A segment keeping an index with disk copies of k0..k7; every key removed, each removal's
    barrier (those with a FORGET to wait for); the DRAM notices acknowledged, the FORGETs never."""
    state = make_state(FakeClock(), promote_after_reads=2)
    result = state.mount_segment(
        "unit", "a", "h-a", ["tcp://127.0.0.1:9/a"], 8 * KiB, ssd_capacity=1 << 30, offload=True, inventory=True
    )
    seg = result.segment.segment_id
    inventory_done(state, seg)
    disk = FakeDisk(state, seg)
    for i in range(8):
        put(state, f"k{i}")
    for _ in range(3):
        state.tick()
        disk.complete(disk.poll())
    handlers = MasterHandlers(state, 7)
    waiter = CommitWaiter(handlers, TIMEOUT_S)
    barriers = []
    for i in range(8):
        handlers.Remove(pb.KeysRequest(namespace=NS, keys=[f"k{i}"]))
        barrier = waiter.barrier()
        if barrier is not None and barrier.forgets:
            barriers.append(barrier)
    assert len(barriers) >= 2, "two removes with disk copies"
    state.commits.ack(seg, state.commits.next_seq(seg) - 1)  # its index applied every notice
    state.durable_generation = state.state_generation
    return state, waiter, barriers


def finish_both(save_after_s: float | None) -> list[pb.RemoveResponse]:
    """Two removes' answers, the second's wait begun 50 ms after the first's; the state saved (as
    Roles.save does) `save_after_s` after the start, or never."""
    state, waiter, barriers = removes_behind_a_stalled_tier()

    async def run() -> list[pb.RemoveResponse]:
        async def save_at(t: float) -> None:
            await asyncio.sleep(t)
            state.durable_generation = state.state_generation
            waiter.wake()

        async def answer(delay: float, barrier: Barrier) -> pb.RemoveResponse:
            await asyncio.sleep(delay)
            return await waiter.finish(pb.RemoveResponse(status=OK), barrier)

        saving = [save_at(save_after_s)] if save_after_s is not None else []
        return (await asyncio.gather(answer(0, barriers[0]), answer(0.05, barriers[1]), *saving))[:2]

    return asyncio.run(run())


def test_every_answer_behind_a_stalled_tier_waits_for_the_save_of_its_owed_forget():
    # the first deadline (0.2 s) stalls the segment; the second (0.25 s) finds its FORGET owed already;
    # the save comes at 0.35 s: both OK then, neither before
    assert [a.status for a in finish_both(save_after_s=0.35)] == [OK, OK]


def test_answers_whose_owed_forgets_are_never_saved_are_unavailable():
    assert [a.status for a in finish_both(save_after_s=None)] == [Status.UNAVAILABLE] * 2
