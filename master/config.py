"""The master's configuration: one dataclass of defaults, validated once at start.

Loaded by the entry point from a TOML file (`--config`), `KVTIER_MASTER_*` environment variables
and flags (flags win; kvtier.common.config); nothing deeper in the master reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from kvtier.common.config import EtcdSecurity, check_etcd_security, check_log_level, load_config
from kvtier.common.units import (
    check_field,
    check_master_spec,
    is_loopback,
    is_wildcard,
    parse_hostport,
    parse_size,
)
from kvtier.master.admission import Admission
from kvtier.master.auth import load_tenants
from kvtier.master.eviction_policy import POLICIES
from kvtier.master.records import READS_CAP
from kvtier.proto.auth import CLOCK_SKEW_MS, read_secret
from kvtier.proto.keys import cluster_id_problem
from kvtier.proto.rpcframe import MESSAGE_LIMIT

# Durations go over the wire as 32-bit milliseconds (leases, TTLs): 30 days is far past any use and
# far below the 49.7 days that fit. A bigger value passed validation, then failed every mount or read.
MAX_DURATION_S = 30 * 86_400.0
STATE_DIR_NONE = "none"  # state_dir = "none" (--state-dir none): save nothing, explicitly
SERVICE_STATE_ROOT = "/var/lib/kvtier"  # a service's state (systemd StateDirectory=kvtier, a volume)


def _writable(path: Path) -> bool:
    """Whether this process could create `path`: its nearest existing ancestor is a writable directory."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


def default_state_dir(cluster_id: str, environ: dict[str, str] | None = None) -> str:
    """A standalone master's default state directory: /var/lib/kvtier/<cluster> where this process
    can write it (a service), else $XDG_STATE_HOME/kvtier/<cluster> (default ~/.local/state/...)."""
    env = os.environ if environ is None else environ
    service = Path(SERVICE_STATE_ROOT) / cluster_id
    if _writable(service):
        return str(service)
    base = env.get("XDG_STATE_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative path is invalid and ignored
        base = os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "kvtier", cluster_id)


