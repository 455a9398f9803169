"""Mooncake Store's Python interface on kvtier: change one import, keep the calls.

    from kvtier.client.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

Every call answers as Mooncake's does: integers with Mooncake's `ErrorCode`
values (0 or a count on success, negative on failure), `b""` for a missed
`get`, None for a missed `get_buffer`; no exception escapes a call (a bug is
logged and answered as INTERNAL_ERROR). What differs from Mooncake, and why,
is listed in docs/integrations.md ("Mooncake Store API"); in short:

- Memory is contributed by kvtier's segment servers, never by a client: the
  segment and buffer sizes given to `setup` are validated and then ignored,
  and `close` keeps the objects this client stored.
- A put on a key that already holds an object succeeds without rewriting it
  (as Mooncake's put does); `upsert*` replace it atomically (kvtier's
  `Client.upsert`). `get_into_ranges` is a verified ranged read per key
  (only the chunks covering its fragments move, each checked).
- Put-time leases are opt-in: `setup(..., default_kv_lease_ttl=ms)` gives every
  put and upsert of this store a lease of that long; while it runs `remove`
  answers OBJECT_HAS_LEASE unless `force=True`.
- `batch_replica_clear(keys, segment_name="")` answers the keys it cleared, as
  Mooncake's does: every replica of each key (the object goes), or only those
  on `segment_name` (the object goes when none is left elsewhere). Mooncake
  skips objects with a live read lease; kvtier needs not (a cleared replica's
  range is freed only when its read leases end), and a client's namespace
  stands for Mooncake's owner check.
- Raw pointers are only read or written inside buffers registered with
  `register_buffer`: a pointer outside them is INVALID_PARAMS, never a crash.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import re
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.client import Client
from kvtier.common.units import parse_size
from kvtier.proto.errors import InvalidKeyError, KvtierError
from kvtier.proto.keys import key_problem
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)


class ErrorCode(enum.IntEnum):
    """Mooncake Store's result codes (mooncake-store/include/types.h), same names and values."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    FILE_INVALID_BUFFER = -1104
    FILE_LOCK_FAIL = -1105
    FILE_INVALID_HANDLE = -1106
    BUCKET_NOT_FOUND = -1200
    BUCKET_ALREADY_EXISTS = -1201
    KEYS_EXCEED_BUCKET_LIMIT = -1202
    KEYS_ULTRA_LIMIT = -1203
    UNABLE_OFFLOAD = -1300
    UNABLE_OFFLOADING = -1301
    TASK_NOT_FOUND = -1400
    TASK_PENDING_LIMIT_EXCEEDED = -1401


# What an unsupported call answers: Mooncake has no "not supported" code; this one reads
# "the request cannot be done in the current mode" and is never a success.
# Every call of a store that is not set up (or was closed) answers this.
NOT_SET_UP = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS

# kvtier Status name -> Mooncake ErrorCode. By name, so a Status another change adds maps to
# INTERNAL_ERROR (never to success) until it is listed here.
_BY_STATUS_NAME: dict[str, ErrorCode] = {
    "OK": ErrorCode.OK,
    "INTERNAL": ErrorCode.INTERNAL_ERROR,
    "INVALID_ARGUMENT": ErrorCode.INVALID_PARAMS,
    "TIMEOUT": ErrorCode.RPC_FAIL,
    "UNAVAILABLE": ErrorCode.RPC_FAIL,
    "CANCELLED": ErrorCode.RPC_FAIL,
    "BATCH_TOO_LARGE": ErrorCode.INVALID_PARAMS,
    "NOT_DURABLE": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "NOT_FOUND": ErrorCode.OBJECT_NOT_FOUND,
    "INVALID_KEY": ErrorCode.INVALID_KEY,
    "PUT_IN_PROGRESS": ErrorCode.REPLICA_IS_NOT_READY,
    "CHECKSUM_MISMATCH": ErrorCode.INVALID_READ,
    "TOO_LARGE": ErrorCode.NO_AVAILABLE_HANDLE,
    "BUFFER_TOO_SMALL": ErrorCode.BUFFER_OVERFLOW,
    "NOT_PENDING": ErrorCode.INVALID_WRITE,
    "LEASE_HELD": ErrorCode.OBJECT_HAS_LEASE,
    "NO_SPACE": ErrorCode.NO_AVAILABLE_HANDLE,
    "QUOTA_EXCEEDED": ErrorCode.NO_AVAILABLE_HANDLE,
    "OFFLOAD_BEHIND": ErrorCode.NO_AVAILABLE_HANDLE,
    "SEGMENT_NOT_FOUND": ErrorCode.SEGMENT_NOT_FOUND,
    "INVALID_RANGE": ErrorCode.INVALID_PARAMS,
    "CLUSTER_MISMATCH": ErrorCode.ILLEGAL_CLIENT,
    "PROTOCOL_ERROR": ErrorCode.TRANSFER_FAIL,
    "TRANSFER_FAILED": ErrorCode.TRANSFER_FAIL,
    "NO_REPLICA": ErrorCode.NO_AVAILABLE_HANDLE,
    "SEGMENT_DRAINED": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "SEGMENT_NAME_IN_USE": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "LEASE_EXPIRED": ErrorCode.LEASE_EXPIRED,
    "UNAUTHENTICATED": ErrorCode.ILLEGAL_CLIENT,
    "PERMISSION_DENIED": ErrorCode.ILLEGAL_CLIENT,
    "CAPABILITY_DENIED": ErrorCode.ILLEGAL_CLIENT,
    "TOO_MANY_CONNECTIONS": ErrorCode.RPC_FAIL,
    "LAST_REPLICA": ErrorCode.INVALID_REPLICA,
    "REPLICA_EXISTS": ErrorCode.REPLICA_ALREADY_EXISTS,
    "REPLICA_NOT_FOUND": ErrorCode.REPLICA_NOT_FOUND,
}


def to_error_code(status: int) -> int:
    """A kvtier `Status` (or a byte count, passed through) as Mooncake's ErrorCode value."""
    if status >= 0:
        return int(status)
    try:
        name = Status(status).name
    except ValueError:
        return int(ErrorCode.INTERNAL_ERROR)
    return int(_BY_STATUS_NAME.get(name, ErrorCode.INTERNAL_ERROR))


class SoftPinAction(enum.IntEnum):
    """What a put does to a key's soft pin (Mooncake's ReplicateConfig.soft_pin_action)."""

    PRESERVE = 0  # leave the pin as it is (a new object: unpinned unless with_soft_pin)
    ENABLE = 1  # soft-pin the object for soft_pin_ttl_ms (0: the master's default TTL)
    DISABLE = 2  # no soft pin


@dataclass(slots=True)
class ReplicateConfig:
    """Mooncake's per-put placement options, mapped onto `Client.batch_put`'s.

    replica_num -> replicas; with_hard_pin -> pin="hard"; with_soft_pin or
    soft_pin_action=ENABLE -> pin="soft" for soft_pin_ttl_ms (0: the master's
    default); preferred_segment (or the first of preferred_segments) -> the
    kvtier segment name the first replica goes to when it has room.
    prefer_alloc_in_same_node is accepted: kvtier prefers same-host segments
    by itself.
    """

    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int = 0
    preferred_segment: str = ""
    preferred_segments: list[str] = field(default_factory=list)
    prefer_alloc_in_same_node: bool = False

    def placement(self) -> dict[str, Any]:
        """The keyword arguments of `Client.batch_put` this config stands for."""
        if int(self.replica_num) < 1:
            raise ValueError(f"replica_num must be at least 1, got {self.replica_num!r}")
        placement: dict[str, Any] = {"replicas": int(self.replica_num)}
        if self.with_hard_pin:
            placement["pin"] = "hard"
        elif self.with_soft_pin or self.soft_pin_action == SoftPinAction.ENABLE:
            placement["pin"] = "soft"
            placement["pin_ttl"] = max(0, int(self.soft_pin_ttl_ms)) / 1000
        segment = self.preferred_segment or (self.preferred_segments[0] if self.preferred_segments else "")
        if segment:
            placement["preferred_segment"] = segment
        return placement


