"""kvtier as an LMCache 0.5.x remote storage backend (docs/integrations.md, "LMCache (remote connector)").

LMCache loads it through its remote storage plugin framework: `remote_storage_plugins: [kvtier]`
and, in `extra_config`, `remote_storage_plugin.kvtier.module_path: kvtier.client.integrations.lmcache`
and `remote_storage_plugin.kvtier.class_name: KvtierConnectorAdapter`. The adapter answers LMCache's
`plugin://kvtier[.<instance>]` URLs (and owns the `kvtier://host:port[/namespace_prefix]` scheme);
pointing `class_name` at `KvtierConnector` itself works too (LMCache's DynamicConnectorAdapter).

Each connector lives in one namespace, the identity of its blocks
(`kvtier.client.integrations.identity`), built from LMCache's own metadata and config: model,
world size and worker id (TP rank; MLA is rank-less), KV dtype, chunk size, the memory layout and
shapes of a chunk, and the hash LMCache really computes chunk hashes with. A chunk's kvtier key is
its chunk hash in hex (plus LMCache's request tags), since every other field of LMCache's
`CacheEngineKey` is already the namespace. Keys that do not belong to this identity (LMCache's health
check probes with a "test" model key) are kept apart under `foreign/<LMCache key>` and overwritten
on put, not content-addressed.

Contracts towards LMCache:
- Nothing raises into LMCache once the connector is built: kvtier failures are misses (None),
  False, a prefix of 0, or a put not stored, logged and counted through `common.Guard`.
- Blocking kvtier calls run on two bounded thread pools (lookups apart from bulk I/O, so prefix
  lookups never queue behind puts); LMCache's event loop only awaits them.
- Zero-copy: gets allocate LMCache memory objects and `batch_get_into` their byte views; puts send
  the objects' byte views. A memory object stays referenced until the thread using it is done, even
  when LMCache cancels the awaiting coroutine (timeouts): a buffer is never freed under a transfer.
- Chunks of this engine's layout are stored raw; other objects, with LMCache's `save_chunk_meta`
  (its default), as a verified `lmcache_meta.ChunkMeta` header and their bytes under the same key
  (sized never to look like a chunk), and without it they are refused: nothing is stored that a
  get could not read back as it was put, so `contains` never promises a miss.
- Construction refuses (`LMCacheIdentityError`, which LMCache treats as irrecoverable: it logs the
  message and runs without this backend) what would give unshareable or unreadable blocks:
  unseeded hashes, layer-wise storage, the cachegen serde.
- The off switch (`enabled: false` / KVTIER_DISABLE=1) builds an inert connector: no cluster
  contacted, no identity checked, nothing stored, nothing found.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
    parse_remote_url,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvtier.client.integrations.common import Guard, KvtierSettings
from kvtier.client.integrations.identity import Identity, IdentityError
from kvtier.client.integrations.lmcache_meta import ChunkMeta, MetaError
from kvtier.proto.status import Status

T = TypeVar("T")

logger = logging.getLogger(__name__)

PLUGIN_TYPE = "kvtier"
SCHEME = "kvtier://"
FOREIGN_PREFIX = "foreign/"  # keys of another identity: never a hex chunk hash
PING_KEY = "ping"  # looked up (never stored) by ping()
PING_FAILED = -2  # LMCache's PING_GENERIC_ERROR_CODE
DEFAULT_THREADS = 4
LOOKUP_THREADS = 2
# Hashes whose chain LMCache/vLLM seed from PYTHONHASHSEED, else per process at random.
_SEED_REQUIRED = frozenset(("builtin", "xxhash", "xxhash_cbor"))
_MISS = int(Status.UNAVAILABLE)
_TOO_SMALL = int(Status.BUFFER_TOO_SMALL)


class LMCacheIdentityError(IdentityError, IrrecoverableException):
    """The connector refuses this deployment (the message says how to fix it). LMCache treats it as
    irrecoverable: the remote backend is not created and the engine runs on its other tiers."""


# ---------------------------------------------------------------------------- settings and identity


def plugin_options(extra_config: dict | None, plugin_name: str | None) -> dict[str, Any]:
    """kvtier settings from LMCache's `extra_config`, as `KvtierSettings.from_config` reads them.

    Global `kvtier_<name>` keys, overridden by the plugin's own `remote_storage_plugin.<plugin>.<name>`
    (or `.kvtier_<name>`). Bare names are not taken from `extra_config`: LMCache and other plugins
    use it too, and `timeout` or `enabled` there are not ours.
    """
    extra = dict(extra_config or {})
    options = {k: v for k, v in extra.items() if k.startswith("kvtier_")}
    if plugin_name:
        prefix = f"remote_storage_plugin.{plugin_name}."
        for key, value in extra.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                if name not in ("module_path", "class_name"):
                    options[name if name.startswith("kvtier_") else f"kvtier_{name}"] = value
    return options


def _plugin_name_for(config: Any) -> str | None:
    """The plugin whose module_path is this module (when LMCache did not say which one built us).

    Raises LMCacheIdentityError when several are: which one's settings to use cannot be known
    (LMCache's DynamicConnectorAdapter passes no plugin name), and guessing would talk to the
    wrong cluster silently."""
    extra = getattr(config, "extra_config", None) or {}
    names = [
        name
        for name in getattr(config, "remote_storage_plugins", None) or []
        if extra.get(f"remote_storage_plugin.{name}.module_path") == __name__
    ]
    if len(names) > 1:
        raise LMCacheIdentityError(
            f"remote_storage_plugins {names} all load kvtier, and LMCache did not say which one this "
            "connector is: use class_name: KvtierConnectorAdapter, which is told its plugin's name."
        )
    return names[0] if names else None


def _vllm_hash_available(name: str) -> bool:
    """Whether LMCache's TokenDatabase gets `name` from vLLM (else it falls back to builtin `hash`).

    Mirrors `TokenDatabase._get_vllm_hash_func`: `get_hash_fn_by_name` from `vllm.utils.hashing`
    or `vllm.utils`, then the function by its own name from either module.
    """
    names = ["sha256_cbor", "sha256_cbor_64bit"] if name in ("sha256_cbor", "sha256_cbor_64bit") else [name]
    for module_path in ("vllm.utils.hashing", "vllm.utils"):
        try:
            module = importlib.import_module(module_path)
        except Exception:  # vLLM absent, or its hashing module's own imports missing (cbor2)
            continue
        getter = getattr(module, "get_hash_fn_by_name", None)
        for candidate in names:
            if getter is not None:
                try:
                    getter(candidate)
                    return True
                except (ValueError, AttributeError):
                    pass
            if callable(getattr(module, candidate, None)):
                return True
    return False


def effective_hash(algorithm: str | None) -> tuple[str, str]:
    """(scheme, seed) of the hash LMCache really computes chunk hashes with for `algorithm`
    (`pre_caching_hash_algorithm`), and what seeds it: PYTHONHASHSEED ("" when unset or "random")."""
    seed = os.environ.get("PYTHONHASHSEED", "")
    if seed == "random":
        seed = ""
    name = algorithm or "builtin"
    if name == "sha256_cbor_64bit":
        name = "sha256_cbor"
    if name == "builtin" or not _vllm_hash_available(name):
        return "builtin", seed
    if name in _SEED_REQUIRED:
        return name, seed
    return name, seed or "vllm-default"  # vLLM's fixed NONE_HASH seed: the same in every process


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _by_overwrite(keys: list[str], values: list[Any]) -> list[tuple[bool, list[tuple[str, Any]]]]:
    """The puts of one store call: content-addressed keys (never overwritten) apart from foreign ones
    (overwritten, `FOREIGN_PREFIX`); each part only when it has keys."""
    parts: dict[bool, list[tuple[str, Any]]] = {False: [], True: []}
    for key, value in zip(keys, values, strict=True):
        parts[key.startswith(FOREIGN_PREFIX)].append((key, value))
    return [(overwrite, part) for overwrite, part in parts.items() if part]


def key_world_size(config: Any, metadata: Any) -> int:
    """The world size LMCache writes into its keys: MLA with save_only_first_rank collapses it to 1."""
    if metadata.use_mla and config.get_extra_config_value("save_only_first_rank", metadata.use_mla):
        return 1
    return int(metadata.world_size)


def lmcache_identity(config: Any, metadata: Any, *, revision: str = "", variant: str = "") -> Identity:
    """The identity of a connector's chunks, from LMCache's engine config and metadata; validated.
    `variant`: what else the engine's KV depends on that LMCache does not say (the operator's
    `model_variant`: weight quantization, RoPE overrides), as text.

    Raises LMCacheIdentityError for an unseeded hash, layer-wise storage or the cachegen serde.
    """
    if config.use_layerwise:
        raise LMCacheIdentityError(
            "use_layerwise stores per-layer objects of another shape than a chunk; the kvtier connector "
            "serves whole chunks only. Turn use_layerwise off for the kvtier remote backend."
        )
    if (config.remote_serde or "naive") not in ("naive", "kivi"):
        raise LMCacheIdentityError(
            f"remote_serde {config.remote_serde!r} stores variable-size encodings the kvtier connector "
            "cannot read back into a chunk; use remote_serde: naive."
        )
    scheme, seed = effective_hash(config.pre_caching_hash_algorithm)
    if scheme in _SEED_REQUIRED and not seed:
        raise LMCacheIdentityError(
            f"LMCache hashes chunks with {scheme!r} here (pre_caching_hash_algorithm="
            f"{config.pre_caching_hash_algorithm!r}) and PYTHONHASHSEED is not set: every engine process "
            "would compute other chunk keys for the same prefix and share nothing. Set PYTHONHASHSEED to "
            "the same value on every instance (e.g. PYTHONHASHSEED=0), or use pre_caching_hash_algorithm: "
            "sha256_cbor with vLLM installed."
        )
    use_mla = bool(metadata.use_mla)
    fmt = "KV_MLA_FMT" if use_mla else "KV_2LTD"
    shapes = ";".join("x".join(str(d) for d in shape) for shape in metadata.get_shapes())
    world = key_world_size(config, metadata)
    identity = Identity(
        engine="lmcache",
        model=metadata.model_name,
        revision=revision,
        kv_dtype=",".join(dtype_name(d) for d in metadata.get_dtypes()),
        layout=f"{fmt}[{shapes}]",
        tokens_per_block=int(metadata.chunk_size),
        hash_scheme=scheme,
        hash_seed=seed,
        tp_size=world,
        tp_rank=0 if use_mla else int(metadata.worker_id),
        rankless=use_mla,
        extra=f"variant={variant}" if variant else "",
    )
    try:
        return identity.validate()
    except LMCacheIdentityError:
        raise
    except IdentityError as exc:
        raise LMCacheIdentityError(str(exc)) from exc


# ---------------------------------------------------------------------------- the connector


class KvtierConnector(RemoteConnector):
    """LMCache's RemoteConnector over a kvtier cluster (see the module docstring for the contracts).

    Built by `KvtierConnectorAdapter` or LMCache's DynamicConnectorAdapter. The engine config and
    metadata come from the connector's own context (its settings: `remote_storage_plugin.<plugin>.*`
    of that config), else from the local CPU backend (the DynamicConnectorAdapter passes no metadata;
    the scheduler role has no CPU backend: it only looks up).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any = None,
        metadata: Any = None,
        plugin_name: str | None = None,
        url: str = "",
    ) -> None:
        # The connector's own context first: two RemoteBackends of one engine (plugins `kvtier.a` and
        # `kvtier.b`) share a CPU backend whose config may not even name kvtier; reading the settings
        # from there sent every instance to the default master. The CPU backend's config and metadata
        # are only the fallback for adapters that pass none (LMCache's DynamicConnectorAdapter).
        config = config or getattr(local_cpu_backend, "config", None)
        metadata = metadata or getattr(local_cpu_backend, "metadata", None)
        if config is None or metadata is None:
            raise LMCacheIdentityError("the kvtier connector needs LMCache's engine config and metadata")
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name or _plugin_name_for(config) or PLUGIN_TYPE
        options = plugin_options(config.extra_config, self.plugin_name)
        if url.startswith(SCHEME):  # kvtier://host:port[/namespace_prefix]
            parsed = parse_remote_url(url)
            options["kvtier_master"] = f"{parsed.host}:{parsed.port}"
            if parsed.path.strip("/"):
                options["kvtier_namespace_prefix"] = parsed.path.strip("/")
        self.settings = KvtierSettings.from_config(options)
        self.guard = Guard("lmcache")
        self._model = metadata.model_name
        self._world = key_world_size(config, metadata)
        self._worker = int(metadata.worker_id)
        self._kv_dtype = metadata.kv_dtype
        self._dtype_str = TORCH_DTYPE_TO_STR_DTYPE.get(metadata.kv_dtype, dtype_name(metadata.kv_dtype))
        self._rankless = bool(metadata.use_mla)
        self.identity: Identity | None = None
        self.namespace = ""
        self._client: Any = None
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._lookups: concurrent.futures.ThreadPoolExecutor | None = None
        if not self.settings.enabled:
            logger.info("kvtier lmcache connector disabled (enabled=false or KVTIER_DISABLE): nothing stored or found")
            return
        self.identity = lmcache_identity(
            config,
            metadata,
            revision=str(options.get("kvtier_model_revision", "")),
            variant=str(options.get("kvtier_model_variant", "")),
        )
        self.namespace = self.identity.namespace(self.settings.namespace_prefix)
        self._client = self.settings.client(self.namespace, rank=self._worker)
        threads = max(1, int(options.get("kvtier_threads", DEFAULT_THREADS)))
        self._io = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvtier-lmcache-io")
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="kvtier-lmcache-lookup"
        )
        if self.settings.instance and self.settings.budget_bytes:
            self.guard.call(
                "register_instance",
                lambda: self._client.register_instance(
                    tp_size=self._world, pp_size=1, budget=self.settings.budget_bytes
                ),
                0,
            )
        logger.info(
            "kvtier lmcache connector ready master=%s namespace=%s plugin=%s",
            self.settings.master,
            self.namespace,
            self.plugin_name,
        )

    @property
    def enabled(self) -> bool:
        return self._client is not None

    # ------------------------------------------------------------ keys

    def _is_native(self, key: CacheEngineKey) -> bool:
        return (
            type(key) is CacheEngineKey
            and key.model_name == self._model
            and key.world_size == self._world
            and key.dtype == self._kv_dtype
            and (self._rankless or key.worker_id == self._worker)
        )

    def kv_key(self, key: CacheEngineKey) -> str:
        """kvtier's key for an LMCache key: the chunk hash in hex, then LMCache's tags (`@name%value`)."""
        if not self._is_native(key):
            return FOREIGN_PREFIX + key.to_string()
        if key.tags:
            return key.chunk_hash_hex + "@" + "@".join(f"{k}%{v}" for k, v in key.tags)
        return key.chunk_hash_hex

    def lmcache_key(self, kv_key: str) -> str:
        """The LMCache key string of a kvtier key of this namespace (inverse of `kv_key`)."""
        if kv_key.startswith(FOREIGN_PREFIX):
            return kv_key[len(FOREIGN_PREFIX) :]
        chunk, _, tags = kv_key.partition("@")
        worker = 0 if self._rankless else self._worker
        text = f"{self._model}@{self._world}@{worker}@{chunk}@{self._dtype_str}"
        return f"{text}@{tags}" if tags else text

    def chunk_shaped(self, obj: MemoryObj) -> bool:
        """Whether `obj` reads back from its bytes alone: this engine's chunk layout (format, dtypes,
        shapes), whole or with fewer tokens exactly as LMCache's `reshape_partial_chunk` rebuilds it."""
        try:
            meta = ChunkMeta.of(obj)
            size = len(obj.byte_array)
        except Exception:  # not a memory object we can describe: never chunk-shaped
            return False
        full = tuple(tuple(int(d) for d in shape) for shape in self.meta_shapes)
        if meta.fmt != self.meta_fmt or list(meta.dtypes) != list(self.meta_dtypes):
            return False
        if meta.shapes == full:
            return size == self.full_chunk_size_bytes
        if len(full) != 1 or len(meta.shapes) != 1 or len(full[0]) != 4 or len(meta.shapes[0]) != 4:
            return False
        shape, chunk = meta.shapes[0], full[0]
        tokens = shape[2]
        return (
            shape[:2] == chunk[:2]
            and shape[3:] == chunk[3:]
            and 0 < tokens < chunk[2]
            and size == tokens * self.single_token_size
        )

    # ------------------------------------------------------------ running blocking calls

    async def _run(
        self, pool: concurrent.futures.Executor, fn: Callable[[], T], on_abandon: Callable[[Any], None] | None = None
    ) -> T:
        """`fn()` on `pool`, awaited without blocking the loop. If the awaiting coroutine is cancelled,
        `on_abandon(result)` runs once `fn` is done (or was never started: result None)."""
        future = pool.submit(fn)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if on_abandon is not None:
                future.add_done_callback(lambda f: on_abandon(None if f.cancelled() or f.exception() else f.result()))
            raise

    # ------------------------------------------------------------ lookups

    def _prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        if not self.enabled or not keys:
            return 0
        kv_keys = [self.kv_key(k) for k in keys]
        # LMCache's contains comes before its retrieve: found chunks held only on SSD start moving
        # into DRAM now (settings.prefetch), so the retrieve is a DRAM hit.
        prefetch = self.settings.prefetch
        return self.guard.call("longest_prefix", lambda: self._client.longest_prefix(kv_keys, prefetch=prefetch), 0)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._prefix([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        if not self.enabled:
            return False
        return await self._run(self._lookups, lambda: self._prefix([key])) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys are present: one kvtier call."""
        return self._prefix(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading keys are present: one kvtier call (`Client.longest_prefix`). `pin` is not
        needed: a get that loses its object to eviction meanwhile is a miss, and LMCache recomputes."""
        if not self.enabled or not keys:
            return 0
        return await self._run(self._lookups, lambda: self._prefix(keys))

    def support_ping(self) -> bool:
        return self.enabled

    async def ping(self) -> int:
        """0 when the master answers a lookup, else LMCache's generic ping error (-2)."""
        if not self.enabled:
            return 0

        def probe() -> int:
            self._client.exists(PING_KEY)
            return 0

        return await self._run(self._lookups, lambda: self.guard.call("ping", probe, PING_FAILED))

    # ------------------------------------------------------------ gets

    def _release(self, objs: Sequence[MemoryObj | None] | None) -> None:
        for obj in objs or ():
            if obj is not None:
                obj.ref_count_down()

    def _fetch(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Allocate chunks from LMCache's CPU backend and read into them (in a pool thread).

        Allocation never waits for memory (busy_loop=False): when the backend is full, the chunks
        from there on are misses. A whole number of tokens (at most a chunk) is a chunk; any other
        size is an object stored with its metadata (`_with_meta`), read in place when it fits a
        chunk's buffer, else fetched whole: one more kvtier call, for those only. Bytes that are
        neither are misses."""
        objs: list[MemoryObj] = []
        for _ in keys:
            obj = self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                break
            objs.append(obj)
        if not objs:
            return [None] * len(keys)
        kv_keys = [self.kv_key(k) for k in keys[: len(objs)]]
        sizes = self.guard.call(
            "batch_get_into",
            lambda: self._client.batch_get_into(kv_keys, [memoryview(obj.byte_array) for obj in objs]),
            [_MISS] * len(objs),
        )
        out: list[MemoryObj | None] = []
        larger: list[int] = []
        for i, (obj, size) in enumerate(zip(objs, sizes, strict=True)):
            if size > 0 and size % self.single_token_size == 0:
                out.append(self._as_chunk(obj, size))
                continue
            out.append(self._with_meta(memoryview(obj.byte_array).cast("B")[:size]) if size > 0 else None)
            obj.ref_count_down()
            if size == _TOO_SMALL:
                larger.append(i)
        if larger:  # more than a chunk: only an object stored with its metadata can be that
            values = self.guard.call(
                "batch_get", lambda: self._client.batch_get([kv_keys[i] for i in larger]), [None] * len(larger)
            )
            for i, value in zip(larger, values, strict=True):
                out[i] = None if value is None else self._with_meta(memoryview(value))
        hits = sum(o is not None for o in out)
        self.guard.count("hits", hits)
        self.guard.count("misses", len(keys) - hits)
        return out + [None] * (len(keys) - len(out))

    def _allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> MemoryObj | None:
        obj = self.guard.call(
            "allocate", lambda: self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False), None
        )
        if obj is None:
            self.guard.count("allocation_failures")
        return obj

    def _as_chunk(self, obj: MemoryObj, size: int) -> MemoryObj | None:
        """`obj` holding `size` bytes of a chunk (whole or partial), or None (released) if it is not one."""
        try:
            return self.reshape_partial_chunk(obj, size)
        except ValueError as exc:
            self.guard.count("bad_sizes")
            logger.warning("kvtier lmcache object of %d bytes is not a chunk here, treated as a miss: %s", size, exc)
            obj.ref_count_down()
            return None

    def _with_meta(self, data: memoryview) -> MemoryObj | None:
        """A memory object for bytes stored with their ChunkMeta header: allocated as the header says,
        the header verified against the bytes first. Bytes that are no such object are a miss."""
        try:
            meta, offset = ChunkMeta.decode(data)
        except MetaError as exc:
            self.guard.count("bad_sizes")
            logger.warning(
                "kvtier lmcache object of %d bytes is neither a chunk here nor stored with its metadata, "
                "treated as a miss: %s",
                len(data),
                exc,
            )
            return None
        obj = self._allocate([torch.Size(s) for s in meta.shapes], list(meta.dtypes), meta.fmt)
        if obj is None:
            return None
        target = memoryview(obj.byte_array).cast("B")
        payload = data.cast("B")[offset : offset + meta.nbytes]
        if len(target) != len(payload):  # LMCache allocated another size than the shapes make
            self.guard.count("bad_sizes")
            obj.ref_count_down()
            return None
        target[:] = payload
        return obj

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One memory object per key (the caller owns it), None per miss; one kvtier call, zero-copy."""
        if not self.enabled or not keys:
            return [None] * len(keys)
        fallback: list[MemoryObj | None] = [None] * len(keys)
        return await self._run(
            self._io, lambda: self.guard.call("get", lambda: self._fetch(keys), fallback), on_abandon=self._release
        )

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks that were read (the rest released), in one kvtier call."""
        got = await self.batched_get(keys)
        n = next((i for i, obj in enumerate(got) if obj is None), len(got))
        self._release(got[n:])
        return [obj for obj in got[:n] if obj is not None]

    # ------------------------------------------------------------ puts

    def _encode(self, obj: MemoryObj) -> Any:
        """What to store for an object: chunk-shaped objects raw (zero-copy; their size is a whole
        number of tokens), the others, when save_chunk_meta is on, as ChunkMeta header || bytes,
        padded so that their size is never a whole number of tokens (a reader tells them apart by
        size alone, in the same read). None: the object could not be read back as it is (not
        chunk-shaped and no metadata kept, or metadata that does not describe its bytes); it is
        refused rather than stored for `contains` to promise."""
        view = memoryview(obj.byte_array)
        if self.chunk_shaped(obj):
            return view
        if not self.save_chunk_meta or self.single_token_size <= 1:
            return None
        try:
            return ChunkMeta.of(obj).encode_with(view.cast("B"), self.single_token_size)
        except (MetaError, AttributeError, TypeError) as exc:
            logger.warning("kvtier lmcache put refused, its metadata cannot be kept: %s", exc)
            return None

    def _store(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        kv_keys: list[str] = []
        values: list[Any] = []
        for key, obj in zip(keys, objs, strict=True):
            value = self._encode(obj)
            if value is not None:
                kv_keys.append(self.kv_key(key))
                values.append(value)
        refused = len(keys) - len(kv_keys)
        if refused:
            self.guard.count("refused_puts", refused)
            logger.warning(
                "kvtier lmcache put: %d of %d objects refused: not chunks of this engine's layout, and "
                "save_chunk_meta is off (or their metadata cannot be kept), so they could not be read back",
                refused,
                len(keys),
            )
        if not kv_keys:
            return
        statuses: list[Status] = []  # counted only: in the order of the parts, not of kv_keys
        for overwrite, group in _by_overwrite(kv_keys, values):
            names, data = [k for k, _ in group], [v for _, v in group]
            # Not content-addressed (LMCache's health probe): the last put wins, as one atomic
            # overwrite, so a reader meanwhile gets the old bytes or the new, never a miss.
            put = self._client.batch_upsert if overwrite else self._client.batch_put
            statuses += self.guard.call(
                "batch_upsert" if overwrite else "batch_put",
                lambda put=put, names=names, data=data: put(names, data, replicas=self.settings.replicas),
                [Status.UNAVAILABLE] * len(names),
            )
        failed = [s for s in statuses if s != Status.OK]
        self.guard.count("puts", len(kv_keys) - len(failed))
        if failed:
            self.guard.count("put_failures", len(failed))
            logger.warning(
                "kvtier lmcache put: %d of %d chunks not stored (first: %s)",
                len(failed),
                len(kv_keys),
                Status(failed[0]).name,
            )

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store chunks in one kvtier call (idempotent: a chunk already stored is not rewritten).

        Never raises. The objects are referenced until the sending thread is done, so LMCache's own
        release after this coroutine (or its cancellation) cannot free a buffer being sent."""
        if not self.enabled or not keys:
            return
        objs = list(memory_objs)
        for obj in objs:
            obj.ref_count_up()
        keys = list(keys)
        future = self._io.submit(self.guard.call, "put", lambda: self._store(keys, objs), None)
        future.add_done_callback(lambda _f: self._release(objs))
        await asyncio.wrap_future(future)

    # ------------------------------------------------------------ the rest of RemoteConnector

    def remove_sync(self, key: CacheEngineKey) -> bool:
        if not self.enabled:
            return False
        return self.guard.call("remove", lambda: self._client.remove(self.kv_key(key)), False)

    async def list(self) -> list[str]:
        """Every chunk of this namespace, as LMCache key strings."""
        if not self.enabled:
            return []

        def walk() -> list[str]:
            return [self.lmcache_key(info.key) for info in self._client.iter_keys()]

        return await self._run(self._lookups, lambda: self.guard.call("list", walk, []))

    def stats(self) -> dict[str, int]:
        """The adapter's counters (hits, misses, puts, put_failures, errors, ...) and the client's."""
        out = dict(self.guard.stats())
        if self.enabled:
            out.update({f"client_{k}": v for k, v in self._client.stats().items()})
        return out

    async def close(self) -> None:
        if not self.enabled:
            return
        client, self._client = self._client, None
        pools = [p for p in (self._io, self._lookups) if p is not None]

        def shutdown() -> None:
            for pool in pools:
                pool.shutdown(wait=True)
            client.close()

        await asyncio.get_running_loop().run_in_executor(None, shutdown)
        logger.info("kvtier lmcache connector closed namespace=%s stats=%s", self.namespace, self.guard.stats())

    def __repr__(self) -> str:
        return f"<KvtierConnector master={self.settings.master} namespace={self.namespace or '(disabled)'}>"


class KvtierConnectorAdapter(ConnectorAdapter):
    """LMCache's adapter for kvtier: `plugin://kvtier[.<instance>]` and `kvtier://host:port[/prefix]`."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KvtierConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=context.plugin_name,
            url=context.url,
        )
