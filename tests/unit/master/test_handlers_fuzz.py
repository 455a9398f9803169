"""Every MasterHandlers RPC, called in-process with arbitrary messages of its request type.

Issue 8: bad input gets a clear error and the master keeps serving. Each
example builds a small cluster's tables (two mounted segments, a few objects,
one put in flight), then calls a random sequence of handlers with random
requests (tests/unit/master/messages.py: huge numbers, empty, huge and NUL
strings, parallel arrays of different lengths, unknown enum values), with the
clock moving and the tick running between some of them. After every call:

- the handler returned (the `rpc` wrapper turns an exception into INTERNAL, so
  INTERNAL, "a bug on the answering side", is what a crash looks like here and
  fails the test);
- the response is of the RPC's response type, its status is OK or a negative
  kvtier Status, and so is every per-key status;
- the tables are consistent (tests/unit/master/accounting.py).

The fuzzer also plays segments, so the segment RPCs (MountSegment,
PollCommits, ReportDramObjects, ...) get random requests too; before each
PollCommits the segments' index model takes every notice, so a random
acknowledgement cannot make the model (not the master) miss one.
"""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.master.config import MasterConfig
from kvtier.master.handlers import RPC_NAMES, MasterHandlers
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent, segment_indexes
from tests.unit.master.messages import messages, request_type, response_type

STATUSES = {int(s) for s in Status}
# The default suite's budget; `make fuzz` multiplies it (KVTIER_FUZZ_SCALE=20).
SCALE = float(os.environ.get("KVTIER_FUZZ_SCALE", "1"))
EPOCH = 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# Requests name what the tables hold about half the time (see messages.py), or they would stop at
# the first check: "no such segment", "wrong epoch", "invalid namespace".
MARK = 0xFEEDFACE  # put_id / migration_id: replaced with one of the tables' own when drawn
HINTS = {
    "epoch": st.just(EPOCH),
    "segment_id": st.sampled_from([1, 2, 3]),  # seg0, seg1, and the next one a MountSegment makes
    "cluster_id": st.just("unit"),
    "name": st.sampled_from(["seg0", "seg1", "seg2"]),
    "segment": st.sampled_from(["seg0", "seg1"]),
    "namespace": st.just("ns"),
    "namespaces": st.just("ns"),
    "keys": st.sampled_from(["k0", "k1", "k2", "k3"]),
    "sizes": st.integers(0, 4096),
    "replicas": st.integers(1, 3),
    "put_id": st.just(MARK),
    "migration_id": st.just(MARK),
    "dram_capacity": st.sampled_from([4096, 1 << 20]),
    "offsets": st.sampled_from([0, 64, 1024, 1 << 20]),
    "instance": st.just("inst"),
    "tp_size": st.integers(1, 4),
    "pp_size": st.integers(1, 2),
    "budget_bytes": st.integers(0, 1 << 20),
    "prefix": st.sampled_from(["", "k", "k0"]),
    "acked_seq": st.integers(0, 8),
}


def request(rpc: str) -> st.SearchStrategy:
    return messages(request_type(rpc), HINTS)


def resolve(request, handlers: MasterHandlers, put_id: int):
    """Put the tables' own ids where the request drew MARK."""
    fields = request.DESCRIPTOR.fields_by_name
    if "put_id" in fields and request.put_id == MARK:
        request.put_id = put_id
    if "migration_id" in fields and request.migration_id == MARK:
        request.migration_id = max(handlers.state.drainer._batches, default=MARK)
    if "put_end" in fields:  # RelayPutEnd: the client's PutEnd inside
        resolve(request.put_end, handlers, put_id)
    return request


def tables() -> tuple[MasterHandlers, FakeClock, int]:
    """Two segments, two complete objects in "ns", one put of "k2" in flight."""
    clock = FakeClock()
    config = MasterConfig(cluster_id="unit", segment_ttl_s=10.0, heartbeat_interval_s=1.0).validate()
    state = MasterState(config, clock=clock)
    for name in ("seg0", "seg1"):
        result = state.mount_segment("unit", name, f"host-{name}", [f"tcp://127.0.0.1:9/{name}"], 1 << 20)
        assert result.status == Status.OK, result.error
    started = state.put_start("ns", ["k0", "k1"], [1000, 0], 1, PutOptions())
    assert state.put_end("ns", ["k0", "k1"], [7, 0], started.put_id) == [Status.OK, Status.OK]
    pending = state.put_start("ns", ["k2"], [64], 2, PutOptions())
    assert pending.statuses == [Status.OK]
    assert sorted(state.segments) == [1, 2]
    return MasterHandlers(state, EPOCH), clock, pending.put_id


def check_response(rpc: str, response) -> None:
    assert type(response) is response_type(rpc), f"{rpc} answered a {type(response).__name__}"
    fields = response.DESCRIPTOR.fields_by_name
    if "status" in fields:
        status = response.status
        assert status in STATUSES and status <= 0, f"{rpc}: status {status} is no kvtier Status"
        assert status != Status.INTERNAL, f"{rpc} failed inside: {response.error}"
        if status in (Status.INVALID_ARGUMENT, Status.INVALID_KEY, Status.BATCH_TOO_LARGE):
            assert response.error, f"{rpc} refused its input ({Status(status).name}) without saying why"
    if "statuses" in fields:
        for status in response.statuses:
            assert status in STATUSES and status <= 0, f"{rpc}: per-key status {status} is no kvtier Status"
            assert status != Status.INTERNAL, f"{rpc}: a per-key INTERNAL"


CALL = st.sampled_from(RPC_NAMES).flatmap(lambda rpc: st.tuples(st.just(rpc), request(rpc)))
STEP = st.one_of(CALL, st.tuples(st.just("tick"), st.sampled_from([0.5, 5.0, 31.0])))


@pytest.fixture(autouse=True)
def _quiet_refusals():
    """Refused requests are logged at INFO/WARNING; thousands of them would only slow the run."""
    logger = logging.getLogger("kvtier")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# Calls carrying a segment's acknowledgement (a random acked_seq): its index model is up to date first.
_ACKNOWLEDGING = ("PollCommits", "RelayPutEnd")


@settings(
    max_examples=int(100 * SCALE),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(STEP, min_size=1, max_size=12))
def test_every_handler_answers_any_request_with_a_status_and_keeps_the_books(steps):
    handlers, clock, put_id = tables()
    for rpc, argument in steps:
        if rpc == "tick":
            clock.now += argument
            for segment_id in handlers.state.segments:  # the segments stay alive unless time jumps far
                if argument < 10:
                    handlers.state.heartbeat(segment_id, 0, {})
            handlers.state.tick()
        else:
            if rpc in _ACKNOWLEDGING:
                segment_indexes(handlers.state)  # the index model takes every notice first
            check_response(rpc, getattr(handlers, rpc)(resolve(argument, handlers, put_id)))
        assert_consistent(handlers.state)


@settings(
    max_examples=int(25 * SCALE),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.parametrize("rpc", sorted(RPC_NAMES))
def test_each_handler_alone(rpc, data):
    """Every RPC gets its own share of examples, however the sequences above happen to draw."""
    handlers, _clock, put_id = tables()
    for _ in range(3):
        if rpc in _ACKNOWLEDGING:
            segment_indexes(handlers.state)
        drawn = resolve(data.draw(request(rpc)), handlers, put_id)
        check_response(rpc, getattr(handlers, rpc)(drawn))
        assert_consistent(handlers.state)
