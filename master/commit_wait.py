"""The wait of PutEnd, Remove and RemovePrefix for the segments' acknowledgements of the commit-log
notices they made (kvtier.master.commits), shared by both doors: `Barrier` (what one answer waits for)
and `CommitWaiter` (the asyncio wait)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.master.commits import PutAcknowledgement
from kvtier.master.gates import DATA
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState
from kvtier.master.tiering import TierTask
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

# Calls answered only once the segments acknowledged the notices they made (kvtier.master.commits).
WAITING_CALLS = ("PutEnd", "Remove", "RemovePrefix")


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
        self._event = asyncio.Event()
        self.attach(handlers.state)

    def attach(self, state: MasterState) -> None:
        state.commits.on_ack = self.wake
        state.tiering.on_ack = self.wake

    def wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def barrier(self) -> Barrier | None:
        """After a waiting call's handler ran: what to wait for, or None when nothing is outstanding."""
        handlers = self._handlers
        state = handlers.state
        put_ack, handlers.put_ack = handlers.put_ack, None
        generation = state.state_generation if state.state_generation > state.durable_generation else 0
        barrier = Barrier(state.commits.barrier(), state.tiering.pending_forgets(), generation, put_ack)
        return barrier if barrier.notices or barrier.forgets or generation else None

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
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except TimeoutError:
                pass
        if handlers.state is not state or not handlers.leadership.is_leader():
            return type(reply)(status=Status.UNAVAILABLE, error=handlers.refusal(DATA) or "master changed")
        put_ack = barrier.put_ack if isinstance(reply, pb.KeyStatusResponse) else None  # PutEnd's answer only
        if put_ack is not None and (lost := put_ack.settle(state.segments, reply.statuses)):
            # Acknowledged means stored: a segment expelled or replaced during the wait took them.
            handlers.puts_lost += lost
            logger.warning("put not acknowledged: %d keys lost with their segment during PutEnd", lost)
        return reply
