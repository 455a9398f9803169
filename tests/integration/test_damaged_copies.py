"""Damaged copies and damaged mappings (issue 15, observations 7 and 8), with real processes.

7: bytes of a stored copy overwritten by a process granted the region. The reader's checksum
   catches them (a miss), the reader reports the copy (ReportCorrupt) and the master drops it:
   the key is no longer listed and a fresh put writes it anew.
8: a process granted the region tries to resize it. The region is a sealed memfd: shrinking and
   growing are refused, and the other processes mapping it keep reading.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import textwrap
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from kvtier.client import Client, KvtierError
from kvtier.client.transport.shm import ShmConnector, request_region
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.integration.test_metrics import scrape, value
from tests.integration.test_security import secure  # noqa: F401 - the fixture

KiB = 1024


def shm_endpoint(cluster, segment: str) -> str:
    (endpoint,) = [e for e in cluster.segments[segment].info["endpoints"] if e.startswith("shm://")]
    return endpoint


def scribble(cluster, client, replica: dict, position: int = 0, length: int = 16) -> None:
    """Overwrite bytes of a stored DRAM replica the way a granted process can: through its own mapping."""
    connector = ShmConnector(shm_endpoint(cluster, replica["segment"]), client.config)
    try:
        offset = replica["offset"] + position
        (old,) = connector.read([(offset, length)])
        assert connector.write([(offset, bytes(b ^ 0xFF for b in old))]) == [0]
    finally:
        connector.close()


def corrupt_total(cluster, tier: str = "dram") -> float:
    return value(scrape(cluster.master.info["metrics"]), "kvtier_master_corrupt_replicas_total", tier=tier)


@pytest.fixture
def metered(bare_cluster):
    """A master with metrics and two 64 MiB segments."""
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    return bare_cluster


# ------------------------------------------------------------------ observation 7


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_damaged_only_copy_is_dropped_and_the_next_put_writes_it_anew(metered, transport):
    cluster = metered
    client = cluster.client(transport=transport)
    value_ = os.urandom(40 * KiB)
    client.put("k", value_)
    (replica,) = client.locate("k")
    scribble(cluster, client, replica, position=1000)
    before = corrupt_total(cluster)

    assert client.get("k") is None, "damaged bytes are a miss"
    assert client.stats()["checksum_mismatches"] == 1
    assert client.stats()["corrupt_dropped"] == 1
    assert client.exists("k") is False, "the only copy failed verification: the object is gone"
    assert corrupt_total(cluster) == before + 1
    assert client.get("k") is None and client.stats()["checksum_mismatches"] == 1, "no copy left to mismatch"

    client.put("k", value_)  # no longer "already complete": written anew
    assert client.get("k") == value_
    buf = bytearray(len(value_))
    assert client.get_into("k", buf) == len(value_) and bytes(buf) == value_


def test_batch_get_into_reports_every_damaged_copy_and_keeps_the_good_ones(metered):
    cluster = metered
    client = cluster.client(transport="shm")
    keys = [f"b/{i}" for i in range(6)]
    values = [os.urandom(8 * KiB + i) for i in range(6)]
    assert client.batch_put(keys, values) == [Status.OK] * 6
    damaged = keys[::2]
    for key in damaged:
        (replica,) = client.locate(key)
        scribble(cluster, client, replica, position=7)
    buffers = [bytearray(16 * KiB) for _ in keys]
    results = client.batch_get_into(keys, buffers)
    for key, result, buf, v in zip(keys, results, buffers, values, strict=True):
        if key in damaged:
            assert result == Status.CHECKSUM_MISMATCH
        else:
            assert result == len(v) and bytes(buf[: len(v)]) == v
    assert client.batch_exists(keys) == [key not in damaged for key in keys]
    assert client.stats()["corrupt_dropped"] == len(damaged)


def test_one_damaged_replica_of_two_is_dropped_and_the_object_stays(metered):
    cluster = metered
    client = cluster.client(transport="shm")
    value_ = os.urandom(20 * KiB)
    client.put("two", value_, replicas=2)
    replicas = client.locate("two")
    assert sorted(r["segment"] for r in replicas) == ["seg0", "seg1"]
    bad, good = replicas  # both on this host, in DRAM: a reader tries them in the master's order
    scribble(cluster, client, bad, position=5)
    before = corrupt_total(cluster)

    assert client.get("two") == value_, "the other replica serves the value"
    assert client.stats()["checksum_mismatches"] == 1
    assert client.locate("two") == [good], "only the damaged replica was dropped"
    assert client.exists("two") and client.get("two") == value_
    assert client.stats()["checksum_mismatches"] == 1, "the damaged copy is no longer handed out"
    assert corrupt_total(cluster) == before + 1


def test_a_stale_report_drops_nothing(metered):
    cluster = metered
    client = cluster.client(transport="tcp")
    client.put("s", b"first value " * 100)
    (old,) = client.locate("s")
    report = pb.ReportCorruptRequest(
        namespace="default",
        keys=["s"],
        segment_ids=[old["segment_id"]],
        tiers=[pb.DRAM],
        offsets=[old["offset"]],
        checksums=[old["checksum"]],
    )
    assert client.remove("s")
    client.put("s", b"second value " * 100)  # re-put: another checksum (and maybe the same range)
    before = corrupt_total(cluster)

    assert list(client._master.call("ReportCorrupt", report).statuses) == [Status.NOT_FOUND]
    assert client.get("s") == b"second value " * 100
    assert corrupt_total(cluster) == before
    # A report with the right checksum but another replica location matches nothing either.
    (new,) = client.locate("s")
    report.checksums[0] = new["checksum"]
    report.offsets[0] = new["offset"] + 4096
    assert list(client._master.call("ReportCorrupt", report).statuses) == [Status.NOT_FOUND]
    assert client.get("s") == b"second value " * 100


# ------------------------------------------------------------------ observation 8

OBJECTS = 48

# An engine process: maps both regions (shm), reads every object, says so, waits, then reads them all
# again. Exit 0: every object read back exactly over shm; 3: a wrong or missing value; a signal:
# negative (SIGBUS is -7).
READER = textwrap.dedent(
    """
    import hashlib, sys
    from kvtier.client import Client

    keys = [f"o/{i:02d}" for i in range({objects})]
    values = [hashlib.sha256(k.encode()).digest() * 512 for k in keys]
    with Client(sys.argv[1], transport="shm", timeout=10) as client:
        def all_read():
            return client.batch_get(keys, with_source=True) == [(v, "dram/shm") for v in values]
        if not all_read():
            sys.exit(3)
        print("mapped", flush=True)
        sys.stdin.readline()
        sys.exit(0 if all_read() else 3)
    """
).replace("{objects}", str(OBJECTS))


def object_value(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest() * 512  # 16 KiB


def granted_fd(cluster, segment: str) -> int:
    """The region's fd exactly as the segment grants it to any same-host engine (the caller closes it)."""
    url = urlsplit(shm_endpoint(cluster, segment))
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    return request_region(unquote(url.path), bytes.fromhex(query["nonce"]), int(query["uid"]), 5.0)


