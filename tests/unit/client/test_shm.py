"""ShmConnector against a real DramRegion in a tmp directory: copies, checksums, refusals and close.

No processes: the test maps the region the way a same-host client maps a
segment server's, through the URL and the grant socket of a real `ShmListener`
(on an event loop in a thread, tests/grants.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import crc32c
import numpy as np
import pytest

from kvtier.client.client import as_bytes_view
from kvtier.client.config import ClientConfig
from kvtier.client.transport import shm
from kvtier.client.transport.shm import ShmConnector
from kvtier.proto.errors import ConnectError
from kvtier.proto.region import HEADER_SIZE, host_id
from kvtier.proto.status import Status
from kvtier.segment_server.region import SEALS, DramRegion, grant_socket_path, region_path
from tests.capability import require
from tests.grants import GrantLoop, open_fd, wait_until

KiB, MiB = 1 << 10, 1 << 20
CAPACITY = 16 * MiB
SIZES = [0, 1, 64 * KiB - 1, 64 * KiB, 256 * KiB + 3, 4 * MiB]
CONFIG = ClientConfig(master="127.0.0.1:1")
TIMEOUT_S = 10.0


def with_query(url: str, **changes: str | None) -> str:
    """`url` with some of its query parameters replaced (None: removed)."""
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    query = {k: v for k, v in query.items() if v is not None}
    return f"{parts.scheme}://{parts.path}?{urlencode(query)}"


@pytest.fixture
def region(tmp_path: Path):
    region = DramRegion(region_path(str(tmp_path), "tunit", "seg0"), CAPACITY, "tunit", "seg0").open()
    yield region
    region.close()


@pytest.fixture
def region_url(region: DramRegion, grants: GrantLoop, tmp_path: Path) -> str:
    """The endpoint URL exactly as a segment server advertises it, its grant socket served."""
    url, _ = grants.serve(grant_socket_path(str(tmp_path), "tunit", "seg0"), region.fileno(), region.nonce)
    return url


@pytest.fixture
def connectors(region_url: str):
    """Opens connectors to the region (or to a given URL); closes them at teardown."""
    opened: list[ShmConnector] = []

    def open_connector(url: str | None = None) -> ShmConnector:
        connector = ShmConnector(url or region_url, CONFIG)
        opened.append(connector)
        return connector

    yield open_connector
    for connector in opened:
        connector.close()


@pytest.fixture
def memmoves(monkeypatch) -> list[int]:
    """Sizes of the ctypes.memmove calls made during the test (the GIL-free copy path)."""
    calls: list[int] = []
    real = ctypes.memmove

    def spy(dst, src, count):
        calls.append(count)
        return real(dst, src, count)

    monkeypatch.setattr(ctypes, "memmove", spy)
    return calls


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + size).integers(0, 256, size, dtype=np.uint8).tobytes()


def chunks(size: int) -> int:
    """How many memmove calls the chunked path makes for `size` bytes (0 below the threshold)."""
    return 0 if size < shm._MEMMOVE_MIN else -(-size // shm._CHUNK)


# Sources of a write: how the caller holds its bytes. Writable ones take the ctypes path.
SOURCES = {
    "bytearray": lambda data: (memoryview(bytearray(data)), True),
    "memoryview-slice": lambda data: (memoryview(bytearray(b"xyz" + data + b"!"))[3 : 3 + len(data)], True),
    "numpy-uint8": lambda data: (memoryview(np.frombuffer(data, dtype=np.uint8).copy()), True),
    "bytes": lambda data: (memoryview(data), False),  # read-only: copied by slices
}


# Destinations of read_into: always writable (the client refuses read-only buffers).
def numpy_destination(size: int) -> tuple[memoryview, np.ndarray]:
    array = np.zeros(size, dtype=np.uint8)
    return memoryview(array), array


DESTINATIONS = {
    "bytearray": lambda size: (memoryview(bytearray(size)), None),
    "memoryview-slice": lambda size: (memoryview(bytearray(size + 8))[4 : 4 + size], None),
    "numpy-uint8": numpy_destination,
}


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_back_every_size_and_source(region, connectors, memmoves, source, size):
    connector = connectors()
    data = payload(size)
    buf, writable = SOURCES[source](data)
    offset = 4096 + 7  # an odd offset: no alignment is assumed
    checksums: list[int | None] = [None]

    assert connector.write([(offset, buf)], checksums) == [Status.OK]

    assert bytes(region.view[offset : offset + size]) == data, "the bytes are in the region"
    assert checksums == [crc32c.crc32c(data)]
    if writable:  # GIL-free ctypes path for large copies, in chunks
        assert len(memmoves) == chunks(size) and sum(memmoves) == (size if chunks(size) else 0), memmoves
    else:  # read-only source: no address to memmove from, copied by slices
        assert memmoves == []
    assert connector.read([(offset, size)]) == [data]


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("size", SIZES)
def test_read_into_every_size_and_destination(region, connectors, memmoves, destination, size):
    connector = connectors()
    data = payload(size, seed=1)
    offset = CAPACITY - size - 3
    region.view[offset : offset + size] = data
    view, owner = DESTINATIONS[destination](size)
    checksums: list[int | None] = [None]

    assert connector.read_into([(offset, view)], checksums) == [Status.OK]

    assert bytes(view) == data
    if owner is not None:
        assert owner.tobytes() == data
    assert checksums == [crc32c.crc32c(data)]
    assert len(memmoves) == chunks(size), "writable destinations take the ctypes path"
    assert sum(memmoves) == (size if chunks(size) else 0)


def test_a_float_array_round_trips_through_its_byte_view(connectors):
    connector = connectors()
    values = np.arange(300_000, dtype=np.float32)  # 1.2 MB: crosses several chunks
    source = as_bytes_view(values)
    checksums: list[int | None] = [None]
    assert connector.write([(0, source)], checksums) == [Status.OK]
    assert checksums == [crc32c.crc32c(values.tobytes())]

    out = np.empty_like(values)
    read_checksums: list[int | None] = [None]
    assert connector.read_into([(0, as_bytes_view(out))], read_checksums) == [Status.OK]
    assert np.array_equal(out, values)
    assert read_checksums == checksums


def test_a_batch_mixing_sizes_and_sources_fills_every_checksum(region, connectors):
    connector = connectors()
    datas = [payload(size, seed=2) for size in SIZES]
    offsets, position = [], 0
    for data in datas:
        offsets.append(position)
        position += len(data) + 13
    names = [list(SOURCES)[i % len(SOURCES)] for i in range(len(datas))]
    ranges = [(offset, SOURCES[name](data)[0]) for offset, data, name in zip(offsets, datas, names, strict=True)]
    checksums: list[int | None] = [None] * len(ranges)

    assert connector.write(ranges, checksums) == [Status.OK] * len(ranges)
    assert checksums == [crc32c.crc32c(d) for d in datas]

    buffers = [bytearray(len(d)) for d in datas]
    read_checksums: list[int | None] = [None] * len(ranges)
    reads = [(o, memoryview(b)) for o, b in zip(offsets, buffers, strict=True)]
    assert connector.read_into(reads, read_checksums) == [Status.OK] * len(ranges)
    assert [bytes(b) for b in buffers] == datas
    assert read_checksums == checksums
    assert connector.read(list(zip(offsets, map(len, datas), strict=True))) == datas
    assert connector.write(ranges) == [Status.OK] * len(ranges), "checksums are optional"


def test_two_connectors_and_the_segment_share_one_region(region, connectors):
    writer, reader = connectors(), connectors()
    data = payload(300 * KiB, seed=3)
    assert writer.write([(123, memoryview(bytearray(data)))]) == [Status.OK]
    assert reader.read([(123, len(data))]) == [data]
    region.view[123:124] = b"\x00"
    assert reader.read([(123, 1)]) == [b"\x00"]


def test_threads_copy_through_one_connector_concurrently(region, connectors):
    connector = connectors()
    size, count = 512 * KiB, 16
    datas = [payload(size, seed=10 + i) for i in range(count)]
    results: dict[int, tuple] = {}

    def worker(i: int) -> None:
        checksums: list[int | None] = [None]
        written = connector.write([(i * size, memoryview(bytearray(datas[i])))], checksums)
        out = bytearray(size)
        read = connector.read_into([(i * size, memoryview(out))])
        results[i] = (written, checksums[0], read, bytes(out))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(results) == count
    for i, data in enumerate(datas):
        assert results[i] == ([Status.OK], crc32c.crc32c(data), [Status.OK], data)
        assert bytes(region.view[i * size : (i + 1) * size]) == data


# ------------------------------------------------------------------ out of range


@pytest.mark.parametrize(
    ("offset", "size"),
    [
        (CAPACITY - 10, 20),  # straddles the end
        (CAPACITY - 10, 4 * MiB),  # straddles the end, large (the chunked path)
        (CAPACITY, 1),  # starts at the end
        (CAPACITY + 1, 0),  # an empty range past the end
        (2**63, 8),  # far past the end
    ],
)
def test_out_of_range_is_invalid_range_and_nothing_is_copied(region, connectors, offset, size):
    connector = connectors()
    region.view[CAPACITY - 64 * KiB :] = b"\xee" * (64 * KiB)
    good = payload(100, seed=4)
    checksums: list[int | None] = [None, None]

    statuses = connector.write([(offset, memoryview(b"\x11" * size)), (0, memoryview(good))], checksums)

    assert statuses == [Status.INVALID_RANGE, Status.OK], "a bad range fails alone"
    assert checksums == [None, crc32c.crc32c(good)]
    assert bytes(region.view[CAPACITY - 64 * KiB :]) == b"\xee" * (64 * KiB), "nothing written at the end"
    assert os.fstat(region.fileno()).st_size == HEADER_SIZE + CAPACITY, "the region did not grow"

    guard = bytearray(b"\x5a" * size)
    assert connector.read_into([(offset, memoryview(guard))], [None]) == [Status.INVALID_RANGE]
    assert guard == b"\x5a" * size, "nothing read into the buffer"
    assert connector.read([(offset, size), (0, 100)]) == [Status.INVALID_RANGE, good]


def test_a_range_ending_exactly_at_the_capacity_is_fine(region, connectors):
    connector = connectors()
    data = payload(70 * KiB, seed=5)
    assert connector.write([(CAPACITY - len(data), memoryview(data))]) == [Status.OK]
    assert connector.read([(CAPACITY - len(data), len(data)), (CAPACITY, 0)]) == [data, b""]


# ------------------------------------------------------------------ refusals: not the advertised region


def test_a_region_on_another_host_is_refused_before_asking(region_url, grants):
    (listener,) = grants.listeners
    for host in ("another-machine:another-boot", host_id() + "x", ""):
        with pytest.raises(ConnectError, match="another host"):
            ShmConnector(with_query(region_url, host=host), CONFIG)
    with pytest.raises(ConnectError, match="another host"):
        ShmConnector(with_query(region_url, host=None), CONFIG)
    assert sum(listener.stats.results.values()) == 0, "the grant socket was never asked"


def test_a_nonce_mismatch_is_refused(region, region_url, grants, tmp_path):
    (listener,) = grants.listeners
    for nonce in (bytes(16), region.nonce[::-1]):
        with pytest.raises(ConnectError, match="refused .*nonce mismatch"):
            ShmConnector(with_query(region_url, nonce=nonce.hex()), CONFIG)
    assert listener.stats.results["refused_nonce"] == 2, "refused by the server, before any fd was sent"
    assert listener.stats.results["granted"] == 0
    # A server granting another live region under this one's nonce: the client reads the header.
    other = DramRegion(region_path(str(tmp_path), "tunit", "seg1"), MiB, "tunit", "seg1").open()
    try:
        url, _ = grants.serve(str(tmp_path / "other.sock"), other.fileno(), region.nonce)
        with pytest.raises(ConnectError, match="not the advertised region \\(nonce mismatch\\)"):
            ShmConnector(url, CONFIG)
    finally:
        other.close()


MALFORMED = [{"nonce": "zz"}, {"nonce": "abc"}, {"nonce": "not hex"}, {"nonce": "ab" * 8}, {"nonce": ""}]
MALFORMED += [{"nonce": None}, {"uid": "x"}, {"uid": ""}, {"uid": None}]


@pytest.mark.parametrize("query", MALFORMED)
def test_a_malformed_nonce_or_uid_is_a_connect_error_not_a_crash(region_url, grants, query):
    with pytest.raises(ConnectError, match="malformed"):
        ShmConnector(with_query(region_url, **query), CONFIG)
    assert sum(grants.listeners[0].stats.results.values()) == 0, "refused before asking"


def test_a_grant_socket_of_another_uid_is_refused(region_url, grants):
    """The URL names the segment's uid: a socket served by anyone else is not trusted with our bytes."""
    (listener,) = grants.listeners
    with pytest.raises(ConnectError, match=f"served by uid {os.geteuid()}, not the segment's uid 4242"):
        ShmConnector(with_query(region_url, uid="4242"), CONFIG)
    assert wait_until(lambda: listener.stats.results["error"] == 1), "hung up without asking"
    assert sum(listener.stats.results.values()) == 1


