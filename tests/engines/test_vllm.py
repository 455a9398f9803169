"""The vLLM 0.33 offloading adapter (client/integrations/vllm.py) against vLLM's real spec factory,
config and KV-cache types, and a real kvtier cluster (master and segment processes).

Each engine is driven as vLLM's OffloadingConnector drives a spec (tests/engines/vllm_harness.py),
with CPU tensors as the KV cache.
"""

from __future__ import annotations

import importlib
import json
import pickle
import signal
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)

from kvtier.client.integrations.identity import IdentityError, block_key
from kvtier.client.integrations.vllm import KvtierOffloadingSpec, forward_engine_config
from tests.capability import missing
from tests.cluster import Cluster
from tests.engines.vllm_harness import Engine, offloading_config, prefix_keys
from tests.integration.test_ssd_tier import segment_info, start_ssd_segment


@pytest.fixture
def engines(request: pytest.FixtureRequest):
    """`make(cluster_or_master, **config)`: an Engine on that kvtier master; all closed afterwards."""
    made: list[Engine] = []

    def make(master: Cluster | str, extra: dict | None = None, **config) -> Engine:
        address = master if isinstance(master, str) else master.master_address
        engine = Engine(offloading_config({"master": address, "timeout": 2.0, **(extra or {})}, **config))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(autouse=True)
def _own_hash_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every test decides PYTHONHASHSEED and the off switch itself, and starts with vLLM's hashing not
    # initialised in this process (another engine's tests may have run vLLM's init_none_hash).
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("KVTIER_DISABLE", raising=False)
    kv_cache_utils = sys.modules.get("vllm.v1.core.kv_cache_utils")
    if kv_cache_utils is not None:
        monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)


def test_vllm_factory_loads_the_spec_by_name_and_module_path(cluster, engines):
    engine = engines(cluster)
    assert type(engine.spec) is KvtierOffloadingSpec and isinstance(engine.spec, OffloadingSpec)
    assert isinstance(engine.manager, OffloadingManager) and isinstance(engine.worker, OffloadingWorker)
    namespace = engine.spec.namespace
    assert namespace.startswith("vllm.kvtier-tests_tiny-llama.bfloat16.tp0of1.pp0of1."), namespace
    identity = engine.spec.identity
    assert (identity.hash_scheme, identity.hash_seed, identity.tokens_per_block) == ("sha256", "vllm-none-hash", 16)
    assert identity.layout == "LBHNC/direct" and not identity.rankless


def test_stored_blocks_are_found_and_load_back_byte_for_byte(cluster, engines):
    writer, reader = engines(cluster), engines(cluster)
    keys = prefix_keys(6)
    writer.fill(list(range(1, 7)), seed=1)
    result = writer.store(keys, list(range(1, 7)))
    assert result.success and result.transfer_size == 6 * 2 * writer.layers[0][0].nbytes

    assert reader.lookup(keys) == 6
    assert reader.lookup_rounds == 2, "the first lookup of a request defers (RETRY) while kvtier is asked"
    result, errors = reader.load(keys, [40, 41, 42, 43, 44, 45])
    assert result.success and not errors
    assert reader.blocks([40, 41, 42, 43, 44, 45]) == writer.blocks(list(range(1, 7)))
    assert reader.blocks([1]) != writer.blocks([1]), "only the loaded blocks changed"


@pytest.mark.parametrize("first_block", [0, 1])
def test_chunks_of_several_blocks_map_to_blocks_as_vllm_does(cluster, engines, first_block):
    """blocks_per_chunk=2: a chunk holds two blocks; a load may start in the middle of a chunk (the
    first block is already on the GPU), and a store never writes a chunk it cannot fill."""
    writer, reader = engines(cluster, blocks_per_chunk=2), engines(cluster, blocks_per_chunk=2)
    keys = prefix_keys(4)
    writer.fill(list(range(1, 8)), seed=2)
    assert writer.store(keys, list(range(1, 8))).success  # 7 blocks: the 4th chunk is half full
    assert reader.lookup(keys) == 3, "the half-filled chunk was not stored"

    gpu = [30, 31, 32, 33, 34, 35][first_block:]
    result, errors = reader.load(keys[:3], gpu, block_indices=[first_block])
    assert result.success and not errors
    assert reader.blocks(gpu) == writer.blocks(list(range(1 + first_block, 7)))


