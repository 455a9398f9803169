"""The SGLang 0.5.x HiCache storage backend (client/integrations/sglang.py) against SGLang itself and
real kvtier processes.

Each backend is made the way SGLang's cache controller attaches one (`attach_storage_backend`): a
real `HiCacheStorageConfig` whose extra config is the JSON documented in docs/integrations.md,
`StorageBackendFactory.create_backend("dynamic", ...)` (which imports the module named there and
checks the class is a `HiCacheStorage`), then `register_mem_pool_host(pool)`. Page keys are
SGLang's own page hashes (`get_hash_str`). The host pools are CPU-tensor stand-ins reproducing
SGLang's MHA/MLA host pools (tests/engines/sglang_pool.py says why the real ones cannot be built
here). Every put, lookup and get goes through a real master and segment.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from kvtier.client import Client
from kvtier.client.config import ClientConfig
from kvtier.client.integrations.identity import IdentityError
from kvtier.client.integrations.sglang import HiCacheKvtier
from tests.engines.sglang_pool import MHAHostPool, MLAHostPool

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
MODEL = "Qwen/Qwen3-0.6B"
PAGE = 16  # tokens per page
LAYERS = 3  # MHA layer_first: 6 pieces a page (packed); MLA layer_first: 3 (one object each)


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("KVTIER_DISABLE", raising=False)
    monkeypatch.delenv("KVTIER_MASTER", raising=False)


def documented_extra_config() -> dict:
    """The extra-config JSON of the SGLang section of docs/integrations.md."""
    section = DOCS.read_text().split("## SGLang (HiCache storage backend)")[1].split("\n## ")[0]
    match = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", section)
    assert match, "the SGLang section shows no --hicache-storage-backend-extra-config"
    return json.loads(match.group(1))


def mha_pool(layout: str = "page_first", dtype: torch.dtype = torch.bfloat16, pages: int = 24) -> MHAHostPool:
    return MHAHostPool(
        size=pages * PAGE, page_size=PAGE, layer_num=LAYERS, dtype=dtype, layout=layout, head_num=2, head_dim=64
    )


def mla_pool(layout: str = "page_first", pages: int = 24) -> MLAHostPool:
    return MLAHostPool(
        size=pages * PAGE, page_size=PAGE, layer_num=LAYERS, dtype=torch.bfloat16, layout=layout, kv_cache_dim=96
    )


def randomize(pool) -> None:
    """Random bytes in every page of the pool."""
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))


def page(pool, indices: torch.Tensor, p: int) -> bytes:
    """Page `p` of `indices`, through the pool's own (SGLang's) page accessor."""
    return bytes(pool.get_data_page(int(indices[p * PAGE])).contiguous().view(torch.uint8).numpy())


def page_keys(pages: int, seed: int = 0) -> list[str]:
    """SGLang's keys for a prompt of `pages` pages: its SHA-256 page-hash chain."""
    rng = random.Random(seed)
    return get_hash_str([rng.randrange(150_000) for _ in range(pages * PAGE)], None, page_size=PAGE)


@pytest.fixture
def attach(bare_cluster):
    """`attach(pool, master=..., tp_rank=..., ..., **extra_config)`: a backend as SGLang attaches one."""
    backends: list = []

    def make(
        pool,
        *,
        master: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        mla: bool = False,
        model: str | None = MODEL,
        metrics: bool = False,
        **extra,
    ) -> HiCacheKvtier:
        options = {**documented_extra_config(), "master": master or bare_cluster.master_address, "timeout": 2}
        options.update(extra)
        storage_config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=mla,
            enable_storage_metrics=metrics,
            is_page_first_layout=pool.layout == "page_first",
            model_name=model,
            extra_config=json.loads(json.dumps(options)),  # what SGLang parses from the flag
        )
        backend = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
        backends.append(backend)
        backend.register_mem_pool_host(pool)
        return backend

    yield make
    for backend in backends:
        backend.close()


