"""Real kvtier processes for integration and e2e tests.

`Cluster` starts a master and segment servers as subprocesses on free
loopback ports, waits for their ready files (each process writes one once it
serves; a segment only after the master accepted its mount), and keeps their
logs so a failing test can show their tails. Each cluster has a unique
cluster id, so its region files in /dev/shm never collide with another
test's, and `stop()` checks that nothing of it is left behind.
"""

from __future__ import annotations

import secrets
import signal
import sys
import time
import uuid
from pathlib import Path

from kvtier.client import Client
from kvtier.common.supervisor import Child, Supervisor

READY_TIMEOUT_S = 20.0

# A started process: name, popen (tests signal it directly), log, ready_file, info (the ready
# file's JSON), tail(), alive. The shared supervisor's (kvtier.common.supervisor) child.
Proc = Child


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
        self.supervisor = Supervisor(workdir)

    # ------------------------------------------------------------ processes

    def _spawn(
        self, name: str, args: list[str], prefix: list[str] | None = None, env: dict[str, str] | None = None
    ) -> Proc:
        """Start `python <args>` (after `prefix`, with `env` added to ours) with its log in the workdir;
        wait for its ready file."""
        ready = self.workdir / f"{name}.ready"
        return self.supervisor.start(
            name,
            [*(prefix or []), sys.executable, *args, "--ready-file", str(ready)],
            env=env,
            ready_file=ready,
            timeout=READY_TIMEOUT_S,
        )

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

    def start_segment(
        self,
        name: str = "",
        dram: str = "64MiB",
        *extra: str,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """`prefix`: a command that runs the segment elsewhere (e.g. in a network namespace, tests/netns.py);
        `env`: added to its environment (e.g. KVTIER_FAILPOINTS, kvtier.segment_server.failpoints)."""
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
            env,
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
        """Send `sig` and wait (10 s at most) for the process to exit."""
        proc.kill(sig, timeout=10)

    def freeze(self, proc: Proc) -> None:
        """SIGSTOP `proc` and wait (5 s at most) until every thread of it is stopped: on a loaded
        machine the signal takes effect only once each thread is scheduled again, and a call made
        meanwhile could still be answered by the process meant to be frozen."""
        proc.popen.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{proc.popen.pid}/task")

        def stopped() -> bool:
            try:
                states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                return True  # gone: nothing of it runs
            return all(state in ("T", "t") for state in states)

        assert self.wait_for(stopped, timeout=5.0, interval=0.005), f"{proc} did not stop"

    def region_file(self, segment: str) -> Path:
        return Path(self.segments[segment].info["region"])

    # ------------------------------------------------------------ clients

    def use_secret(self, path: Path) -> None:
        """Write a fresh cluster secret to `path` (only its owner may read it): every process and client
        started from here on uses it."""
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        self.secret_file = str(path)

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
        return self.supervisor.report(children=self._master_procs() + list(self.segments.values()))

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        # All at once (SIGTERM, SIGKILL after 10 s), then whatever else was started (earlier
        # incarnations of a restarted process): nothing outlives the test.
        self.supervisor.stop(*self.segments.values(), *self._master_procs(), grace_s=10.0)
        self.supervisor.close()

    def _master_procs(self) -> list[Proc]:
        procs = list(self.masters.values())
        if self.master is not None and self.master not in procs:
            procs.append(self.master)
        return procs

    def leftover_region_files(self) -> list[str]:
        return sorted(str(p) for p in Path("/dev/shm").glob(f"kvtier.{self.cluster_id}.*"))
