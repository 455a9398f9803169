"""The LMCache 0.5.x remote connector (client/integrations/lmcache.py) against LMCache itself and
real kvtier processes.

LMCache loads the connector the way a worker does (tests/engines/lmcache_harness.py): its engine
config names the `kvtier` remote storage plugin, `CreateStorageBackends` builds its LocalCPUBackend
and, through its plugin loading and ConnectorManager, the RemoteBackend wrapping our connector.
Chunks are LMCache's own TensorMemoryObj from its CPU allocator (CPU tensors); keys come from
LMCache's ChunkedTokenDatabase. Every put, lookup and get goes through a real master and segment.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend.connector import CreateConnector

from kvtier.client.integrations.identity import IdentityError
from tests.cluster import Cluster
from tests.engines.lmcache_harness import (
    MODEL,
    REMOTE,
    Engine,
    LoopThread,
    make_config,
    make_engine,
    payload,
    plugin_extra,
)

CHUNK_BYTES = 2048  # harness KV_SHAPE in bf16
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


@pytest.fixture(autouse=True)
def seeded_env(monkeypatch):
    """A shared PYTHONHASHSEED (LMCache's builtin chunk hash needs one to be shareable), no off switch."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv("KVTIER_DISABLE", raising=False)
    monkeypatch.delenv("KVTIER_MASTER", raising=False)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_leaked_chunks():
    """LMCache frees a chunk nobody released when it is garbage collected, and says so: every test
    fails on that warning, so a chunk the connector (or LMCache) forgot to release cannot hide."""
    records = _Records()
    memory_logger = logging.getLogger("lmcache.v1.memory_management")  # LMCache's loggers do not propagate
    memory_logger.addHandler(records)
    yield
    gc.collect()
    memory_logger.removeHandler(records)
    leaks = [m for m in records.messages if "garbage collected" in m]
    assert not leaks, leaks


@pytest.fixture
def loop():
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture
def engines(loop):
    """make(master, **kwargs) -> Engine; every engine is closed at the end."""
    made: list[Engine] = []

    def make(master: str, **kwargs) -> Engine:
        engine = make_engine(loop, master, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def tokens(n_chunks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + 16 * n_chunks))


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---------------------------------------------------------------------------- loading


def test_lmcache_loads_the_connector_from_its_plugin_config(cluster, engines):
    engine = engines(cluster.master_address)
    connector = engine.connector
    assert type(connector).__module__ == "kvtier.client.integrations.lmcache"
    assert type(connector).__name__ == "KvtierConnector"
    assert engine.remote.connection.support_batched_async_contains()
    assert engine.remote.connection.support_batched_get() and engine.remote.connection.support_batched_put()
    # the namespace is the identity LMCache's metadata describes
    ns = connector.namespace
    assert ns.startswith("lmcache.kvtier-test_tiny-llama.bfloat16.tp0of1.pp0of1."), ns
    identity = connector.identity
    assert (identity.model, identity.kv_dtype, identity.tokens_per_block) == (MODEL, "bfloat16", 16)
    assert (identity.tp_size, identity.tp_rank, identity.rankless) == (1, 0, False)
    assert identity.layout == "KV_2LTD[2x2x16x16]"
    assert (identity.hash_scheme, identity.hash_seed) == ("builtin", "0")
    assert engine.loop.run(engine.remote.connection.ping()) == 0


def test_connector_class_itself_loads_through_lmcaches_dynamic_adapter(cluster, engines):
    """class_name may name the RemoteConnector: LMCache then wraps it in its DynamicConnectorAdapter,
    which passes no metadata: the connector takes it from the local CPU backend."""
    engine = engines(cluster.master_address, class_name="KvtierConnector")
    keys = engine.keys(tokens(2))
    engine.store(keys)
    assert engine.lookup(keys) == 2
    assert engine.load(keys) == [payload(k, CHUNK_BYTES) for k in keys]


def test_config_from_lmcache_environment_variables(cluster, loop, engines, monkeypatch):
    """LMCACHE_REMOTE_STORAGE_PLUGINS + LMCACHE_EXTRA_CONFIG (JSON), as docs/integrations.md shows."""
    import json

    monkeypatch.setenv("LMCACHE_REMOTE_STORAGE_PLUGINS", "kvtier")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(plugin_extra(cluster.master_address)))
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "16")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.01")
    config = LMCacheEngineConfig.from_env()
    engine = engines(cluster.master_address, config=config)
    keys = engine.keys(tokens(3))
    engine.store(keys)
    assert engine.lookup(keys) == 3