def test_a_missing_middle_block_shrinks_the_loadable_prefix(cluster, engines):
    writer, reader = engines(cluster), engines(cluster)
    keys = prefix_keys(8)
    writer.fill(list(range(8)), seed=3)
    assert writer.store(keys[:6], list(range(6))).success
    assert reader.lookup(keys) == 6, "a prefix longer than what was stored"

    with cluster.client(namespace=writer.spec.namespace) as kv:
        assert kv.remove(block_key(keys[3]))
    assert reader.lookup(keys) == 3

    result, errors = reader.load(keys[:4], [50, 51, 52, 53])  # loading past it anyway: that block fails
    assert not result.success and errors == {53}
    assert reader.blocks([50, 51, 52]) == writer.blocks([0, 1, 2])


def test_sliding_window_groups_are_answered_chunk_by_chunk(cluster, engines):
    """A hybrid model: a full-attention group and a sliding-window group stored in one job."""
    writer = engines(cluster, window_layers=1)
    reader = engines(cluster, window_layers=1)
    full, window = prefix_keys(4, group=0), prefix_keys(4, group=1)
    writer.fill(list(range(1, 9)), seed=4)
    assert writer.store(full + window, list(range(1, 9)), group_sizes=[4, 4], block_indices=[0, 0]).success
    with cluster.client(namespace=writer.spec.namespace) as kv:
        assert kv.remove(block_key(window[1]))

    context = reader.new_request()
    assert reader.lookup(full, context) == 4
    reader.lookup(window, context)
    answers = [reader.manager.lookup(k, context) for k in window]
    assert answers == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]

    result, errors = reader.load(
        full + window[2:], [20, 21, 22, 23, 24, 25], context, group_sizes=[4, 2], block_indices=[0, 2]
    )
    assert result.success and not errors
    assert reader.blocks([20, 21, 22, 23], range(2)) == writer.blocks([1, 2, 3, 4], range(2))
    assert reader.blocks([24, 25], range(2, 3)) == writer.blocks([7, 8], range(2, 3))


@pytest.mark.parametrize("fold", [False, True], ids=["offloading-connector", "kvtier-connector"])
def test_kvtier_down_fails_loads_per_block_and_nothing_raises(cluster, engines, fold):
    extra = {"fold_load_errors": True} if fold else {}
    writer, reader = engines(cluster, extra), engines(cluster, extra)
    keys = prefix_keys(4)
    writer.fill(list(range(4)), seed=5)
    assert writer.store(keys, list(range(4))).success
    context = reader.new_request()
    assert reader.lookup(keys, context) == 4

    cluster.kill(cluster.master)
    result, errors = reader.load(keys, [10, 11, 12, 13], context)
    assert errors == {10, 11, 12, 13}, "every block of the failed load is reported"
    # vLLM 0.33's OffloadingConnectorWorker asserts success: under KvtierOffloadingConnector the
    # failure travels as invalid blocks instead.
    assert result.success is fold
    assert reader.lookup(keys) == 0, "a lookup while kvtier is down is a miss"
    assert writer.store(prefix_keys(2, salt=b"later"), [5, 6]).success, "a store is dropped, not an error"
    read, written = reader.spec.stats(), writer.spec.stats()
    assert read["load_failed_blocks"] == 4 and read["errors"] >= 1, read  # the load, the lookup
    assert written["stores_dropped"] == 2, written


def test_the_engine_never_waits_on_kvtier_for_a_store(cluster, engines):
    """vLLM calls wait() before reusing a stored job's GPU blocks, on its engine thread: the blocks
    were copied out at submit, so a store to a kvtier that hangs or is down must not stall it."""
    timeout = 3.0
    writer = engines(cluster, {"timeout": timeout})
    writer.fill([0, 1], seed=9)
    cluster.kill(cluster.master)  # every kvtier call now takes its whole timeout before failing
    context = writer.new_request()
    output = writer.manager.prepare_store(prefix_keys(2, salt=b"stall"), context)
    src = GPULoadStoreSpec([0, 1], [2], [0])
    assert writer.worker.submit_store(9001, src, pickle.loads(pickle.dumps(output.store_spec)))
    started = time.monotonic()
    writer.worker.wait({9001})
    assert time.monotonic() - started < timeout / 3, "wait() waited for kvtier, not for the GPU blocks"
    result = writer.finished(9001)  # the store itself still ends, dropped, and is reported done
    assert result.success and writer.spec.stats()["stores_dropped"] == 2


