"""`kvtier`: the operator's and developer's command line (this module parses and dispatches).

    kvtier up [--listen ADDR] [--dram SIZE] [--segments N]   local cluster in the foreground
    kvtier status [--json]                                   cluster summary and segments
    kvtier segments [--json]                                 per segment: DRAM, SSD, heartbeat, bytes served
    kvtier quotas [--json]                                   per instance and rank: quota, used, objects
    kvtier keys [--prefix P] [--limit N] [--start-after K] [--namespace NS] [--json]
                                                             keys in key order, size, state, tiers, pin
    kvtier stat KEY [--namespace NS] [--json]                one object: replicas, size, tiers, lease, pin
    kvtier drain SEGMENT|--segment-config PATH [--cancel] [--json]
                                                             move a segment's objects away, unmount it
    kvtier replica remove|copy|move KEY SEGMENT [--namespace NS] [--json]
                                                             one replica of a key: drop, add a verified copy, move
    kvtier evict --prefix P [--namespace NS] [--include-pinned] [--dry-run] [--json]
                                                             remove the objects under a prefix, page by page
    kvtier top [--interval S] [--iterations N] [--json]      live throughput, hit ratios per tier, capacity
    kvtier events [--prefix P] [--since N --epoch E] [--kinds stored,removed] [--namespace NS] [--json]
                                                             follow stored/removed/evicted/tier events
    kvtier put KEY FILE|-                                    store a file (or stdin)
    kvtier get KEY [-o FILE]                                 fetch to a file (or stdout)
    kvtier bench [--master ADDR] ...                         throughput and latency

Every command but `up` takes `--master`: from the flag, else `KVTIER_MASTER`,
else 127.0.0.1:50051. The ops commands live in kvtier.cli.ops and
kvtier.cli.top; README.md, "Operating with the kvtier CLI", documents
their flags and JSON fields. `--json` output goes to stdout alone; progress
of drain, evict and bench goes to stderr. Invalid arguments print one line
and exit with status 2; a miss or a failed operation exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from collections.abc import Callable

from kvtier.common.units import check_master_spec, parse_hostport, parse_size
from kvtier.proto.errors import KvtierError

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


def _master_spec(text: str) -> str:
    """`--master`: HOST:PORT, a comma list of them, or etcd://HOST:PORT[,...]/CLUSTER (HA)."""
    try:
        return check_master_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _page_size(text: str) -> int:
    """Keys per ListKeys page: 1 to MAX_PAGE (what the master serves in one page)."""
    from kvtier.client.keys import MAX_PAGE

    value = _positive_int(text)
    if value > MAX_PAGE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PAGE}, got {value}")
    return value


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0.1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be at least 0.1, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _add_master(parser: argparse.ArgumentParser, json_help: str = "machine-readable output") -> None:
    parser.add_argument(
        "--master",
        type=_master_spec,
        default=os.environ.get("KVTIER_MASTER", DEFAULT_MASTER),
        help=f"master address (default: $KVTIER_MASTER or {DEFAULT_MASTER})",
    )
    if json_help:
        parser.add_argument("--json", action="store_true", help=json_help)


