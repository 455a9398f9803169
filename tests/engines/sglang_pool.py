"""Stand-ins for SGLang 0.5.23's HiCache host pools, with CPU tensors.

SGLang's real `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` cannot be imported on a CPU-only
machine: `sglang.srt.mem_cache.pool_host` imports `memory_pool`, which imports every model config
(`sglang.srt.configs`), and the multimodal ones import torchvision, whose PyPI wheels link CUDA
torch (`libtorch_cuda.so`). So these classes copy, from SGLang 0.5.23's pool_host/mha.py and
pool_host/mla.py, exactly what a storage backend touches: the buffer shapes of `init_kv_buffer`
per layout, `get_page_buffer_meta` (the zero-copy page map), `get_data_page`,
`get_dummy_flat_data_page`, `set_from_flat_data_page`, and the attributes `kv_buffer`, `layout`,
`page_size`, `dtype`, `start_layer`, `end_layer`, `storage_format_tag`. Allocation is a plain
page-aligned free list (SGLang's `alloc` hands out page-aligned slots the same way).
"""

from __future__ import annotations

import torch


class _HostPool:
    storage_format_tag = None
    dcp_size = 1

    def __init__(self, *, size: int, page_size: int, layer_num: int, dtype: torch.dtype, layout: str) -> None:
        assert size % page_size == 0
        self.page_size = page_size
        self.page_num = size // page_size
        self.size = size
        self.layer_num = layer_num
        self.start_layer, self.end_layer = 0, layer_num
        self.dtype = dtype
        self.layout = layout
        self.device = "cpu"
        self.kv_buffer = torch.zeros(self.buffer_dims(), dtype=dtype)
        self._free = list(range(0, size, page_size))

    def buffer_dims(self) -> tuple[int, ...]:
        raise NotImplementedError

    def alloc(self, tokens: int) -> torch.Tensor:
        pages = [self._free.pop(0) for _ in range(tokens // self.page_size)]
        return torch.tensor([p + i for p in pages for i in range(self.page_size)], dtype=torch.int64)

    def page_starts(self, host_indices: torch.Tensor) -> list[int]:
        return host_indices.tolist()[:: self.page_size]


class MHAHostPool(_HostPool):
    """`MHATokenToKVPoolHost` (layouts layer_first, page_first, page_first_direct, page_head)."""

    def __init__(self, *, head_num: int, head_dim: int, **kwargs) -> None:
        self.head_num, self.head_dim = head_num, head_dim
        super().__init__(**kwargs)

    def buffer_dims(self) -> tuple[int, ...]:
        if self.layout == "layer_first":
            return (2, self.layer_num, self.size, self.head_num, self.head_dim)
        if self.layout == "page_first":
            return (2, self.size, self.layer_num, self.head_num, self.head_dim)
        if self.layout == "page_first_direct":
            return (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        if self.layout == "page_head":
            return (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)
        raise ValueError(f"Unsupported layout: {self.layout}")

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.k_buffer, self.v_buffer]

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim
            )
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim
            )
        else:
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.head_num, self.page_size, self.layer_num, self.head_dim
            )

    def get_page_buffer_meta(self, indices):
        """SGLang 0.5.23 `MHATokenToKVPoolHost.get_page_buffer_meta`, verbatim in substance."""
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        itemsize = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * itemsize
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (
                        kv_buffer_data_ptr
                        + indices[index] * self.head_num * self.head_dim * itemsize
                        + layer_id * self.size * self.head_num * self.head_dim * itemsize
                    )
                    ptr_list.append(k_ptr)
                    ptr_list.append(k_ptr + v_offset)
            element_size = itemsize * self.page_size * self.head_num * self.head_dim
        elif self.layout in ["page_first", "page_first_direct", "page_head"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = kv_buffer_data_ptr + indices[index] * self.layer_num * self.head_num * self.head_dim * itemsize
                ptr_list.append(k_ptr)
                ptr_list.append(k_ptr + v_offset)
            element_size = self.layer_num * itemsize * self.page_size * self.head_num * self.head_dim
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, [element_size] * len(ptr_list)


class MLAHostPool(_HostPool):
    """`MLATokenToKVPoolHost` (layouts layer_first, page_first, page_first_direct): one latent row
    of `kv_cache_dim` per token and layer, the same on every TP rank."""

    def __init__(self, *, kv_cache_dim: int, **kwargs) -> None:
        self.kv_cache_dim = kv_cache_dim
        super().__init__(**kwargs)

    def buffer_dims(self) -> tuple[int, ...]:
        if self.layout == "layer_first":
            return (self.layer_num, self.size, 1, self.kv_cache_dim)
        if self.layout == "page_first":
            return (self.size, self.layer_num, 1, self.kv_cache_dim)
        if self.layout == "page_first_direct":
            return (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        raise ValueError(f"Unsupported layout: {self.layout}")

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def get_page_buffer_meta(self, indices):
        """SGLang 0.5.23 `MLATokenToKVPoolHost.get_page_buffer_meta` (without DCP or kv-split)."""
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        itemsize = self.dtype.itemsize
        page_starts = self.page_starts(indices)
        if self.layout == "layer_first":
            for index in page_starts:
                for layer_id in range(self.layer_num):
                    ptr_list.append(
                        kv_buffer_data_ptr
                        + index * self.kv_cache_dim * itemsize
                        + layer_id * self.size * self.kv_cache_dim * itemsize
                    )
            element_size = itemsize * self.page_size * self.kv_cache_dim
        elif self.layout in ["page_first", "page_first_direct"]:
            for index in page_starts:
                ptr_list.append(kv_buffer_data_ptr + index * self.layer_num * self.kv_cache_dim * itemsize)
            element_size = self.layer_num * itemsize * self.page_size * self.kv_cache_dim
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, [element_size] * len(ptr_list)
