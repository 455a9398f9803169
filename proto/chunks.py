"""Chunk checksums for verified ranged reads (issue 21): the contract between writer, master and reader.

A value larger than CHUNK_BYTES is cut into chunks of CHUNK_BYTES (the last one
shorter); its put records the CRC32C (Castagnoli, as the whole-object checksum)
of each chunk, 4 bytes little-endian per chunk, concatenated: the blob
`PutEndRequest.chunk_checksums` carries and `GetReplicasResponse.chunk_checksums`
returns. A value of one chunk or less has no blob (its whole checksum is the
chunk's). The chunk size is a cluster-wide constant, not an option: a blob
means the same to every reader whenever it was written, and one whose length
does not match its object's chunk count is not kept (readers then read whole).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

CHUNK_BYTES = 64 << 10  # 4 B per 64 KiB: 64 B of master memory per MiB stored
CRC_BYTES = 4


def chunk_count(size: int) -> int:
    """How many chunks an object of `size` bytes has (0 for an empty one)."""
    return -(-size // CHUNK_BYTES)


def blob_fits(blob: bytes, size: int) -> bool:
    """Whether `blob` is a chunk-checksum blob for an object of `size` bytes (more than one chunk)."""
    count = chunk_count(size)
    return count > 1 and len(blob) == CRC_BYTES * count


def unpack_crcs(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // CRC_BYTES}I", blob)


def pack_crcs(crcs: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(crcs)}I", *crcs)


def covering(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of chunks, [first, end) chunk indices, sorted and merged, that hold every byte of
    `ranges` ((offset, length) pairs; empty ones need none)."""
    wanted = sorted(
        (offset // CHUNK_BYTES, -(-(offset + length) // CHUNK_BYTES)) for offset, length in ranges if length
    )
    runs: list[tuple[int, int]] = []
    for first, end in wanted:
        if runs and first <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((first, end))
    return runs
