"""SGLang 0.5.x HiCache storage backend on kvtier (docs/integrations.md, "SGLang").

SGLang loads it with its `dynamic` storage backend:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtier", "module_path": "kvtier.client.integrations.sglang",
        "class_name": "HiCacheKvtier", "interface_v1": 1, "master": "10.0.0.1:50051"}'

Its `StorageBackendFactory` calls `HiCacheKvtier(storage_config, kwargs)`, then
`register_mem_pool_host(pool)`. Only the host pool knows the page size, KV dtype and layout, so
the identity (the kvtier namespace of this rank's pages) and the client are made at registration;
before it every call answers "nothing".

Pages and objects. SGLang names a page by its SHA-256 chain hash (hex). With `interface_v1`
SGLang calls the zero-copy `batch_get_v1`/`batch_set_v1` with host pool indices; the pool says
where a page's bytes lie (`get_page_buffer_meta`: an address and size per contiguous piece, K and
V for MHA pools in page_first, page_first_direct and page_head layouts, one piece for MLA
page_first). A page of at most MAX_ZERO_COPY_PIECES pieces is stored as one kvtier object per
piece, `<hash>.<i>`, written from and read into the pool's own memory (memoryviews of its
tensors, bounds-checked; no copy in Python). A layer_first pool splits each page per layer
(2 x layers pieces for MHA): such a page is packed into one object `<hash>.page`, with one gather
copy on set and one scatter copy on get (`bytes_copied` in the stats), rather than making the
master track one object per layer. Without `interface_v1`, SGLang's generic path hands flat page
tensors to `get`/`set`/`batch_get`/`batch_set`: one object `<hash>.flat` per page.

Contracts:
- Never raises into SGLang once attached: a kvtier failure is logged, counted (`Guard`) and
  answered as absent / not loaded / not stored, which shrinks the usable prefix.
- Sets are idempotent: a page already stored is a success without rewriting it (kvtier puts).
- `batch_exists` is one kvtier call (`Client.longest_prefix`), whatever the number of pages; with
  the `prefetch` setting (default on) it also starts moving the found pages kvtier holds only on SSD
  into DRAM, so the `batch_get_v1` of SGLang's prefetch that follows is a DRAM hit.
- The off switch (`enabled: false`, KVTIER_DISABLE=1): nothing is ever found, every get fails,
  and sets report success without storing, so SGLang recomputes and neither retries its backups
  nor logs a failure per page. No kvtier process needs to be reachable.
- Configuration that cannot give correct keys (no model name, an fp8 cache whose variant is
  unknown, a pool whose pages cannot be addressed with interface_v1) fails the attach with the
  fix in the message, as `IdentityError`/`ValueError`: a wrong identity would serve wrong bytes.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.client import KvtierError, Status
from kvtier.client.integrations.common import Guard, KvtierSettings
from kvtier.client.integrations.identity import Identity, IdentityError

if TYPE_CHECKING:  # only HiCacheStorage is needed at import: older 0.5.x releases lack the v2 types
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransfer,
        PoolTransferResult,
    )

logger = logging.getLogger(__name__)

# Pages of at most this many contiguous pieces are one object per piece, zero-copy; pages split
# further (layer_first: per layer) are packed into one object with one copy.
MAX_ZERO_COPY_PIECES = 4
# The extra-config keys this adapter reads besides KvtierSettings' (each also with `kvtier_`).
MODEL_KEY, REVISION_KEY, KV_DTYPE_KEY = "model", "revision", "kv_dtype"
# Storage dtypes that do not say what they hold (fp8 e4m3 and e5m2 are both stored as uint8).
_OPAQUE_DTYPES = ("uint8", "int8")
_OK = 0


@dataclass(frozen=True, slots=True)
class PageMap:
    """How one host page lies in the pool: its contiguous pieces, and whether they are packed."""

    sizes: tuple[int, ...]  # bytes of each piece, in get_page_buffer_meta order

    @property
    def pieces(self) -> int:
        return len(self.sizes)

    @property
    def packed(self) -> bool:
        return self.pieces > MAX_ZERO_COPY_PIECES

    @property
    def objects(self) -> int:
        """kvtier objects per page."""
        return 1 if self.packed else self.pieces

    @property
    def page_bytes(self) -> int:
        return sum(self.sizes)

    def object_keys(self, keys: Sequence[str]) -> list[str]:
        if self.packed:
            return [f"{key}.page" for key in keys]
        return [f"{key}.{i}" for key in keys for i in range(self.pieces)]

    def signature(self) -> str:
        """The object format, for the identity: another split or size is another namespace."""
        sizes = "+".join(str(s) for s in self.sizes)
        return f"{'packed' if self.packed else 'pieces'}:{sizes}"


class HostMemory:
    """Writable byte views of a host pool's tensors, addressed by the pool's own pointers.

    `get_page_buffer_meta` answers raw addresses (what SGLang's RDMA backends register); here an
    address becomes a slice of a memoryview of the tensor that holds it, checked against that
    tensor's bounds, so a wrong address is an error, never a write outside the pool.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        regions: dict[int, memoryview] = {}
        for tensor in tensors:
            if tensor.numel() == 0:
                continue
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"host pool buffer is not contiguous CPU memory: {tensor.device} {tensor.shape}")
            view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
            start = tensor.data_ptr()
            if len(view) > len(regions.get(start, b"")):
                regions[start] = view
        self._starts = sorted(regions)
        self._views = [regions[s] for s in self._starts]

    def view(self, address: int, size: int) -> memoryview:
        i = bisect.bisect_right(self._starts, address) - 1
        while i >= 0:  # views of one tensor may overlap (k_buffer inside kv_buffer): find one holding it all
            start, view = self._starts[i], self._views[i]
            if address + size <= start + len(view):
                return view[address - start : address - start + size]
            i -= 1
        raise ValueError(f"address {address:#x}+{size} is outside the registered host pool")


