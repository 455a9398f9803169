"""Work that visits many objects, done in slices so that no request waits behind it (issue 19).

Two kinds: a prefix removal (RemovePrefix) and a dead segment's cleanup (`drop_segment`). Each
starts in O(1) and from that instant no lookup sees what it takes: while any is active, every
lookup of `MasterState` settles the record it meets first (`MasterState._settled`: a record a
removal owes is discarded, a record with copies on a dead segment loses them), so readers get the
answer they would get had the whole walk finished at once. `MasterState.sweep(budget)` then visits
at most `budget` names of the oldest task's range in the name index (kvtier.master.name_index)
and settles each; `run_sweeper` calls it between requests on the master's event loop.

What a removal takes: the objects complete when it began. Objects completed afterwards (their
PutEnd ran after RemovePrefix) are `survivors`, kept, as are objects still pending when the sweep
reaches them, as before slicing. A dead segment's copies: its id is never reused, and no new copy
can be placed on a segment no longer mounted, so the set of records owing it only shrinks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.master.records import ObjectRecord, ObjectState

if TYPE_CHECKING:
    from kvtier.master.state import MasterState

_COMPLETE = ObjectState.COMPLETE

# A slice's bounds by default (config sweep_slice_ms, sweep_slice_objects). A request arriving
# meanwhile waits for the slice to end, so a slice costs about what an idle request waits anyway;
# the loop's turn between two slices costs ~10-20 us. Removing an object costs ~3-25 us (quiet
# machine vs busy 2-core VM, docs/benchmarks.md "Scans"): the time bound is the one that holds.
DEFAULT_SLICE = 1024
DEFAULT_SLICE_MS = 0.25


@dataclass(slots=True, eq=False)
class Sweep:
    """One task: the names in [cursor, end) still to visit ("" end = no bound)."""

    cursor: str
    end: str
    prefix: str = ""  # a removal: the object-name prefix removed
    segment_id: int = 0  # a dead segment: its id, name and why it went
    segment: str = ""
    reason: str = ""
    started: bool = False  # the cursor itself was visited
    removed: int = 0  # objects it removed (a removal) or lost (a dead segment)
    done: bool = False
    survivors: set[str] = field(default_factory=set)  # removal: names completed after it began
    on_done: list[Callable[[], None]] = field(default_factory=list)


Removal = Sweep


class Sweeps:
    """The tasks in progress, oldest first, and what lookups check while any is."""

    def __init__(self) -> None:
        self.tasks: deque[Sweep] = deque()
        self.removals: list[Sweep] = []
        self.dead_segments: dict[int, Sweep] = {}
        self.active = False  # any task: lookups settle the records they meet
        self.on_work: Callable[[], None] | None = None  # wakes the sweeper (kvtier.master.server)

    def remove_prefix(self, start: str, end: str) -> Sweep:
        task = Sweep(cursor=start, end=end, prefix=start)
        self.removals.append(task)
        return self._add(task)

    def segment_died(self, segment_id: int, name: str, reason: str) -> Sweep:
        task = Sweep(cursor="", end="", segment_id=segment_id, segment=name, reason=reason)
        self.dead_segments[segment_id] = task
        return self._add(task)

    def _add(self, task: Sweep) -> Sweep:
        self.tasks.append(task)
        self.active = True
        if self.on_work is not None:
            self.on_work()
        return task

    def current(self) -> Sweep | None:
        return self.tasks[0] if self.tasks else None

    def finish(self, task: Sweep) -> None:
        self.tasks.remove(task)
        if task.segment_id:
            # Records owing it were all settled: none is left with a copy there.
            del self.dead_segments[task.segment_id]
        else:
            self.removals.remove(task)
        self.active = bool(self.tasks)
        task.done = True
        for callback in task.on_done:
            callback()
        task.on_done.clear()

    def removing(self, record: ObjectRecord) -> Sweep | None:
        """The removal that takes `record` (complete when it began), if any."""
        if record.state is not _COMPLETE:
            return None
        name = record.name
        for removal in self.removals:
            if name.startswith(removal.prefix) and name not in removal.survivors:
                return removal
        return None

    def completed(self, records: Iterable[ObjectRecord]) -> None:
        """`records` became complete now, after every removal in progress began: they survive them."""
        for removal in self.removals:
            prefix = removal.prefix
            removal.survivors.update(r.name for r in records if r.name.startswith(prefix))


async def wait_done(task: Sweep, timeout_s: float) -> bool:
    """Until `task` is done (True), or `timeout_s` passed (False)."""
    if task.done:
        return True
    future = asyncio.get_running_loop().create_future()
    settle = lambda: future.done() or future.set_result(None)  # noqa: E731
    task.on_done.append(settle)
    try:
        await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        return False
    finally:
        if settle in task.on_done:
            task.on_done.remove(settle)
    return True


async def run_sweeper(
    current_state: Callable[[], MasterState], slice_objects: int = DEFAULT_SLICE, slice_ms: float = DEFAULT_SLICE_MS
) -> None:
    """Sweep the current state's tasks forever, one slice per turn of the event loop, so every
    request that arrived meanwhile is served between two slices. Idle: waits to be woken."""
    wakeup = asyncio.Event()
    while True:
        state = current_state()
        state.sweeps.on_work = wakeup.set
        if state.sweep(slice_objects, slice_ms / 1000):
            await asyncio.sleep(0)
            continue
        wakeup.clear()
        if not state.sweeps.active:
            try:  # bounded: a state replaced meanwhile (a new epoch) is picked up
                await asyncio.wait_for(wakeup.wait(), 0.5)
            except TimeoutError:
                pass