def raw_client(cluster, backend: HiCacheKvtier) -> Client:
    """A plain kvtier client in the backend's namespace, to look at what it stored."""
    return cluster.client(namespace=backend.namespace)


def test_the_documented_flags_load_the_adapter_through_sglangs_dynamic_backend(cluster, attach):
    extra = documented_extra_config()
    assert extra["module_path"] == "kvtier.client.integrations.sglang" and extra["interface_v1"] == 1
    backend = attach(mha_pool())
    assert type(backend) is HiCacheKvtier and isinstance(backend, HiCacheStorage)
    assert backend.namespace.startswith("sglang.Qwen_Qwen3-0.6B.bfloat16.tp0of1.pp0of1.")
    identity = backend.identity
    assert (identity.layout, identity.tokens_per_block, identity.hash_scheme) == ("page_first", PAGE, "sha256-chain")
    assert identity.model == MODEL and not identity.rankless


@pytest.mark.parametrize(
    "make_pool, mla, packed, objects",
    [
        (lambda: mha_pool("page_first"), False, False, 2),
        (lambda: mha_pool("page_first_direct"), False, False, 2),
        (lambda: mha_pool("page_head"), False, False, 2),
        (lambda: mha_pool("layer_first"), False, True, 1),
        (lambda: mla_pool("page_first"), True, False, 1),
        (lambda: mla_pool("layer_first"), True, False, LAYERS),
    ],
    ids=["mha-page_first", "mha-page_first_direct", "mha-page_head", "mha-layer_first", "mla-page_first", "mla-lf"],
)
def test_pages_round_trip_through_kvtier_into_another_instances_pool(cluster, attach, make_pool, mla, packed, objects):
    pool_a, pool_b = make_pool(), make_pool()
    randomize(pool_a)
    writer, reader = attach(pool_a, mla=mla), attach(pool_b, mla=mla)
    keys = page_keys(6)
    stored = pool_a.alloc(6 * PAGE)
    assert writer.batch_set_v1(keys, stored) == [True] * 6

    pool_b.alloc(2 * PAGE)  # other slots than the writer's: the pages must land where SGLang asks
    loaded = pool_b.alloc(6 * PAGE)
    assert reader.batch_exists(keys) == 6
    assert reader.batch_get_v1(keys, loaded) == [True] * 6
    for p in range(6):
        assert page(pool_b, loaded, p) == page(pool_a, stored, p), f"page {p} differs"
    untouched = torch.arange(0, 2 * PAGE)
    assert not any(page(pool_b, untouched, p).strip(b"\0") for p in range(2)), "bytes landed outside the pages"

    listed = sorted(k.key for k in raw_client(cluster, writer).iter_keys())
    suffixes = [".page"] if packed else [f".{i}" for i in range(objects)]
    assert listed == sorted(f"{k}{s}" for k in keys for s in suffixes)
    page_bytes = writer.page_map.page_bytes
    assert writer.stats().get("bytes_copied", 0) == (6 * page_bytes if packed else 0)
    assert reader.stats().get("bytes_copied", 0) == (6 * page_bytes if packed else 0)


def test_batch_exists_counts_leading_pages_in_one_call_and_a_missing_middle_page_shrinks_the_prefix(cluster, attach):
    pool_a, pool_b = mha_pool(), mha_pool()
    randomize(pool_a)
    writer, reader = attach(pool_a), attach(pool_b)
    keys = page_keys(8)
    assert writer.batch_set_v1(keys, pool_a.alloc(8 * PAGE)) == [True] * 8

    calls = []
    longest_prefix = reader.client.longest_prefix
    reader.client.longest_prefix = lambda object_keys, **kw: (
        calls.append((len(object_keys), kw)) or longest_prefix(object_keys, **kw)
    )
    assert reader.batch_exists(keys) == 8
    # one kvtier call for 8 pages of 2 objects, prefetching (SGLang loads what it finds next)
    assert calls == [(16, {"prefetch": True})]
    assert reader.batch_exists(keys + page_keys(2, seed=1)) == 8
    assert reader.batch_exists(page_keys(2, seed=1) + keys) == 0

    assert raw_client(cluster, writer).remove(f"{keys[3]}.1")  # page 3 loses its V half
    assert reader.batch_exists(keys) == 3
    assert (reader.exists(keys[2]), reader.exists(keys[3])) == (True, False)
    assert reader.batch_get_v1(keys, pool_b.alloc(8 * PAGE)) == [True] * 3 + [False] + [True] * 4


