"""Secrets, principal tokens, tenants and data-plane capability tags (issue 8)."""

from __future__ import annotations

import os

import pytest

from kvtier.master.auth import Authenticator, Tenant, load_tenants
from kvtier.master.config import parse_args as master_args
from kvtier.proto import auth
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op

SECRET = b"s" * 32


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch):
    monkeypatch.delenv("KVTIER_SECRET", raising=False)


def write_secret(tmp_path, name: str, value: bytes = SECRET, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_bytes(value + b"\n")
    os.chmod(path, mode)
    return str(path)


def test_secret_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    assert auth.read_secret(write_secret(tmp_path, "s")) == SECRET  # the newline is cut
    assert auth.read_secret(write_secret(tmp_path, "g", mode=0o640)) == SECRET  # the service's group may read
    assert auth.read_secret("") is None
    monkeypatch.setenv("KVTIER_SECRET", "e" * 20)
    assert auth.read_secret("") == b"e" * 20


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: write_secret(p, "open", mode=0o644), "open to every user"),
        (lambda p: write_secret(p, "short", value=b"tiny"), "at least 16"),
        (lambda p: str(p / "absent"), "cannot read secret file"),
    ],
)
def test_unusable_secrets_are_one_clear_error(tmp_path, setup, message):
    with pytest.raises(auth.SecretError, match=message):
        auth.read_secret(setup(tmp_path))


def test_a_token_proves_its_principal_only_with_the_right_secret():
    secrets = {"cluster": SECRET, "alice": b"a" * 32}
    assert auth.verify_token(auth.make_token(SECRET), secrets) == "cluster"
    assert auth.verify_token(auth.make_token(b"a" * 32, "alice"), secrets) == "alice"
    assert auth.verify_token(auth.make_token(b"x" * 32), secrets) == ""  # wrong secret
    assert auth.verify_token(auth.make_token(SECRET, "alice"), secrets) == ""  # claims alice, cluster's secret
    assert auth.verify_token(auth.make_token(b"a" * 32, "mallory"), secrets) == ""  # unknown principal
    for garbage in ("", "v1", "v1:cluster", "v2:cluster:00", "v1:cluster:" + "0" * 64):
        assert auth.verify_token(garbage, secrets) == ""


def test_tenants_see_only_their_namespaces_and_the_data_rpcs():
    authenticator = Authenticator(SECRET, {"alice": (b"a" * 32, Tenant("alice", ("alice-*", "shared")))})
    request = pb.KeysRequest(namespace="alice-llama", keys=["k"])
    assert authenticator.refusal("alice", "GetReplicas", request) == ""
    assert authenticator.refusal("alice", "GetReplicas", pb.KeysRequest(namespace="shared")) == ""
    assert "may not use namespace 'bob-x'" in authenticator.refusal(
        "alice", "GetReplicas", pb.KeysRequest(namespace="bob-x")
    )
    assert "may not use namespace" in authenticator.refusal("alice", "Remove", pb.KeysRequest(namespace="alicex"))
    for rpc in ("Status", "DrainSegment", "MountSegment", "RegisterInstance", "Quotas"):
        assert "cluster credentials only" in authenticator.refusal("alice", rpc, pb.StatusRequest())
    assert authenticator.refusal("cluster", "DrainSegment", pb.DrainSegmentRequest()) == ""
    assert authenticator.principal("wrong") == ""
    assert Authenticator(None).principal("") == "cluster"  # authentication off


def test_a_tenant_is_charged_only_to_its_own_instances():
    alice = Tenant("alice", ("alice-*",))
    pinned = Tenant("carol", ("carol-*",), ("engine-7", "carol-*"))
    authenticator = Authenticator(SECRET, {"alice": (b"a" * 32, alice), "carol": (b"c" * 32, pinned)})
    put = pb.PutStartRequest(namespace="alice-x", keys=["k"], sizes=[1], replicas=1)
    assert authenticator.refusal("alice", "PutStart", put) == ""  # no instance: no account
    put.instance = "alice-engine"
    assert authenticator.refusal("alice", "PutStart", put) == ""  # by default its namespace patterns
    put.instance = "bob-engine"
    assert "may not be charged to instance 'bob-engine'" in authenticator.refusal("alice", "PutStart", put)
    put.namespace = "carol-x"
    assert authenticator.refusal("carol", "PutStart", put).startswith("tenant 'carol' may not be charged")
    put.instance = "engine-7"
    assert authenticator.refusal("carol", "PutStart", put) == ""
    assert authenticator.refusal("cluster", "PutStart", put) == ""  # the cluster names any instance


