"""The service runner both servers' entry points share: `run_service` and `stop_on_signals`.

`kvtier-master` and `kvtier-segment` run their `serve()` coroutine the same way: on uvloop when it
is installed (the default asyncio loop otherwise, with a warning), a start-up failure the user
fixes (`StartupError`) reported as one line on stderr with exit status 2 (kvtier.common.startup),
and SIGINT/SIGTERM turned into a graceful stop by the service itself (`stop_on_signals`, called
once the service is far enough into its start to stop cleanly).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from kvtier.common.startup import StartupError, run_main


def event_loop_factory(logger: logging.Logger) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory; None (asyncio's default loop) with a warning when uvloop is missing."""
    try:
        import uvloop
    except ImportError:
        logger.warning("uvloop not installed; using the default asyncio loop")
        return None
    return uvloop.new_event_loop


def run_service(
    prog: str,
    serve: Callable[[], Coroutine[Any, Any, int | None]],
    *,
    logger: logging.Logger,
    startup_errors: tuple[type[Exception], ...] = (),
    user_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Run `serve()` to its end on a fresh event loop; the process exit status.

    Returns what `serve()` returns (None: 0). A StartupError, or one of `startup_errors`, is one
    line `<prog>: <reason>` on stderr and exit status 2; one of `user_errors` (a directory the
    service cannot use while serving, say) is the same line with exit status 1. Anything else is a
    bug and propagates with its traceback. `logger` is the entry point's, so the uvloop warning
    names the service that gave it.
    """
    loop_factory = event_loop_factory(logger)

    def body() -> int:
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                code = runner.run(serve())
        except startup_errors as exc:
            raise StartupError(str(exc)) from None
        except user_errors as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
        return 0 if code is None else code

    return run_main(prog, body)


def stop_on_signals(stop: asyncio.Event, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Set `stop` on SIGINT or SIGTERM (the running loop's handlers): the service then shuts down
    in order instead of dying with the signal's default action."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
