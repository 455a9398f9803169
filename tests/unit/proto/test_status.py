"""Status: built from status.proto, OK is 0, errors negative, each with a gRPC code."""

from __future__ import annotations

import grpc
import pytest

from kvtier.proto import errors, status_pb2
from kvtier.proto.status import GRPC_CODE, Status, to_status


def test_ok_is_zero():
    assert Status.OK == 0
    assert int(Status.OK) == 0
    assert GRPC_CODE[Status.OK] == grpc.StatusCode.OK


def test_all_errors_are_negative():
    errors_ = [s for s in Status if s is not Status.OK]
    assert errors_
    assert all(int(s) < 0 for s in errors_)


def test_matches_the_proto_enum_without_aliases():
    descriptor = status_pb2.DESCRIPTOR.enum_types_by_name["Status"]
    assert {v.name: v.number for v in descriptor.values} == {s.name: int(s) for s in Status}
    assert len({int(s) for s in Status}) == len(descriptor.values), "two names share a value"


@pytest.mark.parametrize("status", list(Status))
def test_every_member_has_a_grpc_code(status):
    assert isinstance(GRPC_CODE[status], grpc.StatusCode)
    if status is not Status.OK:
        assert GRPC_CODE[status] != grpc.StatusCode.OK


def test_grpc_code_has_no_extra_entries():
    assert set(GRPC_CODE) == set(Status)


@pytest.mark.parametrize("status", list(Status))
def test_to_status_of_known_values(status):
    assert to_status(int(status)) is status


@pytest.mark.parametrize("value", [1, 7, -98, -99, -150, -999, 1 << 40, -(1 << 31)])
def test_to_status_of_unknown_values_is_internal(value):
    assert to_status(value) is Status.INTERNAL


def test_some_well_known_values():
    assert Status.NOT_FOUND == -100
    assert Status.INVALID_KEY == -101
    assert Status.NO_SPACE == -200
    assert Status.INVALID_RANGE == -301
    assert Status.PROTOCOL_ERROR == -303


def test_error_classes_carry_their_status():
    assert errors.ConnectError("x").status == Status.UNAVAILABLE
    assert errors.ConnectError("x").retryable
    assert errors.ReadError("x").status == Status.TRANSFER_FAILED
    assert errors.ReadError("x").retryable
    assert errors.ProtocolError("x").status == Status.PROTOCOL_ERROR
    assert not errors.ProtocolError("x").retryable
    err = errors.KvtierError(Status.NO_SPACE)
    assert err.message == "NO_SPACE"
    assert str(err) == "NO_SPACE: NO_SPACE"
    assert errors.KvtierError(-200, "full").status is Status.NO_SPACE
