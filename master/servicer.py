"""Request plumbing for the master: parse requests, call `MasterState`, build responses.

`MasterHandlers` holds one synchronous method per RPC, named as in
`master.proto`, taking a request message and returning a response message.
Two transports call them: the gRPC servicer (`MasterServicer`, the API) and
the framed fast path (`kvtier.master.fastpath`) for the hot per-batch calls.
Every handler goes through `rpc` (kvtier.master.gates), which counts requests and failures, times
the call, logs slow or failing ones and turns an unexpected exception into an
INTERNAL response. Handlers contain no logic beyond wire-form validation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.master import inspection_rpc
from kvtier.master.auth import Authenticator
from kvtier.master.backpressure import HeldPut, PutWaiter
from kvtier.master.capabilities import Minter
from kvtier.master.commits import PutAcknowledgement, notice_pin
from kvtier.master.corrupt import CorruptReport
from kvtier.master.gates import DATA, rpc
from kvtier.master.inspection import disk_only_hits
from kvtier.master.prefetch import prefetch
from kvtier.master.records import replica_offset, replica_segment
from kvtier.master.recovery import DramObjects, inventory_done, report_dram_objects
from kvtier.master.state import MasterState, PutOptions
from kvtier.master.tiering import TierTask
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.frames import Op
from kvtier.proto.keys import check_namespace
from kvtier.proto.latency import LatencyHistogram
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

# Per-segment byte counters a heartbeat carries and Status repeats (see HeartbeatRequest).
_IO_COUNTERS = ("dram_bytes_served", "ssd_bytes_served", "disk_bytes_read", "ssd_bytes_offloaded")


class Leadership:
    """Whether this master may act, and who leads. Standalone: always the leader.
    With etcd, kvtier.master.election supplies both (the server wires it in)."""

    def is_leader(self) -> bool:
        return True

    def leader(self) -> str:
        return ""


class MasterHandlers:
    def __init__(self, state: MasterState, epoch: int, leadership: Leadership | None = None) -> None:
        self.state = state
        self.epoch = epoch
        self.leadership = leadership or Leadership()
        self.auth = Authenticator(None)  # the server installs the configured one (kvtier.master.auth)
        self.minter = Minter(None)  # data-plane capabilities (kvtier.master.capabilities), with a secret
        self.denied: Counter[str] = Counter()  # calls refused PERMISSION_DENIED, per RPC
        self.fast_endpoint = ""  # set by the server once the fast path listens
        self.requests: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # answered UNAVAILABLE: standby or recovering
        self.latency: dict[str, LatencyHistogram] = {}  # handler time per RPC (kvtier_master_rpc_latency_seconds)
        self.lookup_keys: Counter[str] = Counter()  # keys asked by Exists / GetReplicas
        self.lookup_hits: Counter[str] = Counter()  # of those, found complete (a lookup hit, not bytes served)
        self.lookup_hits_disk_only = 0  # GetReplicas hits without a DRAM copy: read from an SSD tier
        self.put_ack: PutAcknowledgement | None = None  # of the PutEnd just handled
        self.puts_lost = 0  # keys a PutEnd committed whose segment was lost before the answer
        self.put_held: HeldPut | None = None  # of the PutStart just handled, when keys wait for offload
        self.put_waiter = PutWaiter(self)  # both doors await it for a held PutStart

    def take_put_hold(self) -> HeldPut | None:
        """After PutStart: the put whose answer must wait for offload (kvtier.master.backpressure)."""
        held, self.put_held = self.put_held, None
        return held

    def events(self) -> dict[str, int]:
        """Tiering, commit-log and returning-segment counters (Status's `tiering`, kvtier_master_tiering)."""
        state = self.state
        return (
            dict(state.tiering.counters)
            | dict(state.commits.counters)
            | state.pressure.counters()
            | {
                # returning segments (master/fences.py), and PutEnd keys whose segment was lost meanwhile
                "fence_copies_readopted": state.fences.readopted,
                "fence_copies_refused": state.fences.refused,
                "fence_overflows": state.fences.overflows,
                "put_keys_lost_with_segment": self.puts_lost,
            }
        )

    def _refusal(self, gate: str) -> str:
        """Why this master may not answer an RPC of `gate` now ("" = it may)."""
        if not self.leadership.is_leader():
            return f"not the leader; leader={self.leadership.leader()}"
        if gate is DATA and not self.state.serving:
            recovery = self.state.recovery
            return (
                f"master epoch {self.epoch} is recovering: {len(recovery.reported & recovery.expected)} of "
                f"{len(recovery.expected)} segment inventories in; retry"
            )
        return ""

    @property
    def role(self) -> str:
        if not self.leadership.is_leader():
            return "standby"
        return "leader" if self.state.serving else "recovering"

    def _too_many(self, keys: Iterable[str], response_type: type) -> Any | None:
        count = len(keys)  # type: ignore[arg-type]
        limit = self.state.config.max_batch_keys
        if count > limit:
            return response_type(
                status=Status.BATCH_TOO_LARGE, error=f"{count} keys in one request; the limit is {limit}"
            )
        return None

    def _endpoints(self, segment_ids: Iterable[int]) -> list[pb.SegmentEndpoint]:
        out = []
        for segment_id in set(segment_ids):
            segment = self.state.segments.get(segment_id)
            if segment is not None:
                out.append(
                    pb.SegmentEndpoint(
                        segment_id=segment_id, name=segment.name, host_id=segment.host_id, endpoints=segment.endpoints
                    )
                )
        return out

    # -------------------------------------------------------------- segments

    @rpc(pb.HelloResponse)
    def Hello(self, request):
        config = self.state.config
        return pb.HelloResponse(
            status=Status.OK,
            cluster_id=config.cluster_id,
            master_epoch=str(self.epoch),
            fast_endpoint=self.fast_endpoint,
            max_batch_keys=config.max_batch_keys,
            lease_ms=int(config.lease_s * 1000),
            epoch=self.epoch,
            role=self.role,
            leader=self.leadership.leader(),
        )

    @rpc(pb.MountSegmentResponse)
    def MountSegment(self, request):
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
        )
        if result.segment is None:
            return pb.MountSegmentResponse(status=result.status, error=result.error)
        config = self.state.config
        return pb.MountSegmentResponse(
            status=Status.OK,
            segment_id=result.segment.segment_id,
            heartbeat_interval_ms=int(config.heartbeat_interval_s * 1000),
            ttl_ms=int(config.segment_ttl_s * 1000),
            master_epoch=str(self.epoch),
            epoch=self.epoch,
            discard_index=result.discard_index,
        )

    @rpc(pb.UnmountSegmentResponse)
    def UnmountSegment(self, request):
        return pb.UnmountSegmentResponse(status=self.state.unmount_segment(request.segment_id))

    @rpc(pb.HeartbeatResponse)
    def Heartbeat(self, request):
        counters = {name: getattr(request, name) for name in _IO_COUNTERS}
        status = self.state.heartbeat(request.segment_id, request.ssd_used, counters)
        return pb.HeartbeatResponse(status=status, master_epoch=str(self.epoch), epoch=self.epoch)

    # -------------------------------------------------------------- objects

    @rpc(pb.PutStartResponse)
    def PutStart(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.PutStartResponse):
            return rejected
        if len(request.sizes) != len(request.keys):
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error="keys and sizes differ in length")
        if request.replicas < 1:
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error="replicas must be at least 1")
        if request.pin not in (pb.PIN_NONE, pb.PIN_SOFT, pb.PIN_HARD):
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error=f"unknown pin value {request.pin}")
        options = PutOptions(
            instance=request.instance,
            rank=request.rank,
            pin=request.pin,
            pin_ttl_s=request.pin_ttl_ms / 1000,
            preferred_segment=request.preferred_segment,
            client_host=request.client_host,
        )
        started = self.state.clock()
        result = self.state.put_start(namespace, request.keys, request.sizes, request.replicas, options)
        self.put_held = self.state.pressure.hold(namespace, request, options, result, started)
        return self.put_reply(request, result, 0.0) if self.put_held is None else pb.PutStartResponse()

    def put_reply(self, request, result, waited_s: float):
        """The PutStartResponse of `result`; `waited_s` after its first allocation (backpressure),
        which its write grant has used up: tags never outlive the ranges' reservation (_reuse_at)."""
        reply = pb.PutStartResponse(
            status=Status.OK,
            error=result.first_error,
            statuses=result.statuses,
            replica_counts=result.replica_counts,
            replica_segments=result.replica_segments,
            replica_offsets=result.replica_offsets,
            segments=self._endpoints(result.replica_segments),
            put_id=result.put_id,
        )
        if result.replica_segments:  # writable for capability_ttl_s (_reuse_at); frames carry the deadline
            reply.tag_expiry_ms = self.minter.expiry_in(self.state.capability_ttl_s - waited_s)
        if self.minter.enabled and result.replica_segments:
            reply.replica_tags = self.minter.replica_tags(
                self.state.segments.get, self.epoch, result.replica_counts, result.replica_segments,
                result.replica_offsets, request.sizes, reply.tag_expiry_ms, op=Op.WRITE,
            )  # fmt: skip
        return reply

    @rpc(pb.KeyStatusResponse)
    def PutEnd(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        if len(request.checksums) != len(request.keys):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="keys and checksums differ in length")
        # Checked again once the segments acknowledged (CommitWaiter.finish): taken by the next
        # barrier(), which the caller asks for right after this returns, on this thread.
        self.put_ack = ack = PutAcknowledgement()
        statuses = self.state.put_end(namespace, request.keys, request.checksums, request.put_id, ack.committed)
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.KeyStatusResponse)
    def PutRevoke(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        statuses = self.state.put_revoke(namespace, request.keys, request.put_id)
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.GetReplicasResponse)
    def GetReplicas(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.GetReplicasResponse):
            return rejected
        r = self.state.get_replicas(namespace, request.keys)
        self.lookup_keys["GetReplicas"] += len(request.keys)
        self.lookup_hits["GetReplicas"] += r.statuses.count(0)
        self.lookup_hits_disk_only += disk_only_hits(r.replica_counts, r.replica_tiers)
        reply = pb.GetReplicasResponse(
            status=Status.OK,
            statuses=r.statuses,
            sizes=r.sizes,
            checksums=r.checksums,
            replica_counts=r.replica_counts,
            replica_segments=r.replica_segments,
            replica_offsets=r.replica_offsets,
            replica_tiers=r.replica_tiers,
            segments=self._endpoints(r.replica_segments),
            lease_ms=r.lease_ms,
        )
        # The lease is what keeps the bytes in place: the frames' deadline (and the tags) end with it.
        reply.tag_expiry_ms = self.minter.expiry_in(r.lease_ms / 1000)
        if self.minter.enabled:
            reply.replica_tags = self.minter.replica_tags(
                self.state.segments.get, self.epoch, r.replica_counts, r.replica_segments, r.replica_offsets, r.sizes,
                reply.tag_expiry_ms, tiers=r.replica_tiers,
            )  # fmt: skip
        return reply

    @rpc(pb.ExistsResponse)
    def Exists(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.ExistsResponse):
            return rejected
        found, prefix = self.state.exists(namespace, request.keys)
        prefetch(self.state, namespace, request.keys, found, request.prefetch)  # kvtier.master.prefetch
        self.lookup_keys["Exists"] += len(request.keys)
        self.lookup_hits["Exists"] += found.count(True)
        return pb.ExistsResponse(status=Status.OK, exists=found, prefix_count=prefix)

    @rpc(pb.RemoveResponse)
    def Remove(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.RemoveResponse):
            return rejected
        statuses = self.state.remove(namespace, request.keys)
        return pb.RemoveResponse(status=Status.OK, statuses=statuses, removed=statuses.count(0))

    @rpc(pb.KeyStatusResponse)
    def ReportCorrupt(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        columns = (request.segment_ids, request.tiers, request.offsets, request.checksums)
        if any(len(column) != len(request.keys) for column in columns):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="parallel arrays differ in length")
        names = request.segment_names
        if names and len(names) != len(request.keys):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="parallel arrays differ in length")
        reports = [
            CorruptReport(key, segment_id, tier, offset, checksum, names[i] if names else "")
            for i, (key, segment_id, tier, offset, checksum) in enumerate(zip(request.keys, *columns, strict=True))
        ]
        return pb.KeyStatusResponse(status=Status.OK, statuses=self.state.corrupt.report(namespace, reports))

    @rpc(pb.RemoveResponse)
    def RemovePrefix(self, request):
        namespace = check_namespace(request.namespace)
        return pb.RemoveResponse(status=Status.OK, removed=self.state.remove_prefix(namespace, request.prefix))

    @rpc(pb.DrainSegmentResponse)
    def DrainSegment(self, request):
        status, objects_left, bytes_left, state = self.state.drainer.drain(request.segment, request.finish)
        error = "" if status == Status.OK else f"no segment named {request.segment!r}"
        return pb.DrainSegmentResponse(
            status=status, error=error, objects_left=objects_left, bytes_left=bytes_left, state=state
        )

    @rpc(pb.MigrateStartResponse)
    def MigrateStart(self, request):
        status, batch = self.state.drainer.migrate_start(request.segment, request.max_objects or 256)
        if batch is None:
            reason = "is not draining" if status == Status.INVALID_ARGUMENT else "does not exist"
            return pb.MigrateStartResponse(status=status, error=f"segment {request.segment!r} {reason}")
        reply = pb.MigrateStartResponse(
            status=Status.OK, migration_id=batch.migration_id, source_segment=batch.source_segment
        )
        no_space = int(Status.NO_SPACE)
        for item in batch.items:
            record = item.record
            reply.namespaces.append(record.namespace)
            reply.keys.append(record.key)
            reply.sizes.append(record.size)
            reply.checksums.append(record.checksum)
            reply.source_offsets.append(replica_offset(item.source))
            reply.statuses.append(0 if item.target is not None else no_space)
            reply.target_segments.append(replica_segment(item.target) if item.target is not None else 0)
            reply.target_offsets.append(replica_offset(item.target) if item.target is not None else 0)
        segment_ids = [batch.source_segment] + [replica_segment(i.target) for i in batch.items if i.target is not None]
        reply.segments.extend(self._endpoints(segment_ids))
        # Read the source, write the target, while the migration's lease holds (the frames' deadline).
        reply.tag_expiry_ms = self.minter.expiry_in(self.state.config.lease_s)
        if self.minter.enabled:
            moving = [i for i, status in enumerate(reply.statuses) if status == 0]
            source = self.minter.key(self.state.segments.get(batch.source_segment), self.epoch)
            reply.source_tags = b"".join(
                source.tag(Op.READ, reply.tag_expiry_ms, reply.source_offsets[i], reply.sizes[i]) for i in moving
            )
            reply.target_tags = b"".join(
                self.minter.key(self.state.segments.get(reply.target_segments[i]), self.epoch).tag(
                    Op.WRITE, reply.tag_expiry_ms, reply.target_offsets[i], reply.sizes[i]
                )
                for i in moving
            )
        return reply

    @rpc(pb.KeyStatusResponse)
    def MigrateEnd(self, request):
        if len(request.keys) != len(request.namespaces) or len(request.moved) != len(request.keys):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="namespaces, keys and moved differ")
        moved = {(ns, key): ok for ns, key, ok in zip(request.namespaces, request.keys, request.moved, strict=True)}
        status, statuses = self.state.drainer.migrate_end(request.migration_id, moved)
        if status != Status.OK:
            return pb.KeyStatusResponse(status=status, error=f"no migration {request.migration_id} in flight")
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.RegisterInstanceResponse)
    def RegisterInstance(self, request):
        try:
            quota = self.state.register_instance(
                request.instance, request.tp_size, request.pp_size, request.budget_bytes
            )
        except ValueError as exc:
            return pb.RegisterInstanceResponse(status=Status.INVALID_ARGUMENT, error=str(exc))
        return pb.RegisterInstanceResponse(status=Status.OK, quota_per_rank=quota)

    def _quota_infos(self) -> list[pb.QuotaInfo]:
        return [
            pb.QuotaInfo(
                instance=o.instance,
                rank=o.rank,
                quota=o.quota,
                used=o.used,
                objects=o.objects,
                tp_size=o.tp_size,
                pp_size=o.pp_size,
            )
            for o in self.state.quotas.snapshot()
        ]

    @rpc(pb.QuotasResponse)
    def Quotas(self, request):
        return pb.QuotasResponse(status=Status.OK, quotas=self._quota_infos())

    @rpc(pb.StatusResponse)
    def Status(self, request):
        snap = self.state.snapshot()
        now = self.state.clock()
        segments = [
            pb.SegmentInfo(
                segment_id=s.segment_id,
                name=s.name,
                host_id=s.host_id,
                endpoints=s.endpoints,
                dram_capacity=s.capacity,
                dram_used=s.used,
                objects=s.objects,
                heartbeat_age_ms=int((now - s.last_heartbeat) * 1000),
                state=s.state.name,
                ssd_capacity=s.ssd_capacity,
                ssd_used=s.ssd_used,
                ssd_objects=s.ssd_objects,
                disk_engine=s.disk_engine,
                offload=s.offload,
                **s.io_counters,
            )
            for s in snap.segments
        ]
        return pb.StatusResponse(
            cluster_id=self.state.config.cluster_id,
            master_epoch=str(self.epoch),
            epoch=self.epoch,
            role=self.role,
            leader=self.leadership.leader(),
            recovery=self.state.recovery.figures(now),
            objects=snap.objects,
            pending_puts=snap.pending_puts,
            capacity=sum(s.capacity for s in snap.segments),
            used=sum(s.used for s in snap.segments),
            segments=segments,
            uptime_s=now - self.state.started_at,
            rpc_requests=dict(self.requests),
            rpc_failures=dict(self.failures),
            quotas=self._quota_infos(),
            evictions=[
                pb.EvictionInfo(reason=reason, objects=objects, bytes=size)
                for reason, (objects, size) in sorted(self.state.evictions.items())
            ],
            tiering=self.events(),
            lookup_keys=dict(self.lookup_keys),
            lookup_hits=dict(self.lookup_hits),
            lookup_hits_disk_only=self.lookup_hits_disk_only,
        )

    # -------------------------------------------------------------- tiering

    @rpc(pb.PollTierTasksResponse)
    def PollTierTasks(self, request):
        """Non-blocking: the tasks queued now (the gRPC servicer adds the long poll)."""
        if request.segment_id not in self.state.segments:
            return pb.PollTierTasksResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        reply = pb.PollTierTasksResponse(status=Status.OK, task_ttl_ms=int(self.state.tiering.task_ttl_s * 1000))
        for task in self.state.tiering.poll(request.segment_id, request.max_tasks or 256):
            namespace, _, key = task.name.partition("\x00")
            reply.task_ids.append(task.task_id)
            reply.kinds.append(int(task.kind))
            reply.namespaces.append(namespace)
            reply.keys.append(key)
            reply.sizes.append(task.size)
            reply.checksums.append(task.checksum)
            reply.dram_offsets.append(task.dram_offset)
            reply.disk_locations.append(task.disk_location)
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
        ):
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
        items = notices.items
        if not items:
            return reply
        # Column by column (list comprehensions, bulk extends): thousands of notices per poll.
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
            now = self.state.clock()
            pins = [notice_pin(record, now) for record in records]
            reply.pins.extend([pin for pin, _ in pins])
            reply.pin_ttl_ms.extend([ttl for _, ttl in pins])
        return reply

    @rpc(pb.KeyStatusResponse)
    def ReportDramObjects(self, request):
        segment = self.state.segments.get(request.segment_id)
        if segment is None:
            return pb.KeyStatusResponse(status=Status.SEGMENT_NOT_FOUND, error="segment is not mounted")
        columns = (
            request.keys,
            request.sizes,
            request.checksums,
            request.offsets,
            request.instances,
            request.ranks,
            request.pins,
            request.pin_ttl_ms,
        )
        if any(len(column) != len(request.namespaces) for column in columns):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="parallel arrays differ in length")
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        statuses = report_dram_objects(
            self.state,
            request.segment_id,
            DramObjects(
                request.namespaces,
                request.keys,
                request.sizes,
                request.checksums,
                request.offsets,
                request.instances,
                request.ranks,
                request.pins,
                request.pin_ttl_ms,
            ),
        )
        if request.done:
            inventory_done(self.state, request.segment_id)
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)


