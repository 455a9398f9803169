"""The identity namespace shared by the engine adapters (issue 9)."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.client.integrations.common import Guard, KvtierSettings
from kvtier.client.integrations.identity import Identity, IdentityError, block_key
from kvtier.proto.keys import check_namespace

BASE = Identity(
    engine="vllm",
    model="meta-llama/Llama-3.1-8B-Instruct",
    kv_dtype="bfloat16",
    layout="NHD",
    tokens_per_block=16,
    hash_scheme="sha256_cbor",
    tp_size=2,
    tp_rank=1,
)


@pytest.mark.parametrize(
    "change",
    [
        {"engine": "sglang"},
        {"model": "meta-llama/Llama-3.1-70B-Instruct"},
        {"revision": "abc123"},
        {"kv_dtype": "float8_e4m3fn"},
        {"layout": "HND"},
        {"tokens_per_block": 32},
        {"hash_scheme": "sha256"},
        {"hash_seed": "42"},
        {"tp_size": 4},
        {"tp_rank": 0},
        {"pp_size": 2},
        {"extra": "kv_heads=8"},
        {"format_version": 2},
    ],
)
def test_every_field_changes_the_namespace(change):
    other = dataclasses.replace(BASE, **change)
    assert other.namespace() != BASE.namespace()


def test_the_namespace_is_stable_readable_and_valid():
    assert BASE.namespace() == dataclasses.replace(BASE).namespace()
    name = BASE.namespace("alice")
    assert name.startswith("alice.vllm.meta-llama_Llama-3.1-8B-Instruct.bfloat16.tp1of2.pp0of1.")
    assert check_namespace(name) == name and len(name.encode()) <= 256
    long = dataclasses.replace(BASE, model="m" * 500).namespace("p" * 100)
    assert check_namespace(long) == long


def test_rankless_models_share_one_copy_across_tp_ranks():
    ranks = [dataclasses.replace(BASE, rankless=True, tp_rank=r) for r in range(2)]
    assert ranks[0].namespace() == ranks[1].namespace()
    assert ranks[0].namespace() != BASE.namespace()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hash_scheme": "builtin"}, "PYTHONHASHSEED"),
        ({"kv_dtype": ""}, "needs kv_dtype"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"tp_rank": 2}, "outside its group"),
    ],
)
def test_identities_that_would_share_wrongly_or_never_are_refused(change, message):
    with pytest.raises(IdentityError, match=message):
        dataclasses.replace(BASE, **change).validate()
    assert dataclasses.replace(BASE, hash_scheme="builtin", hash_seed="0").validate()


def test_block_keys():
    assert block_key(b"\x01\xff") == "01ff"
    assert block_key(255) == "ff" and block_key(-1) == "f" * 64
    assert block_key("abc") == "abc"


def test_settings_from_engine_config_and_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_MASTER", "10.0.0.1:50051")
    settings = KvtierSettings.from_config({"kvtier_timeout": "2.5", "replicas": 2, "other_engine_key": 1})
    assert (settings.master, settings.timeout, settings.replicas, settings.enabled) == ("10.0.0.1:50051", 2.5, 2, True)
    assert not KvtierSettings.from_config({"enabled": "false"}).enabled
    assert settings.copy_threads == 2 and KvtierSettings.from_config({"kvtier_copy_threads": "1"}).copy_threads == 1
    with pytest.raises(ValueError, match="kvtier_copy_threads must be at least 1"):
        KvtierSettings.from_config({"copy_threads": 0})
    monkeypatch.setenv("KVTIER_DISABLE", "1")
    assert not KvtierSettings.from_config({}).enabled


def test_guard_turns_failures_into_fallbacks_and_counts_them():
    guard = Guard("test")
    assert guard.call("get", lambda: 1 / 0, fallback=None) is None
    assert guard.call("get", lambda: 7, fallback=None) == 7
    assert guard.stats() == {"errors": 1}


def test_guard_stops_calling_an_unreachable_kvtier_for_a_moment():
    import time

    from kvtier.proto.errors import ConnectError

    guard = Guard("test", cooldown_s=0.3)
    calls = []

    def unreachable():
        calls.append(1)
        raise ConnectError("master down")

    assert guard.call("lookup", unreachable, fallback=0) == 0
    assert guard.call("lookup", unreachable, fallback=0) == 0  # answered at once: not called
    assert len(calls) == 1 and guard.stats() == {"errors": 1, "short_circuited": 1}
    time.sleep(0.35)
    assert guard.call("lookup", lambda: 5, fallback=0) == 5, "tried again after the cooldown"
    # A call refused for its own reasons does not stop the others.
    other = Guard("test", cooldown_s=10)
    assert other.call("put", lambda: 1 / 0, fallback=None) is None
    assert other.call("put", lambda: 7, fallback=None) == 7


def test_settings_make_a_client_with_their_copy_threads():
    settings = KvtierSettings.from_config({"kvtier_copy_threads": 3, "master": "127.0.0.1:1"})
    client = settings.client("ns", rank=2)  # connects at its first call, not here
    try:
        assert (client.namespace, client.rank, client.config.copy_threads) == ("ns", 2, 3)
    finally:
        client.close()
