"""Case 1: values of every size class round-trip through real servers, via every read and write API.

The test process is a plain client, not a segment server: the bytes go over
the TCP data plane, or (forced per test through the `transport` fixture) the
same-host shm transport that maps the segment's region file.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.client import Status

KiB, MiB = 1 << 10, 1 << 20
SIZES = [0, 1, 64 * KiB, 1 * MiB, 16 * MiB]
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def values() -> dict[int, bytes]:
    return {size: os.urandom(size) for size in SIZES}


def guarded(size: int, slack: int = 64) -> tuple[bytearray, memoryview]:
    """A `size`-byte writable view whose backing store continues with `slack` sentinel bytes."""
    backing = bytearray([SENTINEL]) * (size + slack)
    return backing, memoryview(backing)[:size]


def untouched_tail(backing: bytearray, size: int) -> bool:
    return backing[size:] == bytearray([SENTINEL]) * (len(backing) - size)


def test_put_then_read_every_size_with_every_single_key_api(cluster, values, transport):
    client = cluster.client(transport=transport)
    for size, value in values.items():
        key = f"single/{size}"
        client.put(key, value)

        got = client.get(key)
        assert isinstance(got, bytes) and got == value, f"get of {size} bytes"

        buf = bytearray(size)
        assert client.get_into(key, buf) == size
        assert buf == value

        backing, view = guarded(size)
        assert client.get_into(key, view) == size
        assert view == value and untouched_tail(backing, size), f"memoryview of {size} bytes"

        arr = np.zeros(size, dtype=np.uint8)
        assert client.get_into(key, arr) == size
        assert arr.tobytes() == value

        # A larger buffer: exactly `size` bytes are written, the rest stays as it was.
        backing, view = guarded(size + 100, slack=0)
        assert client.get_into(key, view) == size
        assert backing[:size] == value and untouched_tail(backing, size)


def test_put_from_numpy_and_read_into_a_non_byte_dtype(cluster, values):
    client = cluster.client()
    value = values[64 * KiB]
    source = np.frombuffer(value, dtype=np.uint32).reshape(128, 128)  # 2-D, 4-byte items
    client.put("numpy/src", source)
    assert client.get("numpy/src") == value

    target = np.zeros(16 * KiB, dtype=np.float32)  # same byte count, other dtype
    assert client.get_into("numpy/src", target) == 64 * KiB
    assert target.tobytes() == value


def test_batch_put_then_batch_get_and_batch_get_into_every_size(cluster, values, transport):
    client = cluster.client(transport=transport)
    keys = [f"batch/{size}" for size in SIZES]
    assert client.batch_put(keys, [values[s] for s in SIZES]) == [Status.OK] * len(SIZES)

    assert client.batch_get(keys) == [values[s] for s in SIZES]

    # One buffer type per key, mixed in one batch.
    backings = [guarded(s) for s in SIZES]
    buffers = [
        bytearray(SIZES[0]),
        backings[1][1],
        np.zeros(SIZES[2], dtype=np.uint8),
        memoryview(bytearray(SIZES[3])),
        backings[4][1],
    ]
    assert client.batch_get_into(keys, buffers) == SIZES
    for size, buf in zip(SIZES, buffers, strict=True):
        assert bytes(buf) == values[size], f"batch_get_into of {size} bytes"
    assert untouched_tail(backings[1][0], SIZES[1]) and untouched_tail(backings[4][0], SIZES[4])

    # The single-key API sees what the batch API wrote, and vice versa.
    client.put("single-then-batch", values[1 * MiB])
    assert client.batch_get(["single-then-batch", keys[3]]) == [values[1 * MiB], values[1 * MiB]]

    # What one transport wrote, the other reads.
    other = cluster.client(transport="tcp" if transport == "shm" else "shm")
    assert other.batch_get(keys) == [values[s] for s in SIZES]


def test_get_into_a_too_small_buffer_is_buffer_too_small_and_writes_nothing_past_it(cluster, values):
    client = cluster.client()
    client.put("small", b"xyz")
    for size in SIZES[1:]:
        key = f"big/{size}"
        client.put(key, values[size])
        for short in sorted({0, size - 1}):
            backing, view = guarded(short)
            result = client.get_into(key, view)
            assert result == Status.BUFFER_TOO_SMALL and result < 0, f"{short}-byte buffer for {size} bytes"
            assert untouched_tail(backing, short), f"bytes written past a {short}-byte buffer"

            arr = np.full(short + 64, SENTINEL, dtype=np.uint8)
            assert client.get_into(key, arr[:short]) == Status.BUFFER_TOO_SMALL
            assert (arr[short:] == SENTINEL).all()

        # In a batch only the key with the short buffer fails; the others are still read.
        backing, short_view = guarded(size - 1)
        fine = bytearray(3)
        assert client.batch_get_into([key, "small"], [short_view, fine]) == [Status.BUFFER_TOO_SMALL, 3]
        assert fine == b"xyz" and untouched_tail(backing, size - 1)
        assert client.get(key) == values[size]  # the failed read did not disturb the object
