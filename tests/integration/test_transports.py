"""Transport conformance: every data-plane transport behaves the same through the Client.

Each test runs once per transport the client can be forced to (`transport`
fixture: tcp, shm): sizes from 0 B to 16 MiB, mixed batches, caller buffers
of the wrong size, and a segment server killed mid-batch. Then the choice of
transport (KVTIER_TRANSPORT) and the master fast path (on, off, broken).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import numpy as np
import pytest

from kvtier.client import Status
from kvtier.client import master as master_module
from kvtier.client.sockpool import SocketPool
from kvtier.client.transport.shm import ShmConnector
from kvtier.client.transport.tcp import TcpConnector
from kvtier.proto import rpcframe
from tests.integration.rawframes import recv_exact

KiB, MiB = 1 << 10, 1 << 20
CONNECTOR = {"tcp": TcpConnector, "shm": ShmConnector}
# The master drops a silent segment after its TTL, checked every tick: generous slack for a loaded machine.
DROP_SLACK_S = 5.0
GUARD = 64
GUARD_BYTE = 0xAB


def connector_types(client) -> set[type]:
    return {type(connector) for _, connector, _ in client._connectors.values()}


def segment_of(client, key: str) -> str:
    (replica,) = client.locate(key)
    return replica["segment"]


def guarded(size: int) -> tuple[bytearray, memoryview]:
    """A buffer of `size` bytes inside an arena with GUARD bytes on each side: (arena, the buffer)."""
    arena = bytearray([GUARD_BYTE]) * (GUARD + size + GUARD)
    return arena, memoryview(arena)[GUARD : GUARD + size]


def guards_intact(arena: bytearray, written: int = 0) -> bool:
    """Nothing outside the first `written` bytes of the buffer changed."""
    untouched = arena[:GUARD] + arena[GUARD + written :]
    return untouched == bytearray([GUARD_BYTE]) * len(untouched)


# ------------------------------------------------------------------ sizes


SIZES = [0, 1, 4095, 4096, 64 * KiB - 1, 64 * KiB, 256 * KiB + 3, MiB, 4 * MiB + 5, 16 * MiB]


def test_every_size_from_empty_to_16_mib_round_trips(cluster, transport):
    client = cluster.client(transport=transport)
    values = {f"size/{size}": os.urandom(size) for size in SIZES}
    for key, value in values.items():
        client.put(key, value)
        assert client.get(key) == value, key
        arena, view = guarded(len(value) + 1000)  # larger than needed: only the object's bytes are written
        assert client.get_into(key, view) == len(value), key
        assert view[: len(value)] == value and guards_intact(arena, len(value)), key
        exact = np.empty(len(value), dtype=np.uint8)
        assert client.get_into(key, exact) == len(value), key
        assert exact.tobytes() == value, key
    assert connector_types(client) == {CONNECTOR[transport]}
    assert client.batch_get(list(values)) == list(values.values())
    assert {segment_of(client, key) for key in values} == {"seg0", "seg1"}
    assert client.stats().get("checksum_mismatches", 0) == 0


def test_batches_mixing_sizes_and_buffer_kinds(cluster, transport):
    client = cluster.client(transport=transport)
    sizes = [0, 1, 100, 4096, 65_535, 65_536, 65_537, 300_000, MiB, 3 * MiB + 7] * 2
    keys = [f"mix/{i:02d}" for i in range(len(sizes))]
    raw = [os.urandom(size) for size in sizes]
    kinds = [bytes, bytearray, lambda b: np.frombuffer(b, dtype=np.uint8), memoryview]
    values = [kinds[i % len(kinds)](data) for i, data in enumerate(raw)]

    assert client.batch_put(keys, values) == [Status.OK] * len(keys)
    assert {segment_of(client, key) for key in keys} == {"seg0", "seg1"}

    assert client.batch_get(keys) == raw
    order = [5, "absent", 0, 5, 19, "also/absent", 12]
    asked = [keys[i] if isinstance(i, int) else i for i in order]
    assert client.batch_get(asked) == [raw[i] if isinstance(i, int) else None for i in order]

    buffers = [np.zeros(size, dtype=np.uint8) if i % 2 else bytearray(size) for i, size in enumerate(sizes)]
    assert client.batch_get_into(keys, buffers) == sizes
    assert [bytes(b) for b in buffers] == raw
    assert connector_types(client) == {CONNECTOR[transport]}


# ------------------------------------------------------------------ caller buffers of the wrong size


def test_buffers_of_the_wrong_size(cluster, transport):
    client = cluster.client(transport=transport)
    value = os.urandom(100_000)
    big = os.urandom(2 * MiB + 1)
    assert client.batch_put(["v", "big", "empty"], [value, big, b""]) == [Status.OK] * 3

    for size in (len(value) - 1, 1, 0):  # too small: refused before any byte moves
        arena, view = guarded(size)
        assert client.get_into("v", view) == Status.BUFFER_TOO_SMALL, size
        assert guards_intact(arena), f"bytes written into or around a {size}-byte buffer"

    arena, view = guarded(len(value))  # exact
    assert client.get_into("v", view) == len(value)
    assert view == value and guards_intact(arena, len(value))

    arena, view = guarded(3 * MiB)  # larger: the tail and the guards stay as they were
    assert client.get_into("big", view) == len(big)
    assert view[: len(big)] == big and guards_intact(arena, len(big))

    arena, view = guarded(0)  # an empty object fits an empty buffer
    assert client.get_into("empty", view) == 0 and guards_intact(arena)

    floats = np.zeros(len(value) // 4, dtype=np.float32)  # 100,000 bytes exactly
    assert client.get_into("v", floats) == len(value) and floats.tobytes() == value
    assert client.get_into("v", np.zeros(len(value) // 4 - 1, dtype=np.float32)) == Status.BUFFER_TOO_SMALL

    # In one batch, a too-small buffer fails alone and leaves the others' bytes right.
    arenas_views = [guarded(n) for n in (len(value) - 1, len(value), len(big) - 1, len(big) + 5, 10)]
    views = [v for _, v in arenas_views]
    results = client.batch_get_into(["v", "v", "big", "big", "absent"], views)
    assert results == [Status.BUFFER_TOO_SMALL, len(value), Status.BUFFER_TOO_SMALL, len(big), Status.NOT_FOUND]
    written = [0, len(value), 0, len(big), 0]
    assert all(guards_intact(a, w) for (a, _), w in zip(arenas_views, written, strict=True))
    assert views[1] == value and views[3][: len(big)] == big

    with pytest.raises(TypeError, match="read-only"):
        client.get_into("v", bytes(len(value)))


# ------------------------------------------------------------------ a segment server killed mid-batch


def test_a_segment_killed_mid_batch(bare_cluster, transport):
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("seg0")
    cluster.start_segment("seg1")
    client = cluster.client(transport=transport)
    keys = [f"k/{i:02d}" for i in range(24)]
    values = {k: os.urandom(20 * KiB + i) for i, k in enumerate(keys)}
    assert client.batch_put(keys, list(values.values())) == [Status.OK] * len(keys)
    placement: dict[str, list[str]] = {}
    for key in keys:
        placement.setdefault(segment_of(client, key), []).append(key)
    assert set(placement) == {"seg0", "seg1"}
    lost, kept = placement["seg0"], placement["seg1"]
    assert client.batch_get(keys) == list(values.values())  # connections to both segments are open
    assert connector_types(client) == {CONNECTOR[transport]}

    cluster.kill(cluster.segments["seg0"])

    # The master still lists seg0: its keys fail (never raise) or, over shm only, where the
    # dead process's region file is still mapped, return exactly the stored bytes.
    mixed = [key for pair in zip(lost, kept, strict=False) for key in pair]  # interleaved: one batch, both segments
    for key, got in zip(mixed, client.batch_get(mixed), strict=True):
        if key in kept:
            assert got == values[key], key
        elif transport == "tcp":
            assert got is None, key
        else:
            assert got is None or got == values[key], f"wrong bytes for {key}"
    buffers = [bytearray(32 * KiB) for _ in mixed]
    for key, result, buf in zip(mixed, client.batch_get_into(mixed, buffers), buffers, strict=True):
        size = len(values[key])
        if key in kept or (transport == "shm" and result >= 0):
            assert result == size and buf[:size] == values[key], key
        else:
            assert result < 0, key
    # A put now may be placed on the dead segment: it fails or (shm) lands in the orphaned mapping.
    early = client.batch_put([f"early/{i}" for i in range(6)], [b"e" * 5000] * 6)
    assert len(early) == 6 and all(isinstance(s, Status) for s in early)

    # Once the master dropped seg0, its keys are misses for every transport.
    timeout = cluster.segment_ttl_s + DROP_SLACK_S
    assert cluster.wait_for(lambda: not any(client.batch_exists(lost)), timeout=timeout), cluster.logs()
    assert [s.name for s in client.cluster_status().segments] == ["seg1"]
    assert client.batch_get(mixed) == [values[k] if k in kept else None for k in mixed]
    assert client.get_into(lost[0], bytearray(32 * KiB)) == Status.NOT_FOUND
    assert client.stats().get("checksum_mismatches", 0) == 0

    # New writes go to the survivor.
    new_keys = [f"new/{i}" for i in range(8)]
    new_values = [os.urandom(10 * KiB + i) for i in range(8)]
    assert client.batch_put(new_keys, new_values) == [Status.OK] * 8
    assert {segment_of(client, key) for key in new_keys} == {"seg1"}
    assert client.batch_get(new_keys + kept) == new_values + [values[k] for k in kept]


# ------------------------------------------------------------------ same-host copies shared by io threads


def test_a_large_same_host_batch_is_copied_by_several_threads_each_part_intact(bare_cluster):
    """One segment: a client whose copy pool exists shared a copy (kvtier.client.reads.split_copy).
    Every byte, whole-object CRC and chunk CRC written and read by parts must be the object's."""
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("seg0")
    alone = cluster.client(transport="shm", copy_threads=1)
    shared = cluster.client(transport="shm", copy_threads=2)
    reader = cluster.client(transport="shm", copy_threads=2)
    over_tcp = cluster.client(transport="tcp", copy_threads=2)
    sizes = [MiB, 3 * MiB + 7, 200_000, 128 * KiB, 2 * MiB - 1, MiB, MiB + 1, 700_001]
    values = [os.urandom(size) for size in sizes]
    keys = [f"split/{i}" for i in range(len(sizes))]
    for client in (alone, shared, reader, over_tcp):  # a first call makes the connectors: only a made one is shared
        assert client.batch_put([f"warm/{id(client)}"], [b"w" * 10]) == [Status.OK]
    assert connector_types(over_tcp) == {TcpConnector}
    # Small objects and read-only values (bytes) are copied holding the GIL: never shared (no gain).
    small = [os.urandom(64 * KiB) for _ in range(64)]
    assert shared.batch_put([f"small/{i}" for i in range(64)], small) == [Status.OK] * 64
    assert shared.batch_get([f"small/{i}" for i in range(64)]) == small
    assert shared.batch_put([f"ro/{i}" for i in range(len(sizes))], values) == [Status.OK] * len(sizes)
    assert shared._copy_pool is None
    writable = [bytearray(v) for v in values]
    assert shared.batch_put(keys, writable) == [Status.OK] * len(keys)
    assert shared._copy_pool is not None, "the write was not shared"
    assert alone.batch_get(keys) == values  # read by one thread, verified against the parts' CRCs
    assert alone.batch_get([f"ro/{i}" for i in range(len(sizes))]) == values
    for key, value in zip(keys, values, strict=True):  # chunk CRCs (kvtier.client.chunks) of the parts
        assert alone.get_ranges(key, [(0, 1), (len(value) - 5, 5), (65_536, 1000)]) == [
            value[:1],
            value[-5:],
            value[65_536:66_536],
        ], key
    assert reader.batch_get(keys) == values
    assert reader._copy_pool is None, "new bytes objects are made holding the GIL: not shared"
    buffers = [bytearray(size) for size in sizes]
    assert reader.batch_get_into(keys, buffers) == sizes
    assert reader._copy_pool is not None, "the read was not shared"
    assert [bytes(b) for b in buffers] == values
    assert alone.batch_put([f"one/{i}" for i in range(len(sizes))], writable) == [Status.OK] * len(sizes)
    assert shared.batch_get_into([f"one/{i}" for i in range(len(sizes))], buffers) == sizes
    assert [bytes(b) for b in buffers] == values
    assert over_tcp.batch_put([f"tcp/{i}" for i in range(len(sizes))], writable) == [Status.OK] * len(sizes)
    assert over_tcp.batch_get_into(keys, buffers) == sizes and [bytes(b) for b in buffers] == values
    for client in (alone, over_tcp):
        assert client._copy_pool is None and client._pool is None
    for client in (alone, shared, reader, over_tcp):
        assert client.stats().get("checksum_mismatches", 0) == 0


