"""A real LMCache storage stack for tests/engines/test_lmcache.py.

`make_engine` builds what an LMCache worker builds at start: an `LMCacheEngineConfig` (the kvtier
plugin in `remote_storage_plugins` and its `extra_config` keys), an `LMCacheMetadata`, then
`CreateStorageBackends`, which makes the LocalCPUBackend (LMCache's own CPU allocator and
TensorMemoryObj chunks) and, through LMCache's remote plugin loading, the kvtier RemoteBackend.
The `Engine` drives that backend the way LMCache's storage manager does (batched puts, async
prefix lookups, blocking batched gets), on an event loop running in its own thread.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.token_database import ChunkedTokenDatabase

_VLLM_IMPORTED = False


def import_vllm_quietly() -> None:
    """Import vLLM's hashing and kv_cache_utils now, if they import at all, their warnings ignored.

    With vLLM installed, LMCache's ChunkedTokenDatabase imports vLLM's kv_cache_utils (for its
    NONE_HASH), whose import chain runs torch.compile and emits DeprecationWarnings that this test
    suite turns into errors; in an engine process vLLM is long imported by then. Called on first
    use only, so collecting this module imports nothing of vLLM."""
    global _VLLM_IMPORTED
    if _VLLM_IMPORTED:
        return
    _VLLM_IMPORTED = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("vllm.utils.hashing", "vllm.v1.core.kv_cache_utils"):
            try:
                importlib.import_module(module)
            except Exception:
                pass  # LMCache then falls back as it does without vLLM


PLUGIN = "kvtier"
MODULE = "kvtier.client.integrations.lmcache"
REMOTE = f"RemoteBackend-{PLUGIN}"
MODEL = "kvtier-test/tiny-llama"
CHUNK = 16  # tokens per chunk
# (num_layers, 2, chunk, kv_heads, head_size): 2 x 2 x 16 x 16 x 2 bytes = 2 KiB per bf16 chunk
KV_SHAPE = (2, 2, CHUNK, 2, 8)
MLA_SHAPE = (2, 1, CHUNK, 1, 16)


class LoopThread:
    """An asyncio loop in a daemon thread, as LMCache runs its storage loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def plugin_extra(master: str, class_name: str = "KvtierConnectorAdapter", **settings: Any) -> dict[str, Any]:
    """LMCache `extra_config` loading kvtier as remote storage plugin `kvtier`, plus kvtier settings."""
    extra: dict[str, Any] = {
        f"remote_storage_plugin.{PLUGIN}.module_path": MODULE,
        f"remote_storage_plugin.{PLUGIN}.class_name": class_name,
        f"remote_storage_plugin.{PLUGIN}.master": master,
        f"remote_storage_plugin.{PLUGIN}.timeout": 2.0,
    }
    extra.update({f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in settings.items()})
    return extra


def payload(key: CacheEngineKey, size: int) -> bytes:
    """The bytes every test engine stores for a chunk: derived from its hash only, so two engines
    holding the same prefix hold the same bytes."""
    return random.Random(f"chunk:{key.chunk_hash}").randbytes(size)


