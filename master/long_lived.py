"""Keeping the cyclic garbage collector off the master's long-lived tables.

A master holds one record per object, each a tracked container, for as long as the object lives.
CPython's full collection walks every tracked object: about a second per 3 million here, several at
10 million, all of it on the event loop (docs/benchmarks.md, "Issue 19: ten million objects").
The records hold no reference cycles that matter (a removed record is freed by its reference count
the moment the tables let go of it), so walking them finds nothing.

`LongLivedFreezer.observe(count)` moves everything tracked into the collector's permanent generation
(`gc.freeze()`, O(1)) each time the object count has grown by `growth` since the last freeze (and is
at least `minimum`): collections then walk only what was allocated since. A freeze happens about
log_{1+growth}(n / minimum) times over a fill, never under steady churn. The price: cyclic garbage
alive at a freeze (a few thousand asyncio objects at most) is never collected, once per freeze.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LongLivedFreezer:
    def __init__(self, growth: float = 0.25, minimum: int = 200_000, freeze: Callable[[], None] = gc.freeze) -> None:
        self.growth = growth
        self.minimum = minimum
        self.freezes = 0
        self._frozen_at = 0  # the object count at the last freeze
        self._freeze = freeze

    def reset(self) -> None:
        """The tables were replaced (a new epoch, or standing by): unfreeze everything, so the old
        tables, a reference cycle (their policy modules hold them), are collected, and count anew."""
        gc.unfreeze()
        self._frozen_at = 0

    def observe(self, count: int) -> bool:
        """Freeze if the tables grew enough since the last freeze; True when it froze now. Never
        with `minimum` 0 (switched off)."""
        if not self.minimum or count < self.minimum or count < self._frozen_at * (1 + self.growth):
            return False
        self._freeze()
        self._frozen_at = count
        self.freezes += 1
        logger.info("froze long-lived objects objects=%d frozen=%d", count, gc.get_freeze_count())
        return True
