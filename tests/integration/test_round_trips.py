"""One master round trip per batch, whatever the number of keys (counted by the master itself)."""

from __future__ import annotations

import os


def _counts(client) -> dict[str, int]:
    return dict(client.cluster_status().rpc_requests)


# Calls segment servers make on their own, and the Status calls this test makes to count.
_NOT_CLIENT_DATA_CALLS = {"Status", "Heartbeat", "MountSegment", "UnmountSegment", "PollCommits", "ReportDramObjects"}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    names = (set(after) | set(before)) - _NOT_CLIENT_DATA_CALLS
    return {name: after.get(name, 0) - before.get(name, 0) for name in names}


def test_batch_put_and_batch_get_make_one_master_call_each(cluster, transport):
    client = cluster.client(transport=transport)
    client.exists("warm-up")  # the first call also says Hello to find the fast path
    # Each segment's commit feed says Hello too, just after its mount: let them, or one lands in the count.
    segments = len(client.cluster_status().segments)
    cluster.wait_for(lambda: _counts(client).get("Hello", 0) >= 1 + segments, timeout=10, interval=0.05)
    keys = [f"rt/{i}" for i in range(256)]
    values = [os.urandom(1000 + i) for i in range(256)]

    before = _counts(client)
    assert not any(client.batch_put(keys, values))
    after = _counts(client)
    assert {k: v for k, v in _delta(before, after).items() if v} == {"PutStart": 1, "PutEnd": 1}

    before = after
    assert client.batch_get(keys) == values
    after = _counts(client)
    assert {k: v for k, v in _delta(before, after).items() if v} == {"GetReplicas": 1}

    before = after
    buffers = [bytearray(2000) for _ in keys]
    assert client.batch_get_into(keys, buffers) == [len(v) for v in values]
    assert client.longest_prefix(keys) == 256
    after = _counts(client)
    # 282 KiB in all: more than a direct read takes (docs/architecture.md, "Direct reads"), looked up.
    assert {k: v for k, v in _delta(before, after).items() if v} == {"GetReplicas": 1, "Exists": 1}
