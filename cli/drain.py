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

import crc32c

from kvtier.client.client import Client
from kvtier.client.transport.base import Caps
from kvtier.proto import master_pb2 as pb

_OK = 0


@dataclass
class DrainReport:
    segment: str
    moved: int = 0
    moved_bytes: int = 0
    failed: int = 0  # copy or verification failed (the object stays where it was)
    no_space: int = 0  # migrations refused for lack of room elsewhere
    dropped: int = 0  # replicas still on the segment when it was unmounted
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
    while left and time.monotonic() < deadline:
        start = master.call("MigrateStart", pb.MigrateStartRequest(segment=segment, max_objects=batch))
        if not start.keys:  # only pending puts remain: wait for them to finish or be reclaimed
            time.sleep(0.2)
        else:
            moved = _copy_batch(client, start, report)
            master.call(
                "MigrateEnd",
                pb.MigrateEndRequest(
                    migration_id=start.migration_id,
                    namespaces=list(start.namespaces),
                    keys=list(start.keys),
                    moved=moved,
                ),
            )
            if not any(moved):  # nothing could move (no room, or copies failing): stop trying
                break
        left = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment)).objects_left
        if progress is not None:
            progress(report, left)
    finished = master.call("DrainSegment", pb.DrainSegmentRequest(segment=segment, finish=True))
    report.dropped = finished.objects_left
    report.state = finished.state
    return report


def _copy_batch(client: Client, start: pb.MigrateStartResponse, report: DrainReport) -> list[bool]:
    segments = {s.segment_id: s for s in start.segments}
    source = segments.get(start.source_segment)
    moved = [False] * len(start.keys)
    if source is None:
        return moved
    todo = [i for i, status in enumerate(start.statuses) if status == _OK]
    report.no_space += len(start.keys) - len(todo)
    buffers = {i: bytearray(start.sizes[i]) for i in todo}
    rank = {i: n for n, i in enumerate(todo)}  # capabilities come for the movable objects, in order

    def caps(tags: bytes, indices: list[int]) -> Caps:
        """The migration's grant: its tags, or without a secret only its expiry (the frames' deadline)."""
        if not tags:
            return (start.tag_expiry_ms, []) if start.tag_expiry_ms else None
        return start.tag_expiry_ms, [tags[16 * rank[i] : 16 * rank[i] + 16] for i in indices]

    reads = client._connector(source).read_into(
        [(start.source_offsets[i], memoryview(buffers[i])) for i in todo], None, caps=caps(start.source_tags, todo)
    )
    verified = [
        i
        for i, status in zip(todo, reads, strict=True)
        if status == _OK and crc32c.crc32c(buffers[i]) == start.checksums[i]
    ]
    report.failed += len(todo) - len(verified)
    by_target: dict[int, list[int]] = {}
    for i in verified:
        by_target.setdefault(start.target_segments[i], []).append(i)
    for target_id, indices in by_target.items():
        target = segments.get(target_id)
        if target is None:
            report.failed += len(indices)
            continue
        results = client._connector(target).write(
            [(start.target_offsets[i], memoryview(buffers[i])) for i in indices],
            None,
            caps=caps(start.target_tags, indices),
        )
        for i, status in zip(indices, results, strict=True):
            if status == _OK:
                moved[i] = True
                report.moved += 1
                report.moved_bytes += start.sizes[i]
            else:
                report.failed += 1
    return moved
