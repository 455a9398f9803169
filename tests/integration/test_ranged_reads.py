"""Verified ranged reads (issue 21), with real master and segment processes.

`get_ranges` / `get_into_ranges` read only the chunks (kvtier.proto.chunks, 64 KiB) that cover
the ranges from a DRAM copy, check each against the CRC its put recorded, and return the slices;
objects without chunk CRCs and SSD copies are read whole and checked whole. A damaged chunk the
call reads makes it a miss (CHECKSUM_MISMATCH) and the copy is reported; a range whose chunks
avoid the damage is served (those chunks verify).
"""

from __future__ import annotations

import random
from pathlib import Path

import crc32c
import pytest

from kvtier.client import Client, KvtierError, Status
from kvtier.proto import master_pb2 as pb
from kvtier.proto.chunks import CHUNK_BYTES
from tests.integration.test_damaged_copies import corrupt_total, metered, scribble  # noqa: F401 - fixture
from tests.integration.test_metrics import scrape
from tests.integration.test_metrics import value as metric
from tests.integration.test_security import secure  # noqa: F401 - the fixture

KiB, MiB = 1 << 10, 1 << 20
SIZE = MiB + 123  # 17 chunks, the last one short
RANGES = [(0, 10), (5 * CHUNK_BYTES - 3, 7), (SIZE - 100, 100), (3 * CHUNK_BYTES + 1, 0)]


def data(size: int = SIZE, seed: int = 21) -> bytes:
    return random.Random(seed).randbytes(size)


def expected(value: bytes, ranges=RANGES) -> list[bytes]:
    return [value[o : o + n] for o, n in ranges]


