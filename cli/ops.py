"""The operator's commands of `kvtier` (the dispatcher and argument parser are in kvtier.cli.main).

`status`, `segments`, `quotas`, `keys`, `stat`, `drain`, `evict` here;
`top` in kvtier.cli.top. Each prints aligned tables, or with `--json`
one JSON document on stdout. Progress of long operations goes to stderr
(rewritten in place on a terminal, one line per step otherwise), so stdout
stays parseable; `--quiet` silences it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from kvtier.common.units import format_size


def print_table(rows: Sequence[Sequence[str]], out: TextIO | None = None) -> None:
    """Left-aligned columns two spaces apart; the first row is the header. Cells are never empty."""
    out = out or sys.stdout
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out)


def show_key(key: str) -> str:
    """A key as one printable table cell (escaped when it holds control or other unprintable characters)."""
    return key if key.isprintable() and key.strip() == key and "  " not in key else ascii(key)


def endpoints_text(endpoints: Sequence[str]) -> str:
    """Endpoints for a table: a same-host `shm` endpoint as its scheme alone (the URL is long; --json has it)."""
    return ",".join("shm" if e.startswith("shm://") else e for e in endpoints) or "-"


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


class Progress:
    """Progress of a long operation on stderr: one line rewritten in place on a terminal, else one
    line per update."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = self.stream.isatty()
        self._open = False

    def update(self, text: str) -> None:
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _client(opts: argparse.Namespace, timeout: float = 5.0):
    from kvtier.client import Client

    return Client(opts.master, namespace=getattr(opts, "namespace", "default"), timeout=timeout)


# ------------------------------------------------------------------ status and segments


def segment_dict(s: Any) -> dict[str, Any]:
    """One segment of a StatusResponse as plain data (`kvtier segments --json`, `status --json`)."""
    return {
        "segment_id": s.segment_id,
        "name": s.name,
        "host_id": s.host_id,
        "endpoints": list(s.endpoints),
        "state": s.state,
        "dram_capacity": s.dram_capacity,
        "dram_used": s.dram_used,
        "dram_releasing": s.dram_releasing,  # of dram_used: copies gone, ranges not reusable yet
        "objects": s.objects,
        "heartbeat_age_ms": s.heartbeat_age_ms,
        "ssd_capacity": s.ssd_capacity,
        "ssd_used": s.ssd_used,
        # what the SSD tier can hold now: ssd_capacity, or less when its file system has less room
        "ssd_usable": s.ssd_usable,
        "ssd_objects": s.ssd_objects,
        "disk_engine": s.disk_engine,
        "offload": s.offload,
        "dram_bytes_served": s.dram_bytes_served,
        "ssd_bytes_served": s.ssd_bytes_served,
        "disk_bytes_read": s.disk_bytes_read,
        "ssd_bytes_offloaded": s.ssd_bytes_offloaded,
        "direct_reads_served": s.direct_reads_served,
        # its wall clock minus the master's; skewed: beyond the master's tolerance, out of placement
        "clock_skew_s": round(s.clock_skew_s, 3),
        "clock_skewed": s.clock_skewed,
        # clients reported repeated data-plane failures: placed on last, read last, for this much longer
        "quarantined": s.quarantined,
        "quarantine_left_s": round(s.quarantine_left_s, 1),
    }


def ssd_text(s: dict[str, Any]) -> str:
    """The SSD column: the tier's capacity, and what its file system holds when that is less."""
    text = format_size(s["ssd_capacity"])
    if 0 < s["ssd_usable"] < s["ssd_capacity"]:
        text += f" (fs: {format_size(s['ssd_usable'])})"
    return text


def state_text(s: dict[str, Any]) -> str:
    """The STATE column: the state, a clock skew that keeps the segment out of placement, and a
    quarantine (kvtier.master.quarantine) with the seconds of cool-off left."""
    text = f"{s['state']} CLOCK_SKEW {s['clock_skew_s']:+.1f}s" if s["clock_skewed"] else s["state"]
    if s.get("quarantined"):
        text += f" QUARANTINED {s['quarantine_left_s']:.0f}s"
    return text


ADMISSION_VETOES = ("min_size", "reads")  # kvtier.master.admission.REASONS


