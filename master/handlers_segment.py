"""The segment-server handlers of `MasterHandlers` (kvtier.master.handlers): mount, unmount,
heartbeat, tier tasks and disk inventories, the commit log and DRAM inventories after a master restart."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.master.clock_skew import read_skew
from kvtier.master.commits import notice_pin
from kvtier.master.gates import rpc
from kvtier.master.groups import GroupTable
from kvtier.master.records import ObjectRecord
from kvtier.master.recovery import DramObjects, inventory_done, report_dram_objects
from kvtier.master.tier_tasks import TaskKind
from kvtier.master.tiering import PROMOTE_WRITE_SHARE
from kvtier.proto import master_pb2 as pb
from kvtier.proto.auth import wall_ms
from kvtier.proto.keys import split_name
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

# Per-segment byte counters (and the SSD tier's room now) a heartbeat carries and Status repeats
# (see HeartbeatRequest).
_IO_COUNTERS = (
    "dram_bytes_served",
    "ssd_bytes_served",
    "disk_bytes_read",
    "ssd_bytes_offloaded",
    "direct_reads_served",
    "ssd_usable",
)


class SegmentCalls:
    """Segment servers' RPCs; mixed into `MasterHandlers`, whose state and counters they use."""

    @rpc(pb.MountSegmentResponse)
    def MountSegment(self, request):
        received_ms = wall_ms()
        result = self.state.mount_segment(
            request.cluster_id,
            request.name,
            request.host_id,
            list(request.endpoints),
            request.dram_capacity,
            request.incarnation,
            ssd_capacity=request.ssd_capacity,
            offload=request.offload,
            disk_engine=request.disk_engine,
            ssd_max_object=request.ssd_max_object,
            inventory=request.inventory,
            # another master's session proves nothing about this one's fence
            previous_segment_id=request.previous_segment_id if request.previous_epoch == self.epoch else 0,
            previous_applied_seq=request.previous_applied_seq,
        )
        if result.segment is None:
            return pb.MountSegmentResponse(
                status=result.status, error=result.error, name_frees_in_ms=int(result.name_frees_in_s * 1000)
            )
        config = self.state.config
        # Not with tenants: a range freed early (a cluster reader handed its lease back) may go to a
        # tenant's put before its segment applied the drop, and only the checksum (CRC32C: forgeable by
        # one who knows the old bytes) would then tell that tenant's bytes from the old object.
        direct = request.keyed_reads and config.direct_reads and not self.auth.tenants
        result.segment.direct_reads = direct
        result.segment.mount_sessions = request.mount_sessions
        result.segment.writer_slots = request.writer_slots
        writers = list(zip(request.writer_offsets, request.writer_lengths, strict=False))
        self.state.writers_at_mount(result.segment.segment_id, writers)
        self.state.note_clock_skew(
            result.segment.segment_id, read_skew(request.wall_clock_ms, received_ms, 0, config.clock_skew_tolerance_s)
        )
        return pb.MountSegmentResponse(
            status=Status.OK,
            segment_id=result.segment.segment_id,
            heartbeat_interval_ms=int(config.heartbeat_interval_s * 1000),
            ttl_ms=int(config.segment_ttl_s * 1000),
            master_epoch=str(self.epoch),
            epoch=self.epoch,
            discard_index=result.discard_index,
            wall_clock_ms=wall_ms(),
            direct_read_lease_ms=self._mount_lease_ms(request) if direct else 0,
            mount_sessions=True,
        )

    def _mount_lease_ms(self, request) -> int:
        """The direct-read lease a mount names: the cap of what later answers grant, or, to a segment
        that takes no grants (an older one serves under it at once), what is granted already."""
        own = self.state.config.direct_read_lease_ms
        return own if request.lease_grants else min(own, self.state.granted_lease_ms)

    @rpc(pb.UnmountSegmentResponse)
    def UnmountSegment(self, request):
        return pb.UnmountSegmentResponse(status=self.state.unmount_segment(request.segment_id))

    @rpc(pb.HeartbeatResponse)
    def Heartbeat(self, request):
        received_ms = wall_ms()
        counters = {name: getattr(request, name) for name in _IO_COUNTERS}
        status = self.state.heartbeat(request.segment_id, request.ssd_used, counters)
        if status == Status.OK:
            tolerance_s = self.state.config.clock_skew_tolerance_s
            reading = read_skew(request.wall_clock_ms, received_ms, request.rtt_ms, tolerance_s)
            self.state.note_clock_skew(request.segment_id, reading)
            if request.writers_sampled_ms:
                writers = list(zip(request.writer_offsets, request.writer_lengths, strict=False))
                stalled = [
                    w
                    for w, cutoff in zip(writers, request.writer_cutoffs_ms, strict=False)
                    if cutoff < request.writers_sampled_ms
                ]
                self.state.writers_reported(request.segment_id, request.writers_sampled_ms, writers, stalled)
        reply = pb.HeartbeatResponse(
            status=status, master_epoch=str(self.epoch), epoch=self.epoch, wall_clock_ms=wall_ms()
        )
        if status == Status.OK:  # grows from 0 once a save held (kvtier.segment_server.keyed_reads)
            reply.direct_read_lease_ms = self.state.granted_lease_ms
        return reply

    # -------------------------------------------------------------- tiering

    @rpc(pb.PollTierTasksResponse)
    def PollTierTasks(self, request):
        """Non-blocking: the tasks queued now (the gRPC servicer adds the long poll)."""
        if request.segment_id not in self.state.segments:
            return pb.PollTierTasksResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        ttl_ms = int(self.state.tiering.task_ttl_s * 1000)
        reply = pb.PollTierTasksResponse(
            status=Status.OK, task_ttl_ms=ttl_ms, promote_by_ms=wall_ms() + int(ttl_ms * PROMOTE_WRITE_SHARE)
        )
        groups = self.state.groups
        tags: list[tuple[int, int]] = []
        for task in self.state.tiering.poll(request.segment_id, request.max_tasks or 256):
            # An offloaded member keeps its group's tag on disk: a successor forms the group from it.
            tags.append(groups.tag_of(task.record) if task.kind == TaskKind.OFFLOAD and task.record else (0, 0))
            namespace, key = split_name(task.name)
            reply.task_ids.append(task.task_id)
            reply.kinds.append(int(task.kind))
            reply.namespaces.append(namespace)
            reply.keys.append(key)
            reply.sizes.append(task.size)
            reply.checksums.append(task.checksum)
            reply.dram_offsets.append(task.dram_offset)
            reply.disk_locations.append(task.disk_location)
        if any(group_id for group_id, _ in tags):  # groups are rare: the columns only when one is there
            reply.group_ids.extend(group_id for group_id, _ in tags)
            reply.group_sizes.extend(size for _, size in tags)
        return reply

    @rpc(pb.KeyStatusResponse)
    def TierTasksDone(self, request):
        if request.segment_id not in self.state.segments:
            return pb.KeyStatusResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        if not len(request.task_ids) == len(request.statuses) == len(request.disk_locations):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="task_ids, statuses, locations differ")
        if request.error:
            logger.warning("tier tasks failed segment_id=%d first_error=%s", request.segment_id, request.error)
        statuses = self.state.tiering.done(
            request.segment_id, list(request.task_ids), list(request.statuses), list(request.disk_locations)
        )
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    def _disk_objects_problem(self, request) -> pb.KeyStatusResponse | None:
        if request.segment_id not in self.state.segments:
            return pb.KeyStatusResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        n = len(request.keys)
        if (
            not n
            == len(request.namespaces)
            == len(request.sizes)
            == len(request.checksums)
            == len(request.disk_locations)
        ) or not len(request.group_ids) == len(request.group_sizes) in (0, n):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="parallel arrays differ in length")
        return self._too_many(request.keys, pb.KeyStatusResponse)

    @rpc(pb.KeyStatusResponse)
    def ReportDiskObjects(self, request):
        if problem := self._disk_objects_problem(request):
            return problem
        statuses = self.state.tiering.report_disk_objects(
            request.segment_id,
            list(request.namespaces),
            list(request.keys),
            list(request.sizes),
            list(request.checksums),
            list(request.disk_locations),
            list(zip(request.group_ids, request.group_sizes, strict=True)),
        )
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.KeyStatusResponse)
    def DropDiskReplicas(self, request):
        if problem := self._disk_objects_problem(request):
            return problem
        self.state.tiering.drop_disk_replicas(
            request.segment_id, list(request.namespaces), list(request.keys), list(request.disk_locations)
        )
        return pb.KeyStatusResponse(status=Status.OK)

    # -------------------------------------------------------------- commit log and recovery

    @rpc(pb.PollCommitsResponse)
    def PollCommits(self, request):
        """Non-blocking: acknowledge, then the notices queued now (the gRPC servicer adds the long poll)."""
        notices = self.state.commits.poll(request.segment_id, request.acked_seq, request.max_notices or 4096)
        if notices is None:
            return pb.PollCommitsResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        reply = pb.PollCommitsResponse(status=Status.OK, epoch=self.epoch, first_seq=notices.first_seq)
        if notices.items:
            fill_notices(reply, notices.items, self.state.clock, self.state.groups)
        return reply

    @rpc(pb.KeyStatusResponse)
    def ReportDramObjects(self, request):
        segment = self.state.segments.get(request.segment_id)
        if segment is None:
            return pb.KeyStatusResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        columns = (  # DramObjects' fields after the namespaces, in order
            request.keys,
            request.sizes,
            request.checksums,
            request.offsets,
            request.instances,
            request.ranks,
            request.pins,
            request.pin_ttl_ms,
        )
        count = len(request.namespaces)
        groups = (request.group_ids, request.group_sizes)  # empty when no object is a group's member
        if any(len(column) != count for column in columns) or any(len(c) not in (0, count) for c in groups):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="parallel arrays differ in length")
        if len(groups[0]) != len(groups[1]):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="group ids and sizes differ in length")
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        statuses = report_dram_objects(
            self.state,
            request.segment_id,
            DramObjects(request.namespaces, *columns, *groups),
        )
        if request.done:
            inventory_done(self.state, request.segment_id)
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)