@pytest.mark.parametrize("switch", ["config", "env"])
def test_the_off_switch_finds_nothing_and_stores_nothing(cluster, engines, monkeypatch, switch):
    writer = engines(cluster)
    keys = prefix_keys(3)
    writer.fill([0, 1, 2], seed=6)
    assert writer.store(keys, [0, 1, 2]).success
    before = cluster.client().cluster_status().objects

    if switch == "env":
        monkeypatch.setenv("KVTIER_DISABLE", "1")
    extra = {"enabled": False} if switch == "config" else {}
    # unseeded hashes and an unreachable master do not matter once kvtier is off
    off = engines("127.0.0.1:9", {**extra, "prefix_caching_hash_algo": "xxhash"})
    on = engines(cluster)
    assert not off.spec.enabled and on.spec.enabled != (switch == "env")

    context = off.new_request()
    assert [off.manager.lookup(k, context) for k in keys] == [LookupResult.MISS] * 3, "no RETRY, no kvtier call"
    assert not off.manager.has_pending_work()
    off.fill([3, 4], seed=7)
    assert off.manager.prepare_store(prefix_keys(2, salt=b"off"), context).keys_to_store == []
    assert off.store(prefix_keys(2, salt=b"off"), [3, 4]).success
    assert cluster.client().cluster_status().objects == before


def test_unseeded_hashes_are_refused_and_seeded_ones_accepted(cluster, engines, monkeypatch):
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(IdentityError, match="PYTHONHASHSEED"):
            engines(cluster, {"prefix_caching_hash_algo": algo})
    with pytest.raises(IdentityError, match="not one of"):
        engines(cluster, {"prefix_caching_hash_algo": "builtin"})

    sha = engines(cluster, {"prefix_caching_hash_algo": "sha256_cbor"})
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    seeded = engines(cluster, {"prefix_caching_hash_algo": "xxhash"})
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    other_seed = engines(cluster, {"prefix_caching_hash_algo": "xxhash"})
    assert seeded.spec.identity.hash_seed == "PYTHONHASHSEED=1234"
    assert len({sha.spec.namespace, seeded.spec.namespace, other_seed.spec.namespace}) == 3


def test_same_identity_shares_and_another_dtype_or_tp_layout_only_misses(cluster, engines):
    keys = prefix_keys(5)
    writer = engines(cluster)
    writer.fill(list(range(5)), seed=8)
    assert writer.store(keys, list(range(5))).success

    same = engines(cluster)
    assert same.lookup(keys) == 5
    assert same.load(keys, [20, 21, 22, 23, 24])[0].success
    assert same.blocks([20, 21, 22, 23, 24]) == writer.blocks(list(range(5)))

    others = [
        engines(cluster, dtype="float16"),
        engines(cluster, dtype="float8_e4m3fn"),
        engines(cluster, tp_size=2, rank=0),
        engines(cluster, {"model_revision": "refs/pr/7"}),
        engines(cluster, {"namespace_prefix": "alice"}),
    ]
    assert [o.lookup(keys) for o in others] == [0] * len(others)
    # even a load asked for anyway reads nothing of another identity
    result, errors = others[0].load(keys[:1], [30])
    assert not result.success and errors == {30}


def test_mla_replicated_layout_is_one_copy_every_tp_rank_reads(cluster, engines):
    rank0 = engines(cluster, tp_size=2, rank=0, replicated=True)
    rank1 = engines(cluster, tp_size=2, rank=1, replicated=True)
    keys = prefix_keys(3)
    assert rank0.spec.replicated_layout and rank0.spec.identity.rankless
    assert ".tpall." in rank0.spec.namespace
    rank0.fill([0, 1, 2], seed=9)
    assert rank0.store(keys, [0, 1, 2]).success  # vLLM lets rank 0 alone store a replicated layout
    result, errors = rank1.load(keys, [7, 8, 9])
    assert result.success and not errors
    assert rank1.blocks([7, 8, 9]) == rank0.blocks([0, 1, 2])


