"""`kvtier bench --recovery` / `--failover`: how long the cluster is away when its master dies.

Real processes on loopback, started here and stopped at the end whatever
happens (their logs, the master's state dir and etcd's data dir live in one
temporary directory, removed at the end; segments' region files in /dev/shm
too). `--recovery-objects` objects (default 100,000) of 1-16 KiB are put first
with `batch_put`, 1,000 keys per call; each value is a slice of one random
pool chosen by the key's number, so any read can be checked.

`--recovery`: a standalone master with a `--state-dir` and two segment
servers. `--repeat` times: SIGKILL the master, start it again at the same
address, and measure from the kill
- until the new process listens (its ready file);
- until `Hello` says role "leader" (recovery finished; polled every 10 ms on
  a channel of our own that reconnects fast);
- until a client made before the kill (as an engine's would be) gets the
  right bytes for 1,000 random keys with one `batch_get`;
- until another such client's `Exists` over all keys, 10,000 per call, finds
  every one of them;
and read the master's own recovery figures (`cluster_status().recovery`).
The three waits run in parallel threads from the moment of the kill. After
the last restart every object is read back in full and compared.

`--failover`: a single-member etcd, three masters electing a leader through
it (default lease TTL, 5 s) and two segments, all given `etcd://...`; the same
objects are put first. `--repeat` times: a writer thread puts 16 keys per
call without pause; after 2 s the leader is SIGKILLed; measured from the
kill: a standby reporting it won the election, the new leader serving
(role "leader"), and the writer's first successful put (a batch that started
after the kill, or one that was in flight and ended more than 100 ms after it:
a reply already on its way from the old leader cannot take that long). The
writer goes on 1 s more; then every key it was told was stored and 1,000
sampled objects of the fill are read back and compared, and Exists must find
every object of the fill. The killed master is started again as a standby
before the next run; after the last run every object of the fill is read back.

A read that misses is retried RETRIES times, 0.5 s apart, before its key
counts as lost (one that then reads right counts as a flaky read): a client
can miss a read while the object is safe, e.g. when a connection fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

from kvtier.bench.recovery_procs import SERVE_DEADLINE_S, Probe, Processes, Watch
from kvtier.common.units import format_size, parse_size

PUT_BATCH = 1000
SAMPLE = 1000
EXISTS_BATCH = 10_000
WRITER_BATCH = 16
MIN_SIZE, MAX_SIZE = 1 << 10, 16 << 10
POOL_SLACK = 4096
RETRIES = 3
RESTART_FIGURES = ("master_ready_s", "leader_s", "get_s", "exists_s")
FAILOVER_FIGURES = ("elected_s", "leader_s", "gap_s")
# A restart's waits give up after SERVE_DEADLINE_S, or this long per object when that is more: the
# segments verify and report every DRAM object before the master leads (tens of µs per object on a
# 2-vCPU VM: minutes at 10M objects, within the master's own recovery_max_s of 300 s).
SERVE_S_PER_OBJECT = 40e-6
IN_FLIGHT_S = 0.1  # see the module docstring: a put ending this long after the kill was served by another master


# ---------------------------------------------------------------------- data


class Payloads:
    """Value number n: a slice of one random pool, its size (1-16 KiB, or `fixed` bytes) and start
    fixed by n."""

    def __init__(self, seed: int = 6, fixed: int = 0) -> None:
        self.fixed = fixed
        self.pool = random.Random(seed).randbytes(max(MAX_SIZE, fixed) + POOL_SLACK)
        self.view = memoryview(self.pool)

    def size(self, n: int) -> int:
        return self.fixed or MIN_SIZE + (n * 2654435761) % (MAX_SIZE - MIN_SIZE + 1)

    def value(self, n: int) -> memoryview:
        start = (n * 40503) % POOL_SLACK
        return self.view[start : start + self.size(n)]

    def matches(self, n: int, got: bytes | None) -> bool:
        start = (n * 40503) % POOL_SLACK
        return got is not None and got == self.pool[start : start + self.size(n)]


def _key(n: int) -> str:
    return f"recovery/{n:09d}"


def _fill(client, payloads: Payloads, objects: int) -> float:
    """Put objects 0..objects-1; seconds taken. Raises if any put fails."""
    started = time.perf_counter()
    for lo in range(0, objects, PUT_BATCH):
        numbers = range(lo, min(objects, lo + PUT_BATCH))
        statuses = client.batch_put([_key(n) for n in numbers], [payloads.value(n) for n in numbers])
        if any(statuses):
            failed = sorted({s.name for s in statuses if s})
            raise RuntimeError(f"fill: batch_put at object {lo} failed: {failed}")
    return time.perf_counter() - started


def _verify(client, payloads: Payloads, numbers: list[int], key=_key) -> tuple[list[int], list[int], int]:
    """Read `numbers` back in batches: (the numbers missing, those read with other bytes, how many
    missed at first but read back right on one of RETRIES later reads). A miss is retried because a
    read can fail without the object being gone (a segment connection lost, say): loss is what
    stays missing."""
    missing, wrong = [], []
    for lo in range(0, len(numbers), PUT_BATCH):
        chunk = numbers[lo : lo + PUT_BATCH]
        for n, got in zip(chunk, client.batch_get([key(n) for n in chunk]), strict=True):
            if got is None:
                missing.append(n)
            elif not payloads.matches(n, got):
                wrong.append(n)
    flaky = 0
    for _ in range(RETRIES):
        if not missing:
            break
        time.sleep(0.5)
        got = []  # in batches: after a large loss, one request of every missing key is refused
        for lo in range(0, len(missing), PUT_BATCH):
            got += client.batch_get([key(n) for n in missing[lo : lo + PUT_BATCH]])
        flaky += sum(1 for n, v in zip(missing, got, strict=True) if v is not None and payloads.matches(n, v))
        wrong += [n for n, v in zip(missing, got, strict=True) if v is not None and not payloads.matches(n, v)]
        missing = [n for n, v in zip(missing, got, strict=True) if v is None]
    return missing, wrong, flaky


def _count_missing(client, keys: list[str]) -> int:
    """How many of `keys` Exists does not find (raises KvtierError when the master does not answer)."""
    missing = 0
    for lo in range(0, len(keys), EXISTS_BATCH):
        missing += client.batch_exists(keys[lo : lo + EXISTS_BATCH]).count(False)
    return missing


def _segment_dram(opts_dram: str, objects: int, extra: int, fixed: int = 0) -> int:
    """Per segment (two): room for the objects with a third to spare, and `extra`; at least --dram."""
    mean = (fixed or (MIN_SIZE + MAX_SIZE) // 2) + 64
    need = objects * mean * 4 // 3 // 2 + extra
    return max(parse_size(opts_dram), -(-need // (64 << 20)) * (64 << 20))


def _start_segments(procs: Processes, master: str, dram: int) -> None:
    for i in range(2):
        procs.spawn(
            f"seg{i}",
            [
                "-m", "kvtier.segment_server",
                "--master", master,
                "--listen", "127.0.0.1:0",
                "--cluster-id", procs.cluster_id,
                "--name", f"seg{i}",
                "--dram", str(dram),
            ],
        )  # fmt: skip


# ---------------------------------------------------------------------- restart


@dataclass
class RestartRun:
    master_ready_s: float  # kill -> the new master process listens (ready file)
    leader_s: float  # kill -> Hello says role "leader": recovery finished, data RPCs served
    get_s: float  # kill -> batch_get of SAMPLE random keys returned the right bytes
    exists_s: float  # kill -> Exists over every key found all of them
    recovery: dict[str, float]  # the master's own figures (cluster_status().recovery)
    missing: int  # keys Exists did not find once the waits ended
    wrong: int  # sampled values read with other bytes
    errors: list[str]


@dataclass
class RecoveryResult:
    objects: int
    payload_bytes: int
    segment_dram: int  # each of the two segments
    fill_s: float
    runs: list[RestartRun]
    verified: int  # objects read back in full after the last restart with the right bytes
    lost: int
    wrong: int
    flaky_reads: int  # reads that missed but read back right when retried (see _verify)
    logs: dict[str, object]

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)


def run_recovery_bench(objects: int, repeat: int, dram: str, value_size: int = 0) -> RecoveryResult:
    payloads = Payloads(fixed=value_size)
    segment_dram = _segment_dram(dram, objects, 0, value_size)
    with Processes("rbench") as procs:
        state_dir = procs.dir / "master-state"
        master_args = ["-m", "kvtier.master", "--cluster-id", procs.cluster_id, "--state-dir", str(state_dir)]
        address = procs.spawn("master", [*master_args, "--listen", "127.0.0.1:0"]).info["address"]
        _start_segments(procs, address, segment_dram)
        # Two engine-like clients, made before any kill and used throughout.
        getter, checker = procs.client(address, 10.0), procs.client(address, 10.0)
        fill_s = _fill(getter, payloads, objects)
        keys = [_key(n) for n in range(objects)]
        if missing := _count_missing(checker, keys):
            raise RuntimeError(f"{missing} objects missing right after the fill")
        rng = random.Random(66)
        runs = []
        for _ in range(repeat):
            sample = rng.sample(range(objects), min(SAMPLE, objects))
            sample_keys = [_key(n) for n in sample]
            epoch_before = checker.cluster_status().epoch
            watch = Watch(max(SERVE_DEADLINE_S, objects * SERVE_S_PER_OBJECT))
            probe = Probe()

            def leader(probe=probe, epoch_before=epoch_before) -> bool:
                hello = probe.hello(address)
                return hello is not None and hello.epoch > epoch_before and hello.role == "leader"

            def sample_get(sample=sample, sample_keys=sample_keys, watch=watch) -> bool:
                got = getter.batch_get(sample_keys)  # misses while the master is away, never an exception
                wrong = sum(1 for n, v in zip(sample, got, strict=True) if v is not None and not payloads.matches(n, v))
                watch.wrong = max(watch.wrong, wrong)
                return None not in got

            watch.poll("leader", leader)
            watch.poll("get", sample_get)
            watch.poll("exists", lambda: _count_missing(checker, keys) == 0)
            watch.start(procs.kill("master"))
            procs.respawn("master", [*master_args, "--listen", address])  # the same address
            watch.mark("ready")
            watch.join()
            probe.close()
            runs.append(
                RestartRun(
                    master_ready_s=watch.get("ready"),
                    leader_s=watch.get("leader"),
                    get_s=watch.get("get"),
                    exists_s=watch.get("exists"),
                    recovery=dict(checker.cluster_status().recovery),
                    missing=_count_missing(checker, keys),
                    wrong=watch.wrong,
                    errors=watch.errors,
                )
            )
        lost, wrong, flaky = _verify(getter, payloads, list(range(objects)))
        return RecoveryResult(
            objects=objects,
            payload_bytes=sum(payloads.size(n) for n in range(objects)),
            segment_dram=segment_dram,
            fill_s=fill_s,
            runs=runs,
            verified=objects - len(lost) - len(wrong),
            lost=len(lost),
            wrong=len(wrong),
            flaky_reads=flaky,
            logs=procs.log_findings(),
        )


# ---------------------------------------------------------------------- failover


@dataclass
class FailoverRun:
    killed: str
    new_leader: str
    elected_s: float  # kill -> a standby says it won the election (role recovering or leader)
    leader_s: float  # kill -> the new leader serves (role "leader")
    gap_s: float  # kill -> the writer's first successful put served by the new leader
    puts_ok: int  # keys the writer was told were stored during the run
    puts_failed: dict[str, int]  # keys whose put returned an error (not counted as stored), by status
    lost: int  # acknowledged or pre-filled keys not found afterwards, retries included
    wrong: int
    flaky_reads: int  # reads that missed but read back right when retried
    recovery: dict[str, float]
    errors: list[str]


@dataclass
class FailoverResult:
    objects: int
    lease_ttl_s: float
    segment_dram: int
    fill_s: float
    runs: list[FailoverRun]
    verified: int
    lost: int
    wrong: int
    flaky_reads: int
    logs: dict[str, object]

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)


class _Writer:
    """Puts WRITER_BATCH keys per call from a thread until stopped; logs (start, end, numbers stored)."""

    def __init__(self, client, payloads: Payloads, base: int) -> None:
        self.client = client
        self.payloads = payloads
        self.base = base
        self.log: list[tuple[float, float, list[int]]] = []
        self.failures: Counter[str] = Counter()  # status names of the puts that failed
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def key(n: int) -> str:
        return f"failover/{n:011d}"

    def _run(self) -> None:
        n = self.base
        try:
            while not self._stop.is_set():
                numbers = list(range(n, n + WRITER_BATCH))
                n += WRITER_BATCH
                started = time.monotonic()
                statuses = self.client.batch_put(
                    [self.key(m) for m in numbers], [self.payloads.value(m) for m in numbers]
                )
                self.log.append(
                    (started, time.monotonic(), [m for m, s in zip(numbers, statuses, strict=True) if not s])
                )
                self.failures.update(s.name for s in statuses if s)
        except Exception as exc:
            self.error = f"writer: {type(exc).__name__}: {exc}"

    def stop(self) -> list[int]:
        """Stop; the numbers of every key the writer was told was stored."""
        self._stop.set()
        self._thread.join(60)
        return [m for _, _, stored in self.log for m in stored]


def run_failover_bench(objects: int, repeat: int, dram: str, etcd_binary: str) -> FailoverResult:
    binary = shutil.which(etcd_binary)
    if binary is None:
        raise RuntimeError(f"etcd not found at {etcd_binary!r} (apt-get install etcd-server, or --etcd-binary)")
    payloads = Payloads()
    segment_dram = _segment_dram(dram, objects, 1 << 30)  # the writer's keys on top
    with Processes("fbench") as procs:
        spec = f"etcd://{procs.start_etcd(binary)}/{procs.cluster_id}"
        master_args = ["-m", "kvtier.master", "--listen", "127.0.0.1:0", "--cluster-id", procs.cluster_id]
        master_args += ["--etcd", spec]  # default --etcd-lease-ttl-s: 5 s
        addresses = {f"master{i}": procs.spawn(f"master{i}", master_args).info["address"] for i in range(3)}
        probe = Probe()
        procs.on_close(probe.close)
        probe.wait_leader(addresses)
        _start_segments(procs, spec, segment_dram)
        writer_client, checker = procs.client(spec, 30.0), procs.client(spec, 30.0)
        fill_s = _fill(writer_client, payloads, objects)
        keys = [_key(n) for n in range(objects)]
        rng = random.Random(67)
        runs = []
        for r in range(repeat):
            sample = rng.sample(range(objects), min(SAMPLE, objects))
            old = probe.wait_leader(addresses)
            others = {name: address for name, address in addresses.items() if name != old}
            writer = _Writer(writer_client, payloads, base=(r + 1) * 1_000_000_000)
            time.sleep(2.0)
            watch = Watch()
            roles: dict[str, str] = {}

            def new_leader(others=others, roles=roles, watch=watch) -> bool:
                for name, address in others.items():
                    hello = probe.hello(address)
                    if hello is not None and hello.role in ("recovering", "leader"):
                        watch.mark("elected")
                        if hello.role == "leader":
                            roles["leader"] = name
                            return True
                return False

            watch.poll("leader", new_leader)
            watch.poll("put", lambda writer=writer, watch=watch: not math.isnan(_first_put_s(writer, watch.killed_at)))
            watch.start(procs.kill(old))
            watch.join()
            time.sleep(1.0)  # writing on under the new leader
            acked = writer.stop()
            if writer.error:
                watch.errors.append(writer.error)
            lost_writes, wrong_writes, flaky_writes = _verify(checker, payloads, acked, key=_Writer.key)
            lost_sample, wrong_sample, flaky_sample = _verify(checker, payloads, sample)
            runs.append(
                FailoverRun(
                    killed=old,
                    new_leader=roles.get("leader", ""),
                    elected_s=watch.get("elected"),
                    leader_s=watch.get("leader"),
                    gap_s=_first_put_s(writer, watch.killed_at),
                    puts_ok=len(acked),
                    puts_failed=dict(writer.failures),
                    lost=len(lost_writes) + len(lost_sample) + _count_missing(checker, keys),
                    wrong=len(wrong_writes) + len(wrong_sample),
                    flaky_reads=flaky_writes + flaky_sample,
                    recovery=dict(checker.cluster_status().recovery),
                    errors=watch.errors,
                )
            )
            # The killed master comes back as a standby (at a new port) for the next run.
            addresses[old] = procs.respawn(old, master_args).info["address"]
        lost, wrong, flaky = _verify(checker, payloads, list(range(objects)))
        return FailoverResult(
            objects=objects,
            lease_ttl_s=5.0,
            segment_dram=segment_dram,
            fill_s=fill_s,
            runs=runs,
            verified=objects - len(lost) - len(wrong),
            lost=len(lost),
            wrong=len(wrong),
            flaky_reads=flaky,
            logs=procs.log_findings(),
        )


def _first_put_s(writer: _Writer, killed_at: float) -> float:
    """Seconds from the kill to the end of the first put served by another master (module docstring)."""
    for started, ended, stored in writer.log:
        if stored and ended > killed_at and (started > killed_at or ended - killed_at > IN_FLIGHT_S):
            return ended - killed_at
    return float("nan")


# ---------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recovery",
        action="store_true",
        help="start a master (--state-dir) and 2 segments, fill, kill -9 and restart the master --repeat times; "
        "time until it serves again, check no loss",
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="start etcd, 3 masters and 2 segments, fill; kill -9 the leader under a writer --repeat times; "
        "time until puts succeed, check no loss",
    )
    parser.add_argument(
        "--recovery-objects",
        type=int,
        default=100_000,
        help="--recovery/--failover: 1-16 KiB objects stored first (default: %(default)s)",
    )
    parser.add_argument(
        "--recovery-value-size",
        type=int,
        default=0,
        help="--recovery: every value this many bytes instead of 1-16 KiB, e.g. 64 for 10,000,000 objects "
        "(issue 19: what recovery costs per object, not per byte)",
    )
    parser.add_argument("--etcd-binary", default="/usr/bin/etcd", help="--failover: etcd to run (%(default)s)")


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _table(header: list[str], rows: list[list[object]]) -> None:
    """Right-aligned columns, two spaces apart."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(header))]
    for row in cells:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)))


