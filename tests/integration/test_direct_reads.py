"""Direct reads (docs/architecture.md, "Direct reads"): a client reads a small DRAM object it looked
up before from its segment alone, and never gets an old version for it: not after an overwrite or a
removal by another client, not from a segment the master dropped (stopped, drained) and not from
one that lost its master."""

from __future__ import annotations

import secrets
import signal
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status

KiB = 1 << 10


def _direct(segment, outcome: str) -> float:
    """kvtier_segment_direct_reads_total{outcome} of a segment started with --metrics."""
    with urllib.request.urlopen(f"http://{segment.info['metrics']}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvtier_segment_direct_reads_total" and sample.labels["outcome"] == outcome:
                return sample.value
    raise AssertionError("kvtier_segment_direct_reads_total missing")


def test_a_repeated_get_is_served_by_the_segment_alone_also_with_a_cluster_secret(bare_cluster, tmp_path):
    bare_cluster.use_secret(tmp_path / "secret")
    bare_cluster.start_master()
    segment = bare_cluster.start_segment("seg0", "32MiB", "--metrics", "127.0.0.1:0")
    writer, reader = bare_cluster.client(transport="tcp"), bare_cluster.client(transport="tcp")
    values = {f"d/{i}": secrets.token_bytes(4 * KiB + i) for i in range(8)}
    assert not any(writer.batch_put(list(values), list(values.values())))
    assert reader.batch_get(list(values)) == list(values.values())  # the lookup: locations remembered
    assert reader.stats().get("direct_reads", 0) == 0

    assert reader.batch_get(list(values)) == list(values.values())
    assert reader.get("d/3", with_source=True) == (values["d/3"], "dram/tcp")
    buffer = bytearray(8 * KiB)
    assert reader.get_into("d/5", buffer) == len(values["d/5"]) and bytes(buffer[: len(values["d/5"])]) == values["d/5"]
    buffers = [bytearray(5 * KiB) for _ in values]  # 32 KiB in all: statuses and bytes in one scatter receive
    assert reader.batch_get_into(list(values), buffers) == [len(v) for v in values.values()]
    assert [bytes(b[: len(v)]) for b, v in zip(buffers, values.values(), strict=True)] == list(values.values())
    assert reader.stats()["direct_reads"] == 18
    assert _direct(segment, "served") == 18
    # Without a grant of its own (a forged or missing tag), nothing is served.
    assert _direct(segment, "no_lease") == 0


def test_every_overwrite_and_removal_by_another_client_is_seen_at_once(cluster):
    writer, reader = cluster.client(transport="tcp"), cluster.client(transport="tcp")
    key = "hot"
    for version in range(30):
        value = version.to_bytes(4, "little") * KiB  # 4 KiB, different per version
        writer.upsert(key, value)
        # Acknowledged: the reader's remembered copy (the version before) must not answer any more.
        assert reader.get(key) == value
        assert reader.get(key) == value  # and now from the segment alone
    stats = reader.stats()
    assert stats["direct_reads"] >= 29 and stats["direct_read_misses"] >= 29
    assert writer.remove(key)
    assert reader.get(key) is None


def test_a_segment_the_master_dropped_serves_no_direct_read_when_it_returns(cluster):
    writer, reader = cluster.client(transport="tcp"), cluster.client(transport="tcp", timeout=3.0)
    old, new = b"o" * 4 * KiB, b"n" * 4 * KiB
    writer.put("k", old, preferred_segment="seg0")
    assert reader.get("k") == old and reader.get("k") == old  # remembered on seg0, then read from it alone
    seg0 = cluster.segments["seg0"]
    seg0.popen.send_signal(signal.SIGSTOP)
    try:
        assert cluster.wait_for(lambda: [s.name for s in writer.cluster_status().segments] == ["seg1"], timeout=15)
        writer.put("k", new)  # gone with seg0: a new object, on seg1
    finally:
        seg0.popen.send_signal(signal.SIGCONT)
    # seg0 still has k in its index and believes itself mounted until its next heartbeat is refused;
    # its direct-read lease ran out while it was stopped: it must not serve the old copy.
    assert reader.get("k") == new


def test_objects_dropped_with_a_drained_segment_are_not_read_from_it(bare_cluster):
    cluster = bare_cluster
    cluster.heartbeat_interval_s = 1.0  # seg0 may go on believing itself mounted for up to a second
    cluster.start_master()
    cluster.start_segment("seg0")
    cluster.start_segment("seg1")
    writer, reader = cluster.client(transport="tcp"), cluster.client(transport="tcp")
    keys = [f"dr/{i}" for i in range(4)]
    olds = [bytes([i]) * 4 * KiB for i in range(4)]
    news = [bytes([100 + i]) * 4 * KiB for i in range(4)]
    assert not any(writer.batch_put(keys, olds, preferred_segment="seg0"))
    assert reader.batch_get(keys) == olds
    # Unmounted at once, objects not moved: dropped. seg0 learns it at its next heartbeat only.
    reply = writer._master.call("DrainSegment", pb.DrainSegmentRequest(segment="seg0", finish=True))
    assert reply.state == "DRAINED"
    assert not any(writer.batch_put(keys, news))  # answered only once seg0's direct-read lease ran out
    assert reader.batch_get(keys) == news


def test_a_segment_cut_from_its_master_stops_serving_direct_reads(bare_cluster):
    bare_cluster.heartbeat_interval_s = 1.0  # a 2 s lease: time for the reads right after the stop
    bare_cluster.start_master()
    segment = bare_cluster.start_segment("seg0", "32MiB", "--metrics", "127.0.0.1:0")
    client = bare_cluster.client(transport="tcp", timeout=1.0)
    client.put("k", b"v" * 4 * KiB)
    assert client.get("k") == b"v" * 4 * KiB
    bare_cluster.master.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2.5)  # past the lease (2 heartbeat intervals) from the last heartbeat acknowledged
        served = _direct(segment, "served")
        assert client.get("k") is None  # the segment refuses; the master does not answer: a miss
        assert _direct(segment, "no_lease") == 1 and _direct(segment, "served") == served
    finally:
        bare_cluster.master.popen.send_signal(signal.SIGCONT)
    assert bare_cluster.wait_for(lambda: client.get("k") == b"v" * 4 * KiB, timeout=10)


