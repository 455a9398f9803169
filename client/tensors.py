"""`put_tensor` / `get_tensor`: CPU torch tensors as kvtier objects, with their dtype and shape.

The object is a small header followed by the tensor's bytes (C order):

    magic b"KVTT" | version u8 | ndim u8 | dtype-name length u8 | pad u8 |
    dtype name (ASCII, e.g. "bfloat16") | ndim x u64 dims | zero padding to 16 bytes | data

`get_tensor` checks the header before it builds anything: an object that is
not a tensor object, a payload whose length does not match the recorded dtype
and shape, or a dtype/shape other than the one the caller expects raises
`TensorMismatchError` (a ValueError); bytes are never reinterpreted as another
tensor. torch is imported only when a helper runs, so `kvtier.client` stays
importable without it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

MAGIC = b"KVTT"
VERSION = 1
_FIXED = struct.Struct("<4sBBBx")  # magic, version, ndim, dtype-name length, pad
_DIM = struct.Struct("<Q")
ALIGN = 16  # the data starts 16-byte aligned within the object: any dtype's view of it is aligned
MAX_NDIM = 64


class TensorMismatchError(ValueError):
    """The stored object is not the tensor the caller asked for (or not a tensor object at all)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # torch is optional: only these helpers need it
        raise ImportError("kvtier's tensor helpers need torch (pip install torch)") from exc
    return torch


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(dtype_name: str, shape: Sequence[int]) -> bytes:
    """The header of a tensor object of `dtype_name` and `shape`, padded to ALIGN bytes."""
    name = dtype_name.encode("ascii")
    if len(shape) > MAX_NDIM or len(name) > 255:
        raise ValueError(f"tensor of {len(shape)} dimensions / dtype {dtype_name!r} is not supported")
    header = _FIXED.pack(MAGIC, VERSION, len(shape), len(name)) + name + b"".join(_DIM.pack(d) for d in shape)
    return header + bytes(-len(header) % ALIGN)


def decode_header(data: Any) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, data offset) of a tensor object; TensorMismatchError when it is none."""
    view = memoryview(data).cast("B")
    if len(view) < _FIXED.size or bytes(view[:4]) != MAGIC:
        raise TensorMismatchError("the object is not a kvtier tensor object (no KVTT header)")
    _, version, ndim, name_len = _FIXED.unpack_from(view)
    if version != VERSION:
        raise TensorMismatchError(f"tensor object version {version} is not supported (this client reads {VERSION})")
    end = _FIXED.size + name_len + ndim * _DIM.size
    if len(view) < end:
        raise TensorMismatchError("the tensor object's header is truncated")
    name = bytes(view[_FIXED.size : _FIXED.size + name_len]).decode("ascii", errors="replace")
    dims_at = _FIXED.size + name_len
    shape = tuple(_DIM.unpack_from(view, dims_at + i * _DIM.size)[0] for i in range(ndim))
    return name, shape, end + (-end % ALIGN)


class TensorMixin:
    """`put_tensor` / `get_tensor` for `Client` (which supplies batch_put, get)."""

    def put_tensor(self, key: str, tensor: Any, **placement: Any) -> None:
        """Store a CPU torch tensor with its dtype and shape; raises KvtierError as `put` does.

        Non-contiguous tensors are stored in C order. `placement` as for `batch_put`.
        A key that already holds an object keeps it (puts never overwrite).
        """
        torch = _torch()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put_tensor needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"put_tensor takes CPU tensors (this one is on {tensor.device}); call .cpu() first")
        header = encode_header(_dtype_name(tensor.dtype), tuple(tensor.shape))
        nbytes = tensor.numel() * tensor.element_size()
        value = bytearray(len(header) + nbytes)
        value[: len(header)] = header
        if nbytes:
            out = torch.frombuffer(value, dtype=torch.uint8, offset=len(header), count=nbytes)
            out.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self.put(key, value, **placement)  # type: ignore[attr-defined]

    def get_tensor(self, key: str, *, dtype: Any = None, shape: Sequence[int] | None = None) -> Any:
        """The tensor stored under `key` (a new CPU tensor), or None on a miss.

        With `dtype` and/or `shape`, the recorded ones must equal them. Raises
        TensorMismatchError when they differ, when the object is not a tensor
        object, or when its length does not match its header.
        """
        torch = _torch()
        data = self.get(key)  # type: ignore[attr-defined]
        if data is None:
            return None
        name, stored_shape, offset = decode_header(data)
        stored_dtype = getattr(torch, name, None)
        if not isinstance(stored_dtype, torch.dtype):
            raise TensorMismatchError(f"{key!r:.80} holds a tensor of dtype {name!r}, unknown to this torch")
        if dtype is not None and stored_dtype != dtype:
            raise TensorMismatchError(f"{key!r:.80} holds a {name} tensor, not {_dtype_name(dtype)}")
        if shape is not None and tuple(shape) != stored_shape:
            raise TensorMismatchError(f"{key!r:.80} holds a tensor of shape {list(stored_shape)}, not {list(shape)}")
        itemsize = torch.empty((), dtype=stored_dtype).element_size()
        nbytes = math.prod(stored_shape) * itemsize
        if len(data) - offset != nbytes:
            raise TensorMismatchError(
                f"{key!r:.80}: {len(data) - offset} data bytes for a {name} tensor of shape {list(stored_shape)}"
                f" ({nbytes} expected)"
            )
        if nbytes == 0:
            return torch.empty(stored_shape, dtype=stored_dtype)
        buffer = bytearray(memoryview(data)[offset:])  # writable and owned by the tensor
        return torch.frombuffer(buffer, dtype=torch.uint8).view(stored_dtype).reshape(stored_shape)
