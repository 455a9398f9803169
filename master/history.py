"""An opt-in record of objects and replicas that leave the master's tables for a reason other than a
client's remove (`--history-log PATH`).

Each event is one JSON line, appended and flushed (a SIGKILLed master loses at most what the
kernel had not yet been handed, which is nothing that was written):

    {"t": 12.345678, "event": "object", "reason": "evicted:watermark", "ns": "default",
     "key": "k", "checksum": 1234, "size": 4096, "segment": "seg0"}

`t` is CLOCK_MONOTONIC (time.monotonic()): comparable with the clients' records on the same host,
which is what the history checker (tests/chaos/) needs to tell whether a miss is explained.
`event` is "object" (the object is gone: its next read is a miss) or "replica" (one copy went, the
object stays readable from another). Reasons: "evicted:<why>" (watermark, allocation, quota,
corrupt), "segment:<why>" (heartbeat ttl expired, commit feed silent, remounted, unmounted,
drained), "reclaimed" (a put never ended), "replaced" (a stale pending put replaced by a new one),
"revoked" (the writer undid its failed put), "upsert:<why>" (an upsert's new version that never
became visible: revoked, reclaimed, lost, refused; the old version stays). An upsert's swap is a
"version" event, reason "upserted", with the replaced version's checksum and size: the key stays
readable, with the new version's bytes (kvtier.master.upsert).

Off by default: MasterState keeps `history = None` and each call site tests it first, so nothing
is formatted or written on any path. Bounded: after `history_log_max_size` bytes the log stops
growing and its last line says so (a checker that sees it knows the record is incomplete).
"""

from __future__ import annotations

import json
import logging
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.master.records import ObjectRecord

logger = logging.getLogger(__name__)

TRUNCATED = "truncated"  # the reason on the last line of a log that reached its size bound


class HistoryLog:
    """Append-only JSON lines of objects and replicas leaving the tables (see the module docstring)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        # Line-buffered append: a restarted master adds to the same file.
        self._file: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._written = self._file.tell()
        self.dropped = 0
        self._line({"t": time.monotonic(), "event": "start"})

    def left(self, record: ObjectRecord, reason: str, segment: str = "", replica: bool = False) -> None:
        """`record` (or, with `replica`, one copy of it, on `segment`) left the tables for `reason`."""
        self._line(
            {
                "t": time.monotonic(),
                "event": "version" if reason == "upserted" else "replica" if replica else "object",
                "reason": reason,
                "ns": record.namespace,
                "key": record.key,
                "checksum": record.checksum,
                "size": record.size,
                "segment": segment,
                "complete": record.state.name == "COMPLETE",
            }
        )

    def replaced(self, record: ObjectRecord) -> None:
        """`record` was replaced by an upsert's new version: its key stays readable, other bytes."""
        self.left(record, "upserted")

    def _line(self, event: dict) -> None:
        if self._file is None:
            self.dropped += 1
            return
        line = json.dumps(event, separators=(",", ":")) + "\n"
        try:
            if self._written + len(line) > self.max_bytes:
                self._file.write(json.dumps({"t": event["t"], "event": TRUNCATED}) + "\n")
                self._file.close()
                self._file = None
                self.dropped += 1
                logger.warning("history log %s reached %d bytes: no more events recorded", self.path, self.max_bytes)
                return
            self._file.write(line)
            self._written += len(line)
        except OSError as exc:  # a full disk must not take the master down: the record says it stopped
            logger.warning("history log %s: %s; no more events recorded", self.path, exc)
            self._file = None
            self.dropped += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_open: dict[str, HistoryLog] = {}


def open_history(path: str, max_bytes: int) -> HistoryLog | None:
    """The history log the config asks for, or None (off). One per path and process: every epoch's
    tables (a master builds new ones when it starts leading) append through the same file."""
    if not path:
        return None
    log = _open.get(path)
    if log is None or log._file is None and not log.dropped:  # closed by its owner: open again
        log = _open[path] = HistoryLog(path, max_bytes)
    return log
