"""`kvtier-segment`: a segment server owning a DRAM region."""

from __future__ import annotations

import logging
import sys

from kvtier.common.logs import setup_logging
from kvtier.common.service import run_service
from kvtier.segment_server.config import parse_args
from kvtier.segment_server.server import FdLimitError, serve


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("segment", config.log_level)
    return run_service(
        "kvtier-segment",
        lambda: serve(config),
        logger=logging.getLogger(__name__),
        # The SSD tier's size against the open file limit: a start-up failure (one line, exit 2).
        startup_errors=(FdLimitError,),
        # For the user to fix (a directory while serving): one line, exit status 1.
        user_errors=(OSError,),
    )


if __name__ == "__main__":
    sys.exit(main())
