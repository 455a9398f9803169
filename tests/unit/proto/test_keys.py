"""Key and namespace validation shared by client and master."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.master.state import master_key_problem
from kvtier.proto import frames
from kvtier.proto.errors import InvalidKeyError, KvtierError
from kvtier.proto.keys import (
    MAX_JOINED_NAME_BYTES,
    MAX_KEY_BYTES,
    MAX_NAMESPACE_BYTES,
    NAME_SEPARATOR,
    check_key,
    check_namespace,
    join_name,
    key_problem,
    name_prefix,
    name_prefix_bytes,
    split_name,
    split_name_bytes,
    wire_key_invalid,
)
from kvtier.proto.status import Status

VALID = [
    "k",
    "x" * 1024,  # exactly 1024 bytes
    "é" * 512,  # 2-byte chars: exactly 1024 bytes
    "€" * 341 + "a",  # 3-byte chars: 1024 bytes
    "🙂" * 256,  # 4-byte chars: 1024 bytes
    "model/layer.0/block 7",
    " ",
    "\x01\x7f\n",
]

INVALID = [
    ("", "must not be empty"),
    ("x" * 1025, "longer than 1024"),
    ("é" * 512 + "a", "1025 bytes in UTF-8"),  # 513 characters but 1025 bytes
    ("🙂" * 256 + "a", "1025 bytes in UTF-8"),
    ("a\x00b", "NUL"),
    ("\x00", "NUL"),
    ("ab\ud800", "lone surrogate"),
    ("\udfff", "lone surrogate"),
]


def test_limits():
    assert MAX_KEY_BYTES == 1024
    assert MAX_NAMESPACE_BYTES == 256


@pytest.mark.parametrize("key", VALID)
def test_valid_keys(key):
    assert key_problem(key) is None
    assert check_key(key) is key


@pytest.mark.parametrize(("key", "reason"), INVALID)
def test_invalid_keys(key, reason):
    problem = key_problem(key)
    assert problem is not None and reason in problem
    with pytest.raises(InvalidKeyError, match=reason) as excinfo:
        check_key(key)
    error = excinfo.value
    assert error.status == Status.INVALID_KEY
    assert isinstance(error, ValueError) and isinstance(error, KvtierError)
    assert not error.retryable


@pytest.mark.parametrize("key", [None, b"bytes", 42, ["k"], object()])
def test_non_str_keys(key):
    assert "must be str" in key_problem(key)
    with pytest.raises(InvalidKeyError, match="must be str"):
        check_key(key)


def test_error_message_truncates_the_key():
    with pytest.raises(InvalidKeyError) as excinfo:
        check_key("x" * 5000)
    assert len(str(excinfo.value)) < 200


@pytest.mark.parametrize("namespace", ["default", "n" * 256, "é" * 128])
def test_valid_namespaces(namespace):
    assert check_namespace(namespace) == namespace


@pytest.mark.parametrize(
    ("namespace", "reason"),
    [("", "namespace must not be empty"), ("n" * 257, "longer than 256"), ("é" * 128 + "a", "257 bytes"), (7, "str")],
)
def test_invalid_namespaces(namespace, reason):
    with pytest.raises(InvalidKeyError, match=reason):
        check_namespace(namespace)


@pytest.mark.parametrize("key", VALID)
def test_master_accepts_what_the_client_accepts(key):
    assert not master_key_problem(key)


@pytest.mark.parametrize(("key", "reason"), [k for k in INVALID if "surrogate" not in k[1]])
def test_master_rejects_what_the_client_rejects(key, reason):
    # lone surrogates cannot arrive at the master: protobuf guarantees valid UTF-8
    assert master_key_problem(key)


# ------------------------------------------------------------------ one shape owner (issue 18)

REPO = Path(__file__).resolve().parents[3]
NAMES = [("ns", "k"), ("", "k"), ("ns", ""), ("é" * 128, "🙂" * 256), ("a/b", "c:d\n")]


@pytest.mark.parametrize(("namespace", "key"), NAMES)
def test_join_and_split_are_inverse(namespace, key):
    name = join_name(namespace, key)
    assert name == namespace + "\x00" + key  # the wire and disk shape: unchanged
    assert name == name_prefix(namespace) + key
    assert split_name(name) == (namespace, key)
    raw = name_prefix_bytes(namespace) + key.encode()
    assert raw == name.encode()
    assert split_name_bytes(raw) == (namespace, key)
    assert split_name_bytes(memoryview(raw)) == (namespace, key)


def test_split_name_without_separator_gives_an_empty_key_every_check_refuses():
    namespace, key = split_name("no-separator")
    assert (namespace, key) == ("no-separator", "")
    assert key_problem(key) and master_key_problem(key)


@pytest.mark.parametrize("raw", [b"no-separator", b"\xff\x00key"], ids=["no-separator", "not-utf8"])
def test_split_name_bytes_refuses_untrusted_bytes(raw):
    with pytest.raises(ValueError):
        split_name_bytes(raw)


def test_read_disk_name_limit_derives_from_the_key_rules():
    assert MAX_JOINED_NAME_BYTES == MAX_NAMESPACE_BYTES + 1 + MAX_KEY_BYTES
    assert frames.MAX_DISK_NAME == 2 + MAX_JOINED_NAME_BYTES == 1283  # the READ_DISK bound is unchanged
    longest = name_prefix_bytes("n" * MAX_NAMESPACE_BYTES) + ("🙂" * (MAX_KEY_BYTES // 4)).encode()
    payload = frames.pack_disk_names([longest])
    assert len(payload) == frames.MAX_DISK_NAME
    assert frames.unpack_disk_names(payload, 1) == [("n" * MAX_NAMESPACE_BYTES, "🙂" * (MAX_KEY_BYTES // 4))]
    with pytest.raises(ValueError, match="separator"):
        frames.unpack_disk_names(frames.pack_disk_names([b"no-separator"]), 1)


# protobuf delivers valid UTF-8 only: lone surrogates never reach the wire check
@pytest.mark.parametrize("key", [*VALID, *(k for k, reason in INVALID if reason != "lone surrogate")])
def test_wire_check_agrees_with_the_client_check(key):
    assert wire_key_invalid(key) == (key_problem(key) is not None)


def test_the_name_separator_is_defined_once():
    """Every package joins and splits names through kvtier.proto.keys: a NUL string literal
    anywhere else is a second definition of the rule (NUL bytes for padding are fine)."""
    found = []
    for package in ("proto", "common", "master", "segment_server", "client", "cli", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == REPO / "proto" / "keys.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value == NAME_SEPARATOR:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