def test_sets_are_idempotent_and_never_rewrite_a_stored_page(cluster, attach):
    pool_a, pool_b = mha_pool(), mha_pool()
    randomize(pool_a)
    writer = attach(pool_a)
    keys = page_keys(4)
    stored = pool_a.alloc(4 * PAGE)
    original = [page(pool_a, stored, p) for p in range(4)]
    assert writer.batch_set_v1(keys, stored) == [True] * 4
    written = writer.client.stats()["bytes_written"]

    pool_a.kv_buffer.add_(1)  # the same keys with other bytes: a second set must change nothing
    assert writer.batch_set_v1(keys, stored) == [True] * 4
    assert writer.client.stats()["bytes_written"] == written
    assert attach(mha_pool()).batch_set_v1(keys, stored) == [True] * 4  # another instance, pages already there

    loaded = pool_b.alloc(4 * PAGE)
    assert attach(pool_b).batch_get_v1(keys, loaded) == [True] * 4
    assert [page(pool_b, loaded, p) for p in range(4)] == original


def test_kvtier_down_gives_misses_and_failures_and_never_raises(cluster, attach):
    pool = mha_pool()
    randomize(pool)
    backend = attach(pool, timeout=1)
    keys = page_keys(4)
    indices = pool.alloc(4 * PAGE)
    assert backend.batch_set_v1(keys, indices) == [True] * 4
    cluster.kill(cluster.master)

    assert backend.batch_exists(keys) == 0
    assert backend.exists(keys[0]) is False
    assert backend.batch_get_v1(keys, indices) == [False] * 4
    assert backend.batch_set_v1(page_keys(2, seed=1), pool.alloc(2 * PAGE)) == [False] * 2
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert backend.set(keys[0], pool.get_data_page(0)) is False
    assert backend.clear() is False
    stats = backend.get_stats().kvtier
    # The first failure opens the adapter's circuit breaker: later calls are answered at once.
    failures = stats["errors"] + stats.get("short_circuited", 0)
    assert failures >= 3 and stats["pages_not_loaded"] >= 4 and stats["pages_not_stored"] >= 2


@pytest.mark.parametrize("how", ["extra-config", "env"])
def test_the_off_switch_stores_nothing_finds_nothing_and_needs_no_kvtier(cluster, attach, monkeypatch, how):
    pool = mha_pool()
    randomize(pool)
    keys = page_keys(4)
    indices = pool.alloc(4 * PAGE)
    off_options = {"enabled": False} if how == "extra-config" else {}
    if how == "env":
        monkeypatch.setenv("KVTIER_DISABLE", "1")
    started = time.monotonic()
    off = attach(pool, master="127.0.0.1:1", **off_options)  # nothing listens there: never asked
    assert off.batch_set_v1(keys, indices) == [True] * 4  # accepted, dropped: SGLang neither retries nor logs
    assert off.batch_set(keys, [pool.get_data_page(int(indices[p * PAGE])) for p in range(4)]) is True
    assert off.batch_exists(keys) == 0 and off.exists(keys[0]) is False
    assert off.batch_get_v1(keys, pool.alloc(4 * PAGE)) == [False] * 4
    assert off.get(keys[0], pool.get_dummy_flat_data_page()) is None
    # never asked: any call to a master would have waited out a timeout (the default, 5 s) first
    assert time.monotonic() - started < ClientConfig(master="unused:1").timeout / 2
    assert off.client is None and off.stats()["pages_dropped"] == 8

    off_here = attach(mha_pool(), **off_options)  # the live cluster: still nothing stored
    assert off_here.batch_set_v1(keys, indices) == [True] * 4
    monkeypatch.delenv("KVTIER_DISABLE", raising=False)
    on = attach(mha_pool())
    assert on.batch_exists(keys) == 0
    assert sum(s.objects for s in on.client.cluster_status().segments) == 0


