"""Case 2: one batch of 256 keys of mixed sizes, presence queries, and removal counts."""

from __future__ import annotations

import os

from kvtier.client import Status

N = 256
GROUPS = 4  # keys are "b/<group>/<index>", so remove_prefix("b/<group>/") hits N / GROUPS keys


def mixed_size(i: int) -> int:
    # 0 B, odd sizes, page-crossing and up to ~256 KiB: about 16 MiB in total.
    return [0, 1, 63, 4097, 65_536, 131_071, 262_144, 100][i % 8] + (i % 3)


def make_batch() -> tuple[list[str], list[bytes]]:
    keys = [f"b/{i % GROUPS}/{i:03d}" for i in range(N)]
    values = [os.urandom(mixed_size(i)) for i in range(N)]
    return keys, values


def test_batch_of_256_mixed_sizes_round_trips(cluster):
    client = cluster.client()
    keys, values = make_batch()
    assert client.batch_put(keys, values) == [Status.OK] * N

    assert client.batch_get(keys) == values

    buffers = [bytearray(len(v)) for v in values]
    assert client.batch_get_into(keys, buffers) == [len(v) for v in values]
    assert buffers == [bytearray(v) for v in values]

    # Reversed order and duplicates: results follow the request order.
    order = list(range(N - 1, -1, -1)) + [7, 7]
    assert client.batch_get([keys[i] for i in order]) == [values[i] for i in order]

    # Misses inside a big batch stay per key.
    mixed = keys[:10] + ["absent"] + keys[10:20]
    assert client.batch_get(mixed) == values[:10] + [None] + values[10:20]

    status = client.cluster_status()
    assert status.objects == N and status.pending_puts == 0


def test_exists_batch_exists_and_longest_prefix(cluster):
    client = cluster.client()
    keys, values = make_batch()
    assert client.batch_put(keys, values) == [Status.OK] * N

    assert client.exists(keys[0]) and client.exists(keys[-1])
    assert not client.exists("b/0/999")
    assert client.batch_exists(keys) == [True] * N
    assert client.longest_prefix(keys) == N
    assert client.batch_exists([]) == [] and client.longest_prefix([]) == 0

    assert client.remove(keys[100])
    present = client.batch_exists(keys)
    assert present == [i != 100 for i in range(N)]
    assert client.longest_prefix(keys) == 100, "a gap in the middle stops the prefix"
    assert client.longest_prefix(keys[101:]) == N - 101, "keys after the gap are still present"
    assert client.longest_prefix([keys[100]] + keys[:100]) == 0
    assert client.longest_prefix(keys[:5] + ["absent"] + keys[5:10]) == 5

    assert client.batch_put([keys[100]], [values[100]]) == [Status.OK]
    assert client.longest_prefix(keys) == N, "filling the gap restores the whole prefix"


def test_remove_and_remove_prefix_counts(cluster):
    client = cluster.client()
    keys, values = make_batch()
    assert client.batch_put(keys, values) == [Status.OK] * N

    assert client.remove(keys[0]) is True
    assert client.remove(keys[0]) is False, "a second remove finds nothing"
    assert client.get(keys[0]) is None

    assert client.batch_remove([keys[4], "absent", keys[8]]) == [Status.OK, Status.NOT_FOUND, Status.OK]
    assert client.batch_get([keys[4], keys[8], keys[12]]) == [None, None, values[12]]

    # keys[0], keys[4] and keys[8] were in group 0.
    assert client.remove_prefix("b/0/") == N // GROUPS - 3
    assert client.remove_prefix("b/0/") == 0
    assert client.remove_prefix("no-such-prefix/") == 0
    assert not any(client.batch_exists(keys[0::GROUPS]))
    assert client.batch_exists(keys[1::GROUPS]) == [True] * (N // GROUPS), "other groups are untouched"

    assert client.remove_prefix("b/1/0") == 25  # b/1/001 .. b/1/097: i = 1, 5, ..., 97
    assert client.remove_prefix("b/") == N - N // GROUPS - 25
    assert client.cluster_status().objects == 0
    assert client.batch_get(keys) == [None] * N
