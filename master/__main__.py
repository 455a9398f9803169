"""`kvtier-master`: the metadata master."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

from kvtier.common.logs import setup_logging
from kvtier.common.startup import run_main
from kvtier.master.config import parse_args
from kvtier.master.server import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("master", config.log_level)
    # A master holds millions of long-lived records: with the default thresholds (700 allocations)
    # the cyclic collector keeps walking them and took a quarter of the master's CPU at 1M objects
    # (docs/benchmarks.md). Young collections 100x rarer; the records hold no cycles that matter.
    gc.set_threshold(70_000, 20, 20)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        logging.getLogger(__name__).warning("uvloop not installed; using the default asyncio loop")
        loop_factory = None

    def run() -> int:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config))
        return 0

    return run_main("kvtier-master", run)  # a start-up failure: one line, exit status 2


if __name__ == "__main__":
    sys.exit(main())
