"""`kvtier drain SEGMENT`: the mover that empties a segment before it is taken out of service.

The master marks the segment DRAINING (no new allocations) and hands out
batches of objects with a leased source range and an allocated target range
on another segment; this process copies each object over the data plane,
verifies its CRC32C against the checksum recorded at PutEnd, writes it to
the target and reports which moved. Bytes never pass through the master.
When nothing is left (or nothing moved for --stall-timeout seconds, or the
timeout passes) the segment is unmounted; objects that could not move are
dropped, which for a cache means a later recompute, never a wrong answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.client.client import Client
from kvtier.client.replicas import copy_batch
from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import KvtierError
from kvtier.proto.status import Status

_OK = 0
_NOT_FOUND = int(Status.NOT_FOUND)


@dataclass
class DrainReport:
    segment: str
    moved: int = 0
    moved_bytes: int = 0
    # Objects, not attempts (a retried object counts once), that had not moved when the drain ended:
    failed: int = 0  # the copy, its verification or the target's acknowledgement failed
    no_space: int = 0  # no room on any other segment
    dropped: int = 0  # DRAM replicas still on the segment when it was unmounted
    dropped_ssd: int = 0  # disk copies left on its SSD tier: of objects held elsewhere too, or not moved
    state: str = ""


class _Unmoved:
    """Objects of the drain that have not moved (yet), each under the last reason: the summary counts
    objects, where counting attempts said `no_space: 48` for 24 objects tried twice."""

    def __init__(self, report: DrainReport) -> None:
        self.report = report
        self._why: dict[tuple[str, str], str] = {}

    def note(self, key: tuple[str, str], why: str) -> None:
        before = self._why.get(key)
        if before != why:
            if before is not None:
                setattr(self.report, before, getattr(self.report, before) - 1)
            self._why[key] = why
            setattr(self.report, why, getattr(self.report, why) + 1)

    def forget(self, key: tuple[str, str]) -> None:
        """`key` moved, or is not the drain's to move any more (removed, put again)."""
        before = self._why.pop(key, None)
        if before is not None:
            setattr(self.report, before, getattr(self.report, before) - 1)


def drain_segment(
    client: Client,
    segment: str,
    *,
    batch: int = 256,
    timeout: float = 300.0,
    stall_timeout: float = 30.0,
    progress: Callable[[DrainReport, int], None] | None = None,
) -> DrainReport:
    """Drain `segment` and unmount it; raises KvtierError if the master refuses. Objects that find no
    room or fail to copy are tried again while others move (a target's DRAM frees up as it offloads
    to its SSD); after `stall_timeout` seconds in which nothing moved, the rest is given up."""
    master = client._master
    report = DrainReport(segment)
    unmoved = _Unmoved(report)
    # Marks it DRAINING. Every later DrainSegment of this drain only asks (`status_only`): marking again
    # undid a `kvtier drain --cancel`. Its process (`incarnation`) tells its end from an earlier one's.
    mine = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment)).incarnation
    deadline = time.monotonic() + timeout
    last_move = time.monotonic()
    walk_found = walk_moved = False  # what the master's current walk handed out, and moved
    # What to move and what to wait for (`waiting`: pending puts, copies, moves, promotions in flight)
    # is MigrateStart's to say: `left` (DRAM objects, for the progress line) has neither the disk-only
    # objects nor knows which replicas need no move. Every decision is taken where a walk ends
    # (`more` false): the empty call that ends a walk says nothing of objects handed out earlier in
    # it, and giving up in the middle of one never reached the objects after it (which might fit).
    while time.monotonic() < deadline:
        try:
            start = master.call("MigrateStart", pb.MigrateStartRequest(segment=segment, max_objects=batch))
        except KvtierError as exc:
            if exc.status != Status.SEGMENT_NOT_FOUND:
                raise
            # Another `kvtier drain` of it finished (DRAINED: the finish below answers so, with what
            # this drain moved), or it is away: expelled, it mounts again DRAINING and the walk starts
            # over (finishing here dropped a segment that came back meanwhile with objects no walk had
            # seen). Anything else ends the drain with an error: the name unknown (the call raises),
            # its drain cancelled, or another process under the name (a restart: it mounts ACTIVE).
            now = _status(master, segment)
            if now.state == "AWAY" and now.incarnation == mine:
                walk_found = walk_moved = False
                last_move = time.monotonic()  # time away is no stall: the walk has not seen it back
                time.sleep(0.5)
                continue
            if now.state == "DRAINED" and now.incarnation == mine:
                break
            if now.incarnation == mine and now.state in ("DRAINING", "RECOVERING"):
                continue  # back already
            raise KvtierError(
                Status.SEGMENT_NOT_FOUND,
                f"segment {segment!r} went away during its drain and is not being drained any more "
                f"({now.state}{'' if now.incarnation == mine else ', another process'}): drain it again",
            ) from None
        if start.keys:
            walk_found = True
            if _move_batch(client, start, report, unmoved):
                walk_moved, last_move = True, time.monotonic()
            if progress is not None:
                progress(report, _status(master, segment).objects_left)
        if start.more:  # the master's walk stopped at its time bound: it goes on at the next call
            continue
        found, moved, walk_found, walk_moved = walk_found, walk_moved, False, False
        if found and not moved:
            # A whole walk handed out objects and moved none (no room elsewhere, copies failing):
            # the next one tries them again after a pause, until nothing moved for stall_timeout.
            if time.monotonic() - last_move > stall_timeout:
                break
            time.sleep(0.5)
        elif not found:
            if not start.waiting:
                # A whole walk found nothing to move and nothing to wait for. (DRAM objects may be
                # left: replicas of objects every other segment holds already.)
                break
            # pending puts, or copies, moves, promotions of the segment's objects in flight (or the
            # segment still reporting its inventory): they end, or are reclaimed, and the next walk
            # meets what they left. No stall meanwhile: nothing was there to move.
            last_move = time.monotonic()
            time.sleep(0.2)
    finished = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment, finish=True, if_draining=True))
    report.dropped = finished.objects_left
    report.dropped_ssd = finished.ssd_objects_left
    report.state = finished.state
    return report


