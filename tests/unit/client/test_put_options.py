"""What `Client.batch_put` sends for owners, pins and placement, against a stub master (no processes)."""

from __future__ import annotations

import pytest

from kvtier.client import Client, Status
from kvtier.client.transport.shm import local_host_id
from kvtier.proto import master_pb2 as pb


class StubMaster:
    """Records requests; answers PutStart with NO_SPACE for every key, so nothing is written."""

    forked_from = 0  # as MasterClient: made in this process

    def __init__(self) -> None:
        self.requests: list[tuple[str, object]] = []

    def call(self, method, request, timeout=None):
        self.requests.append((method, request))
        if method == "PutStart":
            n = len(request.keys)
            return pb.PutStartResponse(statuses=[int(Status.NO_SPACE)] * n, replica_counts=[0] * n)
        if method == "RegisterInstance":
            ranks = request.tp_size * request.pp_size
            return pb.RegisterInstanceResponse(quota_per_rank=request.budget_bytes // ranks)
        raise AssertionError(f"unexpected call {method}")

    def close(self) -> None:
        pass


@pytest.fixture
def make_client():
    clients = []

    def make(**kwargs) -> tuple[Client, StubMaster]:
        client = Client("127.0.0.1:1", **kwargs)
        stub = client._master = StubMaster()
        clients.append(client)
        return client, stub

    yield make
    for client in clients:
        client.close()


def sent_put_start(client: Client, stub: StubMaster, **placement) -> pb.PutStartRequest:
    assert client.batch_put(["k"], [b"v"], **placement) == [Status.NO_SPACE]
    method, request = stub.requests[-1]
    assert method == "PutStart"
    return request


def test_instance_rank_pin_and_placement_go_to_the_master(make_client):
    client, stub = make_client(instance="llm", rank=3)
    request = sent_put_start(client, stub, pin="soft", pin_ttl=2.5, preferred_segment="seg1", replicas=2)
    assert (request.instance, request.rank, request.replicas) == ("llm", 3, 2)
    assert (request.pin, request.pin_ttl_ms, request.preferred_segment) == (pb.PIN_SOFT, 2500, "seg1")
    assert request.client_host == local_host_id()


def test_defaults_are_no_owner_and_no_pin(make_client):
    client, stub = make_client()
    request = sent_put_start(client, stub)
    assert (request.instance, request.rank, request.pin, request.pin_ttl_ms, request.preferred_segment) == (
        "",
        0,
        pb.PIN_NONE,
        0,
        "",
    )


@pytest.mark.parametrize(("pin", "wire"), [(None, pb.PIN_NONE), ("soft", pb.PIN_SOFT), ("hard", pb.PIN_HARD)])
def test_pin_names(make_client, pin, wire):
    client, stub = make_client()
    assert sent_put_start(client, stub, pin=pin).pin == wire


@pytest.mark.parametrize(
    ("pin_ttl", "ms"),
    [(0, 0), (0.0004, 1), (0.001, 1), (1.1, 1100), (0.3, 300), (300, 300_000), (4294967.295, 2**32 - 1)],
)
def test_pin_ttl_in_milliseconds_never_rounds_a_positive_ttl_to_the_default(make_client, pin_ttl, ms):
    client, stub = make_client()
    assert sent_put_start(client, stub, pin="soft", pin_ttl=pin_ttl).pin_ttl_ms == ms


@pytest.mark.parametrize("pin_ttl", [-1, -0.001, 4294967.296, 1e12, float("nan"), float("inf")])
def test_an_invalid_pin_ttl_is_a_value_error_before_anything_is_sent(make_client, pin_ttl):
    client, stub = make_client()
    with pytest.raises(ValueError, match="pin_ttl"):
        client.batch_put(["k"], [b"v"], pin="soft", pin_ttl=pin_ttl)
    assert stub.requests == []


@pytest.mark.parametrize("pin", ["SOFT", "weak", 1, True])
def test_an_unknown_pin_is_a_value_error(make_client, pin):
    client, stub = make_client()
    with pytest.raises(ValueError, match="pin must be"):
        client.batch_put(["k"], [b"v"], pin=pin)
    assert stub.requests == []


def test_a_negative_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        Client("127.0.0.1:1", instance="llm", rank=-1)


def test_register_instance_needs_an_instance_and_sends_the_whole_budget(make_client):
    client, stub = make_client()
    with pytest.raises(ValueError, match="instance"):
        client.register_instance(2, 1, 1 << 30)
    assert stub.requests == []
    client, stub = make_client(instance="llm")
    assert client.register_instance(4, 2, 8 << 30) == 1 << 30
    method, request = stub.requests[-1]
    assert method == "RegisterInstance"
    assert (request.instance, request.tp_size, request.pp_size, request.budget_bytes) == ("llm", 4, 2, 8 << 30)
