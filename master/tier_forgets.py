"""FORGETs: the master's book of disk copies a segment must tombstone (kvtier.master.tiering, FORGET).

A mixin of `Tiering` (its `self` is the Tiering, whose `__init__` makes the book's tables:
`_unacked_forgets`, `_owed`, `_owed_bytes`, `_forgets_stalled`, `_forgets_failing`, `_forget_retries`).
A FORGET is acknowledged and remembered by segment name until it is; a change waits for its FORGETs
(kvtier.master.commit_wait) but not for a segment that stalled or failed one: such a FORGET is *owed*,
saved with the master's state (kvtier.master.persist) before the change is answered, so the next
incarnation refuses that copy too and hands the FORGET out again.
"""

from __future__ import annotations

import json
import logging

from kvtier.master.tier_tasks import TaskKind, TierTask
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

_OK = int(Status.OK)
FORGET_RETRY_S = 1.0  # a FORGET the segment could not write (disk full, I/O error) is sent again after this
# Owed FORGETs (see `_owe`) the saved state lists, all segments together, in bytes of JSON (etcd takes
# 1.5 MiB a request by default): past that, the segments with the most are saved as expelled instead (the
# next incarnation refuses their copies, DRAM and SSD: misses, never stale bytes).
OWED_SAVED_MAX_BYTES = 1 << 20


def _json_bytes(location: int, name: str) -> int:
    """What one owed FORGET adds to the saved state's JSON (names escaped as `json.dumps` does)."""
    return len(json.dumps([location, name])) + 2