def _status(master, segment: str) -> pb.DrainSegmentResponse:
    """How the segment stands, nothing changed (the segment unknown to the master: raises)."""
    return master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment, status_only=True))


def _move_batch(client: Client, start: pb.MigrateStartResponse, report: DrainReport, unmoved: _Unmoved) -> bool:
    """Copy a batch and report it (MigrateEnd); whether any object of it moved."""
    moved = _copy_batch(client, start, unmoved)
    try:
        statuses = client._master.call(
            "MigrateEnd",
            pb.MigrateEndRequest(
                migration_id=start.migration_id,
                namespaces=list(start.namespaces),
                keys=list(start.keys),
                moved=moved,
            ),
        ).statuses
    except KvtierError as exc:
        if exc.status != Status.NOT_PENDING:
            raise
        # The batch outlived the put timeout (a segment or this mover stalled): the master released
        # it, and its objects are where they were, for a later walk.
        statuses = [int(Status.NOT_PENDING)] * len(moved)
    # Moved is what the master answered OK: a copy whose target went before acknowledging it
    # (SEGMENT_NOT_FOUND), or whose object changed meanwhile, left the object where it was.
    any_moved = False
    for i, (copied, status) in enumerate(zip(moved, statuses, strict=True)):
        key = (start.namespaces[i], start.keys[i])
        if status == _NOT_FOUND:  # removed or put again meanwhile: not the drain's to move
            unmoved.forget(key)
        elif copied and status == _OK:
            report.moved += 1
            report.moved_bytes += start.sizes[i]
            unmoved.forget(key)
            any_moved = True
        elif copied:
            unmoved.note(key, "failed")
    return any_moved


def _copy_batch(client: Client, start: pb.MigrateStartResponse, unmoved: _Unmoved) -> list[bool]:
    """Copy and verify the batch (kvtier.client.replicas.copy_batch, shared with `kvtier replica`);
    which keys were copied (the master counts them moved, `drain_segment`)."""
    statuses = copy_batch(client, start)
    moved = [status == _OK for status in statuses]
    for i, (status, ok) in enumerate(zip(start.statuses, moved, strict=True)):
        if status != _OK:
            unmoved.note((start.namespaces[i], start.keys[i]), "no_space")
        elif not ok:
            unmoved.note((start.namespaces[i], start.keys[i]), "failed")
    return moved
