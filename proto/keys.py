"""Validation of keys and namespaces, shared by client and master.

A key is a non-empty UTF-8 string of at most `MAX_KEY_BYTES` bytes without NUL;
a namespace follows the same rules with `MAX_NAMESPACE_BYTES`. The master
re-validates everything it receives: the client check only gives a faster,
clearer error.
"""

from __future__ import annotations

from kvtier.proto.errors import InvalidKeyError

MAX_KEY_BYTES = 1024
MAX_NAMESPACE_BYTES = 256


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
