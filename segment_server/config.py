"""The segment server's configuration: one dataclass of defaults, validated once at start.

Loaded by the entry point from flags and `KVTIER_SEGMENT_*` environment
variables (flags win); nothing deeper reads the environment.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, fields

from kvtier.proto.config import load_config
from kvtier.proto.keys import cluster_id_problem, segment_name_problem
from kvtier.proto.units import parse_hostport, parse_size

MIN_DRAM = 1 << 20


@dataclass(frozen=True, slots=True)
class SegmentConfig:
    master: str = "127.0.0.1:50051"  # master gRPC address
    listen: str = "127.0.0.1:0"  # data-plane TCP address; binds exactly this address (port 0: any free port)
    dram: str = "1GiB"  # DRAM region size
    name: str = ""  # stable segment name; default: <hostname>-<random>
    cluster_id: str = "default"
    shm_dir: str = "/dev/shm"  # where region files live
    ready_file: str = ""  # if set, JSON with endpoints is written here once mounted
    log_level: str = "INFO"

    @property
    def dram_bytes(self) -> int:
        return parse_size(self.dram)

    def validate(self) -> SegmentConfig:
        parse_hostport(self.master)
        parse_hostport(self.listen)
        if self.dram_bytes < MIN_DRAM:
            raise ValueError(f"--dram must be at least 1MiB, got {self.dram!r}")
        if problem := cluster_id_problem(self.cluster_id):
            raise ValueError(problem)
        if self.name and (problem := segment_name_problem(self.name)):
            raise ValueError(problem)
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shm_dir {self.shm_dir!r} is not a directory")
        return self

    def with_defaults(self) -> SegmentConfig:
        """Fill in values that depend on the machine (the default name)."""
        if self.name:
            return self
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:100] or "segment"
        name = f"{host}-{uuid.uuid4().hex[:8]}"
        return SegmentConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, "name": name})


def parse_args(argv: list[str] | None = None) -> SegmentConfig:
    """Build the config from defaults, `KVTIER_SEGMENT_<FIELD>` env vars, then flags; exit 2 when invalid."""
    return load_config(
        SegmentConfig,
        prog="kvtier-segment",
        description="kvtier segment server (DRAM region + data plane).",
        env_prefix="KVTIER_SEGMENT_",
        argv=argv,
    ).with_defaults()
