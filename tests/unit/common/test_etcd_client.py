"""The parts of the etcd client that need no server: endpoint and URL parsing, prefix ranges."""

from __future__ import annotations

import pytest

from kvtier.common.etcd_client import EtcdClient, EtcdError, normalize_endpoint, parse_etcd_url, prefix_range_end
from kvtier.proto.errors import TransportError
from kvtier.proto.status import Status


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("127.0.0.1:2379", "127.0.0.1:2379"),
        ("http://etcd-0:2379", "etcd-0:2379"),
        (" http://etcd-0:2379/ ", "etcd-0:2379"),
        ("[::1]:2379", "[::1]:2379"),
        ("https://etcd-0:2379", "etcd-0:2379"),  # TLS is EtcdSecurity's (a CA file), not the scheme's
    ],
)
def test_normalize_endpoint(endpoint, expected):
    assert normalize_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["etcd-0", "etcd-0:", ":2379", "h:99999", "h:x", "grpcs://h:2379", "unix:///s"])
def test_bad_endpoints(endpoint):
    with pytest.raises(ValueError):
        normalize_endpoint(endpoint)


def test_parse_etcd_url():
    assert parse_etcd_url("etcd://h1:2379,h2:2379/prod-1") == (["h1:2379", "h2:2379"], "prod-1")
    assert parse_etcd_url("etcd://127.0.0.1:2379/c") == (["127.0.0.1:2379"], "c")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://h:2379/c", "not an etcd URL"),
        ("etcd://h:2379", "names no cluster"),
        ("etcd://h:2379/", "names no cluster"),
        ("etcd:///c", "names no etcd endpoint"),
        ("etcd://h:2379/a.b", "cluster_id"),
        ("etcd://h/c", "host:port"),
    ],
)
def test_bad_etcd_urls(url, reason):
    with pytest.raises(ValueError, match=reason):
        parse_etcd_url(url)


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"/kvtier/", b"/kvtier0"), (b"a", b"b"), (b"a\xff", b"b"), (b"\xff\xff", b"\0"), (b"", b"\0")],
)
def test_prefix_range_end(prefix, end):
    assert prefix_range_end(prefix) == end


def test_client_accepts_comma_lists_and_needs_an_endpoint():
    with EtcdClient("http://a:1, b:2") as client:
        assert client.endpoints == ["a:1", "b:2"]
        assert client.endpoint == "a:1"
    with pytest.raises(ValueError):
        EtcdClient([])


def test_errors_are_transport_errors_naming_the_endpoint():
    error = EtcdError("Range failed", endpoint="h:2379")
    assert isinstance(error, TransportError) and error.retryable
    assert error.status == Status.UNAVAILABLE
    assert "h:2379" in str(error)


def test_closed_client_raises_etcd_error():
    client = EtcdClient("127.0.0.1:1")
    client.close()
    client.close()  # idempotent
    with pytest.raises(EtcdError, match="closed"):
        client.get("/k")


def test_an_https_endpoint_without_a_ca_file_is_refused_rather_than_tried_in_plaintext():
    with pytest.raises(ValueError, match="etcd_ca_file"):
        EtcdClient("https://127.0.0.1:2379")