def chunks_of(ranges) -> int:
    """How many chunks cover `ranges` (what a ranged read moves, in chunks)."""
    return len({c for o, n in ranges if n for c in range(o // CHUNK_BYTES, (o + n - 1) // CHUNK_BYTES + 1)})


def covered_bytes(ranges, size: int = SIZE) -> int:
    chunks = {c for o, n in ranges if n for c in range(o // CHUNK_BYTES, (o + n - 1) // CHUNK_BYTES + 1)}
    return sum(min(size, (c + 1) * CHUNK_BYTES) - c * CHUNK_BYTES for c in chunks)


def test_ranged_reads_return_the_slices_and_move_only_their_chunks(cluster, transport):
    value = data()
    client = cluster.client(transport=transport)
    client.put("big", value)
    before = client.stats()
    assert client.get_ranges("big", RANGES) == expected(value)
    after = client.stats()
    moved = after["bytes_read"] - before.get("bytes_read", 0)
    assert moved == covered_bytes(RANGES) == 3 * CHUNK_BYTES + (SIZE - 16 * CHUNK_BYTES)
    assert moved < SIZE / 4
    assert after["ranged_bytes_verified"] == moved
    assert after[f"served_bytes_dram_{transport}"] == moved and after[f"served_dram_{transport}"] == 1
    assert after["ranged_bytes_returned"] == sum(n for _, n in RANGES)

    # get_into_ranges: into the caller's buffers, the bytes written in all
    buffers = [bytearray(n + 5) for _, n in RANGES]
    assert client.get_into_ranges("big", RANGES, buffers) == sum(n for _, n in RANGES)
    assert [bytes(b[:n]) for b, (_, n) in zip(buffers, RANGES, strict=True)] == expected(value)
    # a range spanning many chunks, and the whole object as one range
    assert client.get_ranges("big", [(CHUNK_BYTES - 1, 4 * CHUNK_BYTES + 2)]) == [
        value[CHUNK_BYTES - 1 : 5 * CHUNK_BYTES + 1]
    ]
    assert client.get_ranges("big", [(0, SIZE)]) == [value]


def test_segment_serves_only_the_windows(metered):  # noqa: F811
    """The segment's own count of DRAM bytes served over TCP is the chunks', not the object's."""
    seg = metered.start_segment("seg2", "64MiB", "--metrics", "127.0.0.1:0")
    client = metered.client(transport="tcp")
    value = data()
    client.put("big", value, preferred_segment="seg2")
    s0 = scrape(seg.info["metrics"])
    assert client.get_ranges("big", RANGES) == expected(value)
    s1 = scrape(seg.info["metrics"])
    labels = {"segment": "seg2", "tier": "dram", "transport": "tcp"}
    served = metric(s1, "kvtier_segment_served_bytes_total", **labels)
    assert served - metric(s0, "kvtier_segment_served_bytes_total", **labels) == covered_bytes(RANGES)


def test_small_objects_are_read_whole_and_checked_whole(cluster, transport):
    client = cluster.client(transport=transport)
    small = data(CHUNK_BYTES)  # one chunk: no chunk CRCs are recorded
    client.put("small", small)
    assert client.get_ranges("small", [(1, 3), (CHUNK_BYTES - 2, 2)]) == [small[1:4], small[-2:]]
    assert client.stats()["ranged_bytes_read"] == CHUNK_BYTES
    client.put("empty", b"")
    assert client.get_ranges("empty", [(0, 0)]) == [b""]


def raw_put(client: Client, key: str, value: bytes, chunks: list[bytes] | None = None) -> pb.KeyStatusResponse:
    """A put on the wire as a client from before chunk CRCs makes it (none), or with `chunks` as given."""
    master = client._master
    start = master.call("PutStart", pb.PutStartRequest(namespace="default", keys=[key], sizes=[len(value)], replicas=1))
    assert start.statuses == [0]
    connector = client._connector(start.segments[0])
    caps = (start.tag_expiry_ms, [start.replica_tags[:16]] if start.replica_tags else [], start.segments[0].session)
    assert connector.write([(start.replica_offsets[0], memoryview(value))], caps=caps) == [0]
    request = pb.PutEndRequest(
        namespace="default", keys=[key], checksums=[crc32c.crc32c(value)], put_id=start.put_id, chunk_checksums=chunks
    )
    return master.call("PutEnd", request)


@pytest.mark.parametrize("chunks", [None, [b"\0" * 8]], ids=["none", "wrong-count"])
def test_objects_without_fitting_chunk_crcs_are_read_whole(cluster, chunks):
    """An object whose put recorded no chunk CRCs (a client from before them), or a blob that does
    not fit its object (not kept): the whole object is read, verified against its whole checksum,
    then sliced."""
    client = cluster.client()
    value = data(3 * CHUNK_BYTES + 9)
    assert raw_put(client, "old", value, chunks).statuses == [0]
    assert client.get_ranges("old", [(CHUNK_BYTES, 5)]) == [value[CHUNK_BYTES : CHUNK_BYTES + 5]]
    assert client.stats()["ranged_bytes_read"] == len(value)


def test_put_end_refuses_chunk_crcs_that_are_not_whole_crcs(cluster):
    client = cluster.client()
    with pytest.raises(KvtierError) as caught:
        raw_put(client, "k", data(3 * CHUNK_BYTES), [b"\0" * 7])
    assert caught.value.status == Status.INVALID_ARGUMENT and "chunk_checksums" in caught.value.message
    assert client.get("k") is None  # nothing became visible (pending until reclaimed)
    client.put("other", b"v")  # and the master keeps serving
    assert client.get("other") == b"v"


def test_a_damaged_chunk_is_a_miss_and_reported_a_range_avoiding_it_is_served(metered):  # noqa: F811
    client = metered.client(transport="shm")
    value = data()
    client.put("big", value)
    (replica,) = client.locate("big")
    scribble(metered, client, replica, position=7 * CHUNK_BYTES + 100)  # damage chunk 7 only
    clean = [(0, 10), (9 * CHUNK_BYTES, 50)]
    # chunks 0 and 9 verify: served (the damaged chunk was not read, nothing unverified is returned)
    assert client.get_ranges("big", clean) == expected(value, clean)
    assert client.stats().get("checksum_mismatches", 0) == 0
    # a range touching chunk 7: a miss, counted and reported; the master drops the copy
    assert client.get_into_ranges("big", [(7 * CHUNK_BYTES + 90, 20)], [bytearray(20)]) == Status.CHECKSUM_MISMATCH
    assert client.stats()["checksum_mismatches"] == 1
    assert metered.wait_for(lambda: corrupt_total(metered) == 1)
    assert client.locate("big") == []
    assert client.get_ranges("big", clean) is None  # the copy is gone: a miss
    client.put("big", value)  # and a fresh put writes it anew
    assert client.get_ranges("big", [(7 * CHUNK_BYTES + 90, 20)]) == [value[7 * CHUNK_BYTES + 90 :][:20]]


def test_a_second_replica_serves_when_the_first_is_damaged(cluster):
    client = cluster.client(transport="shm")
    value = data()
    client.put("two", value, replicas=2)
    first, _ = client.locate("two")  # read first: the master's order, both on this host
    scribble(cluster, client, first, position=2 * CHUNK_BYTES)
    assert client.get_ranges("two", [(2 * CHUNK_BYTES, 8)]) == [value[2 * CHUNK_BYTES : 2 * CHUNK_BYTES + 8]]
    assert client.stats()["checksum_mismatches"] == 1


def test_bad_ranges_get_a_clear_error(cluster, transport):
    client = cluster.client(transport=transport)
    value = data(2 * CHUNK_BYTES)
    client.put("k", value)
    with pytest.raises(KvtierError) as caught:
        client.get_ranges("k", [(0, 1), (2 * CHUNK_BYTES - 1, 2)])
    assert caught.value.status == Status.INVALID_ARGUMENT and "ends past" in caught.value.message
    assert client.get_into_ranges("k", [(2 * CHUNK_BYTES, 1)], [bytearray(1)]) == Status.INVALID_ARGUMENT
    assert client.get_into_ranges("k", [(0, 8)], [bytearray(4)]) == Status.BUFFER_TOO_SMALL
    with pytest.raises(ValueError):
        client.get_ranges("k", [(-1, 4)])
    with pytest.raises(ValueError):
        client.get_into_ranges("k", [(0, 4)], [])
    assert client.get_ranges("absent", [(0, 1)]) is None
    assert client.get_into_ranges("absent", [(0, 1)], [bytearray(1)]) == Status.NOT_FOUND
    assert client.get_ranges("k", [(5, 3)]) == [value[5:8]]  # and the client and cluster keep serving
    # lengths no object can have are refused as ending past it, before anything is allocated for them
    for huge in [(1, 2**64 - 1), (0, 2**63), (0, 1 << 50)]:
        with pytest.raises(KvtierError) as caught:
            client.get_ranges("k", [(0, 1), huge])
        assert caught.value.status == Status.INVALID_ARGUMENT and "ends past" in caught.value.message
    assert client.get_ranges("k", [(0, 0), (3, 0)]) == [b"", b""]


def test_ranged_reads_under_capabilities(secure):  # noqa: F811
    """With a cluster secret, a windowed READ carries the object's own tag: the segment checks the
    grant and serves the windows; a window outside its grant is refused."""
    client = secure.client(transport="tcp")
    value = data()
    client.put("big", value)
    assert client.get_ranges("big", RANGES) == expected(value)
    assert client.stats()["ranged_bytes_read"] == covered_bytes(RANGES)

    (replica,) = client.locate("big")
    reply = client._master.call("GetReplicas", pb.KeysRequest(namespace="default", keys=["big"]))
    connector = client._connector(reply.segments[0])
    caps = (reply.tag_expiry_ms, [reply.replica_tags[:16]], reply.segments[0].session)
    grant = (replica["offset"], SIZE)
    inside, outside = bytearray(8), bytearray(8)
    assert connector.read_windows(grant, [(SIZE - 8, memoryview(inside))], caps) == [0]
    assert bytes(inside) == value[-8:]
    refused = connector.read_windows(grant, [(SIZE - 7, memoryview(outside))], caps)
    assert refused == [Status.INVALID_RANGE]
    wrong_grant = (replica["offset"], SIZE + 8)  # a grant the tag was not minted for
    assert connector.read_windows(wrong_grant, [(SIZE, memoryview(outside))], caps) == [Status.CAPABILITY_DENIED]
    assert client.get_ranges("big", [(1, 1)]) == [value[1:2]]


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


def test_ranged_read_of_an_ssd_copy_is_read_whole_and_verified(bare_cluster, ssd_dir):
    """An object whose only copy is on the SSD tier: the segment reads and checks the record, the
    client checks the whole checksum, then slices."""
    cluster = bare_cluster
    cluster.start_master("--offload-watermark", "0.01", "--promote-after-reads", "0")
    cluster.start_segment("s0", "8MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "256MiB", "--ssd-bucket-size", "4MiB")
    client = cluster.client()
    value = data()
    client.put("cold", value)

    def tiers() -> set[str]:  # stat reads nothing: the object stays least recently used
        info = client.stat("cold")
        return {r.tier for r in info.replicas} if info is not None else set()

    assert cluster.wait_for(lambda: "ssd" in tiers(), timeout=20), tiers()
    for i in range(16):  # push it out of DRAM: its offloaded copy stays on disk
        if tiers() == {"ssd"}:
            break
        client.batch_put([f"fill/{i}/{j}" for j in range(4)], [data(MiB, seed=j) for j in range(4)])
    assert tiers() == {"ssd"}
    assert client.get_ranges("cold", RANGES) == expected(value)
    stats = client.stats()
    assert stats["ranged_bytes_read"] == SIZE and stats["bytes_read_ssd"] >= SIZE
    assert stats["served_ssd_tcp"] == 1 and stats["served_bytes_ssd_tcp"] == SIZE


def test_client_stats_reach_clients_that_share_nothing(cluster):
    """A ranged read on a fresh client: stats count only that call's bytes."""
    with Client(cluster.master_address) as writer:
        writer.put("big", data())
    with Client(cluster.master_address, transport="tcp") as reader:
        assert reader.get_ranges("big", [(0, 1)]) == [data()[:1]]
        assert reader.stats()["bytes_read"] == CHUNK_BYTES


def test_after_a_master_restart_ranged_reads_read_whole_until_the_object_is_put_again(bare_cluster, tmp_path):
    """Chunk CRCs live in master memory only: a master rebuilt from the segments' inventories has
    none for the objects put before, whose ranged reads then read whole (and stay verified)."""
    state_dir = str(tmp_path / "master-state")
    bare_cluster.start_master("--state-dir", state_dir)
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    value = data()
    client.put("big", value)
    assert client.get_ranges("big", [(0, 4)]) == [value[:4]]
    assert client.stats()["ranged_bytes_read"] == CHUNK_BYTES

    bare_cluster.restart_master("--state-dir", state_dir)

    assert client.get_ranges("big", [(0, 4)]) == [value[:4]]  # the same client retries while it recovers
    assert client.stats()["ranged_bytes_read"] == CHUNK_BYTES + SIZE  # read whole: no chunk CRCs
    assert client.remove("big")
    client.put("big", value)
    assert client.get_ranges("big", [(0, 4)]) == [value[:4]]
    assert client.stats()["ranged_bytes_read"] == 2 * CHUNK_BYTES + SIZE