def test_no_direct_reads_when_the_master_or_the_client_turns_them_off(bare_cluster):
    bare_cluster.start_master("--direct-reads", "false")
    segment = bare_cluster.start_segment("seg0", "32MiB", "--metrics", "127.0.0.1:0")
    client = bare_cluster.client(transport="tcp")
    client.put("k", b"v" * 4 * KiB)
    for _ in range(3):
        assert client.get("k") == b"v" * 4 * KiB
    assert client.stats().get("direct_reads", 0) == 0 and _direct(segment, "served") == 0
    off = bare_cluster.client(transport="tcp", location_cache_keys=0)
    assert off.get("k") == b"v" * 4 * KiB


def test_a_call_with_a_key_not_remembered_looks_every_key_up_once(cluster):
    client = cluster.client(transport="tcp")
    keys = [f"p/{i}" for i in range(4)]
    values = [bytes([i]) * 4 * KiB for i in range(4)]
    assert not any(client.batch_put(keys, values))
    assert client.batch_get(keys[:3]) == values[:3]  # three remembered
    stats = client.stats()
    assert client.batch_get(keys) == values  # the fourth is not: one lookup for all four
    after = client.stats()
    assert after.get("direct_reads", 0) == stats.get("direct_reads", 0)
    assert client.batch_get(keys) == values  # now all four are: one direct read each
    assert client.stats()["direct_reads"] == after.get("direct_reads", 0) + 4


