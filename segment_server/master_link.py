"""The segment server's control-plane link: mount, inventory, heartbeat, re-mount, unmount.

Runs on its own thread with a synchronous gRPC channel, so heartbeats are
never delayed by data-plane work on the event loop (a field lesson: heartbeats
starved by I/O expire healthy nodes). The loop is a
kvtier.common.poller.MasterPoller: failures back off exponentially from 50 ms
to 0.5 s, with jitter (a restarted master must find its segments back
quickly).

Every mount is followed by the inventory (kvtier.master.recovery): the DRAM
objects of the index kept by kvtier.segment_server.dram_index, then the SSD
tier's disk copies, then `done`. Only then is the mount's session (segment
id, epoch) published to the other threads (commit feed, tier worker).

A new mount happens when the master answers SEGMENT_NOT_FOUND (it expired
us, restarted, or another master was elected). UNAVAILABLE (a standby, or a
leader that lost its lease for a moment) keeps the mount: the link follows
the leader it names, or asks etcd / the next address (see
kvtier.common.discovery), and the next heartbeat tells whether that master
knows us. A mount's answer may say `discard_index`: the master does not take
our DRAM index (it serves already and never fenced us, or it was restarted
since it expelled us and can prove nothing), so it is emptied first. A
master that expelled us and still runs takes the index and keeps every
object nothing touched meanwhile (kvtier.master.fences); the entries it
refuses leave the index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvtier.common.channels import Credentials, open_channel
from kvtier.common.discovery import MasterLocator, leader_hint
from kvtier.common.poller import Backoff, MasterPoller, StopPolling
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.auth import wall_ms
from kvtier.proto.status import Status, status_name
from kvtier.segment_server.dram_index import DramIndex, InventoryRefused, report_dram_inventory
from kvtier.segment_server.keyed_reads import DirectReadLease
from kvtier.segment_server.master_clock import MasterClock, local_s
from kvtier.segment_server.mount_session import MountSession

logger = logging.getLogger(__name__)

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 0.5
_RPC_TIMEOUT_S = 2.0
# A mount refused because another live process holds the name is tried again this long (the name's
# previous process, before a restart, stops holding it within a few heartbeat intervals), then the
# segment exits with the reason (exit code 2: a configuration error; change --name).
NAME_IN_USE_GIVE_UP_S = 10.0
_CREDENTIALS_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_READY_SILENCE_S = 5.0  # unanswered heartbeats for this long: not ready (the master expels later)


class MasterChannels:
    """One gRPC channel to the current master, shared by the segment's threads; follows the leader."""

    def __init__(self, locator: MasterLocator, credentials: Credentials | None = None) -> None:
        self._locator = locator
        self._credentials = credentials or Credentials()
        self._lock = threading.Lock()
        self._address = ""
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def stub(self) -> Any:
        address = self._locator.address
        if not address:
            raise NoLeader()
        with self._lock:
            if address != self._address or self._stub is None:
                if self._channel is not None:
                    self._channel.close()
                self._channel = open_channel(address, self._credentials)
                self._stub = master_pb2_grpc.MasterStub(self._channel)
                self._address = address
                logger.info("master link target=%s", address)
            return self._stub

    def failed(self, error: str = "") -> None:
        """The master did not answer or is not the leader: look for the leader (a hint in `error` wins)."""
        self._locator.refresh(leader_hint(error))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None
        self._locator.close()


