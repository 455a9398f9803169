"""`kvtier replica remove|copy|move KEY SEGMENT`: one key's replicas, by the operator (issue 21).

    kvtier replica copy KEY SEGMENT [--source SEG] [--namespace NS] [--json]
    kvtier replica move KEY SEGMENT [--source SEG] [--namespace NS] [--json]
    kvtier replica remove KEY SEGMENT [--allow-last] [--namespace NS] [--json]

SEGMENT is the name `kvtier status` shows. copy/move read a DRAM replica over the data plane,
verify it against the object's checksum and write it to SEGMENT (kvtier.client.replicas); the
master only records. remove refuses the key's last complete replica (LAST_REPLICA) unless
--allow-last. Exit status 0 when the operation was done, 1 with the status on stderr when not.
`--json` prints {"operation", "namespace", "key", "segment", "status", "replicas"} on stdout
(`replicas`: the key's replicas afterwards, each {"segment", "tier"}), whatever the outcome.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.ops import _client, show_key

_DONE = {"copy": "copied", "move": "moved", "remove": "removed"}
_WHY = {
    "LAST_REPLICA": "it is the key's last complete replica (--allow-last removes the object)",
    "REPLICA_EXISTS": "the segment already holds a replica of it",
    "REPLICA_NOT_FOUND": "no replica of it there (copy and move read a DRAM replica)",
    "SEGMENT_NOT_FOUND": "no segment of that name (see kvtier status)",
    "INVALID_ARGUMENT": "the segment takes no new replicas (draining)",
    "NOT_FOUND": "no complete object under this key",
    "PUT_IN_PROGRESS": "a put, copy, move or drain of it is in flight; try again",
    "NO_SPACE": "no room on the segment",
    "CHECKSUM_MISMATCH": "the source replica's bytes do not match the checksum: nothing copied",
}


def add_parser(sub: argparse._SubParsersAction, add_master, add_namespace) -> None:
    replica = sub.add_parser("replica", help="remove, copy or move one replica of a key")
    ops = replica.add_subparsers(dest="operation", required=True, parser_class=type(replica))
    for name, text in (
        ("copy", "add a verified replica of KEY on SEGMENT"),
        ("move", "copy a replica of KEY to SEGMENT, then drop the one it came from"),
        ("remove", "drop the replicas SEGMENT holds of KEY"),
    ):
        op = ops.add_parser(name, help=text)
        add_master(op)
        add_namespace(op)
        op.add_argument("key")
        op.add_argument("segment", help="segment name (see kvtier status)")
        if name == "remove":
            op.add_argument("--allow-last", action="store_true", help="remove the object with its last replica")
        else:
            op.add_argument("--source", default="", help="the segment to read from (default: any DRAM replica)")


def cmd_replica(opts: argparse.Namespace) -> int:
    with _client(opts) as client:
        if opts.operation == "remove":
            status = client.remove_replica(opts.key, opts.segment, allow_last=opts.allow_last)
        elif opts.operation == "copy":
            status = client.copy_replica(opts.key, opts.segment, source=opts.source)
        else:
            status = client.move_replica(opts.key, opts.segment, source=opts.source)
        info = client.stat(opts.key)
    replicas = [{"segment": r.segment, "tier": r.tier} for r in info.replicas] if info else []
    if opts.json:
        fields = {"operation": opts.operation, "namespace": opts.namespace, "key": opts.key}
        print(json.dumps({**fields, "segment": opts.segment, "status": status.name, "replicas": replicas}, indent=2))
    elif status == 0:
        where = ", ".join(f"{r['segment']} ({r['tier']})" for r in replicas) or "none (the object is gone)"
        print(f"{_DONE[opts.operation]} {show_key(opts.key)} on {opts.segment}: replicas now {where}")
    if status != 0:
        why = _WHY.get(status.name, "")
        print(
            f"kvtier replica {opts.operation}: {show_key(opts.key)} on {opts.segment}: {status.name}"
            + (f" ({why})" if why else ""),
            file=sys.stderr,
        )
        return 1
    return 0