def test_a_shared_copy_never_waits_behind_another_calls_transfer(bare_cluster):
    """The io pool may be held by transfers to a slow segment; a same-host copy's parts have a pool
    of their own, so the copy finishes meanwhile (here: the only io thread waits on an event)."""
    cluster = bare_cluster
    cluster.start_master()
    cluster.start_segment("seg0")
    client = cluster.client(transport="shm", copy_threads=2, io_threads=1)
    sizes = [MiB] * 8
    values = [bytearray(os.urandom(size)) for size in sizes]
    keys = [f"hol/{i}" for i in range(len(sizes))]
    assert client.batch_put(["warm"], [b"w"]) == [Status.OK]
    held, release = threading.Event(), threading.Event()

    def hold_the_io_thread() -> None:
        held.set()
        release.wait(60)

    blocker = threading.Thread(target=client._run_parallel, args=([(lambda: None,), (hold_the_io_thread,)],))
    blocker.start()
    try:
        assert held.wait(10)
        done: list = []
        buffers = [bytearray(size) for size in sizes]
        copier = threading.Thread(
            target=lambda: done.extend([client.batch_put(keys, values), client.batch_get_into(keys, buffers)])
        )
        copier.start()
        copier.join(30)
        assert not copier.is_alive(), "the copy waited for the io thread"
        assert done == [[Status.OK] * len(keys), sizes] and [bytes(b) for b in buffers] == values
        assert client._copy_pool is not None
    finally:
        release.set()
        blocker.join(10)


