"""`kvtier-master --history-log`: a real master records objects that leave its tables other than by a
client's remove (what the history checker, tests/chaos/, explains misses with)."""

from __future__ import annotations

import json

import crc32c

from kvtier.client import Status


def events(path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


def test_a_killed_segment_s_objects_are_recorded_a_removed_key_is_not(bare_cluster, tmp_path):
    log = tmp_path / "history.jsonl"
    bare_cluster.start_master("--history-log", str(log))
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    values = {f"k{i}": f"value {i}".encode() * 50 for i in range(6)}
    assert client.batch_put(list(values), list(values.values())) == [Status.OK] * 6
    assert client.remove("k0")
    bare_cluster.kill(bare_cluster.segments["seg0"])
    lost = lambda: [e for e in events(log) if e.get("event") == "object"]  # noqa: E731
    assert bare_cluster.wait_for(lambda: len(lost()) == 5, timeout=bare_cluster.segment_ttl_s + 5)
    assert events(log)[0]["event"] == "start"
    assert {e["key"] for e in lost()} == set(values) - {"k0"}, "a client's remove is no event"
    for e in lost():
        assert e["reason"] == "segment:heartbeat ttl expired" and e["segment"] == "seg0" and e["complete"]
        assert e["checksum"] == crc32c.crc32c(values[e["key"]]) and e["ns"] == "default"
