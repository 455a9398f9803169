"""The segment server's configuration: one dataclass of defaults, validated once at start.

Loaded by the entry point from a TOML file (`--config`), `KVTIER_SEGMENT_*` environment
variables and flags (flags win; kvtier.proto.config); nothing deeper reads the environment.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, fields

from kvtier.proto.config import check_log_level, load_config
from kvtier.proto.keys import cluster_id_problem, segment_name_problem
from kvtier.proto.units import check_field, check_master_spec, is_wildcard, parse_hostport, parse_size

MIN_DRAM = 1 << 20
MIN_SSD = 16 << 20


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
    shm_dir: str = "/dev/shm"  # where region files live
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
    ssd_read_ahead: int = 4  # records of one request read ahead of the one being sent
    ssd_send_timeout_s: float = 30.0  # a client that reads nothing of a disk response this long is cut off
    ssd_direct_io: bool = True  # O_DIRECT reads where the file system allows it (not on tmpfs)
    log_level: str = "INFO"

    @property
    def dram_bytes(self) -> int:
        return parse_size(self.dram)

    @property
    def ssd_bytes(self) -> int:
        return parse_size(self.ssd_size) if self.ssd_dir else 0

    def validate(self) -> SegmentConfig:
        check_field("master", check_master_spec, self.master)
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
        for name in ("dram", "ssd_size", "ssd_bucket_size", "ssd_read_buffers"):
            check_field(name, parse_size, getattr(self, name))
        if self.dram_bytes < MIN_DRAM:
            raise ValueError(f"--dram must be at least 1MiB, got {self.dram!r}")
        if problem := cluster_id_problem(self.cluster_id):
            raise ValueError(problem)
        if self.name and (problem := segment_name_problem(self.name)):
            raise ValueError(problem)
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shm_dir {self.shm_dir!r} is not a directory")
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
        if self.ssd_send_timeout_s <= 0:
            raise ValueError("--ssd-send-timeout-s must be positive")
        if parse_size(self.ssd_read_buffers) < 1 << 20:
            raise ValueError(f"--ssd-read-buffers must be at least 1MiB, got {self.ssd_read_buffers!r}")
        check_log_level(self.log_level)
        return self

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