def _docs_yaml() -> str:
    section = DOCS.read_text().split("## LMCache (remote connector)", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert blocks, "the LMCache section of docs/integrations.md shows no yaml config"
    return blocks[0]


def test_the_documented_yaml_config_works(cluster, engines, tmp_path):
    text = _docs_yaml().replace("10.0.0.5:50051", cluster.master_address)
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    config = LMCacheEngineConfig.from_file(str(path))
    config.chunk_size = 16  # the harness's small chunks; everything else as documented
    config.max_local_cpu_size = 0.01
    config.extra_config.pop("remote_storage_plugin.kvtier.secret_file", None)  # this cluster has none
    engine = engines(cluster.master_address, config=config)
    keys = engine.keys(tokens(2))
    engine.store(keys)
    assert engine.lookup(keys) == 2


def test_plugin_keys_win_over_global_kvtier_keys_and_bare_names_are_not_read(cluster, engines):
    extra = plugin_extra(cluster.master_address, namespace_prefix="tenant-a")
    extra.update({"kvtier_master": "127.0.0.1:1", "kvtier_replicas": 1, "timeout": "not ours", "enabled": False})
    engine = engines(cluster.master_address, config=make_config(extra))
    assert engine.connector.enabled  # the bare `enabled` belongs to someone else
    assert engine.connector.namespace.startswith("tenant-a.lmcache.")
    keys = engine.keys(tokens(2))
    engine.store(keys)  # through the plugin's master, not the global one
    assert engine.lookup(keys) == 2


@pytest.mark.parametrize(
    "algorithm, vllm_has_it, seed, expected",
    [
        ("builtin", True, "0", ("builtin", "0")),
        ("builtin", True, None, IdentityError),
        ("sha256_cbor", False, None, IdentityError),  # LMCache falls back to builtin hash without vLLM
        ("sha256_cbor", True, None, ("sha256_cbor", "vllm-default")),
        ("sha256_cbor_64bit", True, "3", ("sha256_cbor", "3")),
        ("sha256", True, None, ("sha256", "vllm-default")),
        ("xxhash", True, None, IdentityError),  # vLLM seeds its NONE_HASH at random then
        ("xxhash", True, "5", ("xxhash", "5")),
    ],
)
def test_the_identity_names_the_hash_lmcache_really_uses(monkeypatch, algorithm, vllm_has_it, seed, expected):
    from kvtier.client.integrations import lmcache as adapter
    from tests.engines.lmcache_harness import make_metadata

    monkeypatch.setattr(adapter, "_vllm_hash_available", lambda name: vllm_has_it)
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    config = make_config({}, pre_caching_hash_algorithm=algorithm)
    if expected is IdentityError:
        with pytest.raises(IdentityError, match="PYTHONHASHSEED"):
            adapter.lmcache_identity(config, make_metadata())
    else:
        identity = adapter.lmcache_identity(config, make_metadata())
        assert (identity.hash_scheme, identity.hash_seed) == expected


# ---------------------------------------------------------------------------- put / lookup / get


def test_chunks_round_trip_byte_for_byte_and_nothing_leaks(cluster, engines):
    engine = engines(cluster.master_address)
    free_at_start = engine.free_bytes()
    keys = engine.keys(tokens(4))
    engine.store(keys)

    assert engine.lookup(keys) == 4
    assert engine.remote.batched_contains(keys) == 4
    assert engine.remote.contains(keys[2])
    objs = engine.load_objs(keys)
    for key, obj in zip(keys, objs, strict=True):
        assert obj is not None
        assert bytes(obj.byte_array) == payload(key, CHUNK_BYTES)
        assert obj.get_shapes() == engine.metadata.get_shapes() and obj.get_dtypes() == [torch.bfloat16]
        assert obj.get_ref_count() == 1  # the caller's reference only
        obj.ref_count_down()
    single = engine.remote.get_blocking(keys[1])
    assert bytes(single.byte_array) == payload(keys[1], CHUNK_BYTES)
    single.ref_count_down()
    assert engine.free_bytes() == free_at_start

    # in kvtier: the raw chunk bytes (no header) under the chunk hash, in the identity's namespace
    with cluster.client(namespace=engine.connector.namespace) as raw:
        assert raw.get(keys[0].chunk_hash_hex) == payload(keys[0], CHUNK_BYTES)
    listed = engine.loop.run(engine.remote.connection.list())
    assert sorted(listed) == sorted(k.to_string() for k in keys)
    assert {CacheEngineKey.from_string(s) for s in listed} == set(keys)
    stats = engine.connector.stats()
    assert stats["puts"] == 4 and stats["hits"] >= 5 and stats.get("errors", 0) == 0


def test_request_tags_are_part_of_the_key(cluster, engines):
    engine = engines(cluster.master_address)
    alice = engine.keys(tokens(2), {"lmcache.tag.user": "alice"})
    bob = engine.keys(tokens(2), {"lmcache.tag.user": "bob"})
    assert [k.chunk_hash for k in alice] == [k.chunk_hash for k in bob]
    engine.store(alice)
    assert engine.lookup(alice) == 2
    assert engine.lookup(bob) == 0
    assert engine.connector.kv_key(alice[0]) == f"{alice[0].chunk_hash_hex}@user%alice"


def test_batched_async_contains_counts_leading_chunks_in_one_kvtier_call(cluster, engines):
    engine = engines(cluster.master_address)
    keys = engine.keys(tokens(8))
    engine.store(keys[:6])
    client = engine.connector._client
    calls: list[str] = []
    for name in ("longest_prefix", "batch_exists", "exists"):
        real = getattr(client, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            prefetches.append(kwargs.get("prefetch", False))
            return _real(*args, **kwargs)

        setattr(client, name, spy)
    prefetches: list[bool] = []
    assert engine.lookup(keys) == 6
    assert calls == ["longest_prefix"]
    assert prefetches == [True]  # LMCache retrieves what contains found: kvtier prefetches it
    assert engine.lookup(keys[:3]) == 3
    assert engine.lookup(keys[6:]) == 0
    assert engine.lookup([keys[0], keys[1], keys[7], keys[3]]) == 2
    assert engine.remote.batched_contains(keys) == 6


def test_a_missing_middle_chunk_shrinks_the_prefix(cluster, engines):
    engine = engines(cluster.master_address)
    free_at_start = engine.free_bytes()
    keys = engine.keys(tokens(6))
    engine.store(keys)
    assert engine.lookup(keys) == 6
    assert engine.remote.remove(keys[2])  # LMCache's remove -> remove_sync
    assert engine.lookup(keys) == 2
    assert engine.remote.batched_contains(keys) == 2
    # the non-blocking (async loading) retrieve returns only the leading chunks and releases the rest
    got = engine.loop.run(engine.remote.batched_get_non_blocking("load", keys))
    assert [bytes(o.byte_array) for o in got] == [payload(k, CHUNK_BYTES) for k in keys[:2]]
    for obj in got:
        obj.ref_count_down()
    loaded = engine.load(keys)
    assert loaded[2] is None and loaded[3] == payload(keys[3], CHUNK_BYTES)
    assert engine.free_bytes() == free_at_start


def test_a_partial_last_chunk_comes_back_with_its_token_count(cluster, engines):
    engine = engines(cluster.master_address, config_overrides={"save_unfull_chunk": True})
    keys = engine.keys(list(range(500, 500 + 16 * 2 + 5)))  # two full chunks and 5 tokens
    assert len(keys) == 3
    engine.store(keys[:2])
    engine.store(keys[2:], num_tokens=5)
    objs = engine.load_objs(keys)
    assert [o.get_num_tokens() for o in objs] == [16, 16, 5]  # LMCache's reshape_partial_chunk
    assert [o.get_size() for o in objs] == [CHUNK_BYTES, CHUNK_BYTES, 5 * CHUNK_BYTES // 16]
    assert bytes(objs[2].byte_array) == payload(keys[2], 5 * CHUNK_BYTES // 16)
    for obj in objs:
        obj.ref_count_down()


def test_an_object_that_is_not_a_chunk_here_is_a_miss(cluster, engines):
    """Bytes under a chunk's key that are no whole number of tokens (or more than a chunk) are misses."""
    engine = engines(cluster.master_address)
    free_at_start = engine.free_bytes()
    keys = engine.keys(tokens(3))
    with cluster.client(namespace=engine.connector.namespace) as raw:
        raw.put(keys[0].chunk_hash_hex, b"x" * 1000)  # not a multiple of a token's 128 bytes
        raw.put(keys[1].chunk_hash_hex, b"y" * (CHUNK_BYTES + 128))  # larger than a chunk
    engine.store(keys[2:])
    assert engine.load(keys) == [None, None, payload(keys[2], CHUNK_BYTES)]
    assert engine.free_bytes() == free_at_start
    assert engine.connector.stats()["bad_sizes"] == 2  # neither a chunk nor stored with its metadata


def test_lmcache_health_probe_round_trips_with_fresh_bytes_every_time(cluster, engines):
    """LMCache's RemoteBackendHealthCheck puts and gets a fixed "test" model key with whatever bytes
    it allocated: keys of another identity are overwritten on put, not content-addressed."""
    from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck

    engine = engines(cluster.master_address)
    probe = CacheEngineKey(model_name="test", world_size=1, worker_id=0, chunk_hash=0, dtype=torch.bfloat16)
    assert engine.connector.kv_key(probe) == "foreign/test@1@0@0@bfloat16"
    for fill in (1, 2):
        obj = engine.cpu.allocate(engine.metadata.get_shapes(), engine.metadata.get_dtypes())
        obj.raw_tensor.fill_(fill)
        engine.remote.submit_put_task(probe, obj).result(10)
        back = engine.load_objs([probe])[0]
        assert back is not None and bool((back.raw_tensor == fill).all()), f"round {fill} read stale bytes"
        back.ref_count_down()
        obj.ref_count_down()
    assert RemoteBackendHealthCheck(engine.remote)._put_and_get_check()


def test_an_overwritten_probe_key_never_reads_as_a_miss_meanwhile(cluster, engines):
    """Keys that are overwritten (the health probe's) are replaced atomically: a reader polling the
    key while the probe is put again and again always finds a value (remove-then-put left a gap)."""
    import threading

    engine = engines(cluster.master_address)
    probe = CacheEngineKey(model_name="test", world_size=1, worker_id=0, chunk_hash=0, dtype=torch.bfloat16)

    def put(fill: int) -> None:
        obj = engine.cpu.allocate(engine.metadata.get_shapes(), engine.metadata.get_dtypes())
        obj.raw_tensor.fill_(fill)
        engine.remote.submit_put_task(probe, obj).result(10)
        obj.ref_count_down()

    put(1)
    misses, reads, done = [], [0], threading.Event()
    with cluster.client(namespace=engine.connector.namespace) as raw:
        kv_key = engine.connector.kv_key(probe)
        assert raw.get(kv_key) is not None

        def read() -> None:
            while not done.is_set():
                reads[0] += 1
                if raw.get(kv_key) is None:
                    misses.append(reads[0])

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for fill in range(2, 42):
                put(fill)
        finally:
            done.set()
            reader.join(10)
    assert reads[0] > 40
    assert misses == [], f"{len(misses)} of {reads[0]} reads missed the overwritten key"
    assert engine.connector.stats().get("put_failures", 0) == 0


# ---------------------------------------------------------------------------- failures


def test_kvtier_down_gives_misses_and_never_raises(cluster, engines):
    engine = engines(cluster.master_address)
    free_at_start = engine.free_bytes()
    keys = engine.keys(tokens(4))
    engine.store(keys)
    assert engine.lookup(keys) == 4
    cluster.kill(cluster.master)

    started = time.monotonic()
    assert engine.lookup(keys) == 0
    assert engine.remote.batched_contains(keys) == 0
    assert not engine.remote.contains(keys[0])
    assert engine.load(keys) == [None] * 4
    assert engine.loop.run(engine.remote.batched_get_non_blocking("load", keys)) == []
    engine.store(engine.keys(tokens(2, start=9000)))  # returns; the chunks are released
    assert engine.loop.run(engine.remote.connection.ping()) != 0
    assert engine.loop.run(engine.remote.connection.list()) == []
    assert not engine.remote.remove(keys[0])
    assert time.monotonic() - started < 60
    assert engine.free_bytes() == free_at_start
    stats = engine.connector.stats()
    # The first failure opens the adapter's circuit breaker: later calls are answered at once.
    assert stats["errors"] + stats.get("short_circuited", 0) >= 5, stats
    assert stats["puts"] == 4, "the put while kvtier was down stored nothing (failed or short-circuited)"


def test_a_hung_master_never_blocks_lmcaches_event_loop(bare_cluster, engines):
    bare_cluster.segment_ttl_s = 60  # the master must not drop the segment while it is stopped
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0")
    timeout = 3.0
    engine = engines(bare_cluster.master_address, settings={"timeout": timeout})
    keys = engine.keys(tokens(3))
    engine.store(keys)
    master = bare_cluster.master.popen
    os.kill(master.pid, signal.SIGSTOP)
    try:
        pending = engine.loop.submit(engine.remote.batched_async_contains("lookup", keys))
        worst = 0.0
        while not pending.done():
            t0 = time.monotonic()
            engine.loop.run(asyncio.sleep(0))  # the loop answers while the lookup waits on kvtier
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        # blocked by the lookup, the loop would answer only once it timed out: well under that
        assert worst < timeout / 6, f"LMCache's event loop was blocked for {worst:.2f}s"
        assert pending.result() == 0  # timed out: a miss
    finally:
        os.kill(master.pid, signal.SIGCONT)
    time.sleep(engine.connector.guard.cooldown_s)  # the timed-out lookup opened the circuit breaker
    assert engine.lookup(keys) == 3


def test_abandoned_transfers_keep_their_chunks_until_the_thread_is_done(bare_cluster, engines):
    """LMCache cancels a get after blocking_timeout_secs and releases a put's chunk when the put
    coroutine ends: a chunk must not go back to the allocator while a kvtier thread still uses it."""
    bare_cluster.segment_ttl_s = 60
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0")
    engine = engines(
        bare_cluster.master_address, settings={"timeout": 8.0}, config_overrides={"blocking_timeout_secs": 1}
    )
    keys = engine.keys(tokens(3))
    engine.store(keys)
    free_at_start = engine.free_bytes()
    extra = engine.keys(tokens(1, start=7000))[0]
    obj = engine.chunk(extra)
    master = bare_cluster.master.popen
    os.kill(master.pid, signal.SIGSTOP)
    try:
        assert engine.load(keys) == [None] * 3  # LMCache gave up after 1 s and cancelled
        assert engine.free_bytes() < free_at_start - CHUNK_BYTES, "chunks freed under a running get"
        put = engine.loop.submit(engine.connector.batched_put([extra], [obj]))
        time.sleep(0.3)
        put.cancel()
        time.sleep(0.3)
        assert obj.get_ref_count() == 2, "chunk released while its put is still sending it"
    finally:
        os.kill(master.pid, signal.SIGCONT)
    assert wait_until(lambda: obj.get_ref_count() == 1), obj.get_ref_count()
    obj.ref_count_down()
    assert wait_until(lambda: engine.free_bytes() == free_at_start), (engine.free_bytes(), free_at_start)
    assert engine.lookup([extra]) == 1  # the abandoned put still finished


# ---------------------------------------------------------------------------- off switch, refusals


def test_off_switch_in_config_stores_nothing_and_finds_nothing(cluster, engines):
    on = engines(cluster.master_address)
    keys = on.keys(tokens(3))
    on.store(keys)
    off = engines("127.0.0.1:1", settings={"enabled": False})  # no cluster there: never contacted
    assert not off.connector.enabled
    assert off.lookup(keys) == 0 and off.remote.batched_contains(keys) == 0
    assert off.load(keys) == [None] * 3
    assert not off.remote.contains(keys[0])
    others = off.keys(tokens(2, start=5000))
    off.store(others)
    assert on.lookup(others) == 0  # nothing was stored
    assert off.loop.run(off.remote.connection.list()) == []
    assert off.loop.run(off.remote.connection.ping()) == 0  # healthy: LMCache keeps its other tiers


def test_kvtier_disable_env_turns_off_an_enabled_config(cluster, engines, monkeypatch):
    on = engines(cluster.master_address)
    keys = on.keys(tokens(2))
    on.store(keys)
    monkeypatch.setenv("KVTIER_DISABLE", "1")
    off = engines(cluster.master_address, settings={"enabled": True})
    assert not off.connector.enabled
    assert off.lookup(keys) == 0 and off.load(keys) == [None, None]
    off.store(off.keys(tokens(2, start=5000)))
    assert on.lookup(on.keys(tokens(2, start=5000))) == 0


@pytest.mark.parametrize("seed", [None, "random"])
def test_unseeded_builtin_hash_is_refused(cluster, loop, monkeypatch, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    engine = make_engine(loop, cluster.master_address)  # pre_caching_hash_algorithm: builtin
    try:
        assert REMOTE not in engine.backends  # LMCache logged the refusal and runs without it
        with pytest.raises(IdentityError, match="PYTHONHASHSEED"):
            CreateConnector(
                f"plugin://{'kvtier'}", loop.loop, engine.cpu, engine.config, engine.metadata, plugin_name="kvtier"
            )
    finally:
        engine.close()
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = make_engine(loop, cluster.master_address)
    try:
        assert seeded.connector.identity.hash_seed == "7"
    finally:
        seeded.close()


@pytest.mark.parametrize(
    "overrides, message",
    [({"use_layerwise": True}, "use_layerwise"), ({"remote_serde": "cachegen"}, "remote_serde")],
)
def test_formats_the_connector_cannot_serve_are_refused(cluster, loop, overrides, message):
    config = make_config(plugin_extra(cluster.master_address), **overrides)
    engine = make_engine(loop, cluster.master_address, config=config)
    try:
        with pytest.raises(IdentityError, match=message):
            CreateConnector("plugin://kvtier", loop.loop, engine.cpu, config, engine.metadata, plugin_name="kvtier")
    finally:
        engine.close()


# ---------------------------------------------------------------------------- across instances


def test_same_identity_shares_other_dtype_or_world_size_only_misses(cluster, engines):
    first = engines(cluster.master_address)
    keys = first.keys(tokens(5))
    first.store(keys)

    second = engines(cluster.master_address)  # another engine process, same deployment
    assert second.connector is not first.connector
    assert second.keys(tokens(5)) == keys  # the same prefix gives the same chunk keys
    assert second.lookup(keys) == 5
    assert second.load(keys) == [payload(k, CHUNK_BYTES) for k in keys]

    fp16 = engines(cluster.master_address, dtype=torch.float16)
    tp2 = engines(cluster.master_address, world_size=2, worker_id=0)
    other_model = engines(cluster.master_address, model="kvtier-test/other")
    # quantized weights or a RoPE override of the same model name: LMCache's metadata does not tell
    quantized = engines(cluster.master_address, settings={"model_variant": "quantization=fp8"})
    for other in (fp16, tp2, other_model, quantized):
        own = other.keys(tokens(5))
        assert [k.chunk_hash for k in own] == [k.chunk_hash for k in keys]  # the hashes collide...
        assert other.lookup(own) == 0  # ...the identity keeps them apart
        assert other.load(own) == [None] * 5
        assert other.connector.namespace != first.connector.namespace


def test_mla_chunks_are_shared_by_every_rank(cluster, engines):
    """MLA keeps the same latent KV on every rank: LMCache's rank-0 keys, one rank-less namespace."""
    rank0 = engines(cluster.master_address, use_mla=True, world_size=2, worker_id=0)
    rank1 = engines(cluster.master_address, use_mla=True, world_size=2, worker_id=1)
    assert rank0.connector.identity.rankless and rank0.connector.namespace == rank1.connector.namespace
    keys = rank0.keys(tokens(3))
    size = rank0.chunk(keys[0])
    nbytes = size.get_size()
    size.ref_count_down()
    rank0.store(keys)
    assert rank1.lookup(rank1.keys(tokens(3))) == 3
    assert rank1.load(rank1.keys(tokens(3))) == [payload(k, nbytes) for k in keys]
    plain = engines(cluster.master_address, world_size=2, worker_id=0)
    assert plain.lookup(plain.keys(tokens(3))) == 0


def _ssd_segment(cluster: Cluster, ssd_dir: Path):
    return cluster.start_segment(
        "ssd0", "16MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "128MiB", "--ssd-bucket-size", "4MiB"
    )


def test_sharing_survives_a_restart_of_every_kvtier_process(bare_cluster, engines, tmp_path):
    state_dir = str(tmp_path / "master-state")
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    # a master with a state dir that has segments copy objects to SSD as soon as DRAM holds any
    master_args = ("--state-dir", state_dir, "--offload-watermark", "0.0001")
    bare_cluster.start_master(*master_args)
    _ssd_segment(bare_cluster, ssd_dir)
    writer = engines(bare_cluster.master_address)
    keys = writer.keys(tokens(6))
    writer.store(keys)
    namespace = writer.connector.namespace
    ours = bare_cluster.client(namespace=namespace)
    hexes = [k.chunk_hash_hex for k in keys]

    def on_ssd() -> bool:  # batch_stat is read-only: no lease, no recency refresh
        return all(
            info and any(r.tier == "ssd" and not r.task for r in info.replicas) for info in ours.batch_stat(hexes)
        )

    assert wait_until(on_ssd, timeout=30), ours.batch_stat(hexes)
    writer.close()

    # every kvtier process dies without warning and starts again on its state
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    bare_cluster.restart_master(*master_args)
    _ssd_segment(bare_cluster, ssd_dir)

    reader = engines(bare_cluster.master_address)  # a new engine instance, same identity
    assert reader.connector.namespace == namespace
    assert wait_until(lambda: reader.lookup(keys) == 6, timeout=20), reader.lookup(keys)
    assert reader.load(keys) == [payload(k, CHUNK_BYTES) for k in keys]
    fp16 = engines(bare_cluster.master_address, dtype=torch.float16)
    assert fp16.lookup(fp16.keys(tokens(6))) == 0
    tp2 = engines(bare_cluster.master_address, world_size=2, worker_id=1)
    assert tp2.lookup(tp2.keys(tokens(6))) == 0


def test_client_module_stays_free_of_lmcache():
    """The adapter is imported by LMCache only: kvtier's client does not import LMCache."""
    import subprocess
    import sys

    code = "import sys, kvtier.client, kvtier.client.integrations; print('lmcache' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