def _add_namespace(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default="default", help="the keys' namespace (default: %(default)s)")


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
    up.add_argument(
        "--state-dir",
        default="",
        help="where the master saves its state, so a restart loses nothing; none = save nothing "
        "(default: .kvtier/state/CLUSTER_ID)",
    )

    _add_master(sub.add_parser("status", help="cluster summary: role, capacity, objects, segments"))
    _add_master(sub.add_parser("segments", help="per segment: DRAM and SSD capacity and use, heartbeat, bytes served"))
    _add_master(sub.add_parser("quotas", help="per instance and rank: quota, used, objects"))

    keys = sub.add_parser("keys", help="list keys under a prefix, in key order, with size, state, tiers and pin")
    _add_master(keys)
    _add_namespace(keys)
    keys.add_argument("--prefix", default="", help="only keys starting with this (default: every key)")
    keys.add_argument("--limit", type=_count, default=1000, help="at most this many keys, 0 = all (default: 1000)")
    keys.add_argument("--start-after", default="", help="only keys after this one: resume an earlier listing")
    keys.add_argument("--page-size", type=_page_size, default=1000, help="keys per request (at most 10000)")
    keys.add_argument("--pending", action="store_true", help="also list puts not finished yet")

    stat = sub.add_parser("stat", help="one object: size, checksum, replicas and tiers, lease, pin, owner")
    _add_master(stat)
    _add_namespace(stat)
    stat.add_argument("key")

    drain = sub.add_parser("drain", help="move a segment's objects elsewhere, then unmount it")
    _add_master(drain, json_help="machine-readable summary")
    drain.add_argument("segment", nargs="?", default="", help="segment name (see kvtier segments)")
    drain.add_argument(
        "--segment-config",
        metavar="PATH",
        default="",
        help="drain the segment this config (and KVTIER_SEGMENT_* variables) runs, at its master, with its "
        "secret and TLS files: what a unit's ExecStop or a pod's preStop runs",
    )
    drain.add_argument("--batch", type=_positive_int, default=256, help="objects per migration batch")
    drain.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up on the rest")
    drain.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds in which no object moved (no room elsewhere, copies failing) before giving up on the rest; "
        "until then they are tried again (a target's DRAM frees up as it offloads to its SSD, once the copies "
        "it just took are out of their migration lease, the master's lease_s)",
    )
    drain.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    drain.add_argument(
        "--cancel",
        action="store_true",
        help="stop draining the segment (a drain interrupted, or not wanted any more): it takes new objects "
        "again, and mounts ACTIVE when it restarts; objects already moved stay moved",
    )

    from kvtier.cli.replica import add_parser as add_replica_parser

    add_replica_parser(sub, _add_master, _add_namespace)

    evict = sub.add_parser("evict", help="remove the objects under a prefix from the cache, page by page")
    _add_master(evict, json_help="machine-readable summary")
    _add_namespace(evict)
    evict.add_argument("--prefix", required=True, help="keys starting with this ('' = the whole namespace)")
    evict.add_argument("--page-size", type=_page_size, default=10000, help="keys per page (at most 10000)")
    evict.add_argument("--include-pinned", action="store_true", help="remove hard- and soft-pinned objects too")
    evict.add_argument("--dry-run", action="store_true", help="count what would be removed, remove nothing")
    evict.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")

    top = sub.add_parser("top", help="live view: throughput, hit ratios per tier, capacity")
    _add_master(top, json_help="one JSON object per refresh (JSON lines)")
    top.add_argument("--interval", type=_interval, default=2.0, help="seconds between refreshes (default: 2)")
    top.add_argument("--iterations", type=_count, default=0, help="stop after N refreshes (default: 0 = Ctrl-C)")

    events = sub.add_parser("events", help="follow objects stored, removed, evicted, moved between tiers")
    _add_master(events, json_help="one JSON object per event (JSON lines)")
    _add_namespace(events)
    from kvtier.cli.events import add_arguments as add_event_arguments

    add_event_arguments(events)

    put = sub.add_parser("put", help="store a file's bytes (or stdin with '-') under KEY")
    _add_master(put, json_help="")
    _add_namespace(put)
    put.add_argument("--replicas", type=_positive_int, default=1)
    put.add_argument(
        "--upsert", action="store_true", help="replace KEY's value if it has one (a put keeps the first value)"
    )
    put.add_argument("key")
    put.add_argument("file", help="path, or - for standard input")

    get = sub.add_parser("get", help="fetch KEY's bytes to a file or standard output")
    _add_master(get, json_help="")
    _add_namespace(get)
    get.add_argument("key")
    get.add_argument("-o", "--output", default="-", help="path, or - for standard output (default)")

    bench = sub.add_parser("bench", help="measure put/get throughput and latency")
    from kvtier.bench.run import add_arguments

    add_arguments(bench)
    return parser


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
        if opts.upsert:
            client.upsert(opts.key, data, replicas=opts.replicas)
        else:
            existed = client.exists(opts.key)
            client.put(opts.key, data, replicas=opts.replicas)
            if existed:  # first writer wins: the value stays as it was
                print(f"{opts.key} is stored already: kept as it was (--upsert replaces it)", file=sys.stderr)
                return 0
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
        try:
            with open(opts.output, "wb") as f:
                f.write(data)
        except OSError as exc:
            print(f"kvtier get: cannot write {opts.output}: {exc.strerror}: change -o", file=sys.stderr)
            return 2
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _up_state_dir(state_dir: str, cluster_id: str) -> str:
    if state_dir == "none":
        return state_dir
    return os.path.abspath(state_dir or os.path.join(".kvtier", "state", cluster_id))


def cmd_up(opts: argparse.Namespace) -> int:
    from kvtier.common.local_cluster import LocalCluster, StartupFailed

    # Explicit handlers: SIGINT may be inherited as ignored (background jobs), and
    # service managers stop us with SIGTERM; both must stop the children cleanly.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)

    if opts.ssd not in ("0", "") and os.path.exists(opts.ssd_dir) and not os.path.isdir(opts.ssd_dir):
        print(f"kvtier up: {opts.ssd_dir} is not a directory: change --ssd-dir", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        listen=opts.listen,
        dram=opts.dram,
        segments=opts.segments,
        cluster_id=opts.cluster_id,
        log_level=opts.log_level,
        ssd=opts.ssd,
        ssd_dir=os.path.abspath(opts.ssd_dir),
        state_dir=_up_state_dir(opts.state_dir, opts.cluster_id),
    )
    try:
        cluster.start()
    except StartupFailed as exc:  # the server printed its one line (cause and option): add none
        cluster.stop()
        return exc.returncode
    except RuntimeError as exc:
        print(f"kvtier up: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    except OSError as exc:  # the SSD directory cannot be made (a file in its path)
        print(f"kvtier up: cannot create {exc.filename}: {exc.strerror}: change --ssd-dir", file=sys.stderr)
        cluster.stop()
        return 2
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


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    from kvtier.cli import ops as ops_cli
    from kvtier.cli.events import cmd_events
    from kvtier.cli.replica import cmd_replica
    from kvtier.cli.top import run_top

    return {
        "up": cmd_up,
        "status": ops_cli.cmd_status,
        "segments": ops_cli.cmd_segments,
        "quotas": ops_cli.cmd_quotas,
        "keys": ops_cli.cmd_keys,
        "stat": ops_cli.cmd_stat,
        "drain": ops_cli.cmd_drain,
        "evict": ops_cli.cmd_evict,
        "replica": cmd_replica,
        "top": run_top,
        "events": cmd_events,
        "put": cmd_put,
        "get": cmd_get,
    }


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        if opts.command == "bench":
            from kvtier.bench.run import run

            return run(opts)
        return _commands()[opts.command](opts)
    except KvtierError as exc:
        print(f"kvtier {opts.command}: {exc}", file=sys.stderr)
        return 2 if exc.status.name == "INVALID_KEY" else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvtier status --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        # Free what a command left in reference cycles while gRPC's threads still run: a gRPC call
        # object first collected at interpreter exit waits in its finalizer for a lock that a
        # frozen gRPC daemon thread may hold, and the process never exits (seen with `events`).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
