"""A chaos run: real master and segments, worker processes over TCP and shm, seeded faults, then the checker.

`run_chaos(ChaosConfig(...))` starts a master (with a state dir and `--history-log`), segment
servers with small DRAM regions (so evictions happen), and `workers` client processes
(tests/chaos/worker.py; even ones over tcp, odd ones over shm). While they run it injects faults
at random moments from a seeded RNG, one at a time, each logged to faults.jsonl with its start
and end (CLOCK_MONOTONIC):

    stop_client / stop_segment / stop_master   SIGSTOP, a random pause, SIGCONT (a segment's sometimes
                                               past its TTL; the master's always under the segment TTL)
    stop_master_long                           SIGSTOP of the master past the segment TTL
    stop_client_long                           SIGSTOP of a worker past the master's put timeout
    kill_client                                SIGKILL; a new incarnation of the worker (fresh keys)
    kill_segment                               SIGKILL; restarted under the same name
    kill_master                                SIGKILL; restarted at the same address and state dir

Everything stops by itself: the workers at their deadline (or the stop file), the harness after
it. The run directory holds the whole history (ops/, master-history.jsonl, faults.jsonl) and every
process's log; it is deleted after a clean run and kept after a violation, its path in the report.

Module entry point, the long run behind `make test-chaos`:
    python -m tests.chaos.harness [--seconds 600] [--workers 8] [--seed N] [--faults kill_master,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.checker import Report, check_run
from tests.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
ALL_FAULTS = (
    "stop_client",
    "stop_client_long",
    "kill_client",
    "stop_segment",
    "kill_segment",
    "stop_master",
    "stop_master_long",
    "kill_master",
)
# Faults that produce violations on today's code, left out of the short run in `make test` until
# fixed (docs/testing.md, "Findings"); KVTIER_CHAOS_FAULTS turns them on. None now.
KNOWN_FAILING: tuple[str, ...] = ()
SHORT_RUN_FAULTS = tuple(f for f in ALL_FAULTS if f not in KNOWN_FAILING)


def artifacts_root() -> Path:
    return Path(os.environ.get("KVTIER_ARTIFACTS") or REPO / ".kvtier" / "chaos")


def wait_for_workers(workers: dict[str, subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for every worker to end after the stop file; what went wrong (a worker killed at the
    deadline, or one that exited with an error), one line each."""
    problems = []
    for name, popen in workers.items():
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            problems.append(f"worker {name} still running after the deadline: killed")
            popen.kill()
            popen.wait()
        if popen.returncode not in (0, -signal.SIGKILL):
            problems.append(f"worker {name} exited with {popen.returncode} (see worker-{name}.log)")
    return problems


@dataclass
class ChaosConfig:
    seconds: float = 20.0  # how long the workers run
    workers: int = 4
    segments: int = 2
    dram: str = "12MiB"  # per segment: small, so that the workers' values overflow it and get evicted
    keys: int = 24  # per worker incarnation
    faults: tuple[str, ...] = ALL_FAULTS
    fault_gap_s: tuple[float, float] = (0.3, 1.5)  # quiet time between two faults
    seed: int = field(default_factory=lambda: random.randrange(1 << 30))
    segment_ttl_s: float = 2.0
    client_timeout_s: float = 3.0
    put_timeout_s: float = 3.0
    # Segment seg0 also gets an SSD tier (kept across its restarts): offload, disk reads, disk
    # copies reported again by a restarted segment.
    ssd: bool = False
    # seg0's tier worker sleeps this long before each batch of FORGETs (a stalled disk, the
    # `tier.forget` failpoint): past the master's wait for them, removes are answered with their
    # FORGETs owed (saved), and a master killed meanwhile must not bring those copies back.
    tier_stall_s: float = 0.0
    # The master keeps --state-dir across its restarts. Without one a restarted master cannot
    # recover (it does not know whom to expect): every kill_master loses everything, silently.
    master_state_dir: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(ALL_FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(ALL_FAULTS)}")


def faults_from_env(default: tuple[str, ...] = ALL_FAULTS) -> tuple[str, ...]:
    """KVTIER_CHAOS_FAULTS: a comma-separated subset of ALL_FAULTS ("none" for no faults)."""
    text = os.environ.get("KVTIER_CHAOS_FAULTS")
    if text is None:
        return default
    return tuple(f.strip() for f in text.split(",") if f.strip() and f.strip() != "none")


@dataclass
class RunResult:
    run_dir: Path
    report: Report
    problems: list[str]  # harness-level failures: a process that crashed by itself, a worker that never ended
    faults: int

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems

    def message(self) -> str:
        text = self.report.summary()
        if self.problems:
            text += "\nharness: " + "; ".join(self.problems)
        where = f"history and logs kept in {self.run_dir}" if self.run_dir.exists() else "run dir removed"
        return f"chaos run ({self.faults} faults): {text}\n{where}"


