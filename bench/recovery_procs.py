"""The processes and instruments of one `kvtier bench --recovery` / `--failover` run.

`Processes` starts and stops the run's etcd, masters and segments (through the shared supervisor,
kvtier.common.supervisor) and owns their temporary directory; `Probe` asks masters `Hello` over
channels that reconnect fast; `Watch` times waits that run in parallel from a kill on. The
benches themselves are in kvtier.bench.recovery_bench.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

from kvtier.common.supervisor import Child, Supervisor
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.errors import KvtierError

READY_TIMEOUT_S = 30.0
SERVE_DEADLINE_S = 60.0  # a wait for the cluster to serve again gives up after this long
# Poll with fast reconnects: a channel's default back-off after a refused connection is 1 s and growing.
PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The processes and clients of one bench run; logs, state and data dirs in one temporary directory.

    The children are the shared supervisor's (kvtier.common.supervisor). A context manager: on the
    way out (an exception included) it closes the clients, stops every child (segments first, then
    masters, then etcd; SIGKILL after 10 s), removes the cluster's region files from /dev/shm once
    none of its segments is alive, and deletes the directory; after a failure it prints the tail of
    every log first.
    """

    def __init__(self, prefix: str) -> None:
        self.cluster_id = f"{prefix}{uuid.uuid4().hex[:6]}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-recovery-"))
        self.supervisor = Supervisor(self.dir, grace_s=10.0)
        self._closers: list = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, Exception):  # not for Ctrl-C or SIGTERM
            print(
                f"kvtier bench: {exc_type.__name__} in {self.cluster_id}; process logs:\n{self.tails()}",
                file=sys.stderr,
            )
        self.close()

    @property
    def children(self) -> dict[str, Child]:
        return self.supervisor.children

    def client(self, master: str, timeout: float):
        from kvtier.client import Client

        client = Client(master, timeout=timeout)
        self.on_close(client.close)
        return client

    def on_close(self, closer) -> None:
        self._closers.append(closer)

    def spawn(self, name: str, args: list[str], retry_s: float = 0.0) -> Child:
        """Start `python <args>` with a ready file and wait until it is written (polled every 5 ms:
        the restart bench times it); tried again for up to `retry_s` seconds while it fails."""
        ready = self.dir / f"{name}.ready"
        argv = [sys.executable, *args, "--ready-file", str(ready)]
        wait = {"ready_file": ready, "timeout": READY_TIMEOUT_S, "poll_s": 0.005}
        return self.supervisor.start_retrying(name, argv, retry_s=retry_s, gap_s=0.05, **wait)

    def respawn(self, name: str, args: list[str]) -> Child:
        """spawn() again for up to 10 s: a killed process's port may linger for a moment."""
        return self.spawn(name, args, retry_s=10.0)

    def start_etcd(self, binary: str) -> str:
        """A single-member etcd on free loopback ports (default raft timings); its client endpoint."""
        from kvtier.common.etcd_client import EtcdClient, EtcdError

        port, peer_port = _free_port(), _free_port()
        client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
        args = [
            binary,
            "--name", "etcd",
            "--data-dir", str(self.dir / "etcd.data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"etcd={peer_url}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        endpoint = f"127.0.0.1:{port}"
        probe = EtcdClient(endpoint, timeout=0.5)

        def answers() -> bool:  # a linearizable read answers only once etcd has a raft leader
            try:
                probe.get("/kvtier-bench-ready-probe")
                return True
            except EtcdError:
                return False

        try:
            self.supervisor.start("etcd", args, probe=answers, timeout=READY_TIMEOUT_S, poll_s=0.05)
        finally:
            probe.close()
        return endpoint

    def kill(self, name: str) -> float:
        """SIGKILL the child and reap it; the monotonic time the signal was sent."""
        killed_at = time.monotonic()
        self.children[name].kill()
        return killed_at

    def log_findings(self, limit: int = 12) -> dict[str, object]:
        """Warnings counted per log; error lines and tracebacks quoted (first `limit`, time stamps cut)."""
        warnings: dict[str, int] = {}
        errors: list[str] = []
        for log in sorted({c.log for c in self.children.values() if c.log is not None}):
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            count = sum(1 for line in lines if "level=WARNING" in line or '"level":"warn"' in line)
            if count:
                warnings[log.stem] = count
            for line in lines:
                if any(m in line for m in ("level=ERROR", "level=CRITICAL", "Traceback", '"level":"error"')):
                    text = f"{log.stem}: {line.split(' level=', 1)[-1][:200]}"
                    if text not in errors and len(errors) < limit:
                        errors.append(text)
        return {"warnings": warnings, "errors": errors}

    def tails(self) -> str:
        return self.supervisor.report(lines=30)

    def close(self) -> None:
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):  # the processes must be stopped whatever happens
                closer()
        self._closers.clear()

        def group(child: Child) -> int:  # segments unmount while their master lives; etcd goes last
            return 0 if child.name.startswith("seg") else 2 if child.name == "etcd" else 1

        for rank in (0, 1, 2):
            self.supervisor.stop(*(c for c in self.children.values() if group(c) == rank))
        self.supervisor.close()  # earlier incarnations of a restarted child, if any still runs
        for path in Path("/dev/shm").glob(f"kvtier.{self.cluster_id}.*"):
            path.unlink(missing_ok=True)  # every process of this cluster is gone: these are orphans
        shutil.rmtree(self.dir, ignore_errors=True)


class Probe:
    """`Hello` on masters over channels of its own that reconnect fast (after a refused connection a
    default channel waits 1 s, then longer, before it tries again)."""

    def __init__(self) -> None:
        self.channels: dict[str, grpc.Channel] = {}

    def hello(self, address: str) -> pb.HelloResponse | None:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address, options=PROBE_OPTIONS)
        try:
            return master_pb2_grpc.MasterStub(self.channels[address]).Hello(pb.HelloRequest(), timeout=0.5)
        except grpc.RpcError:
            return None

    def wait_leader(self, addresses: dict[str, str], timeout: float = READY_TIMEOUT_S) -> str:
        """The name of the one master that says it leads and serves (waits for one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            roles = {name: self.hello(address) for name, address in addresses.items()}
            leaders = [name for name, hello in roles.items() if hello is not None and hello.role == "leader"]
            if len(leaders) == 1:
                return leaders[0]
            time.sleep(0.02)
        raise RuntimeError(f"no single leader among {sorted(addresses)} after {timeout:.0f}s")

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


class Watch:
    """Waits that run in parallel threads from the kill on; each records when it first saw what it
    waits for, in seconds from the kill (NaN when it never did within `deadline_s`, by default
    SERVE_DEADLINE_S)."""

    def __init__(self, deadline_s: float = SERVE_DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self.killed_at = 0.0
        self.first: dict[str, float] = {}
        self.errors: list[str] = []
        self.wrong = 0  # values read with other bytes than were put (must stay 0)
        self._go = threading.Event()
        self._threads: list[threading.Thread] = []

    def poll(self, what: str, predicate) -> None:
        """From the kill, call predicate() every 10 ms until it is true (KvtierError counts as false)."""

        def run() -> None:
            self._go.wait()
            try:
                while time.monotonic() - self.killed_at < self.deadline_s:
                    try:
                        if predicate():
                            self.mark(what)
                            return
                    except KvtierError:  # the master did not serve within the client's timeout
                        pass
                    time.sleep(0.01)
            except Exception as exc:  # reported with the result, not lost in a thread
                self.errors.append(f"{what}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self, killed_at: float) -> None:
        self.killed_at = killed_at
        self._go.set()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(self.deadline_s + 15)

    def mark(self, what: str) -> None:
        self.first.setdefault(what, time.monotonic() - self.killed_at)

    def get(self, what: str) -> float:
        return self.first.get(what, float("nan"))
