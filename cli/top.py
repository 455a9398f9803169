"""`kvtier top`: a live view of throughput, hit ratios per tier and capacity, from successive Status replies.

Every refresh compares two `Status` replies `--interval` seconds apart (the
first refresh comes one interval after start) and turns the counters into
rates per second:

- served bytes per tier: what segment servers sent over TCP from DRAM and
  from SSD (same-host `shm` reads bypass the servers and are not seen here),
  physical disk reads, and DRAM -> SSD offload bytes; the segments report
  them with their heartbeats, so a rate lags by up to one heartbeat;
- lookups (keys asked by Exists and GetReplicas) and hit ratios: `lookup` is
  hits / keys over both RPCs; `dram` and `ssd` split GetReplicas keys by where
  the reader goes: found with a DRAM copy, or found on SSD only (`dram + ssd`
  is GetReplicas' hit ratio), with the direct reads the segments served (small DRAM objects read at a
  remembered location, without the master) counted as DRAM reads that hit (a workload of repeated
  small reads showed as all-SSD without them). A ratio is null when there were no lookups;
- RPCs handled and failed, evictions, promotions;
- capacity and use per tier, cluster-wide and per segment.

A counter that went down (a restarted master or segment) counts from zero.
`frame(previous, current, seconds)` is pure: it builds one refresh's JSON
object from two `status_dict` snapshots.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any, TextIO

from kvtier.cli.ops import percent, print_table, status_dict
from kvtier.common.units import format_size

SEGMENT_COUNTERS = ("dram_bytes_served", "ssd_bytes_served", "disk_bytes_read", "ssd_bytes_offloaded")
_MASTER_COUNTER_MAPS = ("lookup_keys", "lookup_hits", "rpc_requests", "rpc_failures", "evictions")


def _delta(current: float, previous: float) -> float:
    return current - previous if current >= previous else current  # went down: restarted, count from 0


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def frame(previous: dict[str, Any], current: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One refresh: rates over `seconds` between two `status_dict` snapshots, and the current capacity."""
    seconds = max(seconds, 1e-6)
    if current.get("uptime_s", 0) < previous.get("uptime_s", 0):
        # Another master incarnation: all of its counters started again together (judging each on
        # its own would mix old and new counts in one ratio).
        previous = {**previous, **{name: {} for name in _MASTER_COUNTER_MAPS}, "lookup_hits_disk_only": 0}

    def rate(now: float, before: float) -> float:
        return round(_delta(now, before) / seconds, 3)

    def total(snapshot: dict[str, Any], name: str) -> int:
        return sum(snapshot[name].values())

    def get(snapshot: dict[str, Any], name: str, key: str) -> int:
        return snapshot[name].get(key, 0)

    def evicted(snapshot: dict[str, Any], field: str) -> int:
        return sum(counts[field] for counts in snapshot["evictions"].values())

    before_segments = {s["name"]: s for s in previous["segments"]}
    segments = []
    for s in current["segments"]:
        old = before_segments.get(s["name"])
        segments.append(
            {
                "name": s["name"],
                "state": s["state"],
                "dram_capacity": s["dram_capacity"],
                "dram_used": s["dram_used"],
                "ssd_capacity": s["ssd_capacity"],
                "ssd_used": s["ssd_used"],
                "objects": s["objects"],
                "ssd_objects": s["ssd_objects"],
                # a segment that was not there before: nothing to compare with yet
                "rates": {c: rate(s[c], old[c]) if old else 0.0 for c in SEGMENT_COUNTERS},
            }
        )
    get_keys = _delta(get(current, "lookup_keys", "GetReplicas"), get(previous, "lookup_keys", "GetReplicas"))
    get_hits = _delta(get(current, "lookup_hits", "GetReplicas"), get(previous, "lookup_hits", "GetReplicas"))
    disk_only = _delta(current["lookup_hits_disk_only"], previous["lookup_hits_disk_only"])
    lookup_keys = _delta(total(current, "lookup_keys"), total(previous, "lookup_keys"))
    lookup_hits = _delta(total(current, "lookup_hits"), total(previous, "lookup_hits"))
    # Direct reads served: DRAM hits no lookup saw (a segment new since the last refresh: from the next)
    direct = sum(
        _delta(s.get("direct_reads_served", 0), before_segments[s["name"]].get("direct_reads_served", 0))
        for s in current["segments"]
        if s["name"] in before_segments
    )
    rates = {c: round(sum(s["rates"][c] for s in segments), 3) for c in SEGMENT_COUNTERS}
    rates |= {
        "rpc_requests": rate(total(current, "rpc_requests"), total(previous, "rpc_requests")),
        "rpc_failures": rate(total(current, "rpc_failures"), total(previous, "rpc_failures")),
        "lookup_keys": round(lookup_keys / seconds, 3),
        "lookup_hits": round(lookup_hits / seconds, 3),
        "direct_reads": round(direct / seconds, 3),
        "evicted_objects": rate(evicted(current, "objects"), evicted(previous, "objects")),
        "evicted_bytes": rate(evicted(current, "bytes"), evicted(previous, "bytes")),
        "promoted_bytes": rate(get(current, "tiering", "promoted_bytes"), get(previous, "tiering", "promoted_bytes")),
    }
    rpcs = {
        name: rate(count, previous["rpc_requests"].get(name, 0))
        for name, count in sorted(current["rpc_requests"].items())
        if count != previous["rpc_requests"].get(name, 0)
    }
    ssd_capacity = sum(s["ssd_capacity"] for s in current["segments"])
    return {
        "time": round(time.time(), 3),
        "interval_s": round(seconds, 3),
        "cluster_id": current["cluster_id"],
        "role": current["role"],
        "epoch": current["epoch"],
        "objects": current["objects"],
        "pending_puts": current["pending_puts"],
        "capacity": {
            "dram": current["capacity"],
            "dram_used": current["used"],
            "ssd": ssd_capacity,
            "ssd_used": sum(s["ssd_used"] for s in current["segments"]),
        },
        "rates": rates,
        "hit_ratio": {
            "lookup": _ratio(lookup_hits, lookup_keys),
            "dram": _ratio(get_hits - disk_only + direct, get_keys + direct),
            "ssd": _ratio(disk_only, get_keys + direct),
        },
        "rpcs": rpcs,
        "segments": segments,
    }


