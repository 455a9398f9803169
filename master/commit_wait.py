"""The wait of PutEnd, Remove and RemovePrefix for the segments' acknowledgements of the commit-log
notices they made (kvtier.master.commits), shared by both doors: `Barrier` (what one answer waits for),
`CommitWaiter` (the asyncio wait) and `CommitPolls` (the segments' long poll of those notices, on
either door: the fast path's framing is how segments poll since issue 19)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.master.commits import PutAcknowledgement
from kvtier.master.gates import DATA
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState
from kvtier.master.sweeps import Removal, wait_done
from kvtier.master.tiering import TierTask
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

# Calls answered only once the segments acknowledged the notices they made (kvtier.master.commits).
WAITING_CALLS = ("PutEnd", "Remove", "RemovePrefix")
LONG_POLL_MAX_S = 30.0  # the longest a segment's poll waits for notices, whatever it asks


@dataclass(slots=True)
class Barrier:
    """What an answer waits for: commit-log notices per segment, FORGETs of disk copies, and the
    saved state covering expulsions (kvtier.master.commits)."""

    notices: dict[int, int]
    forgets: list[TierTask]
    generation: int
    put_ack: PutAcknowledgement | None = None  # a PutEnd's: re-checked once the wait is over

    def done(self, state: MasterState) -> bool:
        return (
            state.commits.acked(self.notices)
            and state.durable_generation >= self.generation
            and all(state.tiering.forgotten(t) for t in self.forgets)
        )


class CommitWaiter:
    """The wait of PutEnd, Remove and RemovePrefix for the segments' acknowledgements
    (kvtier.master.commits).

    Shared by the gRPC servicer and the fast path. One event wakes every
    waiter whenever a segment acknowledges (or leaves, or a save becomes
    durable); each checks its own barrier. A segment that never acknowledges
    is expelled at segment_ttl_s (MasterState.tick), which ends the wait; a
    FORGET not acknowledged by then is no longer waited for (its segment's
    tier worker hangs). Past that, the answer is UNAVAILABLE, never OK.
    """

    def __init__(self, handlers: MasterHandlers, timeout_s: float) -> None:
        self._handlers = handlers
        self._timeout_s = timeout_s
        self._wakeups: set[asyncio.Future] = set()
        self.polls = CommitPolls(handlers)
        self.attach(handlers.state)

    def attach(self, state: MasterState) -> None:
        state.commits.on_ack = self.wake
        state.tiering.on_ack = self.wake
        self.polls.attach(state)

    def wake(self) -> None:
        _wake_all(self._wakeups)

    def barrier(self) -> Barrier | None:
        """After a waiting call's handler ran: what to wait for, or None when nothing is outstanding."""
        handlers = self._handlers
        state = handlers.state
        put_ack, handlers.put_ack = handlers.put_ack, None
        generation = state.state_generation if state.state_generation > state.durable_generation else 0
        barrier = Barrier(state.commits.barrier(), state.tiering.pending_forgets(), generation, put_ack)
        return barrier if barrier.notices or barrier.forgets or generation else None

    async def after_removal(self, reply: Any, removal: Removal) -> Any:
        """RemovePrefix's answer once its sweep removed everything it hides (kvtier.master.sweeps),
        then once the segments acknowledged those removals: a restart never brings them back."""
        state = self._handlers.state
        while not await wait_done(removal, 1.0):
            if self._handlers.state is not state:
                return type(reply)(status=Status.UNAVAILABLE, error="master changed")
        reply.removed = removal.removed
        barrier = self.barrier()
        return reply if barrier is None else await self.finish(reply, barrier)

    async def finish(self, reply: Any, barrier: Barrier) -> Any:
        """Wait for `barrier`, then the reply to send. A master deposed meanwhile answers
        UNAVAILABLE: its commits may not have reached the segments the new leader rebuilds from."""
        handlers = self._handlers
        state = handlers.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        while not barrier.done(state):
            remaining = deadline - loop.time()
            if remaining <= 0:
                state.tiering.forgets_stalled(barrier.forgets)
                if barrier.done(state):
                    break
                missing = sorted(barrier.notices)
                logger.error("acknowledgements missing after %.1fs segments=%s", self._timeout_s, missing)
                return type(reply)(status=Status.UNAVAILABLE, error="segments did not acknowledge; retry")
            await _woken(self._wakeups, remaining)
        if handlers.state is not state or not handlers.leadership.is_leader():
            return type(reply)(status=Status.UNAVAILABLE, error=handlers.refusal(DATA) or "master changed")
        put_ack = barrier.put_ack if isinstance(reply, pb.KeyStatusResponse) else None  # PutEnd's answer only
        if put_ack is not None and (
            lost := put_ack.settle(state.segments, reply.statuses, bool(state.sweeps.dead_segments))
        ):
            # Acknowledged means stored: a segment expelled or replaced during the wait took them.
            handlers.puts_lost += lost
            logger.warning("put not acknowledged: %d keys lost with their segment during PutEnd", lost)
        return reply


