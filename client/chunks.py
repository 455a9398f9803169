"""Chunk checksums at put (kvtier.proto.chunks): one pass over the value gives both the chunk CRCs
and the whole-object CRC.

The crc32c package has no combine, so this module carries one for the one length that matters:
CRC32C(a + b) = shift(CRC32C(a)) ^ CRC32C(b) when b is CHUNK_BYTES long, `shift` being the linear
map "append CHUNK_BYTES zero bytes" on the 32-bit register (zlib's crc32_combine, specialised):
four table lookups per chunk. The whole CRC then costs no second pass over the value; only the
last, shorter chunk is read twice (once for its own CRC, once chained onto the rest). The shm and
tcp connectors feed a `ChunkSums` as they copy a value (the pass they already make for the whole
CRC); `put_checksums` computes what no connector did.
"""

from __future__ import annotations

import crc32c

from kvtier.proto.chunks import CHUNK_BYTES, pack_crcs

_POLY = 0x82F63B78  # CRC32C, reflected


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _shift_tables(nbytes: int) -> list[list[int]]:
    """Byte tables of the operator that appends `nbytes` zero bytes (a power of two) to a CRC."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # -> one zero byte
        op = _square(op)
    for _ in range(nbytes.bit_length() - 1):
        op = _square(op)
    tables = []
    for k in range(4):  # by linearity: table[b] = table[b without its lowest bit] ^ that bit's column
        table = [0] * 256
        for b in range(1, 256):
            low = (b & -b).bit_length() - 1
            table[b] = table[b & (b - 1)] ^ op[8 * k + low]
        tables.append(table)
    return tables


assert CHUNK_BYTES & (CHUNK_BYTES - 1) == 0, "the chunk size must be a power of two"
_T0, _T1, _T2, _T3 = _shift_tables(CHUNK_BYTES)


def combine_chunk(crc: int, chunk_crc: int) -> int:
    """CRC32C of (bytes with CRC `crc`) + (one full CHUNK_BYTES chunk with CRC `chunk_crc`)."""
    return _T0[crc & 255] ^ _T1[crc >> 8 & 255] ^ _T2[crc >> 16 & 255] ^ _T3[crc >> 24] ^ chunk_crc


class ChunkSums:
    """The chunk CRCs and the whole CRC of a value, fed in pieces as a connector copies it (each
    piece checksummed right after it is copied, while in cache: the connectors' one pass). Every
    piece but the last must be a multiple of CHUNK_BYTES long."""

    __slots__ = ("crcs", "whole")

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self.whole = 0

    def add(self, piece: memoryview) -> None:
        for lo in range(0, len(piece), CHUNK_BYTES):
            part = piece[lo : lo + CHUNK_BYTES]
            crc = crc32c.crc32c(part)
            # combine_chunk(0, crc) == crc: the first chunk needs no case of its own
            self.whole = combine_chunk(self.whole, crc) if len(part) == CHUNK_BYTES else crc32c.crc32c(part, self.whole)
            self.crcs.append(crc)

    def blob(self) -> bytes:
        """The chunk-CRC blob (kvtier.proto.chunks): b"" for a value of one chunk or less."""
        return pack_crcs(self.crcs) if len(self.crcs) > 1 else b""


def chunk_checksums(view: memoryview) -> tuple[int, bytes]:
    """(whole-object CRC32C, chunk-CRC blob) of a value; the blob is b"" for one chunk or less."""
    if len(view) <= CHUNK_BYTES:
        return crc32c.crc32c(view), b""
    sums = ChunkSums()
    sums.add(view)
    return sums.whole, sums.blob()


def put_checksums(
    views: list[memoryview], written: list[int], checksums: list[int | None], blobs: list[bytes | None]
) -> list[bytes]:
    """For the keys `written`: their chunk-CRC blobs (b"" for small ones). A connector that
    checksums while copying filled `checksums[i]` and `blobs[i]` (one pass); the rest are computed
    here. Where a connector gave the whole CRC only and the value's bytes no longer match it (the
    caller changed its buffer during the put), the blob is dropped: the whole checksum stands for
    the stored bytes and the object is read whole; chunk CRCs never describe other bytes."""
    out = []
    for i in written:
        view, blob = views[i], blobs[i]
        if blob is not None and checksums[i] is not None:
            out.append(blob)
            continue
        if len(view) <= CHUNK_BYTES:
            if checksums[i] is None:
                checksums[i] = crc32c.crc32c(view)
            out.append(b"")
            continue
        whole, blob = chunk_checksums(view)
        if checksums[i] is None:
            checksums[i] = whole
        out.append(blob if whole == checksums[i] else b"")
    return out
