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

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> KvtierSettings:
        """From an engine's extra config (unknown keys ignored: the engine's dict holds its own too)."""
        config = dict(config or {})
        env = os.environ.get
        defaults = cls()

        def pick(name: str, default: Any) -> Any:
            return config.get(f"kvtier_{name}", config.get(name, default))

        enabled = pick("enabled", True)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in _TRUE
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
        )


class Guard:
    """Runs kvtier calls for an adapter: failures are logged, counted and answered with a fallback."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        try:
            return fn()
        except Exception as exc:  # never into the engine: its thread must live on
            self.count("errors")
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
