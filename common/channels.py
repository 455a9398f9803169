"""gRPC channels to the master, with this process's credentials: a token, and TLS when configured.

Clients and segment servers build their master channels here, so both present
the same credentials the same way: the bearer token (kvtier.proto.auth) in the
`authorization` metadata of every call, and, with `tls_ca_file`, a TLS channel
that verifies the master's certificate (plus a client certificate for mTLS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvtier.proto.auth import AUTH_METADATA, CLUSTER_PRINCIPAL, make_token, principal_problem, read_secret
from kvtier.proto.rpcframe import MESSAGE_LIMIT

# While a call is open (an event stream most of all: it may carry nothing for hours), a ping every
# 20 s, and a master that does not answer one within 10 s is gone: the call breaks (UNAVAILABLE)
# instead of waiting for good on a frozen or cut-off host that sent no reset. The master takes a
# ping without data every 10 s at most (kvtier.master.server.MIN_CLIENT_PING_INTERVAL_MS).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    # gRPC's own reconnect backoff starts at 1 s and grows to 120 s: a segment whose master restarted
    # stayed unable to reach it for a second or more after it listened again, and missed the recovery
    # gate (its index then discarded). Our callers retry with their own bounded backoff; the channel
    # reconnects within 100 ms to 1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # The wait for a ping's acknowledgement is this one in the gRPC core we run (default 60 s; the
    # keepalive timeout above alone left a stopped master's stream open for 60 s more).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),  # idle channels: the master closes them (idle_timeout_s)
    ("grpc.http2.max_pings_without_data", 0),  # an idle stream sends no data: keep pinging it
]


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class Credentials:
    # Never in a repr (a debug log or a traceback's locals): the token is a bearer credential.
    token: str = field(default="", repr=False)  # "" = present none (a master without a secret accepts that)
    tls_ca: bytes | None = None  # PEM roots that sign the master's certificate; None = plain TCP
    tls_cert: bytes | None = field(default=None, repr=False)  # client certificate chain (mTLS), PEM
    tls_key: bytes | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @classmethod
    def load(
        cls,
        *,
        secret: bytes | None = None,
        secret_file: str = "",
        principal: str = CLUSTER_PRINCIPAL,
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
    ) -> Credentials:
        """Read the secret (`secret`, else `secret_file`, else $KVTIER_SECRET) and the TLS files;
        ValueError (SecretError) with one line when something is wrong."""
        if problem := principal_problem(principal):
            raise ValueError(problem)
        if secret is None:
            secret = read_secret(secret_file)
        if bool(tls_cert_file) != bool(tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together (a client certificate and its key)")
        if tls_cert_file and not tls_ca_file:
            raise ValueError("a client certificate (tls_cert_file) needs tls_ca_file, the roots of the master's")
        return cls(
            token=make_token(secret, principal) if secret else "",
            tls_ca=read_file(tls_ca_file, "TLS CA file (tls_ca_file)") if tls_ca_file else None,
            tls_cert=read_file(tls_cert_file, "TLS certificate (tls_cert_file)") if tls_cert_file else None,
            tls_key=read_file(tls_key_file, "TLS key (tls_key_file)") if tls_key_file else None,
        )


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ((AUTH_METADATA, token),)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        # gRPC's call details are a namedtuple: a copy with the token added
        metadata = tuple(details.metadata or ()) + self._metadata
        return continuation(details._replace(metadata=metadata), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        """Streams too (WatchEvents): the same token."""
        return self.intercept_unary_unary(continuation, details, request)


def open_channel(address: str, credentials: Credentials) -> grpc.Channel:
    """A channel to the master at `address` presenting `credentials` on every call."""
    if credentials.tls:
        ssl = grpc.ssl_channel_credentials(credentials.tls_ca, credentials.tls_key, credentials.tls_cert)
        channel = grpc.secure_channel(address, ssl, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if credentials.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(credentials.token))
    return channel