class CommitPolls:
    """The long poll of a segment's commit notices (`PollCommits`), for both doors.

    The handler answers at once with what is queued (applying the poll's
    acknowledgement first); a poll that finds nothing waits here until the
    commit log notifies its segment, or `wait_ms`. The acknowledgement a
    PutEnd waits for rides on the segment's next poll, so the whole commit
    round trip is two frames on a connection the segment keeps open.
    """

    def __init__(self, handlers: MasterHandlers) -> None:
        self._handlers = handlers
        self._wakeups: dict[int, set[asyncio.Future]] = {}  # segment id -> its polls waiting

    def attach(self, state: MasterState) -> None:
        """Hook a (new) state's notifications; polls of the old state's segments answer now."""
        for wakeups in self._wakeups.values():
            _wake_all(wakeups)
        self._wakeups.clear()
        state.commits.notify = self.wake

    def wake(self, segment_id: int) -> None:
        wakeups = self._wakeups.get(segment_id)
        if wakeups:
            _wake_all(wakeups)

    def later(self, request: Any, reply: Any) -> Any:
        """After the handler answered `reply`: the coroutine of the long poll's answer, or None when
        `reply` is the answer (notices, a refusal, or no wait asked)."""
        wait_s = min(request.wait_ms / 1000, LONG_POLL_MAX_S)
        if reply.status != Status.OK or reply.offsets or wait_s <= 0:
            return None
        return self._wait(request, reply, wait_s)

    async def poll(self, request: Any) -> Any:
        reply = self._handlers.PollCommits(request)  # applies the acknowledgement at once
        wait = self.later(request, reply)
        return reply if wait is None else await wait

    async def _wait(self, request: Any, reply: Any, wait_s: float) -> Any:
        handlers = self._handlers
        segment_id = request.segment_id
        if not handlers.state.commits.has_notices(segment_id, reply.first_seq - 1):
            wakeups = self._wakeups.setdefault(segment_id, set())
            await _woken(wakeups, wait_s)
            if not wakeups and self._wakeups.get(segment_id) is wakeups:
                del self._wakeups[segment_id]
        request.acked_seq = reply.first_seq - 1
        return handlers.PollCommits(request)


# Waits as bare futures with a timer, not asyncio.wait_for over an Event: every put waits twice (its
# PutEnd, its segment's poll), and wait_for's extra task and callbacks were a measurable share of the
# master's CPU per put (docs/benchmarks.md, issue 19).


async def _woken(wakeups: set[asyncio.Future], timeout_s: float) -> None:
    """Until the next `_wake_all(wakeups)`, or `timeout_s`."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    wakeups.add(future)
    timer = loop.call_later(timeout_s, _settle, future)
    try:
        await future
    finally:
        timer.cancel()
        wakeups.discard(future)


def _wake_all(wakeups: set[asyncio.Future]) -> None:
    for future in list(wakeups):
        _settle(future)
    wakeups.clear()


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