def status_dict(reply: Any) -> dict[str, Any]:
    """A StatusResponse as plain data (`kvtier status --json`, and what `kvtier top` samples)."""
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
        "rpc_failures": dict(reply.rpc_failures),
        "lookup_keys": dict(reply.lookup_keys),
        "lookup_hits": dict(reply.lookup_hits),
        "lookup_hits_disk_only": reply.lookup_hits_disk_only,
        "eviction_policy": reply.eviction_policy,
        "quotas": [quota_dict(q) for q in reply.quotas],
        "evictions": {e.reason: {"objects": e.objects, "bytes": e.bytes} for e in reply.evictions},
        "capacity": reply.capacity,
        "used": reply.used,
        "tiering": dict(reply.tiering),
        # Also in "tiering" (admission_veto_<reason>, prefetch_<outcome>), gathered here by name.
        "ssd_admission_vetoes": {r: reply.tiering.get(f"admission_veto_{r}", 0) for r in ADMISSION_VETOES},
        "prefetch": {k.removeprefix("prefetch_"): v for k, v in reply.tiering.items() if k.startswith("prefetch_")},
        "segments": [segment_dict(s) for s in reply.segments],
    }


def cmd_status(opts: argparse.Namespace) -> int:
    with _client(opts) as client:
        data = status_dict(client.cluster_status())
    if opts.json:
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"cluster {data['cluster_id']}  master {opts.master}  epoch {data['master_epoch']}  "
        f"objects {data['objects']}  used {format_size(data['used'])} / {format_size(data['capacity'])} "
        f"({percent(data['used'], data['capacity']) if data['capacity'] else '0.0%'})  "
        f"eviction {data['eviction_policy'] or '?'}"
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
        ssd = s["ssd_capacity"]
        rows.append(
            [
                str(s["segment_id"]),
                s["name"],
                state_text(s),
                format_size(s["dram_capacity"]),
                format_size(s["dram_used"]),
                str(s["objects"]),
                f"{ssd_text(s)} ({s['disk_engine'] or '?'})" if ssd else "-",
                format_size(s["ssd_used"]) if ssd else "-",
                str(s["ssd_objects"]) if ssd else "-",
                f"{s['heartbeat_age_ms']}ms",
                endpoints_text(s["endpoints"]),
            ]
        )
    print_table(rows)
    return 0


def cmd_segments(opts: argparse.Namespace) -> int:
    with _client(opts) as client:
        segments = [segment_dict(s) for s in client.cluster_status().segments]
    if opts.json:
        print(json.dumps(segments, indent=2))
        return 0
    if not segments:
        print("no segment is mounted")
        return 0
    rows = [
        [
            "ID", "NAME", "STATE", "DRAM", "DRAM USED", "DRAM%", "OBJECTS", "SSD", "SSD USED", "SSD%", "SSD OBJ",
            "HEARTBEAT", "SERVED DRAM", "SERVED SSD", "DISK READ", "OFFLOADED", "ENDPOINTS",
        ]
    ]  # fmt: skip
    for s in segments:
        ssd = s["ssd_capacity"]
        rows.append(
            [
                str(s["segment_id"]),
                s["name"],
                state_text(s),
                format_size(s["dram_capacity"]),
                format_size(s["dram_used"]),
                percent(s["dram_used"], s["dram_capacity"]),
                str(s["objects"]),
                ssd_text(s) if ssd else "-",
                format_size(s["ssd_used"]) if ssd else "-",
                percent(s["ssd_used"], min(ssd, s["ssd_usable"] or ssd)),
                str(s["ssd_objects"]) if ssd else "-",
                f"{s['heartbeat_age_ms']}ms",
                format_size(s["dram_bytes_served"]),
                format_size(s["ssd_bytes_served"]) if ssd else "-",
                format_size(s["disk_bytes_read"]),
                format_size(s["ssd_bytes_offloaded"]) if ssd else "-",
                endpoints_text(s["endpoints"]),
            ]
        )
    print_table(rows)
    return 0


