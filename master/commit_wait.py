"""The wait of PutEnd, Remove and RemovePrefix for the segments' acknowledgements of the commit-log
notices they made (kvtier.master.commits), shared by both doors: `Barrier` (what one answer waits for),
`CommitWaiter` (the asyncio wait) and `CommitPolls` (the segments' long poll of those notices, on
either door: the fast path's framing is how segments poll since issue 19).

Two ways to wait, one meaning. The gRPC door awaits (`finish`, `CommitPolls.poll`: a future and a
timer per wait). The fast path parks its answers instead (`park`, `CommitPolls.park`): no task,
future or coroutine per wait, and it answers them itself right after the handler that completes
them (`flush`): a PutEnd's commit notice goes to the waiting poll before the PutEnd's own wait is
set up, and the acknowledgement on the segment's next poll answers the PutEnd before that poll
waits again (session 9: each put waits twice, and those hops were a fifth of its master time)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.master.auth import current_principal
from kvtier.master.commits import FENCED_RELAY, PutAcknowledgement
from kvtier.master.gates import DATA
from kvtier.master.handlers import MasterHandlers
from kvtier.master.records import ObjectRecord, replica_segment
from kvtier.master.state import MasterState
from kvtier.master.sweeps import Removal, wait_done
from kvtier.master.tier_tasks import TierTask
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

# Calls answered only once the segments acknowledged the notices they made (kvtier.master.commits).
WAITING_CALLS = ("PutEnd", "Remove", "RemovePrefix", "RelayPutEnd")
_PUT_END_ANSWERS = (pb.KeyStatusResponse, pb.RelayPutEndResponse)
LONG_POLL_MAX_S = 30.0  # the longest a segment's poll waits for notices, whatever it asks


@dataclass(slots=True)
class Barrier:
    """What an answer waits for: commit-log notices per segment, FORGETs of disk copies, and the
    saved state covering expulsions (kvtier.master.commits)."""

    notices: dict[int, int]
    forgets: list[TierTask]
    generation: int
    put_ack: PutAcknowledgement | None = None  # a PutEnd's: re-checked once the wait is over
    moves: list[tuple[int, ObjectRecord, int]] | None = None  # a MigrateEnd's targets, likewise
    gone_seen: bool = False  # a segment of `notices` left: `generation` includes the save of that

    def done(self, state: MasterState) -> bool:
        return self.acknowledged(state) and state.durable_generation >= self.generation

    def saving(self, state: MasterState) -> bool:
        """Waiting for a save only (everything else acknowledged or owed)."""
        return self.acknowledged(state) and state.durable_generation < self.generation

    def acknowledged(self, state: MasterState) -> bool:
        """Everything but the save of `generation` (which this may raise)."""
        # The fence as it is now, not as it was when the wait began: a segment dropped during the
        # wait (its notices then count as acknowledged) may serve direct reads until then.
        if state.direct_reads_fenced() or not state.commits.acked(self.notices):
            return False
        if not self.gone_seen and state.commits.any_gone(self.notices):
            # Likewise an expulsion that ended the wait: saved (the next incarnation discards that
            # stale index) before the answer: the save due when the drop is first seen, not a
            # later one for another segment's drop.
            self.gone_seen = True
            self.generation = max(self.generation, state.state_generation)
        for task in self.forgets:
            if not state.tiering.forgotten(task):
                return False
            # Not acknowledged but no longer waited for (its segment stalled or left): owed, and saved
            # before the answer, so the next incarnation refuses that copy (kvtier.master.tiering).
            self.generation = max(self.generation, task.owed_generation)
        return True


Deliver = Callable[[Any], None]  # writes one parked answer (the fast path's connection)


@dataclass(slots=True, eq=False)
class _ParkedAnswer:
    """A fast-path answer waiting for its barrier."""

    reply: Any
    barrier: Barrier
    state: MasterState  # the tables it was made in: another state by the end means UNAVAILABLE
    deadline: float  # loop time
    deliver: Deliver
    extended: bool = False  # its wait ran out once, and it waits for a save only now (`_one_more_wait`)


class CommitWaiter:
    """The wait of PutEnd, Remove and RemovePrefix for the segments' acknowledgements
    (kvtier.master.commits).

    Shared by the gRPC servicer and the fast path. Whenever a segment
    acknowledges (or leaves, or a save becomes durable) every waiter checks
    its own barrier: awaited ones are woken, parked ones checked by `flush`.
    A segment that never acknowledges is expelled at segment_ttl_s
    (MasterState.tick), which ends the wait; a FORGET not acknowledged by
    then is no longer waited for (its segment's tier worker hangs). Past
    that, the answer is UNAVAILABLE, never OK.
    """

    def __init__(self, handlers: MasterHandlers, timeout_s: float) -> None:
        self._handlers = handlers
        self._timeout_s = timeout_s
        self._wakeups: set[asyncio.Future] = set()
        # Parked answers in deadline order (one timeout for all): one timer for the head, not one each.
        self._parked: deque[_ParkedAnswer] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon: asyncio.Handle | None = None
        self._fence_timer: asyncio.TimerHandle | None = None  # a wake once the direct-read fence passed
        self._fence_at = 0.0
        self.polls = CommitPolls(handlers)
        self.attach(handlers.state)

    def attach(self, state: MasterState) -> None:
        if self._fence_timer is not None:  # the old tables' fence: the new ones have their own
            self._fence_timer.cancel()
            self._fence_timer, self._fence_at = None, 0.0
        state.commits.on_ack = self.wake
        state.tiering.on_ack = self.wake
        self.polls.attach(state)

    def wake(self) -> None:
        """Something a barrier waits for happened: awaited waits check now, parked ones at the next
        `flush` (right after a fast-path PollCommits whose acknowledgement caused it, else on the
        next turn of the loop)."""
        _wake_all(self._wakeups)
        if self._parked and self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self.flush, context=_neutral())
        self._wake_after_fence()

    def park(self, reply: Any, barrier: Barrier, deliver: Deliver) -> None:
        """The fast path's `finish`: `deliver` gets the answer once `barrier` is done (at a `flush`),
        or the timeout's answer; never twice, never from inside a handler."""
        loop = asyncio.get_running_loop()
        state = self._handlers.state
        self._parked.append(_ParkedAnswer(reply, barrier, state, loop.time() + self._timeout_s, deliver))
        self._wake_after_fence()
        if self._timer is None:
            self._timer = loop.call_at(self._parked[0].deadline, self._expire, context=_neutral())
        if state.unsaveable and self._flush_soon is None:  # a save it may wait for never comes: say so now
            self._flush_soon = loop.call_soon(self.flush, context=_neutral())

    def flush(self) -> None:
        """Answer every parked answer whose barrier is done, in the order they were parked. Only
        after a `wake` (nothing else completes a barrier; the timeout is `_expire`'s): the fast path
        calls this after every poll, and most polls acknowledge nothing new."""
        handle = self._flush_soon
        if handle is None:
            return
        handle.cancel()
        self._flush_soon = None
        parked = self._parked
        waiting: deque[_ParkedAnswer] = deque()
        done, fenced, refused = [], [], []
        state = self._handlers.state
        fence_ahead = state.direct_reads_fenced()
        for answer in parked:
            if answer.barrier.done(answer.state):
                done.append(answer)
            elif answer.state.never_saved(answer.barrier.generation):
                refused.append(answer)
            elif fence_ahead and isinstance(answer.reply, pb.RelayPutEndResponse):
                # A segment dropped while this relayed PutEnd waited: the fence may outlast the relay's
                # own bound, which would close its link for every put on it. The client sends its
                # PutEnd itself (repeatable), and that one waits.
                fenced.append(answer)
            else:
                waiting.append(answer)
        if done or fenced or refused:
            self._parked = waiting  # before delivering: an answer's connection may park again meanwhile
            for answer in done:
                self._deliver(answer, self._settled)
            for answer in fenced:
                answer.deliver(pb.RelayPutEndResponse(status=Status.UNAVAILABLE, error=FENCED_RELAY))
            for answer in refused:
                answer.deliver(type(answer.reply)(status=Status.NOT_DURABLE, error=answer.state.unsaveable))

    def _wake_after_fence(self) -> None:
        """Nothing else happens when the direct-read fence passes: one timer wakes every wait then,
        armed whenever a wait begins or something wakes them while the fence is ahead (a drop moves
        it: the drop's own wake arms it). A timer that fires a little early (the loop's clock is
        coarser) finds the fence ahead and arms again."""
        state = self._handlers.state
        fence = state.direct_read_fence
        ahead = fence - state.clock()
        if ahead <= 0 or (self._fence_timer is not None and self._fence_at >= fence):
            return
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        self._fence_at = fence
        self._fence_timer = asyncio.get_running_loop().call_later(ahead + 0.002, self._fence_passed, context=_neutral())

    def _fence_passed(self) -> None:
        self._fence_timer = None
        self.wake()

    def _expire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._parked and self._parked[0].deadline <= now:
            answer = self._parked.popleft()
            if not answer.extended and self._one_more_wait(answer.barrier, answer.state):
                answer.extended = True
                answer.deadline = now + self._timeout_s  # the latest: the queue stays in deadline order
                self._parked.append(answer)
                self.wake()  # others' FORGETs on that segment are owed now too
                continue
            self._deliver(answer, self._timed_out)
        if self._parked:
            self._timer = loop.call_at(self._parked[0].deadline, self._expire, context=_neutral())

    def _deliver(self, answer: _ParkedAnswer, outcome: Callable[[Any, Barrier, MasterState], Any]) -> None:
        try:
            reply = outcome(answer.reply, answer.barrier, answer.state)
        except Exception:  # never leave the connection paused: answer, and let the client retry
            logger.exception("waiting for acknowledgements failed")
            reply = type(answer.reply)(status=-1, error="internal error while waiting for acknowledgements")
        answer.deliver(reply)

    @staticmethod
    def _one_more_wait(barrier: Barrier, state: MasterState) -> bool:
        """At an answer's deadline: its FORGETs still unacknowledged are no longer waited for (their
        segment's tier worker stalled: owed from now on, kvtier.master.tiering); whether what is left
        is the save that holds them (or another save): then the answer waits once more, for it."""
        state.tiering.forgets_stalled(barrier.forgets)
        return barrier.saving(state) and not state.unsaveable

    def _timed_out(self, reply: Any, barrier: Barrier, state: MasterState) -> Any:
        state.tiering.forgets_stalled(barrier.forgets)
        if barrier.done(state):
            return self._settled(reply, barrier, state)
        logger.error("acknowledgements missing after %.1fs segments=%s", self._timeout_s, sorted(barrier.notices))
        return type(reply)(status=Status.UNAVAILABLE, error="segments did not acknowledge; retry")

    def barrier(self, every_notice: bool = False) -> Barrier | None:
        """After a waiting call's handler ran: what to wait for, or None when nothing is outstanding.
        The notices and FORGETs about the names the handler dealt with (`barrier_names`), or, with
        `every_notice` (a prefix removal's sweep, done over many loop turns), all of them."""
        handlers = self._handlers
        state = handlers.state
        put_ack, handlers.put_ack = handlers.put_ack, None
        moves, handlers.moves = handlers.moves, None
        relayed_by, handlers.relayed_by = handlers.relayed_by, 0
        names, handlers.barrier_names = None if every_notice else handlers.barrier_names, None
        generation = state.state_generation if state.state_generation > state.durable_generation else 0
        fenced = state.direct_reads_fenced()  # a segment that may serve direct reads was dropped
        forgets = state.tiering.pending_forgets()
        if names is not None and forgets:
            wanted = set(names)
            forgets = [task for task in forgets if task.name in wanted]
        barrier = Barrier(state.commits.barrier(relayed_by, names), forgets, generation, put_ack, moves)
        if barrier.notices or barrier.forgets or generation or fenced:
            return barrier
        if put_ack is not None:
            state.commits.waiting_puts.discard(put_ack)  # answered now
        return None

    async def after_removal(self, reply: Any, removal: Removal) -> Any:
        """RemovePrefix's answer once its sweep removed everything it hides (kvtier.master.sweeps),
        then once the segments acknowledged those removals: a restart never brings them back."""
        state = self._handlers.state
        while not await wait_done(removal, 1.0):
            if self._handlers.state is not state:
                return type(reply)(status=Status.UNAVAILABLE, error="master changed")
        reply.removed = removal.removed
        barrier = self.barrier(every_notice=True)
        return reply if barrier is None else await self.finish(reply, barrier)

    async def finish(self, reply: Any, barrier: Barrier) -> Any:
        """Wait for `barrier`, then the reply to send. A master deposed meanwhile answers
        UNAVAILABLE: its commits may not have reached the segments the new leader rebuilds from."""
        handlers = self._handlers
        state = handlers.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        extended = False
        self._wake_after_fence()
        while not barrier.done(state):
            if state.never_saved(barrier.generation):
                return type(reply)(status=Status.NOT_DURABLE, error=state.unsaveable)
            remaining = deadline - loop.time()
            if remaining <= 0:
                if extended or not self._one_more_wait(barrier, state):
                    return self._timed_out(reply, barrier, state)
                extended = True
                deadline = loop.time() + self._timeout_s
                self.wake()  # others' FORGETs on that segment are owed now too
                continue
            await _woken(self._wakeups, remaining)
        return self._settled(reply, barrier, state)

    def _settled(self, reply: Any, barrier: Barrier, state: MasterState) -> Any:
        """The answer once `barrier` is done: UNAVAILABLE if the master was deposed or its tables
        replaced meanwhile, and a PutEnd's keys whose segment was lost turned SEGMENT_NOT_FOUND."""
        handlers = self._handlers
        if handlers.state is not state or not handlers.leadership.is_leader():
            return type(reply)(status=Status.UNAVAILABLE, error=handlers.refusal(DATA) or "master changed")
        # PutEnd's answer, or a relayed one's (Remove's RemoveResponse has no per-key statuses to settle).
        put_ack = barrier.put_ack if isinstance(reply, _PUT_END_ANSWERS) else None
        if put_ack is not None:
            state.commits.waiting_puts.discard(put_ack)  # answered now: a later drop changes nothing it said
        if put_ack is not None and (
            lost := put_ack.settle(state.segments, reply.statuses, bool(state.sweeps.dead_segments))
        ):
            # Acknowledged means stored: a segment expelled or replaced during the wait took them.
            handlers.puts_lost += lost
            logger.warning("put not acknowledged: %d keys lost with their segment during PutEnd", lost)
            # And told "not stored" means it stays so: the segment may have applied the commit
            # before it was expelled and prove so when it returns (master/fences.py, invariant 4);
            # a changed name is never released from a fence.
            lost_status = int(Status.SEGMENT_NOT_FOUND)
            state.fences.touch_many(
                record.name for i, record, _ in put_ack.committed if reply.statuses[i] == lost_status
            )
        for i, _, target in barrier.moves or ():
            if replica_segment(target) not in state.segments and reply.statuses[i] == Status.OK:
                # The target went before (or right after) acknowledging its copy: a move left the
                # object where it was (kvtier.master.drain), a copy added nothing that stays.
                reply.statuses[i] = int(Status.SEGMENT_NOT_FOUND)
        return reply


@dataclass(slots=True, eq=False)
class _ParkedPoll:
    """A fast-path long poll waiting for its segment's next notice."""

    request: Any  # acked_seq already set to what its first answer applied
    deliver: Deliver
    principal: str  # its connection's: the answer is made as that caller, whoever's call woke it
    timer: asyncio.TimerHandle | None = None  # its wait_ms


class CommitPolls:
    """The long poll of a segment's commit notices (`PollCommits`), for both doors.

    The handler answers at once with what is queued (applying the poll's
    acknowledgement first); a poll that finds nothing waits here until the
    commit log notifies its segment, or `wait_ms`. The acknowledgement a
    PutEnd waits for rides on the segment's next poll, so the whole commit
    round trip is two frames on a connection the segment keeps open.

    gRPC polls await (`poll`); fast-path polls are parked (`park`): a notice
    moves its segment's parked polls to `ready`, and they are answered at the
    next `flush`, which the fast path runs right after the handler that made
    the notice (a PutEnd's commit reaches the segment before the PutEnd's own
    wait is even set up), or else this loop turn. Never from inside the
    state's code that made the notice.
    """

    def __init__(self, handlers: MasterHandlers) -> None:
        self._handlers = handlers
        self._wakeups: dict[int, set[asyncio.Future]] = {}  # segment id -> its polls waiting
        self._parked: dict[int, list[_ParkedPoll]] = {}  # segment id -> its fast-path polls waiting
        self.ready: list[_ParkedPoll] = []  # woken: answered at the next flush()
        self._flush_soon: asyncio.Handle | None = None

    def attach(self, state: MasterState) -> None:
        """Hook a (new) state's notifications; polls of the old state's segments answer now."""
        for wakeups in self._wakeups.values():
            _wake_all(wakeups)
        self._wakeups.clear()
        for polls in self._parked.values():
            self._make_ready(polls)
        self._parked.clear()
        state.commits.notify = self.wake

    def wake(self, segment_id: int) -> None:
        wakeups = self._wakeups.get(segment_id)
        if wakeups:
            _wake_all(wakeups)
        polls = self._parked.pop(segment_id, None)
        if polls:
            self._make_ready(polls)

    def later(self, request: Any, reply: Any) -> Any:
        """After the handler answered `reply`: the coroutine of the long poll's answer, or None when
        `reply` is the answer (notices, a refusal, or no wait asked)."""
        wait_s = _wait_s(request, reply)
        return None if wait_s <= 0 else self._wait(request, reply, wait_s)

    def park(self, request: Any, reply: Any, deliver: Deliver, principal: str) -> bool:
        """The fast path's `later`: True when `deliver` gets the long poll's answer later (after the
        segment's next notice, at a `flush`, or after its wait), False when `reply` is the answer.
        `principal`: the polling connection's, the one its answer is made as (the flush that answers
        it runs after another caller's request, possibly a tenant's)."""
        wait_s = _wait_s(request, reply)
        if wait_s <= 0:
            return False
        segment_id = request.segment_id
        request.acked_seq = reply.first_seq - 1
        poll = _ParkedPoll(request, deliver, principal)
        if self._handlers.state.commits.has_notices(segment_id, request.acked_seq):
            self._make_ready([poll])
            return True
        poll.timer = asyncio.get_running_loop().call_later(wait_s, self._expire, segment_id, poll, context=_neutral())
        self._parked.setdefault(segment_id, []).append(poll)
        return True

    def flush(self) -> None:
        """Answer the polls woken since the last flush."""
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        ready, self.ready = self.ready, []
        for poll in ready:
            if poll.timer is not None:
                poll.timer.cancel()
            poll.deliver(self._answer(poll))

    def _make_ready(self, polls: list[_ParkedPoll]) -> None:
        self.ready += polls
        if self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self.flush, context=_neutral())

    def _expire(self, segment_id: int, poll: _ParkedPoll) -> None:
        polls = self._parked.get(segment_id)
        if polls is None or poll not in polls:
            return  # woken meanwhile: answered by a flush
        polls.remove(poll)
        if not polls:
            del self._parked[segment_id]
        poll.deliver(self._answer(poll))

    def _answer(self, poll: _ParkedPoll) -> Any:
        token = current_principal.set(poll.principal)
        try:
            return self._handlers.PollCommits(poll.request)
        finally:
            current_principal.reset(token)

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


def _neutral() -> contextvars.Context:
    """The context a parked answer's callbacks run in: none of the caller's whose request scheduled
    them (`call_soon` would capture it: a tenant's principal, seen by the segment's poll)."""
    return contextvars.Context()


def _wait_s(request: Any, reply: Any) -> float:
    """How long a poll answered `reply` waits for notices (0: `reply` is its answer: notices, a
    refusal, or no wait asked)."""
    if reply.status != Status.OK or reply.offsets:
        return 0.0
    return min(request.wait_ms / 1000, LONG_POLL_MAX_S)


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
