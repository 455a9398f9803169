"""`kvtier bench --master-scan`: do scans stall the master? (issue 19)

In process: one real `MasterState` (kvtier.master.state) on an asyncio event loop (uvloop when
installed, as the master runs), driven through the same state methods its RPC handlers call, with
the server's sweeper task (kvtier.master.sweeps.run_sweeper) running beside the load, and a task
acknowledging the commit notices every millisecond as the segments' polls do. No sockets:
what is measured is how long the event loop keeps a request waiting, not the transport.

Fill `--objects` objects (default 1M; 10M with --objects 10000000) on two segments: a segment
"doomed" holds `--scan-objects` of them (default: min(1M, objects / 4)), a prefix "rm/" names as
many others, a prefix "few/" names 100. Then a load task issues single-key Exists and single-key
PutStart(+PutEnd) requests at fixed arrival times (`--scan-interval-ms`, default 0.5 ms), each
latency counted from its planned arrival to its answer (a request arriving while the loop is busy
waits, as a client's would), and reports p50/p99:
- idle;
- (a) while ListKeys pages through prefix "few/" again and again, `limit` 100, as a client
  would: the next page asked for a loopback round trip (0.2 ms) after the last; each page given
  the time budget the ListKeys handler gives it (`list_page_ms`, kvtier.master.inspection);
- (b) while RemovePrefix("rm/") runs until it has answered;
- (c) while the segment "doomed" is dropped (declared dead) until its cleanup has finished.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from dataclasses import asdict, dataclass, field

NS = "scan-bench"
# The idle and listing phases last this long: long enough that one stall of the machine's own (tens
# of ms, seen idle too) does not decide their p99 alone (at 2 s it could: ~20 puts make the 1%).
WINDOW_S = 8.0
VALUE_SIZE = 64
BATCH = 10_000
# A paging client (`kvtier keys`) asks for the next page once the last one arrived: a loopback
# round trip, during which the master serves others.
CLIENT_ROUND_TRIP_S = 0.0002


@dataclass
class Phase:
    name: str
    samples: int
    exists_p50_ms: float
    exists_p99_ms: float
    exists_max_ms: float
    put_p50_ms: float
    put_p99_ms: float
    put_max_ms: float
    scan_s: float  # how long the scan took (0 for idle)
    gc_max_ms: float  # the longest cyclic garbage collection meanwhile: a stall no scan causes


@dataclass
class ScanResult:
    objects: int
    scan_objects: int
    slice_objects: int
    slice_ms: float
    sliced: bool  # this master sweeps in slices (False: a build before issue 19)
    interval_ms: float
    phases: list[Phase] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def _fill(state, keys: list[str]) -> None:
    for lo in range(0, len(keys), BATCH):
        chunk = keys[lo : lo + BATCH]
        started = state.put_start(NS, chunk, [VALUE_SIZE] * len(chunk), 1)
        if any(started.statuses):
            raise RuntimeError(f"PutStart failed: {started.first_error}")
        state.put_end(NS, chunk, [1] * len(chunk), started.put_id)
        _ack_all(state)


def _ack_all(state) -> None:
    """What the segments' commit polls do (PollCommits): acknowledge every notice queued."""
    for segment_id in list(state.segments):
        state.commits.poll(segment_id, 1 << 62, 0)


async def _acker(state) -> None:
    while True:  # a segment polls again as soon as it acknowledged: here every millisecond
        _ack_all(state)
        await asyncio.sleep(0.001)


