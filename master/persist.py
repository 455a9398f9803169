"""The little a master saves: which segments to wait for, instance registrations, its epoch.

Objects are never saved here: segments report them after a restart
(kvtier.master.recovery). What the segments cannot tell is saved by the
leader whenever it changes (rarely: a segment mounts or leaves, an instance
registers), off the event loop:

- `segments`: names mounted, so a restarted master knows whose inventories
  to wait for before it answers reads (a miss during recovery would be a
  false miss);
- `instances`: TP x PP and budget per engine deployment (per-rank quotas);
- `expelled`: segments the master expelled (silent past their TTL) whose DRAM
  index is stale: told to discard it when they mount again, in any later
  incarnation (saved before the calls that waited on them answer);
- `epoch`: standalone only, so the next incarnation's epoch is larger;
- `drained`: [segment name, incarnation] of segments drained lately (kvtier.master.drain): a drained
  process that mounts again is told SEGMENT_DRAINED and exits, also after a master restart (it came
  back ACTIVE when the restart fell between the drain's end and its process noticing);
- `direct_read_lease_ms`: the longest direct-read lease a segment may still hold from this
  incarnation (or, until its own fence passed, from one before it): the next incarnation answers
  no change before that long, whatever its own `heartbeat_interval_s` (docs/architecture.md,
  "Direct reads").
- `owed_forgets`: segment name -> [disk location, object name] of FORGETs a
  change was answered without (their segment's tier worker stalled past the
  wait, or it was away; kvtier.master.tiering): the next incarnation refuses
  those copies when the segment reports them, and hands the FORGETs out
  again. At most `OWED_SAVED_MAX_BYTES` (1 MiB) of them; past that the segments
  with the most are saved as `expelled` instead (all their copies refused:
  misses, never stale bytes).

Standalone masters keep it in `<state_dir>/master-state.json` (written to a
temporary file, fsynced, renamed). HA masters keep it in etcd under
`/kvtier/<cluster>/state`, written only while leading. Without either a
master starts with nothing to wait for and takes no DRAM inventories.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier.common.startup import StartupError

logger = logging.getLogger(__name__)

STATE_FILE = "master-state.json"
LOCK_FILE = "master.lock"  # flocked by the master that uses the directory (FileStateStore.lock)


@dataclass(slots=True)
class SavedState:
    epoch: int = 0
    segments: list[str] = field(default_factory=list)
    instances: dict[str, list[int]] = field(default_factory=dict)  # instance -> [tp, pp, budget]
    expelled: list[str] = field(default_factory=list)  # segments whose DRAM index is stale
    direct_read_lease_ms: int = 0  # the longest lease a segment may hold from the incarnations so far
    owed_forgets: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # segment -> (location, name)
    drained: list[tuple[str, str]] = field(default_factory=list)  # (segment name, incarnation), oldest first

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SavedState:
        raw = json.loads(data)
        return cls(
            epoch=int(raw.get("epoch", 0)),
            segments=[str(s) for s in raw.get("segments", [])],
            instances={str(k): [int(x) for x in v] for k, v in raw.get("instances", {}).items()},
            expelled=[str(s) for s in raw.get("expelled", [])],
            direct_read_lease_ms=int(raw.get("direct_read_lease_ms", 0)),
            owed_forgets={
                str(segment): [(int(location), str(name)) for location, name in pairs]
                for segment, pairs in raw.get("owed_forgets", {}).items()
            },
            drained=[(str(name), str(incarnation)) for name, incarnation in raw.get("drained", [])],
        )


class StateUnreadable(Exception):
    """The saved state exists but cannot be read: recover nothing, and never overwrite it."""


class StateStore(Protocol):
    def load(self) -> SavedState | None: ...

    def save(self, saved: SavedState) -> None: ...


class NoStateStore:
    def load(self) -> SavedState | None:
        return None

    def save(self, saved: SavedState) -> None:
        pass


class FileStateStore:
    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = -1

    def lock(self) -> None:
        """Hold the directory for this process's life (an exclusive flock on LOCK_FILE, released by the
        kernel when the process ends, kill -9 included). Each master rewrites the whole state file
        from its own view, so two sharing a directory would erase each other's record of the
        segments they expelled (and a removed object could come back from one): StartupError, one
        line, when another process holds it."""
        path = self.path.parent / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # e.g. left by another user's master
            raise StartupError(f"cannot open {path}: {exc.strerror or exc}: change --state-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartupError(
                f"state directory {self.path.parent} is in use by another master (pid {holder}): change --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def load(self) -> SavedState | None:
        """The saved state; None on a first start; StateUnreadable when it exists but cannot be read."""
        try:
            return SavedState.from_json(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise StateUnreadable(f"master state file {self.path}: {exc}") from None

    def save(self, saved: SavedState) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(saved.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def next_standalone_epoch(saved: SavedState | None) -> int:
    """Larger than the saved one, and than any earlier start's (milliseconds since 1970)."""
    return max((saved.epoch if saved else 0) + 1, int(time.time() * 1000))
