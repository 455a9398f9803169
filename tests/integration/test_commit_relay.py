"""Commit through the segment (issue 19): a tcp put's PutEnd rides behind its WRITE (a COMMIT frame)
and the segment relays it to the master (RelayPutEnd), applying the master's notices to its index
before it answers. These tests hold it to a direct PutEnd's promises: an acknowledged put survives
kill -9 of the master, a removed key stays removed, a tenant stays in its namespaces, and anything
the segment cannot relay falls back to the client's own PutEnd. Real master and segment processes;
raw frames where the client would never send what is tested.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading

import crc32c
import pytest

from kvtier.client import Status
from kvtier.proto import auth, frames
from kvtier.proto import master_pb2 as pb
from kvtier.proto.frames import Op
from tests.integration.rawframes import connect, far_deadline, is_closed_by_peer, recv_response, send_request
from tests.integration.test_metrics import scrape
from tests.integration.test_metrics import value as sample

_SEGMENT_CALLS = {"Heartbeat", "PollCommits", "MountSegment", "ReportDramObjects", "Status", "Hello"}


def _calls(client) -> dict[str, int]:
    return dict(client.cluster_status().rpc_requests)


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    names = (set(before) | set(after)) - _SEGMENT_CALLS
    return {n: after.get(n, 0) - before.get(n, 0) for n in names if after.get(n, 0) != before.get(n, 0)}


def _tcp_endpoint(proc) -> str:
    return next(e for e in proc.info["endpoints"] if e.startswith("tcp://"))


@pytest.fixture
def one_segment(bare_cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "64MiB")
    return bare_cluster


def test_a_tcp_put_is_committed_through_its_segment_and_survives_kill_9_of_the_master(one_segment):
    client = one_segment.client(transport="tcp")
    _relay_ready(one_segment, client)
    before = _calls(client)
    relayed = client.stats()["commits_relayed"]
    client.put("relay/one", b"1" * 4096)
    assert _delta(before, _calls(client)) == {"PutStart": 1, "RelayPutEnd": 1}  # no PutEnd of its own
    assert client.stats()["commits_relayed"] == relayed + 1
    values = {f"relay/{i}": os.urandom(100 + 997 * i) for i in range(40)}
    for key, value in values.items():
        client.put(key, value)
    statuses = client.batch_put([f"relay/batch/{i}" for i in range(32)], [b"%d" % i * 64 for i in range(32)])
    assert statuses == [Status.OK] * 32
    one_segment.restart_master()  # SIGKILL: everything acknowledged must come back from the index
    client = one_segment.client(transport="tcp")
    assert one_segment.wait_for(lambda: client.exists("relay/one"), timeout=20)
    assert client.batch_get(list(values)) == list(values.values())
    assert client.batch_get([f"relay/batch/{i}" for i in range(32)]) == [b"%d" % i * 64 for i in range(32)]
    # The restarted master has another fast-path port: the relay finds it (at first the client may
    # fall back to its own PutEnd while the segment's feed says Hello to the new master).
    assert one_segment.wait_for(lambda: (client.put(f"again/{os.urandom(4).hex()}", b"a"), _relayed(client))[1], 20)


def _relayed(client) -> bool:
    return client.stats().get("commits_relayed", 0) > 0


def _relay_ready(cluster, client) -> None:
    """Put until a put is relayed: right after its mount a segment's commit feed has not found the
    master's fast path yet, and the first puts send their PutEnd themselves (a fallback, not a loss)."""
    assert cluster.wait_for(lambda: (client.put(f"warm-up/{os.urandom(4).hex()}", b"w"), _relayed(client))[1], 20)


def test_a_removed_key_stays_removed_and_a_replaced_one_keeps_its_new_bytes_across_kill_9(one_segment):
    """Relayed commits do not wake the segment's long poll; a Remove (and a PutEnd from another
    client) that waits for the segment's acknowledgement must wake it, not wait for the poll's timeout,
    and what it acknowledged must hold after a restart."""
    tcp = one_segment.client(transport="tcp")
    shm = one_segment.client(transport="shm")
    _relay_ready(one_segment, tcp)
    for i in range(20):
        tcp.put(f"gone/{i}", b"g" * 2048)
        tcp.upsert(f"kept/{i}", b"old" * 500)
        tcp.upsert(f"kept/{i}", b"new" * 700)
        shm.put(f"shm/{i}", b"s" * 2048)  # a direct PutEnd, waiting on the relayed notices too
    for i in range(20):
        tcp.remove(f"gone/{i}")
    one_segment.restart_master()
    client = one_segment.client(transport="tcp")
    assert one_segment.wait_for(lambda: client.exists("shm/0"), timeout=20)
    assert client.batch_get([f"gone/{i}" for i in range(20)]) == [None] * 20
    assert client.batch_get([f"kept/{i}" for i in range(20)]) == [b"new" * 700] * 20
    assert client.batch_get([f"shm/{i}" for i in range(20)]) == [b"s" * 2048] * 20


