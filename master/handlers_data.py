"""The client handlers of `MasterHandlers` (kvtier.master.handlers): hello, puts, reads, existence,
removal, corruption reports and instance registration."""

from __future__ import annotations

from kvtier.common.logs import request_id as current_request_id
from kvtier.master.auth import current_principal
from kvtier.master.commits import FENCED_RELAY, PutAcknowledgement
from kvtier.master.corrupt import CorruptReport
from kvtier.master.events import EventKind, Watcher
from kvtier.master.gates import rpc
from kvtier.master.handlers_segment import fill_notices
from kvtier.master.inspection import disk_only_hits
from kvtier.master.prefetch import prefetch
from kvtier.master.quotas import instance_problem
from kvtier.master.state import PutOptions
from kvtier.proto import master_pb2 as pb
from kvtier.proto.auth import CLUSTER_PRINCIPAL
from kvtier.proto.frames import Op
from kvtier.proto.keys import check_namespace, name_prefix
from kvtier.proto.status import Status

# Segments a PutStart may ask to avoid, and failure entries a report may carry: the rest is ignored
# (a client tracks at most kvtier.client.failures.MAX_SEGMENTS).
MAX_AVOID = 256
_EVENT_KINDS = frozenset(int(kind) for kind in EventKind)
# The hot calls' OK as a plain int: protobuf takes an IntEnum member measurably slower (session 9).
_OK = int(Status.OK)
# Notices before a RelayPutEnd's own that its answer carries at most (the rest come with the feed).
RELAY_BACKLOG = 1024


def _no_wake() -> None:
    """A watcher's wake until the servicer gives it its own."""


