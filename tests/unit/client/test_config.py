"""ClientConfig validation, and the KVTIER_TRANSPORT override as a Client applies it."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.client import Client, InvalidKeyError
from kvtier.client.config import ClientConfig

MASTER = "127.0.0.1:1"  # never contacted: the tests below make no call


@pytest.fixture(autouse=True)
def _no_transport_env(monkeypatch):
    monkeypatch.delenv("KVTIER_TRANSPORT", raising=False)


@pytest.fixture
def clients():
    """Creates Clients (which connect lazily); closes them at teardown."""
    made: list[Client] = []

    def make(**kwargs) -> Client:
        client = Client(MASTER, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def test_defaults_are_valid():
    config = ClientConfig(master=MASTER)
    assert config.validate() is config
    assert (config.namespace, config.transport) == ("default", "")
    assert config.timeout > 0 and config.connections_per_segment >= 1 and config.io_threads >= 1


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientConfig(master=MASTER).timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"master": ""}, "master address is required"),
        ({"timeout": 0.0}, "timeout must be positive"),
        ({"timeout": -1.0}, "timeout must be positive"),
        ({"connections_per_segment": 0}, "connections_per_segment must be at least 1"),
        ({"connector_idle_s": 0.0}, "connector_idle_s must be positive"),
        ({"connector_idle_s": -5.0}, "connector_idle_s must be positive"),
        ({"io_threads": 0}, "io_threads must be at least 1"),
    ],
)
def test_invalid_values_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig(**{"master": MASTER, **changes}).validate()


@pytest.mark.parametrize("namespace", ["", "a\x00b", "n" * 257, 7])
def test_invalid_namespaces_are_refused(namespace):
    with pytest.raises(InvalidKeyError):
        ClientConfig(master=MASTER, namespace=namespace).validate()


def test_the_client_validates_its_config(clients):
    with pytest.raises(ValueError, match="timeout must be positive"):
        clients(timeout=0)
    with pytest.raises(ValueError, match="connections_per_segment"):
        clients(connections_per_segment=0)
    with pytest.raises(ValueError, match="io_threads"):
        clients(io_threads=0)
    with pytest.raises(InvalidKeyError):
        clients(namespace="")


@pytest.mark.parametrize(("value", "expected"), [("tcp", "tcp"), (" TCP\n", "tcp"), ("Shm", "shm"), ("", "")])
def test_kvtier_transport_is_read_trimmed_and_lowercased(monkeypatch, value, expected):
    monkeypatch.setenv("KVTIER_TRANSPORT", value)
    assert ClientConfig.transport_override() == expected


def test_without_kvtier_transport_there_is_no_override(clients):
    assert ClientConfig.transport_override() == ""
    assert clients().config.transport == ""


def test_kvtier_transport_sets_the_clients_transport(monkeypatch, clients):
    monkeypatch.setenv("KVTIER_TRANSPORT", "tcp")
    assert clients().config.transport == "tcp"


def test_an_explicit_transport_wins_over_kvtier_transport(monkeypatch, clients):
    monkeypatch.setenv("KVTIER_TRANSPORT", "tcp")
    assert clients(transport="shm").config.transport == "shm"


def test_kvtier_transport_is_read_when_the_client_is_made(monkeypatch, clients):
    monkeypatch.setenv("KVTIER_TRANSPORT", "shm")
    before = clients()
    monkeypatch.setenv("KVTIER_TRANSPORT", "tcp")
    assert before.config.transport == "shm"
    assert clients().config.transport == "tcp"


@pytest.mark.parametrize("transport", ["tpc", "rdma", "carrier-pigeon"])
def test_a_client_refuses_a_transport_it_cannot_use(transport):
    with pytest.raises(ValueError, match="cannot be used"):
        Client("127.0.0.1:1", transport=transport)


def test_a_mistyped_kvtier_transport_fails_at_construction(monkeypatch):
    monkeypatch.setenv("KVTIER_TRANSPORT", "tpc")
    with pytest.raises(ValueError, match="'tpc'"):
        Client("127.0.0.1:1")


def test_transport_names_are_case_insensitive():
    with Client("127.0.0.1:1", transport=" TCP ") as client:
        assert client.config.transport == "tcp"


def test_frame_bytes_must_be_positive():
    with pytest.raises(ValueError, match="frame_bytes"):
        ClientConfig(master="127.0.0.1:1", frame_bytes=0).validate()
