"""`connect()`: which connector a segment's endpoints get, and why not when none fits.

TCP connectors connect lazily, so a tcp endpoint to a closed port is enough;
the shm cases map a real DramRegion in a tmp directory, granted by a real
ShmListener (tests/grants.py).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from kvtier.client.config import ClientConfig
from kvtier.client.transport import CONNECTORS, PREFERENCE, UNAVAILABLE, connect
from kvtier.client.transport.shm import ShmConnector
from kvtier.client.transport.tcp import TcpConnector
from kvtier.proto.errors import ConnectError
from kvtier.segment_server.region import DramRegion, grant_socket_path, region_path
from tests.grants import GrantLoop


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TCP = f"tcp://127.0.0.1:{closed_port()}"


def config(transport: str = "") -> ClientConfig:
    return ClientConfig(master="127.0.0.1:1", transport=transport)


@pytest.fixture
def region(tmp_path: Path):
    region = DramRegion(region_path(str(tmp_path), "treg", "seg0"), 1 << 20, "treg", "seg0").open()
    yield region
    region.close()


@pytest.fixture
def shm_url(region: DramRegion, grants: GrantLoop, tmp_path: Path) -> str:
    return grants.serve(grant_socket_path(str(tmp_path), "treg", "seg0"), region.fileno(), region.nonce)[0]


@pytest.fixture
def foreign_shm_url(region: DramRegion, grants: GrantLoop, tmp_path: Path) -> str:
    socket_path = str(tmp_path / "foreign.sock")
    return grants.serve(socket_path, region.fileno(), region.nonce, host="other-machine:other-boot")[0]


@pytest.fixture
def connected():
    """Calls connect() and closes what it returns at teardown."""
    opened = []

    def call(endpoints, cfg: ClientConfig):
        connector = connect(endpoints, cfg)
        opened.append(connector)
        return connector

    yield call
    for connector in opened:
        connector.close()


def test_the_registry_lists_what_it_prefers():
    assert PREFERENCE == ("rdma", "shm", "tcp")
    assert CONNECTORS == {"shm": ShmConnector, "tcp": TcpConnector}
    assert "rdma" in UNAVAILABLE and "rdma" not in CONNECTORS


def test_tcp_alone_connects_lazily(connected):
    connector = connected([TCP], config())
    assert isinstance(connector, TcpConnector)
    assert connector.endpoint == TCP


@pytest.mark.parametrize("order", ["shm-first", "tcp-first"])
def test_shm_is_preferred_over_tcp_whatever_the_advertised_order(connected, shm_url, order):
    endpoints = [shm_url, TCP] if order == "shm-first" else [TCP, shm_url]
    connector = connected(endpoints, config())
    assert isinstance(connector, ShmConnector)
    assert connector.endpoint == shm_url


def test_shm_on_another_host_falls_back_to_tcp(connected, foreign_shm_url, caplog):
    with caplog.at_level(logging.DEBUG, logger="kvtier.client.transport"):
        connector = connected([foreign_shm_url, TCP], config())
    assert isinstance(connector, TcpConnector)
    assert "transport shm not usable" in caplog.text


def test_an_unusable_shm_region_falls_back_to_tcp(connected, region, grants, shm_url, tmp_path):
    stopped, listener = grants.serve(str(tmp_path / "stopped.sock"), region.fileno(), region.nonce)
    grants.stop(listener)  # its socket is gone
    wrong_nonce = shm_url.replace(region.nonce.hex(), bytes(16).hex())
    other_uid, _ = grants.serve(str(tmp_path / "other-uid.sock"), region.fileno(), region.nonce)
    other_uid = other_uid.replace(f"&uid={os.geteuid()}", f"&uid={os.geteuid() + 1}")  # not the server's uid
    malformed = shm_url.replace(region.nonce.hex(), "zz")
    for url in (stopped, wrong_nonce, other_uid, malformed):
        assert isinstance(connected([url, TCP], config()), TcpConnector), url


def test_rdma_advertised_but_unavailable_falls_back(connected, shm_url):
    connector = connected(["rdma://10.0.0.1:4791", shm_url, TCP], config())
    assert isinstance(connector, ShmConnector)
    assert isinstance(connected(["rdma://10.0.0.1:4791", TCP], config()), TcpConnector)


def test_no_usable_transport_says_why(foreign_shm_url):
    with pytest.raises(ConnectError, match=r"no usable transport .*shm: segment region .* is on another host"):
        connect([foreign_shm_url], config())
    with pytest.raises(ConnectError, match="no usable transport"):
        connect(["rdma://10.0.0.1:4791"], config())


@pytest.mark.parametrize(
    "endpoints",
    [
        [],
        ["quic://127.0.0.1:4000"],  # a scheme this client does not know
        ["127.0.0.1:4000"],  # no scheme at all
        ["tcp:/127.0.0.1:4000"],  # not a URL
        [""],
    ],
)
def test_unknown_or_missing_schemes_are_connect_errors(endpoints):
    with pytest.raises(ConnectError, match="no usable transport"):
        connect(endpoints, config())


def test_an_unknown_scheme_next_to_a_known_one_is_skipped(connected):
    assert isinstance(connected(["quic://127.0.0.1:4000", "127.0.0.1:4001", TCP], config()), TcpConnector)


# ------------------------------------------------------------------ forcing one transport


def test_forcing_tcp_skips_a_usable_shm(connected, shm_url):
    connector = connected([shm_url, TCP], config("tcp"))
    assert isinstance(connector, TcpConnector)


def test_forcing_shm_uses_it(connected, shm_url):
    assert isinstance(connected([shm_url, TCP], config("shm")), ShmConnector)


def test_forcing_shm_does_not_fall_back(foreign_shm_url):
    with pytest.raises(ConnectError, match="another host"):
        connect([foreign_shm_url, TCP], config("shm"))


def test_forcing_a_transport_the_segment_does_not_serve(shm_url):
    with pytest.raises(ConnectError, match=r"segment does not serve transport 'tcp' \(it serves \['shm'\]\)"):
        connect([shm_url], config("tcp"))
    with pytest.raises(ConnectError, match="does not serve transport 'shm'"):
        connect([TCP], config("shm"))


@pytest.mark.parametrize(
    ("transport", "reason"),
    [("rdma", "no RDMA connector yet"), ("bogus", "unknown scheme"), ("TCP", "unknown scheme")],
)
def test_forcing_an_unavailable_transport_says_why(transport, reason):
    with pytest.raises(ConnectError, match=f"transport '{transport}' is not available: {reason}"):
        connect([TCP, f"{transport}://127.0.0.1:1"], config(transport))