class Harness:
    def __init__(self, config: ChaosConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rng = random.Random(config.seed)
        (run_dir / "ops").mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(run_dir, segment_ttl_s=config.segment_ttl_s)
        self.master_args: tuple[str, ...] = (
            "--history-log", str(run_dir / "master-history.jsonl"),
            "--put-timeout-s", str(config.put_timeout_s),
        )  # fmt: skip
        if config.master_state_dir:
            self.master_args += ("--state-dir", str(run_dir / "master-state"))
        self.workers: dict[str, subprocess.Popen] = {}
        self.incarnations: dict[str, int] = {}
        self.fault_log = open(run_dir / "faults.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.problems: list[str] = []
        self.fault_count = 0
        self.deadline = 0.0

    # ------------------------------------------------------------ processes

    def start(self) -> None:
        self.cluster.start_master(*self.master_args)
        for i in range(self.config.segments):
            self.start_segment(f"seg{i}")
        self.deadline = time.monotonic() + self.config.seconds
        for i in range(self.config.workers):
            self.start_worker(f"w{i}", 0)

    def start_segment(self, name: str) -> None:
        extra: list[str] = []
        env: dict[str, str] = {}
        if self.config.ssd and name == "seg0":
            ssd = self.run_dir / f"ssd-{name}"
            extra = ["--ssd-dir", str(ssd), "--ssd-size", "48MiB", "--ssd-bucket-size", "8MiB"]
            if self.config.tier_stall_s:
                env = {"KVTIER_FAILPOINTS": f"tier.forget=stall:{self.config.tier_stall_s}"}
        self.cluster.start_segment(name, self.config.dram, *extra, env=env)

    def start_worker(self, name: str, incarnation: int) -> None:
        self.incarnations[name] = incarnation
        tmp = self.run_dir / "incarnations.json.tmp"
        tmp.write_text(json.dumps(self.incarnations))
        tmp.replace(self.run_dir / "incarnations.json")
        index = int(name[1:])
        args = [
            sys.executable, "-m", "tests.chaos.worker",
            "--master", self.cluster.master_address,
            "--id", name,
            "--incarnation", str(incarnation),
            "--out", str(self.run_dir / "ops" / f"{name}.{incarnation}.jsonl"),
            "--run-dir", str(self.run_dir),
            "--seed", str(self.config.seed),
            "--transport", "tcp" if index % 2 == 0 else "shm",
            "--seconds", str(max(self.deadline - time.monotonic(), 0.5)),
            "--workers", str(self.config.workers),
            "--keys", str(self.config.keys),
            "--replicas", str(min(2, self.config.segments)),
            "--timeout", str(self.config.client_timeout_s),
        ]  # fmt: skip
        # Under the cluster's supervisor: a run that fails half-way leaves no worker running.
        log = self.run_dir / f"worker-{name}.log"
        child = self.cluster.supervisor.start(f"worker-{name}", args, env={"PYTHONPATH": str(REPO)}, cwd=REPO, log=log)
        self.workers[name] = child.popen

    # ------------------------------------------------------------ faults

    def log_fault(self, kind: str, target: str, t0: float, t1: float, **extra) -> None:
        self.fault_count += 1
        self.fault_log.write(json.dumps({"kind": kind, "target": target, "t0": t0, "t1": t1, **extra}) + "\n")

    def pause(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def inject(self, kind: str) -> None:
        rng = self.rng
        if kind in ("stop_client", "stop_client_long", "kill_client"):
            name = rng.choice(sorted(self.workers))
            popen = self.workers[name]
            if popen.poll() is not None:
                return
            if kind == "stop_client":
                self._stop(popen, name, kind, self.pause(0.1, 2.0))
            elif kind == "stop_client_long":
                # Past the master's put timeout: a put it stopped in the middle of is reclaimed and its
                # ranges may go to other objects before its frames, resumed, arrive.
                timeout = self.config.put_timeout_s
                self._stop(popen, name, kind, self.pause(1.2 * timeout, 2.0 * timeout))
            else:
                t0 = time.monotonic()
                popen.kill()
                popen.wait()
                self.log_fault(kind, name, t0, time.monotonic(), incarnation=self.incarnations[name])
                if time.monotonic() < self.deadline - 1.0:
                    self.start_worker(name, self.incarnations[name] + 1)
        elif kind in ("stop_segment", "kill_segment"):
            name = rng.choice(sorted(self.cluster.segments))
            proc = self.cluster.segments[name]
            if kind == "stop_segment":
                # Sometimes past the segment TTL: the master then expels it and its objects are lost.
                ttl = self.config.segment_ttl_s
                self._stop(proc.popen, name, kind, self.pause(0.1, ttl * 1.6))
            else:
                t0 = time.monotonic()
                self.cluster.kill(proc)
                time.sleep(self.pause(0.0, 1.0))
                self.start_segment(name)
                self.log_fault(kind, name, t0, time.monotonic())
        elif kind in ("stop_master", "stop_master_long"):
            # Short: under the segment TTL. Long: past it, so the resumed master sees every segment
            # silent for longer than its TTL although none of them stopped heartbeating.
            assert self.cluster.master is not None
            ttl = self.config.segment_ttl_s
            # (Half the TTL at most for the short one: heartbeats delayed by a busy machine need the rest.)
            low, high = (0.1, 0.5 * ttl) if kind == "stop_master" else (1.1 * ttl, 1.6 * ttl)
            self._stop(self.cluster.master.popen, "master", kind, self.pause(low, high))
        elif kind == "kill_master":
            t0 = time.monotonic()
            self.cluster.restart_master(*self.master_args)
            self.log_fault(kind, "master", t0, time.monotonic())

    def _stop(self, popen: subprocess.Popen, name: str, kind: str, seconds: float) -> None:
        t0 = time.monotonic()
        popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            popen.send_signal(signal.SIGCONT)
            self.log_fault(kind, name, t0, time.monotonic())

    def run(self) -> None:
        self.start()
        low, high = self.config.fault_gap_s
        while time.monotonic() < self.deadline - 0.5:
            time.sleep(min(self.pause(low, high), max(self.deadline - time.monotonic(), 0)))
            if self.config.faults and time.monotonic() < self.deadline - 0.5:
                self.inject(self.rng.choice(self.config.faults))
            for name, popen in self.workers.items():
                if popen.poll() not in (None, 0, -signal.SIGKILL):
                    self.problems.append(f"worker {name} exited with {popen.returncode} (see worker-{name}.log)")
                    self.start_worker(name, self.incarnations[name] + 1)

    def finish(self) -> None:
        (self.run_dir / "stop").touch()
        for popen in self.workers.values():
            if popen.poll() is None:
                popen.send_signal(signal.SIGCONT)
        self.problems += wait_for_workers(self.workers, self.config.client_timeout_s * 4 + 10)
        for proc in [*self.cluster.segments.values(), *self.cluster.masters.values()]:
            if proc.alive:
                proc.popen.send_signal(signal.SIGCONT)
            elif proc.popen.returncode != -signal.SIGKILL:
                self.problems.append(f"{proc.name} exited with {proc.popen.returncode} (see {proc.log.name})")
        self.cluster.stop()
        self.fault_log.close()
        for leftover in self.cluster.leftover_region_files():  # regions of killed segments
            Path(leftover).unlink(missing_ok=True)


def run_chaos(config: ChaosConfig, keep: bool = False) -> RunResult:
    """Run, check, and keep the run directory only after a violation (or with `keep`)."""
    run_dir = artifacts_root() / f"{time.strftime('%Y%m%d-%H%M%S')}-seed{config.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.__dict__, default=list, indent=1))
    harness = Harness(config, run_dir)
    try:
        harness.run()
    finally:
        harness.finish()
    report = check_run(run_dir)
    result = RunResult(run_dir, report, harness.problems, harness.fault_count)
    (run_dir / "report.txt").write_text(result.message() + "\n")
    if result.ok and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="a long chaos run with the history checker")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--faults", default=",".join(faults_from_env()), help=f"subset of {','.join(ALL_FAULTS)}")
    parser.add_argument("--ssd", action="store_true", help="give seg0 an SSD tier")
    parser.add_argument("--dram", default=ChaosConfig.dram, help="DRAM per segment (less: more offload)")
    parser.add_argument("--tier-stall-s", type=float, default=0.0, help="with --ssd: seg0's FORGETs stall this long")
    parser.add_argument("--no-master-state-dir", action="store_true", help="run the master without --state-dir")
    parser.add_argument("--keep", action="store_true", help="keep the run directory after a clean run too")
    args = parser.parse_args(argv)
    config = ChaosConfig(
        seconds=args.seconds,
        workers=args.workers,
        segments=args.segments,
        faults=tuple(f for f in args.faults.split(",") if f and f != "none"),
        fault_gap_s=(0.2, 1.0),
        ssd=args.ssd,
        dram=args.dram,
        tier_stall_s=args.tier_stall_s,
        master_state_dir=not args.no_master_state_dir,
        **({"seed": args.seed} if args.seed is not None else {}),
    )
    print(f"chaos run: seed {config.seed}, {config.seconds:.0f}s, faults {','.join(config.faults) or 'none'}")
    result = run_chaos(config, keep=args.keep)
    print(result.message())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
