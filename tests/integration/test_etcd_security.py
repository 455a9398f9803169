"""A secured etcd (issue 22): TLS with client certificates, and etcd user auth with the user and
password read from a file, against a real etcd (tests/etcd.py) with real masters and segments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.common.config import EtcdSecurity
from kvtier.common.discovery import leader_key
from kvtier.common.etcd_client import EtcdClient, EtcdError
from tests.etcd import EtcdServer, etcd_available
from tests.integration.test_tls import pki  # noqa: F401  (the fixture: a CA, server and client certificates)

pytestmark = [
    pytest.mark.skipif(not etcd_available() and not os.environ.get("CI"), reason="etcd is not installed"),
    pytest.mark.skipif(shutil.which("openssl") is None and not os.environ.get("CI"), reason="openssl missing"),
]


def credentials(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"etcd-{abs(hash(text))}.credentials"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def tls_flags(pki: Path) -> list[str]:  # noqa: F811
    return [
        "--etcd-ca-file", str(pki / "ca.pem"),
        "--etcd-cert-file", str(pki / "client.pem"),
        "--etcd-key-file", str(pki / "client.key"),
    ]  # fmt: skip


def master_start_error(cluster, etcd: EtcdServer, *flags: str) -> str:
    """The one line a master prints when it exits 2 at start against this etcd."""
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.master", "--listen", "127.0.0.1:0", "--cluster-id", cluster.cluster_id,
         "--etcd", f"etcd://{etcd.endpoint}/{cluster.cluster_id}", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines, "no error printed"
    return lines[-1]


def serve_through_leader(cluster, flags: list[str]) -> None:
    """A master campaigning on the secured etcd becomes leader; a segment finds it there; data flows."""
    cluster.start_ha_masters(cluster.etcd.endpoint, 1, "--etcd-lease-ttl-s", "2", "--recovery-timeout-s", "1", *flags)
    cluster.start_segment("seg0", "16MiB", *flags)  # the segment finds the leader in etcd
    with Client(cluster.masters["master0"].info["address"], timeout=10.0) as client:
        client.put("secured", b"etcd")
        assert client.get("secured") == b"etcd"


def test_masters_and_segments_use_etcd_over_tls_with_client_certificates(bare_cluster, pki, tmp_path):  # noqa: F811
    etcd = EtcdServer(tmp_path, tls=pki, client_cert_auth=True)
    bare_cluster.etcd = etcd
    try:
        # the client itself: the CA alone is not enough for --client-cert-auth, plaintext never works
        secure = EtcdSecurity(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
        with EtcdClient(etcd.url, timeout=3.0, security=secure) as client:
            client.put("/probe", b"tls")
            assert client.get("/probe").value == b"tls"
        for security in (None, EtcdSecurity(ca_file=str(pki / "ca.pem"))):
            with EtcdClient(etcd.endpoint, timeout=1.0, security=security) as client:
                with pytest.raises(EtcdError):
                    client.get("/probe")
        # a master without the TLS options stops at start with one line saying what to set
        line = master_start_error(bare_cluster, etcd)
        assert "cannot reach etcd" in line and "etcd_ca_file" in line, line
        serve_through_leader(bare_cluster, tls_flags(pki))
    finally:
        bare_cluster.stop()
        etcd.stop()


def test_masters_and_segments_authenticate_to_etcd_with_a_credentials_file(bare_cluster, tmp_path):
    etcd = EtcdServer(tmp_path)
    etcd.enable_auth("s3cret:with:colons")
    bare_cluster.etcd = etcd
    good = credentials(tmp_path, "root:s3cret:with:colons")
    try:
        line = master_start_error(bare_cluster, etcd)  # no credentials: etcd refuses
        assert "etcd refused this master" in line and "etcd_credentials_file" in line, line
        wrong = credentials(tmp_path, "root:nope")
        line = master_start_error(bare_cluster, etcd, "--etcd-credentials-file", str(wrong))
        assert str(wrong) in line and "Authenticate as 'root' failed" in line, line
        readable = credentials(tmp_path, "root:s3cret:with:colons-", mode=0o644)
        line = master_start_error(bare_cluster, etcd, "--etcd-credentials-file", str(readable))
        assert "etcd_credentials_file" in line and "readable by others" in line, line
        serve_through_leader(bare_cluster, ["--etcd-credentials-file", str(good)])
        # the election and discovery keys were written and read under etcd auth
        security = EtcdSecurity(credentials_file=str(good))
        with EtcdClient(etcd.endpoint, security=security) as client:
            assert client.get(leader_key(bare_cluster.cluster_id)) is not None
    finally:
        bare_cluster.stop()
        etcd.stop()


def test_an_expired_auth_token_is_renewed_for_calls_and_lease_keepalives(tmp_path):
    ttl = 1  # etcd forgets a simple token unused this long
    etcd = EtcdServer(tmp_path, auth_token_ttl_s=ttl)
    try:
        etcd.enable_auth("pw")
        security = EtcdSecurity(credentials_file=str(credentials(tmp_path, "root:pw")))
        with EtcdClient(etcd.endpoint, timeout=3.0, security=security) as client:
            lease = client.grant(30)  # outlives the two waits below
            client.put("/k", b"1", lease)
            assert client.keepalive(lease) > 0
            time.sleep(ttl + 1.5)  # past the token's TTL (the timeout under test), nothing else running
            assert client.get("/k").value == b"1"  # re-authenticated, retried once
            time.sleep(ttl + 1.5)
            assert client.keepalive(lease) > 0
    finally:
        etcd.stop()


def test_bad_etcd_security_options_exit_2_naming_the_option(tmp_path, pki):  # noqa: F811
    cases = [
        (["--etcd-ca-file", str(pki / "ca.pem")], "need etcd"),  # no etcd at all
        (["--etcd", "etcd://127.0.0.1:1/default", "--etcd-cert-file", str(pki / "client.pem")], "etcd_key_file"),
        (["--etcd", "etcd://127.0.0.1:1/default", "--etcd-ca-file", str(tmp_path / "missing.pem")], "etcd_ca_file"),
        (["--etcd", "etcd://127.0.0.1:1/default", "--etcd-ca-file", str(pki / "client.ext")], "not a PEM"),
        (["--etcd", "https://127.0.0.1:1"], "etcd_ca_file"),  # https:// without a CA
    ]
    for flags, expected in cases:
        argv = [sys.executable, "-m", "kvtier.master", *flags, "--print-config"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (flags, result.stderr)
        assert expected in result.stderr, (flags, result.stderr)