@dataclass
class Engine:
    config: Any
    metadata: LMCacheMetadata
    backends: dict[str, Any]
    loop: LoopThread
    closed: bool = False

    @property
    def cpu(self) -> Any:
        return self.backends["LocalCPUBackend"]

    @property
    def remote(self) -> Any:
        """LMCache's RemoteBackend for the kvtier plugin (KeyError: LMCache did not create it)."""
        return self.backends[REMOTE]

    @property
    def connector(self) -> Any:
        """The KvtierConnector inside LMCache's InstrumentedRemoteConnector."""
        return self.remote.connection.getWrappedConnector()

    def free_bytes(self) -> int:
        """Free bytes of LMCache's CPU allocator: back to its start value when no chunk leaked."""
        return self.cpu.memory_allocator.pin_allocator.address_manager.get_free_size()

    def keys(self, tokens: Sequence[int], request_configs: dict | None = None) -> list[CacheEngineKey]:
        """LMCache's own chunk keys for a token sequence (prefix-chained chunk hashes)."""
        import_vllm_quietly()
        db = ChunkedTokenDatabase(self.config, self.metadata)
        return [k for _, _, k in db.process_tokens(tokens=list(tokens), request_configs=request_configs)]

    def chunk(self, key: CacheEngineKey, num_tokens: int | None = None) -> MemoryObj:
        """A chunk from LMCache's CPU allocator filled with `payload(key)` (fewer tokens: a partial chunk)."""
        obj = self.cpu.allocate(self.metadata.get_shapes(num_tokens), self.metadata.get_dtypes())
        assert obj is not None, "LMCache's CPU allocator is full"
        data = payload(key, obj.get_size())
        obj.raw_tensor[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return obj

    def store(self, keys: Sequence[CacheEngineKey], num_tokens: int | None = None, timeout: float = 20.0) -> None:
        """Offload chunks as LMCache's storage manager does (batched_submit_put_task), and wait until
        LMCache and the connector have released them: every chunk back to our one reference."""
        objs = [self.chunk(k, num_tokens) for k in keys]
        self.remote.batched_submit_put_task(list(keys), objs)
        deadline = time.monotonic() + timeout
        while any(o.get_ref_count() > 1 for o in objs):
            assert time.monotonic() < deadline, f"puts not finished: refs {[o.get_ref_count() for o in objs]}"
            time.sleep(0.01)
        for obj in objs:
            obj.ref_count_down()

    def lookup(self, keys: Sequence[CacheEngineKey]) -> int:
        """LMCache's async prefix lookup: how many leading chunks the remote backend has."""
        return self.loop.run(self.remote.batched_async_contains("lookup", list(keys)))

    def load_objs(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """LMCache's blocking batched retrieve; the caller owns (and releases) the chunks."""
        return self.remote.batched_get_blocking(list(keys))

    def load(self, keys: Sequence[CacheEngineKey]) -> list[bytes | None]:
        """Bytes of each retrieved chunk (None per miss); the chunks are released."""
        out: list[bytes | None] = []
        for obj in self.load_objs(keys):
            if obj is None:
                out.append(None)
                continue
            out.append(bytes(obj.byte_array))
            obj.ref_count_down()
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        remote = self.backends.get(REMOTE)
        if remote is not None and remote.connection is not None:
            remote.close()
        self.cpu.close()


def make_metadata(
    *,
    model: str = MODEL,
    dtype: torch.dtype = torch.bfloat16,
    world_size: int = 1,
    worker_id: int = 0,
    use_mla: bool = False,
) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=MLA_SHAPE if use_mla else KV_SHAPE,
        use_mla=use_mla,
        chunk_size=CHUNK,
    )


def make_config(extra_config: dict[str, Any], **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": False,  # no CPU hot cache: every lookup and get goes to kvtier
        "max_local_cpu_size": 0.01,  # GB: LMCache's CPU allocator (the chunks' memory)
        "remote_storage_plugins": [PLUGIN],
        "pre_caching_hash_algorithm": "builtin",
        "blocking_timeout_secs": 10,
        "extra_config": extra_config,
    }
    values.update(overrides)
    return LMCacheEngineConfig.from_defaults(**values)


def make_engine(
    loop: LoopThread,
    master: str,
    *,
    settings: dict[str, Any] | None = None,
    class_name: str = "KvtierConnectorAdapter",
    config: Any = None,
    config_overrides: dict[str, Any] | None = None,
    **metadata: Any,
) -> Engine:
    """An LMCache worker's storage stack with the kvtier plugin, through LMCache's own loading."""
    import_vllm_quietly()  # the connector resolves LMCache's hash through vLLM, as LMCache does
    if config is None:
        config = make_config(plugin_extra(master, class_name, **(settings or {})), **(config_overrides or {}))
    meta = make_metadata(**metadata)
    return Engine(config, meta, dict(CreateStorageBackends(config, meta, loop.loop)), loop)