def print_recovery_results(
    recovery: RecoveryResult | None, failover: FailoverResult | None, as_json: bool, machine: dict
) -> None:
    if as_json:
        doc: dict = {"machine": machine}
        if recovery is not None:
            doc["recovery"] = asdict(recovery)
            doc["recovery"]["median"] = {k: recovery.median(k) for k in RESTART_FIGURES}
        if failover is not None:
            doc["failover"] = asdict(failover)
            doc["failover"]["median"] = {k: failover.median(k) for k in FAILOVER_FIGURES}
        print(json.dumps(_nan_to_none(doc), indent=2))
        return
    print(f"kvtier bench: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}, Python {machine['python']}")
    if recovery is not None:
        r = recovery
        print(
            f"master kill -9 and restart: {r.objects:,} objects ({format_size(r.payload_bytes)}) on 2 segments of "
            f"{format_size(r.segment_dram)}, filled in {r.fill_s:.1f}s; seconds from the kill to:"
        )
        rows: list[list[object]] = []
        for i, run in enumerate(r.runs, 1):
            rec = {k: f"{v:.0f}" for k, v in run.recovery.items()}
            rows.append(
                [i, *(_fmt(getattr(run, k)) for k in RESTART_FIGURES), f"{run.recovery.get('seconds', 0):.2f}"]
                + [f"{rec.get('segments_reported')}/{rec.get('segments_expected')}", rec.get("objects")]
                + [rec.get("refused"), run.missing, run.wrong]
            )
        rows.append(["median", *(_fmt(r.median(k)) for k in RESTART_FIGURES)])
        header = ["run", "listening", "leader", "get 1000", "exists all", "recovery s", "segments", "objects"]
        _table(header + ["refused", "missing", "wrong"], rows)
        for i, run in enumerate(r.runs, 1):
            for error in run.errors:
                print(f"  run {i} error: {error}")
        print(
            f"  after the last restart: {r.verified:,} of {r.objects:,} intact, {r.lost} lost, {r.wrong} wrong "
            f"({r.flaky_reads} reads missed once and read back right on a retry)"
        )
        _print_logs(r.logs)
    if failover is not None:
        f = failover
        print(
            f"leader failover: etcd + 3 masters (lease TTL {f.lease_ttl_s:.0f}s), 2 segments of "
            f"{format_size(f.segment_dram)}, {f.objects:,} objects put first, a writer putting "
            f"{WRITER_BATCH} keys per call; seconds from the kill to:"
        )
        rows = [
            [i, run.killed, run.new_leader, *(_fmt(getattr(run, k)) for k in FAILOVER_FIGURES), run.puts_ok]
            + [sum(run.puts_failed.values()), run.lost, run.wrong, f"{run.recovery.get('objects', 0):.0f}"]
            + [f"{run.recovery.get('refused', 0):.0f}", run.flaky_reads]
            for i, run in enumerate(f.runs, 1)
        ]
        rows.append(["median", "", "", *(_fmt(f.median(k)) for k in FAILOVER_FIGURES)])
        header = ["run", "killed", "new leader", "elected", "serving", "first put", "puts ok", "failed", "lost"]
        _table(header + ["wrong", "recovered objects", "refused", "flaky reads"], rows)
        for i, run in enumerate(f.runs, 1):
            if run.puts_failed:
                print(f"  run {i} failed puts: " + ", ".join(f"{n} {s}" for s, n in sorted(run.puts_failed.items())))
            for error in run.errors:
                print(f"  run {i} error: {error}")
        print(
            f"  at the end: {f.verified:,} of {f.objects:,} objects put first intact, {f.lost} lost, {f.wrong} wrong "
            f"({f.flaky_reads} reads missed once and read back right on a retry)"
        )
        _print_logs(f.logs)


