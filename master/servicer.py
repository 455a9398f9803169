"""The gRPC face of the master: `MasterServicer` delegates every RPC to the handler of the same
name (kvtier.master.handlers), and adds the waits only a transport can do: long polls, commit
acknowledgements (kvtier.master.commit_wait), held puts and durable saves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvtier.master import event_stream
from kvtier.master.commit_wait import LONG_POLL_MAX_S, WAITING_CALLS, CommitWaiter
from kvtier.master.handlers import RPC_NAMES, MasterHandlers
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2_grpc
from kvtier.proto.status import Status


class MasterServicer(master_pb2_grpc.MasterServicer):
    """The gRPC face of `MasterHandlers`: every RPC delegates to the handler of the same name.

    `PollTierTasks` and `PollCommits` wait: for work of their segment to be queued, or `wait_ms`.
    `PutEnd` answers once the segments acknowledged its commits (`CommitWaiter`).
    `WatchEvents` streams (kvtier.master.event_stream).
    """

    def __init__(self, handlers: MasterHandlers, waiter: CommitWaiter) -> None:
        self.handlers = handlers
        self.waiter = waiter
        self._task_events: dict[int, asyncio.Event] = {}
        self.save_state: Callable[[], Awaitable[bool]] | None = None  # saves what changed: True once durable
        self._save_soon: asyncio.Handle | asyncio.Task | None = None
        self.attach(handlers.state)

    def attach(self, state: MasterState) -> None:
        """Hook a (new) state's notifications to the long polls."""
        for event in self._task_events.values():
            event.set()  # long polls of the old state's segments answer now (their ids mean nothing here)
        self._task_events.clear()
        state.tiering.notify = self._wake
        state.tiering.on_owed = self._save_now
        old = self.handlers.state
        if old is not state:  # a new epoch, or standing by: the old tables' watchers must resync
            old.events.close("the master's tables were replaced (a new epoch, or it no longer leads): resync")
            state.events.published, state.events.cuts = old.events.published, old.events.cuts  # totals go on
        self.waiter.attach(state)  # commit notices wake the commit long polls (CommitPolls)

    def _save_now(self) -> None:
        """Save at the next turn of the loop rather than the next tick: answers wait for it (FORGETs
        owed, kvtier.master.tiering). One save at a time; what changes meanwhile, the next covers."""
        if self.save_state is None or self._save_soon is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (the state is owned by it: a test's direct call)
            return  # the ticker saves what is stale
        self._save_soon = loop.call_soon(self._start_save)

    def _start_save(self) -> None:
        assert self.save_state is not None
        self._save_soon = asyncio.ensure_future(self.save_state())
        self._save_soon.add_done_callback(self._saved)

    def _saved(self, task: asyncio.Future) -> None:
        self._save_soon = None
        state = self.handlers.state
        # Owed meanwhile, what this save did not cover: again (a failed save is the ticker's to retry).
        if not task.cancelled() and task.exception() is None and task.result():
            if state.saved_state_stale and state.state_generation > state.durable_generation:
                self._save_now()

    def _wake(self, segment_id: int) -> None:
        event = self._task_events.get(segment_id)
        if event is not None:
            event.set()

    async def _answer_when_acknowledged(self, name: str, request: Any) -> Any:
        reply = getattr(self.handlers, name)(request)
        if reply.status != Status.OK:
            return reply
        if name == "RemovePrefix" and (removal := self.handlers.take_removal()) is not None:
            return await self.waiter.after_removal(reply, removal)
        barrier = self.waiter.barrier()
        return reply if barrier is None else await self.waiter.finish(reply, barrier)

    async def PutStart(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        reply = self.handlers.PutStart(request)
        held = self.handlers.take_put_hold()
        return reply if held is None else await self.handlers.put_waiter.finish(held)

    async def PutEnd(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("PutEnd", request)

    async def RelayPutEnd(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Segments relay over the fast path; over gRPC it means the same (kvtier.segment_server.commit_relay)."""
        return await self._answer_when_acknowledged("RelayPutEnd", request)

    async def Remove(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("Remove", request)

    async def RemovePrefix(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("RemovePrefix", request)

    async def MigrateEnd(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """A moved or copied replica is in its segment's index before the caller hears OK."""
        return await self._answer_when_acknowledged("MigrateEnd", request)

    async def RemoveReplicas(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Answers once the dropped replicas' segments acknowledged: a restart does not bring them back."""
        return await self._answer_when_acknowledged("RemoveReplicas", request)

    async def RegisterInstance(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Answers once the registration is saved: one acknowledged is one a restart keeps. A save
        that failed answers UNAVAILABLE (registering again is harmless; the save is retried), one
        this master never makes NOT_DURABLE with the cause."""
        reply = self.handlers.RegisterInstance(request)
        if reply.status == Status.OK and self.save_state is not None and not await self.save_state():
            state = self.handlers.state
            if state.unsaveable:
                return type(reply)(status=Status.NOT_DURABLE, error=state.unsaveable)
            return type(reply)(status=Status.UNAVAILABLE, error="the registration could not be saved yet: retry")
        return reply

    async def ReportDramObjects(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The last chunk answers once the segment's name is saved: from then on it takes
        allocations, and a restart waits for it. It grants the segment's direct-read lease once a
        save of this epoch held (`MasterState.granted_lease_ms`: the saved state then names a lease
        at least as long, which the next incarnation waits out); before, and from a master that
        saves nothing, none (heartbeat answers grant it later)."""
        reply = self.handlers.ReportDramObjects(request)
        if request.done and reply.status == Status.OK and self.save_state is not None:
            await self.save_state()
            reply.direct_read_lease_ms = self.handlers.state.granted_lease_ms
        return reply

    async def PollCommits(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self.waiter.polls.poll(request)

    async def WatchEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        handlers = self.handlers
        reply = handlers.WatchEvents(request)
        watcher = handlers.take_watcher()
        if watcher is None:
            yield event_stream.end_message(reply.status, reply.error, handlers.epoch)
            return
        # The tables it subscribed to, whatever replaces them meanwhile (their log then ends it).
        state, epoch = handlers.state, handlers.epoch
        segments = state.segments

        def segment_name(segment_id: int) -> str:
            segment = segments.get(segment_id)
            return segment.name if segment is not None else ""

        messages = event_stream.stream(state.events, watcher, epoch, segment_name)
        try:
            # Subscribed: the client's watch_events returns once it has this, so whatever is
            # published after it returned is in its stream (subscribe, then list: nothing missed).
            await context.send_initial_metadata(
                ((event_stream.EPOCH_HEADER, str(epoch)), (event_stream.START_HEADER, str(watcher.cursor)))
            )
            async for message in messages:
                yield message
        finally:  # however the call ends (its end sent, the client gone, the server stopping)
            await messages.aclose()
            state.events.unwatch(watcher)  # its slot is free

    async def PollTierTasks(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        handlers = self.handlers
        wait_s = min(request.wait_ms / 1000, LONG_POLL_MAX_S)
        tiering = handlers.state.tiering
        if wait_s > 0 and request.segment_id in handlers.state.segments and not tiering.has_tasks(request.segment_id):
            event = self._task_events.setdefault(request.segment_id, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                if self._task_events.get(request.segment_id) is event:
                    del self._task_events[request.segment_id]
        return handlers.PollTierTasks(request)


_AWAITED = ("PutStart", "PollTierTasks", "PollCommits", "RegisterInstance", "ReportDramObjects", "WatchEvents")
_AWAITED += ("MigrateEnd", "RemoveReplicas")


def _delegate(name: str):
    async def method(self: MasterServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return getattr(self.handlers, name)(request)

    method.__name__ = name
    return method


for _name in RPC_NAMES:
    if _name not in (*_AWAITED, *WAITING_CALLS):
        setattr(MasterServicer, _name, _delegate(_name))
