"""`kvtier bench --master-placement`: what a put costs the master as segments multiply.

In process: one real `MasterState` (kvtier.master.state) with `--placement-segments` segments
mounted (each a segment of its own host, as one segment per engine rank on many hosts gives),
driven through the state methods the PutStart and PutEnd handlers call; no sockets. For each
segment count, batches of `--batch` keys (default 32) of 4 KiB are put and committed; the figure is
the master's time per key (PutStart + PutEnd), and its ratio to the first count's in the same run
(one segment by default). Placement ranks the segments for each key (kvtier.master.placement):
done as a pass over all of them per key, the cost grew with the cluster; the master's
PlacementOrder (kvtier.master.placement_order) answers the first choice in O(log segments).
`--batch 1` shows a single-key put's cost.
Every key must be stored without evicting another (1 GiB per segment holds every default run):
more keys than the segments hold would make this an eviction benchmark, so they are refused.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

NS = "placement-bench"
VALUE_SIZE = 4096
SEGMENT_BYTES = 1 << 30


def too_many_keys(counts: list[int], keys: int) -> bool:
    """Whether `keys` values would not all fit in the fewest segments without eviction."""
    return keys * VALUE_SIZE > min(counts) * SEGMENT_BYTES


DEFAULT_SEGMENTS = (1, 8, 64, 256, 1024)


@dataclass
class PlacementRow:
    segments: int
    keys: int
    us_per_key: float  # PutStart + PutEnd, the master's own time
    keys_per_s: float
    vs_first: float  # us_per_key over the first row's (1.0 for that row; one segment by default)
    segments_used: int  # segments that got at least one key: placement spread the load


def run_placement_bench(counts: list[int], batch: int, keys: int) -> list[PlacementRow]:
    if too_many_keys(counts, keys):
        raise ValueError(f"{keys} keys of {VALUE_SIZE} B do not fit in {min(counts)} segment(s) without eviction")
    rows: list[PlacementRow] = []
    _put_all(counts[0], batch, batch * 20)  # warm up: the first timed row must not pay for imports and caches
    for count in counts:
        seconds, done, used = _put_all(count, batch, keys)
        us = seconds / done * 1e6
        first = rows[0].us_per_key if rows else us
        rows.append(PlacementRow(count, done, us, done / seconds, us / first, used))
    return rows


def _put_all(count: int, batch: int, keys: int) -> tuple[float, int, int]:
    """(seconds, keys put, segments used) for `keys` keys over `count` fresh segments."""
    from kvtier.master.config import MasterConfig
    from kvtier.master.state import MasterState, PutOptions

    state = MasterState(MasterConfig(cluster_id="placement-bench", segment_ttl_s=3600.0))
    state.sweep_inline = False
    for i in range(count):
        state.mount_segment("placement-bench", f"s{i}", f"host-{i}", [f"tcp://127.0.0.1:9/s{i}"], SEGMENT_BYTES)
    used: set[int] = set()
    batches = keys // batch
    options = PutOptions()
    started_at = time.perf_counter()
    for b in range(batches):
        names = [f"k{b}/{j}" for j in range(batch)]
        started = state.put_start(NS, names, [VALUE_SIZE] * batch, 1, options)
        if any(started.statuses):
            raise RuntimeError(f"PutStart refused keys with {count} segments: {started.first_error}")
        if any(state.put_end(NS, names, [1] * batch, started.put_id)):
            raise RuntimeError(f"PutEnd refused keys with {count} segments")
        used.update(started.replica_segments)
    return time.perf_counter() - started_at, batches * batch, len(used)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master-placement", action="store_true", help="the master's PutStart+PutEnd time per key as segments multiply"
    )
    parser.add_argument(
        "--placement-segments",
        default=",".join(map(str, DEFAULT_SEGMENTS)),
        help="--master-placement: comma list of segment counts (default: %(default)s)",
    )
    parser.add_argument("--placement-keys", type=int, default=9600, help="--master-placement: keys per count")


def print_placement_result(rows: list[PlacementRow], batch: int, as_json: bool, machine: dict) -> None:
    import json

    if as_json:
        print(json.dumps({"machine": machine, "master_placement": [asdict(r) for r in rows]}, indent=2))
        return
    print(f"kvtier bench --master-placement: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}")
    print(f"in process, {batch}-key batches of {VALUE_SIZE} B, PutStart + PutEnd per key")
    print(f"  {'segments':>8} {'keys':>7} {'us/key':>8} {'keys/s':>9} {'vs first':>9} {'segments used':>13}")
    for r in rows:
        print(
            f"  {r.segments:>8} {r.keys:>7} {r.us_per_key:>8.1f} {r.keys_per_s:>9,.0f} "
            f"{r.vs_first:>8.2f}x {r.segments_used:>13}"
        )
