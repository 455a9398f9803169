"""Cases 9-11: a segment server killed, a corrupted byte in a region, an abandoned put.

Reads degrade to misses, never to wrong bytes or exceptions; replicas cover for
a lost or corrupted copy; the master reclaims what a dead writer left pending.
"""

from __future__ import annotations

import os
import time

import grpc

from kvtier.client import Status
from kvtier.client.config import ClientConfig
from kvtier.client.transport.shm import ShmConnector
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.frames import Op
from tests.integration import rawframes

KiB = 1 << 10
# The master drops a silent segment after its TTL, checked every tick (0.2 s): allow for scheduling on top.
DROP_SLACK_S = 1.5


def by_segment(client, keys: list[str]) -> dict[str, list[str]]:
    """Segment name -> the keys whose (single) replica lives there."""
    out: dict[str, list[str]] = {}
    for key in keys:
        (replica,) = client.locate(key)
        out.setdefault(replica["segment"], []).append(key)
    return out


def mismatches(client) -> int:
    return client.stats().get("checksum_mismatches", 0)


def flip_byte(cluster, replica: dict, position: int) -> None:
    """Invert one byte of a stored replica as any process granted the region can: through its mapping."""
    segment = cluster.segments[replica["segment"]]
    (endpoint,) = [e for e in segment.info["endpoints"] if e.startswith("shm://")]
    connector = ShmConnector(endpoint, ClientConfig(master=cluster.master_address))
    try:
        (old,) = connector.read([(replica["offset"] + position, 1)])
        assert connector.write([(replica["offset"] + position, bytes([old[0] ^ 0xFF]))]) == [Status.OK]
    finally:
        connector.close()


# ------------------------------------------------------------------ case 9: SIGKILL of a segment server


def test_objects_of_a_killed_segment_become_misses_and_the_other_segment_keeps_serving(cluster):
    tcp, shm = cluster.client(transport="tcp"), cluster.client(transport="shm")
    keys = [f"k/{i:02d}" for i in range(40)]
    values = {k: os.urandom(16 * KiB + i) for i, k in enumerate(keys)}
    assert tcp.batch_put(keys, list(values.values())) == [Status.OK] * len(keys)
    assert shm.batch_get(keys) == list(values.values())  # both clients have their connections open
    placement = by_segment(tcp, keys)
    assert set(placement) == {"seg0", "seg1"}, "placement should spread over both segments"
    lost, kept = placement["seg0"], placement["seg1"]

    cluster.kill(cluster.segments["seg0"])
    killed_at = time.monotonic()

    # At once: over TCP the dead segment's keys are misses (no exception); the other segment serves on.
    assert tcp.batch_get(lost + kept) == [None] * len(lost) + [values[k] for k in kept]
    assert tcp.get(lost[0]) is None
    assert tcp.get_into(lost[0], bytearray(32 * KiB)) < 0, "an unreachable object is a negative Status"
    # Over shm the dead process's region file may still be mapped: a read is a miss or the right bytes.
    for key, got in zip(lost + kept, shm.batch_get(lost + kept), strict=True):
        assert got is None or got == values[key], f"wrong bytes for {key}"

    # Within the TTL the master forgets the segment: its objects are misses for every client.
    ttl = cluster.segment_ttl_s
    assert cluster.wait_for(lambda: not any(tcp.batch_exists(lost)), timeout=ttl + DROP_SLACK_S), (
        f"objects of the killed segment still listed {time.monotonic() - killed_at:.1f}s after SIGKILL (TTL {ttl}s)"
    )
    assert [s.name for s in tcp.cluster_status().segments] == ["seg1"]
    assert tcp.locate(lost[0]) == []
    for client in (tcp, shm):
        assert client.batch_get(lost) == [None] * len(lost)
        assert client.get_into(lost[0], bytearray(32 * KiB)) == Status.NOT_FOUND
        assert client.batch_get(kept) == [values[k] for k in kept]
    assert tcp.batch_exists(kept) == [True] * len(kept)

    # The survivor takes new writes.
    tcp.put("after", b"still writable")
    assert shm.get("after") == b"still writable"
    assert tcp.locate("after")[0]["segment"] == "seg1"


def test_replicated_objects_stay_readable_after_one_segment_dies(cluster):
    tcp, shm = cluster.client(transport="tcp"), cluster.client(transport="shm")
    rep_keys = [f"rep/{i}" for i in range(12)]
    rep_values = [os.urandom(40 * KiB + i) for i in range(12)]
    assert tcp.batch_put(rep_keys, rep_values, replicas=2) == [Status.OK] * 12
    single_keys = [f"single/{i}" for i in range(12)]
    for key in single_keys:
        tcp.put(key, key.encode())
    single = by_segment(tcp, single_keys)
    assert set(single) == {"seg0", "seg1"}
    assert shm.batch_get(rep_keys) == rep_values

    placements = [tcp.locate(k) for k in rep_keys]
    assert all(sorted(r["segment"] for r in p) == ["seg0", "seg1"] for p in placements)
    victim = placements[0][0]["segment"]  # the replica a reader tries first
    survivor = "seg1" if victim == "seg0" else "seg0"
    cluster.kill(cluster.segments[victim])

    # Before the master notices: the TCP read of the dead first replica fails and falls back to the other.
    assert tcp.batch_get(rep_keys) == rep_values
    buf = bytearray(64 * KiB)
    assert tcp.get_into(rep_keys[0], buf) == len(rep_values[0])
    assert buf[: len(rep_values[0])] == rep_values[0]
    assert tcp.batch_get(single[victim]) == [None] * len(single[victim])
    assert tcp.batch_get(single[survivor]) == [k.encode() for k in single[survivor]]
    assert shm.batch_get(rep_keys) == rep_values

    # After the master dropped the segment: one replica left, still readable.
    ttl = cluster.segment_ttl_s
    assert cluster.wait_for(lambda: len(tcp.locate(rep_keys[0])) == 1, timeout=ttl + DROP_SLACK_S)
    assert [r["segment"] for r in tcp.locate(rep_keys[0])] == [survivor]
    for client in (tcp, shm):
        assert client.batch_get(rep_keys) == rep_values
        assert client.longest_prefix(rep_keys) == len(rep_keys)
        assert not any(client.batch_exists(single[victim]))
        assert mismatches(client) == 0


