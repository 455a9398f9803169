"""The wrapper every master RPC handler runs in (`rpc`), and which RPCs a master answers when.

Per call, in order: the caller's rights (kvtier.master.auth: a tenant outside its
namespaces is PERMISSION_DENIED), the master's role (a standby, or a leader still
recovering, answers UNAVAILABLE with the reason; see `MasterHandlers.refusal`), a
segment RPC's epoch, then the handler. Invalid keys become INVALID_KEY and anything
unexpected INTERNAL, never an exception into gRPC or the fast path. Every call is
counted and timed (kvtier_master_rpc_*), and runs with the client's request id set
for its log lines.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier.common.latency import LatencyHistogram
from kvtier.common.logs import LogBudget
from kvtier.common.logs import request_id as current_request_id
from kvtier.master.auth import current_principal
from kvtier.proto.auth import CLUSTER_PRINCIPAL
from kvtier.proto.errors import InvalidKeyError
from kvtier.proto.status import Status, status_name

logger = logging.getLogger("kvtier.master.servicer")
# Refused and denied calls are logged (findable by request id) within a budget: a client looping on
# a refused call must not flood the log.
_refusals = LogBudget(logger, "refused request")

Handler = Callable[[Any, Any], Any]
# Which RPCs a master answers in which role (see `MasterHandlers.refusal`): INFO always; SEGMENT
# (segment servers' control plane) only as the leader; DATA only as a leader done recovering.
INFO, SEGMENT, DATA = "info", "segment", "data"
GATES = {
    "Hello": INFO,
    "Status": INFO,
    **dict.fromkeys(
        (
            "MountSegment",
            "UnmountSegment",
            "Heartbeat",
            "PollTierTasks",
            "TierTasksDone",
            "ReportDiskObjects",
            "DropDiskReplicas",
            "PollCommits",
            "ReportDramObjects",
        ),
        SEGMENT,
    ),
}
# Calls answered once a commit barrier is done (kvtier.master.commit_wait): each starts with none
# of what a handler leaves for its barrier (the names it is about, a PutEnd's acknowledgement, the
# relaying segment), so nothing an earlier call left after failing can narrow its wait or settle its
# answer; with no names its barrier covers every notice. (Not on every call: a PollCommits answered
# between a PutEnd's handler and its barrier, a parked poll its notices woke, must not clear them.)
ANSWERED_AFTER_BARRIER = frozenset(("PutEnd", "RelayPutEnd", "Remove", "RemovePrefix", "MigrateEnd", "RemoveReplicas"))


def rpc(response_type: type) -> Callable[[Handler], Handler]:
    def decorate(handler: Handler) -> Handler:
        name = handler.__name__

        gate = GATES.get(name, DATA)
        check_epoch = gate is SEGMENT and name != "MountSegment"
        after_barrier = name in ANSWERED_AFTER_BARRIER

        @functools.wraps(handler)
        def wrapper(self: Any, request: Any) -> Any:
            started = time.perf_counter()
            self.requests[name] += 1
            # The client call's id on every line logged while handling it (0: none, or not traced).
            token = current_request_id.set(getattr(request, "request_id", 0))
            if after_barrier:
                self.barrier_names, self.put_ack, self.relayed_by, self.moves = None, None, 0, None
            try:
                principal = current_principal.get()
                if principal != CLUSTER_PRINCIPAL and (denied := self.auth.refusal(principal, name, request)):
                    self.denied[name] += 1
                    _refusals.log(
                        logging.INFO,
                        "request denied method=%s principal=%s",
                        name,
                        principal,
                        extra={"fields": {"reason": denied}},
                    )
                    return response_type(status=Status.PERMISSION_DENIED, error=denied)
                if gate is not INFO and (refusal := self.refusal(gate)):
                    self.refused[name] += 1
                    return response_type(status=Status.UNAVAILABLE, error=refusal)
                if after_barrier and (state := self.state).never_saved(state.state_generation):
                    # Its answer would wait for a save this master never makes (kvtier.master.commit_wait):
                    # refused before anything changes, rather than applied and then refused.
                    return response_type(status=Status.NOT_DURABLE, error=state.unsaveable)
                if check_epoch and request.epoch != self.epoch:
                    return response_type(
                        status=Status.SEGMENT_NOT_FOUND,
                        error=f"mounted under master epoch {request.epoch}, this is {self.epoch}: mount again",
                    )
                reply = handler(self, request)
                if reply.error and current_request_id.get():  # a client call refused: findable by its id
                    fields = {"status": status_name(reply.status)} if reply.status else {}
                    fields["error"] = reply.error
                    _refusals.log(logging.INFO, "request refused method=%s", name, extra={"fields": fields})
                return reply
            except InvalidKeyError as exc:
                self.failures[name] += 1
                if current_request_id.get():
                    fields = {"status": "INVALID_KEY", "error": exc.message}
                    _refusals.log(logging.INFO, "request refused method=%s", name, extra={"fields": fields})
                return response_type(status=Status.INVALID_KEY, error=exc.message)
            except Exception:
                self.failures[name] += 1
                logger.exception("rpc failed method=%s", name)
                return response_type(status=Status.INTERNAL, error=f"internal error in {name}")
            finally:
                elapsed = time.perf_counter() - started
                histogram = self.latency.get(name)
                if histogram is None:
                    histogram = self.latency[name] = LatencyHistogram()
                histogram.observe(elapsed)
                if elapsed > 0.5:
                    logger.warning("slow rpc method=%s seconds=%.3f", name, elapsed)
                current_request_id.reset(token)

        return wrapper

    return decorate
