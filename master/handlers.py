"""The master's RPC handlers, shared by both doors: parse requests, call `MasterState`, build responses.

`MasterHandlers` holds one synchronous method per RPC, named as in
`master.proto`, taking a request message and returning a response message.
Two transports call them: the gRPC servicer (`kvtier.master.servicer.MasterServicer`, the API) and
the framed fast path (`kvtier.master.fastpath`) for the hot per-batch calls.
Every handler goes through `rpc` (kvtier.master.gates), which counts requests and failures, times
the call, logs slow or failing ones and turns an unexpected exception into an
INTERNAL response. Handlers contain no logic beyond wire-form validation.

This module holds what every handler shares (counters, the leader/recovery gate, batch limits,
endpoints); the handlers themselves are grouped by caller: `kvtier.master.handlers_data` (clients'
puts, reads, removes), `kvtier.master.handlers_segment` (segment servers: mount, heartbeat, tier
tasks, commit log, recovery inventories) and `kvtier.master.handlers_admin` (operators: drain,
quotas, status, inspection).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from kvtier.common.latency import LatencyHistogram
from kvtier.master.auth import Authenticator
from kvtier.master.backpressure import HeldPut, PutWaiter
from kvtier.master.capabilities import Minter
from kvtier.master.commits import PutAcknowledgement
from kvtier.master.events import Watcher
from kvtier.master.gates import DATA
from kvtier.master.handlers_admin import AdminCalls
from kvtier.master.handlers_data import DataCalls
from kvtier.master.handlers_segment import SegmentCalls
from kvtier.master.records import ObjectRecord
from kvtier.master.state import MasterState
from kvtier.master.sweeps import Removal
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import mount_session
from kvtier.proto.status import Status


class Leadership:
    """Whether this master may act, and who leads. Standalone: always the leader.
    With etcd, kvtier.master.election supplies both (the server wires it in)."""

    def is_leader(self) -> bool:
        return True

    def leader(self) -> str:
        return ""

    def following(self) -> str:
        """ "" while a standby follows a leader it could succeed, else why not (standalone: never a standby)."""
        return ""


class MasterHandlers(DataCalls, SegmentCalls, AdminCalls):
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
        self.relayed_by = 0  # the segment that relayed the PutEnd just handled (RelayPutEnd), if any
        # Of the MigrateEnd just handled: (index in its answer, record, target replica) of each key
        # moved or copied, re-checked once its wait is over (kvtier.master.commit_wait).
        self.moves: list[tuple[int, ObjectRecord, int]] | None = None
        # The object names the waiting call just handled is about: its answer waits for the notices
        # about them (kvtier.master.commits). None (each call's start, kvtier.master.gates): every notice.
        self.barrier_names: list[str] | None = None
        self.removal: Removal | None = None  # of the RemovePrefix just handled, still sweeping
        self.watcher: Watcher | None = None  # subscribed by the WatchEvents just handled
        self.puts_lost = 0  # keys a PutEnd committed whose segment was lost before the answer
        self.put_held: HeldPut | None = None  # of the PutStart just handled, when keys wait for offload
        self.put_waiter = PutWaiter(self)  # both doors await it for a held PutStart
        # segment id -> (its record, quarantined, its SegmentEndpoint, epoch), for answers (`_endpoints`)
        self._endpoint_cache: dict[int, tuple[Any, bool, pb.SegmentEndpoint, int]] = {}

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
                "fence_names_released": state.fences.released,
                "put_keys_lost_with_segment": self.puts_lost,
            }
        )

    def refusal(self, gate: str) -> str:
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
        """The endpoints of these segments (each once) for an answer. Built once per segment and
        kept (a segment's name, host and endpoints never change: a re-mount is a new record), so
        a single-key put or get does not construct one per call (session 9)."""
        out = []
        quarantined = self.state.quarantined_ids
        segments = self.state.segments
        cache = self._endpoint_cache
        for segment_id in set(segment_ids):
            segment = segments.get(segment_id)
            if segment is None:
                continue
            shunned = segment_id in quarantined
            cached = cache.get(segment_id)
            # A new epoch (this process leading again) gives the same record a new mount session.
            if cached is None or cached[0] is not segment or cached[1] != shunned or cached[3] != self.epoch:
                message = pb.SegmentEndpoint(
                    segment_id=segment_id,
                    name=segment.name,
                    host_id=segment.host_id,
                    endpoints=segment.endpoints,
                    quarantined=shunned,
                    direct_reads=segment.direct_reads,
                    # the mount its grants belong to (none for an older segment, which checks none)
                    session=mount_session(segment_id, self.epoch) if segment.mount_sessions else 0,
                )
                if len(cache) > 2 * len(segments) + 64:  # segments that left: forget them
                    for gone in [i for i, (record, _, _, _) in cache.items() if segments.get(i) is not record]:
                        del cache[gone]
                cache[segment_id] = cached = (segment, shunned, message, self.epoch)
            out.append(cached[2])
        return out


RPC_NAMES = tuple(name for name in pb.DESCRIPTOR.services_by_name["Master"].methods_by_name)
