"""vLLM 0.33 KV-cache offloading on kvtier: an `OffloadingSpec`, its scheduler-side manager and its
worker (docs/integrations.md, "vLLM (offloading spec)").

vLLM loads the spec by name from `kv_connector_extra_config` ("spec_name": "KvtierOffloadingSpec",
"spec_module_path": "kvtier.client.integrations.vllm") under its `OffloadingConnector`, or through
`KvtierOffloadingConnector` below (the recommended form: see "Failures").

- **Manager** (scheduler process). vLLM asks `lookup(key)` one offloaded chunk at a time, and turns
  the answers into the loadable prefix length. The first time a request's keys are asked, the
  manager answers RETRY and collects them; at the end of the step (`on_schedule_end`) it asks
  kvtier once per request and KV group (`Client.longest_prefix`; `batch_exists` for sliding-window
  groups) on a small thread pool, and the next step's lookups answer HIT for the present prefix and
  MISS from the first absent chunk on. Those calls prefetch (the `prefetch` setting, default on):
  chunks kvtier holds only on SSD start moving into DRAM, so the load that follows is a DRAM hit.
  The scheduler thread never waits for kvtier. Stores are not tracked here: kvtier owns placement
  and eviction (no evictions are announced to vLLM).
- **Worker** (each GPU worker process). A store copies the chunks' pages from the KV cache into a
  staging tensor on the engine thread (ordered after the forward pass that wrote them), then a
  bounded pool puts them with `batch_put` straight from memoryviews of that tensor. A load reads
  with `batch_get_into` straight into a staging tensor on the pool, then copies the chunks that
  came back whole into their KV-cache blocks. Completion goes back through `get_finished()`.
- **Identity**: the scheduler computes it from vLLM's `OffloadingConfig` and the extra config, and
  ships it to the workers inside each load/store spec; every worker applies its own TP/PP rank
  (none for pure-MLA replicated layouts). Keys are the hex of vLLM's `OffloadKey` (block hash plus
  KV-group index). Hashes that differ in every process (vLLM's xxhash schemes without
  PYTHONHASHSEED) are refused with `IdentityError`.
- **Failures**: a kvtier error is logged, counted (`spec.stats()`), and becomes a miss (lookup), a
  dropped store, or a failed load reported per KV-cache block (`get_block_ids_with_load_errors`).
  vLLM 0.33's `OffloadingConnectorWorker` still asserts `TransferResult.success`, so with its plain
  `OffloadingConnector` a failed load stops the engine loudly (never garbage KV). The subclass
  `KvtierOffloadingConnector` reports failed loads as invalid blocks instead, which vLLM recomputes
  with `"kv_load_failure_policy": "recompute"`; it also forwards vLLM's real
  `prefix_caching_hash_algo` and model revision to the spec. It is built on first access, because
  importing vLLM's connector module imports most of vLLM.
- **Off switch**: `enabled: false` (or KVTIER_DISABLE=1): lookups miss, stores are dropped, no
  kvtier client is ever created.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingParallelConfig

from kvtier.client import Status
from kvtier.client.integrations.common import Guard, KvtierSettings
from kvtier.client.integrations.identity import Identity, IdentityError, block_key

logger = logging.getLogger(__name__)

__all__ = [
    "KvtierLoadStoreSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "forward_engine_config",
    "vllm_identity",
]

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vllm/v1/core/kv_cache_utils.py (resolve_none_hash_seed): every prefix's hash chain starts from
# NONE_HASH = hash_fn(seed), seed = PYTHONHASHSEED if set, else the fixed "vllm-none-hash" for the
# sha256 schemes and os.urandom() for the xxhash ones (_NON_CRYPTO_HASH_FUNCTIONS).
RANDOM_SEED_ALGOS = frozenset(("xxhash", "xxhash_cbor"))
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _option(extra: Any, name: str, default: Any) -> Any:
    """An adapter option of the extra config, as `name` or `kvtier_name` (like KvtierSettings)."""
    return extra.get(f"kvtier_{name}", extra.get(name, default))


# ---------------------------------------------------------------------------------------- identity


def hash_scheme(extra: Any, environ: Any = os.environ) -> tuple[str, str]:
    """(scheme, seed) of vLLM's prefix-caching block hashes; IdentityError when they differ per process."""
    algo = str(_option(extra, "prefix_caching_hash_algo", "sha256"))
    if algo not in VLLM_HASH_ALGOS:
        raise IdentityError(f"prefix_caching_hash_algo {algo!r} is not one of vLLM's {VLLM_HASH_ALGOS}")
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return algo, f"PYTHONHASHSEED={seed}"
    if algo in RANDOM_SEED_ALGOS:
        raise IdentityError(
            f"vLLM's {algo!r} prefix hashes are unseeded here: without PYTHONHASHSEED, vLLM seeds them with "
            "random bytes in every process (vllm/v1/core/kv_cache_utils.py), so no two instances compute the "
            "same keys and kvtier would share nothing. Set PYTHONHASHSEED to the same value on every instance, "
            "or run vLLM with --prefix-caching-hash-algo sha256 (its default)."
        )
    return algo, DEFAULT_NONE_HASH_SEED