def test_a_single_get_counts_and_answers_what_a_one_key_batch_get_does(cluster):
    """`get` and `get_into` take a one-key path of their own (Reads._get_one): each outcome (served,
    a stale location, a removed key, a buffer too small) must answer and count as the batch path."""
    writer = cluster.client(transport="tcp")
    single, batch = cluster.client(transport="tcp"), cluster.client(transport="tcp")

    def both(read_single, read_batch):
        before = (single.stats(), batch.stats())
        answers = (read_single(), read_batch())
        after = (single.stats(), batch.stats())
        deltas = [
            {k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)} for a, b in zip(after, before, strict=True)
        ]
        return answers, deltas

    value = secrets.token_bytes(4 * KiB)
    writer.put("k", value)
    (one, many), (counted_one, counted_many) = both(lambda: single.get("k"), lambda: batch.batch_get(["k"])[0])
    assert one == many == value and counted_one == counted_many and "direct_reads" not in counted_one  # looked up

    (one, many), (counted_one, counted_many) = both(lambda: single.get("k"), lambda: batch.batch_get(["k"])[0])
    assert one == many == value and counted_one == counted_many and counted_one["direct_reads"] == 1

    newer = secrets.token_bytes(4 * KiB)
    writer.upsert("k", newer)  # both remember the old copy's place: the segment refuses it, one lookup
    (one, many), (counted_one, counted_many) = both(
        lambda: single.get("k", with_source=True), lambda: batch.batch_get(["k"], with_source=True)[0]
    )
    assert one == many == (newer, "dram/tcp") and counted_one == counted_many
    assert counted_one["direct_read_misses"] == 1 and "direct_reads" not in counted_one

    small = bytearray(KiB)  # remembered, but too small a buffer: the lookup says so
    (one, many), (counted_one, counted_many) = both(
        lambda: single.get_into("k", small), lambda: batch.batch_get_into(["k"], [small])[0]
    )
    assert one == many == Status.BUFFER_TOO_SMALL
    assert counted_one == counted_many

    buffer = bytearray(8 * KiB)
    (one, many), (counted_one, counted_many) = both(
        lambda: single.get_into("k", buffer), lambda: batch.batch_get_into(["k"], [buffer])[0]
    )
    assert one == many == len(newer) and bytes(buffer[: len(newer)]) == newer and counted_one == counted_many
    assert counted_one["direct_reads"] == 1

    assert writer.remove("k")
    (one, many), (counted_one, counted_many) = both(lambda: single.get("k"), lambda: batch.batch_get(["k"])[0])
    assert one is None and many is None and counted_one == counted_many and counted_one["misses"] == 1


def test_one_object_larger_than_a_direct_read_is_read_and_checksummed_whole(cluster):
    """`TcpConnector.read_keyed_one` of an object over its one-receive size (a get never sends one:
    DIRECT_READ_MAX_BYTES is smaller; found by review) goes the general way: bytes with their CRC,
    and into a longer buffer only the object's size (the rest was waited for until the timeout)."""
    client = cluster.client(transport="tcp", timeout=2.0)
    size = 600 * KiB
    value = secrets.token_bytes(size)
    client.put("big", value)
    reply = client._master.call("GetReplicas", pb.KeysRequest(namespace=client.namespace, keys=["big"]))
    segment = next(s for s in reply.segments if s.segment_id == reply.replica_segments[0])
    tag = reply.replica_tags[:16] if reply.replica_tags else b""
    offset, name = reply.replica_offsets[0], b"default\0big"
    connector = client._connector(segment)
    assert connector.read_keyed_one(offset, size, name, None, reply.tag_expiry_ms, tag) == (value, reply.checksums[0])
    longer = bytearray(2 * size)
    started = time.monotonic()
    result = connector.read_keyed_one(offset, size, name, memoryview(longer), reply.tag_expiry_ms, tag)
    assert result == (0, reply.checksums[0]) and bytes(longer[:size]) == value
    assert time.monotonic() - started < 1.5  # not the socket's timeout