def pool_tensors(pool: Any) -> list[torch.Tensor]:
    """Every tensor a host pool keeps its pages in (MHA: kv_buffer; MLA kv-split: k/v/index buffers)."""
    found: list[torch.Tensor] = []

    def add(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            for sub in item:
                add(sub)

    add(getattr(pool, "kv_buffer", None))
    hybrid = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(hybrid):
        try:
            add(hybrid())
        except Exception:  # not every pool class implements it for every layout
            pass
    for name in ("k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        try:
            add(getattr(pool, name, None))
        except Exception:  # properties of pools without that buffer
            pass
    return found


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor (a copy only when it is not contiguous)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def normalize_dtype(dtype: Any) -> str:
    """`torch.bfloat16` -> "bfloat16"; "fp8_e4m3" stays as it is."""
    return str(dtype).removeprefix("torch.")


def _pick(config: dict, name: str, default: Any = None) -> Any:
    return config.get(f"kvtier_{name}", config.get(name, default))


def _canonical(value: Any) -> Any:
    """A JSON text in one spelling (sorted keys, no spaces), so equal overrides written apart give one
    identity; anything else as it is."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return value
    return value


def _engine_model_setting(name: str) -> Any:
    """A model setting SGLang published for this process (`--kv-cache-dtype`, `--revision`), or None
    when there is none (a test, or an SGLang without the runtime context)."""
    try:
        from sglang.srt.runtime_context import get_model

        return getattr(get_model(), name, None)
    except Exception:
        return None


def page_map_of(pool: Any) -> PageMap:
    """The piece sizes of one page of `pool`, from the pool itself; ValueError when it has none."""
    try:
        _, sizes = pool.get_page_buffer_meta(torch.zeros(pool.page_size, dtype=torch.int64))
    except Exception as exc:
        raise ValueError(
            f"kvtier: SGLang's {type(pool).__name__} with layout {getattr(pool, 'layout', '?')!r} does not "
            f"say where a page lies ({exc}); use --hicache-mem-layout page_first, or interface_v1: 0"
        ) from exc
    if not sizes:
        raise ValueError(f"kvtier: SGLang's {type(pool).__name__} has no page bytes (a logical-only pool)")
    return PageMap(tuple(int(s) for s in sizes))


def sglang_identity(storage_config: HiCacheStorageConfig, pool: Any, extra: dict, page_map: PageMap | None) -> Identity:
    """The identity of this rank's pages, from SGLang's storage config, its host pool and the extra config.

    - model: `storage_config.model_name` (SGLang's served model name, tagged with the pool's page
      format when it has one), else `model` in the extra config; revision: `revision`, else
      SGLang's `--revision`.
    - kv_dtype: `kv_dtype` in the extra config, else the pool's dtype; a pool storing uint8 (fp8
      KV caches are stored so, e4m3 and e5m2 alike) takes SGLang's `--kv-cache-dtype`, and is
      refused when that is unknown or "auto".
    - layout and tokens per block: the pool's (`--hicache-mem-layout`, `--page-size`).
    - TP/PP size and rank from the storage config. MLA (SGLang's `is_mla_model`: the latent KV
      is the same on every TP rank, whatever the TP size) is rank-less and TP-size-less.
    - hash: SGLang's page hashes are SHA-256 chains from the sequence start (seeded per request
      by its cache salt, inside the chain): "sha256-chain", no process seed.
    - extra: the pool's layer range (a PP split), the object format (`PageMap.signature` and the
      flat page size), and the attention-CP shard when there is one.
    """
    model = storage_config.model_name or _pick(extra, MODEL_KEY, "")
    kv_dtype = _pick(extra, KV_DTYPE_KEY) or normalize_dtype(pool.dtype)
    if kv_dtype in _OPAQUE_DTYPES:
        engine_dtype = _engine_model_setting("kv_cache_dtype")
        if not engine_dtype or engine_dtype == "auto":
            raise IdentityError(
                f"the host pool stores KV as {kv_dtype} (an fp8 or other packed cache) and which one is unknown: "
                f'set "kv_dtype" in --hicache-storage-backend-extra-config to the --kv-cache-dtype '
                f'(e.g. "fp8_e4m3"); e4m3 and e5m2 bytes must never be read as each other'
            )
        kv_dtype = str(engine_dtype)
    revision = _pick(extra, REVISION_KEY) or _engine_model_setting("revision") or ""
    rankless = bool(storage_config.is_mla_model)
    flat = pool.get_dummy_flat_data_page()
    parts = [
        f"layers={getattr(pool, 'start_layer', 0)}-{getattr(pool, 'end_layer', 0)}",
        f"v1={page_map.signature() if page_map else 'none'}",
        f"flat={flat.numel() * flat.element_size()}",
    ]
    # The served model name is an alias the operator picks (two checkpoints may share it): the
    # weights' path and quantization, where SGLang publishes them, tell such deployments apart; and
    # overrides of the model's config (--json-model-override-args: rope scaling or theta change every
    # cached key's rotation) make other KV from the same weights.
    for name, key in (("model_path", "path"), ("quantization", "quant"), ("json_model_override_args", "overrides")):
        if (value := _canonical(_engine_model_setting(name))) and value != "{}":
            parts.append(f"{key}={value}")
    cp_size = getattr(storage_config, "attn_cp_size", 1)
    if cp_size > 1:
        parts.append(f"cp={storage_config.attn_cp_rank}/{cp_size}")
    return Identity(
        engine="sglang",
        model=str(model),
        kv_dtype=str(kv_dtype),
        layout=str(pool.layout),
        tokens_per_block=int(pool.page_size),
        hash_scheme="sha256-chain",
        revision=str(revision),
        tp_size=1 if rankless else storage_config.tp_size,
        tp_rank=0 if rankless else storage_config.tp_rank,
        pp_size=storage_config.pp_size,
        pp_rank=storage_config.pp_rank,
        rankless=rankless,
        extra=";".join(parts),
    ).validate()


@dataclass(slots=True)
class _Metrics:
    """What SGLang's storage metrics want (pages per batch, GB/s), when it asks for them."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