# ------------------------------------------------------------------ choosing the transport


def test_kvtier_transport_picks_the_connector(cluster, monkeypatch):
    keys, values = ["a", "b", "c", "d"], [b"1" * 100, b"2" * 100, b"3" * 100, b"4" * 100]
    for env, expected in [("tcp", TcpConnector), ("shm", ShmConnector), (None, ShmConnector), (" TCP ", TcpConnector)]:
        if env is None:
            monkeypatch.delenv("KVTIER_TRANSPORT", raising=False)
        else:
            monkeypatch.setenv("KVTIER_TRANSPORT", env)
        client = cluster.client()  # reads KVTIER_TRANSPORT now
        assert client.batch_put(keys, values) == [Status.OK] * 4
        assert client.batch_get(keys) == values
        assert set(client._connectors) == {"seg0", "seg1"}
        assert connector_types(client) == {expected}, f"KVTIER_TRANSPORT={env!r}: same host, shm unless forced"
    monkeypatch.setenv("KVTIER_TRANSPORT", "tcp")
    client = cluster.client(transport="shm")  # an explicit choice wins over the environment
    assert client.batch_get(keys) == values
    assert connector_types(client) == {ShmConnector}


# ------------------------------------------------------------------ the master fast path


def exercise_every_operation(client) -> None:
    """Every Client operation that reaches the master, with its expected result."""
    objects = client.cluster_status().objects
    value = os.urandom(50_000)
    client.put("op/one", value)
    assert client.batch_put(["op/a", "op/b", "op/c"], [b"a", b"bb", b""]) == [Status.OK] * 3
    assert client.get("op/one") == value
    assert client.batch_get(["op/a", "op/b", "op/c", "op/none"]) == [b"a", b"bb", b"", None]
    buf = bytearray(len(value))
    assert client.get_into("op/one", buf) == len(value) and buf == value
    assert client.exists("op/one") and not client.exists("op/none")
    assert client.batch_exists(["op/a", "op/none"]) == [True, False]
    assert client.longest_prefix(["op/a", "op/b", "op/none", "op/c"]) == 2
    assert client.locate("op/one")[0]["size"] == len(value)
    assert client.remove("op/a") and not client.remove("op/a")
    assert client.batch_remove(["op/b", "op/none"]) == [Status.OK, Status.NOT_FOUND]
    assert client.remove_prefix("op/") == 2
    assert client.batch_get(["op/one", "op/c"]) == [None, None]
    assert client.cluster_status().objects == objects