@dataclass(frozen=True, slots=True)
class MasterConfig:
    listen: str = "127.0.0.1:50051"  # gRPC address; binds exactly this address
    # framed fast path for the hot calls: "auto" = the gRPC host on a free port, "off", or HOST:PORT
    fast_listen: str = "auto"
    cluster_id: str = "default"  # segments of another cluster are refused
    segment_ttl_s: float = 10.0  # a segment silent this long is unmounted, its replicas dropped
    heartbeat_interval_s: float = 1.0  # told to segments at mount
    lease_s: float = 10.0  # read lease granted by GetReplicas
    # Direct reads (docs/architecture.md, "Direct reads"): a client that looked a small DRAM object up
    # reads it again from its segment alone, which checks it against its own index, for as long as the
    # lookup's grant lasts. A segment serves them while its heartbeats are acknowledged (two intervals
    # after the last one sent); a call that changes what a key reads waits until a dropped segment's
    # such lease ran out. Off: every read asks the master first.
    direct_reads: bool = True
    put_timeout_s: float = 30.0  # a PutStart without PutEnd this long is reclaimed
    max_batch_keys: int = 100_000  # keys per request; more is BATCH_TOO_LARGE
    high_watermark: float = 0.90  # a segment fuller than this evicts LRU objects in the background...
    eviction_ratio: float = 0.05  # ...down to high_watermark - eviction_ratio
    # A segment with an SSD tier copies its least recently used objects to SSD above this, keeping
    # them in DRAM, so that eviction (and a put that needs room) later drops copies already safe.
    # Above high_watermark it changes nothing (eviction offloads there anyway).
    offload_watermark: float = 0.80
    # When a put finds DRAM full of objects whose only copy is in DRAM and not yet on SSD (docs/
    # architecture.md, "The SSD tier"): "wait" (the put waits for offload, at most put_backpressure_s,
    # then those keys fail OFFLOAD_BEHIND: nothing acknowledged is dropped while the tier has room)
    # or "drop" (such copies are dropped, lost to recompute; puts never wait).
    dram_full_policy: str = "wait"
    # At most half of the write grant, min(put_timeout_s, lease_s): a put that waited keeps the rest to write.
    put_backpressure_s: float = 5.0
    # DRAM bytes a segment may have being offloaded at once (at least eviction_ratio of it, at most
    # a quarter): enough fdatasync groups in flight to keep its disk busy.
    offload_in_flight: str = "256MiB"
    soft_pin_ttl_s: float = 300.0  # default lifetime of a soft pin
    # The order DRAM copies are evicted in (master/eviction_policy.py): "lru" (least recently used
    # first) or "s3fifo" (scan-resistant: objects read fewer than twice leave before the re-read
    # ones; a one-shot scan does not flush the hot set). Safe to change across a restart.
    eviction_policy: str = "lru"
    promote_after_reads: int = 2  # a disk-only object read this often is copied back to DRAM (0 = never)
    # SSD write admission (master/admission.py): objects smaller than this, or read (while in DRAM)
    # fewer times than that, are never offloaded; eviction drops them (recompute) instead. Saves disk
    # bandwidth and wear at the cost of recomputing what was left out. Defaults admit everything.
    ssd_admit_min_bytes: str = "0"
    ssd_admit_after_reads: int = 0
    # Prefetch on lookup (Exists with prefetch): DRAM bytes of promotions in flight per segment at most;
    # a prefetch past it is skipped (counted), never queued. Also bounds promote_after_reads promotions.
    promotion_budget: str = "256MiB"
    alignment: int = 64  # allocation granularity inside a region, bytes
    tick_interval_s: float = 0.2  # how often expiry and reclaim run
    # Freeze the garbage collector's view of long-lived objects (master/long_lived.py) once the master
    # holds this many objects, and again at each 25% growth: full collections stop walking millions of
    # records on the event loop. 0 = never.
    gc_freeze_min_objects: int = 200_000
    # A prefix removal or a dead segment's cleanup runs in slices of the event loop, requests served
    # between them (master/sweeps.py): a slice visits at most this many object names and lasts at
    # most this long. Smaller: shorter waits for requests, longer sweeps.
    sweep_slice_objects: int = 1024
    sweep_slice_ms: float = 0.25
    # A ListKeys page ends, shorter (next_start_after set), once building it took this long: a page of
    # 10,000 keys held the loop tens of ms (master/inspection.py). Larger: fewer round trips per listing.
    list_page_ms: float = 1.0
    # Restart and HA (docs/architecture.md, "Master restart and HA").
    # Standalone: where segment names, registrations and the epoch are saved. Empty: the default
    # directory (default_state_dir); "none": nothing is saved (a restart loses every DRAM object).
    state_dir: str = ""
    recovery_timeout_s: float = 5.0  # after a restart: wait this long at most for segment inventories
    # ...and this long at most while an expected segment is still reporting (each chunk is a heartbeat,
    # so a stalled one is expelled at segment_ttl_s): 10M objects take minutes to report, not seconds.
    # Never shorter than recovery_timeout_s.
    recovery_max_s: float = 300.0
    # A returning segment re-adopts its copies except those of keys changed while it was away; at most
    # this many such keys are remembered for all segments away together, past that the oldest one away
    # discards its copies when it returns (master/fences.py).
    fence_max_keys: int = 1_000_000
    # A segment whose wall clock is off ours by more than this (measured at mount and by heartbeats,
    # allowing for the round trip: kvtier.master.clock_skew) takes no new objects until it is fixed;
    # its reads are still served. Below CLOCK_SKEW_MS (2 s), the margin grants are reused after.
    clock_skew_tolerance_s: float = 1.0
    # Quarantine (kvtier.master.quarantine): data-plane failures that clients report on a segment,
    # from at least quarantine_reporters clients, adding up to quarantine_failures within
    # quarantine_window_s, put it in quarantine for quarantine_cooloff_s: placed on only where no
    # other segment can take an object, its replicas read last. quarantine_failures = 0: off.
    quarantine_failures: int = 3
    quarantine_reporters: int = 1
    quarantine_window_s: float = 30.0
    quarantine_cooloff_s: float = 30.0
    etcd: str = ""  # HA: etcd://HOST:PORT[,HOST:PORT]/CLUSTER (CLUSTER = cluster_id) or HOST:PORT[,...]
    etcd_lease_ttl_s: float = 5.0  # leader lease; also how long a leader serves with etcd unreachable
    # A secured etcd (docs/security.md, "etcd"): TLS checked against this CA (PEM), this client
    # certificate and key for etcd's --client-cert-auth, and etcd user auth with USER:PASSWORD read
    # from a file only its owner or group can read (never argv or the environment).
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_credentials_file: str = ""
    # The address other processes reach this master at (default: listen); its host is also the
    # fast path's advertised host. Required when listen is a wildcard (0.0.0.0, [::]).
    advertise: str = ""
    ready_file: str = ""  # if set, JSON with the bound address is written here once serving
    metrics: str = ""  # HOST:PORT for Prometheus /metrics (port 0 = any); empty = off
    # Security (docs/security.md). The cluster secret: a file only its owner can read, else the
    # KVTIER_SECRET environment variable; never the value on a command line. Without one nobody is
    # authenticated, which only a loopback listener (or allow_insecure) accepts.
    secret_file: str = ""
    tenants_file: str = ""  # TOML: tenants, their secret files and namespace patterns (kvtier.master.auth)
    allow_insecure: bool = False  # serve a non-loopback address without a secret (a trusted network)
    # gRPC over TLS: this master's certificate chain and key (PEM); with tls_client_ca_file, clients
    # must present a certificate signed by it (mTLS). The fast path has no TLS: "auto" turns it off.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Resource limits (docs/security.md). The fast path refuses a connection beyond max_connections
    # with an error frame naming the limit, and cuts one idle for idle_timeout_s (gRPC: closes a
    # connection without calls that long), or whose request has been arriving, or whose answers
    # have gone unread, for request_timeout_s (a slow sender holds no more than that).
    max_connections: int = 4096
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 60.0
    max_message_size: str = "256MiB"  # largest request on either door (gRPC, fast path); at most 256MiB
    # Fast path: request bytes all connections may buffer beyond a small buffer each; a connection
    # whose next request does not fit waits, unread, until others are answered (backpressure).
    max_buffered_size: str = "1GiB"
    max_concurrent_rpcs: int = 10000  # gRPC calls in progress (long polls included); more: RESOURCE_EXHAUSTED
    max_concurrent_streams: int = 1000  # gRPC calls in progress on one connection (HTTP/2 streams)
    log_level: str = "INFO"
    # Testing aid (master/history.py, docs/testing.md): JSON lines of every object or replica that leaves
    # the tables other than by a client's remove, appended to this file; empty = off (no cost).
    history_log: str = ""
    history_log_max_size: str = "64MiB"  # the log stops growing here (its last line says so)
    # Event stream for routers (WatchEvents, master/events.py, docs/events.md): the last events_buffer
    # events are held for resuming watchers (0 = no events at all); a watcher more than
    # events_watcher_queue events behind is cut; at most events_max_watchers streams at once.
    events_buffer: int = 65536
    events_watcher_queue: int = 8192
    events_max_watchers: int = 64
    # Streams of one tenant at once; they do not count in events_max_watchers (the cluster
    # credentials' streams), so no tenant can leave another, or the operator, without one.
    events_max_watchers_per_tenant: int = 8

    @property
    def history_log_max_bytes(self) -> int:
        return parse_size(self.history_log_max_size)

    @property
    def direct_read_lease_s(self) -> float:
        """How long after sending an acknowledged heartbeat a segment serves direct reads (0: none).
        Two intervals: one late heartbeat does not interrupt them; safety does not depend on it."""
        return 2 * self.heartbeat_interval_s if self.direct_reads else 0.0

    @property
    def direct_read_lease_ms(self) -> int:
        """`direct_read_lease_s` as the wire names it (whole ms, rounded down: never longer)."""
        return int(self.direct_read_lease_s * 1000)

    @property
    def segment_suspect_s(self) -> float:
        """A segment silent this long ranks last in placement (kvtier.master.placement.static_rank):
        three missed heartbeats, at least 1 s (a busy host is late now and then), at most the TTL."""
        return min(max(3 * self.heartbeat_interval_s, 1.0), self.segment_ttl_s)

    def validate(self) -> MasterConfig:
        host, _port = check_field("listen", parse_hostport, self.listen)
        if self.fast_listen not in ("auto", "off"):
            check_field("fast_listen", parse_hostport, self.fast_listen)
        if is_wildcard(host) and not self.advertise:
            raise ValueError(
                f"listen {self.listen!r} is every interface: set advertise = HOST:PORT, the address clients "
                "and segments reach this master at (it is also advertised for the fast path)"
            )
        for name in (
            "segment_ttl_s",
            "heartbeat_interval_s",
            "lease_s",
            "put_timeout_s",
            "tick_interval_s",
            "recovery_timeout_s",
            "recovery_max_s",
            "clock_skew_tolerance_s",
            "quarantine_window_s",
            "quarantine_cooloff_s",
        ):
            value = getattr(self, name)
            if not 0 < value <= MAX_DURATION_S:  # also NaN and inf
                raise ValueError(
                    f"{name} must be positive and at most {MAX_DURATION_S:.0f} s (30 days: the wire carries "
                    f"durations as 32-bit milliseconds), got {value}"
                )
        for item in fields(self):  # every other duration too: finite, and what 32-bit ms can carry
            value = getattr(self, item.name)
            if item.name.endswith("_s") and isinstance(value, float) and not value <= MAX_DURATION_S:
                raise ValueError(f"{item.name} must be at most {MAX_DURATION_S:.0f} s (30 days), got {value}")
        if self.clock_skew_tolerance_s * 1000 >= CLOCK_SKEW_MS:
            raise ValueError(
                f"clock_skew_tolerance_s must be below {CLOCK_SKEW_MS / 1000:.0f} s (the margin after which "
                f"grants' ranges are reused: a segment off by more would accept ended grants), got "
                f"{self.clock_skew_tolerance_s}"
            )
        if self.heartbeat_interval_s * 2 > self.segment_ttl_s:
            raise ValueError(
                f"segment_ttl_s ({self.segment_ttl_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if not 0 < self.high_watermark <= 1:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if not 0 < self.offload_watermark <= 1:
            raise ValueError(f"offload_watermark must be in (0, 1], got {self.offload_watermark}")
        if not 0 < self.eviction_ratio <= self.high_watermark:
            raise ValueError(f"eviction_ratio must be in (0, high_watermark], got {self.eviction_ratio}")
        if self.soft_pin_ttl_s <= 0:
            raise ValueError(f"soft_pin_ttl_s must be positive, got {self.soft_pin_ttl_s}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}")
        if self.dram_full_policy not in ("wait", "drop"):
            raise ValueError(f"dram_full_policy must be wait or drop, got {self.dram_full_policy!r}")
        if self.put_backpressure_s < 0:
            raise ValueError(f"put_backpressure_s must be >= 0, got {self.put_backpressure_s}")
        check_field("offload_in_flight", parse_size, self.offload_in_flight)
        if self.promote_after_reads < 0:
            raise ValueError(f"promote_after_reads must be >= 0, got {self.promote_after_reads}")
        if not 0 <= self.ssd_admit_after_reads <= READS_CAP:
            raise ValueError(f"ssd_admit_after_reads must be in [0, {READS_CAP}], got {self.ssd_admit_after_reads}")
        check_field("ssd_admit_min_bytes", parse_size, self.ssd_admit_min_bytes)
        check_field("promotion_budget", parse_size, self.promotion_budget)
        if self.sweep_slice_ms <= 0:
            raise ValueError(f"sweep_slice_ms must be positive, got {self.sweep_slice_ms}")
        if self.list_page_ms <= 0:
            raise ValueError(f"list_page_ms must be positive, got {self.list_page_ms}")
        if self.sweep_slice_objects < 1:
            raise ValueError(f"sweep_slice_objects must be at least 1, got {self.sweep_slice_objects}")
        if self.quarantine_failures < 0:
            raise ValueError(f"quarantine_failures must be >= 0 (0: quarantine off), got {self.quarantine_failures}")
        if self.quarantine_reporters < 1:
            raise ValueError(f"quarantine_reporters must be at least 1, got {self.quarantine_reporters}")
        if self.gc_freeze_min_objects < 0:
            raise ValueError(f"gc_freeze_min_objects must be >= 0 (0: never), got {self.gc_freeze_min_objects}")
        if self.fence_max_keys < 0:
            raise ValueError(f"fence_max_keys must be >= 0, got {self.fence_max_keys}")
        if self.max_batch_keys < 1:
            raise ValueError("max_batch_keys must be at least 1")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        if problem := cluster_id_problem(self.cluster_id):
            raise ValueError(problem)
        if self.etcd_lease_ttl_s < 2:
            raise ValueError(
                f"etcd_lease_ttl_s must be at least 2 (whole seconds in etcd), got {self.etcd_lease_ttl_s}"
            )
        if self.advertise:
            check_field("advertise", parse_hostport, self.advertise)
        if self.metrics:
            check_field("metrics", parse_hostport, self.metrics)
        if self.etcd:
            check_field("etcd", check_master_spec, self.etcd)
        check_etcd_security(self.etcd, self.etcd_security)
        if self.etcd and self.state_dir not in ("", STATE_DIR_NONE):
            raise ValueError("state_dir is for a standalone master; with etcd the leader saves its state there")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        if self.tls_cert_file and self.fast_listen not in ("auto", "off"):
            raise ValueError("the fast path has no TLS: with tls_cert_file, fast_listen must be auto (= off) or off")
        secret = check_field("secret_file", read_secret, self.secret_file)
        if self.tenants_file:
            if secret is None:
                raise ValueError("tenants_file needs a cluster secret (secret_file or KVTIER_SECRET)")
            tenants = check_field("tenants_file", load_tenants, self.tenants_file)
            for name, (tenant_secret, _tenant) in tenants.items():
                if tenant_secret == secret:  # it would authenticate as the cluster, with every right
                    raise ValueError(f"tenants_file: tenant {name!r} has the cluster's secret: give it one of its own")
        exposed = [("listen", self.listen)] if not is_loopback(host) else []
        if self.fast_listen not in ("auto", "off") and not is_loopback(parse_hostport(self.fast_listen)[0]):
            exposed.append(("fast_listen", self.fast_listen))
        if secret is None and not self.allow_insecure and exposed:
            option, address = exposed[0]
            raise ValueError(
                f"{option} {address!r} is reachable from other machines and no cluster secret is set: set "
                "secret_file (or KVTIER_SECRET), or allow_insecure = true on a network you trust"
            )
        for name in ("max_connections", "max_concurrent_rpcs", "max_concurrent_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        message = check_field("max_message_size", parse_size, self.max_message_size)
        if not 64 << 10 <= message <= MESSAGE_LIMIT:
            raise ValueError(f"max_message_size must be between 64KiB and 256MiB, got {self.max_message_size!r}")
        if check_field("max_buffered_size", parse_size, self.max_buffered_size) < message:
            raise ValueError(
                f"max_buffered_size ({self.max_buffered_size}) must hold at least one message (max_message_size)"
            )
        check_log_level(self.log_level)
        check_field("history_log_max_size", parse_size, self.history_log_max_size)
        if self.events_max_watchers_per_tenant < 1:
            raise ValueError(
                f"events_max_watchers_per_tenant must be at least 1, got {self.events_max_watchers_per_tenant}"
            )
        if self.events_buffer < 0 or self.events_max_watchers < 1:
            raise ValueError(
                f"events_buffer must be >= 0 and events_max_watchers at least 1, got {self.events_buffer} "
                f"and {self.events_max_watchers}"
            )
        if self.events_buffer and not 1 <= self.events_watcher_queue <= self.events_buffer:
            raise ValueError(
                f"events_watcher_queue must be between 1 and events_buffer ({self.events_buffer}), "
                f"got {self.events_watcher_queue}"
            )
        return self

    def with_defaults(self) -> MasterConfig:
        """Fill in what depends on the machine: an empty state_dir of a standalone master becomes
        default_state_dir(cluster_id). With etcd the state lives there and state_dir stays empty."""
        if self.etcd or self.state_dir:
            return self
        return replace(self, state_dir=default_state_dir(self.cluster_id))

    @property
    def etcd_security(self) -> EtcdSecurity:
        return EtcdSecurity(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file, self.etcd_credentials_file)

    @property
    def saves_state_to(self) -> str:
        """The directory the standalone master saves its state in; empty when it saves none."""
        return "" if self.state_dir in ("", STATE_DIR_NONE) else self.state_dir

    @property
    def admission(self) -> Admission:
        """The SSD write-admission rules (master/admission.py)."""
        return Admission(parse_size(self.ssd_admit_min_bytes), self.ssd_admit_after_reads)

    @property
    def promotion_budget_bytes(self) -> int:
        return parse_size(self.promotion_budget)

    @property
    def offload_in_flight_bytes(self) -> int:
        return parse_size(self.offload_in_flight)

    @property
    def message_limit(self) -> int:
        """max_message_size in bytes."""
        return parse_size(self.max_message_size)

    @property
    def buffered_limit(self) -> int:
        """max_buffered_size in bytes."""
        return parse_size(self.max_buffered_size)

    @property
    def fast_path_listen(self) -> str:
        """The fast path's setting in effect: "off" under TLS (its frames would travel in the clear)."""
        return "off" if self.tls_cert_file and self.fast_listen == "auto" else self.fast_listen


def parse_args(argv: list[str] | None = None) -> MasterConfig:
    """Build the config from defaults, a `--config` TOML file, `KVTIER_MASTER_<FIELD>` env vars, then flags;
    exit 2 when invalid."""
    return load_config(
        MasterConfig,
        prog="kvtier-master",
        description="kvtier metadata master (gRPC).",
        env_prefix="KVTIER_MASTER_",
        argv=argv,
        resolve=MasterConfig.with_defaults,
    )
