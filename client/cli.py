"""`kvtier`: the operator's and developer's command line.

    kvtier up [--listen ADDR] [--dram SIZE] [--segments N]   local cluster in the foreground
    kvtier status [--master ADDR] [--json]                   segments, capacity, used, objects
    kvtier quotas [--master ADDR] [--json]                   per-rank quota, used, objects
    kvtier drain SEGMENT [--master ADDR] [--json]            move a segment's objects away, unmount it
    kvtier put KEY FILE|-                                    store a file (or stdin)
    kvtier get KEY [-o FILE]                                 fetch to a file (or stdout)
    kvtier bench [--master ADDR] ...                         throughput and latency

The master address comes from `--master`, else `KVTIER_MASTER`, else
127.0.0.1:50051. Invalid arguments print one line and exit with status 2;
a miss or a failed operation exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from kvtier.proto.errors import KvtierError
from kvtier.proto.units import format_size, parse_hostport, parse_size

DEFAULT_MASTER = "127.0.0.1:50051"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _address(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_master(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master",
        type=_address,
        default=os.environ.get("KVTIER_MASTER", DEFAULT_MASTER),
        help=f"master address (default: $KVTIER_MASTER or {DEFAULT_MASTER})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="kvtier: a distributed, tiered KV-cache store.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="run a local master and segment server in the foreground")
    up.add_argument("--listen", type=_address, default=DEFAULT_MASTER, help="master address (default: %(default)s)")
    up.add_argument("--dram", type=_size, default="1GiB", help="DRAM per segment (default: %(default)s)")
    up.add_argument("--segments", type=_positive_int, default=1, help="segment servers (default: %(default)s)")
    up.add_argument("--cluster-id", default="default")
    up.add_argument("--log-level", default="WARNING")
    up.add_argument("--ssd", type=_size, default="1GiB", help="SSD tier per segment, 0 = none (default: %(default)s)")
    up.add_argument(
        "--ssd-dir", default=".kvtier/ssd", help="where SSD tiers keep their bucket files (default: %(default)s)"
    )

    status = sub.add_parser("status", help="segments, capacity, usage and object count")
    _add_master(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    quotas = sub.add_parser("quotas", help="per instance and rank: quota, used, objects")
    _add_master(quotas)
    quotas.add_argument("--json", action="store_true", help="machine-readable output")

    drain = sub.add_parser("drain", help="move a segment's objects elsewhere, then unmount it")
    _add_master(drain)
    drain.add_argument("segment", help="segment name (see kvtier status)")
    drain.add_argument("--batch", type=_positive_int, default=256, help="objects per migration batch")
    drain.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up on the rest")
    drain.add_argument("--json", action="store_true", help="machine-readable summary")

    put = sub.add_parser("put", help="store a file's bytes (or stdin with '-') under KEY")
    _add_master(put)
    put.add_argument("--namespace", default="default")
    put.add_argument("--replicas", type=_positive_int, default=1)
    put.add_argument("key")
    put.add_argument("file", help="path, or - for standard input")

    get = sub.add_parser("get", help="fetch KEY's bytes to a file or standard output")
    _add_master(get)
    get.add_argument("--namespace", default="default")
    get.add_argument("key")
    get.add_argument("-o", "--output", default="-", help="path, or - for standard output (default)")

    bench = sub.add_parser("bench", help="measure put/get throughput and latency")
    from kvtier.bench.run import add_arguments

    add_arguments(bench)
    return parser


def _status_dict(reply: Any) -> dict[str, Any]:
    from kvtier.client.client import quota_dict

    return {
        "cluster_id": reply.cluster_id,
        "master_epoch": reply.master_epoch,
        "epoch": reply.epoch,
        "role": reply.role,
        "leader": reply.leader,
        "recovery": dict(reply.recovery),
        "uptime_s": round(reply.uptime_s, 3),
        "objects": reply.objects,
        "pending_puts": reply.pending_puts,
        "rpc_requests": dict(reply.rpc_requests),
        "quotas": [quota_dict(q) for q in reply.quotas],
        "evictions": {e.reason: {"objects": e.objects, "bytes": e.bytes} for e in reply.evictions},
        "capacity": reply.capacity,
        "used": reply.used,
        "tiering": dict(reply.tiering),
        "segments": [
            {
                "segment_id": s.segment_id,
                "name": s.name,
                "endpoints": list(s.endpoints),
                "state": s.state,
                "dram_capacity": s.dram_capacity,
                "dram_used": s.dram_used,
                "objects": s.objects,
                "heartbeat_age_ms": s.heartbeat_age_ms,
                "ssd_capacity": s.ssd_capacity,
                "ssd_used": s.ssd_used,
                "ssd_objects": s.ssd_objects,
                "disk_engine": s.disk_engine,
                "offload": s.offload,
                "dram_bytes_served": s.dram_bytes_served,
                "ssd_bytes_served": s.ssd_bytes_served,
                "disk_bytes_read": s.disk_bytes_read,
                "ssd_bytes_offloaded": s.ssd_bytes_offloaded,
            }
            for s in reply.segments
        ],
    }


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def cmd_status(opts: argparse.Namespace) -> int:
    from kvtier.client import Client

    with Client(opts.master, timeout=5.0) as client:
        data = _status_dict(client.cluster_status())
    if opts.json:
        print(json.dumps(data, indent=2))
        return 0
    used_pct = 100 * data["used"] / data["capacity"] if data["capacity"] else 0.0
    print(
        f"cluster {data['cluster_id']}  master {opts.master}  epoch {data['master_epoch']}  "
        f"objects {data['objects']}  used {format_size(data['used'])} / {format_size(data['capacity'])} "
        f"({used_pct:.1f}%)"
    )
    recovery = data["recovery"]
    if data["role"] != "leader" or recovery.get("segments_expected"):
        leader = f"  leader {data['leader']}" if data["leader"] else ""
        print(
            f"role {data['role']}{leader}  recovery: {int(recovery.get('segments_reported', 0))} of "
            f"{int(recovery.get('segments_expected', 0))} expected segments, "
            f"{int(recovery.get('objects', 0))} objects rebuilt in {recovery.get('seconds', 0.0):.2f}s"
        )
    rows = [
        ["ID", "NAME", "STATE", "CAPACITY", "USED", "OBJECTS", "SSD", "SSD USED", "SSD OBJ", "HEARTBEAT", "ENDPOINTS"]
    ]
    for s in data["segments"]:
        ssd = s.get("ssd_capacity", 0)
        rows.append(
            [
                str(s["segment_id"]),
                s["name"],
                s["state"],
                format_size(s["dram_capacity"]),
                format_size(s["dram_used"]),
                str(s["objects"]),
                f"{format_size(ssd)} ({s.get('disk_engine', '')})" if ssd else "-",
                format_size(s.get("ssd_used", 0)) if ssd else "-",
                str(s.get("ssd_objects", 0)) if ssd else "-",
                f"{s['heartbeat_age_ms']}ms",
                ",".join(s["endpoints"]),
            ]
        )
    _print_table(rows)
    return 0


def cmd_quotas(opts: argparse.Namespace) -> int:
    from kvtier.client import Client

    with Client(opts.master, timeout=5.0) as client:
        quotas = client.quotas()
    if opts.json:
        print(json.dumps(quotas, indent=2))
        return 0
    rows = [["INSTANCE", "RANK", "TPxPP", "QUOTA", "USED", "USED%", "OBJECTS"]]
    for q in quotas:
        share = f"{100 * q['used'] / q['quota']:.1f}%" if q["quota"] else "-"
        rows.append(
            [
                q["instance"],
                str(q["rank"]),
                f"{q['tp_size']}x{q['pp_size']}" if q["tp_size"] else "-",
                format_size(q["quota"]) if q["quota"] else "none",
                format_size(q["used"]),
                share,
                str(q["objects"]),
            ]
        )
    if len(rows) == 1:
        print("no instance has stored objects or registered")
        return 0
    _print_table(rows)
    return 0


def cmd_drain(opts: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvtier.client import Client
    from kvtier.client.drain import drain_segment

    def progress(report, left: int) -> None:
        if not opts.json:
            print(
                f"drain {opts.segment}: moved {report.moved} ({format_size(report.moved_bytes)}), "
                f"{left} left, {report.failed} failed, {report.no_space} without room",
                file=sys.stderr,
                flush=True,
            )

    with Client(opts.master, timeout=30.0) as client:
        report = drain_segment(client, opts.segment, batch=opts.batch, timeout=opts.timeout, progress=progress)
    if opts.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(
            f"segment {opts.segment} {report.state.lower()}: moved {report.moved} objects "
            f"({format_size(report.moved_bytes)}), dropped {report.dropped}"
        )
    return 0


def cmd_put(opts: argparse.Namespace) -> int:
    from kvtier.client import Client

    if opts.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(opts.file, "rb") as f:
                data = f.read()
        except OSError as exc:
            print(f"kvtier put: cannot read {opts.file}: {exc.strerror}", file=sys.stderr)
            return 2
    with Client(opts.master, namespace=opts.namespace) as client:
        client.put(opts.key, data, replicas=opts.replicas)
    print(f"stored {opts.key} ({len(data)} bytes)", file=sys.stderr)
    return 0


def cmd_get(opts: argparse.Namespace) -> int:
    from kvtier.client import Client

    with Client(opts.master, namespace=opts.namespace) as client:
        data = client.get(opts.key)
    if data is None:
        print(f"kvtier get: {opts.key}: not found", file=sys.stderr)
        return 1
    if opts.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        with open(opts.output, "wb") as f:
            f.write(data)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(opts: argparse.Namespace) -> int:
    from kvtier.client.local_cluster import LocalCluster

    # Explicit handlers: SIGINT may be inherited as ignored (background jobs), and
    # service managers stop us with SIGTERM; both must stop the children cleanly.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)

    cluster = LocalCluster(
        listen=opts.listen,
        dram=opts.dram,
        segments=opts.segments,
        cluster_id=opts.cluster_id,
        log_level=opts.log_level,
        ssd=opts.ssd,
        ssd_dir=os.path.abspath(opts.ssd_dir),
    )
    try:
        cluster.start()
    except RuntimeError as exc:
        print(f"kvtier up: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    try:
        print(f"kvtier up: master {cluster.master_address} (cluster {opts.cluster_id})", flush=True)
        for child in cluster.children[1:]:
            ssd = f" ssd={opts.ssd} in {opts.ssd_dir}" if opts.ssd not in ("0", "") else ""
            print(f"kvtier up: segment {child.info['name']} {', '.join(child.info['endpoints'])} dram={opts.dram}{ssd}")
        print(f"kvtier up: try `kvtier status --master {cluster.master_address}`; Ctrl-C stops", flush=True)
        code = cluster.wait()
    finally:
        cluster.stop()
    print("kvtier up: stopped", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    commands = {
        "up": cmd_up,
        "status": cmd_status,
        "quotas": cmd_quotas,
        "drain": cmd_drain,
        "put": cmd_put,
        "get": cmd_get,
    }
    try:
        if opts.command == "bench":
            from kvtier.bench.run import run

            return run(opts)
        return commands[opts.command](opts)
    except KvtierError as exc:
        print(f"kvtier {opts.command}: {exc}", file=sys.stderr)
        return 2 if exc.status.name == "INVALID_KEY" else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvtier status --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
