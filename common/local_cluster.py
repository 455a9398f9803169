"""Start a master and segment servers as local child processes (for `kvtier up` and `kvtier bench`).

The servers run as separate processes (`python -m kvtier.master`, `python -m
kvtier.segment_server`), never imported: the client stays thin, and the
benchmark's client is in a different process from the segment server, as in
production. Readiness comes from each server's `--ready-file`.

It lives in the shared runtime, not in kvtier.cli: `kvtier up` (kvtier.cli) and the benchmarks
(kvtier.bench, which kvtier.cli imports) both start clusters with it, and the command package is
imported by nothing (the import contracts in pyproject.toml, run by `make lint`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 30.0


STARTUP_EXIT = 2  # a server's start-up failure (kvtier.common.startup): it printed one line saying why


class StartupFailed(RuntimeError):
    """A server exited with status 2 during start-up, after printing its one-line reason to stderr."""

    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name} exited with status {returncode} during start-up")
        self.returncode = returncode


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    info: dict = field(default_factory=dict)


class LocalCluster:
    """A master plus `segments` segment servers on loopback. Use as a context manager."""

    def __init__(
        self,
        *,
        listen: str = "127.0.0.1:0",
        dram: str = "1GiB",
        segments: int = 1,
        cluster_id: str = "default",
        log_level: str = "WARNING",
        quiet: bool = False,
        ssd: str = "0",
        ssd_dir: str = "",
        segment_args: tuple[str, ...] = (),
        master_args: tuple[str, ...] = (),
        state_dir: str = "",
    ) -> None:
        """`ssd` > 0 gives each segment an SSD tier of that size in `ssd_dir`/local<i> (default: a
        temporary directory, removed at stop); `segment_args` go to every segment server. The
        master saves its state in `state_dir` ("none": nowhere; default: the temporary directory)."""
        self.listen = listen
        self.dram = dram
        self.segment_count = segments
        self.cluster_id = cluster_id
        self.log_level = log_level
        self.quiet = quiet
        self.ssd = ssd
        self.ssd_dir = ssd_dir
        self.segment_args = segment_args
        self.master_args = master_args
        self.state_dir = state_dir
        self.children: list[Child] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-")
        self.master_address = ""

    def _spawn(self, name: str, args: list[str]) -> Child:
        ready = Path(self._tmp.name) / f"{name}.ready"
        out = subprocess.DEVNULL if self.quiet else None
        popen = subprocess.Popen(
            [sys.executable, *args, "--ready-file", str(ready), "--log-level", self.log_level],
            stdout=out,
            stderr=out,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
        )
        child = Child(name, popen)
        self.children.append(child)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if popen.poll() is not None:
                if popen.returncode == STARTUP_EXIT:
                    raise StartupFailed(name, popen.returncode)
                raise RuntimeError(f"{name} exited with status {popen.returncode} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become ready within {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.02)
        child.info = json.loads(ready.read_text())
        return child

    def start(self) -> LocalCluster:
        try:
            master = self._spawn(
                "master",
                [
                    "-m",
                    "kvtier.master",
                    "--listen",
                    self.listen,
                    "--cluster-id",
                    self.cluster_id,
                    "--state-dir",
                    self.state_dir or str(Path(self._tmp.name) / "state"),
                    *self.master_args,
                ],  # fmt: skip
            )
            self.master_address = master.info["address"]
            for i in range(self.segment_count):
                self._spawn(
                    f"segment{i}",
                    [
                        "-m", "kvtier.segment_server",
                        "--master", self.master_address,
                        "--listen", "127.0.0.1:0",
                        "--dram", self.dram,
                        "--cluster-id", self.cluster_id,
                        "--name", f"{os.uname().nodename[:40]}-local{i}",
                        *self._ssd_args(i),
                        *self.segment_args,
                    ],
                )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def _ssd_args(self, index: int) -> list[str]:
        if self.ssd in ("", "0"):
            return []
        directory = Path(self.ssd_dir or Path(self._tmp.name) / "ssd") / f"local{index}"
        directory.mkdir(parents=True, exist_ok=True)
        return ["--ssd-dir", str(directory), "--ssd-size", self.ssd]

    def wait(self) -> int:
        """Block until Ctrl-C, the master exits, or a segment fails; return a process exit code.

        A segment that exits with status 0 left on purpose (it was drained):
        it is reported and the rest of the cluster keeps serving.
        """
        watched = list(self.children)
        try:
            while True:
                for child in list(watched):
                    code = child.popen.poll()
                    if code is None:
                        continue
                    if code == 0 and child.name != "master":
                        print(f"kvtier: {child.name} left the cluster (drained)", file=sys.stderr, flush=True)
                        watched.remove(child)
                        continue
                    print(f"kvtier: {child.name} exited with status {code}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        except KeyboardInterrupt:
            return 0

    def stop(self) -> None:
        """SIGTERM the master first, then the segments.

        In that order the master's saved state still names the segments, so the next `kvtier up` on
        the same --state-dir and --ssd-dir waits for them and re-adopts their SSD copies. A segment
        stopped first would unmount: the master drops its objects, and a restarted master refuses
        copies of a segment it saw leave (docs/architecture.md, "Returning segments: fences").
        """
        for child in self.children:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
                try:
                    child.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.popen.kill()
                    child.popen.wait()
        self.children.clear()
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