def test_missing_sockets_are_refused(region, tmp_path):
    base = f"host={host_id()}&nonce={region.nonce.hex()}&uid={os.geteuid()}"
    for path in (tmp_path / "absent.sock", tmp_path, Path(region.path)):  # nothing, a directory, a plain file
        with pytest.raises(ConnectError, match="cannot get the region"):
            ShmConnector(f"shm://{path}?{base}", CONFIG)


def sealed_file(content: bytes) -> int:
    """A memfd holding `content`, sealed like a region (the caller closes it)."""
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, content)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_files_that_are_not_the_region_are_refused(region, grants, tmp_path):
    """A grant server handing out the wrong file (a bug, a stale fd): the client checks what it got."""
    header = bytes(region._map[:HEADER_SIZE])
    cases = [(b"", "not a kvtier region"), (b"KVTREGN1" + bytes(20), "not a kvtier region")]
    cases += [(os.urandom(2 * HEADER_SIZE), "not the advertised region")]
    # The real header (magic and nonce) on a file too short for its capacity.
    cases += [(header + bytes(100), "not the advertised region")]
    for i, (content, reason) in enumerate(cases):
        fd = sealed_file(content)
        try:
            url, _ = grants.serve(str(tmp_path / f"g{i}.sock"), fd, region.nonce)
        finally:
            os.close(fd)  # the listener keeps its own
        with pytest.raises(ConnectError, match=reason):
            ShmConnector(url, CONFIG)


