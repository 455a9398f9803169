"""A real single-member etcd for tests: `EtcdServer(tmp_path)` runs /usr/bin/etcd on free loopback ports.

`EtcdServer(tmp_path, tls=PKI)` serves its clients over TLS with PKI's server.pem/server.key (a
directory as made by tests/integration/test_tls.py's `pki` fixture), `client_cert_auth=True` also
requires a client certificate signed by PKI's ca.pem; `enable_auth(password)` turns etcd's user
auth on with a root user.

The raft timings are shortened (heartbeat 50 ms, election 500 ms): the member
elects itself faster at start-up, and etcd's minimum lease TTL, 1.5 x the
election timeout rounded up, drops from 2 s to 1 s, so election tests can use
1 s leases.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import grpc
import pytest

from kvtier.common.supervisor import Supervisor
from kvtier.proto.etcd import rpc_pb2, rpc_pb2_grpc

ETCD_BINARY = os.environ.get("KVTIER_TEST_ETCD", "/usr/bin/etcd")
READY_TIMEOUT_S = 20.0


def etcd_available() -> bool:
    return shutil.which(ETCD_BINARY) is not None


def require_etcd() -> None:
    """Skip the calling test where etcd is not installed; fail it under CI, where .ci/run installs
    etcd-server and a skip would hide a broken setup."""
    if etcd_available():
        return
    if os.environ.get("CI"):
        pytest.fail(f"etcd not installed at {ETCD_BINARY} in CI")
    pytest.skip(f"etcd not installed at {ETCD_BINARY} (apt-get install etcd-server, or set KVTIER_TEST_ETCD)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member as a subprocess; started by the constructor, ready to serve when it returns."""

    def __init__(
        self,
        workdir: Path,
        name: str = "etcd",
        *,
        tls: Path | None = None,
        client_cert_auth: bool = False,
        auth_token_ttl_s: int = 300,
    ) -> None:
        self.workdir = workdir
        self.name = name
        self.port = _free_port()
        self.peer_port = _free_port()
        self.log = workdir / f"{name}.log"
        self.paused = False
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        client_url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            ETCD_BINARY,
            "--name", name,
            "--data-dir", str(workdir / f"{name}.data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{name}={peer_url}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--auth-token-ttl", str(auth_token_ttl_s),
        ]  # fmt: skip
        if tls is not None:
            args += ["--cert-file", str(tls / "server.pem"), "--key-file", str(tls / "server.key")]
            if client_cert_auth:
                args += ["--client-cert-auth", "--trusted-ca-file", str(tls / "ca.pem")]
        self._supervisor = Supervisor(workdir, grace_s=5.0)
        # gRPC waits 1 s before reconnecting after a refused connection by default: poll faster.
        options = {"grpc.initial_reconnect_backoff_ms": 20, "grpc.min_reconnect_backoff_ms": 20}
        with self.channel(**options) as channel:
            kv = rpc_pb2_grpc.KVStub(channel)

            def answers() -> bool:  # a real linearizable read: etcd answers only once it has a raft leader
                try:
                    kv.Range(rpc_pb2.RangeRequest(key=b"/ready-probe"), timeout=0.5)
                    return True
                except grpc.RpcError:
                    return False

            try:
                self.child = self._supervisor.start(
                    name, args, log=self.log, probe=answers, timeout=READY_TIMEOUT_S, poll_s=0.05
                )
            except BaseException:
                self._supervisor.close()
                raise
        self.popen = self.child.popen

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def channel(self, **options) -> grpc.Channel:
        """A channel to this member as an administrator: TLS (with the client certificate) when served so."""
        opts = list(options.items())
        if self.tls is None:
            return grpc.insecure_channel(self.endpoint, options=opts)
        credentials = grpc.ssl_channel_credentials(
            (self.tls / "ca.pem").read_bytes(),
            (self.tls / "client.key").read_bytes() if self.client_cert_auth else None,
            (self.tls / "client.pem").read_bytes() if self.client_cert_auth else None,
        )
        return grpc.secure_channel(self.endpoint, credentials, options=opts)

    def enable_auth(self, root_password: str) -> None:
        """etcd's user auth on: a root user (with the root role) whose password is `root_password`."""
        with self.channel() as channel:
            auth = rpc_pb2_grpc.AuthStub(channel)
            auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password=root_password), timeout=5)
            auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=5)

    def tail(self, lines: int = 30) -> str:
        return self.child.tail(lines)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing is answered, like a frozen host. Returns once
        every thread of it has stopped, so nothing sent after pause() is answered."""
        self.child.pause()
        self.paused = True

    def resume(self) -> None:
        self.child.resume()
        self.paused = False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a paused etcd is resumed) and wait; SIGKILL if it does not exit in time. Idempotent."""
        self._supervisor.stop(self.child, grace_s=timeout)
        self._supervisor.close()
        self.paused = False

    def kill(self) -> None:
        self.child.kill()  # works on a stopped process too
