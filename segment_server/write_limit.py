"""A cap on the SSD tier's offload bandwidth (`--ssd-write-limit`), so that disk bandwidth stays for reads.

A token bucket in bytes: `take(n)` returns at once while the bucket holds `n`
tokens, else sleeps until it does. The bucket fills at `rate` bytes a second
and holds at most `burst` (a tenth of a second's worth, at least one record:
a record larger than the burst is let through once the bucket is full, then
the debt is paid before the next). Called once per offloaded record by the
tier worker, on its own thread: it is the only one that waits. `stop` (an
Event) cuts a wait short at shutdown. Rate 0 = unlimited: `take` is free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WriteLimit:
    def __init__(
        self,
        rate: int,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate  # may be set before the first take (the server configures the worker's)
        self._stop = stop or threading.Event()
        self._clock = clock
        self._tokens: float | None = None  # None = a full bucket
        self._at = clock()
        self.waited_s = 0.0  # total time offload spent waiting for the limit (segment metrics)

    def delay(self, nbytes: int) -> float:
        """Take `nbytes` tokens (the balance may go negative: a debt); seconds to wait first."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        burst = self.burst
        tokens = burst if self._tokens is None else min(burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        need = min(nbytes, burst)
        wait = 0.0 if tokens >= need else (need - tokens) / self.rate
        self._tokens = tokens - nbytes
        return wait

    def max_tasks(self, default: int) -> int:
        """Tasks to ask per poll: under a cap, about one second of records (taken at 1 MiB each), so
        that a poll's batch is written long before its tasks' deadline (the master's put timeout)."""
        return default if self.rate <= 0 else max(1, min(default, self.rate >> 20))

    @property
    def burst(self) -> float:
        return float(max(self.rate // 10, 1))

    def take(self, nbytes: int) -> None:
        """Wait until `nbytes` more may be written (see the module docstring)."""
        wait = self.delay(nbytes)
        if wait > 0:
            self.waited_s += wait
            self._stop.wait(wait)
