"""`kvtier drain SEGMENT`: the mover that empties a segment before it is taken out of service.

The master marks the segment DRAINING (no new allocations) and hands out
batches of objects with a leased source range and an allocated target range
on another segment; this process copies each object over the data plane,
verifies its CRC32C against the checksum recorded at PutEnd, writes it to
the target and reports which moved. Bytes never pass through the master.
When nothing is left (or nothing more can move, or the timeout passes) the
segment is unmounted; objects that could not move are dropped, which for a
cache means a later recompute, never a wrong answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.client.client import Client
from kvtier.client.replicas import copy_batch
from kvtier.proto import master_pb2 as pb

_OK = 0


@dataclass
class DrainReport:
    segment: str
    moved: int = 0
    moved_bytes: int = 0
    failed: int = 0  # copy, verification or the target's acknowledgement failed (the object stays where it was)
    no_space: int = 0  # migrations refused for lack of room elsewhere
    dropped: int = 0  # DRAM replicas still on the segment when it was unmounted
    dropped_ssd: int = 0  # disk copies on its SSD tier of objects held elsewhere too (or not moved): gone with it
    state: str = ""


def drain_segment(
    client: Client,
    segment: str,
    *,
    batch: int = 256,
    timeout: float = 300.0,
    progress: Callable[[DrainReport, int], None] | None = None,
) -> DrainReport:
    """Drain `segment` and unmount it; raises KvtierError if the master refuses."""
    master = client._master
    report = DrainReport(segment)
    left = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment)).objects_left
    deadline = time.monotonic() + timeout
    # `left` counts DRAM objects; disk-only objects (moved too) show up in MigrateStart's batches only,
    # so the last call to find nothing is MigrateStart's.
    while time.monotonic() < deadline:
        start = master.call("MigrateStart", pb.MigrateStartRequest(segment=segment, max_objects=batch))
        if not start.keys:
            if start.more:  # the master's walk stopped at its time bound: it goes on at the next call
                continue
            if not left:
                break
            time.sleep(0.2)  # only pending puts remain: wait for them to finish or be reclaimed
        else:
            moved = _copy_batch(client, start, report)
            ended = master.call(
                "MigrateEnd",
                pb.MigrateEndRequest(
                    migration_id=start.migration_id,
                    namespaces=list(start.namespaces),
                    keys=list(start.keys),
                    moved=moved,
                ),
            )
            # Moved is what the master answered OK: a copy whose target went before acknowledging it
            # (SEGMENT_NOT_FOUND), or whose object changed meanwhile, left the object where it was.
            for i, (copied, status) in enumerate(zip(moved, ended.statuses, strict=True)):
                if copied and status == _OK:
                    report.moved += 1
                    report.moved_bytes += start.sizes[i]
                elif copied:
                    report.failed += 1
            if not any(moved):  # nothing could move (no room, or copies failing): stop trying
                break
        left = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment)).objects_left
        if progress is not None:
            progress(report, left)
    finished = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment, finish=True))
    report.dropped = finished.objects_left
    report.dropped_ssd = finished.ssd_objects_left
    report.state = finished.state
    return report


def _copy_batch(client: Client, start: pb.MigrateStartResponse, report: DrainReport) -> list[bool]:
    """Copy and verify the batch (kvtier.client.replicas.copy_batch, shared with `kvtier replica`);
    which keys were copied (the master counts them moved, `drain_segment`)."""
    statuses = copy_batch(client, start)
    moved = [status == _OK for status in statuses]
    for status, ok in zip(start.statuses, moved, strict=True):
        if status != _OK:
            report.no_space += 1
        elif not ok:
            report.failed += 1
    return moved
