"""Test hosts: N network namespaces on one bridge, each a "machine" of its own, and the faults between them.

`Network(workdir, hosts=4)` takes a /27 of 198.51.100.0/24 (TEST-NET-2, routed nowhere), creates a
bridge in the root namespace holding the block's first address (the test process's own "host": the
fault proxy and the test's in-process clients live there) and one namespace per host, each joined to
the bridge by its own veth pair and holding the next address. Nothing is sent to any other address.

Each host also gets its own /etc/machine-id (`ip netns exec` bind-mounts /etc/netns/<ns>/machine-id
over /etc/machine-id), so kvtier's host identity (machine id + boot id, proto/region.py) differs per
host: a client on one host never takes the shm path to a segment on another, only TCP.

Faults, all undone by `heal()` / `close()`:

    partition(a, b)   a and b stop hearing each other, everyone else still hears both: each side
                      gets a permanent neighbour entry for the other's address with a MAC that nobody
                      has, so frames vanish on the bridge (no RST, connect() hangs). Works without
                      nftables/iptables or tc actions, which this kernel does not have.
    cut(a)            the host's veth down on the bridge side: the whole host is gone (link down).
    flap(a, ...)      cut and restore, repeatedly.
    rate_limit(a, ..) `tc tbf` on the host's egress: a bandwidth cap.

Delay, jitter and loss come from tests/faultproxy.py (this kernel has no netem).

Blocks are taken under a lock file in /run/kvtier-test-hosts held for the network's life (pytest-
xdist workers get distinct blocks). The lock dies with a killed run, so the next network that takes
the block first deletes whatever a killed run left under the block's names (processes in its
namespaces, the namespaces, the bridge, /etc/netns entries). Blocks 4..7 (.128 and up) are used:
tests/netns.py's single namespaces take /30s from the bottom of the range.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.netns import require_netns

_NET = "198.51.100."
_BLOCKS = range(4, 8)  # /27s: .128, .160, .192, .224
_BLOCK_SIZE = 32
_LOCK_DIR = Path("/run/kvtier-test-hosts")
_NOBODY_MAC = "02:00:00:00:de:ad"  # locally administered, never assigned: frames to it are dropped


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass
class Host:
    """One namespace: `address` on the bridge, `prefix()` to run a program there."""

    name: str  # short: "h0", "etcd1"
    ns: str  # the namespace's name
    address: str
    veth: str  # the bridge-side end, in the root namespace
    ns_if: str = "eth0"  # the host's own end, inside the namespace

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(), *args], capture_output=True, text=True, timeout=10, check=check)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip("netns", "exec", self.ns, "ip", *args, check=check)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]


class Network:
    """A bridge, its hosts and the faults between them. Use as a context manager (or call close())."""

    def __init__(self, hosts: int | list[str] = 3, block: int | None = None) -> None:
        """`block`: take that address block (waiting for it) instead of the first free one."""
        require_netns()
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not 0 < len(names) <= _BLOCK_SIZE - 3:
            raise ValueError(f"1..{_BLOCK_SIZE - 3} hosts per network")
        self._lock_file = None
        self.block = self._take_block(block)
        self.tag = f"kvh{self.block}"
        base = self.block * _BLOCK_SIZE
        self.root_address = f"{_NET}{base + 1}"  # the bridge: the test process's host
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self._partitions: set[tuple[str, str]] = set()
        self._limited: set[str] = set()
        try:
            _cleanup_block(self.tag)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root_address}/27", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self._add_host(name, i, f"{_NET}{base + 2 + i}")
        except BaseException:
            self.close()
            raise

    def _take_block(self, wanted: int | None) -> int:
        _LOCK_DIR.mkdir(parents=True, exist_ok=True)
        if wanted is not None:
            if wanted not in _BLOCKS:
                raise ValueError(f"block must be in {_BLOCKS.start}..{_BLOCKS.stop - 1}")
            f = open(_LOCK_DIR / f"block{wanted}.lock", "w")  # noqa: SIM115 (held for the network's life)
            fcntl.flock(f, fcntl.LOCK_EX)  # another test's network: wait for its end
            self._lock_file = f
            return wanted
        for block in _BLOCKS:
            f = open(_LOCK_DIR / f"block{block}.lock", "w")  # noqa: SIM115 (held for the network's life)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self._lock_file = f
            return block
        raise RuntimeError(f"every test network block is in use ({len(_BLOCKS)} at most at once)")

    def _add_host(self, name: str, index: int, address: str) -> None:
        ns = f"{self.tag}-{name}"
        host = Host(name, ns, address, veth=f"{self.tag}v{index}")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "machine-id").write_text(os.urandom(16).hex() + "\n")  # a machine of its own
        _ip("netns", "add", ns)
        self.hosts[name] = host
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", f"{self.tag}p{index}")
        _ip("link", "set", f"{self.tag}p{index}", "netns", ns)
        host.ip("link", "set", f"{self.tag}p{index}", "name", host.ns_if)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        host.ip("addr", "add", f"{address}/27", "dev", host.ns_if)
        host.ip("link", "set", host.ns_if, "up")
        host.ip("link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ------------------------------------------------------------ faults

    def _address(self, who: str) -> str:
        return self.root_address if who == "root" else self.hosts[who].address

    def _neigh(self, who: str, other: str, cut: bool) -> None:
        args = ["neigh", "replace" if cut else "del", self._address(other)]
        if cut:
            args += ["lladdr", _NOBODY_MAC, "nud", "permanent"]
        if who == "root":
            _ip(*args, "dev", self.bridge, check=cut)
        else:
            host = self.hosts[who]
            host.ip(*args, "dev", host.ns_if, check=cut)

    def partition(self, a: str, b: str) -> None:
        """`a` and `b` (host names, or "root": the test process) no longer reach each other; packets
        in flight between them vanish, connects hang. Both still reach everyone else."""
        self._neigh(a, b, cut=True)
        self._neigh(b, a, cut=True)
        self._partitions.add((a, b))

    def heal_partition(self, a: str, b: str) -> None:
        self._neigh(a, b, cut=False)  # the next packet resolves the address again (ARP)
        self._neigh(b, a, cut=False)
        self._partitions.discard((a, b))

    def isolate(self, a: str, *others: str) -> None:
        """Partition `a` from every other host (or from `others`), the root included unless named."""
        for b in others or ["root", *(h for h in self.hosts if h != a)]:
            self.partition(a, b)

    def cut(self, name: str) -> None:
        """The host's link down (bridge side): everything it sends or is sent is lost."""
        _ip("link", "set", self.hosts[name].veth, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth, "up")

    def flap(self, name: str, times: int = 3, down_s: float = 0.5, up_s: float = 0.5) -> None:
        for _ in range(times):
            self.cut(name)
            time.sleep(down_s)
            self.restore(name)
            time.sleep(up_s)

    def rate_limit(self, name: str, rate: str = "10mbit", burst: str = "64kb", latency: str = "50ms") -> None:
        """A bandwidth cap on what `name` sends (tc tbf on its own end of the link)."""
        host = self.hosts[name]
        subprocess.run(
            [*host.prefix(), "tc", "qdisc", "replace", "dev", host.ns_if, "root", "tbf",
             "rate", rate, "burst", burst, "latency", latency],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip
        self._limited.add(name)

    def heal(self) -> None:
        """Undo every fault: partitions, cut links, rate limits."""
        for a, b in list(self._partitions):
            self.heal_partition(a, b)
        for name, host in self.hosts.items():
            _ip("link", "set", host.veth, "up", check=False)
            if name in self._limited:
                host.run("tc", "qdisc", "del", "dev", host.ns_if, "root", check=False)
        self._limited.clear()

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill what still runs on the hosts, delete namespaces, veths and the bridge. Idempotent."""
        if self._lock_file is None:
            return
        _cleanup_block(self.tag)
        self.hosts.clear()
        self._lock_file.close()  # releases the block
        self._lock_file = None

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cleanup_block(tag: str) -> None:
    """Delete everything under a block's names: this network's at close, a killed run's before reuse."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    namespaces = [line.split()[0] for line in listed if line.startswith(f"{tag}-")]
    for ns in namespaces:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)  # its veth ends go with it
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    for path in Path("/etc/netns").glob(f"{tag}-*") if Path("/etc/netns").is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
    _ip("link", "del", f"{tag}br", check=False)
    # A namespace dies when its last process has gone, after `netns del` returns (the SIGKILLed ones
    # may still be exiting), and its veth pairs with it: delete the root-side ends ourselves and
    # wait until none of the block's links is left, or the next `link add` finds the name taken.
    deadline = time.monotonic() + 10
    while links := [n for n in _link_names() if n.startswith(tag)]:
        for name in links:
            _ip("link", "del", name, check=False)
        if time.monotonic() > deadline:
            raise RuntimeError(f"links of a test network would not go away: {links}")
        time.sleep(0.05)