def test_a_granted_process_cannot_resize_the_region_and_its_neighbours_keep_reading(cluster):
    client = cluster.client(transport="shm")
    keys = [f"o/{i:02d}" for i in range(OBJECTS)]
    assert client.batch_put(keys, [object_value(k) for k in keys]) == [Status.OK] * OBJECTS
    assert {r["segment"] for k in keys for r in client.locate(k)} == {"seg0", "seg1"}
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, cluster.master_address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline() == "mapped\n", "the reader maps both regions and reads everything"

        for segment in ("seg0", "seg1"):
            fd = granted_fd(cluster, segment)
            try:
                size = os.fstat(fd).st_size
                for new_size in (0, 4096, size // 2, size - 1, size + 1, size + (64 << 20)):
                    with pytest.raises(PermissionError):  # EPERM: the seals forbid shrinking and growing
                        os.ftruncate(fd, new_size)
                with pytest.raises(PermissionError):  # and the seals cannot be changed
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
                assert os.fstat(fd).st_size == size
            finally:
                os.close(fd)

        out, _ = reader.communicate("go\n", timeout=30)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, f"the neighbour reader ended with {reader.returncode}: {out!r}"

    # The segments are untouched: they keep serving puts and reads, over both transports.
    assert all(cluster.segments[s].alive for s in ("seg0", "seg1"))
    more = [f"after/{i}" for i in range(OBJECTS)]
    assert client.batch_put(more, [object_value(k) for k in more]) == [Status.OK] * OBJECTS
    tcp = cluster.client(transport="tcp")
    assert tcp.batch_get(keys + more) == [object_value(k) for k in keys + more]
    assert client.batch_get(keys + more) == [object_value(k) for k in keys + more]


def test_a_tenant_can_report_corrupt_copies_only_in_its_own_namespaces(secure):  # noqa: F811
    """ReportCorrupt goes through the namespace gate like Remove: alice cannot drop bob's objects."""

    master, files = secure.master.info["address"], secure.tenant_secrets
    with (
        Client(master, namespace="bob-llama", principal="bob", secret_file=files["bob"]) as bob,
        Client(master, namespace="bob-llama", principal="alice", secret_file=files["alice"]) as alice_in_bob,
    ):
        bob.put("k", b"bob's bytes" * 100)
        (replica,) = bob.locate("k")
        report = pb.ReportCorruptRequest(
            namespace="bob-llama",
            keys=["k"],
            segment_ids=[replica["segment_id"]],
            tiers=[pb.DRAM],
            offsets=[replica["offset"]],
            checksums=[replica["checksum"]],
        )
        with pytest.raises(KvtierError) as denied:
            alice_in_bob._master.call("ReportCorrupt", report)
        assert denied.value.status == Status.PERMISSION_DENIED
        assert bob.get("k") == b"bob's bytes" * 100, "nothing dropped"
        assert list(bob._master.call("ReportCorrupt", report).statuses) == [Status.OK], "bob may"
        assert not bob.exists("k")