def cmd_quotas(opts: argparse.Namespace) -> int:
    with _client(opts) as client:
        quotas = client.quotas()
    if opts.json:
        print(json.dumps(quotas, indent=2))
        return 0
    rows = [["INSTANCE", "RANK", "TPxPP", "QUOTA", "USED", "USED%", "OBJECTS"]]
    for q in quotas:
        rows.append(
            [
                q["instance"] or "-",
                str(q["rank"]),
                f"{q['tp_size']}x{q['pp_size']}" if q["tp_size"] else "-",
                format_size(q["quota"]) if q["quota"] else "none",
                format_size(q["used"]),
                percent(q["used"], q["quota"]),
                str(q["objects"]),
            ]
        )
    if len(rows) == 1:
        print("no instance has stored objects or registered")
        return 0
    print_table(rows)
    return 0


# ------------------------------------------------------------------ keys


def cmd_keys(opts: argparse.Namespace) -> int:
    from kvtier.client.keys import MAX_PAGE

    listed = []
    start_after = opts.start_after
    with _client(opts, timeout=30.0) as client:
        while True:
            want = opts.limit - len(listed) if opts.limit else opts.page_size
            page = client.list_keys(
                opts.prefix,
                start_after=start_after,
                limit=min(want, opts.page_size, MAX_PAGE),
                include_pending=opts.pending,
            )
            listed.extend(page.keys)
            start_after = page.next_start_after
            if not start_after or (opts.limit and len(listed) >= opts.limit):
                break
    next_start_after = start_after or None  # more keys follow: continue with --start-after
    if opts.json:
        doc = {
            "namespace": opts.namespace,
            "prefix": opts.prefix,
            "keys": [info.to_dict() for info in listed],
            "next_start_after": next_start_after,
        }
        print(json.dumps(doc, indent=2))
        return 0
    if listed:
        rows = [["KEY", "SIZE", "STATE", "DRAM", "SSD", "PIN"]]
        for info in listed:
            rows.append(
                [
                    show_key(info.key),
                    format_size(info.size),
                    info.state,
                    str(info.dram_replicas),
                    str(info.ssd_replicas),
                    info.pin,
                ]
            )
        print_table(rows)
    more = f"; more follow: --start-after {show_key(next_start_after)}" if next_start_after else ""
    print(f"{len(listed)} keys in namespace {opts.namespace!r} under prefix {opts.prefix!r}{more}", file=sys.stderr)
    return 0


def cmd_stat(opts: argparse.Namespace) -> int:
    with _client(opts) as client:
        info = client.stat(opts.key)
    if info is None:
        print(f"kvtier stat: {show_key(opts.key)}: not found in namespace {opts.namespace!r}", file=sys.stderr)
        return 1
    if opts.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    pin = f"soft, {info.pin_ttl_s:.1f}s left" if info.pin == "soft" else info.pin
    print_table(
        [
            ["namespace", info.namespace],
            ["key", show_key(info.key)],
            ["state", info.state],
            ["size", f"{format_size(info.size)} ({info.size} bytes)"],
            ["checksum", f"0x{info.checksum:08x} (crc32c)"],
            ["replicas", f"{len(info.replicas)}: " + ", ".join(f"{r.tier} on {r.segment}" for r in info.replicas)],
            ["lease", f"{info.lease_s:.1f}s left" if info.lease_s else "none"],
            ["pin", pin],
            ["owner", f"{info.instance} rank {info.rank}" if info.instance else "-"],
            ["age", f"{info.age_s:.1f}s"],
            ["disk reads", str(info.disk_reads)],
        ]
    )
    if info.replicas:
        print()
        rows = [["SEGMENT", "ID", "TIER", "LOCATION", "TASK"]]
        for r in info.replicas:
            rows.append([r.segment or "?", str(r.segment_id), r.tier, hex(r.location), r.task or "-"])
        print_table(rows)
    return 0


# ------------------------------------------------------------------ drain and evict


