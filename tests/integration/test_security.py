"""Authentication, tenants and data-plane capabilities against real processes (issue 8)."""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest

from kvtier.client import KvtierError
from kvtier.common.units import parse_hostport
from kvtier.proto import auth, frames, master_pb2_grpc, rpcframe
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.integration.rawframes import connect, is_closed_by_peer, recv_response

SECRET = b"0123456789abcdef0123456789abcdef"


def secret_file(tmp_path, name: str, value: bytes = SECRET) -> str:
    path = tmp_path / name
    path.write_bytes(value)
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture
def secure(bare_cluster, tmp_path):
    bare_cluster.secret_file = secret_file(tmp_path, "cluster.secret")
    alice, bob = secret_file(tmp_path, "alice.secret", b"a" * 32), secret_file(tmp_path, "bob.secret", b"b" * 32)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\n'
        f'[tenants.bob]\nsecret_file = "{bob}"\nnamespaces = ["bob-*"]\n'
    )
    bare_cluster.start_master("--tenants-file", str(tenants), "--lease-s", "2")  # short: tags expire with it
    bare_cluster.start_segment("seg0", "16MiB")
    bare_cluster.tenant_secrets = {"alice": alice, "bob": bob}
    return bare_cluster


def stub_with(address: str, token: str = ""):
    channel = grpc.insecure_channel(address)
    metadata = ((auth.AUTH_METADATA, token),) if token else ()
    return channel, master_pb2_grpc.MasterStub(channel), metadata


def tcp_endpoint(proc) -> str:
    return next(e for e in proc.info["endpoints"] if e.startswith("tcp://"))


def test_the_cluster_secret_opens_everything_and_nothing_else_does(secure, tmp_path):
    with secure.client(transport="tcp") as client:
        client.put("k", b"v" * 1000)
        assert client.get("k", with_source=True) == (b"v" * 1000, "dram/tcp")
    from kvtier.client import Client

    master = secure.master.info["address"]
    with Client(master, timeout=3.0) as anon:
        with pytest.raises(KvtierError) as missing:
            anon.put("k2", b"v")
        assert missing.value.status == Status.UNAUTHENTICATED
        assert "missing credentials" in str(missing.value)
    wrong = secret_file(tmp_path, "wrong.secret", b"w" * 32)
    with Client(master, timeout=3.0, secret_file=wrong) as intruder:
        with pytest.raises(KvtierError) as refused:
            intruder.remove("k")
        assert refused.value.status == Status.UNAUTHENTICATED and "wrong credentials" in str(refused.value)
        assert intruder.get("k") is None  # reads degrade to misses, never bytes
    with secure.client() as client:
        assert client.get("k") == b"v" * 1000, "nothing an unauthenticated caller did changed the data"


def test_the_fast_path_needs_an_auth_frame_first(secure):
    hello = stub_with(secure.master.info["address"], auth.make_token(SECRET))
    endpoint = hello[1].Hello(pb.HelloRequest(), metadata=hello[2]).fast_endpoint
    hello[0].close()
    address = parse_hostport(endpoint.split("://")[-1])
    request = pb.KeysRequest(namespace="default", keys=["k"]).SerializeToString()
    frame = rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.METHOD_IDS["Exists"], 1, len(request)) + request
    for preamble in (b"", _auth_frame("v1:cluster:" + "0" * 64)):
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(preamble + frame)
            got = _read_frames(sock)
            assert got[-1][0] == rpcframe.ERROR_METHOD and b"unauthenticated" in got[-1][1]
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(_auth_frame(auth.make_token(SECRET)) + frame)
        got = _read_frames(sock, count=2)
        assert [method for method, _ in got] == [rpcframe.AUTH_METHOD, rpcframe.METHOD_IDS["Exists"]]


def _auth_frame(token: str) -> bytes:
    data = token.encode()
    return rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, 0, len(data)) + data