def vllm_identity(config: OffloadingConfig) -> Identity:
    """The identity of this deployment's offloaded chunks, as seen by rank 0 (see `rank_identity`)."""
    extra = config.extra_config
    algo, seed = hash_scheme(extra)
    cache = config.cache
    detail = {
        # what else the bytes of one chunk depend on: each group's block span, layer count and window
        "groups": [
            [g.group_id, g.tokens_per_block, len(g.layer_names), g.sliding_window_size_in_chunks] for g in config.groups
        ],
        "blocks_per_chunk": cache.blocks_per_chunk,
        "tokens_per_hash": cache.tokens_per_hash,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "pcp_size": config.parallel.pcp_size,
        "dcp_size": config.parallel.dcp_size,
    }
    # Other KV from the same checkpoint path (forward_engine_config): quantized weights, and RoPE
    # scaling or theta overridden (the cached keys are rotated with them).
    for name in ("quantization", "rope"):
        if value := _option(extra, name, ""):
            detail[name] = str(value)
    return Identity(
        engine="vllm",
        model=config.model.name,
        revision=str(_option(extra, "model_revision", "") or ""),
        kv_dtype=config.model.dtype,
        # kvtier keeps each worker's own pages (vLLM's "direct" layout), never canonical ones
        layout=f"{config.kv_cache_layout or 'default'}/direct",
        tokens_per_block=config.groups[0].tokens_per_block * cache.blocks_per_chunk if config.groups else 0,
        hash_scheme=algo,
        hash_seed=seed,
        tp_size=config.parallel.tp_size,
        pp_size=config.parallel.pp_size,
        rankless=bool(config.replicated_layout),
        extra=json.dumps(detail, sort_keys=True, separators=(",", ":")),
    ).validate()


