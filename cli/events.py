"""`kvtier events`: follow the master's event stream (WatchEvents; docs/events.md), one line per
event (JSON lines with --json), until Ctrl-C. When the master ends the stream (cut for being slow,
events missed, refused) it says why on stderr and exits 1; --json also prints a last line
{"end": STATUS, "error": ..., "epoch": E, "last_seq": N} on stdout, so a script can resume with
`--since N+1 --epoch E`."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from kvtier.client.events import KIND_VALUES, Event, WatchEnded

KIND_NAMES = sorted(KIND_VALUES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", default="", help="only keys starting with this (default: every key)")
    parser.add_argument(
        "--all-namespaces", action="store_true", help="every namespace's events (cluster credentials only)"
    )
    parser.add_argument(
        "--since", type=int, default=0, help="resume: every event from this seq on still held (needs --epoch)"
    )
    parser.add_argument("--epoch", type=int, default=0, help="the master epoch --since counts in (in every event)")
    parser.add_argument(
        "--kinds", type=_kinds, default=None, help=f"comma-separated, of {','.join(KIND_NAMES)} (default: all)"
    )


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KIND_VALUES]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind {unknown[0] if unknown else text!r}; one of {KIND_NAMES}")
    return kinds


def _line(event: Event) -> str:
    at = datetime.datetime.fromtimestamp(event.time, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
    where = ",".join(f"{t}@{s}" if s else t for t, s in zip(event.tiers, event.segments, strict=True)) or "-"
    return (
        f"{event.seq} {at} {event.kind.upper():<12} {event.namespace}/{event.key} size={event.size} "
        f"copies={where} reason={event.reason}"
    )


def cmd_events(opts: argparse.Namespace) -> int:
    from kvtier.client import Client

    if opts.since < 0 or opts.epoch < 0 or (opts.since and not opts.epoch):
        print("kvtier events: --since N needs --epoch E (both from an earlier event)", file=sys.stderr)
        return 2
    with Client(opts.master, namespace=opts.namespace) as client:
        stream = client.watch_events(
            opts.prefix, opts.since, opts.kinds, epoch=opts.epoch, all_namespaces=opts.all_namespaces
        )
        try:
            for event in stream:
                print(json.dumps(event.to_dict()) if opts.json else _line(event), flush=True)
        except WatchEnded as exc:
            if opts.json:
                end = {"end": exc.status.name, "error": exc.message, "epoch": stream.epoch, "last_seq": stream.last_seq}
                print(json.dumps(end), flush=True)
            print(f"kvtier events: stream ended: {exc}", file=sys.stderr)
            return 1
        finally:
            stream.close()
    return 0