def _per_s(value: float) -> str:
    return f"{format_size(int(value))}/s"


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# Plain (non-terminal) output: one fixed-width row per refresh under one header, like vmstat.
_COLUMNS = (
    ("TIME", 8),
    ("OBJECTS", 9),
    ("DRAM USED", 10),
    ("DRAM%", 6),
    ("SSD USED", 10),
    ("LOOKUPS/s", 10),
    ("HIT%", 6),
    ("DRAM HIT%", 9),
    ("SSD HIT%", 8),
    ("SERVED DRAM/s", 13),
    ("SERVED SSD/s", 13),
    ("DISK READ/s", 13),
    ("OFFLOAD/s", 13),
    ("RPC/s", 9),
)


def _row(cells: list[str]) -> str:
    return "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _COLUMNS, strict=True)).rstrip()


def plain_row(f: dict[str, Any]) -> str:
    rates, capacity, hits = f["rates"], f["capacity"], f["hit_ratio"]
    return _row(
        [
            time.strftime("%H:%M:%S", time.localtime(f["time"])),
            str(f["objects"]),
            format_size(capacity["dram_used"]),
            percent(capacity["dram_used"], capacity["dram"]),
            format_size(capacity["ssd_used"]) if capacity["ssd"] else "-",
            f"{rates['lookup_keys']:.0f}",
            _ratio_text(hits["lookup"]),
            _ratio_text(hits["dram"]),
            _ratio_text(hits["ssd"]),
            _per_s(rates["dram_bytes_served"]),
            _per_s(rates["ssd_bytes_served"]),
            _per_s(rates["disk_bytes_read"]),
            _per_s(rates["ssd_bytes_offloaded"]),
            f"{rates['rpc_requests']:.0f}",
        ]
    )