def _link_names() -> list[str]:
    """Interface names in the root namespace ("veth0@if12" is listed as "veth0")."""
    listed = _ip("-o", "link", "show", check=False).stdout.splitlines()
    return [line.split(":")[1].strip().split("@")[0] for line in listed if line.count(":") >= 2]


class EtcdCluster:
    """A 3-member (or n) etcd cluster, one member per host, on the hosts' own addresses (2379/2380).

    Same short raft timings as tests/etcd.py (heartbeat 50 ms, election 500 ms). `endpoints` is the
    comma list for `--etcd etcd://.../CLUSTER`; `cut(i)` / `restore(i)` are the network's faults.
    """

    CLIENT_PORT, PEER_PORT = 2379, 2380

    def __init__(self, workdir: Path, hosts: list[Host]) -> None:
        from tests.etcd import ETCD_BINARY

        self.hosts = hosts
        self.popens: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        initial = ",".join(f"{h.name}=http://{h.address}:{self.PEER_PORT}" for h in hosts)
        try:
            for host in hosts:
                client_url = f"http://{host.address}:{self.CLIENT_PORT}"
                peer_url = f"http://{host.address}:{self.PEER_PORT}"
                log = workdir / f"etcd-{host.name}.log"
                args = [
                    ETCD_BINARY,
                    "--name", host.name,
                    "--data-dir", str(workdir / f"etcd-{host.name}.data"),
                    "--listen-client-urls", client_url,
                    "--advertise-client-urls", client_url,
                    "--listen-peer-urls", peer_url,
                    "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", initial,
                    "--initial-cluster-token", f"kvtier-{hosts[0].ns}",  # one cluster: one token
                    "--initial-cluster-state", "new",
                    "--heartbeat-interval", "50",
                    "--election-timeout", "500",
                    "--logger", "zap",
                    "--log-outputs", "stderr",
                ]  # fmt: skip
                with open(log, "ab") as out:
                    self.popens.append(
                        subprocess.Popen(
                            [*host.prefix(), *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
                self.logs.append(log)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> str:
        return ",".join(f"{h.address}:{self.CLIENT_PORT}" for h in self.hosts)

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import grpc

        from kvtier.proto.etcd import rpc_pb2, rpc_pb2_grpc

        deadline = time.monotonic() + timeout
        for host, popen, log in zip(self.hosts, self.popens, self.logs, strict=True):
            with grpc.insecure_channel(f"{host.address}:{self.CLIENT_PORT}") as channel:
                kv = rpc_pb2_grpc.KVStub(channel)
                while True:
                    if popen.poll() is not None:
                        raise RuntimeError(f"etcd on {host.name} exited:\n{log.read_text()[-3000:]}")
                    try:
                        kv.Range(rpc_pb2.RangeRequest(key=b"/ready-probe"), timeout=0.5)
                        break
                    except grpc.RpcError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"etcd on {host.name} not ready:\n{log.read_text()[-3000:]}") from None
                        time.sleep(0.1)

    def stop(self) -> None:
        for popen in self.popens:
            if popen.poll() is None:
                popen.terminate()
        for popen in self.popens:
            try:
                popen.wait(5)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