def _build(objects: int, scan_objects: int):
    from kvtier.master.config import MasterConfig
    from kvtier.master.state import MasterState
    from kvtier.master.state_types import SegmentState

    config = MasterConfig(cluster_id="scanbench", segment_ttl_s=3600.0, heartbeat_interval_s=1.0)
    state = MasterState(config)
    state.sweep_inline = False
    capacity = max(256 << 20, objects * 128)

    def mount(name: str):
        result = state.mount_segment("scanbench", name, name, [f"tcp://127.0.0.1:9/{name}"], capacity)
        return result.segment

    doomed = mount("doomed")
    _fill(state, [f"seg/{i:016x}-block-hash-suffix" for i in range(scan_objects)])
    doomed.state = SegmentState.DRAINING  # placement skips it from here on: it holds exactly these
    mount("live")
    _fill(state, [f"rm/{i:016x}-block-hash-suffix" for i in range(scan_objects)])
    _fill(state, [f"few/{i:04d}" for i in range(100)])
    rest = objects - 2 * scan_objects - 100
    _fill(state, [f"k/{i:016x}-block-hash-suffix" for i in range(max(0, rest))])
    return state, doomed.segment_id


async def _load(state, keys: list[str], interval_s: float, stop: asyncio.Event, out: dict, tag: str) -> None:
    exists_lat, put_lat = out["exists"], out["put"]
    loop_time = time.perf_counter
    n = 0
    arrival = loop_time()
    while True:  # the request that arrived during a stall is answered and counted, then we stop
        arrival += interval_s
        delay = arrival - loop_time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:  # behind: this request arrives now (not queued up), and waits for the loop like any
            arrival = loop_time()
            await asyncio.sleep(0)
        key = keys[n % len(keys)]
        if n % 2 == 0:
            state.exists(NS, [key])
            exists_lat.append(loop_time() - arrival)
        else:
            name = f"load/{tag}/{n:012d}"  # new in every phase: a name put before is answered at once
            started = state.put_start(NS, [name], [VALUE_SIZE], 1)
            state.put_end(NS, [name], [1], started.put_id)
            put_lat.append(loop_time() - arrival)
        n += 1
        if stop.is_set():
            return


