"""Structured logs: one `key=value` line per event (logfmt), the same on every service.

    ts=2026-11-30T10:12:03.114Z level=warning component=segment logger=kvtier.segment_server.protocol
        rid=5f3a9c01-0000002a msg="range error" peer=127.0.0.1:50412 ...

Call sites keep the stdlib logger and write their message as an event followed by
`key=value` pairs (`logger.info("segment mounted id=%d name=%s", ...)`); the
formatter splits the event from the pairs and quotes every value that needs it, so
a value with spaces stays one field; a value that may itself contain `k=v` text
goes in `extra={"fields": {...}}` instead. Tracebacks are one quoted `exc=` field, so a
log line is always one line.

`rid` is the request id of the client call being served. A client numbers its
calls (a random 32-bit client tag, then a 32-bit sequence: one u64, shown as
`tttttttt-ssssssss`) and sends the id with every master request and data-plane
frame of that call; servers set `request_id` for the duration of a handler and
every line it logs carries `rid=`, and the client's errors and warnings name the
same id, so one grep finds a failed call on every process it touched.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

# The request id (u64, 0 = none) of the client call being made or served by this thread or task.
request_id: contextvars.ContextVar[int] = contextvars.ContextVar("kvtier_request_id", default=0)


def format_request_id(number: int) -> str:
    """A wire request id (u64: client tag, sequence) as logs and errors show it."""
    return f"{number >> 32:08x}-{number & 0xFFFFFFFF:08x}" if number else ""


_PAIR_START = re.compile(r"(?:^|(?<=\s))([A-Za-z_][\w.]*)=")
_NEEDS_QUOTES = re.compile(r'[\s"=\\]|^$')


def quote(value: str) -> str:
    """A logfmt value: bare when it can be, else a JSON string (escapes quotes and newlines)."""
    return json.dumps(value) if _NEEDS_QUOTES.search(value) or not value.isprintable() else value


def split_message(message: str) -> tuple[str, list[tuple[str, str]]]:
    """("event text", [(key, value), ...]) of a message written as "event key=value key=value"."""
    starts = list(_PAIR_START.finditer(message))
    if not starts:
        return message.strip(), []
    event = message[: starts[0].start()].strip()
    pairs = []
    for match, following in zip(starts, [*starts[1:], None], strict=True):
        end = following.start() if following is not None else len(message)
        pairs.append((match.group(1), message[match.end() : end].strip()))
    return event, pairs


class KeyValueFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        event, pairs = split_message(record.getMessage())
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = [
            f"ts={stamp}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"component={self.component}",
            f"logger={record.name}",
        ]
        rid = getattr(record, "rid", "") or format_request_id(request_id.get())
        if rid and not any(key == "rid" for key, _ in pairs):
            fields.append(f"rid={quote(rid)}")
        fields.append(f"msg={quote(event)}")
        fields.extend(f"{key}={quote(value)}" for key, value in pairs)
        # Values that may hold anything (an error text with its own "k=v" in it) come as a dict,
        # `logger.warning("request refused", extra={"fields": {"detail": text}})`, never split.
        extra = getattr(record, "fields", None) or {}
        fields.extend(f"{key}={quote(str(value))}" for key, value in extra.items())
        if record.exc_info:
            fields.append(f"exc={quote(self.formatException(record.exc_info))}")
        return " ".join(fields)


class RequestIdFilter(logging.Filter):
    """For loggers of library code (the client) whose records the engine formats: appends
    ` rid=...` to the message of any record logged during a client call."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (number := request_id.get()) and not hasattr(record, "rid"):
            record.rid = format_request_id(number)
            record.msg = f"{record.msg} rid={record.rid}"
        return True


class LogBudget:
    """At most `per_second` lines a second through one budget; the rest are counted and reported in
    one line when the next second starts. For events a flood of bad peers can cause (refusals,
    protocol errors): they must not become a flood of log lines. Single-threaded (an event loop)."""

    def __init__(self, logger: logging.Logger, what: str, per_second: int = 20) -> None:
        self._logger = logger
        self._what = what
        self._per_second = per_second
        self._second = 0
        self._lines = 0
        self._dropped = 0

    def log(self, level: int, message: str, *args: object, **kwargs: object) -> bool:
        """Log unless this second's budget is spent; False when the line was dropped (counted)."""
        second = int(time.monotonic())
        if second != self._second:
            if self._dropped:
                self._logger.warning("%s log lines dropped count=%d", self._what, self._dropped)
            self._second, self._lines, self._dropped = second, 0, 0
        if self._lines >= self._per_second:
            self._dropped += 1
            return False
        self._lines += 1
        self._logger.log(level, message, *args, **kwargs)  # type: ignore[arg-type]
        return True


def setup_logging(component: str, level: str) -> None:
    """Every record of this process as one key=value line on stderr (journald and containers keep it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(component))
    handler.kvtier = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    # Replace only an earlier handler of ours: handlers someone else installed (a test runner's
    # capture, an embedding application's) stay.
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "kvtier", False)] + [handler]
    root.setLevel(level.upper())