def test_the_fast_path_is_used_when_the_master_offers_it(cluster):
    assert cluster.master.info["fast_endpoint"].startswith("tcp://127.0.0.1:")
    client = cluster.client()
    assert not client._master.fast_path_active, "learned from Hello on the first hot call"
    exercise_every_operation(client)
    assert client._master.fast_path_active


def test_every_operation_works_over_grpc_when_the_fast_path_is_off(bare_cluster):
    bare_cluster.start_master("--fast-listen", "off")
    bare_cluster.start_segment("seg0")
    assert bare_cluster.master.info["fast_endpoint"] == ""
    client = bare_cluster.client()
    exercise_every_operation(client)
    assert not client._master.fast_path_active
    exercise_every_operation(client)
    assert not client._master.fast_path_active


def break_fast_sockets(client) -> None:
    """Shut down the client's idle fast-path sockets (as a dead connection): nothing can be sent on them."""
    pool = client._master._fast
    assert pool is not None and pool._idle, "no idle fast-path socket to break"
    for sock in pool._idle:
        sock.shutdown(socket.SHUT_RDWR)


def make_fast_path_unreachable(client) -> None:
    """Close the client's idle fast-path sockets and point its pool at a port nobody listens on."""
    pool = client._master._fast
    assert pool is not None
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead = closed.getsockname()[:2]
    for sock in pool._idle:
        sock.shutdown(socket.SHUT_RDWR)
    pool.address = dead


