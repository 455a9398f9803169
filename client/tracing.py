"""Request ids for client calls: one id per public call, on everything the call sends.

Each `Client` draws a random 32-bit tag; its calls are numbered after it (one
u64 per call, `tttttttt-ssssssss` in logs: kvtier.common.logs). `traced` sets the
id for the duration of a call (a nested call, `put` -> `batch_put`, keeps the
outer one); the master requests and data-plane frames the call sends read it
from the context, the I/O pool's jobs run in a copy of it, and a `KvtierError`
leaving the call names it (`exc.request_id`, and in its text), as do the
client's log lines (RequestIdFilter), so a failed call can be found in the
master's and segment servers' logs. The outermost call is also timed, per
method name (`Client.latency()`, `kvtier_client_op_latency_seconds`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.common.logs import RequestIdFilter, format_request_id, request_id
from kvtier.proto.errors import KvtierError

F = TypeVar("F", bound=Callable[..., Any])

_filter = RequestIdFilter()
for _name in ("kvtier.client.client", "kvtier.client.master", "kvtier.client.transport.tcp", "kvtier.cli.drain"):
    logging.getLogger(_name).addFilter(_filter)


class RequestIds:
    """Ids of one client's calls: its tag in the high 32 bits, a sequence in the low ones."""

    def __init__(self) -> None:
        self._tag = secrets.randbits(32) or 1
        self._sequence = itertools.count(1)
        self._lock = threading.Lock()  # itertools.count is atomic in CPython; the lock says so anyway

    def next(self) -> int:
        with self._lock:
            return (self._tag << 32) | (next(self._sequence) & 0xFFFFFFFF)


def traced(method: F) -> F:
    """Run a public `Client` method under a request id of its own (see the module docstring)."""

    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if request_id.get():
            return method(self, *args, **kwargs)
        number = self._request_ids.next()
        token = request_id.set(number)
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        except KvtierError as exc:
            exc.request_id = exc.request_id or format_request_id(number)
            raise
        finally:
            self._observe_latency(name, time.perf_counter() - started)
            request_id.reset(token)

    return wrapper  # type: ignore[return-value]