# ------------------------------------------------------------------ case 10: a corrupted byte in a region


def test_a_flipped_byte_is_a_miss_never_wrong_bytes(cluster, transport):
    client = cluster.client(transport=transport)
    values = {f"c/{i}": os.urandom(64 * KiB) for i in range(4)}
    assert client.batch_put(list(values), list(values.values())) == [Status.OK] * 4
    victim = "c/1"
    (replica,) = client.locate(victim)
    assert client.get(victim) == values[victim]
    before = mismatches(client)

    flip_byte(cluster, replica, 1000)

    assert client.get(victim) is None
    assert mismatches(client) == before + 1
    # The reader reported the copy (issue 15 obs 7): the only replica is gone, so the key is a plain miss.
    assert not client.exists(victim)
    buf = bytearray(64 * KiB)
    assert client.get_into(victim, buf) == Status.NOT_FOUND
    others = [k for k in values if k != victim]
    assert client.batch_get(list(values)) == [None if k == victim else values[k] for k in values]
    assert mismatches(client) == before + 1
    assert client.batch_get(others) == [values[k] for k in others], "other keys still hit"

    # The last byte of an object is checked too, and so is a 1-byte object.
    client.put("tiny", b"\x00")
    flip_byte(cluster, client.locate("tiny")[0], 0)
    assert client.get("tiny") is None
    flip_byte(cluster, client.locate("c/3")[0], 64 * KiB - 1)
    assert client.get("c/3") is None
    assert mismatches(client) == before + 3
    assert client.batch_get(["c/0", "c/2"]) == [values["c/0"], values["c/2"]]


def test_a_corrupted_replica_falls_back_to_the_intact_one(cluster, transport):
    client = cluster.client(transport=transport)
    value = os.urandom(100 * KiB)
    client.put("r", value, replicas=2)
    first, second = client.locate("r")
    assert first["segment"] != second["segment"]

    flip_byte(cluster, first, 12_345)  # the copy a reader tries first
    assert client.get("r") == value
    assert mismatches(client) == 1
    assert client.locate("r") == [second], "the reader reported the bad copy: only the intact one is left"
    buf = bytearray(100 * KiB)
    assert client.get_into("r", buf) == len(value) and buf == value
    assert client.batch_get(["r", "r"]) == [value, value]
    assert mismatches(client) == 1

    flip_byte(cluster, second, 7)  # now the last copy is bad too: a miss, and the object goes
    assert client.get("r") is None
    assert mismatches(client) == 2
    assert client.get_into("r", buf) == Status.NOT_FOUND and not client.exists("r")


# ------------------------------------------------------------------ case 11: an abandoned PutStart


def test_an_abandoned_put_is_invisible_and_its_space_is_reclaimed(bare_cluster):
    cluster = bare_cluster
    cluster.start_master("--put-timeout-s", "3")  # long enough for the invisibility checks on a loaded machine
    cluster.start_segment("seg0")
    client = cluster.client()
    size = 1 << 20
    payload = os.urandom(size)

    with grpc.insecure_channel(cluster.master_address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        started = stub.PutStart(pb.PutStartRequest(namespace="default", keys=["abandoned"], sizes=[size], replicas=1))
        assert list(started.statuses) == [Status.OK] and list(started.replica_counts) == [1]
        # The writer even delivers the bytes; only its PutEnd never comes.
        (endpoint,) = [e for e in started.segments[0].endpoints if e.startswith("tcp://")]
        with rawframes.connect(endpoint) as sock:
            rawframes.send_request(
                sock, Op.WRITE, 1, [(started.replica_offsets[0], size)], payload, deadline=started.tag_expiry_ms
            )
            assert rawframes.recv_response(sock) == (Op.WRITE, 1, Status.OK, b"")

        # Pending: invisible to every read and presence call.
        assert client.get("abandoned") is None
        assert client.get_into("abandoned", bytearray(size)) == Status.NOT_FOUND
        assert client.exists("abandoned") is False
        assert client.locate("abandoned") == []
        assert client.remove("abandoned") is False
        status = client.cluster_status()
        assert status.pending_puts == 1, "the put was reclaimed before its invisibility could be checked"
        assert status.segments[0].dram_used == size and status.objects == 0

        # After the put timeout the master reclaims the range.
        assert cluster.wait_for(lambda: client.cluster_status().segments[0].dram_used == 0, timeout=10.0)
        status = client.cluster_status()
        assert status.pending_puts == 0 and status.objects == 0 and status.segments[0].objects == 0

        # A late PutEnd cannot resurrect it.
        ended = stub.PutEnd(
            pb.PutEndRequest(namespace="default", keys=["abandoned"], checksums=[0], put_id=started.put_id)
        )
        assert list(ended.statuses) == [Status.NOT_PENDING]
        assert client.get("abandoned") is None and not client.exists("abandoned")

    # The key is free for a new writer.
    client.put("abandoned", b"fresh")
    assert client.get("abandoned") == b"fresh"
