"""The client's configuration, in one place. `KVTIER_*` env vars fill what the caller did not set."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.common.channels import Credentials
from kvtier.common.units import check_master_spec
from kvtier.proto.auth import CLUSTER_PRINCIPAL
from kvtier.proto.keys import check_namespace


@dataclass(frozen=True, slots=True)
class ClientConfig:
    master: str
    namespace: str = "default"
    timeout: float = 5.0  # seconds for one call, master retries and transfers included
    connections_per_segment: int = 4  # pooled data-plane sockets per segment endpoint
    io_threads: int = 4  # threads serving one batch's segments in parallel (per client)
    # A same-host (shm) batch is a memcpy and a CRC32C in this process, both with the GIL released:
    # one segment's share of a batch, when large enough, is copied by this many threads at once, the
    # calling thread and copy_threads - 1 of a pool of their own (kvtier.client.reads.split_copy).
    # 1: by the calling thread alone.
    copy_threads: int = 2
    connector_idle_s: float = 60.0  # a segment connection (socket pool, mapping) unused this long is closed
    frame_bytes: int = 64 << 20  # payload bytes per data-plane frame (large objects get a frame each)
    transport: str = ""  # force a scheme ("tcp"); default from KVTIER_TRANSPORT, else best available
    # A segment this client's transfers just failed on (kvtier.client.failures) is avoided by its
    # puts this long; failures are reported to the master at most once per interval (quarantine).
    avoid_failed_s: float = 10.0
    failure_report_interval_s: float = 0.5
    # A put whose bytes all go to one segment over tcp sends its PutEnd behind its WRITE, for the
    # segment to relay (kvtier.client.commit): one round trip less. False: always to the master.
    commit_through_segment: bool = True
    # Direct reads (kvtier.client.locations): where the last lookups found small DRAM objects, for this
    # many keys at most; a get of one of them asks its segment alone (one round trip, no master),
    # which serves it only if its own index still says that object is there. 0: every get asks the
    # master first.
    location_cache_keys: int = 4096
    # Credentials (docs/security.md); each defaults to its KVTIER_* variable: the cluster's or a
    # tenant's secret (a file, or KVTIER_SECRET itself), the principal it proves ("cluster", or the
    # tenant's name), and TLS to the master (the CA of its certificate; a client certificate for mTLS).
    secret_file: str = ""  # KVTIER_SECRET_FILE
    principal: str = ""  # KVTIER_PRINCIPAL; "" = cluster
    tls_ca_file: str = ""  # KVTIER_TLS_CA_FILE
    tls_cert_file: str = ""  # KVTIER_TLS_CERT_FILE
    tls_key_file: str = ""  # KVTIER_TLS_KEY_FILE

    def validate(self) -> ClientConfig:
        check_namespace(self.namespace)
        if not self.master:
            raise ValueError("master address is required, e.g. 127.0.0.1:50051")
        check_master_spec(self.master)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.frame_bytes < 1:
            raise ValueError(f"frame_bytes must be positive, got {self.frame_bytes}")
        if self.connections_per_segment < 1:
            raise ValueError("connections_per_segment must be at least 1")
        if self.connector_idle_s <= 0:
            raise ValueError("connector_idle_s must be positive")
        if self.io_threads < 1:
            raise ValueError("io_threads must be at least 1")
        if self.copy_threads < 1:
            raise ValueError("copy_threads must be at least 1")
        if self.location_cache_keys < 0:
            raise ValueError(f"location_cache_keys must be 0 (off) or more, got {self.location_cache_keys}")
        return self

    def credentials(self, secret: bytes | None = None) -> Credentials:
        """The credentials this client presents; ValueError with one line when they cannot be read."""
        env = os.environ.get
        return Credentials.load(
            secret=secret,
            secret_file=self.secret_file or env("KVTIER_SECRET_FILE", ""),
            principal=self.principal or env("KVTIER_PRINCIPAL", "") or CLUSTER_PRINCIPAL,
            tls_ca_file=self.tls_ca_file or env("KVTIER_TLS_CA_FILE", ""),
            tls_cert_file=self.tls_cert_file or env("KVTIER_TLS_CERT_FILE", ""),
            tls_key_file=self.tls_key_file or env("KVTIER_TLS_KEY_FILE", ""),
        )

    @staticmethod
    def metrics_override() -> bool:
        """KVTIER_CLIENT_METRICS=1: every Client of the process reports to Prometheus (kvtier.client.metrics)."""
        return os.environ.get("KVTIER_CLIENT_METRICS", "").strip().lower() in ("1", "true", "yes", "on")

    @staticmethod
    def transport_override() -> str:
        return os.environ.get("KVTIER_TRANSPORT", "").strip().lower()
