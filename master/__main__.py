"""`kvtier-master`: the metadata master."""

from __future__ import annotations

import gc
import logging
import sys

from kvtier.common.logs import setup_logging
from kvtier.common.service import run_service
from kvtier.master.config import parse_args
from kvtier.master.server import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("master", config.log_level)
    # A master holds millions of long-lived records: with the default thresholds (700 allocations)
    # the cyclic collector keeps walking them and took a quarter of the master's CPU at 1M objects
    # (docs/benchmarks.md). Young collections 100x rarer; the records hold no cycles that matter.
    gc.set_threshold(70_000, 20, 20)
    # A start-up failure: one line, exit status 2 (kvtier.common.startup).
    return run_service("kvtier-master", lambda: serve(config), logger=logging.getLogger(__name__))


if __name__ == "__main__":
    sys.exit(main())
