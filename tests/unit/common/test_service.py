"""The servers' shared runner (kvtier.common.service): exit statuses, one-line errors, stop signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from kvtier.common.service import run_service, stop_on_signals
from kvtier.common.startup import StartupError

logger = logging.getLogger("kvtier.test_service")


class ReasonError(ValueError):
    pass


def test_the_service_return_value_is_the_exit_status():
    async def three() -> int:
        return 3

    async def nothing() -> None:
        return None

    assert run_service("kvtier-x", three, logger=logger) == 3
    assert run_service("kvtier-x", nothing, logger=logger) == 0


def test_it_runs_on_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")

    async def loop_kind() -> int:
        return int(isinstance(asyncio.get_running_loop(), uvloop.Loop))

    assert run_service("kvtier-x", loop_kind, logger=logger) == 1


def test_a_startup_error_is_one_line_and_status_2(capsys):
    async def fails() -> int:
        raise StartupError("cannot listen on 127.0.0.1:1: address already in use: change --listen")

    assert run_service("kvtier-x", fails, logger=logger) == 2
    err = capsys.readouterr().err
    assert err == "kvtier-x: cannot listen on 127.0.0.1:1: address already in use: change --listen\n"


def test_named_startup_and_user_errors(capsys):
    async def startup() -> int:
        raise ReasonError("the open file limit is too low for --ssd-size")

    async def user() -> int:
        raise PermissionError("cannot write /x")

    assert run_service("kvtier-x", startup, logger=logger, startup_errors=(ReasonError,)) == 2
    assert capsys.readouterr().err == "kvtier-x: the open file limit is too low for --ssd-size\n"
    assert run_service("kvtier-x", user, logger=logger, user_errors=(OSError,)) == 1
    assert capsys.readouterr().err == "kvtier-x: cannot write /x\n"


def test_any_other_exception_is_a_bug_and_propagates():
    async def bug() -> int:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_service("kvtier-x", bug, logger=logger, user_errors=(OSError,))


def test_sigterm_and_sigint_set_the_stop_event():
    async def serve() -> int:
        stop = asyncio.Event()
        stop_on_signals(stop)
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                stop.clear()
                os.kill(os.getpid(), sig)
                await asyncio.wait_for(stop.wait(), timeout=10)
        finally:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return 0

    assert run_service("kvtier-x", serve, logger=logger) == 0
