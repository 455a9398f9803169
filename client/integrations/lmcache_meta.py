"""The chunk metadata the LMCache connector stores with objects that are not chunk-shaped.

LMCache's `save_chunk_meta` (on unless `extra_config` sets it false) asks a remote connector to
keep each object's shapes, dtypes and memory format with its bytes, so that any memory object
round-trips, not only a chunk of this engine's layout. The kvtier connector stores chunk-shaped
objects raw (zero-copy both ways, their shape follows from their size: a whole number of tokens)
and the others as `header || bytes || pad` under the same key, the pad (0 or 1 byte) chosen so that
the total is never a whole number of tokens: a reader tells the two apart by size, in one read.

The header is kvtier's own, self-describing (it does not depend on LMCache's process-wide
`init_remote_metadata_info`), little-endian:

    magic "KVTM", version u16, memory format u16, groups u16,
    per group: dtype code u16 (LMCache's DTYPE_TO_INT), ndim u16, ndim x dim i64,
    payload length u64, pad length u16.

`decode` verifies everything it can: the magic and version, a known format and dtypes, sane
dimensions, and that the payload length is what the shapes and dtypes make and what the object
holds (with exactly the announced pad after it). Anything else raises MetaError, which the
connector turns into a miss: bytes whose shape cannot be known for sure are never handed to LMCache.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import DTYPE_TO_INT, INT_TO_DTYPE

MAGIC = b"KVTM"
VERSION = 1
MAX_GROUPS = 64
MAX_DIMS = 8
_HEAD = struct.Struct("<4sHHH")  # magic, version, memory format, groups
_GROUP = struct.Struct("<HH")  # dtype code, ndim
_DIM = struct.Struct("<q")
_LEN = struct.Struct("<QH")  # payload length, pad length


class MetaError(ValueError):
    """A header that is not one this module wrote, or that does not match the bytes after it."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What LMCache needs to allocate a memory object for stored bytes."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: MemoryFormat

    @classmethod
    def of(cls, obj: object) -> ChunkMeta:
        """The metadata of an LMCache memory object."""
        return cls(
            shapes=tuple(tuple(int(d) for d in shape) for shape in obj.get_shapes()),  # type: ignore[attr-defined]
            dtypes=tuple(obj.get_dtypes()),  # type: ignore[attr-defined]
            fmt=obj.get_memory_format(),  # type: ignore[attr-defined]
        )

    @property
    def nbytes(self) -> int:
        """The payload size the shapes and dtypes make."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    def encode_with(self, payload: memoryview, token_bytes: int) -> bytearray:
        """`header || payload || pad`, its length never a multiple of `token_bytes` (> 1): what a
        reader takes for raw chunk bytes never has a header, and the reverse. One copy of the payload."""
        header = self.encode(len(payload), pad=0)
        pad = 1 if (len(header) + len(payload)) % token_bytes == 0 else 0
        header = self.encode(len(payload), pad=pad)
        value = bytearray(len(header) + len(payload) + pad)
        value[: len(header)] = header
        value[len(header) : len(header) + len(payload)] = payload
        return value

    def encode(self, payload_len: int, pad: int = 0) -> bytes:
        """The header for a payload of `payload_len` bytes followed by `pad` bytes. Raises MetaError
        for what it cannot describe (an unknown dtype, too many groups or dimensions) or a length
        the shapes do not make."""
        if not self.shapes or len(self.shapes) != len(self.dtypes) or len(self.shapes) > MAX_GROUPS:
            raise MetaError(f"{len(self.shapes)} shapes for {len(self.dtypes)} dtypes")
        if payload_len != self.nbytes:
            raise MetaError(f"the object holds {payload_len} bytes, its shapes and dtypes make {self.nbytes}")
        parts = [_HEAD.pack(MAGIC, VERSION, int(self.fmt.value), len(self.shapes))]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            if dtype not in DTYPE_TO_INT:
                raise MetaError(f"dtype {dtype} has no code in LMCache's protocol")
            if len(shape) > MAX_DIMS:
                raise MetaError(f"shape {shape} has more than {MAX_DIMS} dimensions")
            parts.append(_GROUP.pack(DTYPE_TO_INT[dtype], len(shape)))
            parts.extend(_DIM.pack(d) for d in shape)
        parts.append(_LEN.pack(payload_len, pad))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> tuple[ChunkMeta, int]:
        """(metadata, header length) of a stored object `header || payload`; MetaError if the header
        is not valid or the payload after it is not exactly the size it announces."""
        view = memoryview(data)
        try:
            magic, version, fmt_value, groups = _HEAD.unpack_from(view, 0)
            if magic != MAGIC or version != VERSION:
                raise MetaError(f"not a kvtier chunk header (magic {bytes(magic)!r}, version {version})")
            if not 0 < groups <= MAX_GROUPS:
                raise MetaError(f"{groups} groups")
            fmt = MemoryFormat(fmt_value)
            pos = _HEAD.size
            shapes: list[tuple[int, ...]] = []
            dtypes: list[torch.dtype] = []
            for _ in range(groups):
                code, ndim = _GROUP.unpack_from(view, pos)
                pos += _GROUP.size
                if code not in INT_TO_DTYPE or ndim > MAX_DIMS:
                    raise MetaError(f"dtype code {code}, {ndim} dimensions")
                dims = tuple(_DIM.unpack_from(view, pos + i * _DIM.size)[0] for i in range(ndim))
                pos += ndim * _DIM.size
                if any(d < 0 for d in dims):
                    raise MetaError(f"negative dimension in {dims}")
                shapes.append(dims)
                dtypes.append(INT_TO_DTYPE[code])
            length, pad = _LEN.unpack_from(view, pos)
            pos += _LEN.size
        except struct.error as exc:
            raise MetaError(f"truncated header ({len(view)} bytes)") from exc
        except ValueError as exc:  # MemoryFormat(unknown)
            if isinstance(exc, MetaError):
                raise
            raise MetaError(str(exc)) from exc
        meta = cls(tuple(shapes), tuple(dtypes), fmt)
        if length != meta.nbytes or pad > 1 or length + pad != len(view) - pos:
            raise MetaError(
                f"header announces {length} bytes and {pad} of pad, shapes make {meta.nbytes}, "
                f"{len(view) - pos} follow it"
            )
        return meta, pos