def test_same_identity_shares_and_another_dtype_layout_tp_or_model_gets_only_misses(cluster, attach):
    pool_a = mha_pool()
    randomize(pool_a)
    writer = attach(pool_a)
    keys = page_keys(6)
    stored = pool_a.alloc(6 * PAGE)
    assert writer.batch_set_v1(keys, stored) == [True] * 6

    same_pool = mha_pool()
    same = attach(same_pool)
    assert same.namespace == writer.namespace
    assert same.batch_exists(keys) == 6
    loaded = same_pool.alloc(6 * PAGE)
    assert same.batch_get_v1(keys, loaded) == [True] * 6
    assert [page(same_pool, loaded, p) for p in range(6)] == [page(pool_a, stored, p) for p in range(6)]

    others = {
        "float16": lambda: attach(mha_pool(dtype=torch.float16)),
        "tp 0 of 2": lambda: attach(mha_pool(), tp_rank=0, tp_size=2),
        "pp 0 of 2": lambda: attach(mha_pool(), pp_rank=0, pp_size=2),
        "page_first_direct": lambda: attach(mha_pool("page_first_direct")),
        "another model": lambda: attach(mha_pool(), model="meta-llama/Llama-3.1-8B"),
        "a namespace prefix": lambda: attach(mha_pool(), namespace_prefix="alice"),
    }
    for what, make in others.items():
        other = make()
        pool = other.mem_pool_host
        assert other.namespace != writer.namespace, what
        assert other.batch_exists(keys) == 0, what  # the same page hashes: another namespace
        assert other.batch_get_v1(keys, pool.alloc(6 * PAGE)) == [False] * 6, what
        assert not pool.kv_buffer.view(torch.uint8).any(), f"{what}: bytes of another identity were loaded"


def test_model_overrides_and_quantization_sglang_runs_with_reach_the_identity(cluster, attach, monkeypatch):
    """One model path with --json-model-override-args (a RoPE scaling, say) makes other KV than
    without: such deployments shared a namespace. What SGLang publishes of them reaches the identity."""
    import kvtier.client.integrations.sglang as adapter

    plain = attach(mha_pool())
    settings = {"model_path": "/models/llama", "json_model_override_args": "{}"}
    monkeypatch.setattr(adapter, "_engine_model_setting", lambda name: settings.get(name))
    with_path = attach(mha_pool())
    assert with_path.namespace != plain.namespace, "the weights' path is part of it"
    settings["json_model_override_args"] = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'
    overridden = attach(mha_pool())
    settings["json_model_override_args"] = '{"rope_scaling":{"factor":4.0,"rope_type":"yarn"}}'
    assert attach(mha_pool()).namespace == overridden.namespace, "the same overrides, spelt otherwise"
    settings["json_model_override_args"] = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'
    settings["quantization"] = "fp8"
    quantized = attach(mha_pool())
    assert len({with_path.namespace, overridden.namespace, quantized.namespace}) == 3


def test_mla_pages_are_shared_by_every_tp_rank_and_size_but_not_across_pp_stages(cluster, attach):
    pool_a = mla_pool()
    randomize(pool_a)
    writer = attach(pool_a, mla=True, tp_rank=0, tp_size=2)
    keys = page_keys(5)
    stored = pool_a.alloc(5 * PAGE)
    assert writer.batch_set_v1(keys, stored) == [True] * 5
    assert ".tpall." in writer.namespace

    for tp_rank, tp_size in ((1, 2), (3, 4), (0, 1)):
        pool = mla_pool()
        reader = attach(pool, mla=True, tp_rank=tp_rank, tp_size=tp_size)
        loaded = pool.alloc(5 * PAGE)
        assert reader.batch_get_v1(keys, loaded) == [True] * 5, (tp_rank, tp_size)
        assert [page(pool, loaded, p) for p in range(5)] == [page(pool_a, stored, p) for p in range(5)]
    assert attach(mla_pool(), mla=True, pp_rank=1, pp_size=2).batch_exists(keys) == 0
    assert attach(mla_pool(), mla=False).batch_exists(keys) == 0  # the same bytes read as per-rank KV: no