_metrics_class: Any = None


def _storage_metrics() -> Any:
    """An SGLang `StorageMetrics` (its collector asserts the type); a look-alike where SGLang's
    metrics module cannot be imported (it imports the model executor), which only tests see."""
    global _metrics_class
    if _metrics_class is None:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics

            _metrics_class = StorageMetrics
        except Exception:
            _metrics_class = type("StorageMetrics", (), {})
    metrics = _metrics_class()
    for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
        if not hasattr(metrics, name):
            setattr(metrics, name, [])
    return metrics


class HiCacheKvtier(HiCacheStorage):
    """SGLang's L3 HiCache storage in a kvtier cluster; see the module docstring for the contracts."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.settings = KvtierSettings.from_config(self.extra)
        self.interface_v1 = bool(self.extra.get("interface_v1", 0))
        self.guard = Guard("sglang")
        self.identity: Identity | None = None
        self.namespace = ""
        self.page_map: PageMap | None = None
        self.client: Any = None
        # Store nothing on purpose (the off switch, or a pool whose bytes this adapter cannot serve):
        # sets then succeed without storing, so SGLang neither retries nor logs every backup.
        self.store_nothing = not self.settings.enabled
        self._memory: HostMemory | None = None
        self._registered_quota = False
        self._rank = storage_config.pp_rank * storage_config.tp_size + storage_config.tp_rank
        self._metrics = _Metrics()
        self._metrics_lock = threading.Lock()
        self._page_bytes = 0
        if getattr(storage_config, "should_split_heads", False):
            logger.warning(
                "kvtier stores whole-rank pages: tp_lcm_size head splitting is not used, so pages are shared "
                "only with deployments of the same TP size tp_size=%d",
                storage_config.tp_size,
            )
        if not self.settings.enabled:
            logger.info("kvtier is off for SGLang (enabled=false or KVTIER_DISABLE): every page is recomputed")

    # ------------------------------------------------------------------ attach

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Make the identity and the client for this host pool. Raises (failing the attach) only for
        configuration that would give wrong keys; kvtier being unreachable is not an error here."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store_nothing:
            return
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            logger.warning(
                "kvtier: SGLang's %s holds no KV bytes (a hybrid logical anchor; its pools need HiCache's v2 "
                "interface, which this adapter does not serve): nothing is stored, every page is recomputed",
                type(mem_pool_host).__name__,
            )
            self.store_nothing = True
            return
        page_map: PageMap | None = None
        try:
            page_map = page_map_of(mem_pool_host)
            self._memory = HostMemory(pool_tensors(mem_pool_host))
        except ValueError:
            if self.interface_v1:
                raise
            logger.info("kvtier: %s has no zero-copy page map; the generic path is used", type(mem_pool_host).__name__)
        self.page_map = page_map
        flat = mem_pool_host.get_dummy_flat_data_page()
        self._page_bytes = page_map.page_bytes if page_map else flat.numel() * flat.element_size()
        self.identity = sglang_identity(self.storage_config, mem_pool_host, self.extra, page_map)
        self.namespace = self.identity.namespace(self.settings.namespace_prefix)
        self.client = self.settings.client(self.namespace, rank=self._rank)
        self._register_quota()
        logger.info(
            "kvtier attached namespace=%s master=%s interface_v1=%s objects_per_page=%s packed=%s",
            self.namespace,
            self.settings.master,
            self.interface_v1,
            page_map.objects if page_map else 1,
            page_map.packed if page_map else False,
        )

    def _register_quota(self) -> None:
        """Register the deployment's budget (idempotent; every rank does, so none puts unregistered)."""
        if self._registered_quota or not (self.settings.instance and self.settings.budget_bytes):
            return
        cfg = self.storage_config

        def register() -> int:
            try:
                return self.client.register_instance(cfg.tp_size, cfg.pp_size, self.settings.budget_bytes)
            except KvtierError as exc:
                if exc.status != Status.INVALID_ARGUMENT:
                    raise  # the master is unreachable: tried again at the next set
                logger.error("kvtier refused the quota of instance=%s, none applies: %s", self.settings.instance, exc)
                return 0

        quota = self.guard.call("register_instance", register, None)
        if quota is not None:
            self._registered_quota = True
            logger.info("kvtier quota instance=%s rank=%d quota_bytes=%d", self.settings.instance, self._rank, quota)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ presence

    def _live(self) -> bool:
        return self.client is not None

    def _keys_for_exists(self, keys: Sequence[str]) -> tuple[list[str], int]:
        if self.interface_v1 and self.page_map is not None:
            return self.page_map.object_keys(keys), self.page_map.objects
        return [f"{k}.flat" for k in keys], 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored (every object of each), in one kvtier call; 0 on failure."""
        if not keys or not self._live():
            return 0
        object_keys, per_page = self._keys_for_exists(keys)
        # SGLang's prefetch thread asks this before it loads the pages: kvtier starts moving pages
        # found only on SSD into DRAM meanwhile (settings.prefetch), so the load is a DRAM hit.
        prefetch = self.settings.prefetch
        found = (
            self.guard.call("batch_exists", lambda: self.client.longest_prefix(object_keys, prefetch=prefetch), 0)
            // per_page
        )
        self.guard.count("pages_queried", len(keys))
        self.guard.count("pages_found", found)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ zero-copy pages (interface_v1)

    def _page_views(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page, views of its pieces in the host pool (raises on any inconsistency)."""
        assert self.page_map is not None and self._memory is not None
        page_size = self.mem_pool_host.page_size
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(f"{len(host_indices)} host indices for {len(keys)} pages of {page_size} tokens")
        addresses, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        m = self.page_map.pieces
        if len(addresses) != len(keys) * m or any(
            int(sizes[j]) != self.page_map.sizes[j % m] for j in range(len(sizes))
        ):
            raise ValueError(f"host pool pages changed shape: {len(addresses)} pieces for {len(keys)} pages")
        return [
            [self._memory.view(addresses[p * m + j], int(sizes[p * m + j])) for j in range(m)] for p in range(len(keys))
        ]

    def _usable_v1(self, what: str) -> bool:
        if self.page_map is None or self._memory is None:
            self.guard.count("unsupported_calls")
            logger.debug("kvtier %s: the host pool has no zero-copy page map", what)
            return False
        return True

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store pages from the host pool; one bool per page (True also for pages already stored)."""
        if not keys:
            return []
        if self.store_nothing:
            self.guard.count("pages_dropped", len(keys))
            return [True] * len(keys)
        if not self._live() or not self._usable_v1("batch_set_v1"):
            return [False] * len(keys)
        self._register_quota()
        return self._timed("backup", len(keys), lambda: self._set_pages(keys, host_indices))

    def _set_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        page_map = self.page_map
        assert page_map is not None

        def run() -> list[bool]:
            pages = self._page_views(keys, host_indices)
            values: list[Any]
            if page_map.packed:
                staging = memoryview(torch.empty(len(keys) * page_map.page_bytes, dtype=torch.uint8).numpy())
                values = []
                for p, pieces in enumerate(pages):
                    offset = p * page_map.page_bytes
                    values.append(staging[offset : offset + page_map.page_bytes])
                    for piece in pieces:
                        staging[offset : offset + len(piece)] = piece
                        offset += len(piece)
                self.guard.count("bytes_copied", len(staging))
            else:
                values = [piece for pieces in pages for piece in pieces]
            statuses = self.client.batch_put(page_map.object_keys(keys), values, replicas=self.settings.replicas)
            return self._per_page([s == _OK for s in statuses], page_map.objects)

        done = self.guard.call("batch_set_v1", run, [False] * len(keys))
        self._count_pages("stored", done)
        return done

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load pages into the host pool; one bool per page (False: not loaded, SGLang recomputes it)."""
        if not keys:
            return []
        if not self._live() or not self._usable_v1("batch_get_v1"):
            return [False] * len(keys)
        return self._timed("prefetch", len(keys), lambda: self._get_pages(keys, host_indices))

    def _get_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        page_map = self.page_map
        assert page_map is not None

        def run() -> list[bool]:
            pages = self._page_views(keys, host_indices)
            if page_map.packed:
                staging = memoryview(torch.empty(len(keys) * page_map.page_bytes, dtype=torch.uint8).numpy())
                targets = [staging[p * page_map.page_bytes : (p + 1) * page_map.page_bytes] for p in range(len(keys))]
            else:
                targets = [piece for pieces in pages for piece in pieces]
            results = self.client.batch_get_into(page_map.object_keys(keys), targets)
            loaded = self._per_page([r == len(t) for r, t in zip(results, targets, strict=True)], page_map.objects)
            if page_map.packed:
                for p, ok in enumerate(loaded):
                    if ok:
                        offset = p * page_map.page_bytes
                        for piece in pages[p]:
                            piece[:] = staging[offset : offset + len(piece)]
                            offset += len(piece)
                        self.guard.count("bytes_copied", page_map.page_bytes)
            return loaded

        done = self.guard.call("batch_get_v1", run, [False] * len(keys))
        self._count_pages("loaded", done)
        return done

    # ------------------------------------------------------------------ generic path (flat page tensors)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Flat pages into `target_locations` (SGLang passes `get_dummy_flat_data_page()` tensors):
        the filled tensor per hit, None per miss."""
        if not keys:
            return []
        if not self._live():
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)

        def run() -> list[Any]:
            object_keys = [f"{k}.flat" for k in keys]
            if any(t is None for t in targets):  # no destination given: return new tensors
                values = self.client.batch_get(object_keys)
                return [torch.frombuffer(bytearray(v), dtype=torch.uint8) if v is not None else None for v in values]
            views = [tensor_bytes(t) if t.is_contiguous() else None for t in targets]
            if any(v is None for v in views):
                raise ValueError("flat page targets must be contiguous")
            results = self.client.batch_get_into(object_keys, views)
            return [t if r == len(v) else None for t, v, r in zip(targets, views, results, strict=True)]

        values = self.guard.call("batch_get", run, [None] * len(keys))
        self._count_pages("loaded", [v is not None for v in values])
        return values

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat pages (`get_data_page()` tensors); True when every one is stored (or already was)."""
        if not keys:
            return True
        if self.store_nothing:
            self.guard.count("pages_dropped", len(keys))
            return True
        if not self._live() or values is None or len(values) != len(keys) or any(v is None for v in values):
            return False
        self._register_quota()

        def run() -> list[bool]:
            views = [tensor_bytes(v) for v in values]
            statuses = self.client.batch_put([f"{k}.flat" for k in keys], views, replicas=self.settings.replicas)
            return [s == _OK for s in statuses]

        done = self.guard.call("batch_set", run, [False] * len(keys))
        self._count_pages("stored", done)
        return all(done)

    # ------------------------------------------------------------------ hybrid pools (HiCache v2): not served

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Hybrid models (Mamba, SWA, DSA sidecar pools) need their pools' pages too, which this adapter
        does not store: no prefix is usable, SGLang recomputes. Plain KV goes through `batch_exists`."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        if pool_transfers:
            self.guard.count("unsupported_calls")
            return PoolTransferResult.empty()
        found = self.batch_exists(keys, extra_info)
        return PoolTransferResult(found, {}, list(range(1, found + 1)))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        self.guard.count("unsupported_calls")
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        self.guard.count("unsupported_calls")
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    # ------------------------------------------------------------------ maintenance and stats

    def clear(self) -> bool:
        """Remove every page of this identity (this rank's namespace); False on failure."""
        if not self._live():
            return self.store_nothing
        removed = self.guard.call("clear", lambda: self.client.remove_prefix(""), None)
        if removed is None:
            return False
        logger.info("kvtier cleared namespace=%s objects=%d", self.namespace, removed)
        return True

    def stats(self) -> dict[str, Any]:
        """Counters: pages queried/found/loaded/stored and their failures, errors (Guard), bytes copied,
        and the kvtier client's own counters as `client_*`."""
        out: dict[str, Any] = dict(self.guard.stats())
        if self.client is not None:
            out.update({f"client_{k}": v for k, v in self.client.stats().items()})
        out["namespace"] = self.namespace
        out["enabled"] = self.settings.enabled
        return out

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` (pages per batch and GB/s since the last call), with this
        adapter's counters (`stats()`) as its `kvtier` attribute."""
        metrics = _storage_metrics()
        with self._metrics_lock:
            taken, self._metrics = self._metrics, _Metrics()
        metrics.prefetch_pgs.extend(taken.prefetch_pgs)
        metrics.backup_pgs.extend(taken.backup_pgs)
        metrics.prefetch_bandwidth.extend(taken.prefetch_bandwidth)
        metrics.backup_bandwidth.extend(taken.backup_bandwidth)
        metrics.kvtier = self.stats()
        return metrics

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _per_page(ok: list[bool], per_page: int) -> list[bool]:
        return [all(ok[p : p + per_page]) for p in range(0, len(ok), per_page)]

    def _count_pages(self, what: str, done: list[bool]) -> None:
        hits = sum(done)
        self.guard.count(f"pages_{what}", hits)
        if hits < len(done):
            self.guard.count(f"pages_not_{what}", len(done) - hits)

    def _timed(self, kind: str, pages: int, fn: Callable[[], list[bool]]) -> list[bool]:
        if not getattr(self.storage_config, "enable_storage_metrics", False):
            return fn()
        started = time.perf_counter()
        done = fn()
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._metrics_lock:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(sum(done) * self._page_bytes / seconds / (1 << 30))
        return done