def _read_frames(sock: socket.socket, count: int = 1) -> list[tuple[int, bytes]]:
    out = []
    try:
        for _ in range(count):
            header = _recv(sock, rpcframe.HEADER.size)
            _magic, method, _rid, size = rpcframe.HEADER.unpack(header)
            out.append((method, _recv(sock, size)))
    except ConnectionError:
        pass
    return out


def _recv(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def test_a_segment_without_the_secret_cannot_mount(secure, tmp_path):
    secure.secret_file = ""
    with pytest.raises(RuntimeError) as excinfo:
        secure.start_segment("rogue", "16MiB", "--shm-dir", str(tmp_path))
    assert "exited with 2" in str(excinfo.value)
    assert "refused this segment's credentials" in str(excinfo.value)


def test_tenants_are_confined_to_their_namespaces(secure):
    from kvtier.client import Client

    master = secure.master.info["address"]
    files = secure.tenant_secrets
    with (
        Client(master, namespace="alice-llama", principal="alice", secret_file=files["alice"]) as alice,
        Client(master, namespace="bob-llama", principal="bob", secret_file=files["bob"]) as bob,
        Client(master, namespace="bob-llama", principal="alice", secret_file=files["alice"]) as alice_in_bob,
    ):
        alice.put("a", b"alice's")
        bob.put("b", b"bob's")
        assert alice.get("a") == b"alice's" and bob.get("b") == b"bob's"
        assert alice_in_bob.get("b") is None  # cannot read
        for call in (lambda: alice_in_bob.remove("b"), lambda: alice_in_bob.put("b", b"evil")):
            with pytest.raises(KvtierError) as denied:  # cannot remove, cannot overwrite
                call()
            assert denied.value.status == Status.PERMISSION_DENIED
            assert "may not use namespace 'bob-llama'" in str(denied.value)
        with pytest.raises(KvtierError) as listing:  # cannot list
            list(alice_in_bob.iter_keys())
        assert listing.value.status == Status.PERMISSION_DENIED
        with pytest.raises(KvtierError) as ops:  # cluster operations are for the cluster secret
            alice.cluster_status()
        assert ops.value.status == Status.PERMISSION_DENIED
        assert bob.get("b") == b"bob's", "bob's object is untouched"


def _granted(secure, key: bytes = b"") -> tuple[pb.GetReplicasResponse, str]:
    channel, stub, metadata = stub_with(secure.master.info["address"], auth.make_token(SECRET))
    try:
        reply = stub.GetReplicas(pb.KeysRequest(namespace="default", keys=["cap"]), metadata=metadata)
    finally:
        channel.close()
    return reply, tcp_endpoint(secure.segments["seg0"])


def test_the_data_plane_serves_only_ranges_the_master_granted(secure):
    with secure.client(transport="tcp") as client:
        client.put("cap", b"c" * 4096)
        client.put("other", b"o" * 4096)
        other_offset = client.locate("other")[0]["offset"]
    reply, endpoint = _granted(secure)
    offset, size = reply.replica_offsets[0], reply.sizes[0]
    tag, expiry = reply.replica_tags[:16], reply.tag_expiry_ms
    assert len(reply.replica_tags) == 16 and expiry + auth.CLOCK_SKEW_MS > auth.wall_ms()  # the lease's end

    def read(ranges, caps) -> tuple[int, bytes]:
        with connect(endpoint) as sock:
            sock.sendall(frames.pack_request(Op.READ, 1, ranges, caps=caps))
            _op, _rid, status, payload = recv_response(sock)
            return status, payload

    assert read([(offset, size)], (expiry, tag)) == (0, b"c" * 4096)  # granted: served
    status, message = read([(offset, size)], None)
    assert status == Status.CAPABILITY_DENIED and b"capabilities from the master" in message
    forged = bytes(16)
    assert read([(offset, size)], (expiry, forged))[0] == Status.CAPABILITY_DENIED
    assert read([(other_offset, size)], (expiry, tag))[0] == Status.CAPABILITY_DENIED  # another range
    assert read([(offset, size)], (expiry + 60_000, tag))[0] == Status.CAPABILITY_DENIED  # a longer life
    stale = auth.wall_ms() - auth.CLOCK_SKEW_MS - 1000
    key = auth.CapabilityKey(auth.capability_key(SECRET, "seg0", 1))  # wrong epoch: not this mount's key
    assert read([(offset, size)], (stale, key.tag(Op.READ, stale, offset, size)))[0] == Status.CAPABILITY_DENIED
    # A read tag does not write: the bytes stay as they were.
    with connect(endpoint) as sock:
        sock.sendall(frames.pack_request(Op.WRITE, 2, [(offset, size)], size, caps=(expiry, tag)) + b"X" * size)
        assert recv_response(sock)[2] == Status.CAPABILITY_DENIED
        sock.sendall(frames.pack_request(Op.PING, 3, []))  # the connection is still in sync
        assert recv_response(sock)[:3] == (Op.PING, 3, 0)
    with secure.client(transport="tcp") as client:
        assert client.get("cap") == b"c" * 4096


def test_capabilities_expire(secure):
    with secure.client(transport="tcp") as client:
        client.put("cap", b"e" * 100)
    reply, endpoint = _granted(secure)
    offset, size = reply.replica_offsets[0], reply.sizes[0]
    wait_s = (reply.tag_expiry_ms + auth.CLOCK_SKEW_MS - auth.wall_ms()) / 1000 + 0.2
    time.sleep(max(wait_s, 0))
    with connect(endpoint) as sock:
        sock.sendall(frames.pack_request(Op.READ, 1, [(offset, size)], caps=(reply.tag_expiry_ms, reply.replica_tags)))
        _op, _rid, status, message = recv_response(sock)
    assert status == Status.CAPABILITY_DENIED and b"expired" in message
    assert not is_closed_by_peer_quick(endpoint)


def is_closed_by_peer_quick(endpoint: str) -> bool:
    with connect(endpoint) as sock:
        sock.settimeout(0.2)
        try:
            return is_closed_by_peer(sock)
        except TimeoutError:
            return False


def test_a_refused_disk_read_is_answered_before_its_names_are_buffered(secure):
    endpoint = tcp_endpoint(secure.segments["seg0"])
    names = b"\xff" * 1000  # not even names: a refusal must come before they are parsed (or held)
    with connect(endpoint) as sock:
        sock.sendall(frames.pack_request(Op.READ_DISK, 1, [(0, 4096)], len(names)) + names)
        op, _rid, status, _message = recv_response(sock)
        assert (op, status) != (Op.READ_DISK, 0) and status != Status.PROTOCOL_ERROR
        sock.sendall(frames.pack_request(Op.PING, 2, []))  # drained: the stream is still in sync
        assert recv_response(sock)[:3] == (Op.PING, 2, 0)


def test_a_tenant_is_refused_segment_rpcs_before_any_of_them_runs(secure):
    channel, stub, _ = stub_with(secure.master.info["address"])
    token = auth.make_token(b"a" * 32, "alice")
    try:
        wait_ms = 5000
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as excinfo:  # a long poll: refused at once, not after it
            stub.PollTierTasks(
                pb.PollTierTasksRequest(segment_id=1, wait_ms=wait_ms), metadata=((auth.AUTH_METADATA, token),)
            )
        assert excinfo.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert time.monotonic() - started < wait_ms / 1000 / 2, "refused well before the poll's wait"
    finally:
        channel.close()


def test_a_client_with_a_secret_keeps_the_fast_path_of_a_master_without_one(bare_cluster, tmp_path):
    from kvtier.client import Client

    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    with Client(bare_cluster.master.info["address"], secret=SECRET, timeout=5.0) as client:
        client.put("k", b"v")
        assert client.get("k") == b"v"
        assert client._master.fast_path_active


def test_a_tenant_cannot_charge_or_evict_through_another_tenants_instance(secure):
    """Quota accounts are per engine instance and rank; the instance a put names was taken as given,
    so alice, naming bob's registered instance, was charged to bob's quota and evicted bob's objects
    to make room. A tenant names only instances matching its `instances` patterns (by default its
    namespace patterns)."""
    from kvtier.client import Client

    master = secure.master.info["address"]
    files = secure.tenant_secrets
    with secure.client(namespace="bob-llama", instance="bob-engine", rank=0) as operator:
        operator.register_instance(1, 1, 1_000_000)
    with (
        Client(master, namespace="bob-llama", principal="bob", secret_file=files["bob"], instance="bob-engine") as bob,
        Client(
            master, namespace="alice-x", principal="alice", secret_file=files["alice"], instance="bob-engine"
        ) as alice,
    ):
        keys = [f"b{i}" for i in range(8)]
        assert bob.batch_put(keys, [b"b" * 100_000] * 8) == [Status.OK] * 8
        with pytest.raises(KvtierError) as denied:
            alice.put("a0", b"a" * 100_000)
        assert denied.value.status == Status.PERMISSION_DENIED
        assert "instance 'bob-engine'" in str(denied.value)
        assert all(bob.batch_exists(keys)), "bob's objects were evicted to make room on alice's account"


def test_a_tenants_puts_leave_no_quota_accounts_behind_and_instance_names_are_bounded(secure):
    """Each new instance name made an account that was never forgotten (a tenant grew the master by
    storing nothing); accounts of unregistered instances now go with their last object, and an
    instance name is at most 256 bytes."""
    from kvtier.client import Client

    master = secure.master.info["address"]
    files = secure.tenant_secrets
    with Client(master, namespace="alice-x", principal="alice", secret_file=files["alice"]) as base:
        base.put("taken", b"t")
        for i in range(50):
            with Client(
                master, namespace="alice-x", principal="alice", secret_file=files["alice"], instance=f"alice-{i}"
            ) as alice:
                alice.put("taken", b"t")  # exists already: stores nothing
                alice.put(f"new{i}", b"n")
                alice.remove(f"new{i}")
        with (
            Client(
                master,
                namespace="alice-x",
                principal="alice",
                secret_file=files["alice"],
                instance="alice-" + "x" * 300,
            ) as long_name,
            pytest.raises(KvtierError) as refused,
        ):
            long_name.put("k", b"v")
        assert refused.value.status == Status.INVALID_ARGUMENT
    with secure.client(namespace="alice-x") as operator:
        assert [q for q in operator.quotas() if q["instance"].startswith("alice-")] == []


def test_one_tenant_cannot_take_every_event_stream(secure):
    from kvtier.client import Client
    from kvtier.client.events import WatchEnded

    master = secure.master.info["address"]
    files = secure.tenant_secrets
    streams = []
    with (
        Client(master, namespace="alice-x", principal="alice", secret_file=files["alice"]) as alice,
        Client(master, namespace="bob-x", principal="bob", secret_file=files["bob"]) as bob,
        secure.client(namespace="default") as operator,
    ):
        try:
            for _ in range(64):  # every slot events_max_watchers gives (alice was given all 64 before)
                streams.append(alice.watch_events())
                if not streams[-1].epoch:
                    break
            assert sum(1 for stream in streams if stream.epoch) == 8  # events_max_watchers_per_tenant
            with pytest.raises(WatchEnded) as full:
                next(streams[-1])
            assert full.value.status == Status.TOO_MANY_WATCHERS and "per_tenant" in full.value.message
            streams += [bob.watch_events(), operator.watch_events(all_namespaces=True)]
            assert streams[-2].epoch and streams[-1].epoch, "bob and the operator still get their streams"
        finally:
            for stream in streams:
                stream.close()