def screen(f: dict[str, Any], master: str, out: TextIO) -> None:
    """The terminal view: a summary, then one row per segment."""
    rates, capacity, hits = f["rates"], f["capacity"], f["hit_ratio"]
    ssd = (
        f"  SSD {format_size(capacity['ssd_used'])} / {format_size(capacity['ssd'])} "
        f"({percent(capacity['ssd_used'], capacity['ssd'])})"
        if capacity["ssd"]
        else ""
    )
    print(
        f"kvtier top  cluster {f['cluster_id']}  master {master}  {f['role']}  epoch {f['epoch']}  "
        f"every {f['interval_s']:.1f}s  {time.strftime('%H:%M:%S', time.localtime(f['time']))}  (Ctrl-C quits)",
        file=out,
    )
    print(
        f"objects {f['objects']} ({f['pending_puts']} pending)  DRAM {format_size(capacity['dram_used'])} / "
        f"{format_size(capacity['dram'])} ({percent(capacity['dram_used'], capacity['dram'])}){ssd}",
        file=out,
    )
    print(
        f"served  dram {_per_s(rates['dram_bytes_served'])}  ssd {_per_s(rates['ssd_bytes_served'])}  "
        f"disk read {_per_s(rates['disk_bytes_read'])}  offload {_per_s(rates['ssd_bytes_offloaded'])}  "
        f"promote {_per_s(rates['promoted_bytes'])}",
        file=out,
    )
    print(
        f"lookups {rates['lookup_keys']:.0f}/s  hit {_ratio_text(hits['lookup'])}  dram {_ratio_text(hits['dram'])}  "
        f"ssd {_ratio_text(hits['ssd'])}  rpc {rates['rpc_requests']:.0f}/s  failed {rates['rpc_failures']:.0f}/s  "
        f"evicted {rates['evicted_objects']:.0f}/s ({_per_s(rates['evicted_bytes'])})",
        file=out,
    )
    print(file=out)
    rows = [["SEGMENT", "STATE", "DRAM USED", "DRAM%", "SSD USED", "SSD%", "SERVED DRAM/s", "SERVED SSD/s",
             "DISK READ/s", "OFFLOAD/s"]]  # fmt: skip
    for s in f["segments"]:
        r = s["rates"]
        rows.append(
            [
                s["name"],
                s["state"],
                format_size(s["dram_used"]),
                percent(s["dram_used"], s["dram_capacity"]),
                format_size(s["ssd_used"]) if s["ssd_capacity"] else "-",
                percent(s["ssd_used"], s["ssd_capacity"]),
                _per_s(r["dram_bytes_served"]),
                _per_s(r["ssd_bytes_served"]),
                _per_s(r["disk_bytes_read"]),
                _per_s(r["ssd_bytes_offloaded"]),
            ]
        )
    print_table(rows, out)


def run_top(opts: argparse.Namespace, out: TextIO | None = None) -> int:
    """Refresh every `opts.interval` seconds, `opts.iterations` times (0 = until Ctrl-C, which exits 0)."""
    from kvtier.client import Client

    out = out or sys.stdout
    tty = out.isatty() and not opts.json
    # Ctrl-C sets a flag instead of raising KeyboardInterrupt wherever the main thread happens to be:
    # raised inside a gRPC call, it could leave the client's channel or locks half-used, and closing
    # the client then hung (seen: `kvtier top` still running 30 s after SIGINT). The refresh in flight
    # finishes (bounded by the client's timeout) and the loop ends.
    stop = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: stop.set()) if in_main_thread else None
    try:
        with Client(opts.master, timeout=5.0) as client:
            previous, taken = status_dict(client.cluster_status()), time.monotonic()
            if tty:
                print(f"kvtier top: first refresh in {opts.interval:g}s (Ctrl-C quits)", file=out, flush=True)
            shown = 0
            while not opts.iterations or shown < opts.iterations:
                if stop.wait(max(0.0, taken + opts.interval - time.monotonic())):
                    break
                current, now = status_dict(client.cluster_status()), time.monotonic()
                if stop.is_set():
                    break
                refresh = frame(previous, current, now - taken)
                if opts.json:
                    print(json.dumps(refresh), file=out, flush=True)
                elif tty:
                    out.write("\x1b[H\x1b[2J")  # home, clear: redraw in place
                    screen(refresh, opts.master, out)
                    out.flush()
                else:
                    if not shown:
                        print(_row([name for name, _ in _COLUMNS]), file=out)
                    print(plain_row(refresh), file=out, flush=True)
                previous, taken = current, now
                shown += 1
    except KeyboardInterrupt:  # before the handler was installed, or outside the main thread
        pass
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    return 0