def test_an_fp8_cache_needs_its_variant_and_a_model_name_is_required(cluster, attach):
    with pytest.raises(IdentityError, match="kv_dtype"):
        attach(mha_pool(dtype=torch.uint8))  # SGLang stores fp8 e4m3 and e5m2 caches as uint8
    with pytest.raises(IdentityError, match="model"):
        attach(mha_pool(), model=None)
    assert attach(mha_pool(), model=None, kvtier_model=MODEL).namespace == attach(mha_pool()).namespace

    pool = mha_pool(dtype=torch.uint8)
    randomize(pool)
    keys = page_keys(3)
    e4m3 = attach(pool, kv_dtype="fp8_e4m3")
    assert ".fp8_e4m3." in e4m3.namespace
    assert e4m3.batch_set_v1(keys, pool.alloc(3 * PAGE)) == [True] * 3
    assert attach(mha_pool(dtype=torch.uint8), kv_dtype="fp8_e5m2").batch_exists(keys) == 0
    assert attach(mha_pool(dtype=torch.uint8), kv_dtype="fp8_e4m3").batch_exists(keys) == 3


def test_a_restart_of_every_kvtier_process_keeps_the_pages_shared(bare_cluster, attach, tmp_path):
    state_dir, ssd_dir = str(tmp_path / "master-state"), tmp_path / "ssd"
    ssd_dir.mkdir()
    # A low offload watermark copies every page to the SSD tier soon after it is stored.
    master_args = ("--state-dir", state_dir, "--offload-watermark", "0.001")
    segment_args = ("--ssd-dir", str(ssd_dir), "--ssd-size", "64MiB", "--ssd-bucket-size", "4MiB")
    bare_cluster.start_master(*master_args)
    bare_cluster.start_segment("ssd0", "16MiB", *segment_args)

    pool_a = mha_pool()
    randomize(pool_a)
    writer = attach(pool_a)
    keys = page_keys(8)
    stored = pool_a.alloc(8 * PAGE)
    expected = [page(pool_a, stored, p) for p in range(8)]
    assert writer.batch_set_v1(keys, stored) == [True] * 8
    inspect = raw_client(bare_cluster, writer)  # listing grants no read lease (a leased object is not offloaded)
    objects = sorted(writer.page_map.object_keys(keys))
    assert bare_cluster.wait_for(
        lambda: [k.key for k in inspect.iter_keys() if k.ssd_replicas] == objects, timeout=20
    ), "the pages were not offloaded to the SSD tier"
    writer.close()

    bare_cluster.kill(bare_cluster.segments["ssd0"])
    bare_cluster.restart_master(*master_args)
    bare_cluster.start_segment("ssd0", "16MiB", *segment_args)

    pool_b = mha_pool()
    reader = attach(pool_b)
    assert reader.namespace == writer.namespace
    assert bare_cluster.wait_for(lambda: reader.batch_exists(keys) == 8, timeout=20)
    loaded = pool_b.alloc(8 * PAGE)
    assert reader.batch_get_v1(keys, loaded) == [True] * 8
    assert [page(pool_b, loaded, p) for p in range(8)] == expected
    assert attach(mha_pool(dtype=torch.float16)).batch_exists(keys) == 0
    assert attach(mha_pool(), tp_rank=1, tp_size=2).batch_exists(keys) == 0


