"""Calls to the master that repeat: one back-off policy and one polling thread, written once.

Every loop that long-polls or heartbeats the master (the segment's master
link, commit feed and tier worker; the client's master link) has the same
needs: after a failure wait a little, then longer, up to a cap, so a master
that restarts is found again quickly and one that stays away is not
hammered; after a success start again from the shortest wait; and stop at
once when the process stops.

- `Backoff`: capped exponential back-off with jitter. Each delay is drawn
  from [(1 - jitter) * d, d] where d doubles from `first_s` to `max_s`: the
  waits stay bounded by the same cap as without jitter, and the segments of a
  cluster that lost its master do not come back in lockstep.
- `MasterPoller`: a daemon thread that calls `step()` until stopped. `step`
  returns how long to wait before the next call (its pace when all is well);
  an exception in `retryable` means "master unreachable": the poller backs
  off and logs it once per change of state (the first failure, and a failure
  of another kind, at the poller's level; repeats at DEBUG; the recovery at
  INFO), never once per attempt. `StopPolling` ends the loop (a fatal answer:
  the step reported it first). Any other exception is logged with its trace
  and backed off alike: a poller never dies silently, or the segment would
  stop heartbeating yet serve on.
- `retry_call`: one call repeated with back-off while a condition holds (a
  report that must reach the master of the current mount, or nobody).

All waits go through the poller's stop event (`threading.Event.wait`), so
`stop()` ends a waiting poller at once; a call in flight ends with its own
timeout (or is cancelled by its owner).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

_default_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Backoff:
    """Capped exponential back-off with jitter (not thread-safe: one per loop or per call)."""

    first_s: float = 0.05
    max_s: float = 0.5
    jitter: float = 0.2  # share of each delay that may be taken off at random
    current_s: float = field(init=False)  # the cap of the next delay
    failures: int = field(init=False, default=0)  # since the last reset
    _random: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"back-off needs 0 < first_s <= max_s, got {self.first_s} and {self.max_s}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"back-off jitter is a share in [0, 1), got {self.jitter}")
        self.current_s = self.first_s
        self._random = random.Random()

    def next(self) -> float:
        """The delay to wait now; the next one doubles (up to `max_s`)."""
        delay = self.current_s * (1 - self.jitter * self._random.random())
        self.current_s = min(self.current_s * 2, self.max_s)
        self.failures += 1
        return delay

    def reset(self) -> None:
        """A call succeeded: the next failure waits `first_s` again."""
        self.current_s = self.first_s
        self.failures = 0


class StopPolling(Exception):
    """Raised by a step (or `on_failure`) to end its poller for good: the reason is already handled."""


class MasterPoller:
    """A daemon thread calling `step()` until stopped (see the module docstring).

    `what` names the loop in logs ("tier worker: master unreachable (...)");
    `on_failure(exc)` is called for each retryable failure and returns the
    detail to log (a gRPC code, say); it may act (look for the leader) or
    raise StopPolling. `level` is the level of the first failure's line.
    """

    def __init__(
        self,
        what: str,
        step: Callable[[], float],
        *,
        retryable: tuple[type[BaseException], ...],
        backoff: Backoff | None = None,
        on_failure: Callable[[BaseException], str] | None = None,
        stop: threading.Event | None = None,
        thread_name: str = "",
        logger: logging.Logger | None = None,
        level: int = logging.WARNING,
    ) -> None:
        self.what = what
        self._step = step
        self._retryable = retryable
        self.backoff = backoff if backoff is not None else Backoff()
        self._on_failure = on_failure
        self.stopping = stop if stop is not None else threading.Event()
        self._logger = logger or _default_logger
        self._level = level
        self._failing = ""  # the kind of failure last logged; "" while the master answers
        self._thread = threading.Thread(target=self.run, name=thread_name or f"kvtier-{what}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop and wait up to `timeout` for the thread; whether it has ended."""
        self.stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def run(self) -> None:
        """The loop (the thread's target; tests may call it on their own thread)."""
        while not self.stopping.is_set():
            try:
                pause = self._step()
            except StopPolling:
                return
            except self._retryable as exc:
                if self.stopping.is_set():
                    return
                try:
                    detail = self._on_failure(exc) if self._on_failure is not None else _describe(exc)
                except StopPolling:
                    return
                delay = self.backoff.next()
                kind = f"{type(exc).__name__}:{detail}"
                level = self._level if kind != self._failing else logging.DEBUG
                self._failing = kind
                self._logger.log(level, "%s: master unreachable (%s); retrying in %.2fs", self.what, detail, delay)
                self.stopping.wait(delay)
                continue
            except Exception:
                if self.stopping.is_set():
                    return
                delay = self.backoff.next()
                self._failing = "exception"
                self._logger.exception("%s failed; retrying in %.2fs", self.what, delay)
                self.stopping.wait(delay)
                continue
            if self._failing:
                self._logger.info("%s: master answers again after %d failures", self.what, self.backoff.failures)
                self._failing = ""
            self.backoff.reset()
            if pause > 0:
                self.stopping.wait(pause)


def retry_call(
    call: Callable[[], T],
    *,
    retryable: tuple[type[BaseException], ...],
    go_on: Callable[[], bool],
    stop: threading.Event,
    what: str,
    backoff: Backoff | None = None,
    logger: logging.Logger | None = None,
) -> T | None:
    """`call()`'s result, repeated with back-off after retryable failures while `go_on()` holds and
    `stop` is not set; None once it gives up. Each failure is logged at WARNING (a report is rarer
    than a poll, and each lost one matters)."""
    backoff = backoff if backoff is not None else Backoff()
    log = logger or _default_logger
    while True:
        try:
            return call()
        except retryable as exc:
            if stop.is_set() or not go_on():
                return None
            delay = backoff.next()
            log.warning("%s failed (%s); retrying in %.2fs", what, _describe(exc), delay)
            stop.wait(delay)


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)  # a grpc.RpcError names its status code (this module imports no grpc)
    if callable(code):
        try:
            return str(code())
        except Exception:  # noqa: BLE001 - a description must never fail the loop
            pass
    return str(exc) or type(exc).__name__
