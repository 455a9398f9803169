"""`kvtier events`: follow the master's event stream (WatchEvents; docs/events.md), one line per
event (JSON lines with --json), until Ctrl-C (exit 0). When the master ends the stream (cut for being slow,
events missed, refused) it says why on stderr and exits 1; --json also prints a last line
{"end": STATUS, "error": ..., "epoch": E, "last_seq": N} on stdout, so a script can resume with
`--since N+1 --epoch E`."""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import sys
import threading

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
    """Follow until Ctrl-C (exit 0) or until the master ends the stream (exit 1)."""
    from kvtier.client import Client

    if opts.since < 0 or opts.epoch < 0 or bool(opts.since) != bool(opts.epoch):
        print("kvtier events: --since N and --epoch E go together (both from an earlier event)", file=sys.stderr)
        return 2
    # As in `kvtier top`: Ctrl-C sets a flag, never raises inside a gRPC call. The stream is read on
    # a thread; the main thread waits for Ctrl-C or the stream's end, then closes it.
    done = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: done.set()) if in_main_thread else None
    outcome: list[BaseException | None] = []
    try:
        with Client(opts.master, namespace=opts.namespace) as client:
            stream = client.watch_events(
                opts.prefix, opts.since, opts.kinds, epoch=opts.epoch, all_namespaces=opts.all_namespaces
            )

            def follow() -> None:
                try:
                    for event in stream:
                        print(json.dumps(event.to_dict()) if opts.json else _line(event), flush=True)
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
                    # Without its traceback: that holds this frame, and through it the stream,
                    # in a cycle only the garbage collector frees (see main()).
                    outcome.append(exc.with_traceback(None))
                finally:
                    done.set()

            reader = threading.Thread(target=follow, name="kvtier-events", daemon=True)
            reader.start()
            while not done.wait(0.5):
                pass
            stream.close()
            reader.join(5.0)
    except KeyboardInterrupt:  # before the handler was installed, or outside the main thread
        return 0
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    error = outcome[0] if outcome else None
    if isinstance(error, WatchEnded):
        if opts.json:
            end = {"end": error.status.name, "error": error.message, "epoch": stream.epoch, "last_seq": stream.last_seq}
            print(json.dumps(end), flush=True)
        print(f"kvtier events: stream ended: {error}", file=sys.stderr)
        return 1
    if error is not None:
        raise error  # main() reports it (master unreachable: exit 1)
    return 0