def test_sharing_survives_a_restart_of_every_kvtier_process(bare_cluster, engines, tmp_path: Path):
    state_dir, ssd_dir = str(tmp_path / "state"), tmp_path / "ssd"
    ssd_dir.mkdir()
    # Offload everything to SSD right away: DRAM copies die with a killed segment.
    master_flags = ("--state-dir", state_dir, "--offload-watermark", "0.001")
    bare_cluster.start_master(*master_flags)
    start_ssd_segment(bare_cluster, ssd_dir)
    keys = prefix_keys(8)
    writer = engines(bare_cluster, {"timeout": 15.0})
    writer.fill(list(range(8)), seed=10)
    assert writer.store(keys, list(range(8))).success
    expected = writer.blocks(list(range(8)))
    with bare_cluster.client() as kv:  # (not locate(): its read lease would hold the objects in DRAM)
        assert bare_cluster.wait_for(lambda: segment_info(kv).ssd_objects >= len(keys), timeout=20), (
            f"the blocks never reached the SSD tier: {segment_info(kv)}"
        )
    writer.close()

    bare_cluster.kill(bare_cluster.segments["ssd0"], signal.SIGKILL)
    bare_cluster.restart_master(*master_flags)
    start_ssd_segment(bare_cluster, ssd_dir)

    reader = engines(bare_cluster, {"timeout": 15.0})
    assert reader.lookup(keys) == 8
    result, errors = reader.load(keys, list(range(30, 38)))
    assert result.success and not errors
    assert reader.blocks(list(range(30, 38))) == expected
    with bare_cluster.client() as kv:
        # The bytes came off the SSD tier: served from it directly, or copied back to DRAM first by
        # the adapter's prefetch (a promotion) and served from there, whichever won the race.
        def from_ssd() -> int:
            return segment_info(kv).ssd_bytes_served + kv.cluster_status().tiering["promoted_bytes"]

        assert bare_cluster.wait_for(lambda: from_ssd() >= result.transfer_size, timeout=10), (
            f"not served from the SSD tier: {segment_info(kv)} {dict(kv.cluster_status().tiering)}"
        )
    assert engines(bare_cluster, {"timeout": 15.0}, dtype="float16").lookup(keys) == 0


# ------------------------------------------------------------------ vLLM's connector module
# These import vLLM's KV-connector package, which imports most of vLLM (pydantic, transformers,
# openai, xgrammar, ...); where those are not installed they are skipped, and fail under CI
# (tests/capability.py). They run last: the import
# stays for the session.


def _vllm_connector_modules() -> SimpleNamespace:
    with warnings.catch_warnings():  # torch and others warn on that import (pytest turns warnings into errors)
        warnings.simplefilter("ignore")
        try:  # under CI (make test-engines installs what these need) a failed import fails the test
            importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
        except ImportError as exc:
            missing("vllm-offloading", f"vLLM's connector package does not import: {exc!r}")
        from vllm.config import CacheConfig, KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common, worker
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    return SimpleNamespace(
        CacheConfig=CacheConfig,
        KVTransferConfig=KVTransferConfig,
        KVConnectorFactory=KVConnectorFactory,
        OffloadingConnectorMetadata=common.OffloadingConnectorMetadata,
        TransferJob=common.TransferJob,
        OffloadingConnectorWorker=worker.OffloadingConnectorWorker,
        OffloadingConnector=OffloadingConnector,
        get_hash_fn_by_name=get_hash_fn_by_name,
        kv_cache_utils=kv_cache_utils,
    )


def test_quantization_and_rope_vllm_runs_with_reach_the_identity(cluster, engines):
    """Two deployments of one checkpoint path differing only in weight quantization or RoPE scaling
    (the cached keys are rotated with it) shared a namespace: one read the other's KV as its own."""
    vllm = _vllm_connector_modules()
    text_config = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0}, rope_theta=None)
    model = SimpleNamespace(revision="", quantization="fp8", hf_text_config=text_config)
    extra = forward_engine_config(SimpleNamespace(cache_config=vllm.CacheConfig(), model_config=model), {})
    assert extra["quantization"] == "fp8"
    assert json.loads(extra["rope"]) == {"rope_parameters": {"factor": 4.0, "rope_type": "yarn"}}

    keys = prefix_keys(2)
    writer = engines(cluster)
    writer.fill([0, 1], seed=3)
    assert writer.store(keys, [0, 1]).success
    others = [engines(cluster, {"quantization": "fp8"}), engines(cluster, {"rope": extra["rope"]})]
    assert [o.lookup(keys) for o in others] == [0, 0]
    assert engines(cluster).lookup(keys) == 2


