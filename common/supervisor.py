"""Child processes for `kvtier up`, the benchmarks and the test harness: one supervisor for all three.

A `Supervisor` starts each child with its argv, environment and output (a log file it appends to,
the parent's terminal, or nothing), in a session of its own (so a Ctrl-C at the terminal reaches
the parent only, and the parent stops its children in the order it chooses), waits until the child
says it is ready, and stops it gracefully: SIGTERM, then SIGKILL after a grace period. Readiness is
whichever the caller names:

- a ready file: the servers' `--ready-file` JSON, written once they serve (a segment: once its
  master took its mount); the parsed JSON becomes `Child.info`;
- a line in the child's log (a regular expression, searched in what the child wrote so far);
- a probe: a callable, true once the child answers (etcd's linearizable read, say).

A child that exits before it is ready raises `ChildExited` (its exit status and the tail of its
log in the message); one not ready in time is killed and raises `ChildNotReady`. Both are
RuntimeErrors. `report()` gives every child's exit status and log tail, for a failing test or
bench to print.

Nothing is left behind: `close()` (or leaving the `with` block, an exception included) stops
every child still running, and an interpreter that exits without closing a supervisor stops the
children at exit (atexit), rather than leaving servers holding ports and shared memory.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long: a segment's clean unmount fits well inside
POLL_S = 0.02


class ChildExited(RuntimeError):
    """A child exited before it was ready; `returncode` is its exit status (negative: the signal)."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with {child.popen.returncode} before ready:\n{child.tail()}")
        self.name = child.name
        self.returncode: int = child.popen.returncode


class ChildNotReady(RuntimeError):
    """A child was not ready in time; it has been killed."""

    def __init__(self, child: Child, timeout: float) -> None:
        super().__init__(f"{child.name} not ready after {timeout:.0f}s:\n{child.tail()}")
        self.name = child.name
        self.timeout = timeout


