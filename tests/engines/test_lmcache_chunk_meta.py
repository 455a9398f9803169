"""Issue #21: the LMCache connector's own settings per instance, LMCache's `save_chunk_meta`, and
puts that could not be read back refused (so `contains` never promises a miss).

Everything through LMCache itself and real kvtier processes (tests/engines/lmcache_harness.py);
LMCache's own RemoteBackend tests run in tests/engines/lmcache_upstream/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector import CreateConnector

from kvtier.client.integrations.identity import IdentityError
from kvtier.client.integrations.lmcache_meta import ChunkMeta, MetaError
from tests.cluster import Cluster
from tests.conftest import _finish
from tests.engines.lmcache_harness import (
    MODULE,
    LoopThread,
    make_config,
    make_engine,
    payload,
    plugin_extra,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def seeded_env(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv("KVTIER_DISABLE", raising=False)
    monkeypatch.delenv("KVTIER_MASTER", raising=False)


@pytest.fixture
def loop():
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture
def engines(loop):
    made = []

    def make(master: str, **kwargs):
        engine = make_engine(loop, master, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def odd_object(fill: int, shape=(2, 16, 8, 8), dtype=torch.bfloat16, fmt=MemoryFormat.KV_T2D):
    """A memory object that is not a chunk of the harness's layout (KV_2LTD [2, 2, 16, 16])."""
    obj = AdHocMemoryAllocator(device="cpu").allocate([torch.Size(shape)], [dtype], fmt=fmt)
    obj.tensor.copy_(torch.arange(obj.tensor.numel()).reshape(obj.tensor.shape).to(dtype) + fill)
    return obj


def put(engine, keys, objs) -> None:
    for key, obj in zip(keys, objs, strict=True):
        engine.remote.submit_put_task(key, obj).result(10)


# ---------------------------------------------------------------------------- save_chunk_meta


def test_objects_that_are_not_chunks_round_trip_byte_for_byte_with_their_metadata(cluster, engines):
    engine = engines(cluster.master_address)
    assert engine.connector.save_chunk_meta  # LMCache's default
    keys = engine.keys(list(range(3000, 3000 + 16 * 4)))
    objs = [
        odd_object(1),
        odd_object(2, shape=(4, 4, 4), dtype=torch.float32),
        odd_object(3, shape=(2, 1, 300, 16), fmt=MemoryFormat.KV_2LTD),  # 300 tokens: more than a chunk
    ]
    put(engine, keys[:3], objs)
    engine.store(keys[3:])  # a chunk of this layout: stored raw
    assert engine.lookup(keys) == 4
    got = engine.load_objs(keys)
    for back, original in zip(got[:3], objs, strict=True):
        assert back is not None
        assert back.get_shapes() == original.get_shapes()
        assert back.get_dtypes() == original.get_dtypes()
        assert back.get_memory_format() == original.get_memory_format()
        assert bytes(back.byte_array) == bytes(original.byte_array)
    assert bytes(got[3].byte_array) == payload(keys[3], 2048)
    for obj in got:
        obj.ref_count_down()
    assert engine.connector.stats().get("refused_puts", 0) == 0


def test_with_save_chunk_meta_off_objects_that_are_not_chunks_are_refused_never_promised(cluster, engines):
    extra = dict(plugin_extra(cluster.master_address), save_chunk_meta=False)
    engine = engines(cluster.master_address, config=make_config(extra))
    assert not engine.connector.save_chunk_meta
    keys = engine.keys(list(range(4000, 4000 + 16 * 2)))
    put(engine, keys[:1], [odd_object(1)])
    engine.store(keys[1:])
    assert engine.lookup(keys[:1]) == 0  # nothing stored that could not be read back
    assert engine.lookup(keys[1:]) == 1
    assert engine.load(keys) == [None, payload(keys[1], 2048)]
    assert engine.connector.stats()["refused_puts"] == 1


def test_a_header_that_does_not_match_its_bytes_is_a_miss(cluster, engines):
    engine = engines(cluster.master_address)
    keys = engine.keys(list(range(5000, 5000 + 16 * 3)))
    obj = odd_object(7)
    good = ChunkMeta.of(obj).encode_with(memoryview(obj.byte_array).cast("B"), engine.connector.single_token_size)
    truncated = bytes(good[:-3])
    flipped = bytearray(good)
    flipped[0] ^= 0xFF  # not our magic
    with cluster.client(namespace=engine.connector.namespace) as raw:
        raw.put(keys[0].chunk_hash_hex, truncated)
        raw.put(keys[1].chunk_hash_hex, bytes(flipped))
        raw.put(keys[2].chunk_hash_hex, bytes(good))
    free_at_start = engine.free_bytes()
    got = engine.load_objs(keys)
    assert got[:2] == [None, None]
    assert bytes(got[2].byte_array) == bytes(obj.byte_array)
    got[2].ref_count_down()
    assert engine.free_bytes() == free_at_start
    assert engine.connector.stats()["bad_sizes"] == 2
    with pytest.raises(MetaError):
        ChunkMeta.decode(truncated)


def test_a_stored_header_object_is_never_a_whole_number_of_tokens():
    """Raw chunks are a whole number of tokens; header objects never are, whatever their size."""
    for token_bytes in (2, 3, 64, 128, 4096):
        for n in range(1, 40):
            obj = odd_object(0, shape=(n,), dtype=torch.uint8)
            value = ChunkMeta.of(obj).encode_with(memoryview(obj.byte_array).cast("B"), token_bytes)
            assert len(value) % token_bytes != 0
            meta, offset = ChunkMeta.decode(value)
            assert meta == ChunkMeta(((n,),), (torch.uint8,), MemoryFormat.KV_T2D)
            assert bytes(value[offset : offset + n]) == bytes(obj.byte_array)


