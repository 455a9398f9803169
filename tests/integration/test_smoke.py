"""The shortest end-to-end path: put from this process, get it back, through real servers."""

import os

from kvtier.client import Status


def test_put_then_get_returns_the_same_bytes(cluster):
    client = cluster.client()
    value = os.urandom(100_000)
    client.put("smoke", value)
    assert client.get("smoke") == value
    assert client.batch_put(["smoke"], [b"other"]) == [Status.OK]  # idempotent: existing key is not rewritten
    assert client.get("smoke") == value
