"""Validation of keys and namespaces, shared by client and master.

A key is a non-empty UTF-8 string of at most `MAX_KEY_BYTES` bytes without NUL;
a namespace follows the same rules with `MAX_NAMESPACE_BYTES`. The master
re-validates everything it receives: the client check only gives a faster,
clearer error.
"""

from __future__ import annotations

import re

from kvtier.proto.errors import InvalidKeyError

MAX_KEY_BYTES = 1024
MAX_NAMESPACE_BYTES = 256

# Cluster ids and segment names appear in file names (`kvtier.<cluster>.<name>.region`):
# a cluster id has no '.', so the first '.' after the prefix always ends it.
CLUSTER_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
SEGMENT_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,120}")


def cluster_id_problem(cluster_id: str) -> str | None:
    if not CLUSTER_ID_RE.fullmatch(cluster_id):
        return f"cluster_id {cluster_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -"
    return None


def segment_name_problem(name: str) -> str | None:
    if not SEGMENT_NAME_RE.fullmatch(name):
        return f"segment name (--name) {name!r} must be 1-120 characters of A-Z a-z 0-9 _ . -"
    return None


def key_problem(key: object, *, limit: int = MAX_KEY_BYTES, what: str = "key") -> str | None:
    """Why `key` is invalid, or None when it is fine."""
    if not isinstance(key, str):
        return f"{what} must be str, not {type(key).__name__}"
    if not key:
        return f"{what} must not be empty"
    if len(key) > limit:  # cheap reject before encoding: every char is >= 1 byte
        return f"{what} is longer than {limit} bytes"
    if "\x00" in key:
        return f"{what} must not contain NUL"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{what} is not valid UTF-8 (lone surrogate)"
    if size > limit:
        return f"{what} is {size} bytes in UTF-8, more than {limit}"
    return None


def check_key(key: object) -> str:
    """Return `key` if valid, else raise InvalidKeyError with the reason."""
    problem = key_problem(key)
    if problem:
        raise InvalidKeyError(f"{problem}: {key!r:.80}")
    return key  # type: ignore[return-value]


def check_namespace(namespace: object) -> str:
    """Return `namespace` if valid, else raise InvalidKeyError with the reason."""
    problem = key_problem(namespace, limit=MAX_NAMESPACE_BYTES, what="namespace")
    if problem:
        raise InvalidKeyError(f"{problem}: {namespace!r:.80}")
    return namespace  # type: ignore[return-value]