def test_commits_are_not_relayed_when_the_client_says_so_or_the_put_spans_segments(bare_cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "32MiB")
    bare_cluster.start_segment("seg1", "32MiB")
    direct = bare_cluster.client(transport="tcp", commit_through_segment=False)
    direct.put("warm-up", b"x")
    before = _calls(direct)
    direct.put("direct/one", b"d" * 4096)
    assert _delta(before, _calls(direct)) == {"PutStart": 1, "PutEnd": 1}
    relaying = bare_cluster.client(transport="tcp")
    relaying.put("warm-up-2", b"x")
    before = _calls(relaying)
    assert relaying.batch_put(["two/a"], [b"r" * 4096], replicas=2) == [Status.OK]  # two segments: PutEnd
    assert _delta(before, _calls(relaying)) == {"PutStart": 1, "PutEnd": 1}
    assert relaying.get("two/a") == b"r" * 4096 and direct.get("direct/one") == b"d" * 4096


# ---------------------------------------------------------------- raw frames


def _put_start(client, key: str, size: int) -> pb.PutStartResponse:
    reply = client._master.call(
        "PutStart",
        pb.PutStartRequest(namespace=client.namespace, keys=[key], sizes=[size], replicas=1, instance="", rank=0),
    )
    assert list(reply.statuses) == [Status.OK], reply
    return reply


def _commit_frame(request_id: int, put_end: pb.PutEndRequest, token: str = "") -> bytes:
    body = pb.RelayPutEndRequest(put_end=put_end, token=token).SerializeToString()
    return frames.pack_request(Op.COMMIT, request_id, [], len(body)) + body


def _write_then_commit(endpoint: str, started: pb.PutStartResponse, value: bytes, put_end: pb.PutEndRequest, token=""):
    """WRITE the granted range (with its capability, if any), COMMIT right behind it: both answers."""
    offset = started.replica_offsets[0]
    caps = (started.tag_expiry_ms, started.replica_tags[:16]) if started.replica_tags else None
    with connect(endpoint) as sock:
        write = frames.pack_request(
            Op.WRITE, 1, [(offset, len(value))], len(value), caps=caps, deadline=0 if caps else started.tag_expiry_ms
        )
        sock.sendall(write + value + _commit_frame(2, put_end, token))
        return recv_response(sock), recv_response(sock)


def test_a_commit_is_taken_only_right_behind_a_write_that_completed_and_bad_ones_are_refused(one_segment):
    client = one_segment.client(transport="tcp")
    _relay_ready(one_segment, client)
    endpoint = _tcp_endpoint(one_segment.segments["seg0"])
    put_end = pb.PutEndRequest(namespace="default", keys=["raw/never"], checksums=[1], put_id=1)
    with connect(endpoint) as sock:  # first on its connection: nothing was written
        sock.sendall(_commit_frame(7, put_end))
        op, request_id, status, message = recv_response(sock)
        assert (op, request_id, status) == (Op.COMMIT, 7, Status.INVALID_ARGUMENT)
        assert b"right behind a WRITE" in message
        send_request(sock, Op.PING, 8, [])  # still in sync, still serving
        assert recv_response(sock)[:3] == (Op.PING, 8, 0)
        send_request(sock, Op.PING, 9, [])
        sock.sendall(_commit_frame(10, put_end))  # behind a PING: refused the same way
        assert recv_response(sock)[:3] == (Op.PING, 9, 0)
        assert recv_response(sock)[2] == Status.INVALID_ARGUMENT
    started = _put_start(client, "raw/garbage", 64)
    value = b"g" * 64
    with connect(endpoint) as sock:  # an undecodable payload: refused, never sent to the master
        sock.sendall(
            frames.pack_request(Op.WRITE, 1, [(started.replica_offsets[0], 64)], 64, deadline=started.tag_expiry_ms)
            + value
            + frames.pack_request(Op.COMMIT, 2, [], 3)
            + b"\xff\xff\xff"
        )
        assert recv_response(sock)[:3] == (Op.WRITE, 1, 0)
        assert recv_response(sock)[:3] == (Op.COMMIT, 2, Status.INVALID_ARGUMENT)
    for bad in (
        frames.pack_request(Op.COMMIT, 3, [(0, 8)], 0),  # a COMMIT with a range
        frames.pack_request(Op.READ, 4, [(0, 8)], deadline=far_deadline(), flags=frames.FLAG_COMMIT_FOLLOWS),
        frames.pack_request(Op.COMMIT, 5, [], frames.MAX_COMMIT_BYTES + 1),
    ):
        with connect(endpoint) as sock:
            sock.sendall(bad)
            assert recv_response(sock)[2] == Status.PROTOCOL_ERROR
            assert is_closed_by_peer(sock)
    # The segment served on, and relays real commits: one put's PutEnd written by hand.
    started = _put_start(client, "raw/good", 64)
    put_end = pb.PutEndRequest(
        namespace="default", keys=["raw/good"], checksums=[crc32c.crc32c(value)], put_id=started.put_id
    )
    (write, commit) = _write_then_commit(endpoint, started, value, put_end)
    assert write[:3] == (Op.WRITE, 1, 0)
    assert commit[:3] == (Op.COMMIT, 2, 0)
    answer = pb.RelayPutEndResponse.FromString(commit[3])
    assert answer.status == Status.OK and list(answer.statuses) == [Status.OK] and not answer.HasField("notices")
    assert client.get("raw/good") == value
    assert client.get("raw/garbage") is None  # never committed: its put is still pending


