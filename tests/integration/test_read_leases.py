"""Read leases end with the read (issue 19): removed space is reusable at once, never under a reader.

A reader hands its lease back once its read is over (piggybacked on its next
request to the master), so a removed object's range is free right away
instead of `lease_s` later; leases are counted per reader, so one reader's
release never frees a range another one still holds.
"""

from __future__ import annotations

import random

from kvtier.client import Status

MiB = 1 << 20
KiB = 1 << 10
SEGMENT = 16 * MiB


def _dram_used(client) -> int:
    return client.cluster_status().used


def test_removed_space_is_reusable_at_once(bare_cluster, transport):
    """The issue's scenario, scaled down: fill 5/8 of a segment, read it back, remove it, then at
    once write 5/8 again in bigger objects and read them back. While the removed objects' ranges
    stayed held by their read leases (lease_s = 10 s), the second round fit only by evicting its own
    live objects: reads missed. Now every one of them is a hit with the right bytes."""
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    client = bare_cluster.client(transport=transport)
    rng = random.Random(19)
    small = {f"small/{i:03d}": rng.randbytes(256 * KiB) for i in range(40)}  # 10 MiB
    assert client.batch_put(list(small), list(small.values())) == [Status.OK] * len(small)
    assert client.batch_get(list(small)) == list(small.values())
    assert client.batch_remove(list(small)) == [Status.OK] * len(small)
    assert _dram_used(client) == 0  # freed by the remove: the reads were over

    big = {f"big/{i:03d}": rng.randbytes(MiB + 512 * KiB) for i in range(7)}  # 10.5 MiB
    for key, value in big.items():  # one by one, as engines store blocks
        assert client.batch_put([key], [value]) == [Status.OK], key
    got = client.batch_get(list(big))
    missed = [key for key, value in zip(big, got, strict=True) if value != big[key]]
    assert not missed, f"{len(missed)} of {len(big)} reads missed: {missed}"


def test_a_release_never_frees_what_another_reader_holds(bare_cluster):
    """Two readers lease the same object; it is removed. The first reader's release leaves the range
    held for the second, whose release frees it; a reader that never releases holds it until its
    lease runs out (the dead-reader case: the lease expires as before)."""
    bare_cluster.start_master("--lease-s", "3")
    bare_cluster.start_segment("seg0", "16MiB")
    a, b, c = (bare_cluster.client() for _ in range(3))
    value = random.Random(7).randbytes(4 * MiB)
    assert a.batch_put(["shared"], [value]) == [Status.OK]
    used = _dram_used(a)
    assert used >= len(value)
    assert a.get("shared") == value
    assert b.get("shared") == value
    assert a.remove("shared")  # carries a's release
    assert _dram_used(a) == used, "freed while b still holds its lease"
    assert not b.exists("shared")  # carries b's release: nobody reads the range any more
    assert _dram_used(a) == 0

    # A reader that never hands its lease back: the range waits for the lease's end, as before.
    assert a.batch_put(["kept"], [value]) == [Status.OK]
    assert c.get("kept") == value
    assert a.remove("kept")
    assert _dram_used(a) == used
    assert bare_cluster.wait_for(lambda: _dram_used(a) == 0, timeout=30)