# The read-only inspection handlers (ListKeys, StatKeys) live in kvtier.master.inspection_rpc.
for _name, (_response_type, _handler) in inspection_rpc.HANDLERS.items():
    setattr(MasterHandlers, _name, rpc(_response_type)(_handler))

RPC_NAMES = tuple(name for name in pb.DESCRIPTOR.services_by_name["Master"].methods_by_name)


LONG_POLL_MAX_S = 30.0


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
            return type(reply)(status=Status.UNAVAILABLE, error=handlers._refusal(DATA) or "master changed")
        put_ack = barrier.put_ack if isinstance(reply, pb.KeyStatusResponse) else None  # PutEnd's answer only
        if put_ack is not None and (lost := put_ack.settle(state.segments, reply.statuses)):
            # Acknowledged means stored: a segment expelled or replaced during the wait took them.
            handlers.puts_lost += lost
            logger.warning("put not acknowledged: %d keys lost with their segment during PutEnd", lost)
        return reply


class MasterServicer(master_pb2_grpc.MasterServicer):
    """The gRPC face of `MasterHandlers`: every RPC delegates to the handler of the same name.

    `PollTierTasks` and `PollCommits` wait: for work of their segment to be queued, or `wait_ms`.
    `PutEnd` answers once the segments acknowledged its commits (`CommitWaiter`).
    """

    def __init__(self, handlers: MasterHandlers, waiter: CommitWaiter) -> None:
        self.handlers = handlers
        self.waiter = waiter
        self._task_events: dict[int, asyncio.Event] = {}
        self._commit_events: dict[int, asyncio.Event] = {}
        self.save_state: Callable[[], Awaitable[None]] | None = None  # saves what changed, durably
        self.attach(handlers.state)

    def attach(self, state: MasterState) -> None:
        """Hook a (new) state's notifications to the long polls."""
        for event in (*self._task_events.values(), *self._commit_events.values()):
            event.set()  # long polls of the old state's segments answer now (their ids mean nothing here)
        self._task_events.clear()
        self._commit_events.clear()
        state.tiering.notify = self._wake
        state.commits.notify = self._wake_commits
        self.waiter.attach(state)

    def _wake(self, segment_id: int) -> None:
        event = self._task_events.get(segment_id)
        if event is not None:
            event.set()

    def _wake_commits(self, segment_id: int) -> None:
        event = self._commit_events.get(segment_id)
        if event is not None:
            event.set()

    async def _answer_when_acknowledged(self, name: str, request: Any) -> Any:
        reply = getattr(self.handlers, name)(request)
        if reply.status != Status.OK:
            return reply
        barrier = self.waiter.barrier()
        return reply if barrier is None else await self.waiter.finish(reply, barrier)

    async def PutStart(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        reply = self.handlers.PutStart(request)
        held = self.handlers.take_put_hold()
        return reply if held is None else await self.handlers.put_waiter.finish(held)

    async def PutEnd(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("PutEnd", request)

    async def Remove(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("Remove", request)

    async def RemovePrefix(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer_when_acknowledged("RemovePrefix", request)

    async def RegisterInstance(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Answers once the registration is saved: one acknowledged is one a restart keeps."""
        reply = self.handlers.RegisterInstance(request)
        if reply.status == Status.OK and self.save_state is not None:
            await self.save_state()
        return reply

    async def ReportDramObjects(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The last chunk answers once the segment's name is saved: from then on it takes
        allocations, and a restart waits for it."""
        reply = self.handlers.ReportDramObjects(request)
        if request.done and reply.status == Status.OK and self.save_state is not None:
            await self.save_state()
        return reply

    async def PollCommits(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        handlers = self.handlers
        reply = handlers.PollCommits(request)  # applies the acknowledgement at once
        wait_s = min(request.wait_ms / 1000, LONG_POLL_MAX_S)
        if reply.status != Status.OK or reply.offsets or wait_s <= 0:
            return reply
        commits = handlers.state.commits
        event = self._commit_events.setdefault(request.segment_id, asyncio.Event())
        event.clear()
        try:
            if not commits.has_notices(request.segment_id, reply.first_seq - 1):
                await asyncio.wait_for(event.wait(), wait_s)
        except TimeoutError:
            pass
        finally:
            if self._commit_events.get(request.segment_id) is event:
                del self._commit_events[request.segment_id]
        request.acked_seq = reply.first_seq - 1
        return handlers.PollCommits(request)

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


_AWAITED = ("PutStart", "PollTierTasks", "PollCommits", "RegisterInstance", "ReportDramObjects")  # not delegated


def _delegate(name: str):
    async def method(self: MasterServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return getattr(self.handlers, name)(request)

    method.__name__ = name
    return method


for _name in RPC_NAMES:
    if _name not in (*_AWAITED, *WAITING_CALLS):
        setattr(MasterServicer, _name, _delegate(_name))