@pytest.fixture
def tenants(bare_cluster, tmp_path):
    def secret(name: str, value: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(value)
        path.chmod(0o600)
        return str(path)

    bare_cluster.secret_file = secret("cluster.secret", secrets.token_hex(16).encode())
    alice = secret("alice.secret", b"a" * 32)
    (tmp_path / "tenants.toml").write_text(
        f'[tenants.alice]\nsecret_file = "{alice}"\nnamespaces = ["alice-*"]\n'
        f'[tenants.bob]\nsecret_file = "{secret("bob.secret", b"b" * 32)}"\nnamespaces = ["bob-*"]\n'
    )
    bare_cluster.start_master("--tenants-file", str(tmp_path / "tenants.toml"))
    bare_cluster.start_segment("seg0", "32MiB")
    bare_cluster.alice_secret = alice
    return bare_cluster


def test_a_relayed_commit_is_checked_as_the_clients_own_call(tenants):
    """The segment relays with the cluster's credentials; the master checks the client's token and
    rights on the PutEnd inside, exactly as if the client had sent it."""
    alice = tenants.client(transport="tcp", namespace="alice-x", principal="alice", secret_file=tenants.alice_secret)
    _relay_ready(tenants, alice)
    alice.put("mine", b"m" * 1000)
    assert alice.get("mine") == b"m" * 1000
    endpoint = _tcp_endpoint(tenants.segments["seg0"])
    token = auth.make_token(b"a" * 32, "alice")
    value = b"v" * 128
    started = _put_start(alice, "raw", len(value))
    crc = crc32c.crc32c(value)
    into_bob = pb.PutEndRequest(namespace="bob-x", keys=["raw"], checksums=[crc], put_id=started.put_id)
    write, commit = _write_then_commit(endpoint, started, value, into_bob, token)
    assert write[2] == 0 and commit[2] == 0
    assert pb.RelayPutEndResponse.FromString(commit[3]).status == Status.PERMISSION_DENIED
    own = pb.PutEndRequest(namespace="alice-x", keys=["raw"], checksums=[crc], put_id=started.put_id)
    _, no_token = _write_then_commit(endpoint, started, value, own, "")
    assert pb.RelayPutEndResponse.FromString(no_token[3]).status == Status.UNAUTHENTICATED
    assert alice.get("raw") is None
    _, accepted = _write_then_commit(endpoint, started, value, own, token)
    assert list(pb.RelayPutEndResponse.FromString(accepted[3]).statuses) == [Status.OK]
    assert alice.get("raw") == value


def test_many_writers_over_two_segments_are_relayed_and_every_acknowledged_put_survives_kill_9(bare_cluster):
    """Relays of several clients at once, on two segments: each relayed answer's wait covers the other
    segment's notices, and a segment's relays spread over a few connections to the master (one parked
    answer must not queue the rest). Everything answered OK is back after kill -9."""
    bare_cluster.start_master()
    segments = [bare_cluster.start_segment(name, "64MiB", "--metrics", "127.0.0.1:0") for name in ("seg0", "seg1")]
    clients = [bare_cluster.client(transport="tcp") for _ in range(4)]
    for client in clients:
        _relay_ready(bare_cluster, client)
    acknowledged: dict[str, bytes] = {}
    lock = threading.Lock()

    def writer(n: int, client) -> None:
        for i in range(60):
            key, value = f"many/{n}/{i}", os.urandom(512 + 64 * i)
            if client.batch_put([key], [value]) == [Status.OK]:
                with lock:
                    acknowledged[key] = value

    threads = [threading.Thread(target=writer, args=(n, c)) for n, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(acknowledged) == 240  # nothing refused on a healthy cluster
    relayed = [
        sample(scrape(proc.info["metrics"]), "kvtier_segment_commits_total", segment=name, outcome="relayed")
        for name, proc in zip(("seg0", "seg1"), segments, strict=True)
    ]
    assert all(count > 0 for count in relayed), relayed
    bare_cluster.restart_master()
    reader = bare_cluster.client(transport="tcp")
    assert bare_cluster.wait_for(lambda: len(reader.cluster_status().segments) == 2, timeout=20)
    assert bare_cluster.wait_for(lambda: reader.exists("many/0/0") and reader.exists("many/3/59"), timeout=20)
    keys = sorted(acknowledged)
    assert reader.batch_get(keys) == [acknowledged[k] for k in keys]


def test_a_stalled_master_gets_the_write_answered_at_once_the_commit_unavailable_and_the_put_ends_directly(
    one_segment,
):
    """The segment holds a WRITE's answer for its COMMIT's, but not for long: with the master stopped
    (SIGSTOP), the WRITE is answered within the hold, the COMMIT UNAVAILABLE at the relay's
    timeout, the connection keeps serving, and the client's own PutEnd then commits the put."""
    client = one_segment.client(transport="tcp")
    _relay_ready(one_segment, client)
    endpoint = _tcp_endpoint(one_segment.segments["seg0"])
    value_bytes = b"s" * 256
    started = _put_start(client, "stalled", len(value_bytes))
    put_end = pb.PutEndRequest(
        namespace="default", keys=["stalled"], checksums=[crc32c.crc32c(value_bytes)], put_id=started.put_id
    )
    master = one_segment.master.popen
    with connect(endpoint) as sock:
        write = frames.pack_request(
            Op.WRITE,
            1,
            [(started.replica_offsets[0], len(value_bytes))],
            len(value_bytes),
            deadline=started.tag_expiry_ms,
            flags=frames.FLAG_COMMIT_FOLLOWS,
        )
        master.send_signal(signal.SIGSTOP)
        try:
            sock.sendall(write + value_bytes + _commit_frame(2, put_end))
            assert recv_response(sock)[:3] == (Op.WRITE, 1, 0)  # before the relay gave up
            op, request_id, status, message = recv_response(sock)
            assert (op, request_id, status) == (Op.COMMIT, 2, Status.UNAVAILABLE), message
            send_request(sock, Op.PING, 3, [])
            assert recv_response(sock)[:3] == (Op.PING, 3, 0)
        finally:
            master.send_signal(signal.SIGCONT)
    ended = client._master.call("PutEnd", put_end)  # what the client does when the relay fails
    assert list(ended.statuses) == [Status.OK]
    assert client.get("stalled") == value_bytes


def test_a_put_committed_while_its_answer_waited_is_ok_though_the_key_changed_before_the_clients_put_end(
    bare_cluster,
):
    """A relayed PutEnd commits at once but answers only once the segments acknowledged it; with
    another segment stalled (an earlier drop of the key waits there), the relay gives up and the
    client sends its own PutEnd. A reader read the value and removed the key meanwhile: the writer
    must hear OK (its put was stored, then removed), never NOT_PENDING ("stores nothing")."""
    bare_cluster.segment_ttl_s = 10.0  # the stall must not expel the segment
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0", "16MiB")
    bare_cluster.start_segment("seg1", "16MiB")
    writer = bare_cluster.client(transport="tcp", timeout=8.0)
    reader = bare_cluster.client(transport="tcp", timeout=8.0)
    _relay_ready(bare_cluster, writer)
    old, new = b"1" * 4096, b"2" * 4096
    writer.put("k", old, preferred_segment="seg1")
    stalled = bare_cluster.segments["seg1"].popen
    outcome: dict[str, object] = {}

    def put_new() -> None:
        try:
            writer.put("k", new, preferred_segment="seg0")
            outcome["writer"] = "OK"
        except Exception as exc:  # noqa: BLE001 - the status is what the test checks
            outcome["writer"] = exc

    removals = []
    stalled.send_signal(signal.SIGSTOP)
    try:
        # The removal is applied at once; its answer (and the next PutEnd of "k") waits for seg1.
        removals.append(threading.Thread(target=reader.remove, args=("k",), daemon=True))
        removals[-1].start()
        assert bare_cluster.wait_for(lambda: not reader.exists("k"), 5)
        put_thread = threading.Thread(target=put_new)
        put_thread.start()
        assert bare_cluster.wait_for(lambda: reader.get("k") == new, 1.2), "the put never became visible"
        removals.append(threading.Thread(target=reader.remove, args=("k",), daemon=True))
        removals[-1].start()
        assert bare_cluster.wait_for(lambda: not reader.exists("k"), 1)
        put_thread.join(2.5)  # the relay's bound passes, the client's own PutEnd is answered
    finally:
        stalled.send_signal(signal.SIGCONT)
    put_thread.join(15)
    for removal in removals:
        removal.join(15)
    assert outcome["writer"] == "OK"
    assert writer.stats()["commits_relayed"] >= 1
    assert reader.get("k") is None
