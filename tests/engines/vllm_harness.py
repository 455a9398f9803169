"""A vLLM 0.33 engine as its OffloadingConnector drives an offloading spec, on CPU tensors.

`Engine` builds vLLM's real `OffloadingConfig` (what `build_offloading_config` hands the spec
factory; vLLM's `VllmConfig` itself cannot be built on this CPU-only machine: device inference and
the model-architecture probe need a GPU platform and the model executor), loads the spec through
vLLM's `OffloadingSpecFactory`, registers CPU tensors as the KV cache through vLLM's
`CanonicalKVCaches`, and calls the manager and the worker in the order vLLM's scheduler and
worker connectors do (offloading/scheduler.py, offloading/worker.py).
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import time
import uuid

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

TOKENS_PER_BLOCK = 16
BLOCK_SHAPE = (2, TOKENS_PER_BLOCK, 2, 32)  # one layer's block: K/V, tokens, KV heads, head size
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}
SPEC = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.client.integrations.vllm"}
_request_ids = itertools.count()


def page_bytes(dtype: str) -> int:
    return torch.empty(BLOCK_SHAPE, dtype=DTYPES[dtype]).nbytes


def offloading_config(
    extra: dict,
    *,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    rank: int = 0,
    blocks_per_chunk: int = 1,
    layers: int = 2,
    window_layers: int = 0,
    replicated: bool = False,
    model: str = "kvtier-tests/tiny-llama",
) -> OffloadingConfig:
    """vLLM's OffloadingConfig for a small model: one full-attention group of `layers` layers, and
    a sliding-window group of `window_layers` layers when asked."""
    groups = [
        OffloadingGroupConfig(
            tokens_per_block=TOKENS_PER_BLOCK,
            layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
            group_id=0,
        )
    ]
    if window_layers:
        groups.append(
            OffloadingGroupConfig(
                tokens_per_block=TOKENS_PER_BLOCK,
                layer_names=tuple(f"model.layers.{layers + i}.self_attn.attn" for i in range(window_layers)),
                group_id=1,
                sliding_window_size_in_chunks=2,
            )
        )
    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=page_bytes(dtype) * (layers + window_layers),
        enable_kv_cache_events=False,
        extra_config={**SPEC, **extra},
        engine_id=str(uuid.uuid4()),
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
        canonical_layout=False,
        kv_cache_layout="LBHNC",
    )


def prefix_keys(count: int, *, group: int = 0, salt: bytes = b"prompt") -> list[OffloadKey]:
    """Chained 32-byte block hashes, as vLLM's sha256 prefix hashing gives, keyed for one KV group."""
    keys, parent = [], hashlib.sha256(b"vllm-none-hash").digest()
    for i in range(count):
        parent = hashlib.sha256(parent + salt + i.to_bytes(4, "big")).digest()
        keys.append(make_offload_key(parent, group))
    return keys