def test_the_generic_path_without_interface_v1_round_trips_flat_pages(cluster, attach):
    pool_a, pool_b = mha_pool("layer_first"), mha_pool("layer_first")
    randomize(pool_a)
    writer, reader = attach(pool_a, interface_v1=0), attach(pool_b, interface_v1=0)
    keys = page_keys(4)
    stored = pool_a.alloc(4 * PAGE)
    assert writer.batch_set(keys[:3], [pool_a.get_data_page(int(stored[p * PAGE])) for p in range(3)]) is True
    assert writer.set(keys[3], pool_a.get_data_page(int(stored[3 * PAGE]))) is True
    assert reader.batch_exists(keys) == 4

    loaded = pool_b.alloc(4 * PAGE)
    got = reader.batch_get(keys, [pool_b.get_dummy_flat_data_page() for _ in keys])
    assert all(t is not None for t in got)
    for p, flat in enumerate(got):  # what SGLang's _generic_page_get does with them
        pool_b.set_from_flat_data_page(int(loaded[p * PAGE]), flat)
    assert [page(pool_b, loaded, p) for p in range(4)] == [page(pool_a, stored, p) for p in range(4)]
    assert reader.get(page_keys(1, seed=1)[0], pool_b.get_dummy_flat_data_page()) is None
    assert attach(mha_pool("layer_first")).batch_exists(keys) == 0  # v1 objects are other objects


def test_quotas_are_registered_per_deployment_and_pages_count_against_their_rank(cluster, attach):
    pool = mha_pool()
    randomize(pool)
    backend = attach(pool, tp_rank=1, tp_size=2, instance="qwen-a", budget_bytes=32 << 20)
    assert backend.batch_set_v1(page_keys(4), pool.alloc(4 * PAGE)) == [True] * 4
    ranks = {q["rank"]: q for q in backend.client.quotas() if q["instance"] == "qwen-a"}
    assert {r: (q["quota"], q["tp_size"], q["pp_size"]) for r, q in ranks.items()} == {
        0: (16 << 20, 2, 1),
        1: (16 << 20, 2, 1),
    }
    assert ranks[1]["used"] >= 4 * backend.page_map.page_bytes and ranks[1]["objects"] == 8
    assert ranks[0]["used"] == 0


def test_get_stats_gives_sglangs_storage_metrics_with_the_adapters_counters(cluster, attach):
    pool_a, pool_b = mha_pool(), mha_pool()
    randomize(pool_a)
    writer, reader = attach(pool_a, metrics=True), attach(pool_b, metrics=True)
    keys = page_keys(5)
    assert writer.batch_set_v1(keys, pool_a.alloc(5 * PAGE)) == [True] * 5
    assert reader.batch_exists(keys) == 5
    assert reader.batch_get_v1(keys, pool_b.alloc(5 * PAGE)) == [True] * 5

    written, read = writer.get_stats(), reader.get_stats()
    assert type(written).__name__ == "StorageMetrics"
    assert written.backup_pgs == [5] and written.backup_bandwidth[0] > 0 and written.prefetch_pgs == []
    assert read.prefetch_pgs == [5] and read.prefetch_bandwidth[0] > 0
    assert (
        written.kvtier["pages_stored"] == 5 and written.kvtier["client_bytes_written"] == 5 * writer.page_map.page_bytes
    )
    assert read.kvtier["pages_found"] == 5 and read.kvtier["pages_loaded"] == 5 and "errors" not in read.kvtier
    assert reader.get_stats().prefetch_pgs == []  # drained by the previous call, as SGLang expects


def test_side_pools_of_hybrid_models_are_answered_with_nothing_not_an_exception(cluster, attach):
    pool = mha_pool()
    randomize(pool)
    backend = attach(pool)
    keys = page_keys(3)
    indices = pool.alloc(3 * PAGE)
    assert backend.batch_set_v1(keys, indices) == [True] * 3
    mamba = [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=indices)]
    assert backend.batch_exists_v2(keys, mamba).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys).kv_hit_pages == 3
    assert backend.batch_get_v2(mamba) == {"mamba": [False] * 3}
    assert backend.batch_set_v2(mamba) == {"mamba": [False] * 3}