@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, None])
def test_a_region_that_could_be_resized_is_never_mapped(region, grants, tmp_path, seals, caplog):
    """Anyone granted an unsealed region could shrink it under every mapping (SIGBUS): refused."""
    full = bytes(region._map[: HEADER_SIZE + CAPACITY])  # the real region's bytes, header and nonce
    if seals is None:  # a plain file, as regions were before memfds
        path = tmp_path / "plain.region"
        path.write_bytes(full)
        fd = open_fd(str(path))
    else:
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, full)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    try:
        url, listener = grants.serve(str(tmp_path / "unsealed.sock"), fd, region.nonce)
    finally:
        os.close(fd)
    with caplog.at_level("WARNING", logger="kvtier.client.transport.shm"):
        with pytest.raises(ConnectError, match="not sealed against resizing"):
            ShmConnector(url, CONFIG)
    assert "not mapping it; using the next transport" in caplog.text, "the fallback to TCP is logged"
    assert wait_until(lambda: listener.stats.results["granted"] == 1), "granted, then refused by the client"


def test_a_file_owned_by_another_uid_is_refused(region, grants, tmp_path):
    require("root", os.geteuid() == 0, "needs root to give a file to another uid (CI runs as root)")
    fd = sealed_file(bytes(region._map[: HEADER_SIZE + CAPACITY]))
    os.fchown(fd, 65534, 65534)
    try:
        url, _ = grants.serve(str(tmp_path / "copy.sock"), fd, region.nonce)
    finally:
        os.close(fd)
    with pytest.raises(ConnectError, match="not a region owned by uid 0"):
        ShmConnector(url, CONFIG)