class BufferHandle(bytearray):
    """An object's bytes as `get_buffer` returns them: a buffer (numpy.frombuffer, memoryview)
    with Mooncake's `ptr()` and `size()`. The memory is this handle's own copy."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


# setup's keys, in the order of its positional form.
_POSITIONAL = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "engine",  # Mooncake's optional transfer engine object: kvtier has its own transports (ignored)
)
_ALIASES = {"device_name": "rdma_devices", "master_server_address": "master_server_addr"}
# Keys of Mooncake's config dict kvtier has no use for: accepted and ignored (docs/integrations.md).
_IGNORED_KEYS = frozenset(
    {"ipc_socket_path", "engine", "enable_offload", "client_id", "mem_pool_size", "transfer_timeout"}
)
# kvtier's own settings a config dict may add (the Client's keyword arguments).
_KVTIER_KEYS = frozenset({"timeout", "secret_file", "principal", "tls_ca_file", "tls_cert_file", "tls_key_file"})
_DEFAULTS: dict[str, Any] = {
    "local_hostname": "",
    "metadata_server": "",
    "global_segment_size": 16 << 20,
    "local_buffer_size": 16 << 20,
    "protocol": "tcp",
    "rdma_devices": "",
    "master_server_addr": "127.0.0.1:50051",
    "tenant_id": "",
    # Mooncake's master flag, per store here: a put-time lease (ms) on every put and upsert; 0 = none.
    "default_kv_lease_ttl": 0,
}


def _transport(protocol: str) -> str:
    """Mooncake's protocol as a kvtier transport ("" = the client's own choice: shared memory for
    segments on this host, TCP otherwise). "tcp" asks for no RDMA, which is kvtier's choice too;
    "rdma" has no kvtier connector yet, so it also gets that choice (logged)."""
    protocol = (protocol or "tcp").strip().lower()
    if protocol in ("tcp", ""):
        return ""
    if protocol == "rdma":
        logger.warning("protocol=rdma: kvtier has no RDMA transport yet; using shared memory or TCP")
        return ""
    if protocol in ("shm", "tcp-only"):
        return "shm" if protocol == "shm" else "tcp"
    raise ValueError(f"unknown protocol {protocol!r}: use 'tcp' or 'rdma' (or kvtier's 'shm', 'tcp-only')")


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return parse_size(value if isinstance(value, int) else str(value))


def _answers(failure: Callable[[int, tuple], Any]) -> Callable:
    """Run a store call; whatever it raises becomes `failure(code, args)`: Mooncake's calls answer
    codes, never exceptions. Invalid keys and arguments get their codes; bugs are logged."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: MooncakeDistributedStore, *args: Any, **kwargs: Any) -> Any:
            if self._client is None:
                return failure(int(NOT_SET_UP), args)
            try:
                return method(self, *args, **kwargs)
            except InvalidKeyError as exc:
                logger.warning("%s: %s", method.__name__, exc)
                return failure(int(ErrorCode.INVALID_KEY), args)
            except KvtierError as exc:
                logger.warning("%s: %s", method.__name__, exc)
                return failure(to_error_code(int(exc.status)), args)
            except (ValueError, TypeError, OverflowError) as exc:
                logger.warning("%s: invalid arguments: %s", method.__name__, exc)
                return failure(int(ErrorCode.INVALID_PARAMS), args)
            except Exception:
                if self._client is None:  # closed by another thread meanwhile: not a bug
                    return failure(int(NOT_SET_UP), args)
                logger.exception("%s failed", method.__name__)
                return failure(int(ErrorCode.INTERNAL_ERROR), args)

        return call

    return wrap


def _code(code: int, args: tuple) -> int:
    return code


def _empty(code: int, args: tuple) -> bytes:
    return b""


def _no_keys(code: int, args: tuple) -> list[str]:
    return []


def _none(code: int, args: tuple) -> None:
    return None


def _fragments(args: tuple, code: int) -> list:
    """`code` for every fragment of a get_into_ranges request, in its shape (sizes: its 5th argument)."""
    try:
        return [[[int(code)] * len(fragments) for fragments in per_key] for per_key in args[4][: len(args[0])]]
    except (IndexError, TypeError):
        return []


def _valid_keys_only(keys: Sequence[str], call: Callable[[list[str]], list], invalid: Any, answer: Callable) -> list:
    """A batch read on its valid keys alone: each invalid key answers `invalid` by itself (Mooncake
    answers per key; one bad key used to blank the whole batch), the others `answer(result)`."""
    keys = list(keys)
    valid = [i for i, key in enumerate(keys) if not key_problem(key)]
    if len(valid) < len(keys):
        logger.warning("%d of %d keys are invalid, answered alone", len(keys) - len(valid), len(keys))
    out = [invalid] * len(keys)
    if valid:
        for i, result in zip(valid, call([keys[i] for i in valid]), strict=True):
            out[i] = answer(result)
    return out