@dataclass
class Child:
    """One started process. `popen` is the subprocess.Popen (tests send it signals directly)."""

    name: str
    popen: subprocess.Popen
    log: Path | None = None  # None: its output went to the parent's terminal or nowhere
    ready_file: Path | None = None
    info: dict = field(default_factory=dict)  # the ready file's JSON once ready

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), None while it runs."""
        return self.popen.poll()

    def tail(self, lines: int = 40) -> str:
        """The last `lines` lines of its log ("(no log)" when it has none)."""
        if self.log is None:
            return "(no log)"
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def send(self, sig: int) -> None:
        """Send `sig` if it still runs (a reaped child's pid may belong to another process by now)."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = STOP_GRACE_S) -> int:
        """Send `sig` and wait for the exit (SIGKILL by default: no clean-up in the child); its status.
        subprocess.TimeoutExpired when a signal it survives or handles slowly leaves it running."""
        self.send(sig)
        return self.popen.wait(timeout=timeout)

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until every thread of it has stopped (state T): the signal alone returns
        before they have, and a test relies on nothing being answered after pause() returns."""
        self.send(signal.SIGSTOP)
        tasks = f"/proc/{self.popen.pid}/task"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = []
                for tid in os.listdir(tasks):
                    with open(f"{tasks}/{tid}/stat") as f:
                        states.append(f.read().rpartition(")")[2].split()[0])
            except OSError:  # it exited, or a thread went while we looked: nothing left to wait for
                return
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)

    def resume(self) -> None:
        self.send(signal.SIGCONT)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """Stop it gracefully (see `stop_all`); its exit status."""
        stop_all([self], grace_s)
        return self.popen.returncode


def stop_all(children: Iterable[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child still running, all at once; SIGKILL those not gone after `grace_s`.

    A SIGCONT follows the SIGTERM: a paused (SIGSTOPped) child would otherwise keep the SIGTERM
    pending until the grace ran out and be killed without its clean shutdown. Every child is
    reaped, so none is left a zombie.
    """
    children = list(children)
    for child in children:
        if child.alive:
            child.popen.terminate()
            child.send(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait()


def ready_file_info(path: Path) -> dict | None:
    """The ready file's JSON once it is there and complete; None before."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError:  # written but not yet complete: the servers write it in one go, but be sure
        return None


class Supervisor:
    """Starts, watches and stops child processes; a context manager that stops them all on the way out.

    `children` maps each name to its latest child (a restarted child replaces the one before it);
    every child ever started is stopped and reaped by `close()`, in reverse start order.
    """

    def __init__(self, workdir: Path | None = None, *, grace_s: float = STOP_GRACE_S) -> None:
        """`workdir`: where `start(..., log=True)` puts `<name>.log`; `grace_s`: SIGTERM to SIGKILL."""
        self.workdir = workdir
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self._started: list[Child] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log: Path | bool | None = True,
        quiet: bool = False,
        ready_file: Path | None = None,
        ready_line: str | None = None,
        probe: Callable[[], object] | None = None,
        timeout: float = READY_TIMEOUT_S,
        poll_s: float = POLL_S,
    ) -> Child:
        """Start `argv` and wait until it is ready; the Child.

        `env`: added to this process's environment; `cwd`: its working directory (ours by default).
        `log`: a file its stdout and stderr are appended to (True: `<workdir>/<name>.log`); None or
        False: they go where ours go, or nowhere when `quiet`. Readiness: `ready_file` (removed
        first; it must be passed in `argv` as the child expects it, e.g. `--ready-file`),
        `ready_line` (a regular expression searched in the log), `probe` (called until it returns
        something true; its exceptions propagate, the child left running for `close()`); checked in
        that order, every `poll_s`, up to `timeout` seconds; with none of them the child counts as
        ready once started. Raises ChildExited or ChildNotReady (after killing it).
        """
        if log is True:
            if self.workdir is None:
                raise ValueError("log=True needs the supervisor's workdir")
            log = self.workdir / f"{name}.log"
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if log:
            with open(log, "ab") as out:
                popen = subprocess.Popen(
                    list(argv), stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=cwd, start_new_session=True
                )
        else:
            out = subprocess.DEVNULL if quiet else None
            popen = subprocess.Popen(list(argv), stdout=out, stderr=out, env=child_env, cwd=cwd, start_new_session=True)
        child = Child(name, popen, log or None, ready_file)
        with self._lock:
            self.children[name] = child
            self._started.append(child)
        _live.add(self)
        ready = {"ready_file": ready_file, "ready_line": ready_line, "probe": probe}
        self.wait_ready(child, **ready, timeout=timeout, poll_s=poll_s)
        return child

    def start_retrying(self, name: str, argv: Sequence[str], *, retry_s: float, gap_s: float = 0.05, **kwargs) -> Child:
        """`start()` again for up to `retry_s` seconds while it fails: a killed process's port may
        linger for a moment before a new one can listen on it."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return self.start(name, argv, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(gap_s)

    def wait_ready(
        self,
        child: Child,
        *,
        ready_file: Path | None = None,
        ready_line: str | None = None,
        probe: Callable[[], object] | None = None,
        timeout: float = READY_TIMEOUT_S,
        poll_s: float = POLL_S,
    ) -> None:
        """Wait until `child` is ready (see `start`); ChildExited, or ChildNotReady after killing it."""
        pattern = re.compile(ready_line) if ready_line is not None else None
        if pattern is not None and child.log is None:
            raise ValueError(f"{child.name}: ready_line needs a log file")
        deadline = time.monotonic() + timeout
        while True:
            if self._is_ready(child, ready_file, pattern, probe):
                return
            if not child.alive:
                if self._is_ready(child, ready_file, pattern, probe):  # ready, then gone: still ready
                    return
                raise ChildExited(child)
            if time.monotonic() > deadline:
                child.popen.kill()
                child.popen.wait()
                raise ChildNotReady(child, timeout)
            time.sleep(poll_s)

    @staticmethod
    def _is_ready(child: Child, ready_file: Path | None, pattern: re.Pattern | None, probe) -> bool:
        if ready_file is not None:
            info = ready_file_info(ready_file)
            if info is None:
                return False
            child.info = info
        if pattern is not None:
            try:
                text = child.log.read_text(errors="replace")  # type: ignore[union-attr]
            except OSError:
                return False
            if not pattern.search(text):
                return False
        return probe is None or bool(probe())

    def stop(self, *children: Child, grace_s: float | None = None) -> None:
        """Stop these children gracefully, all at once (`stop_all`)."""
        stop_all(children, self.grace_s if grace_s is None else grace_s)

    def report(self, lines: int = 40, children: Iterable[Child] | None = None) -> str:
        """Each child's exit status (None: running) and log tail, for a failure message."""
        chosen = self.children.values() if children is None else children
        return "\n".join(f"----- {c.name} (rc={c.popen.poll()}) -----\n{c.tail(lines)}" for c in chosen)

    def close(self) -> None:
        """Stop every child still running, newest first (SIGTERM, SIGKILL after the grace); idempotent."""
        with self._lock:
            started, self._started = self._started, []
        for child in reversed(started):
            stop_all([child], self.grace_s)
        _live.discard(self)


_live: set[Supervisor] = set()  # those with children not yet stopped by close(); held until then


@atexit.register
def _close_all() -> None:
    """Children of a supervisor nobody closed are stopped when the interpreter exits."""
    for supervisor in list(_live):
        try:
            supervisor.close()
        except Exception as exc:  # one failure must not keep the others' children running
            print(f"kvtier: stopping child processes: {exc}", file=sys.stderr)
