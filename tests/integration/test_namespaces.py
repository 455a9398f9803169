"""Case 8: clients of different namespaces never see, read or remove each other's objects."""

from __future__ import annotations

from kvtier.client import Status

KEYS = [f"shared/{i}" for i in range(10)]


def test_same_key_names_in_two_namespaces_are_separate_objects(cluster):
    a = cluster.client(namespace="tenant-a")
    b = cluster.client(namespace="tenant-b")
    va = [f"a-{k}".encode() * 50 for k in KEYS]
    vb = [f"b-{k}".encode() * 70 for k in KEYS]

    assert a.batch_put(KEYS, va) == [Status.OK] * len(KEYS)
    # Not an idempotent no-op: b's puts of the same names store b's own values.
    assert b.batch_put(KEYS, vb) == [Status.OK] * len(KEYS)
    assert a.batch_get(KEYS) == va
    assert b.batch_get(KEYS) == vb
    assert a.cluster_status().objects == 2 * len(KEYS)

    a.put("only-a/x", b"secret")
    assert b.get("only-a/x") is None
    assert b.get_into("only-a/x", bytearray(16)) == Status.NOT_FOUND
    assert b.exists("only-a/x") is False
    assert b.batch_exists(["only-a/x", KEYS[0]]) == [False, True]
    assert b.longest_prefix(["only-a/x", KEYS[0]]) == 0
    assert b.locate("only-a/x") == []
    default = cluster.client()  # the default namespace is a namespace like any other
    assert default.get("only-a/x") is None and default.batch_get(KEYS) == [None] * len(KEYS)

    # Removal stays inside the caller's namespace.
    assert b.remove("only-a/x") is False
    assert b.batch_remove(["only-a/x"]) == [Status.NOT_FOUND]
    assert b.remove_prefix("only-a/") == 0
    assert default.remove_prefix("shared/") == 0
    assert a.get("only-a/x") == b"secret"

    assert b.remove(KEYS[0]) is True
    assert b.get(KEYS[0]) is None and a.get(KEYS[0]) == va[0]
    assert b.remove_prefix("shared/") == len(KEYS) - 1
    assert b.batch_get(KEYS) == [None] * len(KEYS)
    assert a.batch_get(KEYS) == va, "a's objects survived b's remove_prefix"
    assert a.remove_prefix("") == len(KEYS) + 1  # "" is every key, of a only
    assert a.cluster_status().objects == 0


def test_namespace_and_key_are_not_concatenated(cluster):
    # ("x", "y/z") and ("x/y", "z") would collide if the master joined namespace and key with "/".
    outer = cluster.client(namespace="x")
    inner = cluster.client(namespace="x/y")
    prefix = cluster.client(namespace="x/")  # and a namespace that is a prefix of another
    outer.put("y/z", b"outer")
    inner.put("z", b"inner")
    prefix.put("y/z", b"prefix")
    assert (outer.get("y/z"), inner.get("z"), prefix.get("y/z")) == (b"outer", b"inner", b"prefix")
    assert inner.get("y/z") is None and outer.get("z") is None
    assert outer.remove_prefix("y") == 1
    assert (inner.get("z"), prefix.get("y/z")) == (b"inner", b"prefix")