def _per_key(answer: Callable[[int], Any]) -> Callable[[int, tuple], list]:
    """A batch call's failure: `answer(code)` for each of its keys (its first argument)."""

    def failure(code: int, args: tuple) -> list:
        try:
            return [answer(code)] * len(args[0])
        except (IndexError, TypeError):
            return []

    return failure


class MooncakeDistributedStore:
    """Mooncake Store's client API on a kvtier cluster (see the module docstring).

    Thread-safe as the underlying `Client` is. `setup` connects; `close` disconnects.
    """

    def __init__(self) -> None:
        self._client: Client | None = None
        self._hostname = ""
        self._lock = threading.Lock()
        self._buffers: dict[int, int] = {}  # registered buffers: address -> size
        self._lease_s = 0.0  # put-time lease of every put and upsert (setup's default_kv_lease_ttl)

    # ------------------------------------------------------------------ lifecycle

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect to the kvtier master. Both of Mooncake's forms:
        `setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
        rdma_devices, master_server_addr)` and `setup({"local_hostname": ..., ...})`; sizes may be
        human-readable ("512MB"). `tenant_id` is the kvtier namespace ("default" when empty).
        0, or INVALID_PARAMS for a bad value, RPC_FAIL when the master does not answer."""
        try:
            settings = self._settings(args, kwargs)
        except (ValueError, TypeError) as exc:
            logger.warning("setup: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        extra = {k: settings[k] for k in _KVTIER_KEYS if k in settings}
        try:
            client = Client(
                settings["master_server_addr"],
                namespace=settings["tenant_id"] or "default",
                transport=_transport(settings["protocol"]),
                **extra,
            )
        except InvalidKeyError as exc:
            logger.warning("setup: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        except (ValueError, TypeError, OSError) as exc:  # OSError: an unreadable secret or TLS file
            logger.warning("setup: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        except Exception:
            logger.exception("setup failed")
            return int(ErrorCode.INTERNAL_ERROR)
        try:
            client.cluster_status()  # Mooncake's setup fails when the master is unreachable: so does this
        except Exception as exc:
            code = to_error_code(int(exc.status)) if isinstance(exc, KvtierError) else int(ErrorCode.RPC_FAIL)
            logger.warning("setup: master %s: %s", settings["master_server_addr"], exc)
            client.close()
            return code
        with self._lock:
            old, self._client = self._client, client
            self._hostname = settings["local_hostname"] or socket.gethostname()
            self._lease_s = settings["default_kv_lease_ttl"] / 1000
        if old is not None:
            old.close()
        return 0

    @staticmethod
    def _settings(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            given = dict(args[0])
        else:
            if len(args) > len(_POSITIONAL):
                raise TypeError(f"setup takes at most {len(_POSITIONAL)} positional arguments, got {len(args)}")
            given = dict(zip(_POSITIONAL, args, strict=False))
            for key, value in kwargs.items():
                if key in given:
                    raise TypeError(f"setup got {key!r} twice")
                given[key] = value
        settings = dict(_DEFAULTS)
        for key, value in given.items():
            key = _ALIASES.get(key, key)
            if key in _IGNORED_KEYS:
                continue
            if key not in _DEFAULTS and key not in _KVTIER_KEYS:
                raise ValueError(f"unknown setup key {key!r}")
            settings[key] = value
        for name in ("global_segment_size", "local_buffer_size"):
            settings[name] = _size(name, settings[name])  # validated, then unused: segments own memory
        for name in ("local_hostname", "metadata_server", "protocol", "rdma_devices", "master_server_addr"):
            if not isinstance(settings[name], str):
                raise TypeError(f"{name} must be a string, got {settings[name]!r}")
        if not isinstance(settings["tenant_id"], str):
            raise TypeError(f"tenant_id must be a string, got {settings['tenant_id']!r}")
        if not settings["master_server_addr"]:
            raise ValueError("master_server_addr is empty")
        lease = settings["default_kv_lease_ttl"]
        if not _is_int(lease) or not 0 <= lease < 1 << 32:
            raise ValueError(f"default_kv_lease_ttl must be milliseconds in 0..2**32-1, got {lease!r}")
        return settings

    def close(self) -> int:
        """Disconnect; 0. The objects stay: they live in the segment servers, not in this client."""
        with self._lock:
            client, self._client = self._client, None
            self._buffers.clear()
        if client is not None:
            client.close()
        return 0

    def get_hostname(self) -> str:
        """The `local_hostname` given to setup (this host's name when none was)."""
        return self._hostname

    @_answers(_code)
    def health_check(self) -> int:
        """0 when the master answers; RPC_FAIL (or the failure's code) otherwise."""
        self._client.cluster_status()
        return 0

    # ------------------------------------------------------------------ writes

    def _put(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None, upsert: bool = False
    ) -> list[int]:
        placement = (config or ReplicateConfig()).placement()
        if self._lease_s:
            placement["lease_s"] = self._lease_s
        store = self._client.batch_upsert if upsert else self._client.batch_put
        return [to_error_code(int(s)) for s in store(list(keys), list(values), **placement)]

    @_answers(_code)
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store `value` (any bytes-like object); 0 also when `key` already holds an object (it is
        kept as it is: a put never overwrites). NO_AVAILABLE_HANDLE when there is no room."""
        return self._put([key], [value], config)[0]

    @_answers(_code)
    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """Store many values: 0 when every key is stored, else the first failing key's code (the
        others may be stored: a batch is not all-or-none)."""
        if len(keys) != len(values):
            return int(ErrorCode.INVALID_PARAMS)
        return next((c for c in self._put(keys, values, config) if c != 0), 0)

    @_answers(_code)
    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` under `key` (one copy into a joined buffer)."""
        return self._put([key], [b"".join(memoryview(p).cast("B") for p in parts)], config)[0]

    @_answers(_code)
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store `size` bytes at `buffer_ptr` (inside a registered buffer) without copying them."""
        view = self._view(buffer_ptr, size)
        if view is None:
            return int(ErrorCode.INVALID_PARAMS)
        return self._put([key], [view], config)[0]

    @_answers(_per_key(int))
    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """`put_from` for many keys: one code per key (INVALID_PARAMS where a pointer is not registered)."""
        return self._put_from(keys, buffer_ptrs, sizes, config, upsert=False)

    def _put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None,
        upsert: bool,
    ) -> list[int]:
        """Put or upsert registered memory without copying: one code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        good = [i for i, v in enumerate(views) if v is not None]
        codes = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        stored = self._put([keys[i] for i in good], [views[i] for i in good], config, upsert=upsert) if good else []
        for i, code in zip(good, stored, strict=True):
            codes[i] = code
        return codes

    @_answers(_code)
    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store `value`, replacing what `key` holds, atomically (a reader gets the old or the new
        value, never a mix or a miss); a missing key is put. 0, or the code of the failure (the old
        value stays); REPLICA_IS_NOT_READY while another put or upsert of the key is in flight."""
        return self._put([key], [value], config, upsert=True)[0]

    @_answers(_code)
    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """`upsert` of `size` bytes at `buffer_ptr` (inside a registered buffer), without copying them."""
        view = self._view(buffer_ptr, size)
        if view is None:
            return int(ErrorCode.INVALID_PARAMS)
        return self._put([key], [view], config, upsert=True)[0]

    @_answers(_code)
    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """`upsert` for many keys: 0 when every key is replaced, else the first failing key's code."""
        if len(keys) != len(values):
            return int(ErrorCode.INVALID_PARAMS)
        return next((c for c in self._put(keys, values, config, upsert=True) if c != 0), 0)

    @_answers(_per_key(int))
    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """`upsert_from` for many keys: one code per key (INVALID_PARAMS where a pointer is not registered)."""
        return self._put_from(keys, buffer_ptrs, sizes, config, upsert=True)

    # ------------------------------------------------------------------ reads

    @_answers(_empty)
    def get(self, key: str) -> bytes:
        """The object's bytes, or b"" on a miss (absent, unreachable, or failing its checksum)."""
        value = self._client.get(key)
        return b"" if value is None else bytes(value)

    @_answers(_per_key(lambda code: b""))
    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """One value per key, b"" per miss (and per invalid key)."""
        return _valid_keys_only(keys, self._client.batch_get, b"", lambda v: b"" if v is None else bytes(v))

    @_answers(_none)
    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object as a `BufferHandle`, or None on a miss."""
        value = self._client.get(key)
        return None if value is None else BufferHandle(value)

    @_answers(_per_key(lambda code: None))
    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return _valid_keys_only(keys, self._client.batch_get, None, lambda v: None if v is None else BufferHandle(v))

    @_answers(_code)
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read `key` into the registered buffer at `buffer_ptr`: bytes read, or a negative code
        (OBJECT_NOT_FOUND, BUFFER_OVERFLOW when `size` is smaller than the object, ...)."""
        view = self._view(buffer_ptr, size)
        if view is None:
            return int(ErrorCode.INVALID_PARAMS)
        return to_error_code(int(self._client.get_into(key, view)))

    @_answers(_per_key(int))
    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """`get_into` for many keys, one GetReplicas round trip: bytes read or a negative code, per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        good = [i for i, v in enumerate(views) if v is not None and not key_problem(keys[i])]
        codes = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        for i, key in enumerate(keys):
            if key_problem(key):
                codes[i] = int(ErrorCode.INVALID_KEY)
        if good:
            read = self._client.batch_get_into([keys[i] for i in good], [views[i] for i in good])
            for i, result in zip(good, read, strict=True):
                codes[i] = to_error_code(int(result))
        return codes

    @_answers(lambda code, args: _fragments(args, code))
    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[str]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list:
        """Fragments of objects into registered memory: for buffer i, key j and fragment k, the
        `all_sizes[i][j][k]` bytes at `all_src_offsets[i][j][k]` of the object go to
        `buffer_ptrs[i] + all_dst_offsets[i][j][k]`. Per fragment, in the request's shape: its size,
        or a negative code. Each key is one verified ranged read (`Client.get_into_ranges`: only the
        chunks covering its fragments move, each checked against its CRC), so a key's fragments
        succeed or fail together; a fragment outside the registered memory, or lists of unequal
        lengths, are INVALID_PARAMS (that key is not read); a fragment past the object's end makes
        the key's fragments INVALID_PARAMS."""
        invalid = int(ErrorCode.INVALID_PARAMS)
        lists = (buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        if len({len(x) for x in lists}) != 1:
            return _fragments(lists, invalid)
        return [
            [
                self._fragments_into(ptr, key, dsts[j], srcs[j], sizes[j])
                if j < min(len(dsts), len(srcs), len(sizes))
                else []
                for j, key in enumerate(keys)
            ]
            for ptr, keys, dsts, srcs, sizes in zip(*lists, strict=True)
        ]

    def _fragments_into(
        self, ptr: int, key: str, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """One key of get_into_ranges: a size or a negative code per fragment."""
        if not len(dsts) == len(srcs) == len(sizes) or not all(_is_int(v) and v >= 0 for v in (*dsts, *srcs)):
            return [int(ErrorCode.INVALID_PARAMS)] * len(sizes)
        views = [self._view(ptr + dst, size) for dst, size in zip(dsts, sizes, strict=True)]
        if any(v is None for v in views):
            return [int(ErrorCode.INVALID_PARAMS)] * len(sizes)
        result = int(self._client.get_into_ranges(key, list(zip(srcs, sizes, strict=True)), views))
        return [to_error_code(result)] * len(sizes) if result < 0 else list(sizes)

    # ------------------------------------------------------------------ presence and size

    @_answers(_code)
    def is_exist(self, key: str) -> int:
        """1 when a complete object is stored under `key`, 0 when not, negative on failure."""
        return int(self._client.exists(key))

    @_answers(_per_key(int))
    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 per key (INVALID_KEY per invalid key); on a failure of the whole call, its negative
        code for every key."""
        return _valid_keys_only(keys, self._client.batch_exists, int(ErrorCode.INVALID_KEY), int)

    @_answers(_code)
    def get_size(self, key: str) -> int:
        """The object's size in bytes, or OBJECT_NOT_FOUND (also while its put is still in progress)."""
        info = self._client.stat(key)
        if info is None or info.state != "complete":
            return int(ErrorCode.OBJECT_NOT_FOUND)
        return info.size

    isExist = is_exist  # the names of Mooncake's early Python binding, which its tests still call
    getSize = get_size

    # ------------------------------------------------------------------ removal

    @_answers(_code)
    def remove(self, key: str, force: bool = False) -> int:
        """Remove `key`: 0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a put-time lease runs
        (setup's default_kv_lease_ttl) and not `force`. Readers holding a read lease finish first."""
        return to_error_code(int(self._client.batch_remove([key], force=bool(force))[0]))

    @_answers(_per_key(int))
    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        remove = functools.partial(self._client.batch_remove, force=bool(force))
        return _valid_keys_only(keys, remove, int(ErrorCode.INVALID_KEY), lambda s: to_error_code(int(s)))

    @_answers(_code)
    def remove_by_regex(self, regex: str) -> int:
        """Remove this namespace's objects whose key matches `regex` (re.search): the count removed,
        INVALID_PARAMS for a malformed pattern. Keys are listed page by page and removed in batches,
        so objects put meanwhile may or may not be removed."""
        try:
            pattern = re.compile(regex)
        except (re.error, TypeError) as exc:
            logger.warning("remove_by_regex: bad pattern %r: %s", regex, exc)
            return int(ErrorCode.INVALID_PARAMS)
        removed, batch = 0, []
        for info in self._client.iter_keys():
            if pattern.search(info.key):
                batch.append(info.key)
            if len(batch) >= 1000:
                removed += self._remove_all_of(batch)
                batch = []
        return removed + (self._remove_all_of(batch) if batch else 0)

    def _remove_all_of(self, keys: list[str]) -> int:
        return sum(1 for s in self._client.batch_remove(keys) if s == Status.OK)

    @_answers(_code)
    def remove_all(self) -> int:
        """Remove every object of this namespace (tenant): the count removed."""
        return self._client.remove_prefix("")

    @_answers(_no_keys)
    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clear the replicas of `keys` (those on `segment_name`, or all): the keys cleared, in order.

        Mooncake's rules: a key missing, pending, or without a replica on the segment is left out;
        a key whose last replica goes is removed. An unknown segment clears nothing.
        """
        keys = [key for key in keys if key]  # Mooncake skips empty keys
        if segment_name:
            statuses = self._client.batch_remove_replica(keys, segment_name, allow_last=True)
        else:
            statuses = self._client.batch_remove(keys)
        return [key for key, status in zip(keys, statuses, strict=True) if status == Status.OK]

    # ------------------------------------------------------------------ tensors (kvtier.client.tensors)

    @_answers(_code)
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a CPU torch tensor with its dtype and shape (kvtier's tensor format, not Mooncake's)."""
        self._client.put_tensor(key, tensor)
        return 0

    @_answers(_per_key(int))
    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return [self.put_tensor(k, t) for k, t in zip(keys, tensors_list, strict=True)]

    @_answers(_none)
    def get_tensor(self, key: str, dtype: Any = None) -> Any:
        """The tensor, or None on a miss and when the stored one is not a tensor of `dtype` (a
        torch dtype or its name, as Mooncake's early binding took it): never a reinterpreted tensor."""
        if isinstance(dtype, str):
            import torch  # only here: a dtype given by name

            name, dtype = dtype, getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype name {name!r}")
        return self._client.get_tensor(key, dtype=dtype)

    @_answers(_per_key(lambda code: None))
    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        return [self.get_tensor(k) for k in keys]

    # ------------------------------------------------------------------ registered buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow the pointer calls to use [buffer_ptr, buffer_ptr + size): 0, or INVALID_PARAMS.
        Nothing is pinned or mapped: kvtier's transports copy through sockets or shared memory."""
        if not _is_int(buffer_ptr) or not _is_int(size) or buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        with self._lock:
            self._buffers[buffer_ptr] = max(size, self._buffers.get(buffer_ptr, 0))
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or INVALID_PARAMS when `buffer_ptr` was not registered."""
        with self._lock:
            return 0 if self._buffers.pop(buffer_ptr, None) is not None else int(ErrorCode.INVALID_PARAMS)

    def _view(self, ptr: int, size: int) -> memoryview | None:
        """A writable view of [ptr, ptr + size) when it lies inside one registered buffer, else None."""
        if not _is_int(ptr) or not _is_int(size) or ptr <= 0 or size < 0:
            return None
        with self._lock:
            inside = any(base <= ptr and ptr + size <= base + length for base, length in self._buffers.items())
        if not inside:
            logger.warning("pointer %#x (+%d bytes) is not inside a registered buffer", ptr, size)
            return None
        return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "BufferHandle",
    "ErrorCode",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "to_error_code",
]