# ---------------------------------------------------------------------------- settings per instance


def dual_extra(master_a: str, master_b: str) -> dict:
    extra: dict = {}
    for name, master in (("kvtier.a", master_a), ("kvtier.b", master_b)):
        extra.update(
            {
                f"remote_storage_plugin.{name}.module_path": MODULE,
                f"remote_storage_plugin.{name}.class_name": "KvtierConnectorAdapter",
                f"remote_storage_plugin.{name}.master": master,
                f"remote_storage_plugin.{name}.timeout": 2.0,
            }
        )
    return extra


def test_two_connector_instances_talk_to_their_own_clusters(cluster, tmp_path, request, loop):
    (tmp_path / "other").mkdir()
    other = Cluster(tmp_path / "other")
    try:
        other.start_master()
        other.start_segment("seg0")
        config = make_config(
            dual_extra(cluster.master_address, other.master_address),
            remote_storage_plugins=["kvtier.a", "kvtier.b"],
        )
        engine = make_engine(loop, cluster.master_address, config=config)
        try:
            a = engine.backends["RemoteBackend-kvtier.a"]
            b = engine.backends["RemoteBackend-kvtier.b"]
            conn_a = a.connection.getWrappedConnector()
            conn_b = b.connection.getWrappedConnector()
            assert conn_a.settings.master == cluster.master_address
            assert conn_b.settings.master == other.master_address
            keys = engine.keys(list(range(6000, 6000 + 16 * 2)))
            objs = [engine.chunk(k) for k in keys]
            a.submit_put_task(keys[0], objs[0]).result(10)
            b.submit_put_task(keys[1], objs[1]).result(10)
            for obj in objs:
                obj.ref_count_down()
            assert (a.contains(keys[0]), a.contains(keys[1])) == (True, False)
            assert (b.contains(keys[0]), b.contains(keys[1])) == (False, True)
            # the bytes are in the cluster each instance names, and nowhere else
            with cluster.client(namespace=conn_a.namespace) as raw_a, other.client(namespace=conn_b.namespace) as raw_b:
                assert raw_a.get(keys[0].chunk_hash_hex) == payload(keys[0], 2048)
                assert raw_a.get(keys[1].chunk_hash_hex) is None
                assert raw_b.get(keys[1].chunk_hash_hex) == payload(keys[1], 2048)
                assert raw_b.get(keys[0].chunk_hash_hex) is None
            back = b.get_blocking(keys[1])
            assert bytes(back.byte_array) == payload(keys[1], 2048)
            back.ref_count_down()
        finally:
            for name in ("RemoteBackend-kvtier.a", "RemoteBackend-kvtier.b"):  # Engine.close knows only one
                if engine.backends.get(name) is not None:
                    engine.backends[name].close()
            engine.close()
    finally:
        _finish(request, other)


def test_several_kvtier_plugins_behind_the_dynamic_adapter_are_refused_not_guessed(cluster, loop):
    """LMCache's DynamicConnectorAdapter (class_name: KvtierConnector) passes no plugin name: with
    two kvtier plugins the connector cannot know whose settings are its own."""
    extra = dual_extra(cluster.master_address, "127.0.0.1:1")
    for name in ("kvtier.a", "kvtier.b"):
        extra[f"remote_storage_plugin.{name}.class_name"] = "KvtierConnector"
    config = make_config(extra, remote_storage_plugins=["kvtier.a", "kvtier.b"])
    engine = make_engine(loop, cluster.master_address, config=config)
    try:
        assert not any(name.startswith("RemoteBackend") for name in engine.backends)  # LMCache logged it
        with pytest.raises(IdentityError, match="KvtierConnectorAdapter"):
            CreateConnector("plugin://kvtier.a", loop.loop, engine.cpu, config, engine.metadata, plugin_name="kvtier.a")
    finally:
        engine.close()


# ---------------------------------------------------------------------------- LMCache's basic_check


def test_lmcache_basic_check_storage_manager_with_local_cpu_off_gets_every_key_it_promised(cluster, tmp_path):
    """`python -m lmcache.v1.basic_check --mode test_storage_manager` with `local_cpu: false`: its
    objects (512 tokens, KV_2LTD) are not chunks of its metadata's layout; every key `contains`
    answers yes for must come back with the bytes that were put."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        "chunk_size: 256\n"
        "local_cpu: false\n"
        "max_local_cpu_size: 0.05\n"
        "remote_serde: naive\n"
        'remote_storage_plugins: ["kvtier"]\n'
        "extra_config:\n"
        f"  remote_storage_plugin.kvtier.module_path: {MODULE}\n"
        "  remote_storage_plugin.kvtier.class_name: KvtierConnectorAdapter\n"
        f'  remote_storage_plugin.kvtier.master: "{cluster.master_address}"\n'
    )
    env = dict(os.environ, LMCACHE_CONFIG_FILE=str(config), PYTHONHASHSEED="0")
    run = subprocess.run(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_storage_manager", "--num-keys", "20"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    phases = [int(m) for m in re.findall(r"Validation: (\d+)/20 passed", out)]
    correct = re.findall(r"Validation \(content correct\): (\d+)/20", out)
    assert len(phases) == 3 and correct, out[-3000:]
    absent_ok, put_ok, promised = phases
    assert (absent_ok, put_ok) == (20, 20)
    # Every get comes back with the bytes put (before the fix: contains said yes, every get missed).
    # `promised` may fall short of 20 on a loaded machine: basic_check's wait for its puts
    # (wait_put_tasks_complete) can return before LMCache registered them; a no is never a lie.
    assert int(correct[0]) == 20, out[-3000:]
    assert 0 < promised <= int(correct[0])
