"""Real kvtier processes for integration and e2e tests.

`Cluster` starts a master and segment servers as subprocesses on free
loopback ports, waits for their ready files (each process writes one once it
serves; a segment only after the master accepted its mount), and keeps their
logs so a failing test can show their tails. Each cluster has a unique
cluster id, so its region files in /dev/shm never collide with another
test's, and `stop()` checks that nothing of it is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.client import Client

READY_TIMEOUT_S = 20.0


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    ready_file: Path
    info: dict = field(default_factory=dict)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class Cluster:
    def __init__(self, workdir: Path, *, segment_ttl_s: float = 2.0, heartbeat_interval_s: float = 0.2) -> None:
        self.workdir = workdir
        self.cluster_id = f"t{uuid.uuid4().hex[:10]}"
        self.segment_ttl_s = segment_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.master: Proc | None = None
        self.masters: dict[str, Proc] = {}  # HA: every master started with start_master(name=...)
        self.master_spec = ""  # what segments and clients are given as --master; default the master's address
        self.secret_file = ""  # set: every process started from here on, and every client, uses it
        self.segments: dict[str, Proc] = {}
        self._clients: list[Client] = []

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, args: list[str], prefix: list[str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [*(prefix or []), sys.executable, *args, "--ready-file", str(ready)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        proc = Proc(name, popen, log, ready)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {popen.returncode} before ready:\n{proc.tail()}")
            if time.monotonic() > deadline:
                popen.kill()
                raise RuntimeError(f"{name} not ready after {READY_TIMEOUT_S}s:\n{proc.tail()}")
            time.sleep(0.02)
        proc.info = json.loads(ready.read_text())
        return proc

    def state_dir(self, name: str = "master") -> Path:
        """The per-test state directory master `name` is given (kept across restart_master)."""
        return self.workdir / f"{name}-state"

    def start_master(
        self, *extra: str, name: str = "master", default_state_dir: bool = False, prefix: list[str] | None = None
    ) -> Proc:
        """`prefix`: a command that runs the master elsewhere (e.g. on a test host, tests/hosts.py)."""
        # Never the default state directory (/var/lib/kvtier or the home directory): a per-test one,
        # unless the test chooses (--state-dir DIR or none, or default_state_dir for the test of the
        # default itself) or the state lives in etcd.
        chosen = default_state_dir or {"--etcd", "--state-dir"} & set(extra)
        state = [] if chosen else ["--state-dir", str(self.state_dir(name))]
        proc = self._spawn(
            name,
            [
                "-m", "kvtier.master",
                "--listen", "127.0.0.1:0",
                "--cluster-id", self.cluster_id,
                "--segment-ttl-s", str(self.segment_ttl_s),
                "--heartbeat-interval-s", str(self.heartbeat_interval_s),
                *self._secret_args(),
                *state,
                *extra,
            ],
            prefix,
        )  # fmt: skip
        self.masters[name] = proc
        if name == "master" or self.master is None:
            self.master = proc
        return proc

    def start_ha_masters(self, etcd_endpoint: str, count: int = 3, *extra: str) -> list[Proc]:
        """`count` masters campaigning in etcd; segments and clients then find the leader through etcd."""
        self.master_spec = f"etcd://{etcd_endpoint}/{self.cluster_id}"
        return [self.start_master("--etcd", self.master_spec, *extra, name=f"master{i}") for i in range(count)]

    @property
    def master_address(self) -> str:
        if self.master_spec:
            return self.master_spec
        assert self.master is not None, "start_master() first"
        return self.master.info["address"]

    def start_segment(self, name: str = "", dram: str = "64MiB", *extra: str, prefix: list[str] | None = None) -> Proc:
        """`prefix`: a command that runs the segment elsewhere (e.g. in a network namespace, tests/netns.py)."""
        name = name or f"seg{len(self.segments)}"
        proc = self._spawn(
            f"segment-{name}",
            [
                "-m", "kvtier.segment_server",
                "--master", self.master_address,
                "--listen", "127.0.0.1:0",
                "--cluster-id", self.cluster_id,
                "--name", name,
                "--dram", dram,
                *self._secret_args(),
                *extra,
            ],
            prefix,
        )  # fmt: skip
        self.segments[name] = proc
        return proc

    def restart_master(self, *extra: str, sig: int = signal.SIGKILL, default_state_dir: bool = False) -> Proc:
        """Kill the master (SIGKILL by default) and start a new one at the same gRPC address."""
        assert self.master is not None, "start_master() first"
        address = self.master.info["address"]
        self.kill(self.master, sig)
        deadline = time.monotonic() + 10
        while True:
            try:
                return self.start_master("--listen", address, *extra, default_state_dir=default_state_dir)
            except RuntimeError:  # the port may linger for a moment after a kill
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        proc.popen.send_signal(sig)
        proc.popen.wait(timeout=10)

    def region_file(self, segment: str) -> Path:
        return Path(self.segments[segment].info["region"])

    # ------------------------------------------------------------ clients

    def _secret_args(self) -> list[str]:
        return ["--secret-file", self.secret_file] if self.secret_file else []

    def client(self, **kwargs) -> Client:
        kwargs.setdefault("timeout", 5.0)
        if self.secret_file and "secret" not in kwargs:
            kwargs.setdefault("secret_file", self.secret_file)
        client = Client(self.master_address, **kwargs)
        self._clients.append(client)
        return client

    def wait_for(self, predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return predicate()

    # ------------------------------------------------------------ teardown

    def logs(self) -> str:
        procs = self._master_procs() + list(self.segments.values())
        return "\n".join(f"----- {p.name} (rc={p.popen.poll()}) -----\n{p.tail()}" for p in procs)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        procs = list(self.segments.values()) + self._master_procs()
        for proc in procs:
            if proc.alive:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def _master_procs(self) -> list[Proc]:
        procs = list(self.masters.values())
        if self.master is not None and self.master not in procs:
            procs.append(self.master)
        return procs

    def leftover_region_files(self) -> list[str]:
        return sorted(str(p) for p in Path("/dev/shm").glob(f"kvtier.{self.cluster_id}.*"))
