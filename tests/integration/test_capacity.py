"""Cases 4 and 5: objects larger than any segment, and a full cluster."""

from __future__ import annotations

import os

import pytest

from kvtier.client import KvtierError, Status

MiB = 1 << 20
SEGMENT = 64 * MiB  # each of the fixture's two segments
CHUNK = 4 * MiB
FITS = 2 * SEGMENT // CHUNK


def test_object_larger_than_any_segment_is_too_large(cluster):
    client = cluster.client()
    too_big = bytearray(SEGMENT + 1)

    with pytest.raises(KvtierError) as info:
        client.put("too-big", too_big)
    assert info.value.status == Status.TOO_LARGE

    with pytest.raises(KvtierError) as info:
        client.put("too-big", too_big, replicas=2)
    assert info.value.status == Status.TOO_LARGE

    # Per key in a batch: the other keys are stored.
    assert client.batch_put(["too-big", "small"], [too_big, b"ok"]) == [Status.TOO_LARGE, Status.OK]
    assert client.get("small") == b"ok"
    assert client.get("too-big") is None and not client.exists("too-big")
    status = client.cluster_status()
    assert status.objects == 1 and status.pending_puts == 0 and status.used == 64, "no space held for the refused put"

    # The boundary: an object of exactly one segment's capacity is not too large.
    # Hard-pinned: a full segment is above its high watermark, and the next tick would evict it.
    whole = os.urandom(SEGMENT)
    client.put("whole-segment", whole, pin="hard")
    assert client.get("whole-segment") == whole


def test_more_replicas_than_segments_is_no_replica(cluster):
    client = cluster.client()
    with pytest.raises(KvtierError) as info:
        client.put("k", b"v", replicas=3)
    assert info.value.status == Status.NO_REPLICA
    assert client.get("k") is None
    assert client.cluster_status().used == 0


def test_a_cluster_full_of_unevictable_objects_is_no_space_until_objects_are_removed(cluster):
    """Hard-pinned objects are never evicted, so a cluster full of them refuses new puts."""
    client = cluster.client()
    base = os.urandom(CHUNK)
    values = {f"fill/{i:02d}": i.to_bytes(8, "little") + base[8:] for i in range(FITS + 4)}

    stored: list[str] = []
    refused = None
    for key, value in values.items():
        try:
            client.put(key, value, pin="hard")
        except KvtierError as exc:
            refused = exc.status
            break
        stored.append(key)
    assert refused == Status.NO_SPACE, "filling the cluster never reported NO_SPACE"
    assert len(stored) == FITS, "two 64 MiB segments hold exactly 32 objects of 4 MiB"

    status = client.cluster_status()
    assert status.used == status.capacity == 2 * SEGMENT
    assert [s.dram_used for s in status.segments] == [SEGMENT, SEGMENT]

    # Full means full, for one byte too, and per key in a batch.
    with pytest.raises(KvtierError) as info:
        client.put("one-byte", b"x")
    assert info.value.status == Status.NO_SPACE
    assert client.batch_put(["late/0", "late/1"], [b"a", base]) == [Status.NO_SPACE, Status.NO_SPACE]
    assert client.cluster_status().pending_puts == 0, "refused puts left nothing pending"

    # Objects never read are freed at once by remove: their space takes new puts again.
    assert client.batch_remove(stored[:2]) == [Status.OK, Status.OK]
    client.put("refill/0", values[stored[0]], pin="hard")
    client.put("refill/1", values[stored[1]], pin="hard")
    with pytest.raises(KvtierError) as info:
        client.put("refill/2", base)
    assert info.value.status == Status.NO_SPACE

    # A removed object another reader holds a lease on keeps its space until that reader is done:
    # it hands its lease back with its next request (issue 19), or the lease ends.
    reader = cluster.client()
    assert reader.get(stored[2]) == values[stored[2]]
    assert client.remove(stored[2])
    with pytest.raises(KvtierError) as info:
        client.put("refill/3", base)
    assert info.value.status == Status.NO_SPACE
    assert not reader.exists("refill/3")  # carries the reader's release
    client.put("refill/3", base)

    # The objects that stayed are intact, and so are the new ones. Over TCP, asking for every survivor
    # twice is more than one 64 MiB frame per segment: the client splits it into several frames.
    survivors = stored[3:]
    assert client.batch_get(survivors) == [values[k] for k in survivors]
    tcp = cluster.client(transport="tcp")
    assert tcp.batch_get(survivors * 2) == [values[k] for k in survivors * 2]
    assert client.batch_get(["refill/0", "refill/1"]) == [values[stored[0]], values[stored[1]]]
