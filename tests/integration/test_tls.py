"""gRPC to the master over TLS, and mutual TLS (issue 8). Certificates are made with openssl."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvtier.client import Client, KvtierError
from tests.integration.test_security import secret_file

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None and not os.environ.get("CI"), reason="openssl is not installed"
)


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=kvtier test CA", cwd=d)  # fmt: skip
    for name, extra in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=kvtier {name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(extra + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    for key in d.glob("*.key"):
        os.chmod(key, 0o600)
    return d


def test_master_over_tls_with_client_certificates(bare_cluster, pki, tmp_path):
    bare_cluster.secret_file = secret_file(tmp_path, "cluster.secret")
    bare_cluster.start_master(
        "--tls-cert-file", str(pki / "server.pem"),
        "--tls-key-file", str(pki / "server.key"),
        "--tls-client-ca-file", str(pki / "ca.pem"),
    )  # fmt: skip
    assert bare_cluster.master.info["fast_endpoint"] == "", "no fast path under TLS: its frames are plain TCP"
    tls = {"tls_ca_file": str(pki / "ca.pem")}
    mtls = {**tls, "tls_cert_file": str(pki / "client.pem"), "tls_key_file": str(pki / "client.key")}
    bare_cluster.start_segment(
        "seg0", "16MiB",
        "--tls-ca-file", mtls["tls_ca_file"],
        "--tls-cert-file", mtls["tls_cert_file"],
        "--tls-key-file", mtls["tls_key_file"],
    )  # fmt: skip
    master = bare_cluster.master.info["address"]
    with bare_cluster.client(transport="tcp", **mtls) as client:
        client.put("k", b"over tls")
        assert client.get("k") == b"over tls"
    for kwargs in ({}, tls):  # plain TCP to a TLS port; TLS without a client certificate
        with Client(master, timeout=2.0, secret_file=bare_cluster.secret_file, **kwargs) as refused:
            with pytest.raises(KvtierError):
                refused.put("k2", b"v")
    with bare_cluster.client(**mtls) as client:
        assert client.get("k2") is None and client.get("k") == b"over tls"


def test_a_client_refuses_a_master_certificate_it_cannot_verify(bare_cluster, pki, tmp_path):
    bare_cluster.start_master("--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key"))
    other_ca = tmp_path / "other.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", str(other_ca),
             "-days", "1", "-subj", "/CN=someone else", cwd=tmp_path)  # fmt: skip
    with Client(bare_cluster.master.info["address"], timeout=2.0, tls_ca_file=str(other_ca)) as client:
        with pytest.raises(KvtierError):
            client.put("k", b"v")