def fill_notices(
    reply: pb.PollCommitsResponse,
    items: list[tuple[int, ObjectRecord, bool]],
    clock: Callable[[], float],
    groups: GroupTable | None = None,
) -> None:
    """Commit-log notices into a PollCommitsResponse's columns (a poll's answer, or the notices a
    RelayPutEnd hands back to its segment). Column by column (list comprehensions, bulk extends):
    thousands of notices per poll. With `groups` (when any object is grouped), a commit of a group's
    member names its group (`GroupTable.tag_of`), which the segment keeps for a successor."""
    records = [item[1] for item in items]
    metas = [record.meta for record in records]
    reply.drops.extend([item[2] for item in items])
    reply.offsets.extend([item[0] for item in items])
    reply.sizes.extend([meta >> 32 for meta in metas])
    reply.checksums.extend([meta & 0xFFFF_FFFF for meta in metas])
    reply.names.extend([record.name for record in records])
    owners = [record.owner for record in records]
    if any(owners):
        reply.instances.extend([owner.instance if owner is not None else "" for owner in owners])
        reply.ranks.extend([owner.rank if owner is not None else 0 for owner in owners])
    if any(record.pin_until for record in records):
        now = clock()
        pins = [notice_pin(record, now) for record in records]
        reply.pins.extend([pin for pin, _ in pins])
        reply.pin_ttl_ms.extend([ttl for _, ttl in pins])
    if groups is not None and len(groups):
        tags = [(0, 0) if drop else groups.tag_of(record) for _, record, drop in items]
        if any(group_id for group_id, _ in tags):
            reply.group_ids.extend([group_id for group_id, _ in tags])
            reply.group_sizes.extend([size for _, size in tags])