def rank_identity(template: Identity, parallel: OffloadingParallelConfig) -> Identity:
    """The identity of one worker: vLLM orders a replica's ranks PP x PCP x TP (parallel_state.py)."""
    tp, pcp, pp = max(1, parallel.tp_size), max(1, parallel.pcp_size), max(1, parallel.pp_size)
    rank = parallel.rank % (tp * pcp * pp)
    pcp_rank = (rank // tp) % pcp
    extra = template.extra if pcp == 1 else f"{template.extra};pcp_rank={pcp_rank}"
    return replace(template, tp_rank=rank % tp, pp_rank=rank // (tp * pcp), extra=extra).validate()


def check_engine_hash(identity: Identity) -> bool:
    """Compare the identity's hash scheme with what vLLM really seeded in this process, once it has
    (the scheduler, after `init_none_hash`). IdentityError on a mismatch; False when not known yet."""
    kcu = sys.modules.get("vllm.v1.core.kv_cache_utils")
    if kcu is None or getattr(kcu, "_NONE_HASH_SEED", None) is None:
        return False
    seed = kcu.get_none_hash_seed()
    expected = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    if seed != expected:
        raise IdentityError(
            "vLLM seeded its prefix hashes with another seed than kvtier's identity names: per-process random "
            "bytes (an xxhash scheme without PYTHONHASHSEED, while kvtier was told prefix_caching_hash_algo="
            f"{identity.hash_scheme!r}), or a PYTHONHASHSEED changed since. Set PYTHONHASHSEED to the same value on "
            "every instance, or use sha256"
        )
    try:
        from vllm.utils.hashing import get_hash_fn_by_name

        matches = get_hash_fn_by_name(identity.hash_scheme)(seed) == kcu.NONE_HASH
    except Exception:  # the scheme's module (xxhash) is missing: vLLM would have failed first
        return True
    if not matches:
        raise IdentityError(
            f"kv_connector_extra_config says prefix_caching_hash_algo={identity.hash_scheme!r}, but vLLM hashes "
            "prefixes with another scheme: set it to vLLM's --prefix-caching-hash-algo (or use "
            "KvtierOffloadingConnector, which forwards it)"
        )
    return True


def _namespace(identity: Identity, settings: KvtierSettings) -> str:
    return identity.namespace(settings.namespace_prefix)


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The chunks of one load or store, in the order the GPU spec's blocks fill them (group by
    group), and the identity (rank 0's) they belong to. Crosses to the workers with vLLM's metadata."""

    def __init__(self, keys: Sequence[OffloadKey], identity: Identity | None) -> None:
        self.keys = list(keys)
        self.identity = identity

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} keys)"


# ----------------------------------------------------------------------------------------- spec


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec for kvtier; one per process and role (vLLM builds it in both)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra = self.extra_config
        self.settings = KvtierSettings.from_config(dict(extra))
        self.guard = Guard("vllm")
        # Pure-MLA TP-only deployments hold the same bytes on every rank: one rankless copy, written
        # by rank 0 only (vLLM's OffloadingConnectorWorker gates stores on this flag).
        self.replicated_layout = bool(config.replicated_layout)
        self.identity: Identity | None = vllm_identity(config) if self.settings.enabled else None
        self.fold_load_errors = bool(_option(extra, "fold_load_errors", False))
        self.lookup_threads = max(1, int(_option(extra, "lookup_threads", 2)))
        self.io_threads = max(1, int(_option(extra, "io_threads", 2)))
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None
        if self.identity is not None:
            logger.info("kvtier vLLM offloading namespace=%s master=%s", self.namespace, self.settings.master)
        else:
            logger.info("kvtier vLLM offloading disabled: lookups miss, stores are dropped")

    @property
    def enabled(self) -> bool:
        return self.identity is not None

    @property
    def namespace(self) -> str:
        """Rank 0's namespace (the one the scheduler's lookups ask)."""
        assert self.identity is not None, "kvtier is disabled"
        return _namespace(self.identity, self.settings)

    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvtierOffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(self, kv_caches)
        return self._worker

    def stats(self) -> dict[str, int]:
        """Failures and dropped work of this process's manager and worker (Guard counts)."""
        return self.guard.stats()


class _Clients:
    """kvtier clients by namespace, created on first use (so a down master costs nothing at start)."""

    def __init__(self, spec: KvtierOffloadingSpec, rank: int) -> None:
        self._spec = spec
        self._rank = rank
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    def get(self, namespace: str) -> Any:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                settings = self._spec.settings
                client = settings.client(namespace, rank=self._rank)
                self._clients[namespace] = client
                if settings.instance and settings.budget_bytes and self._rank == 0:
                    config = self._spec.config.parallel
                    self._spec.guard.call(
                        "register_instance",
                        lambda: client.register_instance(config.tp_size, config.pp_size, settings.budget_bytes),
                        0,
                    )
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


# -------------------------------------------------------------------------------------- manager


class KvtierOffloadingManager(OffloadingManager):
    """Scheduler side: answers lookups from one kvtier query per request and step.

    Every method runs on vLLM's scheduler thread (under `lock`, a no-op: nothing else enters);
    the lookup pool only hands results back through `_results`. Lookup verdicts live per request
    until it loads (`prepare_load` consumes them) or finishes.
    """

    def __init__(self, spec: KvtierOffloadingSpec) -> None:
        self._spec = spec
        self._guard = spec.guard
        # Lookups ask worker rank 0's namespace (the scheduler's parallel config has rank 0), with
        # the same per-rank fields a worker adds (e.g. its PCP rank), or they would never hit.
        self._identity = rank_identity(spec.identity, spec.config.parallel) if spec.identity is not None else None
        self._window_groups = frozenset(
            g.group_id for g in spec.config.groups if g.sliding_window_size_in_chunks is not None
        )
        self._clients = _Clients(spec, rank=0)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._generation: dict[str, int] = {}  # req_id -> incarnation; results of an older one are dropped
        self._next_generation = 0
        self._verdicts: dict[str, dict[OffloadKey, bool]] = {}
        self._pending: dict[str, dict[OffloadKey, None]] = {}  # asked this step, in the order asked
        self._asked: dict[str, set[OffloadKey]] = {}  # sent to kvtier, no answer drained yet
        self._results: queue.SimpleQueue[tuple[str, int, dict[OffloadKey, bool]]] = queue.SimpleQueue()
        self._in_flight = 0
        self._storing: set[OffloadKey] = set()
        self._engine_hash_checked = False

    # -------------------------------------------------------------- lookups

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._identity is not None and not self._engine_hash_checked:
            self._engine_hash_checked = check_engine_hash(self._identity)
        self._generation[req_context.req_id] = self._next_generation
        self._next_generation += 1
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._identity is None:
            return LookupResult.MISS
        self._drain()
        req = req_context.req_id
        verdict = self._verdicts.get(req, {}).get(key)
        if verdict is not None:
            return LookupResult.HIT if verdict else LookupResult.MISS
        if key not in self._asked.get(req, ()):
            self._pending.setdefault(req, {})[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._drain()
        pending, self._pending = self._pending, {}
        for req, keys in pending.items():
            generation = self._generation.get(req)
            if generation is None:
                continue
            self._asked.setdefault(req, set()).update(keys)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._spec.lookup_threads, thread_name_prefix="kvtier-vllm-lookup"
                )
            self._pool.submit(self._probe, req, generation, list(keys))
            self._in_flight += 1

    def has_pending_work(self) -> bool:
        self._drain()
        return self._in_flight > 0 or bool(self._pending)

    def _probe(self, req: str, generation: int, keys: list[OffloadKey]) -> None:
        """On the lookup pool: one kvtier call per KV group of the request's keys."""
        found: dict[OffloadKey, bool] = dict.fromkeys(keys, False)
        try:
            assert self._identity is not None
            client = self._guard.call(
                "connect", lambda: self._clients.get(_namespace(self._identity, self._spec.settings)), None
            )
            if client is not None:
                by_group: dict[int, list[OffloadKey]] = {}
                for key in keys:
                    by_group.setdefault(get_offload_group_idx(key), []).append(key)
                # vLLM loads what this lookup finds: blocks kvtier holds only on SSD start moving into
                # DRAM now (settings.prefetch), so the load that follows is a DRAM hit.
                prefetch = self._spec.settings.prefetch
                for group, group_keys in by_group.items():
                    names = [block_key(k) for k in group_keys]
                    if group in self._window_groups:  # looked up from the end: every chunk's own answer
                        present = self._guard.call(
                            "batch_exists", lambda n=names: client.batch_exists(n, prefetch=prefetch), []
                        )
                        found.update(zip(group_keys, present, strict=False))  # [] on failure
                    else:  # full attention: the loadable prefix; chunks past the first miss count as misses
                        count = self._guard.call(
                            "longest_prefix", lambda n=names: client.longest_prefix(n, prefetch=prefetch), 0
                        )
                        found.update((k, True) for k in group_keys[:count])
        except Exception:  # a bug here must not leave the request waiting forever
            logger.exception("kvtier vLLM lookup failed, treated as a miss")
            self._guard.count("errors")
        finally:
            self._results.put((req, generation, found))

    def _drain(self) -> None:
        while True:
            try:
                req, generation, found = self._results.get_nowait()
            except queue.Empty:
                return
            self._in_flight -= 1
            if self._generation.get(req) != generation:
                continue
            self._verdicts.setdefault(req, {}).update(found)
            asked = self._asked.get(req)
            if asked is not None:
                asked.difference_update(found)

    # -------------------------------------------------------------- loads and stores

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KvtierLoadStoreSpec:
        # The verdicts are spent: if this load fails and the request asks again, kvtier answers anew.
        self._verdicts.pop(req_context.req_id, None)
        return KvtierLoadStoreSpec(list(keys), self._identity)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        if self._identity is None:  # off switch: nothing to store (vLLM then advances quietly)
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec([], None), evicted_keys=[])
        # kvtier puts are idempotent; only skip chunks another request is storing right now.
        to_store = [k for k in keys if k not in self._storing]
        self._storing.update(to_store)
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=KvtierLoadStoreSpec(to_store, self._identity), evicted_keys=[]
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._storing.difference_update(keys)

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = req_context.req_id
        for table in (self._generation, self._verdicts, self._pending, self._asked):
            table.pop(req, None)

    def reset_cache(self) -> None:
        """Forget lookup verdicts and stores in flight (vLLM drops those jobs without complete_store);
        kvtier's contents are shared with other instances and stay."""
        self._verdicts.clear()
        self._storing.clear()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._clients.close()


