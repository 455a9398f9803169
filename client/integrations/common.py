"""What every engine adapter shares: kvtier settings from the engine's config, the off switch,
and failure accounting that never raises into the engine.

Settings come from the engine's extra-config dict (keys below) with `KVTIER_*`
environment variables as defaults. `enabled: false` (or KVTIER_DISABLE=1) is the
operators' escape hatch: the adapter then stores nothing and finds nothing, so
the engine recomputes locally, without a kvtier cluster being reachable at all.

Adapters call kvtier through `Guard.call`: an exception (master down, timeout,
a bug) is logged with its request id, counted, and turned into the engine's
"nothing found / not stored" answer, so a failure shrinks the usable prefix
instead of killing an engine's background thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class KvtierSettings:
    master: str = "127.0.0.1:50051"
    enabled: bool = True
    namespace_prefix: str = ""  # e.g. a tenant's pattern prefix ("alice") before the identity
    timeout: float = 5.0
    transport: str = ""  # "" = best available (shm on the same host, else tcp)
    secret_file: str = ""
    principal: str = ""
    replicas: int = 1
    instance: str = ""  # quota owner (RegisterInstance); "" = no quota
    budget_bytes: int = 0  # with instance: the deployment's budget, split per rank by the master
    # Lookups (the engine's lookup-then-load) ask kvtier to prefetch what they find on SSD into DRAM,
    # so the engine's load that follows is a DRAM hit (Client.longest_prefix(prefetch=True)).
    prefetch: bool = True
    # Threads that share a large same-host copy (Client(copy_threads=...)): the calling one and
    # copy_threads - 1 of the client's own; 1 keeps every copy on the calling thread.
    copy_threads: int = 2

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> KvtierSettings:
        """From an engine's extra config (unknown keys ignored: the engine's dict holds its own too)."""
        config = dict(config or {})
        env = os.environ.get
        defaults = cls()

        def pick(name: str, default: Any) -> Any:
            return config.get(f"kvtier_{name}", config.get(name, default))

        copy_threads = int(pick("copy_threads", defaults.copy_threads))
        if copy_threads < 1:  # at start, in the engine's own words, not on every call after
            raise ValueError(f"kvtier_copy_threads must be at least 1, got {copy_threads}")
        enabled = _flag(pick("enabled", True))
        if env("KVTIER_DISABLE", "").strip().lower() in _TRUE:
            enabled = False
        return cls(
            master=str(pick("master", env("KVTIER_MASTER", defaults.master))),
            enabled=bool(enabled),
            namespace_prefix=str(pick("namespace_prefix", "")),
            timeout=float(pick("timeout", defaults.timeout)),
            transport=str(pick("transport", "")),
            secret_file=str(pick("secret_file", "")),
            principal=str(pick("principal", "")),
            replicas=int(pick("replicas", 1)),
            instance=str(pick("instance", "")),
            budget_bytes=int(pick("budget_bytes", 0)),
            prefetch=_flag(pick("prefetch", defaults.prefetch)),
            copy_threads=copy_threads,
        )

    def client(self, namespace: str, rank: int = 0) -> Any:
        from kvtier.client import Client

        return Client(
            self.master,
            namespace=namespace,
            timeout=self.timeout,
            transport=self.transport,
            secret_file=self.secret_file,
            principal=self.principal,
            instance=self.instance,
            rank=rank,
            copy_threads=self.copy_threads,
        )


def _flag(value: Any) -> bool:
    """A boolean setting, from JSON (true/false) or a string ("1", "true", "yes", ...)."""
    return value.strip().lower() in _TRUE if isinstance(value, str) else bool(value)


def _unreachable(exc: Exception) -> bool:
    """Whether `exc` says kvtier cannot be reached now (rather than: this one call was refused)."""
    from kvtier.proto.errors import ConnectError, KvtierError
    from kvtier.proto.status import Status

    if isinstance(exc, ConnectError | OSError):
        return True
    return isinstance(exc, KvtierError) and exc.status in (Status.UNAVAILABLE, Status.TIMEOUT)


class Guard:
    """Runs kvtier calls for an adapter: failures are logged, counted and answered with a fallback.

    A circuit breaker: after a call fails because kvtier is unreachable (the master down or not
    answering in time), calls are answered with their fallback at once for `cooldown_s`, counted
    as `short_circuited`, instead of each waiting its whole timeout: an engine with kvtier gone
    recomputes at full speed, and tries kvtier again a moment later.
    """

    def __init__(self, adapter: str, cooldown_s: float = 2.0) -> None:
        self.adapter = adapter
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.cooldown_s = cooldown_s
        self._open_until = 0.0

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        if self._open_until and time.monotonic() < self._open_until:
            self.count("short_circuited")
            return fallback
        try:
            return fn()
        except Exception as exc:  # never into the engine: its thread must live on
            self.count("errors")
            if _unreachable(exc):
                self._open_until = time.monotonic() + self.cooldown_s
            rid = getattr(exc, "request_id", "")
            logger.warning(
                "kvtier %s %s failed, treated as a miss: %s%s",
                self.adapter,
                what,
                exc,
                f" rid={rid}" if rid else "",
                exc_info=not isinstance(exc, (OSError, ValueError)) and logger.isEnabledFor(logging.DEBUG),
            )
            return fallback

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