class NoLeader(grpc.RpcError):
    """etcd names no leading master right now (an election is under way, or etcd is unreachable)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def __str__(self) -> str:
        return "no leading master known"


class MasterLink:
    def __init__(
        self,
        channels: MasterChannels,
        mount_request: pb.MountSegmentRequest,
        index: DramIndex,
        on_mounted: Callable[[int], None],
        on_fatal: Callable[[str, int], None],
        report: Callable[[], dict[str, int]] | None = None,
        report_disk: Callable[[Any, int, int], None] | None = None,
        clock: MasterClock | None = None,
        lease: DirectReadLease | None = None,
        mount: MountSession | None = None,
        writers: Callable[[], list[tuple[int, int]]] | None = None,
    ) -> None:
        """`report` returns extra HeartbeatRequest fields (SSD usage, byte counters, writers) for each
        heartbeat; `writers` the (offset, length) of same-host copies in progress, sent with each mount
        (kvtier.segment_server.shm_writers); `report_disk(stub, segment_id, epoch)` sends the SSD inventory; `lease` is
        started by each mount and renewed by each acknowledged heartbeat (direct reads); `mount`
        is the data plane's view of the mount: ended before the next mount is asked for, set as
        soon as the master answers it (kvtier.segment_server.mount_session)."""
        self._channels = channels
        self._mount_session = mount or MountSession()
        self._lease = lease or DirectReadLease()
        self._request = mount_request
        self._request.inventory = True
        self._index = index
        self._on_mounted = on_mounted
        self._on_fatal = on_fatal
        self._report = report
        self._report_disk = report_disk
        self._writers = writers
        self._clock = clock or MasterClock()  # fed the master's wall clock by every reply
        self._poller = MasterPoller(
            "master link",
            self._step,
            retryable=(grpc.RpcError, InventoryRefused, _Retry),
            backoff=Backoff(_BACKOFF_MIN_S, _BACKOFF_MAX_S),
            on_failure=self._failed,
            thread_name="kvtier-master-link",
            logger=logger,
        )
        self._interval_s = 1.0
        self._last_heartbeat = time.monotonic()  # of the last heartbeat (or mount) the master answered
        self._name_refused_since = 0.0  # when mounts began to be refused SEGMENT_NAME_IN_USE (0: not)

    # The session, (segment id, epoch) of the current mount once its inventory is in, lives in the
    # index: notices are applied only under the session they were polled in.
    @property
    def segment_id(self) -> int:
        return self._index.session[0]

    @property
    def master_epoch(self) -> int:
        return self._index.session[1]

    def session(self) -> tuple[int, int]:
        return self._index.session

    def readiness(self) -> str:
        """`/readyz`: "" while mounted and heard by the master, else why not (any thread)."""
        if not self._index.session[0]:
            return "not mounted on a master"
        silent_s = time.monotonic() - self._last_heartbeat
        if silent_s > max(_READY_SILENCE_S, 3 * self._interval_s):
            return f"mounted, but no heartbeat answered for {silent_s:.1f}s"
        return ""

    def start(self) -> None:
        self._poller.start()

    def stop(self, unmount: bool = True) -> None:
        self._poller.stop(timeout=5)
        self._lease.close()  # before the unmount: the master does not wait for our lease after one
        segment_id, epoch = self._index.session
        if unmount and segment_id:
            try:
                self._channels.stub().UnmountSegment(
                    pb.UnmountSegmentRequest(segment_id=segment_id, epoch=epoch), timeout=_RPC_TIMEOUT_S
                )
                logger.info("unmounted segment_id=%d", segment_id)
            except grpc.RpcError as exc:
                logger.warning("unmount failed segment_id=%d code=%s", segment_id, exc.code())

    def _step(self) -> float:
        """One mount or heartbeat (the poller's step): the wait before the next one."""
        try:
            if not self._index.session[0]:
                self._mount()
            else:
                segment_id, epoch = self._index.session
                extra = self._report() if self._report is not None else {}
                request = pb.HeartbeatRequest(
                    segment_id=segment_id,
                    epoch=epoch,
                    wall_clock_ms=wall_ms(),
                    rtt_ms=self._clock.rtt_ms,
                    **extra,
                )
                sent, lease_sent = local_s(), self._lease.now()
                reply = self._channels.stub().Heartbeat(request, timeout=_RPC_TIMEOUT_S)
                self._clock.observe(sent, local_s(), reply.wall_clock_ms)
                if reply.status == Status.UNAVAILABLE:  # not (or not now) the leader: keep the mount
                    self._channels.failed(reply.error)
                    raise _Retry(f"master refused the heartbeat: {reply.error}")
                if reply.status != Status.OK:
                    logger.warning(
                        "master dropped segment_id=%d (%s: %s); mounting again",
                        segment_id,
                        status_name(reply.status),
                        reply.error,
                    )
                    self._end_session()
                    return 0.0
                # The master had us mounted when it got this heartbeat; its answer says the lease it grants.
                self._lease.renew(lease_sent, _granted_s(reply))
        except _Fatal as exc:
            self._on_fatal(str(exc), exc.exit_code)
            raise StopPolling from exc
        self._last_heartbeat = time.monotonic()
        return self._interval_s

    def _end_session(self) -> None:
        self._lease.end()  # first: no direct read is served from an index that stopped following
        self._mount_session.set(0, 0)  # no grant of the ended mount acts on the region from here on
        self._index.set_session((0, 0))  # no notice of an earlier mount lands from here on

    def _failed(self, exc: BaseException) -> str:
        """A mount or heartbeat failed (the poller backs off): what to log."""
        if isinstance(exc, grpc.RpcError) and exc.code() in _CREDENTIALS_REFUSED:
            # Wrong or missing credentials do not fix themselves: stop with the reason (exit 2,
            # a configuration error, which systemd units do not restart).
            self._on_fatal(f"the master refused this segment's credentials: {exc.details()}", 2)
            raise StopPolling
        if not isinstance(exc, _Retry):  # a refusal already named where to go
            self._channels.failed()
        return str(exc.code()) if isinstance(exc, grpc.RpcError) else str(exc)

    def _mount(self) -> None:
        self._end_session()
        stub = self._channels.stub()
        self._request.wall_clock_ms = wall_ms()
        # How far the index got under its last mount: what its fence holds only for want of our
        # acknowledgement is released (kvtier.master.fences).
        (previous_id, previous_epoch), previous_applied = self._index.previous_session()
        self._request.previous_segment_id = previous_id
        self._request.previous_epoch = previous_epoch
        self._request.previous_applied_seq = previous_applied
        if self._writers is not None:  # read after the mount ended: a copy that starts later is refused
            del self._request.writer_offsets[:], self._request.writer_lengths[:]
            for offset, length in self._writers():
                self._request.writer_offsets.append(offset)
                self._request.writer_lengths.append(length)
        sent, lease_sent = local_s(), self._lease.now()
        reply = stub.MountSegment(self._request, timeout=_RPC_TIMEOUT_S)
        self._clock.observe(sent, local_s(), reply.wall_clock_ms)
        if reply.status == Status.SEGMENT_DRAINED:
            raise _Fatal(f"segment was drained by an operator ({reply.error}); exiting", exit_code=0)
        if reply.status == Status.UNAVAILABLE:  # a standby, or etcd says another leads now
            self._channels.failed(reply.error)
            raise _Retry(f"master is not the leader: {reply.error}")
        if reply.status == Status.SEGMENT_NAME_IN_USE:
            # Another live process holds the name, or ours before a restart, whose mount ends once its
            # heartbeats stop (the master says when, if they do): try again until well past that,
            # then give up with the reason (a live holder keeps the time from running down).
            now = time.monotonic()
            self._name_refused_since = self._name_refused_since or now
            patience = max(NAME_IN_USE_GIVE_UP_S, 2 * reply.name_frees_in_ms / 1000)
            if now - self._name_refused_since >= patience:
                raise _Fatal(f"{reply.error} (refused for {now - self._name_refused_since:.0f}s)", exit_code=2)
            raise _Retry(f"{reply.error}; trying again")
        self._name_refused_since = 0.0
        if reply.status == Status.CLUSTER_MISMATCH:  # a configuration error: say which option
            raise _Fatal(f"master refused mount: {reply.error}: change --cluster-id (or --master)", exit_code=2)
        if reply.status != Status.OK:
            raise _Fatal(f"master refused mount: {status_name(reply.status)}: {reply.error}")
        segment_id, epoch = reply.segment_id, reply.epoch
        # The master hands out grants of this mount from its answer on (the inventory concerns the index).
        self._mount_session.set(segment_id, epoch, keyed=reply.mount_sessions)
        if reply.discard_index:
            if len(self._index):
                logger.warning("master does not take our DRAM index (%d objects): discarding it", len(self._index))
            self._index.clear()
        # Planned now, verified chunk by chunk as it is sent: see report_dram_inventory.
        reported, refused = report_dram_inventory(stub, segment_id, epoch, self._index, self._index.plan())
        if self._report_disk is not None:
            self._report_disk(stub, segment_id, epoch)
        done = stub.ReportDramObjects(
            pb.DramObjectsRequest(segment_id=segment_id, epoch=epoch, done=True), timeout=_RPC_TIMEOUT_S
        )
        if done.status != Status.OK:
            raise InventoryRefused(f"ReportDramObjects(done): {status_name(done.status)}: {done.error}")
        self._interval_s = max(reply.heartbeat_interval_ms / 1000, 0.05)
        self._last_heartbeat = time.monotonic()
        self._index.set_session((segment_id, epoch))
        # Granted once the master's saved state holds it (0 until then; its heartbeat answers say when).
        self._lease.start(reply.direct_read_lease_ms / 1000, lease_sent, _granted_s(done))
        logger.info(
            "mounted segment_id=%d name=%s epoch=%d heartbeat_s=%.2f dram_objects=%d refused=%d",
            segment_id,
            self._request.name,
            epoch,
            self._interval_s,
            reported,
            refused,
        )
        self._on_mounted(segment_id)


class _Retry(Exception):
    """Refused for now, with the leader to try named (the locator already follows it)."""


class _Fatal(Exception):
    """The master will never accept this segment (another cluster id, or it was drained)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _granted_s(reply: Any) -> float | None:
    """The direct-read lease a ReportDramObjects(done) or Heartbeat answer grants, in seconds; None
    from an older master, which names none there (the mount's lease is granted at once)."""
    return reply.direct_read_lease_ms / 1000 if reply.HasField("direct_read_lease_ms") else None
