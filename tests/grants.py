"""Real shm grant servers for tests: `ShmListener`s on an event loop in a background thread.

The segment server runs its grant socket on its uvloop; tests run the same
listener on a uvloop (asyncio's own loop when uvloop is missing) in a thread,
so that clients in the test's thread talk to it over a real Unix socket.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvtier.proto.region import host_id
from kvtier.segment_server.listeners import ShmListener

try:
    import uvloop

    _new_loop = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop is a dependency of the segment server
    _new_loop = asyncio.new_event_loop

TIMEOUT_S = 10.0


class GrantLoop:
    """An event loop in a daemon thread; `serve()` starts listeners on it, `close()` stops them all."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grant-loop", daemon=True)
        self._thread.start()
        self.listeners: list[ShmListener] = []

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    def serve(
        self, socket_path: str, fd: int, nonce: bytes, *, host: str = "", **kwargs: Any
    ) -> tuple[str, ShmListener]:
        """Start a listener granting `fd` at `socket_path`: (the URL it advertises, the listener)."""
        listener = ShmListener(socket_path, fd, host or host_id(), nonce, **kwargs)
        url = self.run(listener.start())
        self.listeners.append(listener)
        return url, listener

    def stop(self, listener: ShmListener) -> None:
        self.run(listener.stop())

    def close(self) -> None:
        for listener in self.listeners:
            self.run(listener.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(TIMEOUT_S)
        self.loop.close()


def open_fd(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT_S) -> bool:
    """Poll `predicate` (the grant loop counts outcomes on its own thread) until true or `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