def test_kvtier_connector_turns_failed_loads_into_blocks_vllm_recomputes(cluster, engines):
    vllm = _vllm_connector_modules()
    transfer = vllm.KVTransferConfig(
        kv_connector="KvtierOffloadingConnector",
        kv_connector_module_path="kvtier.client.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"master": cluster.master_address},
    )
    connector_cls = vllm.KVConnectorFactory.get_connector_class(transfer)  # how vLLM finds it
    assert issubclass(connector_cls, vllm.OffloadingConnector) and connector_cls.__name__ == "KvtierOffloadingConnector"

    # What its __init__ forwards (a VllmConfig cannot be built here: see vllm_harness.py)
    engine_config = SimpleNamespace(cache_config=vllm.CacheConfig(), model_config=SimpleNamespace(revision="abc123"))
    extra = forward_engine_config(engine_config, dict(transfer.kv_connector_extra_config))
    assert (
        extra["spec_name"] == "KvtierOffloadingSpec" and extra["spec_module_path"] == "kvtier.client.integrations.vllm"
    )
    assert (extra["prefix_caching_hash_algo"], extra["model_revision"], extra["fold_load_errors"]) == (
        "sha256",
        "abc123",
        True,
    )
    with pytest.raises(IdentityError, match="vLLM runs with 'sha256'"):
        forward_engine_config(engine_config, {"prefix_caching_hash_algo": "sha256_cbor"})

    keys = prefix_keys(3)
    writer = engines(cluster, extra)
    writer.fill([0, 1, 2], seed=11)
    assert writer.store(keys, [0, 1, 2]).success

    def worker_side(engine: Engine):
        """vLLM's worker half of the OffloadingConnector on this engine's spec."""
        worker_connector = vllm.OffloadingConnectorWorker(engine.spec, None, None)
        worker_connector._init_worker(None)  # register_kv_caches' last step; the spec has its worker
        connector = connector_cls.__new__(connector_cls)
        connector.connector_worker = worker_connector
        return worker_connector, connector

    def found(engine: Engine):
        context = engine.new_request()
        assert engine.lookup(keys, context) == 3
        return context, engine.manager.prepare_load(keys, context)

    def load(worker_connector, job: int, context, src, blocks: list[int]) -> set[str]:
        jobs = {job: vllm.TransferJob(req_id=context.req_id, src_spec=src, dst_spec=GPULoadStoreSpec(blocks, [3], [0]))}
        worker_connector.start_kv_transfers(vllm.OffloadingConnectorMetadata(load_jobs=jobs, store_jobs={}))
        worker_connector.worker.wait({job})
        return worker_connector.get_finished(set())[1]  # finished_recving

    reader = engines(cluster, extra)
    worker_connector, connector = worker_side(reader)
    context, src = found(reader)
    assert load(worker_connector, 1, context, src, [10, 11, 12]) == {context.req_id}
    assert reader.blocks([10, 11, 12]) == writer.blocks([0, 1, 2])
    assert connector.get_block_ids_with_load_errors() == set()

    plain = engines(cluster, {"model_revision": "abc123"})  # under vLLM's own OffloadingConnector: no folding
    plain_worker_connector, _ = worker_side(plain)
    plain_found, found_again = found(plain), found(reader)
    cluster.kill(cluster.master)
    assert load(worker_connector, 2, *found_again, [20, 21, 22]) == {found_again[0].req_id}, "done receiving"
    assert connector.get_block_ids_with_load_errors() == {20, 21, 22}, "vLLM recomputes these"
    assert worker_connector.build_connector_worker_meta().completed_jobs == {1: 1, 2: 1}
    with pytest.raises(AssertionError):  # why KvtierOffloadingConnector exists: vLLM 0.33 asserts success
        load(plain_worker_connector, 3, *plain_found, [30, 31, 32])


def test_a_hash_scheme_that_disagrees_with_vllms_own_is_refused(cluster, engines, monkeypatch):
    vllm = _vllm_connector_modules()
    kcu = vllm.kv_cache_utils
    monkeypatch.setattr(kcu, "_NONE_HASH_SEED", kcu._NONE_HASH_SEED)  # restored after the test
    monkeypatch.setattr(kcu, "NONE_HASH", getattr(kcu, "NONE_HASH", None), raising=False)
    kcu.init_none_hash(vllm.get_hash_fn_by_name("sha256_cbor"))  # what vLLM's engine core does at start

    told_sha256 = engines(cluster)
    with pytest.raises(IdentityError, match="another scheme"):
        told_sha256.new_request()
    told_right = engines(cluster, {"prefix_caching_hash_algo": "sha256_cbor"})
    told_right.new_request()
    assert told_right.manager._engine_hash_checked

    monkeypatch.setenv("PYTHONHASHSEED", "7")  # a seed vLLM did not use
    with pytest.raises(IdentityError, match="another seed"):
        engines(cluster, {"prefix_caching_hash_algo": "sha256_cbor"}).new_request()
