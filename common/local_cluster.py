"""Start a master and segment servers as local child processes (for `kvtier up` and `kvtier bench`).

The servers run as separate processes (`python -m kvtier.master`, `python -m
kvtier.segment_server`), never imported: the client stays thin, and the
benchmark's client is in a different process from the segment server, as in
production. Readiness comes from each server's `--ready-file`; the children are
started, watched and stopped by the shared supervisor (kvtier.common.supervisor).

It lives in the shared runtime, not in kvtier.cli: `kvtier up` (kvtier.cli) and the benchmarks
(kvtier.bench, which kvtier.cli imports) both start clusters with it, and the command package is
imported by nothing (the import contracts in pyproject.toml, run by `make lint`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from kvtier.common.startup import STARTUP_EXIT  # a server's start-up failure: it printed one line saying why
from kvtier.common.supervisor import Child, ChildExited, ChildNotReady, Supervisor

READY_TIMEOUT_S = 30.0


class StartupFailed(RuntimeError):
    """A server exited with status 2 during start-up, after printing its one-line reason to stderr."""

    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name} exited with status {returncode} during start-up")
        self.returncode = returncode


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
        self.children: list[Child] = []  # in start order: the master first
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-")
        self._supervisor = Supervisor(Path(self._tmp.name))
        self.master_address = ""

    def _spawn(self, name: str, args: list[str]) -> Child:
        """Start `python <args>`, its output on our terminal (or nowhere when quiet); wait for its ready file."""
        ready = Path(self._tmp.name) / f"{name}.ready"
        argv = [sys.executable, *args, "--ready-file", str(ready), "--log-level", self.log_level]
        try:
            child = self._supervisor.start(
                name, argv, log=None, quiet=self.quiet, ready_file=ready, timeout=READY_TIMEOUT_S
            )
        except ChildExited as exc:
            if exc.returncode == STARTUP_EXIT:
                raise StartupFailed(name, exc.returncode) from None
            raise RuntimeError(f"{name} exited with status {exc.returncode} during start-up") from None
        except ChildNotReady:
            raise RuntimeError(f"{name} did not become ready within {READY_TIMEOUT_S:.0f}s") from None
        self.children.append(child)
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
        """SIGTERM the master first, then the segments, one at a time; SIGKILL after 10 s.

        In that order the master's saved state still names the segments, so the next `kvtier up` on
        the same --state-dir and --ssd-dir waits for them and re-adopts their SSD copies. A segment
        stopped first would unmount: the master drops its objects, and a restarted master refuses
        copies of a segment it saw leave (docs/architecture.md, "Returning segments: fences").
        """
        for child in self.children:
            child.stop(grace_s=10.0)
        self.children.clear()
        self._supervisor.close()  # one that failed its start, if it still runs
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
