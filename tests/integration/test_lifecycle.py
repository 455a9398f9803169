"""Case 14: segment server region files across clean stops, crashes and name clashes."""

from __future__ import annotations

import os
import signal

import pytest

from kvtier.segment_server.region import read_header


def test_sigterm_unmounts_and_removes_the_region_file(cluster):
    client = cluster.client()
    for i in range(8):
        client.put(f"k/{i}", b"v%d" % i)
    on_seg0 = [k for k in (f"k/{i}" for i in range(8)) if client.locate(k)[0]["segment"] == "seg0"]
    assert on_seg0
    region = cluster.region_file("seg0")
    assert region.exists()

    cluster.kill(cluster.segments["seg0"], signal.SIGTERM)

    assert cluster.segments["seg0"].popen.returncode == 0
    assert not region.exists(), "a clean stop must remove the region file"
    assert cluster.region_file("seg1").exists()
    # It unmounted on the way out: the master forgot it at once, not after the TTL.
    assert [s.name for s in client.cluster_status().segments] == ["seg1"]
    assert not any(client.batch_exists(on_seg0))


def test_a_region_file_left_by_a_killed_segment_is_replaced_when_the_name_starts_again(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("a")
    client, tcp = cluster.client(), cluster.client(transport="tcp")
    client.put("before", b"old")
    assert tcp.get("before") == b"old"  # both clients now hold connections to the old process
    region = cluster.region_file("a")
    old_header, old_inode = read_header(str(region)), region.stat().st_ino

    cluster.kill(cluster.segments["a"])
    assert region.exists(), "SIGKILL leaves the region file behind"

    cluster.start_segment("a")
    assert cluster.region_file("a") == region
    new_header = read_header(str(region))
    assert new_header is not None and new_header["segment_name"] == "a"
    assert new_header["nonce"] != old_header["nonce"] and region.stat().st_ino != old_inode, (
        "the stale file must have been removed and a new region created"
    )
    assert [f for f in cluster.leftover_region_files() if f.endswith(".region")] == [str(region)]

    # The new segment replaced the old one under its name; the old objects are gone, new ones work.
    status = client.cluster_status()
    assert [s.name for s in status.segments] == ["a"] and status.objects == 0
    # A client's connection to the old process is not reused for the new one.
    for name, c in {"default": client, "tcp": tcp}.items():
        assert c.get("before") is None
        c.put(f"after/{name}", name.encode())
    for c in (client, tcp):
        assert c.batch_get(["after/default", "after/tcp"]) == [b"default", b"tcp"]


def test_a_segment_name_held_by_a_live_process_is_refused(cluster):
    client = cluster.client()
    client.put("k", b"v", replicas=2)
    region = cluster.region_file("seg0")
    inode, nonce = region.stat().st_ino, read_header(str(region))["nonce"]
    first = cluster.segments["seg0"]

    with pytest.raises(RuntimeError, match="held by a live process"):
        cluster.start_segment("seg0")

    # The live owner is untouched: same process, same file, still mounted and serving.
    assert cluster.segments["seg0"] is first and first.alive
    assert region.stat().st_ino == inode and read_header(str(region))["nonce"] == nonce
    assert sorted(s.name for s in client.cluster_status().segments) == ["seg0", "seg1"]
    assert {r["segment"] for r in client.locate("k")} == {"seg0", "seg1"}
    tcp = cluster.client(transport="tcp")
    assert tcp.get("k") == b"v"
    assert os.path.exists(region)


def test_pruning_idle_connectors_never_mixes_up_segments(cluster):
    """Regression: the idle-prune loop reused the variable holding the segment being looked up,
    so after a prune a connector was filed under another segment's name (reads missed)."""
    client = cluster.client()
    keys = [f"prune/{i}" for i in range(64)]
    values = [b"%d" % i for i in range(64)]
    assert not any(client.batch_put(keys, values, replicas=1))
    assert {r["segment"] for k in keys for r in client.locate(k)} == {"seg0", "seg1"}
    for _ in range(3):
        with client._lock:
            client._next_prune = 0.0  # prune on the next lookup...
            for name, (endpoints, connector, _) in list(client._connectors.items()):
                client._connectors[name] = (endpoints, connector, -1e9)  # ...and every connector is idle
        assert client.batch_get(keys) == values
    assert sorted(client._connectors) == ["seg0", "seg1"]
