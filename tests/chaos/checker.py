"""The history checker: are the reads of a recorded history ones a correct cache could give?

Inputs (JSON lines, all times CLOCK_MONOTONIC seconds): the workers' op records
(tests/chaos/worker.py), the master's history log (`--history-log`, master/history.py) and the
harness's fault log. Model (docs/testing.md): each key has one writer whose ops are sequential;
it puts a new version only after an acknowledged remove, so an acknowledged put stored exactly
its value. An op without a completion line is indeterminate (completed at +inf, never
acknowledged).

Rules, per read R = [R.t0, R.t1] of key k:
  (a) a value must be complete and k's own (else CORRUPT / FOREIGN), must come from a put P of k
      invoked before R completed (else PHANTOM), and no remove of k invoked after P and
      acknowledged before R began may precede it (else STALE).
  (b) a miss (NOT_FOUND, or a copy failing its checksum) while the last put of k acknowledged
      before R began has no remove invoked after it before R completed is LOST, unless the master
      recorded that object (same checksum) leaving between P's invoke and R's completion for an
      accepted reason: an eviction (not of a corrupt copy), or the loss of a segment the harness
      had killed or stopped.
Reads that failed otherwise (a timeout, an unreachable segment, an expired lease) claim nothing and
are only counted.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ACKED_REMOVE = ("OK", "NOT_FOUND")
MAX_FAULTS_SHOWN = 6  # the faults closest before the read
# A read the client refused because the stored copy failed its checksum: unreadable, so for rule (b)
# as much a miss as NOT_FOUND (nothing in a chaos run corrupts memory on purpose).
MISMATCH = "CHECKSUM_MISMATCH"
# Segment losses the checker accepts when the harness faulted that segment first.
SEGMENT_LOSSES = ("segment:heartbeat ttl expired", "segment:commit feed silent", "segment:remounted")
# (The network faults of tests/chaos/net_harness.py that can make the master expel a segment too.)
SEGMENT_FAULTS = ("kill_segment", "stop_segment", "partition_segment_master", "flap_segment")
REJECTED_EVICTIONS = ("evicted:corrupt", "evicted:corrupt disk")  # a corrupt copy is a bug, not a cache's choice
# A restarted master rebuilds its tables from the segments' inventories: a segment killed while the
# master was down or still rebuilding takes its objects with it and no master ever knew them to
# record their loss. Such a miss is accepted when the window holds a kill_segment from just before a
# kill_master until RECOVERY_S after the master was back (its --recovery-timeout-s, default 5 s).
RECOVERY_S = 5.0


@dataclass
class KeyOp:
    kind: str  # put, remove, get
    proc: str
    op_id: int
    t0: float
    t1: float  # +inf: indeterminate
    result: object  # per-key result; None when indeterminate
    version: int = 0
    crc: int | None = None

    @property
    def acked(self) -> bool:
        if self.kind == "put":
            return self.result == "OK"
        return self.kind == "remove" and self.result in ACKED_REMOVE

    def describe(self) -> str:
        what = f"{self.kind}" + (f" v{self.version}" if self.kind == "put" else "")
        end = "never completed" if math.isinf(self.t1) else f"{self.t1:.6f}"
        return f"{what} by {self.proc}#{self.op_id} [{self.t0:.6f} .. {end}] -> {self.result}"


@dataclass
class Violation:
    rule: str  # CORRUPT, FOREIGN, PHANTOM, STALE, LOST
    key: str
    read: KeyOp
    why: str
    conflicting: list[str] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    cause: str = ""  # the likely cause, for grouping: an unaccepted master event and the fault before it
    repeats: int = 0  # later reads that failed the same way for the same put (not listed)

    def explain(self) -> str:
        head = f"{self.rule} {self.key}: {self.why}" + (f" (and {self.repeats} later reads)" if self.repeats else "")
        lines = [head, f"  read:    {self.read.describe()}"]
        lines += [f"  against: {c}" for c in self.conflicting]
        for f in self.faults[-MAX_FAULTS_SHOWN:]:
            lines.append(f"  fault:   {f['kind']} {f['target']} [{f['t0']:.6f} .. {f.get('t1', math.inf):.6f}]")
        if self.cause:
            lines.append(f"  cause:   {self.cause}")
        return "\n".join(lines)


@dataclass
class Report:
    violations: list[Violation]
    counts: Counter
    events: Counter
    incomplete_event_log: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self, limit: int = 20) -> str:
        head = (
            f"{len(self.violations)} violation(s); reads: "
            + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            + "; master events: "
            + (", ".join(f"{k}={v}" for k, v in sorted(self.events.items())) or "none")
        )
        if self.incomplete_event_log:
            head += "; the master's history log was truncated (misses after that are unexplained)"
        by_rule = Counter(v.rule for v in self.violations)
        if by_rule:
            head += "\nby rule: " + ", ".join(f"{k}={v}" for k, v in sorted(by_rule.items()))
            by_cause = Counter(f"{v.rule} <- {v.cause or '?'}" for v in self.violations)
            head += "".join(f"\n  {n:5d}  {cause}" for cause, n in by_cause.most_common())
        shown = [v.explain() for v in self.violations[:limit]]
        more = len(self.violations) - limit
        return "\n".join([head, *shown] + ([f"... and {more} more"] if more > 0 else []))


def read_jsonl(paths: Iterable[Path | str]) -> list[dict]:
    """Every whole JSON line of the files; a line cut by a SIGKILL mid-write is skipped."""
    out = []
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def key_ops(records: Iterable[dict]) -> dict[str, list[KeyOp]]:
    """Per key, its ops (each batch op split per key), in invoke order."""
    invokes: dict[tuple[str, int], dict] = {}
    completions: dict[tuple[str, int], dict] = {}
    for rec in records:
        (invokes if rec.get("k") == "i" else completions)[(rec["p"], rec["id"])] = rec
    per_key: dict[str, list[KeyOp]] = defaultdict(list)
    for ident, inv in invokes.items():
        done = completions.get(ident)
        keys = inv["keys"]
        results = done["r"] if done is not None else [None] * len(keys)
        versions = inv.get("versions") or [0] * len(keys)
        crcs = inv.get("crcs") or [None] * len(keys)
        for i, key in enumerate(keys):
            per_key[key].append(
                KeyOp(
                    inv["op"],
                    inv["p"],
                    inv["id"],
                    inv["t"],
                    done["t"] if done is not None else math.inf,
                    results[i],
                    versions[i],
                    crcs[i],
                )
            )
    for ops in per_key.values():
        ops.sort(key=lambda o: o.t0)
    return per_key


def overlapping(faults: list[dict], t0: float, t1: float) -> list[dict]:
    return [f for f in faults if f["t0"] <= t1 and f.get("t1", math.inf) >= t0]


class Checker:
    def __init__(self, records: Iterable[dict], events: Iterable[dict] = (), faults: Iterable[dict] = ()) -> None:
        records = list(records)
        self.ops = key_ops(records)
        # Keys the readers got from their segments alone (direct reads): checked like any other read,
        # counted so a run shows it exercised them.
        self.direct_reads = sum(r.get("dr", 0) for r in records if r.get("k") == "c")
        self.faults = sorted(faults, key=lambda f: f["t0"])
        self.events: dict[str, list[dict]] = defaultdict(list)
        self.event_counts: Counter = Counter()
        self.truncated_at = math.inf
        self.counts: Counter = Counter()
        for e in events:
            if e.get("event") == "truncated":
                self.truncated_at = min(self.truncated_at, e["t"])
            if e.get("event") in ("object", "replica"):
                self.event_counts[f"{e['event']}:{e['reason']}"] += 1
                if e["event"] == "object":
                    self.events[e["key"]].append(e)

    def check(self) -> Report:
        violations: list[Violation] = []
        counts = self.counts = Counter()
        for key, ops in sorted(self.ops.items()):
            writes = [o for o in ops if o.kind in ("put", "remove")]
            starts = [o.t0 for o in writes]
            puts = {o.version: o for o in writes if o.kind == "put"}
            self._seen: dict[int, float] = {}  # version -> invoke time of the latest read that returned it
            self._reported: dict[tuple, Violation] = {}
            for read in (o for o in ops if o.kind == "get"):
                result = read.result
                if result is None:
                    counts["indeterminate"] += 1
                elif isinstance(result, dict) and "v" in result:
                    counts["values"] += 1
                    violations += self._check_value(key, read, result["v"], puts, writes, starts)
                    version = result["v"][2]
                    self._seen[version] = max(self._seen.get(version, 0.0), read.t0)
                elif isinstance(result, dict):
                    counts["corrupt"] += 1
                    violations.append(
                        Violation("CORRUPT", key, read, result.get("corrupt", "?"), [], self._faults(read.t0, read))
                    )
                elif result in ("miss", MISMATCH):
                    counts["misses" if result == "miss" else "checksum_mismatches"] += 1
                    violations += self._check_miss(key, read, writes, starts)
                else:
                    counts["failed"] += 1
        if self.direct_reads:
            counts["of_them_direct"] = self.direct_reads
        return Report(violations, counts, self.event_counts, not math.isinf(self.truncated_at))

    def _faults(self, since: float, read: KeyOp) -> list[dict]:
        return overlapping(self.faults, since, read.t1)

    def _check_value(
        self, key: str, read: KeyOp, ident: list, puts: dict[int, KeyOp], writes: list[KeyOp], starts: list[float]
    ) -> list[Violation]:
        got_key, _writer, version = ident
        if got_key != key:
            return [Violation("FOREIGN", key, read, f"returned the value of {got_key} v{version}", [])]
        put = puts.get(version)
        if put is None or put.t0 > read.t1:
            why = "returned a version never put" if put is None else "returned a version put after the read"
            return [Violation("PHANTOM", key, read, why, [put.describe()] if put else [])]
        # Only the writes invoked after the put and before the read can qualify (writes are in invoke
        # order): a long run's keys have thousands of them, and every read used to scan them all.
        for j in range(bisect.bisect_right(starts, put.t0), bisect.bisect_left(starts, read.t0)):
            rm = writes[j]
            if rm.kind == "remove" and rm.acked and rm.t0 > put.t0 and rm.t1 < read.t0:
                if self._repeat(("STALE", version)):
                    return []
                faults = self._faults(rm.t0, read)
                violation = Violation(
                    "STALE",
                    key,
                    read,
                    f"returned v{version}, removed by an acknowledged remove before the read began",
                    [put.describe(), rm.describe()],
                    faults,
                    "after " + ",".join(sorted({f["kind"] for f in faults})) if faults else "no fault",
                )
                self._reported[("STALE", version)] = violation
                return [violation]
        return []

    def _repeat(self, ident: tuple) -> bool:
        known = self._reported.get(ident)
        if known is not None:
            known.repeats += 1
        return known is not None

    def _check_miss(self, key: str, read: KeyOp, writes: list[KeyOp], starts: list[float]) -> list[Violation]:
        index = bisect.bisect_left(starts, read.t0) - 1  # the writes invoked before the read, newest first
        while index >= 0 and not (writes[index].kind == "put" and writes[index].acked and writes[index].t1 < read.t0):
            index -= 1
        if index < 0:
            return []
        last = writes[index]
        after = writes[index + 1] if index + 1 < len(writes) else None
        if after is not None and after.t0 < read.t1:
            self.counts["misses_after_remove"] += 1
            return []  # a remove was invoked (or the next op began): the key may be gone
        events = [e for e in self.events.get(key, ()) if last.t0 <= e["t"] <= read.t1]
        if any(self._accepted(e, last) for e in events):
            self.counts["misses_explained"] += 1
            return []
        since = max(last.t0, self._seen.get(last.version, 0.0))
        if not events and self._segment_killed_during_recovery(since, read.t1):
            self.counts["misses_explained_by_recovery"] += 1
            return []
        if self._repeat(("LOST", last.version)):
            return []
        what = "miss" if read.result == "miss" else "checksum mismatch (the stored copy is corrupt)"
        if self.truncated_at <= read.t1:
            why = f"{what} after an acknowledged put; the master's history log was truncated before it"
        else:
            why = f"{what} after an acknowledged put, no remove invoked and no accepted master event"
        conflicting = [last.describe()] + [
            f"master event {e['reason']} t={e['t']:.6f} checksum={e.get('checksum')} segment={e.get('segment')}"
            for e in events
        ]
        # The object went between the last read that saw it (or its put) and this one.
        violation = Violation("LOST", key, read, why, conflicting, self._faults(since, read))
        violation.cause = self._cause(events, last, since, read)
        self._reported[("LOST", last.version)] = violation
        return [violation]

    def _cause(self, events: list[dict], put: KeyOp, since: float, read: KeyOp) -> str:
        mine = [e for e in events if put.crc is None or e.get("checksum") == put.crc]
        if mine:
            event = mine[0]
            before = [f for f in self.faults if f["t0"] <= event["t"]]
            fault = f"; {before[-1]['kind']} {before[-1]['target']} before it" if before else ""
            return f"master event {event['reason']} (not accepted){fault}"
        kinds = sorted({f["kind"] for f in overlapping(self.faults, since, read.t1)})
        return "no master event; faults since last seen: " + (",".join(kinds) or "none")

    def _segment_killed_during_recovery(self, t0: float, t1: float) -> bool:
        window = overlapping(self.faults, t0, t1)
        masters = [f for f in window if f["kind"] == "kill_master"]
        segments = [f for f in window if f["kind"] == "kill_segment"]
        return any(s["t1"] >= m["t0"] - 1.0 and s["t0"] <= m["t1"] + RECOVERY_S for m in masters for s in segments)

    def _accepted(self, event: dict, put: KeyOp) -> bool:
        if put.crc is not None and event.get("checksum") != put.crc:
            return False  # the record of another version of the key
        reason = event["reason"]
        if reason.startswith("evicted:"):
            return reason not in REJECTED_EVICTIONS
        if reason in SEGMENT_LOSSES:
            return any(
                f["kind"] in SEGMENT_FAULTS and f["target"] == event.get("segment") and f["t0"] <= event["t"]
                for f in self.faults
            )
        return False


def check_run(run_dir: Path) -> Report:
    """Check a run directory as the harness leaves it: ops/*.jsonl, master-history.jsonl, faults.jsonl."""
    return Checker(
        read_jsonl(sorted((run_dir / "ops").glob("*.jsonl"))),
        read_jsonl([run_dir / "master-history.jsonl"]),
        read_jsonl([run_dir / "faults.jsonl"]),
    ).check()


if __name__ == "__main__":
    import sys

    report = check_run(Path(sys.argv[1]))
    print(report.summary(limit=int(sys.argv[2]) if len(sys.argv) > 2 else 50))
    sys.exit(0 if report.ok else 1)