# ------------------------------------------------------------------ close


def test_close_unmaps_and_later_calls_raise_connect_error(connectors):
    connector = connectors()
    assert connector.write([(0, memoryview(b"abc"))]) == [Status.OK]
    connector.close()
    assert connector._map.closed
    with pytest.raises(ConnectError, match="closed"):
        connector.write([(0, memoryview(b"abc"))])
    with pytest.raises(ConnectError, match="closed"):
        connector.read_into([(0, memoryview(bytearray(3)))])
    with pytest.raises(ConnectError, match="closed"):
        connector.read([(0, 3)])
    connector.close()  # twice is fine


@pytest.fixture
def paused_copy(monkeypatch):
    """Makes the next shm copies stop inside `_copy` until released: (entered, release) events."""
    entered, release = threading.Event(), threading.Event()
    real = shm._copy

    def copy(*args, **kwargs):
        entered.set()
        assert release.wait(TIMEOUT_S), "the test never released the copy"
        return real(*args, **kwargs)

    monkeypatch.setattr(shm, "_copy", copy)
    yield entered, release
    release.set()


@pytest.mark.parametrize("op", ["write", "read_into"])
def test_close_during_a_copy_defers_the_unmap_until_the_copy_finishes(region, connectors, paused_copy, op):
    entered, release = paused_copy
    connector = connectors()
    size = 4 * MiB
    data = payload(size, seed=6)
    if op == "read_into":
        region.view[:size] = data
    buf = bytearray(data) if op == "write" else bytearray(size)
    checksums: list[int | None] = [None]
    outcome: list = []

    def copy() -> None:
        try:
            outcome.append(getattr(connector, op)([(0, memoryview(buf))], checksums))
        except BaseException as exc:  # reported by the assertions below
            outcome.append(exc)

    thread = threading.Thread(target=copy)
    thread.start()
    try:
        assert entered.wait(TIMEOUT_S), "the copy never started"
        connector.close()  # returns at once: it does not wait for the copy

        assert not connector._map.closed, "unmapped under a running copy"
        with pytest.raises(ConnectError, match="closed"):
            connector.read([(0, 1)])  # new calls are refused while the copy finishes
        with pytest.raises(ConnectError, match="closed"):
            connector.write([(0, memoryview(b"x"))])
    finally:
        release.set()
        thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    assert outcome == [[Status.OK]]
    assert checksums == [crc32c.crc32c(data)]
    assert bytes(region.view[:size]) == data and bytes(buf) == data
    assert connector._map.closed, "the last copy out unmaps"
    with pytest.raises(ConnectError, match="closed"):
        connector.read_into([(0, memoryview(bytearray(1)))])