# --------------------------------------------------------------------------------------- worker


@dataclass(frozen=True, slots=True)
class _Ref:
    tensor_idx: int
    page_bytes: int  # un-padded page of one block of this layer
    offset: int  # where this layer's pages start in a chunk's value


@dataclass(frozen=True, slots=True)
class _GroupSlice:
    """One KV group's part of a transfer: its chunks, and the GPU blocks that fill them in order
    from sub-block `skip` of the first chunk (as vLLM's CPU worker maps them)."""

    group: int  # index into spec.config.groups
    keys: list[OffloadKey]
    block_ids: torch.Tensor  # int64, CPU
    skip: int


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: async kvtier loads and stores of KV-cache blocks, through CPU staging tensors.

    A chunk's value is, layer by layer in the group's order, its `blocks_per_chunk` pages (each
    layer's un-padded page size). vLLM calls `submit_*`, `get_finished`, `wait` from one thread;
    the pool threads only fill `_done` and `_load_errors`.
    """

    def __init__(self, spec: KvtierOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self._spec = spec
        self._guard = spec.guard
        self._blocks_per_chunk = spec.blocks_per_chunk
        self._identity = rank_identity(spec.identity, spec.config.parallel) if spec.identity is not None else None
        self._tensors = []
        for t in kv_caches.tensors:
            view = t.tensor.view(torch.int8)
            if not (view.dim() == 2 and view.shape[1] == t.page_size_bytes):
                view = view.view(-1, t.page_size_bytes)
            self._tensors.append(view)
        self._groups: list[tuple[list[_Ref], int]] = []  # per group: layers, bytes of one chunk
        for refs in kv_caches.group_data_refs:
            layers, offset = [], 0
            for ref in refs:
                layers.append(_Ref(ref.tensor_idx, ref.page_size_bytes, offset))
                offset += ref.page_size_bytes * self._blocks_per_chunk
            self._groups.append((layers, offset))
        self._group_ids = [g.group_id for g in spec.config.groups]
        self._namespaces: dict[Identity, str] = {}
        self._clients = _Clients(spec, rank=spec.config.parallel.rank)
        self._pool = concurrent.futures.ThreadPoolExecutor(spec.io_threads, thread_name_prefix="kvtier-vllm-io")
        # expedited loads are waited on within the step: they never queue behind regular ones
        self._expedited = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-sync")
        self._lock = threading.Lock()
        self._jobs: dict[int, concurrent.futures.Future] = {}
        self._store_jobs: set[int] = set()  # staged already: wait() need not wait for them
        self._done: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._load_errors: set[int] = set()

    # -------------------------------------------------------------- vLLM's interface

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Async GPU -> kvtier. Never fails toward vLLM: a store kvtier refuses is a later miss."""
        start = time.perf_counter()
        try:
            assert isinstance(dst_spec, KvtierLoadStoreSpec)
            if self._identity is None or dst_spec.identity is None or not dst_spec.keys:
                self._finish(job_id, True, 0, start)
                return True
            slices = self._slices(src_spec, dst_spec.keys)
            # The device copy runs here, on the engine thread, so it is ordered after the forward
            # pass that wrote these blocks; only kvtier I/O goes to the pool.
            staged = [(s, *self._gather(s)) for s in slices]
        except Exception:
            logger.exception("kvtier vLLM store job %d could not be staged; dropped", job_id)
            self._guard.count("stores_dropped", len(dst_spec.keys) if isinstance(dst_spec, KvtierLoadStoreSpec) else 1)
            self._finish(job_id, True, 0, start)
            return True
        with self._lock:
            self._store_jobs.add(job_id)
        self._submit(self._pool, job_id, self._store, job_id, dst_spec.identity, staged, start)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Async kvtier -> GPU; chunks that do not come back whole are reported per block."""
        start = time.perf_counter()
        try:
            assert isinstance(src_spec, KvtierLoadStoreSpec)
            slices = self._slices(dst_spec, src_spec.keys)
        except Exception:
            logger.exception("kvtier vLLM load job %d has an unexpected shape; its blocks failed", job_id)
            self._fail_blocks(dst_spec.block_ids.tolist())
            self._finish(job_id, False, 0, start, load=True)
            return True
        if self._identity is None or src_spec.identity is None:
            self._fail_blocks(dst_spec.block_ids.tolist())
            self._finish(job_id, False, 0, start, load=True)
            return True
        pool = self._expedited if expedited else self._pool
        self._submit(pool, job_id, self._load, job_id, src_spec.identity, slices, start)
        return True

    def get_finished(self) -> list[TransferResult]:
        results = []
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                return results

    def wait(self, job_ids: set[int]) -> None:
        """vLLM waits here before it reuses the GPU blocks of these jobs. A store read its blocks in
        submit_store (a synchronous copy to staging): only loads still touch GPU memory, so only
        they are waited for; a slow or absent kvtier never stalls the engine on a store."""
        with self._lock:
            futures = [self._jobs[j] for j in job_ids if j in self._jobs and j not in self._store_jobs]
        concurrent.futures.wait(futures)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._expedited.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._clients.close()

    # -------------------------------------------------------------- jobs (pool threads)

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, job_id: int, fn: Any, *args: Any) -> None:
        with self._lock:
            self._jobs[job_id] = pool.submit(fn, *args)

    def _finish(self, job_id: int, ok: bool, size: int, start: float, *, load: bool = False) -> None:
        # A failed load is success=False (the OffloadingWorker contract), unless our connector
        # reports its blocks as invalid instead: vLLM 0.33's OffloadingConnectorWorker asserts success.
        success = ok or not load or self._spec.fold_load_errors
        self._done.put(TransferResult(job_id, success, transfer_size=size, transfer_time=time.perf_counter() - start))
        with self._lock:
            self._jobs.pop(job_id, None)
            self._store_jobs.discard(job_id)

    def _fail_blocks(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._load_errors.update(block_ids)
        self._guard.count("load_failed_blocks", len(block_ids))

    def _client(self, identity: Identity) -> Any:
        namespace = self._namespaces.get(identity)
        if namespace is None:
            namespace = _namespace(rank_identity(identity, self._spec.config.parallel), self._spec.settings)
            self._namespaces[identity] = namespace
        return self._guard.call("connect", lambda: self._clients.get(namespace), None)

    def _store(self, job_id: int, identity: Identity, staged: list, start: float) -> None:
        stored = 0
        try:
            keys = [k for s, _, full in staged for k, whole in zip(s.keys, full, strict=True) if whole]
            values = [
                row for _, staging, full in staged for row, whole in zip(staging.numpy(), full, strict=True) if whole
            ]
            self._guard.count("stores_partial_chunks", sum(len(s.keys) for s, _, _ in staged) - len(keys))
            client = self._client(identity) if keys else None
            if client is not None:
                replicas = self._spec.settings.replicas
                statuses = self._guard.call(
                    "batch_put", lambda: client.batch_put([block_key(k) for k in keys], values, replicas=replicas), None
                )
                ok = [v.nbytes for v, status in zip(values, statuses or (), strict=False) if status == Status.OK]
                stored = sum(ok)
                if len(ok) != len(keys):
                    self._guard.count("stores_dropped", len(keys) - len(ok))
            elif keys:
                self._guard.count("stores_dropped", len(keys))
        except Exception:
            logger.exception("kvtier vLLM store job %d failed; dropped", job_id)
            self._guard.count("errors")
        finally:
            self._finish(job_id, True, stored, start)

    def _load(self, job_id: int, identity: Identity, slices: list[_GroupSlice], start: float) -> None:
        loaded, failed = 0, []
        try:
            client = self._client(identity)
            for s in slices:
                n, ok = self._load_group(client, s)
                loaded += n
                failed.extend(s.block_ids[~ok].tolist())
        except Exception:
            logger.exception("kvtier vLLM load job %d failed", job_id)
            self._guard.count("errors")
            failed = [b for s in slices for b in s.block_ids.tolist()]
        finally:
            if failed:
                self._fail_blocks(failed)
            self._finish(job_id, not failed, loaded, start, load=True)

    def _load_group(self, client: Any, s: _GroupSlice) -> tuple[int, torch.Tensor]:
        """Read one group's chunks into staging and copy the whole ones to their blocks; (bytes, ok per block)."""
        layers, chunk_bytes = self._groups[s.group]
        staging = torch.empty((len(s.keys), chunk_bytes), dtype=torch.int8)
        sizes: list[int] = []
        if client is not None:
            names = [block_key(k) for k in s.keys]
            rows = list(staging.numpy())
            sizes = self._guard.call("batch_get_into", lambda: client.batch_get_into(names, rows), [])
        whole = torch.tensor([i < len(sizes) and sizes[i] == chunk_bytes for i in range(len(s.keys))])
        if len(sizes) == len(s.keys) and not bool(whole.all()):
            self._guard.count("load_misses", int((~whole).sum()))
        chunk_of, sub_of = self._positions(s)
        ok = whole[chunk_of]
        if bool(ok.any()):
            blocks, chunks, subs = s.block_ids[ok], chunk_of[ok], sub_of[ok]
            for layer in layers:
                pages = self._layer_view(staging, layer, len(s.keys))[chunks, subs]
                target = self._tensors[layer.tensor_idx]
                target[blocks.to(target.device), : layer.page_bytes] = pages.to(target.device)
            if any(t.is_cuda for t in self._tensors):
                torch.cuda.current_stream().synchronize()  # the blocks are in place before vLLM hears of it
        return int(ok.sum()) * sum(layer.page_bytes for layer in layers), ok

    # -------------------------------------------------------------- layout

    def _slices(self, gpu_spec: GPULoadStoreSpec, keys: Sequence[OffloadKey]) -> list[_GroupSlice]:
        """Split a transfer by KV group as vLLM's CPU worker does: group g's `group_sizes[g]` blocks
        fill ceil((skip + size) / blocks_per_chunk) chunks, skip = block_indices[g] % blocks_per_chunk."""
        bpc = self._blocks_per_chunk
        block_ids = torch.from_numpy(gpu_spec.block_ids.astype("int64"))
        slices, k, b = [], 0, 0
        for g, (size, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % bpc
            count = -(-(skip + size) // bpc)
            group_keys = list(keys[k : k + count])
            if len(group_keys) != count or any(get_offload_group_idx(x) != self._group_ids[g] for x in group_keys):
                raise ValueError(f"keys do not match group {self._group_ids[g]}'s {size} blocks")
            slices.append(_GroupSlice(g, group_keys, block_ids[b : b + size], skip))
            k, b = k + count, b + size
        if k != len(keys) or b != len(block_ids):
            raise ValueError(f"{len(keys)} keys and {len(block_ids)} blocks do not line up")
        return slices

    def _positions(self, s: _GroupSlice) -> tuple[torch.Tensor, torch.Tensor]:
        position = torch.arange(len(s.block_ids)) + s.skip
        return position // self._blocks_per_chunk, position % self._blocks_per_chunk

    def _layer_view(self, staging: torch.Tensor, layer: _Ref, chunks: int) -> torch.Tensor:
        span = staging[:, layer.offset : layer.offset + layer.page_bytes * self._blocks_per_chunk]
        return span.view(chunks, self._blocks_per_chunk, layer.page_bytes)

    def _gather(self, s: _GroupSlice) -> tuple[torch.Tensor, list[bool]]:
        """Copy one group's blocks into a staging tensor (pinned next to a GPU); which chunks are whole."""
        layers, chunk_bytes = self._groups[s.group]
        pinned = any(t.is_cuda for t in self._tensors)
        staging = torch.empty((len(s.keys), chunk_bytes), dtype=torch.int8, pin_memory=pinned)
        chunk_of, sub_of = self._positions(s)
        for layer in layers:
            source = self._tensors[layer.tensor_idx]
            pages = source[s.block_ids.to(source.device), : layer.page_bytes]
            self._layer_view(staging, layer, len(s.keys))[chunk_of, sub_of] = pages.to("cpu")
        # A chunk only partly covered (a skipped first block, a null block) would store unwritten bytes.
        counts = torch.bincount(chunk_of, minlength=len(s.keys))
        return staging, [int(c) == self._blocks_per_chunk for c in counts]


# ------------------------------------------------------------------------------------ connector


def forward_engine_config(vllm_config: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Put what vLLM 0.33 does not hand an OffloadingSpec into its extra config: the prefix hash
    scheme, model revision, weight quantization and RoPE settings vLLM really runs with (IdentityError
    when the config says otherwise),
    the spec to load, and failed loads reported as invalid blocks."""
    extra.setdefault("spec_name", "KvtierOffloadingSpec")
    extra.setdefault("spec_module_path", __name__)
    model = getattr(vllm_config, "model_config", None)
    facts = {
        "prefix_caching_hash_algo": str(vllm_config.cache_config.prefix_caching_hash_algo),
        "model_revision": str(getattr(model, "revision", None) or ""),
        "quantization": str(getattr(model, "quantization", None) or ""),
        "rope": _rope_of(model),
    }
    for name, value in facts.items():
        given = _option(extra, name, None)
        if given is not None and str(given) != value:
            raise IdentityError(f"kv_connector_extra_config has {name}={given!r} but vLLM runs with {value!r}")
        extra[name] = value
    extra["fold_load_errors"] = True
    return extra


def _rope_of(model: Any) -> str:
    """The RoPE settings vLLM runs the model with (its HF text config, --hf-overrides applied), as
    canonical JSON; "" when there are none to see."""
    config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    rope = {
        name: value
        for name in ("rope_parameters", "rope_scaling", "rope_theta")
        if (value := getattr(config, name, None)) is not None
    }
    return json.dumps(rope, sort_keys=True, separators=(",", ":"), default=str) if rope else ""


def _connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    class KvtierOffloadingConnector(OffloadingConnector):
        """vLLM's OffloadingConnector on kvtier's spec: failed loads become invalid blocks (recomputed
        with kv_load_failure_policy "recompute") instead of tripping vLLM 0.33's success assert."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            forward_engine_config(vllm_config, vllm_config.kv_transfer_config.kv_connector_extra_config)
            super().__init__(vllm_config, role, kv_cache_config)

        def get_block_ids_with_load_errors(self) -> set[int]:
            worker = self.connector_worker.worker if self.connector_worker is not None else None
            if isinstance(worker, KvtierOffloadingWorker):
                return worker.get_block_ids_with_load_errors()
            return set()

    KvtierOffloadingConnector.__module__ = __name__
    KvtierOffloadingConnector.__qualname__ = "KvtierOffloadingConnector"
    return KvtierOffloadingConnector


def __getattr__(name: str) -> Any:
    # vLLM's KVConnectorFactory does getattr(module, kv_connector): build the class only then.
    if name == "KvtierOffloadingConnector":
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