def test_tenants_file_is_validated(tmp_path):
    alice = write_secret(tmp_path, "alice.secret", b"a" * 32)
    good = tmp_path / "tenants.toml"
    good.write_text(f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\n')
    tenants = load_tenants(str(good))
    assert tenants["alice"] == (b"a" * 32, Tenant("alice", ("alice-*",)))
    good.write_text(f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\ninstances = ["eng-*"]\n')
    assert load_tenants(str(good))["alice"][1].instances == ("eng-*",)
    for text, message in [
        ('[tenants.cluster]\nsecret_file = "x"\nnamespaces = ["a"]\n', "reserved"),
        (f'[tenants.bob]\nsecret_file = "{alice}"\nnamespaces = []\n', "non-empty list"),
        (f'[tenants.bob]\nsecret_file = "{alice}"\nnamespaces = ["b"]\nadmin = true\n', "exactly"),
        ("[users.bob]\n", "unknown key 'users'"),
        (f'[tenants.bob]\nsecret_file = "{alice}"\nnamespaces = ["b"]\ninstances = "b-*"\n', "instances must be"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_tenants(str(bad))


def test_a_non_loopback_master_needs_a_secret_or_allow_insecure(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as excinfo:
        master_args(["--listen", "10.1.2.3:50051"])
    assert excinfo.value.code == 2
    assert "no cluster secret is set" in capsys.readouterr().err
    assert master_args(["--listen", "10.1.2.3:50051", "--allow-insecure", "true"]).allow_insecure
    assert master_args(["--listen", "10.1.2.3:50051", "--secret-file", write_secret(tmp_path, "c")])
    monkeypatch.setenv("KVTIER_SECRET", "e" * 20)
    assert master_args(["--listen", "10.1.2.3:50051"]).listen == "10.1.2.3:50051"


def test_every_exposed_listener_counts_not_what_is_advertised(tmp_path, capsys):
    from kvtier.segment_server.config import parse_args as segment_args

    with pytest.raises(SystemExit):  # a loopback gRPC port, but the fast path on every interface
        master_args(["--listen", "127.0.0.1:50051", "--fast-listen", "0.0.0.0:7000"])
    assert "'0.0.0.0:7000' is reachable" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bound to every interface, merely advertised as loopback
        segment_args(["--shm-dir", str(tmp_path), "--listen", "0.0.0.0:7000", "--advertise", "127.0.0.1"])
    assert "no cluster secret is set" in capsys.readouterr().err


def test_capability_tags_bind_segment_epoch_range_operation_and_expiry():
    key = auth.CapabilityKey(auth.capability_key(SECRET, "seg0", 7))
    flat = (0, 4096, 8192, 100)
    now = 1_000_000
    tags = key.tags(Op.READ, now + 5000, flat)
    assert len(tags) == 2 * auth.TAG_BYTES
    assert tags[:16] == key.tag(Op.READ, now + 5000, 0, 4096)
    assert key.check(Op.READ, now + 5000, flat, tags, now) == ""
    assert "does not match" in key.check(Op.WRITE, now + 5000, flat, tags, now)  # another operation
    assert "does not match" in key.check(Op.READ, now + 5000, (0, 4096, 8192, 101), tags, now)  # another range
    assert "does not match" in key.check(Op.READ, now + 6000, flat, tags, now)  # a later expiry
    for segment, epoch in (("seg1", 7), ("seg0", 8)):  # another segment, another master incarnation
        other = auth.CapabilityKey(auth.capability_key(SECRET, segment, epoch))
        assert "does not match" in other.check(Op.READ, now + 5000, flat, tags, now)
    late = now + 5000 + auth.CLOCK_SKEW_MS + 1
    assert "expired" in key.check(Op.READ, now + 5000, flat, tags, late)
    assert "bytes of tags" in key.check(Op.READ, now + 5000, flat, tags[:16], now)
    assert "names no range" in key.check(Op.WRITE, now + 5000, (), b"", now)  # proves nothing


def test_a_capability_key_without_a_session_is_the_key_of_before_sessions():
    import hashlib
    import hmac

    # what segments and masters from before mount sessions derive: they still agree with session 0
    before = hmac.new(SECRET, b"kvtier-cap|seg0|7|nonce", hashlib.sha256).digest()
    assert auth.capability_key(SECRET, "seg0", 7, "nonce") == before
    assert auth.capability_key(SECRET, "seg0", 7, "nonce", 0) == before
    assert auth.capability_key(SECRET, "seg0", 7, "nonce", 12345) != before


def test_credentials_never_show_their_secrets_in_a_repr():
    from kvtier.common.channels import Credentials

    credentials = Credentials.load(secret=SECRET)
    assert credentials.token and credentials.token not in repr(credentials)
    assert "tls_key" not in repr(Credentials(token="t", tls_key=b"KEY"))
