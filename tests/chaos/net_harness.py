"""A chaos run across test hosts (tests/hosts.py): network faults, the history checker, and resource samples.

Every process on a host of its own: a 3-member etcd (etcd0..2), two masters campaigning in it (m0,
m1), segment servers (s0..), and chaos workers (tests/chaos/worker.py, over TCP: each host has its
own machine id) on client hosts (c0..). The harness, in the root namespace, injects one network
fault at a time, each logged to faults.jsonl ({kind, target, t0, t1}, CLOCK_MONOTONIC like the
workers' and the masters' logs):

    partition_segment_master   a segment cut from the leading master only (clients still reach it)
    partition_segment_clients  a segment cut from every client host (the master still hears it)
    partition_leader_etcd      the leading master cut from all three etcd members: the standby
                               takes over; `failover_s` is the longest stretch without an
                               acknowledged put meanwhile, `new_leader` who leads after
    cut_etcd_one               one etcd member's link down (quorum holds)
    cut_etcd_two               two members down (quorum lost for a while)
    isolate_client             a client host's link down mid-transfer
    flap_segment               a segment's link down and up a few times

After each fault heals a probe client (root namespace) puts fresh keys until one is acknowledged:
`after_heal_s`, recorded in unavailability.jsonl. At the end, once quiet, the master's accounting of
every segment (objects, DRAM bytes) is compared with the segment's own index (no range leaks).
A sampler records RSS, open fds and threads of every process every `sample_s` seconds
(resources.csv) and plots them (resources.png, with matplotlib). The run directory is named in
every report; it is kept (KVTIER_ARTIFACTS, default .kvtier/chaos).

    python -m tests.chaos.net_harness [--seconds 120] [--fault-every 10] [--seed N]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.client import Client, KvtierError
from tests.chaos.checker import Checker, Report, read_jsonl
from tests.chaos.harness import REPO, artifacts_root, wait_for_workers
from tests.cluster import Cluster
from tests.hosts import EtcdCluster, Network

NET_FAULTS = (
    "partition_segment_master",
    "partition_segment_clients",
    "partition_leader_etcd",
    "cut_etcd_one",
    "cut_etcd_two",
    "isolate_client",
    "flap_segment",
)
INSECURE = ("--allow-insecure", "true")  # test-only namespaces, no secret


@dataclass
class NetChaosConfig:
    seconds: float = 60.0
    fault_every_s: float = 8.0  # one fault starts this long after the previous one healed
    faults: tuple[str, ...] = NET_FAULTS
    segments: int = 3
    workers: int = 2
    dram: str = "16MiB"
    keys: int = 24
    seed: int = field(default_factory=lambda: random.randrange(1 << 30))
    segment_ttl_s: float = 3.0
    etcd_lease_ttl_s: float = 2.0
    client_timeout_s: float = 3.0
    put_timeout_s: float = 3.0
    sample_s: float = 2.0


@dataclass
class NetRunResult:
    run_dir: Path
    report: Report
    problems: list[str]
    unavailability: list[dict]
    samples: list[dict]

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems

    def message(self) -> str:
        worst = max((u["after_heal_s"] for u in self.unavailability), default=0.0)
        return (
            f"net chaos run ({len(self.unavailability)} faults, worst after-heal {worst:.2f}s): "
            f"{self.report.summary()}\nharness: {'; '.join(self.problems) or 'ok'}\nartifacts: {self.run_dir}"
        )


class Sampler:
    """RSS, open fds and threads of named processes every `every_s` seconds, until stopped."""

    def __init__(self, path: Path, every_s: float, procs) -> None:
        self.path = path
        self.every_s = every_s
        self.procs = procs  # () -> {name: pid}
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self._t0
            for name, pid in sorted(self.procs().items()):
                row = sample_process(pid)
                if row is not None:
                    self.rows.append({"t": round(now, 2), "name": name, "pid": pid, **row})
            self._stop.wait(self.every_s)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, ["t", "name", "pid", "rss_mib", "fds", "threads"])
            writer.writeheader()
            writer.writerows(self.rows)
        return self.rows


def sample_process(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": fds, "threads": int(fields["Threads"])}


def plot_samples(rows: list[dict], path: Path) -> bool:
    """resources.png: one panel per measure, one line per process. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    names = sorted({r["name"] for r in rows})
    for ax, measure, label in zip(
        axes, ("rss_mib", "fds", "threads"), ("RSS (MiB)", "open fds", "threads"), strict=True
    ):
        for name in names:
            mine = [r for r in rows if r["name"] == name]
            ax.plot([r["t"] for r in mine], [r[measure] for r in mine], label=name, linewidth=1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, ncol=4, loc="upper left")
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle("kvtier net chaos: resources per process (flat lines = no leak)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def growth_problems(rows: list[dict], rss_mib: float = 64.0, fds: int = 64, threads: int = 16) -> list[str]:
    """Per process: the median of its last fifth of samples against that of its second fifth (the
    first is start-up), beyond the allowances = growth."""
    problems = []
    for name in sorted({r["name"] for r in rows}):
        mine = [r for r in rows if r["name"] == name]
        if len(mine) < 10 or len({r["pid"] for r in mine}) != 1:
            continue
        fifth = len(mine) // 5

        def median(part: list[dict], measure: str) -> float:
            values = sorted(r[measure] for r in part)
            return values[len(values) // 2]

        early, late = mine[fifth : 2 * fifth], mine[-fifth:]
        for measure, allowance in (("rss_mib", rss_mib), ("fds", fds), ("threads", threads)):
            grew = median(late, measure) - median(early, measure)
            if grew > allowance:
                problems.append(f"{name}: {measure} grew by {grew:g} (allowed {allowance:g})")
    return problems


class NetHarness:
    def __init__(self, config: NetChaosConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rng = random.Random(config.seed)
        (run_dir / "ops").mkdir(parents=True, exist_ok=True)
        self.segment_names = [f"s{i}" for i in range(config.segments)]
        self.client_names = [f"c{i}" for i in range(config.workers)]
        self.net = Network(["etcd0", "etcd1", "etcd2", "m0", "m1", *self.segment_names, *self.client_names])
        self.etcd: EtcdCluster | None = None
        self.cluster = Cluster(run_dir, segment_ttl_s=config.segment_ttl_s)
        self.workers: dict[str, subprocess.Popen] = {}
        self.fault_log = open(run_dir / "faults.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.unavailability: list[dict] = []
        self.problems: list[str] = []
        self.probe: Client | None = None
        self.sampler: Sampler | None = None
        self._probe_n = 0

    # ------------------------------------------------------------ processes

    def start(self) -> None:
        net, config = self.net, self.config
        self.etcd = EtcdCluster(self.run_dir, [net["etcd0"], net["etcd1"], net["etcd2"]])
        spec = f"etcd://{self.etcd.endpoints}/{self.cluster.cluster_id}"
        self.cluster.master_spec = spec
        for name in ("m0", "m1"):
            self.cluster.start_master(
                "--etcd", spec,
                "--listen", f"{net[name].address}:0",
                "--etcd-lease-ttl-s", str(config.etcd_lease_ttl_s),
                "--history-log", str(self.run_dir / f"master-history-{name}.jsonl"),
                "--put-timeout-s", str(config.put_timeout_s),
                *INSECURE,
                name=name,
                prefix=net[name].prefix(),
            )  # fmt: skip
        for name in self.segment_names:
            host = net[name]
            self.cluster.start_segment(
                name, config.dram, "--listen", f"{host.address}:0", "--metrics", f"{host.address}:0",
                *INSECURE, prefix=host.prefix(),
            )  # fmt: skip
        self.probe = self.cluster.client(transport="tcp", timeout=config.client_timeout_s)
        (self.run_dir / "incarnations.json").write_text(json.dumps({f"w{i}": 0 for i in range(len(self.client_names))}))
        for i, name in enumerate(self.client_names):
            self.start_worker(name, i)
        self.sampler = Sampler(self.run_dir / "resources.csv", config.sample_s, self.pids)

    def start_worker(self, name: str, index: int) -> None:
        args = [
            sys.executable, "-m", "tests.chaos.worker",
            "--master", self.cluster.master_spec,
            "--id", f"w{index}",
            "--out", str(self.run_dir / "ops" / f"w{index}.0.jsonl"),
            "--run-dir", str(self.run_dir),
            "--seed", str(self.config.seed),
            "--transport", "tcp",
            "--seconds", str(self.config.seconds),
            "--workers", str(self.config.workers),
            "--keys", str(self.config.keys),
            "--replicas", "1",
            "--timeout", str(self.config.client_timeout_s),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        with open(self.run_dir / f"worker-{name}.log", "ab") as log:
            self.workers[name] = subprocess.Popen(
                [*self.net[name].prefix(), *args],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def pids(self) -> dict[str, int]:
        out = {p.name: p.popen.pid for p in [*self.cluster.masters.values(), *self.cluster.segments.values()]}
        if self.etcd is not None:
            out |= {f"etcd-{h.name}": p.pid for h, p in zip(self.etcd.hosts, self.etcd.popens, strict=True)}
        out |= {f"worker-{n}": p.pid for n, p in self.workers.items() if p.poll() is None}
        return out

    # ------------------------------------------------------------ faults

    def leader_host(self) -> str:
        assert self.probe is not None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                leader = self.probe.cluster_status().leader
            except KvtierError:
                leader = ""
            for name in ("m0", "m1"):
                if leader.startswith(self.net[name].address + ":"):
                    return name
            time.sleep(0.2)
        raise RuntimeError("no leading master known after 15 s")

    def log_fault(self, kind: str, target: str, t0: float, t1: float, **extra) -> None:
        self.fault_log.write(json.dumps({"kind": kind, "target": target, "t0": t0, "t1": t1, **extra}) + "\n")

    def first_ok_put(self, limit_s: float = 60.0) -> float:
        """Seconds until a fresh key's put is acknowledged (inf past `limit_s`)."""
        assert self.probe is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            self._probe_n += 1
            try:
                self.probe.put(f"probe/{self._probe_n}", b"p" * 4096)
                return time.monotonic() - t0
            except KvtierError:
                time.sleep(0.05)
        return float("inf")

    def longest_gap(self, seconds: float) -> float:
        """Put fresh keys for `seconds`; the longest time without an acknowledged one (from the start)."""
        assert self.probe is not None
        start = last_ok = time.monotonic()
        gap = 0.0
        while time.monotonic() - start < seconds:
            self._probe_n += 1
            try:
                self.probe.put(f"probe/{self._probe_n}", b"p" * 4096)
                now = time.monotonic()
                gap, last_ok = max(gap, now - last_ok), now
            except KvtierError:
                time.sleep(0.05)
        return round(max(gap, time.monotonic() - last_ok), 3)

    def inject(self, kind: str) -> None:
        net, rng, ttl = self.net, self.rng, self.config.segment_ttl_s
        extra: dict = {}
        t0 = time.monotonic()
        if kind == "partition_segment_master":
            target = rng.choice(self.segment_names)
            leader = self.leader_host()
            net.partition(target, leader)
            time.sleep(rng.uniform(0.5, 2.0 * ttl))  # sometimes past the TTL: expelled, then re-adopted
            net.heal_partition(target, leader)
        elif kind == "partition_segment_clients":
            target = rng.choice(self.segment_names)
            for client in self.client_names:
                net.partition(target, client)
            time.sleep(rng.uniform(1.0, 2.0 * ttl))
            for client in self.client_names:
                net.heal_partition(target, client)
        elif kind == "partition_leader_etcd":
            target = self.leader_host()
            for member in ("etcd0", "etcd1", "etcd2"):
                net.partition(target, member)
            # The cut leader serves on for up to its lease, then stops; the standby takes over:
            # the longest stretch without an acknowledged put over three leases is the failover.
            extra["failover_s"] = self.longest_gap(3 * self.config.etcd_lease_ttl_s + 3.0)
            extra["new_leader"] = self.leader_host()
            for member in ("etcd0", "etcd1", "etcd2"):
                net.heal_partition(target, member)
        elif kind in ("cut_etcd_one", "cut_etcd_two"):
            members = rng.sample(["etcd0", "etcd1", "etcd2"], 1 if kind == "cut_etcd_one" else 2)
            target = ",".join(members)
            for member in members:
                net.cut(member)
            time.sleep(rng.uniform(1.0, 3.0))
            for member in members:
                net.restore(member)
        elif kind == "isolate_client":
            target = rng.choice(self.client_names)
            net.cut(target)
            time.sleep(rng.uniform(0.5, 3.0))
            net.restore(target)
        elif kind == "flap_segment":
            target = rng.choice(self.segment_names)
            net.flap(target, times=3, down_s=rng.uniform(0.2, 1.0), up_s=0.5)
        else:
            raise ValueError(f"unknown fault {kind}")
        t1 = time.monotonic()
        self.log_fault(kind, target, t0, t1, **extra)
        after = self.first_ok_put()
        self.unavailability.append({"fault": kind, "target": target, "after_heal_s": round(after, 3), **extra})
        with open(self.run_dir / "unavailability.jsonl", "a") as f:
            f.write(json.dumps(self.unavailability[-1]) + "\n")

    def run(self) -> None:
        self.start()
        deadline = time.monotonic() + self.config.seconds
        faults = list(self.config.faults)
        self.rng.shuffle(faults)  # then in turn: a run of len(faults) faults has every kind once
        n = 0
        while time.monotonic() < deadline - self.config.fault_every_s:
            time.sleep(self.config.fault_every_s)
            if faults:
                self.inject(faults[n % len(faults)])
                n += 1
        time.sleep(max(deadline - time.monotonic(), 0))

    # ------------------------------------------------------------ end

    def accounting_problems(self) -> list[str]:
        """Once quiet: the master's count and bytes per segment against the segment's own index."""
        from tests.integration.test_metrics import scrape, value

        assert self.probe is not None
        alignment = 64

        def compare() -> list[str]:
            out = []
            for info in self.probe.cluster_status().segments:
                proc = self.cluster.segments.get(info.name)
                if proc is None:
                    continue
                samples = scrape(proc.info["metrics"])
                objects = value(samples, "kvtier_segment_indexed_objects", segment=info.name)
                size = value(samples, "kvtier_segment_indexed_bytes", segment=info.name)
                if info.objects != objects or not size <= info.dram_used <= size + alignment * objects:
                    out.append(
                        f"{info.name}: master {info.objects} objects / {info.dram_used} B, "
                        f"segment index {objects:g} / {size:g} B"
                    )
            return out

        deadline = time.monotonic() + 20
        while (problems := compare()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return problems

    def finish(self) -> list[dict]:
        (self.run_dir / "stop").touch()
        self.net.heal()
        self.problems += wait_for_workers(self.workers, self.config.client_timeout_s * 4 + 15)
        samples = self.sampler.stop() if self.sampler is not None else []
        try:
            if self.probe is not None:
                self.problems += [f"accounting: {p}" for p in self.accounting_problems()]
        finally:
            for proc in [*self.cluster.segments.values(), *self.cluster.masters.values()]:
                if not proc.alive:
                    self.problems.append(f"{proc.name} exited with {proc.popen.returncode} (see {proc.log.name})")
            self.cluster.stop()
            if self.etcd is not None:
                self.etcd.stop()
            self.fault_log.close()
            self.net.close()
        return samples


def run_net_chaos(config: NetChaosConfig, label: str = "net") -> NetRunResult:
    run_dir = artifacts_root() / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-seed{config.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.__dict__, default=list, indent=1))
    harness = NetHarness(config, run_dir)
    samples: list[dict] = []
    try:
        harness.run()
    finally:
        samples = harness.finish()
    plot_samples(samples, run_dir / "resources.png")
    report = Checker(
        read_jsonl(sorted((run_dir / "ops").glob("*.jsonl"))),
        read_jsonl(sorted(run_dir.glob("master-history-*.jsonl"))),
        read_jsonl([run_dir / "faults.jsonl"]),
    ).check()
    result = NetRunResult(run_dir, report, harness.problems, harness.unavailability, samples)
    (run_dir / "report.txt").write_text(result.message() + "\n")
    # Kept: reports, plots, samples, logs; the history too after a violation. Never etcd's data
    # (its WAL files alone are 64 MiB a member).
    for path in run_dir.glob("etcd-*.data"):
        shutil.rmtree(path, ignore_errors=True)
    if result.ok:
        shutil.rmtree(run_dir / "ops", ignore_errors=True)
        for path in run_dir.glob("master-history-*.jsonl"):
            path.unlink()
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--fault-every", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--faults", default=",".join(NET_FAULTS), help="comma-separated fault kinds, in turn")
    args = parser.parse_args(argv)
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    config = NetChaosConfig(seconds=args.seconds, fault_every_s=args.fault_every, faults=faults)
    if args.seed is not None:
        config.seed = args.seed
    result = run_net_chaos(config)
    print(result.message())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