def test_raw_bytearrays_work_as_sources_and_targets(connectors):
    connector = connectors()
    data = bytearray(os.urandom(256 << 10))
    checksums: list[int | None] = [None]
    assert connector.write([(4096, data)], checksums) == [0]
    assert checksums[0] == crc32c.crc32c(data)
    target = bytearray(len(data))
    assert connector.read_into([(4096, target)]) == [0]
    assert target == data


# ---------------------------------------------------------------- grants of the segment's mount


def _mount(region: DramRegion, segment_id: int):
    """The region's segment mounted as `segment_id`: the session it publishes, and a grant of it."""
    from kvtier.proto.auth import wall_ms
    from kvtier.proto.frames import mount_session
    from kvtier.segment_server.mount_session import MountSession

    mount = MountSession(region.header)
    mount.set(segment_id, 11)
    return mount, (wall_ms() + 60_000, [], mount_session(segment_id, 11))


def test_no_copy_either_way_with_a_grant_of_an_earlier_mount(region, connectors):
    # given A's grant under mount 1, then the segment mounted again and B's object on A's range
    mount, old = _mount(region, 3)
    connector = connectors()
    mount.set(0, 0)
    mount.set(4, 11)
    region.view[0:5] = b"BBBBB"
    # when A reads (into a buffer and as bytes) and writes with its old grant
    into = memoryview(bytearray(5))
    reads = connector.read_into([(0, into)], [None], caps=old), connector.read([(0, 5)], caps=old)
    write = connector.write([(0, memoryview(b"AAAAA"))], [None], caps=old)
    # then each is refused, and B's bytes are untouched
    assert reads == ([Status.LEASE_EXPIRED], [Status.LEASE_EXPIRED]) and write == [Status.LEASE_EXPIRED]
    assert bytes(region.view[0:5]) == b"BBBBB" and bytes(into) == bytes(5)


def test_a_read_as_bytes_is_bounded_by_its_grants_expiry(region, connectors):
    from kvtier.proto.auth import wall_ms

    _, grant = _mount(region, 3)
    expired = (wall_ms() - 60_000, [], grant[2])
    assert connectors().read([(0, 5)], caps=expired) == [Status.LEASE_EXPIRED]
    assert connectors().read([(0, 5)], caps=grant) == [bytes(region.view[0:5])]


def test_a_large_write_stops_once_its_mount_ends(region, connectors, monkeypatch):
    # given a grant of the current mount and a value of eight copy chunks
    mount, grant = _mount(region, 3)
    connector = connectors()
    value = bytearray(b"A" * (8 * shm._CHUNK))
    real_memmove = ctypes.memmove
    copied = []

    def memmove_then_remount(dst, src, n):  # the mount ends after the first chunk is copied
        copied.append(n)
        if len(copied) == 1:
            mount.set(0, 0)
            mount.set(4, 11)
        return real_memmove(dst, src, n)

    monkeypatch.setattr(shm.ctypes, "memmove", memmove_then_remount)
    result = connector.write([(0, as_bytes_view(value))], [None], caps=grant)
    monkeypatch.undo()
    # then the copy stopped at that chunk: LEASE_EXPIRED, nothing of A past it in the region
    assert result == [Status.LEASE_EXPIRED] and len(copied) == 1
    assert bytes(region.view[shm._CHUNK : 2 * shm._CHUNK]) != b"A" * shm._CHUNK


def test_a_region_of_an_older_segment_that_publishes_no_session_is_copied_as_before(region, region_url):
    import struct

    # given a region whose header says format 1 (a segment from before mount sessions: none published)
    struct.pack_into("<I", region.header, 8, 1)
    connector = ShmConnector(region_url, CONFIG)
    try:
        from kvtier.proto.auth import wall_ms

        grant = (wall_ms() + 60_000, [], 12345)  # a new master names a session all the same
        # when a client copies with it, then the copy is served
        assert connector.write([(0, memoryview(b"x" * 5))], [None], caps=grant) == [Status.OK]
    finally:
        connector.close()