class FakeFastPath:
    """A fast-path peer that reads each request frame whole, then misbehaves instead of answering."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.behavior = "hang up"
        self.requests: list[int] = []  # method ids received
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    _, method, request_id, size = rpcframe.HEADER.unpack(recv_exact(conn, rpcframe.HEADER.size))
                    recv_exact(conn, size)
                    self.requests.append(method)
                    if self.behavior == "error frame":
                        reason = b"refused"
                        conn.sendall(rpcframe.HEADER.pack(rpcframe.MAGIC, 0, request_id, len(reason)) + reason)
                    elif self.behavior == "bad magic":
                        conn.sendall(rpcframe.HEADER.pack(0xBEEF, method, request_id, 0))
                    elif self.behavior == "wrong request id":
                        conn.sendall(rpcframe.HEADER.pack(rpcframe.MAGIC, method, request_id + 1, 0))
                    elif self.behavior == "half a header":
                        conn.sendall(b"KM\x01")
                except (OSError, ConnectionError):
                    pass

    def install(self, client) -> None:
        """Point the client's fast path at this peer (its real pool, if any, is closed)."""
        master = client._master
        old, master._fast = master._fast, SocketPool(self.address, 5.0, 2, "fake master fast path")
        if old is not None:
            old.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(10.0)


@pytest.fixture
def fake_fast_path():
    fake = FakeFastPath()
    yield fake
    fake.close()


def test_a_dead_fast_path_connection_falls_back_to_grpc(cluster, monkeypatch):
    monkeypatch.setattr(master_module, "_HELLO_RETRY_S", 0.1)  # ask Hello again sooner than 1 s
    client = cluster.client()
    value = os.urandom(30_000)
    client.put("fp", value)
    assert client.get("fp") == value and client._master.fast_path_active

    def back_on_the_fast_path() -> bool:
        return client.get("fp") == value and client._master.fast_path_active

    # A dead idle socket (as after a master restart) is noticed before use and replaced.
    break_fast_sockets(client)
    assert client.get("fp") == value
    assert client._master.fast_path_active, "a dead idle socket is replaced, the fast path stays"
    # A fast path that cannot be reached at all: the request cannot even be sent, gets and puts go
    # over gRPC, and a later Hello brings the fast path back.
    make_fast_path_unreachable(client)
    assert client.get("fp") == value
    assert not client._master.fast_path_active, "the broken fast path is dropped"
    assert cluster.wait_for(back_on_the_fast_path, timeout=10.0), "Hello again, and the fast path is back"
    make_fast_path_unreachable(client)
    assert client.batch_put(["fp/1", "fp/2"], [b"one", b"two"]) == [Status.OK, Status.OK]
    assert client.batch_get(["fp/1", "fp/2"]) == [b"one", b"two"]
    assert cluster.wait_for(back_on_the_fast_path, timeout=10.0)
    exercise_every_operation(client)


def test_a_fast_path_broken_after_the_request_went_out(cluster, monkeypatch, fake_fast_path):
    """Repeatable calls are repeated over gRPC; a PutStart is not (it may have allocated): UNAVAILABLE."""
    monkeypatch.setattr(master_module, "_HELLO_RETRY_S", 0.1)
    client = cluster.client()
    value = os.urandom(30_000)
    client.put("fp", value)
    for behavior in ("hang up", "error frame", "bad magic", "wrong request id", "half a header"):
        fake_fast_path.behavior = behavior
        fake_fast_path.install(client)
        assert client.get("fp") == value, behavior
        assert not client._master.fast_path_active, behavior
        fake_fast_path.install(client)
        assert client.batch_exists(["fp", "nope"]) == [True, False], behavior
        fake_fast_path.install(client)
        assert client.batch_put([f"fp/{behavior}"], [b"x"]) == [Status.UNAVAILABLE], behavior
        assert client.get(f"fp/{behavior}") is None, behavior
    methods = rpcframe.METHOD_IDS
    assert fake_fast_path.requests == [methods["GetReplicas"], methods["Exists"], methods["PutStart"]] * 5
    assert cluster.wait_for(lambda: client.get("fp") == value and client._master.fast_path_active, timeout=10.0)
    client.put("fp/after", b"after")
    assert client.get("fp/after") == b"after"
