"""The chunk-checksum contract (kvtier.proto.chunks) and the client's one-pass computation of it
(kvtier.client.chunks): chunk CRCs and the whole CRC combined from them match crc32c's own."""

from __future__ import annotations

import random

import crc32c
import pytest

from kvtier.client.chunks import ChunkSums, chunk_checksums, combine_chunk, put_checksums
from kvtier.proto.chunks import CHUNK_BYTES, blob_fits, chunk_count, covering, pack_crcs, unpack_crcs

SIZES = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES, 5 * CHUNK_BYTES + 77]


@pytest.mark.parametrize("size", SIZES)
def test_chunk_checksums_match_crc32c(size):
    value = random.Random(size).randbytes(size)
    whole, blob = chunk_checksums(memoryview(value))
    assert whole == crc32c.crc32c(value)
    if size <= CHUNK_BYTES:
        assert blob == b""
    else:
        assert blob_fits(blob, size)
        assert list(unpack_crcs(blob)) == [
            crc32c.crc32c(value[lo : lo + CHUNK_BYTES]) for lo in range(0, size, CHUNK_BYTES)
        ]


def test_combine_is_crc32c_of_the_concatenation():
    rng = random.Random(7)
    for _ in range(5):
        head, chunk = rng.randbytes(rng.randrange(1, 3000)), rng.randbytes(CHUNK_BYTES)
        assert combine_chunk(crc32c.crc32c(head), crc32c.crc32c(chunk)) == crc32c.crc32c(head + chunk)


@pytest.mark.parametrize("piece", [CHUNK_BYTES, 4 * CHUNK_BYTES, 8 * CHUNK_BYTES], ids=["64k", "256k", "512k"])
def test_chunk_sums_fed_in_the_connectors_pieces_match(piece):
    """The shm (256 KiB) and tcp (512 KiB) connectors feed their copy pieces: same CRCs as one go."""
    value = memoryview(random.Random(piece).randbytes(9 * CHUNK_BYTES + 5))
    sums = ChunkSums()
    for lo in range(0, len(value), piece):
        sums.add(value[lo : lo + piece])
    assert (sums.whole, sums.blob()) == chunk_checksums(value)


def test_put_checksums_drop_the_blob_when_the_bytes_changed_under_the_put():
    value = bytearray(random.Random(1).randbytes(3 * CHUNK_BYTES))
    small = b"x" * 10
    stored_crc = crc32c.crc32c(value)  # what a connector computed while copying
    value[5] ^= 0xFF  # the caller changed its buffer before the chunk pass
    copied = memoryview(bytes(5 * CHUNK_BYTES))
    copied_crc, copied_blob = chunk_checksums(copied)  # what a connector computed in its one pass
    checksums = [stored_crc, None, None, copied_crc]
    views = [memoryview(value), memoryview(small), memoryview(bytes(2 * CHUNK_BYTES + 1)), copied]
    blobs = put_checksums(views, [0, 1, 2, 3], checksums, [None, None, None, copied_blob])
    assert blobs[0] == b"" and checksums[0] == stored_crc  # never chunk CRCs of other bytes
    assert blobs[1] == b"" and checksums[1] == crc32c.crc32c(small)
    assert blob_fits(blobs[2], 2 * CHUNK_BYTES + 1) and checksums[2] == crc32c.crc32c(views[2])
    assert blobs[3] == copied_blob and checksums[3] == copied_crc


def test_covering_merges_runs_and_skips_empty_ranges():
    c = CHUNK_BYTES
    assert covering([]) == [] and covering([(5, 0)]) == []
    assert covering([(0, 1)]) == [(0, 1)]
    assert covering([(c - 1, 2)]) == [(0, 2)]
    assert covering([(3 * c, c), (0, 10), (c, 1), (10 * c + 5, 1)]) == [(0, 2), (3, 4), (10, 11)]
    assert covering([(2 * c, 1), (2 * c + 5, 3 * c)]) == [(2, 6)]


def test_counts_and_blob_shapes():
    assert [chunk_count(s) for s in (0, 1, CHUNK_BYTES, CHUNK_BYTES + 1)] == [0, 1, 1, 2]
    assert not blob_fits(b"\0" * 4, CHUNK_BYTES)  # one chunk: no blob
    assert blob_fits(b"\0" * 8, CHUNK_BYTES + 1) and not blob_fits(b"\0" * 12, CHUNK_BYTES + 1)
    assert unpack_crcs(pack_crcs([1, 0xFFFF_FFFF])) == (1, 0xFFFF_FFFF)
