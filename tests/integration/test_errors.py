"""Cases 6 and 7: unknown keys are misses; invalid keys and namespaces are refused with a clear error."""

from __future__ import annotations

import grpc
import pytest

from kvtier.client import Client, InvalidKeyError, KvtierError, Status
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc

BAD_KEYS = {
    "empty": ("", "must not be empty"),
    "too long (ASCII)": ("k" * 1025, "longer than 1024 bytes"),
    "too long in UTF-8 only": ("é" * 513, "1026 bytes in UTF-8, more than 1024"),
    "bytes": (b"key", "must be str, not bytes"),
    "int": (42, "must be str, not int"),
    "None": (None, "must be str, not NoneType"),
    "NUL": ("a\x00b", "must not contain NUL"),
    "lone surrogate": ("a\ud800", "not valid UTF-8"),
}

# Every key-taking call, given one key (batch calls get it among valid keys).
CALLS = {
    "put": lambda c, k: c.put(k, b"v"),
    "get": lambda c, k: c.get(k),
    "get_into": lambda c, k: c.get_into(k, bytearray(8)),
    "batch_put": lambda c, k: c.batch_put(["ok/1", k, "ok/2"], [b"1", b"v", b"2"]),
    "batch_get": lambda c, k: c.batch_get(["ok/1", k]),
    "batch_get_into": lambda c, k: c.batch_get_into(["ok/1", k], [bytearray(8), bytearray(8)]),
    "exists": lambda c, k: c.exists(k),
    "batch_exists": lambda c, k: c.batch_exists(["ok/1", k]),
    "longest_prefix": lambda c, k: c.longest_prefix(["ok/1", k]),
    "remove": lambda c, k: c.remove(k),
    "batch_remove": lambda c, k: c.batch_remove(["ok/1", k]),
    "locate": lambda c, k: c.locate(k),
}


def test_unknown_key_is_a_miss_on_every_read_call(cluster):
    client = cluster.client()
    client.put("known", b"value")

    assert client.get("unknown") is None
    buf = bytearray(b"untouched")
    assert client.get_into("unknown", buf) == Status.NOT_FOUND
    assert buf == b"untouched"
    assert client.batch_get(["unknown", "known", "also-unknown"]) == [None, b"value", None]
    bufs = [bytearray(5), bytearray(5)]
    assert client.batch_get_into(["known", "unknown"], bufs) == [5, Status.NOT_FOUND]
    assert bufs[0] == b"value"
    assert client.exists("unknown") is False
    assert client.locate("unknown") == []
    assert client.remove("unknown") is False
    assert client.batch_remove(["unknown"]) == [Status.NOT_FOUND]

    stats = client.stats()
    assert (stats["gets"], stats["hits"], stats["misses"]) == (7, 2, 5)


def test_invalid_keys_raise_invalid_key_error_before_anything_is_sent(cluster):
    client = cluster.client()
    failures = []
    for kind, (key, reason) in BAD_KEYS.items():
        for name, call in CALLS.items():
            try:
                call(client, key)
            except InvalidKeyError as exc:
                if not isinstance(exc, ValueError) or exc.status != Status.INVALID_KEY:
                    failures.append(f"{name}({kind}): {exc!r} is not a ValueError with INVALID_KEY")
                elif reason not in str(exc):
                    failures.append(f"{name}({kind}): message {str(exc)!r} does not say {reason!r}")
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                failures.append(f"{name}({kind}): raised {exc!r} instead of InvalidKeyError")
            else:
                failures.append(f"{name}({kind}): accepted")
    assert not failures, "\n".join(failures)

    # Nothing of the refused batches reached the cluster, not even their valid keys.
    assert client.batch_exists(["ok/1", "ok/2"]) == [False, False]
    status = client.cluster_status()
    assert status.objects == 0 and status.pending_puts == 0 and status.used == 0


def test_keys_at_the_limits_are_accepted(cluster):
    client = cluster.client()
    for key in ["k" * 1024, "é" * 512, "€" * 341 + "x", "\U0001f600" * 256, "a/b c\t\n", "x"]:
        client.put(key, key.encode())
        assert client.get(key) == key.encode()
        assert client.exists(key)
        assert client.locate(key)[0]["size"] == len(key.encode())
    assert client.batch_exists(["k" * 1024, "k" * 1023]) == [True, False]


@pytest.mark.parametrize(
    "namespace, reason",
    [
        ("", "must not be empty"),
        ("n" * 257, "longer than 256 bytes"),
        ("é" * 129, "258 bytes in UTF-8, more than 256"),
        ("a\x00b", "must not contain NUL"),
        (7, "must be str, not int"),
    ],
    ids=["empty", "too-long", "too-long-utf8", "NUL", "int"],
)
def test_invalid_namespace_is_refused_at_client_construction(namespace, reason):
    # Validation happens before any connection: no cluster is needed, and none is contacted.
    with pytest.raises(InvalidKeyError, match="namespace") as info:
        Client("127.0.0.1:1", namespace=namespace)
    assert isinstance(info.value, ValueError) and info.value.status == Status.INVALID_KEY
    assert reason in str(info.value)


def test_namespace_at_the_limit_is_accepted(cluster):
    client = cluster.client(namespace="n" * 256)
    client.put("k", b"v")
    assert client.get("k") == b"v"


def test_master_revalidates_keys_and_namespaces_from_raw_requests(cluster):
    """The client check is a convenience: a raw gRPC caller gets INVALID_KEY from the master itself."""
    with grpc.insecure_channel(cluster.master_address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        bad = ["", "a\x00b", "k" * 1025, "é" * 513]
        reply = stub.PutStart(pb.PutStartRequest(namespace="default", keys=[*bad, "good"], sizes=[1] * 5, replicas=1))
        assert reply.status == Status.OK
        assert list(reply.statuses) == [Status.INVALID_KEY] * 4 + [Status.OK]
        assert list(reply.replica_counts) == [0, 0, 0, 0, 1]
        assert stub.PutRevoke(
            pb.PutRevokeRequest(namespace="default", keys=["good"], put_id=reply.put_id)
        ).statuses == [Status.OK]

        reply = stub.GetReplicas(pb.KeysRequest(namespace="default", keys=["", "a\x00b"]))
        assert list(reply.statuses) == [Status.INVALID_KEY] * 2

        for namespace in ["", "n" * 257, "a\x00b"]:
            reply = stub.GetReplicas(pb.KeysRequest(namespace=namespace, keys=["k"]))
            assert reply.status == Status.INVALID_KEY and "namespace" in reply.error

    client = cluster.client()
    # Nothing stored, nothing pending (the revoked range itself stays held until its write grant
    # ends: docs/architecture.md, "Data-plane frames").
    status = client.cluster_status()
    assert status.objects == 0 and status.pending_puts == 0
    with pytest.raises(KvtierError):  # and through the client the error keeps its status
        client.put("", b"v")


def test_the_master_refuses_an_unknown_pin_value(cluster):
    with grpc.insecure_channel(cluster.master_address) as channel:
        reply = master_pb2_grpc.MasterStub(channel).PutStart(
            pb.PutStartRequest(namespace="default", keys=["k"], sizes=[1], replicas=1, pin=7)
        )
    assert reply.status == Status.INVALID_ARGUMENT and "pin" in reply.error
    assert cluster.client().get("k") is None
