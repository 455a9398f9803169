"""Key rules, shared by client, master and segment server: the one owner of the limits, the
namespace separator, and joining and splitting (namespace, key).

A key is a non-empty UTF-8 string of at most `MAX_KEY_BYTES` bytes without NUL;
a namespace follows the same rules with `MAX_NAMESPACE_BYTES`. The master
re-validates everything it receives: the client check only gives a faster,
clearer error.

An object is named by (namespace, key). Neither may contain NUL, so
`join_name(namespace, key) = namespace + NUL + key` is unambiguous and
`split_name` undoes it at the first NUL. The pair travels in four shapes, each
chosen for its channel (none may change: they are wire and disk formats):

- Client -> master RPCs (KeysRequest, PutStart/End/Revoke, Exists, ...): one
  scalar `namespace` with repeated `keys`. A client handle is scoped to one
  namespace, so a batch names it once.
- Joined name `join_name(...)` (str), or `join_name_bytes(...)` (UTF-8):
  the master's object index (one dict key per object: one lookup, one string
  per object, kvtier.master.records), its commit notices to segments
  (CommitNotices.names) and the segment's DRAM index fed by them, and the
  READ_DISK frame payload (u16 length + joined bytes, kvtier.proto.frames),
  which the segment checks against the record it reads.
- Parallel columns `namespaces[i]`, `keys[i]`: segment <-> master tier and
  inventory RPCs (PollTierTasks, TierTasksDone, ReportDramObjects,
  ReportDiskObjects, DropDiskReplicas) and MigrateStart/End: one batch spans
  namespaces, and protobuf's packed repeated strings carry them without a
  per-item message.
- Separate length-prefixed fields (namespace_len u16, key_len u16, then the
  bytes) in SSD bucket records (kvtier.segment_server.bucket_format): a
  record read back is checked field by field against the reader's name. The
  u16 widths hold more than the limits here allow; the limits are the rule.
"""

from __future__ import annotations

import re

from kvtier.proto.errors import InvalidKeyError

MAX_KEY_BYTES = 1024
MAX_NAMESPACE_BYTES = 256

NAME_SEPARATOR = "\x00"  # between namespace and key in a joined name; neither may contain it
NAME_SEPARATOR_BYTES = NAME_SEPARATOR.encode()
# A joined name's UTF-8 bytes at most (READ_DISK names, kvtier.proto.frames).
MAX_JOINED_NAME_BYTES = MAX_NAMESPACE_BYTES + len(NAME_SEPARATOR_BYTES) + MAX_KEY_BYTES
# UTF-8 takes at most 4 bytes per character: a key of at most this many characters is within
# MAX_KEY_BYTES without encoding it (the master's hot-path check, `wire_key_invalid`).
SHORT_KEY_CHARS = MAX_KEY_BYTES // 4

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
    if NAME_SEPARATOR in key:
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


def check_prefix(prefix: object) -> str:
    """Return a key prefix if some key could start with it ("" = every key), else raise
    InvalidKeyError: a prefix no key can have (NUL, longer than a key, not UTF-8) listed, removed or
    watched nothing, silently."""
    problem = key_problem(prefix, what="prefix") if prefix != "" else None
    if problem:
        raise InvalidKeyError(f"{problem}: {prefix!r:.80}")
    return prefix  # type: ignore[return-value]


def check_namespace(namespace: object) -> str:
    """Return `namespace` if valid, else raise InvalidKeyError with the reason."""
    problem = key_problem(namespace, limit=MAX_NAMESPACE_BYTES, what="namespace")
    if problem:
        raise InvalidKeyError(f"{problem}: {namespace!r:.80}")
    return namespace  # type: ignore[return-value]


def wire_key_invalid(key: str, limit: int = MAX_KEY_BYTES) -> bool:
    """True when a key (or namespace) received in a protobuf message is invalid: empty, with NUL,
    or over `limit` UTF-8 bytes. protobuf already guarantees valid UTF-8; only text longer than
    `limit // 4` characters pays for an encode."""
    return not key or NAME_SEPARATOR in key or (len(key) > limit // 4 and len(key.encode()) > limit)


def join_name(namespace: str, key: str) -> str:
    """The one name of (namespace, key): `namespace NUL key`."""
    return namespace + NAME_SEPARATOR + key


def name_prefix(namespace: str) -> str:
    """`join_name(namespace, key) == name_prefix(namespace) + key`: built once per batch."""
    return namespace + NAME_SEPARATOR


def name_prefix_bytes(namespace: str) -> bytes:
    """`name_prefix` in UTF-8: `name_prefix_bytes(ns) + key.encode()` is a READ_DISK name."""
    return namespace.encode() + NAME_SEPARATOR_BYTES


def split_name(name: str) -> tuple[str, str]:
    """(namespace, key) of a joined name, split at its first NUL. A name without one (never
    built by `join_name`) splits into (name, ""): an empty key, refused by every check."""
    namespace, _, key = name.partition(NAME_SEPARATOR)
    return namespace, key


def split_name_bytes(raw: bytes | bytearray | memoryview) -> tuple[str, str]:
    """(namespace, key) of a joined name received as UTF-8 bytes (untrusted: a frame payload).
    ValueError when it is not UTF-8 or has no separator."""
    namespace, sep, key = bytes(raw).decode().partition(NAME_SEPARATOR)
    if not sep:
        raise ValueError("name without a namespace separator")
    return namespace, key