class Engine:
    """One vLLM instance: the spec as vLLM's factory loads it, its manager and one worker, and a KV
    cache of `num_blocks` blocks per layer held in CPU tensors."""

    def __init__(self, config: OffloadingConfig, num_blocks: int = 64) -> None:
        self.config = config
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        dtype = DTYPES[config.model.dtype]
        self.layers = [
            torch.zeros((num_blocks, *BLOCK_SHAPE), dtype=dtype) for g in config.groups for _ in g.layer_names
        ]
        page = page_bytes(config.model.dtype)
        tensors = [CanonicalKVCacheTensor(t.view(torch.int8).view(num_blocks, page), page) for t in self.layers]
        refs, index = [], 0
        for group in config.groups:
            refs.append([CanonicalKVCacheRef(index + i, page) for i in range(len(group.layer_names))])
            index += len(group.layer_names)
        self.worker = self.spec.get_worker(CanonicalKVCaches(tensors, refs))
        self._jobs = itertools.count()
        self.lookup_rounds = 0

    # ------------------------------------------------------------------ the KV cache

    def fill(self, block_ids: list[int], seed: int) -> None:
        """Random bytes in these blocks of every layer (what a forward pass would have written)."""
        generator = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            raw = layer.view(torch.int8)
            for b in block_ids:
                raw[b] = torch.randint(-128, 128, raw[b].shape, dtype=torch.int8, generator=generator)

    def blocks(self, block_ids: list[int], layers: range | None = None) -> list[bytes]:
        """The bytes of these blocks, layer by layer."""
        chosen = self.layers if layers is None else [self.layers[i] for i in layers]
        return [bytes(layer.view(torch.int8)[b].numpy().tobytes()) for layer in chosen for b in block_ids]

    # ------------------------------------------------------------------ scheduler side

    def new_request(self) -> ReqContext:
        context = ReqContext(req_id=f"req-{next(_request_ids)}")
        self.manager.on_new_request(context)
        return context

    def lookup(self, keys: list[OffloadKey], context: ReqContext | None = None, timeout: float = 30.0) -> int:
        """The loadable prefix, as vLLM's scheduler finds it: `lookup` key by key (RETRY does not stop
        the scan, MISS does), the step ends (`on_schedule_end`), and a deferred request is asked
        again at a later step, while the manager has pending work."""
        context = context or self.new_request()
        deadline = time.monotonic() + timeout
        self.lookup_rounds = 0
        while True:
            self.lookup_rounds += 1
            hits, deferred = 0, False
            with self.manager.lock:
                for key in keys:
                    result = self.manager.lookup(key, context)
                    if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                        hits += 1
                    elif result is LookupResult.RETRY:
                        deferred = True
                    else:
                        break
                self.manager.on_schedule_end(ScheduleEndContext((), ()))
            if not deferred:
                return hits
            while self.manager.has_pending_work():
                assert time.monotonic() < deadline, "lookups never resolved"
                time.sleep(0.005)

    # ------------------------------------------------------------------ transfers

    def store(
        self, keys: list[OffloadKey], block_ids: list[int], group_sizes=None, block_indices=None
    ) -> TransferResult:
        """One store job: prepare_store, the spec crosses to the worker (pickled, as vLLM's metadata
        does), submit_store, completion, complete_store."""
        context = self.new_request()
        output = self.manager.prepare_store(keys, context)
        assert output is not None
        src = GPULoadStoreSpec(block_ids, group_sizes or [len(block_ids)], block_indices or [0])
        job = next(self._jobs)
        assert self.worker.submit_store(job, src, pickle.loads(pickle.dumps(output.store_spec)))
        result = self.finished(job)
        self.manager.complete_store(output.keys_to_store, context)
        self.manager.on_request_finished(context)
        return result

    def load(
        self,
        keys: list[OffloadKey],
        block_ids: list[int],
        context: ReqContext | None = None,
        group_sizes=None,
        block_indices=None,
        expedited: bool = False,
    ) -> tuple[TransferResult, set[int]]:
        """One load job; its result and the blocks the worker reports as failed."""
        context = context or self.new_request()
        with self.manager.lock:
            src = self.manager.prepare_load(keys, context)
        dst = GPULoadStoreSpec(block_ids, group_sizes or [len(block_ids)], block_indices or [0])
        job = next(self._jobs)
        assert self.worker.submit_load(job, pickle.loads(pickle.dumps(src)), dst, expedited=expedited)
        result = self.finished(job)
        errors = self.worker.get_block_ids_with_load_errors()
        self.manager.complete_load(keys, context)
        self.manager.on_request_finished(context)
        return result, errors

    def finished(self, job: int, timeout: float = 60.0) -> TransferResult:
        """The job's result, polled as vLLM does (`wait` returns at once for stores: their GPU blocks
        were read when they were submitted)."""
        self.worker.wait({job})
        deadline = time.monotonic() + timeout
        results: list[TransferResult] = []
        while not results and time.monotonic() < deadline:
            results = self.worker.get_finished()
            if not results:
                time.sleep(0.005)
        assert [r.job_id for r in results] == [job], results
        return results[0]

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
