"""Env-gated failpoints: fault injection at chosen moments, for tests of real processes.

`KVTIER_FAILPOINTS="name=action,..."`, read once when the module is imported; unset in production,
where `hit()` is one dict lookup that finds nothing. Actions:

- `kill`: SIGKILL this process at that point (a crash at exactly that moment);
- `stall:<seconds>`: sleep there (a hung disk or thread), once per hit;
- `eio`: raise OSError(EIO) there (a failing device: where no real one can be had, e.g. fdatasync).

Each hit is logged first (`failpoint NAME reached`), so a test waits for the log line, not a sleep.
Names in use: `tier.offload_sync` (an OFFLOAD batch is about to be fdatasync'ed), `tier.offload_synced`
(the batch is durable, not yet reported to the master),
`tier.promote_read` (a PROMOTE read and verified its record, before writing DRAM), `tier.forget` (a
poll batch's FORGETs are about to be tombstoned).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

logger = logging.getLogger(__name__)


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for item in spec.split(","):
        name, _, action = item.strip().partition("=")
        if name:
            out[name] = action or "kill"
    return out


_ACTIVE = _parse(os.environ.get("KVTIER_FAILPOINTS", ""))


def hit(name: str) -> None:
    action = _ACTIVE.get(name)
    if action is None:
        return
    logger.warning("failpoint %s reached action=%s", name, action)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("stall:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "eio":
        raise OSError(errno.EIO, f"failpoint {name}")