class DataCalls:
    """Clients' RPCs; mixed into `MasterHandlers`, whose state and counters they use."""

    def _release_leases(self, request) -> None:
        """The reads of `request.released_leases` are over (piggybacked on the caller's next
        request): their ranges are reusable at once (kvtier.master.leases). Only cluster
        credentials get releasable leases, so only theirs are honoured."""
        if request.released_leases and current_principal.get() == CLUSTER_PRINCIPAL:
            self.state.leases.release(request.released_leases)

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

    # -------------------------------------------------------------- objects

    @rpc(pb.PutStartResponse)
    def PutStart(self, request):
        self._release_leases(request)
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.PutStartResponse):
            return rejected
        if len(request.sizes) != len(request.keys):
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error="keys and sizes differ in length")
        if request.replicas < 1:
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error="replicas must be at least 1")
        if request.pin not in (pb.PIN_NONE, pb.PIN_SOFT, pb.PIN_HARD):
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error=f"unknown pin value {request.pin}")
        if problem := instance_problem(request.instance):
            return pb.PutStartResponse(status=Status.INVALID_ARGUMENT, error=problem)
        options = PutOptions(
            instance=request.instance,
            rank=request.rank,
            pin=request.pin,
            pin_ttl_s=request.pin_ttl_ms / 1000,
            preferred_segment=request.preferred_segment,
            client_host=request.client_host,
            avoid_segments=frozenset(request.avoid_segments[:MAX_AVOID]),
            overwrite=request.overwrite,
            lease_s=request.lease_ms / 1000,
        )
        started = self.state.clock()
        result = self.state.put_start(namespace, request.keys, request.sizes, request.replicas, options)
        self.put_held = self.state.pressure.hold(namespace, request, options, result, started)
        return self.put_reply(request, result, 0.0) if self.put_held is None else pb.PutStartResponse()

    def put_reply(self, request, result, waited_s: float):
        """The PutStartResponse of `result`; `waited_s` after its first allocation (backpressure),
        which its write grant has used up: tags never outlive the ranges' reservation (_reuse_at)."""
        reply = pb.PutStartResponse(
            status=_OK,
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
        self._release_leases(request)
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        if len(request.checksums) != len(request.keys):
            return pb.KeyStatusResponse(status=Status.INVALID_ARGUMENT, error="keys and checksums differ in length")
        # Checked again once the segments acknowledged (CommitWaiter.finish): taken by the next
        # barrier(), which the caller asks for right after this returns, on this thread.
        self.put_ack = ack = PutAcknowledgement()
        self.state.commits.waiting_puts.add(ack)  # until answered (a segment dropped meanwhile fences them)
        chunks = request.chunk_checksums  # verified ranged reads (kvtier.proto.chunks): per key, or none
        if chunks and (len(chunks) != len(request.keys) or any(len(b) % 4 for b in chunks)):
            return pb.KeyStatusResponse(
                status=Status.INVALID_ARGUMENT, error="chunk_checksums: one blob of 4 bytes per chunk for each key"
            )
        if request.group:  # all members visible in this one step, or none (kvtier.master.groups)
            ack.group = True
            statuses = self.state.groups.put_end(
                namespace, request.keys, request.checksums, request.put_id, ack.committed
            )
        else:
            statuses = self.state.put_end(namespace, request.keys, request.checksums, request.put_id, ack.committed)
        # Its answer waits for every notice about its keys: the commits it made, an earlier version's
        # drop, and the commit a key answered OK without one was made by (a retried PutEnd, the
        # client's own after a relay it never heard, a group member another put completed).
        prefix = name_prefix(namespace)
        self.barrier_names = [prefix + key for key in request.keys]
        if chunks:  # kept with the records committed now, before any reader can see them (this is sync)
            for i, record, _ in ack.committed:
                record.keep_chunk_crcs(chunks[i])
        return pb.KeyStatusResponse(status=_OK, statuses=statuses)

    # PutEnd's handler without its gate: RelayPutEnd runs it inside its own (one count, one latency).
    _put_end = PutEnd.__wrapped__  # type: ignore[attr-defined]

    @rpc(pb.RelayPutEndResponse)
    def RelayPutEnd(self, request):
        """A client's PutEnd relayed by the segment it wrote to (cluster credentials: the rpc gate
        refuses anyone else). Checked as the client's own call: its token's principal and rights. The
        segment's own notices of this call go back in the answer; `relayed_by` leaves the segment out
        of the wait (kvtier.master.commit_wait): it applies them, after every earlier one, before the
        client hears OK, so "acknowledged means in an index" holds as for a direct PutEnd."""
        segment_id = request.segment_id
        commits = self.state.commits
        if request.epoch != self.epoch or self.state.segments.get(segment_id) is None:
            return pb.RelayPutEndResponse(
                status=Status.SEGMENT_NOT_FOUND, error="the relaying segment is not mounted under this epoch"
            )
        principal = self.auth.principal(request.token) if self.auth.enabled else CLUSTER_PRINCIPAL
        if not principal:
            return pb.RelayPutEndResponse(status=Status.UNAUTHENTICATED, error="the client's token proves no principal")
        put_end = request.put_end
        if principal != CLUSTER_PRINCIPAL and (denied := self.auth.refusal(principal, "PutEnd", put_end)):
            self.denied["PutEnd"] += 1
            return pb.RelayPutEndResponse(status=Status.PERMISSION_DENIED, error=denied)
        commits.ack(segment_id, request.acked_seq)
        if self.state.direct_reads_fenced():
            # A dropped segment may still serve direct reads: this answer would wait for that longer
            # than the relay waits. The client sends its PutEnd itself (and that one waits).
            return pb.RelayPutEndResponse(status=Status.UNAVAILABLE, error=FENCED_RELAY)
        first = commits.next_seq(segment_id)
        token = current_principal.set(principal)  # whose leases it may release (_release_leases)
        traced = current_request_id.set(put_end.request_id)  # the client's call id, for its log lines
        commits.relaying = segment_id  # its notices come back in the answer: its long poll sleeps on
        try:
            ended = self._put_end(put_end)  # PutEnd's own handler, inside this call's gate (no second one)
        finally:
            commits.relaying = 0
            current_request_id.reset(traced)
            current_principal.reset(token)
        reply = pb.RelayPutEndResponse(status=ended.status, error=ended.error, statuses=ended.statuses)
        if ended.status == _OK:
            self.relayed_by = segment_id
            # From the segment's first unacknowledged notice, not just this call's: the segment
            # applies an answer only after every earlier notice, and another relay's answer (parked
            # for other segments, or on another link) may bring those later than this one arrives.
            # Repeats are skipped there; a long backlog is left to the feed.
            first = max(commits.first_unacked(segment_id), first - RELAY_BACKLOG)
            notices = reply.notices
            notices.status, notices.epoch, notices.first_seq = _OK, self.epoch, first
            if items := commits.since(segment_id, first):
                fill_notices(notices, items, self.state.clock, self.state.groups)
        return reply

    @rpc(pb.KeyStatusResponse)
    def PutRevoke(self, request):
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.KeyStatusResponse):
            return rejected
        statuses = self.state.put_revoke(namespace, request.keys, request.put_id)
        return pb.KeyStatusResponse(status=Status.OK, statuses=statuses)

    @rpc(pb.GetReplicasResponse)
    def GetReplicas(self, request):
        self._release_leases(request)
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.GetReplicasResponse):
            return rejected
        releasable = request.releasable and current_principal.get() == CLUSTER_PRINCIPAL  # kvtier.master.leases
        if request.group:  # every member or a miss for every member (kvtier.master.groups)
            r = self.state.groups.get_replicas(namespace, request.keys, releasable)
        else:
            r = self.state.get_replicas(namespace, request.keys, releasable)
        self.lookup_keys["GetReplicas"] += len(request.keys)
        self.lookup_hits["GetReplicas"] += r.statuses.count(0)
        self.lookup_hits_disk_only += disk_only_hits(r.replica_counts, r.replica_tiers)
        reply = pb.GetReplicasResponse(
            status=_OK,
            statuses=r.statuses,
            sizes=r.sizes,
            checksums=r.checksums,
            replica_counts=r.replica_counts,
            replica_segments=r.replica_segments,
            replica_offsets=r.replica_offsets,
            replica_tiers=r.replica_tiers,
            segments=self._endpoints(r.replica_segments),
            lease_ms=r.lease_ms,
            lease_id=r.lease_id,
        )
        if request.with_chunk_checksums:  # ranged reads: the records just answered (nothing ran in between)
            prefix = name_prefix(namespace)
            for key, status in zip(request.keys, r.statuses, strict=True):
                record = self.state.visible(prefix + key) if status == Status.OK else None
                reply.chunk_checksums.append(record.chunk_crcs if record is not None else b"")
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
        self._release_leases(request)
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.ExistsResponse):
            return rejected
        found, prefix = self.state.exists(namespace, request.keys)
        prefetch(self.state, namespace, request.keys, found, request.prefetch)  # kvtier.master.prefetch
        self.lookup_keys["Exists"] += len(request.keys)
        self.lookup_hits["Exists"] += found.count(True)
        return pb.ExistsResponse(status=_OK, exists=found, prefix_count=prefix)

    @rpc(pb.RemoveResponse)
    def Remove(self, request):
        self._release_leases(request)
        namespace = check_namespace(request.namespace)
        if rejected := self._too_many(request.keys, pb.RemoveResponse):
            return rejected
        prefix = name_prefix(namespace)
        self.barrier_names = [prefix + key for key in request.keys]
        statuses = self.state.remove(namespace, request.keys, request.force)
        return pb.RemoveResponse(status=_OK, statuses=statuses, removed=statuses.count(0))

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

    @rpc(pb.SegmentFailuresResponse)
    def ReportSegmentFailures(self, request):
        """Advice about segments clients cannot use (kvtier.master.quarantine): always OK."""
        failures = [(f.segment, f.count, f.kind) for f in request.failures[:MAX_AVOID]]
        quarantined = self.state.report_segment_failures(failures, request.reporter[:64])
        return pb.SegmentFailuresResponse(status=Status.OK, quarantined=quarantined)

    @rpc(pb.RemoveResponse)
    def RemovePrefix(self, request):
        """Starts the removal (hidden from every reader at once); unless it finished here, the
        caller awaits `take_removal()` before answering (kvtier.master.commit_wait.after_removal)."""
        namespace = check_namespace(request.namespace)  # (a sweep's names: its answer waits for every notice)
        removal = self.state.start_remove_prefix(namespace, request.prefix)
        if not removal.done:
            self.removal = removal
        return pb.RemoveResponse(status=Status.OK, removed=removal.removed)

    def take_removal(self):
        """The prefix removal the last RemovePrefix began and left running, once (None if none)."""
        removal, self.removal = self.removal, None
        return removal

    @rpc(pb.Event)
    def WatchEvents(self, request):
        """Subscribes a watcher (kvtier.master.events); the servicer streams its events once it
        took it (`take_watcher`). Else the refusal, for the stream's EVENT_END: INVALID_ARGUMENT,
        WATCH_EPOCH_CHANGED (`since` of another epoch), WATCH_MISSED, TOO_MANY_WATCHERS,
        EVENTS_DISABLED (and, from the gate, UNAVAILABLE on a standby, PERMISSION_DENIED)."""
        if request.namespace:
            check_namespace(request.namespace)
        kinds = set(request.kinds)
        if unknown := kinds - _EVENT_KINDS:
            return pb.Event(status=Status.INVALID_ARGUMENT, error=f"unknown event kinds {sorted(unknown)}")
        if request.since and not request.epoch:
            return pb.Event(
                status=Status.INVALID_ARGUMENT,
                error="since needs the epoch of the events it counts from (every event carries it)",
            )
        if request.since and request.epoch != self.epoch:
            return pb.Event(
                status=Status.WATCH_EPOCH_CHANGED,
                error=f"since={request.since} is a seq of master epoch {request.epoch}, this is epoch {self.epoch} "
                "(a restart or failover): events were missed, resync",
            )
        principal = current_principal.get()
        tenant = "" if principal == CLUSTER_PRINCIPAL else principal  # each tenant has slots of its own
        watcher = self.state.events.watch(request.namespace, request.prefix, request.since, kinds, _no_wake, tenant)
        if not isinstance(watcher, Watcher):
            status, words = watcher
            return pb.Event(status=status, error=words)
        self.watcher = watcher
        return pb.Event(status=Status.OK, epoch=self.epoch)

    def take_watcher(self) -> Watcher | None:
        """The watcher the last WatchEvents subscribed, once (None when it refused)."""
        watcher, self.watcher = self.watcher, None
        return watcher

    @rpc(pb.RegisterInstanceResponse)
    def RegisterInstance(self, request):
        try:
            quota = self.state.register_instance(
                request.instance, request.tp_size, request.pp_size, request.budget_bytes
            )
        except ValueError as exc:
            return pb.RegisterInstanceResponse(status=Status.INVALID_ARGUMENT, error=str(exc))
        return pb.RegisterInstanceResponse(status=Status.OK, quota_per_rank=quota)