def _nan_to_none(value):
    """JSON has no NaN: a wait that never ended is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def _print_logs(logs: dict[str, object]) -> None:
    warnings = logs.get("warnings") or {}
    errors = logs.get("errors") or []
    if warnings:
        print("  log warnings: " + ", ".join(f"{name} {count}" for name, count in warnings.items()))  # type: ignore[union-attr]
    for line in errors:  # type: ignore[union-attr]
        print(f"  log error: {line}")


def run_recovery(opts: argparse.Namespace, machine: dict) -> int:
    """`kvtier bench --recovery` and/or `--failover`; exit status 1 when an object was lost or wrong."""
    if opts.recovery_objects < 1:
        print("kvtier bench: --recovery-objects must be positive", file=sys.stderr)
        return 2
    if opts.recovery_value_size < 0 or opts.recovery_value_size > 64 << 20:
        print("kvtier bench: --recovery-value-size must be 0..64 MiB", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the children
    # The clients' warnings (master unreachable, fast path lost) are what this bench causes on purpose.
    client_logger = logging.getLogger("kvtier.client")
    level = client_logger.level
    client_logger.setLevel(logging.ERROR)
    try:
        recovery = failover = None
        if opts.recovery:
            recovery = run_recovery_bench(opts.recovery_objects, opts.repeat, opts.dram, opts.recovery_value_size)
        if opts.failover:
            failover = run_failover_bench(opts.recovery_objects, opts.repeat, opts.dram, opts.etcd_binary)
    finally:
        signal.signal(signal.SIGTERM, previous)
        client_logger.setLevel(level)
    print_recovery_results(recovery, failover, opts.json, machine)
    bad = 0
    if recovery is not None:
        bad += recovery.lost + recovery.wrong + sum(r.missing + r.wrong for r in recovery.runs)
    if failover is not None:
        bad += failover.lost + failover.wrong + sum(r.lost + r.wrong for r in failover.runs)
    return 1 if bad else 0
