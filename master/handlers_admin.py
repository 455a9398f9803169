"""The operator handlers of `MasterHandlers` (kvtier.master.handlers): drain and migration, quotas,
status, and the read-only inspection calls (`ListKeys`, `StatKeys`, over kvtier.master.inspection).
Inspection calls are data calls: a standby or a recovering master refuses them with UNAVAILABLE."""

from __future__ import annotations

from kvtier.master.gates import rpc
from kvtier.master.inspection import list_keys, stat_keys
from kvtier.master.records import replica_offset, replica_segment, replica_tier
from kvtier.master.replicas import remove_replicas
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op
from kvtier.proto.keys import check_key, check_namespace
from kvtier.proto.status import Status


class AdminCalls:
    """Operators' RPCs; mixed into `MasterHandlers`, whose state and counters they use."""

    @rpc(pb.DrainSegmentResponse)
    def DrainSegment(self, request):
        drainer = self.state.drainer
        if request.cancel:
            status, objects_left, bytes_left, state, disk_left = drainer.cancel(request.segment)
        else:
            status, objects_left, bytes_left, state, disk_left = drainer.drain(
                request.segment, request.finish, request.if_draining, request.status_only
            )
        if status == Status.INVALID_ARGUMENT:
            error = (
                f"segment {request.segment!r} is {state}, not DRAINING (its drain was cancelled, it is still "
                "reporting its inventory, or it mounted again since): drain it again"
            )
        else:
            error = "" if status == Status.OK else f"no segment named {request.segment!r}"
        return pb.DrainSegmentResponse(
            status=status,
            error=error,
            objects_left=objects_left,
            bytes_left=bytes_left,
            state=state,
            ssd_objects_left=disk_left,
            incarnation=drainer.incarnation_of(request.segment),
        )

    @rpc(pb.MigrateStartResponse)
    def MigrateStart(self, request):
        """A drain's batch of `segment`'s objects or, with `keys`, a replica copy/move of those keys."""
        if request.keys:
            if rejected := self._too_many(request.keys, pb.MigrateStartResponse):
                return rejected
            keys = [check_key(key) for key in request.keys]
            status, batch = self.state.drainer.migrate_keys(
                check_namespace(request.namespace), keys, request.segment, request.target, request.keep_source
            )
            if batch is None:
                names = f"segment {request.target!r}" + (f" or {request.segment!r}" if request.segment else "")
                reason = "takes no new replicas (draining)" if status == Status.INVALID_ARGUMENT else "does not exist"
                return pb.MigrateStartResponse(status=status, error=f"{names} {reason}")
        else:
            keys = []
            status, batch = self.state.drainer.migrate_start(request.segment, request.max_objects or 256)
            if batch is None:
                reason = "is not draining" if status == Status.INVALID_ARGUMENT else "does not exist"
                return pb.MigrateStartResponse(status=status, error=f"segment {request.segment!r} {reason}")
        reply = pb.MigrateStartResponse(
            status=Status.OK,
            migration_id=batch.migration_id,
            source_segment=batch.source_segment,
            more=batch.more,
            waiting=batch.waiting,
        )
        no_space = int(Status.NO_SPACE)
        items = iter(batch.items)
        for position in range(len(keys) or len(batch.items)):
            if (refused := batch.refused.get(position)) is not None:  # keyed: this key does not move
                reply.namespaces.append(request.namespace)
                reply.keys.append(keys[position])
                reply.statuses.append(refused)
                for column in (reply.sizes, reply.checksums, reply.source_offsets, reply.source_segments):
                    column.append(0)
                reply.source_tiers.append(pb.DRAM)
                reply.target_segments.append(0)
                reply.target_offsets.append(0)
                continue
            item = next(items)
            record = item.record
            reply.namespaces.append(record.namespace)
            reply.keys.append(record.key)
            reply.sizes.append(record.size)
            reply.checksums.append(record.checksum)
            reply.source_offsets.append(replica_offset(item.source))
            reply.source_segments.append(replica_segment(item.source))
            reply.source_tiers.append(replica_tier(item.source))  # TIER_* are the proto's Tier values
            reply.statuses.append(0 if item.target is not None else no_space)
            reply.target_segments.append(replica_segment(item.target) if item.target is not None else 0)
            reply.target_offsets.append(replica_offset(item.target) if item.target is not None else 0)
        moving = [i for i, status in enumerate(reply.statuses) if status == 0]
        segment_ids = [batch.source_segment, *(reply.source_segments[i] for i in moving)]
        segment_ids += [reply.target_segments[i] for i in moving]
        reply.segments.extend(self._endpoints(segment_ids))
        # Read the source, write the target, while the migration's lease holds (the frames' deadline).
        reply.tag_expiry_ms = self.minter.expiry_in(self.state.config.lease_s)
        if self.minter.enabled:
            reply.source_tags = b"".join(
                self.minter.key(self.state.segments.get(reply.source_segments[i]), self.epoch).tag(
                    Op.READ_DISK if reply.source_tiers[i] == pb.SSD else Op.READ,
                    reply.tag_expiry_ms,
                    reply.source_offsets[i],
                    reply.sizes[i],
                )
                for i in moving
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
        status, statuses, self.moves = self.state.drainer.migrate_end(request.migration_id, moved)
        if status != Status.OK:
            return pb.KeyStatusResponse(status=status, error=f"no migration {request.migration_id} in flight")
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.KeyStatusResponse)
    def RemoveReplicas(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        keys = [check_key(key) for key in request.keys]
        status, statuses = remove_replicas(self.state, namespace, keys, request.segment, request.allow_last)
        if status != Status.OK:
            return pb.KeyStatusResponse(status=status, error=f"no segment named {request.segment!r}")
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

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
        quarantine = self.state.quarantine
        segments = [
            pb.SegmentInfo(
                segment_id=s.segment_id,
                name=s.name,
                host_id=s.host_id,
                endpoints=s.endpoints,
                dram_capacity=s.capacity,
                dram_used=s.used,
                dram_releasing=s.releasing,
                objects=s.objects,
                heartbeat_age_ms=int((now - s.last_heartbeat) * 1000),
                state=s.state.name,
                ssd_capacity=s.ssd_capacity,
                ssd_used=s.ssd_used,
                ssd_objects=s.ssd_objects,
                disk_engine=s.disk_engine,
                offload=s.offload,
                clock_skew_s=s.clock_skew_s,
                clock_skewed=s.clock_skewed,
                quarantined=quarantine.is_quarantined(s.name),
                quarantine_left_s=quarantine.left_s(s.name),
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
            eviction_policy=self.state.policy.name,
        )

    # -------------------------------------------------------------- inspection

    @rpc(pb.ListKeysResponse)
    def ListKeys(self, request):
        r = request
        namespace = check_namespace(r.namespace)
        budget_s = self.state.config.list_page_ms / 1000  # a page holds the loop this long at most
        page = list_keys(self.state, namespace, r.prefix, r.start_after, r.limit, r.include_pending, budget_s)
        return pb.ListKeysResponse(status=Status.OK, entries=page.entries, next_start_after=page.next_start_after)

    @rpc(pb.StatKeysResponse)
    def StatKeys(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.StatKeysResponse):
            return rejected
        statuses, infos = stat_keys(self.state, namespace, request.keys)
        objects = [info or pb.ObjectInfo() for info in infos]
        return pb.StatKeysResponse(status=Status.OK, statuses=statuses, objects=objects)