async def _phase(state, name: str, scan, interval_s: float, idle_s: float) -> Phase:
    keys = [f"k/{i:016x}-block-hash-suffix" for i in range(0, 50_000, 7)] or ["few/0000"]
    stop = asyncio.Event()
    out: dict[str, list[float]] = {"exists": [], "put": []}
    pauses: list[float] = []
    began = [0.0]

    def timing(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    gc.callbacks.append(timing)
    load = asyncio.create_task(_load(state, keys, interval_s, stop, out, name))
    await asyncio.sleep(0.02)  # the load runs before the scan begins
    started = time.perf_counter()
    if scan is None:
        await asyncio.sleep(idle_s)
        took = 0.0
    else:
        await scan()
        took = time.perf_counter() - started
    stop.set()
    await load
    gc.callbacks.remove(timing)
    e, p = out["exists"], out["put"]
    return Phase(
        name,
        len(e) + len(p),
        _pct(e, 0.5),
        _pct(e, 0.99),
        max(e, default=0) * 1000,
        _pct(p, 0.5),
        _pct(p, 0.99),
        max(p, default=0) * 1000,
        took,
        max(pauses, default=0) * 1000,
    )


async def _run(
    objects: int, scan_objects: int, slice_objects: int, slice_ms: float, interval_s: float, window_s: float
) -> ScanResult:
    import inspect

    from kvtier.master.config import MasterConfig
    from kvtier.master.inspection import list_keys

    # As the ListKeys handler calls it: a page holds the loop `list_page_ms` at most (a build before
    # session 9 has no budget and builds whole pages).
    page_ms = getattr(MasterConfig, "list_page_ms", 0.0)
    budget = {"budget_s": page_ms / 1000} if "budget_s" in inspect.signature(list_keys).parameters else {}

    try:
        from kvtier.master.sweeps import run_sweeper
    except ImportError:  # a build before issue 19: scans run whole, inside one call
        run_sweeper = None
    state, doomed_id = _build(objects, scan_objects)
    result = ScanResult(objects, scan_objects, slice_objects, slice_ms, run_sweeper is not None, interval_s * 1000)
    sweeper = asyncio.create_task(run_sweeper(lambda: state, slice_objects, slice_ms)) if run_sweeper else None
    acker = asyncio.create_task(_acker(state))
    await asyncio.sleep(0)
    result.phases.append(await _phase(state, "idle", None, interval_s, window_s))

    async def listing() -> None:
        deadline = time.perf_counter() + window_s
        while time.perf_counter() < deadline:
            after = ""
            while True:
                page = list_keys(state, NS, "few/", after, 100, **budget)
                after = page.next_start_after
                await asyncio.sleep(CLIENT_ROUND_TRIP_S)  # the next page is asked for once this one arrived
                if not after:
                    break

    async def remove_prefix() -> None:
        start = getattr(state, "start_remove_prefix", None)
        if start is None:
            state.remove_prefix(NS, "rm/")
            return
        removal = start(NS, "rm/")
        while not removal.done:
            await asyncio.sleep(0.001)

    async def segment_dies() -> None:
        state.drop_segment(doomed_id, reason="heartbeat ttl expired")
        while getattr(state, "sweeps", None) is not None and state.sweeps.active:
            await asyncio.sleep(0.001)

    for name, scan in (("list_keys", listing), ("remove_prefix", remove_prefix), ("segment_death", segment_dies)):
        await asyncio.sleep(0.05)  # the previous phase's load has drained
        result.phases.append(await _phase(state, name, scan, interval_s, window_s))
    acker.cancel()
    if sweeper is not None:
        sweeper.cancel()
    return result


def run_scan_bench(
    objects: int, scan_objects: int, slice_objects: int, slice_ms: float, interval_ms: float
) -> ScanResult:
    gc.set_threshold(70_000, 20, 20)  # as kvtier-master runs (master/__main__.py)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    scan_objects = scan_objects or min(1_000_000, objects // 4)
    return runner(_run(objects, scan_objects, slice_objects, slice_ms, interval_ms / 1000, WINDOW_S))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master-scan", action="store_true", help="Exists/PutStart latency while scans run")
    parser.add_argument(
        "--scan-objects",
        type=int,
        default=0,
        help="--master-scan: objects removed / lost (default: min(1M, objects/4))",
    )
    parser.add_argument(
        "--scan-slice", type=int, default=0, help="--master-scan: names per sweep slice at most (default: the master's)"
    )
    parser.add_argument(
        "--scan-slice-ms",
        type=float,
        default=0.0,
        help="--master-scan: a sweep slice's time at most (default: the master's)",
    )
    parser.add_argument("--scan-interval-ms", type=float, default=0.5, help="--master-scan: one request every this")


def print_scan_result(result: ScanResult, as_json: bool, machine: dict) -> None:
    import json

    if as_json:
        print(json.dumps({"machine": machine, "master_scan": asdict(result)}, indent=2))
        return
    print(f"kvtier bench --master-scan: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    how = (
        f"sliced, slices of {result.slice_objects:,} names / {result.slice_ms} ms at most"
        if result.sliced
        else "whole (no sweeper)"
    )
    print(f"{result.objects:,} objects, scans of {result.scan_objects:,} objects, {how}; latency in ms")
    print(f"  one request every {result.interval_ms} ms (Exists and PutStart+PutEnd in turn)")
    idle = result.phases[0]
    print(
        f"  {'phase':<14} {'Exists p50':>10} {'p99':>7} {'max':>7} {'Put p50':>8} {'p99':>7} {'max':>7}"
        "  p99 vs idle  scan s"
    )
    for p in result.phases:
        ratio = f"{p.exists_p99_ms / idle.exists_p99_ms:.1f}x / {p.put_p99_ms / idle.put_p99_ms:.1f}x"
        print(
            f"  {p.name:<14} {p.exists_p50_ms:>10.3f} {p.exists_p99_ms:>7.3f} {p.exists_max_ms:>7.1f} "
            f"{p.put_p50_ms:>8.3f} {p.put_p99_ms:>7.3f} {p.put_max_ms:>7.1f}  {ratio:<11}  {p.scan_s:.2f}"
            f"  ({p.samples} requests, longest gc {p.gc_max_ms:.0f} ms)"
        )
