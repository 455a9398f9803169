"""Key and namespace validation shared by client and master."""

from __future__ import annotations

import pytest

from kvtier.master.state import master_key_problem
from kvtier.proto.errors import InvalidKeyError, KvtierError
from kvtier.proto.keys import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES, check_key, check_namespace, key_problem
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
