"""The segment server's configuration: one dataclass of defaults, validated once at start.

Loaded by the entry point from a TOML file (`--config`), `KVTIER_SEGMENT_*` environment
variables and flags (flags win; kvtier.common.config); nothing deeper reads the environment.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, fields

from kvtier.common.channels import Credentials
from kvtier.common.config import EtcdSecurity, check_etcd_security, check_log_level, load_config
from kvtier.common.units import (
    check_field,
    check_master_spec,
    is_loopback,
    is_wildcard,
    parse_hostport,
    parse_size,
)
from kvtier.proto.auth import read_secret
from kvtier.proto.keys import cluster_id_problem, segment_name_problem
from kvtier.segment_server.diskio import MAX_QUEUE_DEPTH
from kvtier.segment_server.region import MAX_SOCKET_PATH, grant_socket_path
from kvtier.segment_server.shm_grant import parse_uids

MIN_DRAM = 1 << 20
MIN_SSD = 16 << 20
MIN_SSD_BUCKETS = 4  # a tier holds at least this many buckets (SegmentConfig.ssd_bucket_bytes)


@dataclass(frozen=True, slots=True)
class SegmentConfig:
    master: str = "127.0.0.1:50051"  # master gRPC address
    listen: str = "127.0.0.1:0"  # data-plane TCP address; binds exactly this address (port 0: any free port)
    # The host clients reach the data plane at (default: listen's host). Required when listen is a
    # wildcard (0.0.0.0, [::]); e.g. the pod IP or the node's hostname.
    advertise: str = ""
    dram: str = "1GiB"  # DRAM region size
    name: str = ""  # stable segment name; default: <hostname>-<random>
    cluster_id: str = "default"
    shm_dir: str = "/dev/shm"  # where region lock files (0600; the region is a sealed memfd) and grant sockets live
    # Users besides the service's own uid whose processes are granted the region over the grant
    # socket (the shm transport): comma-separated uids and/or user names. Empty = the service's uid only.
    shm_allowed_uids: str = ""
    ready_file: str = ""  # if set, JSON with endpoints is written here once mounted
    metrics: str = ""  # HOST:PORT for Prometheus /metrics (port 0 = any); empty = off
    # SSD tier (off unless ssd_dir and ssd_size are set): bucket files in ssd_dir, at most ssd_size bytes.
    ssd_dir: str = ""
    ssd_size: str = "0"
    ssd_bucket_size: str = "256MiB"  # a bucket is sealed at this size (max 4GiB)...
    ssd_bucket_keys: int = 65536  # ...or at this many records, whichever first
    ssd_high_watermark: float = 0.95  # above this, the oldest sealed buckets are deleted...
    ssd_low_watermark: float = 0.85  # ...down to this
    offload: bool = True  # objects evicted from DRAM are written to the SSD tier instead of dropped
    ssd_io: str = "auto"  # disk read engine: auto (io_uring if it works here, else threads), io_uring, threads
    ssd_queue_depth: int = 32  # disk reads in flight, whatever the number of requests
    ssd_threads: int = 4  # threads of the `threads` engine; for io_uring, the cap on the kernel's io-wq workers
    ssd_read_buffers: str = "64MiB"  # aligned read buffers, shared by all disk reads
    ssd_read_ahead: int = 4  # reads of one request in flight or waiting to be sent
    # Adjacent records of one request (same bucket, one after the other) are read with one I/O of
    # up to this many bytes (capped at half of ssd_read_buffers); 0 reads every record alone.
    ssd_read_coalesce: str = "4MiB"
    ssd_send_timeout_s: float = 30.0  # a client that reads nothing of a disk response this long is cut off
    ssd_direct_io: bool = True  # O_DIRECT reads and offload writes where the file system allows it
    # Mounting reads record headers only; payloads found at mount are verified in the background at
    # this many bytes per second (0 = off: readers still verify every payload they get).
    ssd_verify_rate: str = "64MiB"
    ssd_write_buffers: str = "64MiB"  # aligned staging buffers of the offload writer (4MiB each, >= 8MiB)
    ssd_write_threads: int = 4  # offload writes in flight (threads of the group writer)
    # Offload bandwidth cap in bytes/s (e.g. 500MiB), keeping disk bandwidth for reads; 0 = unlimited.
    # A put that needs room waits for offload (the master's dram_full_policy), so a low cap slows writers.
    ssd_write_limit: str = "0"
    # Data-plane connection limits: a client beyond max_connections is refused with a clear
    # error; a connection idle this long, or a request (or its response) stalled this long, is cut.
    max_connections: int = 4096
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 60.0
    # Security (docs/security.md): the cluster secret (a file only its owner can read, else
    # KVTIER_SECRET), which this server presents to the master and from which it derives the key
    # of the data plane's capabilities. Without one, any peer that reaches the data plane may read
    # and write the region: only a loopback listener (or allow_insecure) accepts that.
    secret_file: str = ""
    allow_insecure: bool = False
    # TLS to the master (when the master serves TLS): the CA of its certificate, and this server's
    # certificate and key when the master requires client certificates (mTLS).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # A secured etcd, when `master` is etcd://... (docs/security.md, "etcd"): the CA of etcd's server
    # certificate, this server's client certificate and key (etcd --client-cert-auth), and a file
    # holding USER:PASSWORD for etcd's user auth (only its owner or group may read it).
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_credentials_file: str = ""
    log_level: str = "INFO"

    @property
    def etcd_security(self) -> EtcdSecurity:
        return EtcdSecurity(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file, self.etcd_credentials_file)

    @property
    def dram_bytes(self) -> int:
        return parse_size(self.dram)

    @property
    def ssd_bytes(self) -> int:
        return parse_size(self.ssd_size) if self.ssd_dir else 0

    @property
    def ssd_bucket_bytes(self) -> int:
        """The bucket size the SSD tier uses: `ssd_bucket_size`, lowered (to a power of two, at least
        4 MiB) for a tier that would hold fewer than MIN_SSD_BUCKETS of them. The open bucket is never
        evicted, so a tier of one or two buckets fills once and then takes no offload, and every DRAM
        eviction after it drops an object it could have kept."""
        bucket = parse_size(self.ssd_bucket_size)
        if not self.ssd_bytes:
            return bucket
        fits = 1 << max((self.ssd_bytes // MIN_SSD_BUCKETS).bit_length() - 1, 0)
        return min(bucket, max(fits, MIN_SSD // 4))

    @property
    def ssd_write_limit_bytes(self) -> int:
        return parse_size(self.ssd_write_limit)

    def validate(self) -> SegmentConfig:
        check_field("master", check_master_spec, self.master)
        check_etcd_security(self.master if self.master.startswith("etcd://") else "", self.etcd_security)
        if self.metrics:
            check_field("metrics", parse_hostport, self.metrics)
        host, _port = check_field("listen", parse_hostport, self.listen)
        if self.advertise:
            if self.advertise.count(":") == 1 or any(c in self.advertise for c in " /[]"):
                raise ValueError(f"advertise is a host name or IP address, without a port: {self.advertise!r}")
        elif is_wildcard(host):
            raise ValueError(
                f"listen {self.listen!r} is every interface: set advertise = HOST, the address clients reach "
                "this segment's data plane at"
            )
        for name in (
            "dram",
            "ssd_size",
            "ssd_bucket_size",
            "ssd_read_buffers",
            "ssd_verify_rate",
            "ssd_write_buffers",
            "ssd_write_limit",
            "ssd_read_coalesce",
        ):
            check_field(name, parse_size, getattr(self, name))
        if self.dram_bytes < MIN_DRAM:
            raise ValueError(f"--dram must be at least 1MiB, got {self.dram!r}")
        if problem := cluster_id_problem(self.cluster_id):
            raise ValueError(problem)
        if self.name and (problem := segment_name_problem(self.name)):
            raise ValueError(problem)
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shm_dir {self.shm_dir!r} is not a directory")
        # the longest grant socket path a name can give (a long name is replaced by a hash of it)
        longest = grant_socket_path(self.shm_dir, self.cluster_id, "x" * 120)
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"shm_dir {self.shm_dir!r} is too long for the grant socket's path (a Unix socket path is at most "
                f"{MAX_SOCKET_PATH} bytes): use a shorter directory"
            )
        check_field("shm_allowed_uids", parse_uids, self.shm_allowed_uids)
        if self.ssd_dir and self.ssd_bytes < MIN_SSD:
            raise ValueError(f"--ssd-size must be at least 16MiB with --ssd-dir, got {self.ssd_size!r}")
        if not self.ssd_dir and parse_size(self.ssd_size):
            raise ValueError("--ssd-size needs --ssd-dir")
        bucket = parse_size(self.ssd_bucket_size)
        if not MIN_SSD // 4 <= bucket <= 4 << 30:
            raise ValueError(f"--ssd-bucket-size must be between 4MiB and 4GiB, got {self.ssd_bucket_size!r}")
        if self.ssd_bucket_keys < 1:
            raise ValueError("--ssd-bucket-keys must be at least 1")
        if not 0 < self.ssd_low_watermark < self.ssd_high_watermark <= 1:
            raise ValueError("SSD watermarks must satisfy 0 < ssd_low_watermark < ssd_high_watermark <= 1")
        if self.ssd_io not in ("auto", "io_uring", "threads"):
            raise ValueError(f"--ssd-io must be auto, io_uring or threads, got {self.ssd_io!r}")
        if self.ssd_queue_depth < 1 or self.ssd_threads < 1 or self.ssd_read_ahead < 1:
            raise ValueError("--ssd-queue-depth, --ssd-threads and --ssd-read-ahead must be at least 1")
        if self.ssd_queue_depth > MAX_QUEUE_DEPTH:  # io_uring's ring: a traceback at start before
            raise ValueError(f"--ssd-queue-depth must be at most {MAX_QUEUE_DEPTH}, got {self.ssd_queue_depth}")
        if self.ssd_send_timeout_s <= 0:
            raise ValueError("--ssd-send-timeout-s must be positive")
        if parse_size(self.ssd_read_buffers) < 1 << 20:
            raise ValueError(f"--ssd-read-buffers must be at least 1MiB, got {self.ssd_read_buffers!r}")
        if parse_size(self.ssd_write_buffers) < 8 << 20:
            raise ValueError(f"--ssd-write-buffers must be at least 8MiB, got {self.ssd_write_buffers!r}")
        if not 1 <= self.ssd_write_threads <= 64:
            raise ValueError(f"--ssd-write-threads must be between 1 and 64, got {self.ssd_write_threads}")
        # Above half of ssd_read_buffers it is capped there (DiskReader): a small pool stays valid
        # with the default.
        if 0 < parse_size(self.ssd_read_coalesce) < 64 << 10:
            raise ValueError(f"--ssd-read-coalesce must be 0 (off) or at least 64KiB, got {self.ssd_read_coalesce!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("idle_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        credentials = check_field("credentials", lambda _: self.credentials(), None)
        if (
            not credentials.token and not self.allow_insecure and not is_loopback(host)
        ):  # what is bound, not what is advertised
            raise ValueError(
                f"listen {self.listen!r} is reachable from other machines and no cluster secret is set: set "
                "secret_file (or KVTIER_SECRET), or allow_insecure = true on a network you trust"
            )
        check_log_level(self.log_level)
        return self

    def credentials(self) -> Credentials:
        """What this server presents to the master (ValueError when a file cannot be used)."""
        return Credentials.load(
            secret_file=self.secret_file,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
        )

    def secret(self) -> bytes | None:
        return read_secret(self.secret_file)

    def with_defaults(self) -> SegmentConfig:
        """Fill in values that depend on the machine (the default name)."""
        if self.name:
            return self
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:100] or "segment"
        name = f"{host}-{uuid.uuid4().hex[:8]}"
        return SegmentConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, "name": name})


def parse_args(argv: list[str] | None = None) -> SegmentConfig:
    """Build the config from defaults, a `--config` TOML file, `KVTIER_SEGMENT_<FIELD>` env vars, then flags;
    exit 2 when invalid."""
    return load_config(
        SegmentConfig,
        prog="kvtier-segment",
        description="kvtier segment server (DRAM region + data plane).",
        env_prefix="KVTIER_SEGMENT_",
        argv=argv,
    ).with_defaults()
