"""`kvtier-segment`: a segment server owning a DRAM region."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvtier.common.logs import setup_logging
from kvtier.common.startup import StartupError, run_main
from kvtier.segment_server.config import parse_args
from kvtier.segment_server.server import FdLimitError, serve


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("segment", config.log_level)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        logging.getLogger(__name__).warning("uvloop not installed; using the default asyncio loop")
        loop_factory = None

    def run() -> int:
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                return runner.run(serve(config))
        except FdLimitError as exc:  # the SSD tier's size against the open file limit: a start-up failure
            raise StartupError(str(exc)) from None
        except OSError as exc:  # for the user to fix (a directory while serving): one line
            print(f"kvtier-segment: {exc}", file=sys.stderr)
            return 1

    return run_main("kvtier-segment", run)  # a start-up failure: one line, exit status 2


if __name__ == "__main__":
    sys.exit(main())
