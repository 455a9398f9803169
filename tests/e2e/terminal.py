"""What a user does at a terminal, for the end-to-end tests: run the installed `kvtier` script, keep
`kvtier up` in the foreground and stop it with Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The console script of the install under test (pip puts it beside the interpreter), not `python -m`:
# its entry point is part of what a user's path goes through.
KVTIER = Path(sys.executable).with_name("kvtier")
CLI_TIMEOUT_S = 60


def kvtier(*args: str, stdin: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
    assert KVTIER.exists(), f"the install has no `kvtier` script beside {sys.executable}"
    result = subprocess.run([str(KVTIER), *args], input=stdin, capture_output=True, timeout=CLI_TIMEOUT_S)
    if check and result.returncode != 0:
        raise AssertionError(f"kvtier {' '.join(args)} exited {result.returncode}: {result.stderr.decode()}")
    return result


def kvtier_json(*args: str) -> dict:
    return json.loads(kvtier(*args, "--json").stdout)


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """`kvtier up` as a user runs it in a terminal: started, read until it says how to stop it, Ctrl-C.

    `kvtier` and `env`: another install's script and its environment (tests/e2e/test_install.py)."""

    def __init__(self, args: list[str], log: Path, *, kvtier: Path = KVTIER, env: dict | None = None) -> None:
        self.log = log
        self._err = open(log, "ab")  # noqa: SIM115 (closed by ctrl_c or kill)
        self.proc = subprocess.Popen([str(kvtier), "up", *args], stdout=subprocess.PIPE, stderr=self._err, env=env)
        self.lines: list[str] = []
        while "Ctrl-C stops" not in (line := self.proc.stdout.readline().decode()):
            if not line:
                self.kill()
                raise AssertionError(f"kvtier up exited during start-up: {self.lines} {log.read_text()[-2000:]}")
            self.lines.append(line)

    def ctrl_c(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=CLI_TIMEOUT_S)
        self.lines += self.proc.stdout.read().decode().splitlines()
        return code

    def kill(self) -> None:
        """Stop it whatever state the test left it in: SIGTERM stops its servers too (SIGKILL would orphan them)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=CLI_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._err.close()
