"""WatchEvents over gRPC: one watcher of the event log (kvtier.master.events) per stream.

The stream writes what `EventLog.take` hands its watcher, waits for the next publish when it has
caught up, and ends with one EVENT_END message saying why (status and words) when the log ends
the watcher (cut for being slow, events missed, the log closed) or the handler refused it. A
stream whose reader stops reading waits in gRPC's write (flow control); publishing never waits for
it: the log cuts it once it is `events_watcher_queue` events behind, and the reader gets its
buffered events, then the EVENT_END, when it reads again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvtier.master.events import EventLog, Published, Watcher
from kvtier.master.records import SEGMENT_SHIFT, TIER_MASK, TIER_SHIFT, TIER_SSD
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import split_name
from kvtier.proto.status import Status

TAKE = 256  # events taken from the ring per turn; gRPC's flow control paces the writes
# Initial metadata of a subscribed stream: the master epoch and the first seq it will look at.
EPOCH_HEADER, START_HEADER = "kvtier-epoch", "kvtier-start-seq"


def end_message(status: int, words: str, epoch: int) -> Any:
    return pb.Event(kind=pb.EVENT_END, status=status, error=words, epoch=epoch)


def to_message(event: Published, epoch: int, segment_name: Callable[[int], str]) -> Any:
    namespace, key = split_name(event.name)
    replicas = event.replicas
    return pb.Event(
        seq=event.seq,
        epoch=epoch,
        kind=event.kind,
        namespace=namespace,
        key=key,
        size=event.size,
        tiers=["ssd" if r >> TIER_SHIFT & TIER_MASK == TIER_SSD else "dram" for r in replicas],
        segments=[segment_name(r >> SEGMENT_SHIFT) for r in replicas],
        reason=event.reason,
        time=event.time,
        status=Status.OK,
    )


async def stream(log: EventLog, watcher: Watcher, epoch: int, segment_name: Callable[[int], str]) -> AsyncIterator[Any]:
    """The messages of one watcher's stream, until the log ends it (then its EVENT_END). The
    caller unwatches when the call is over."""
    ready = asyncio.Event()
    watcher.wake = ready.set
    while True:
        batch = log.take(watcher, TAKE)
        for event in batch:
            yield to_message(event, epoch, segment_name)
        if batch:
            continue
        if watcher.end is not None:
            status, words = watcher.end
            yield end_message(status, words, epoch)
            return
        # Caught up: park until the next publish. Nothing is published between take() and here
        # (one thread, no await in between), so no wake-up is lost.
        ready.clear()
        watcher.waiting = True
        await ready.wait()