class ForgetBook:
    """Unacknowledged and owed FORGETs per segment name (a mixin of Tiering)."""

    def forget(self, segment_id: int, name: str, location: int) -> None:
        """The master dropped the disk copy at `location`: have the segment tombstone it (see FORGET)."""
        segment_name = self._names.get(segment_id)
        if segment_name is None:
            return
        task = TierTask(next(self._ids), TaskKind.FORGET, segment_id, None, name, 0, 0, 0, location)
        unacked = self._unacked_forgets.setdefault(segment_name, {})
        old = unacked.get(location)
        if old is not None:  # a FORGET of the same copy again, or of an earlier record there
            self._settle_owed(segment_name, location)
        unacked[location] = task
        if segment_id in self.state.segments:
            self._enqueue(task)
        if (
            segment_id not in self.state.segments
            or segment_name in self._forgets_stalled
            or (old is not None and old.owed and old.name == name)  # it takes the owed one's place
        ):
            self._owe(segment_name, task)  # nothing waits for it: the saved state holds it

    def _owe(self, segment_name: str, task: TierTask) -> None:
        """A change is answered without `task`'s acknowledgement: saved (`owed_forgets`) before that
        answer (the save's generation), and given to the next incarnation, which refuses the copy
        when the segment reports it and hands the FORGET out again."""
        if task.owed:
            return
        self.state.state_generation += 1
        self.state.saved_state_stale = True
        task.owed, task.owed_generation = True, self.state.state_generation
        self._hold_owed(segment_name, task)
        if self.on_owed is not None:
            self.on_owed()

    def _hold_owed(self, segment_name: str, task: TierTask) -> None:
        self._settle_owed(segment_name, task.disk_location)
        self._owed.setdefault(segment_name, {})[task.disk_location] = task
        self._owed_bytes[segment_name] += _json_bytes(task.disk_location, task.name)

    def _newer_record_at(self, segment_name: str, location: int) -> None:
        """The segment holds a record at `location` newer than any FORGET of it (its bucket deleted,
        the id taken again after a restart): such a FORGET is about the location's previous life and
        must not go on (not handed out again, not saved; one handed out already names the old
        object, which the segment checks)."""
        if self._unacked_forgets.get(segment_name, {}).pop(location, None) is not None:
            self._settle_owed(segment_name, location)

    def _settle_owed(self, segment_name: str, location: int) -> None:
        """The owed FORGET at `location` is acknowledged or moot: the next save lists it no more."""
        owed = self._owed.get(segment_name)
        task = owed.pop(location, None) if owed is not None else None
        if task is not None:
            self.state.saved_state_stale = True
            self._owed_bytes[segment_name] -= _json_bytes(location, task.name)
            if not owed:
                del self._owed[segment_name]
                del self._owed_bytes[segment_name]
            if self.on_owed is not None:  # soon: a successor would refuse a new copy at `location`
                self.on_owed()

    def owed_forgets(self) -> tuple[dict[str, list[tuple[int, str]]], set[str]]:
        """What the saved state lists: segment name -> (location, object name) of its owed FORGETs,
        and the names of segments with too many to list (OWED_SAVED_MAX_BYTES), saved as expelled."""
        sizes = {segment: size + len(json.dumps(segment)) + 4 for segment, size in self._owed_bytes.items()}
        total = sum(sizes.values())
        overflowed = set()
        for segment in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if total <= OWED_SAVED_MAX_BYTES:
                break
            total -= sizes[segment]
            overflowed.add(segment)
        owed = {
            segment: [(at, task.name) for at, task in tasks.items()]
            for segment, tasks in self._owed.items()
            if segment not in overflowed
        }
        return owed, overflowed

    def restore_owed(self, owed: dict[str, list[tuple[int, str]]]) -> None:
        """A new incarnation takes the owed FORGETs its predecessor saved: handed out when their segment
        mounts (`mounted`), and a copy it reports at such a location is refused."""
        for segment, pairs in owed.items():
            tasks = self._unacked_forgets.setdefault(segment, {})
            for location, name in pairs:
                # Owed, and held by the save it came from (generation 0): nothing waits for a save.
                task = TierTask(next(self._ids), TaskKind.FORGET, 0, None, name, 0, 0, 0, location, owed=True)
                tasks[location] = task
                self._hold_owed(segment, task)

    def unacked_forget_names(self, segment_name: str) -> set[str]:
        """Object names of the segment's FORGETs not acknowledged yet (the seed of its fence)."""
        return {task.name for task in self._unacked_forgets.get(segment_name, {}).values()}

    def unsettled_offload_names(self, segment_name: str) -> set[str]:
        """Names to fence (kvtier.master.fences) when the segment is dropped: objects removed or replaced
        while an OFFLOAD of theirs was handed out and never reported. The copy may be durable on the
        segment's disk without the master knowing its location (a SIGKILL between fdatasync and
        TierTasksDone), so no FORGET could be sent: its return must be refused. Taken once (called by
        MasterState when it opens the segment's fence, right after `segment_dropped`)."""
        return self._unsettled_at_drop.pop(segment_name, set())

    def pending_forgets(self) -> list[TierTask]:
        """FORGETs not yet acknowledged by mounted, responsive segments: what a Remove waits for,
        so a removed object's disk copy cannot come back with a restart of the master."""
        mounted = {self._names.get(segment_id) for segment_id in self.state.segments}
        return [
            task
            for name, tasks in self._unacked_forgets.items()
            if name in mounted and name not in self._forgets_stalled
            for task in tasks.values()
        ]

    def forgotten(self, task: TierTask) -> bool:
        """Acknowledged, or no longer waited for: its segment left or stalled, and then the FORGET is
        owed (`_owe`): the answer waiting for it waits for the save of `task.owed_generation` instead."""
        name = self._names.get(task.segment_id, "")
        if self._unacked_forgets.get(name, {}).get(task.disk_location) is not task:
            return True
        if name in self._forgets_stalled or task.segment_id not in self.state.segments:
            self._owe(name, task)
            return True
        return False

    def forgets_stalled(self, tasks: list[TierTask]) -> bool:
        """A change timed out waiting for these: stop waiting for their segments until they answer
        (their FORGETs are owed from now on). True if one of `tasks` was still waited for."""
        stalled = False
        for task in tasks:
            if not self.forgotten(task):
                name = self._names.get(task.segment_id, "")
                if name not in self._forgets_stalled:
                    logger.warning(
                        "segment %s did not acknowledge FORGETs in time: not waited for, owed (saved) until it does",
                        name,
                    )
                self._forgets_stalled.add(name)
                self.counters["forget_waits_timed_out"] += 1
                stalled = True
                for other in self._unacked_forgets.get(name, {}).values():  # none is waited for from now on
                    self._owe(name, other)
        return stalled

    def _forget_done(self, task: TierTask, status: int) -> None:
        segment_name = self._names.get(task.segment_id, "")
        unacked = self._unacked_forgets.get(segment_name, {})
        if status == _OK:
            if unacked.get(task.disk_location) is task:
                del unacked[task.disk_location]
                if task.owed:
                    self._settle_owed(segment_name, task.disk_location)
        elif task.segment_id in self.state.segments:
            self.counters["forget_failures"] += 1
            # The tombstone must happen: try again, after a pause (a full or failing disk would
            # otherwise fail it again at once, in a loop between the master and the segment).
            self._forget_retries.append((self.state.clock() + FORGET_RETRY_S, task))
            # The failure is its answer: nothing waits for its FORGETs until one succeeds (they are
            # owed, saved, as after a timed-out wait). Waiting out the timeout instead, every change
            # stalled 3.4 s, again and again, for as long as the disk stayed bad.
            if segment_name not in self._forgets_failing:
                logger.warning(
                    "segment %s failed a FORGET: not waited for, owed (saved) until one succeeds", segment_name
                )
                self._forgets_stalled.add(segment_name)
                self._forgets_failing.add(segment_name)
            for other in unacked.values():
                self._owe(segment_name, other)

    def _retry_forgets(self, now: float) -> None:
        """Send again the FORGETs a segment failed to write (`_forget_done`) whose pause ran out."""
        while self._forget_retries and self._forget_retries[0][0] <= now:
            task = self._forget_retries.popleft()[1]
            name = self._names.get(task.segment_id, "")
            # Still owed (a remount may have handed it out again already) and its segment still here
            # (a remount hands out every unacknowledged FORGET itself).
            owed = self._unacked_forgets.get(name, {}).get(task.disk_location) is task
            queued = task.task_id in self._in_flight or task in self._queues.get(task.segment_id, ())
            if owed and not queued and task.segment_id in self.state.segments:
                self._enqueue(task)