def cmd_drain(opts: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvtier.cli.drain import drain_segment

    progress = Progress(opts.quiet)

    def report_progress(report, left: int) -> None:
        progress.update(
            f"drain {opts.segment}: moved {report.moved} ({format_size(report.moved_bytes)}), "
            f"{left} left, {report.failed} failed, {report.no_space} without room"
        )

    if opts.segment_config:
        client_cm = _segment_config_client(opts)
    elif not opts.segment:
        _drain_usage_error("name the segment, or give --segment-config")
    else:
        client_cm = _client(opts, timeout=30.0)
    if opts.cancel:
        from kvtier.proto import master_pb2 as pb

        with client_cm as client:
            reply = client._master.call("DrainSegment", pb.DrainSegmentRequest(segment=opts.segment, cancel=True))
        if opts.json:
            print(json.dumps({"segment": opts.segment, "state": reply.state, "objects": reply.objects_left}))
        else:
            print(f"drain of {opts.segment} cancelled: {reply.state}, {reply.objects_left} objects")
        return 0
    with client_cm as client:
        try:
            report = drain_segment(
                client,
                opts.segment,
                batch=opts.batch,
                timeout=opts.timeout,
                stall_timeout=opts.stall_timeout,
                progress=report_progress,
            )
        finally:
            progress.done()
    if opts.json:
        print(json.dumps(asdict(report), indent=2))
        return 0
    print_table(
        [
            ["SEGMENT", "STATE", "MOVED", "MOVED BYTES", "FAILED", "NO ROOM", "DROPPED", "DROPPED SSD"],
            [
                opts.segment,
                report.state,
                str(report.moved),
                format_size(report.moved_bytes),
                str(report.failed),
                str(report.no_space),
                str(report.dropped),
                str(report.dropped_ssd),
            ],
        ]
    )
    return 0


def _drain_usage_error(message: str) -> NoReturn:
    sys.stderr.write(f"kvtier drain: error: {message}\n")
    raise SystemExit(2)


def _segment_config_client(opts: argparse.Namespace):
    """A Client for draining the segment a config runs (`kvtier drain --segment-config`): the config is
    loaded as the segment loads it (file, then KVTIER_SEGMENT_* variables), so a unit's ExecStop or a
    pod's preStop names the segment it stops without repeating its name, master or secret."""
    from kvtier.client import Client
    from kvtier.common.config import load_config
    from kvtier.common.discovery import MasterLocator
    from kvtier.segment_server.config import SegmentConfig

    cfg = load_config(
        SegmentConfig,
        prog="kvtier drain",
        description="the segment's config",
        env_prefix="KVTIER_SEGMENT_",
        argv=["--config", opts.segment_config],
    )
    if not cfg.name:
        _drain_usage_error(f"{opts.segment_config} sets no segment name (name, KVTIER_SEGMENT_NAME)")
    if opts.segment and opts.segment != cfg.name:
        _drain_usage_error(f"{opts.segment!r} is not {cfg.name!r}, the segment of the config")
    opts.segment = cfg.name
    master = cfg.master
    if master.startswith("etcd://"):  # the leader, looked up with the segment's etcd credentials
        master = MasterLocator(master, security=cfg.etcd_security).address
        if not master:
            _drain_usage_error(f"no leading master found in {cfg.master}")
    return Client(
        master,
        timeout=30.0,
        secret_file=cfg.secret_file,
        tls_ca_file=cfg.tls_ca_file,
        tls_cert_file=cfg.tls_cert_file,
        tls_key_file=cfg.tls_key_file,
    )


def cmd_evict(opts: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvtier.cli.evict import evict_prefix

    progress = Progress(opts.quiet)
    verb = "would remove" if opts.dry_run else "removed"

    def report_progress(report) -> None:
        progress.update(
            f"evict {opts.prefix!r}: page {report.pages}, {verb} {report.removed} "
            f"({format_size(report.removed_bytes)}), skipped {report.skipped_pinned} pinned, "
            f"{report.skipped_pending} pending"
        )

    with _client(opts, timeout=30.0) as client:
        try:
            report = evict_prefix(
                client,
                opts.prefix,
                page_size=opts.page_size,
                include_pinned=opts.include_pinned,
                dry_run=opts.dry_run,
                progress=report_progress,
            )
        finally:
            progress.done()
    if opts.json:
        print(json.dumps(asdict(report), indent=2))
        return 0
    print_table(
        [
            ["NAMESPACE", "PREFIX", verb.upper(), "BYTES", "SKIPPED PINNED", "SKIPPED PENDING", "GONE", "LISTED"],
            [
                report.namespace,
                show_key(report.prefix) if report.prefix else "''",
                str(report.removed),
                format_size(report.removed_bytes),
                str(report.skipped_pinned),
                str(report.skipped_pending),
                str(report.gone),
                str(report.listed),
            ],
        ]
    )
    return 0
