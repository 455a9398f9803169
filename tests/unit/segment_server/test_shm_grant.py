"""The shm grant socket: a real ShmListener (on a uvloop in a thread) and real Unix sockets.

The client side is the real one (`request_region`, `ShmConnector`), or raw
sockets where a test plays a misbehaving peer. Refusals by uid run against a
server that does not allow this process's uid (a real second user is in
tests/integration/test_shm_grant.py).
"""

from __future__ import annotations

import fcntl
import gc
import os
import pwd
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from kvtier.client.config import ClientConfig
from kvtier.client.transport.shm import ShmConnector, request_region
from kvtier.proto.errors import ConnectError
from kvtier.proto.region import host_id
from kvtier.segment_server.config import SegmentConfig
from kvtier.segment_server.region import (
    MAX_SOCKET_PATH,
    SEALS,
    DramRegion,
    grant_socket_path,
    region_path,
    remove_if_orphaned,
    remove_orphans,
    remove_stale_socket,
)
from kvtier.segment_server.shm_grant import GrantServer, GrantStats, parse_uids, reopen
from tests.grants import wait_until

CONFIG = ClientConfig(master="127.0.0.1:1", timeout=5.0)
ME = os.geteuid()


def raw_peer(path: str) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.settimeout(5.0)
    peer.connect(path)
    return peer


def reply_of(peer: socket.socket) -> tuple[bytes, list[int]]:
    """Everything the server sends until it closes: (bytes, fds received)."""
    data, fds = b"", []
    while True:
        try:
            chunk, received, _flags, _ = socket.recv_fds(peer, 512, 4)
        except ConnectionResetError:  # closed with our request unread (refused at once): same as EOF
            return data, fds
        fds.extend(received)
        if not chunk:
            return data, fds
        data += chunk


def request(nonce: bytes) -> bytes:
    return b"KVTSHM1 " + nonce.hex().encode() + b"\n"


def fds_to(*targets: str) -> set[int]:
    """This process's descriptors open on one of `targets` (a path, or "socket:[inode]").

    Bounds are asserted on the objects under test, never on the whole fd table: other threads of the
    process (the grant loop, gRPC left by earlier tests) open and close descriptors of their own at any
    time. gc.collect() first, so that a descriptor only garbage holds is not counted as a leak."""
    gc.collect()
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in targets:
                fds.add(int(name))
        except FileNotFoundError:  # closed meanwhile (the directory listing itself, or another thread's)
            continue
    return fds


def region_target(region) -> str:
    """What /proc shows for the region's memory (a memfd: "/memfd:... (deleted)"), not its lock file's path."""
    return os.readlink(f"/proc/self/fd/{region.fileno()}")


def socket_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")  # "socket:[inode]"


def results(stats: GrantStats) -> dict[str, int]:
    """The outcomes that happened (non-zero counts)."""
    return {name: count for name, count in stats.results.items() if count}


# ------------------------------------------------------------------ granted


def test_a_peer_of_the_service_uid_gets_the_region_and_maps_it(region, grants, sock_path):
    url, listener = grants.serve(sock_path, region.fileno(), region.nonce)

    parts = urlsplit(url)
    assert parts.scheme == "shm" and unquote(parts.path) == sock_path
    assert parse_qs(parts.query) == {"host": [host_id()], "nonce": [region.nonce.hex()], "uid": [str(ME)]}
    info = os.lstat(sock_path)
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o666, "anyone may ask; uids decide"

    fd = request_region(sock_path, region.nonce, ME, 5.0)
    try:
        got, mine = os.fstat(fd), os.fstat(region.fileno())
        assert (got.st_dev, got.st_ino) == (mine.st_dev, mine.st_ino), "the region file itself"
        assert os.get_inheritable(fd) is False
        # The sealed memfd, never the lock file: the region's ownership lock does not travel with
        # it, so a client's mapping cannot make a dead server's region look alive to its successor.
        assert (got.st_dev, got.st_ino) != (os.stat(region.path).st_dev, os.stat(region.path).st_ino)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS, "nobody it is granted to can resize it"
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        os.close(fd)

    connector = ShmConnector(url, CONFIG)
    try:
        assert connector.write([(100, memoryview(b"granted bytes"))]) == [0]
        assert bytes(region.view[100:113]) == b"granted bytes"
        region.view[200:205] = b"other"
        assert connector.read([(200, 5)]) == [b"other"]
    finally:
        connector.close()
    assert wait_until(lambda: results(listener.stats) == {"granted": 2})
    assert wait_until(lambda: listener.stats.active == 0), "the conversation slot is given back"


def test_a_refused_uid_gets_a_reason_and_no_fd(region, grants, sock_path):
    stats = GrantStats()
    fd = reopen(region.fileno())
    server = GrantServer(sock_path, fd, region.nonce, frozenset({ME + 1}), stats)
    grants.run(server.start())
    try:
        with pytest.raises(ConnectError, match=f"refused to grant its region: uid {ME} may not map this region"):
            request_region(sock_path, region.nonce, ME, 5.0)
        with raw_peer(sock_path) as peer:
            peer.sendall(request(region.nonce))
            data, fds = reply_of(peer)
        assert fds == [], "no fd with a refusal"
        assert data.startswith(b"ERR uid ") and data.endswith(b"in shm_allowed_uids)\n") and data.count(b"\n") == 1
        assert wait_until(lambda: results(stats) == {"refused_uid": 2})
    finally:
        grants.run(server.stop())
        os.close(fd)


def test_a_wrong_nonce_is_refused_before_any_fd_is_sent(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    with raw_peer(sock_path) as peer:
        peer.sendall(request(bytes(16)))
        data, fds = reply_of(peer)
    assert (data, fds) == (b"ERR nonce mismatch: this socket serves another region\n", [])
    with pytest.raises(ConnectError, match="nonce mismatch"):
        request_region(sock_path, region.nonce[::-1], ME, 5.0)
    assert wait_until(lambda: results(listener.stats) == {"refused_nonce": 2})


@pytest.mark.parametrize(
    "sent",
    [b"GET / HTTP/1.0\r\n\r\n", b"KVTSHM1\n", b"KVTSHM2 " + bytes(16).hex().encode() + b"\n", b"x" * 300],
    ids=["http", "no-nonce", "other-version", "overlong-no-newline"],
)
def test_malformed_requests_are_refused_at_once(region, grants, sock_path, sent):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce, timeout_s=30.0)
    started = time.monotonic()
    with raw_peer(sock_path) as peer:
        peer.sendall(sent)
        data, fds = reply_of(peer)
    assert data == b"ERR malformed request: expected KVTSHM1 <nonce hex> [writer]\n" and fds == []
    assert time.monotonic() - started < 5.0, "refused without waiting for the timeout"
    assert wait_until(lambda: results(listener.stats) == {"malformed": 1})


def test_a_peer_that_hangs_up_is_counted_as_an_error(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    raw_peer(sock_path).close()
    assert wait_until(lambda: results(listener.stats) == {"error": 1})
    assert wait_until(lambda: listener.stats.active == 0), "the conversation slot is given back"


# ------------------------------------------------------------------ bounded: silent peers, too many peers


@pytest.mark.parametrize("sent", [b"", b"KVTSHM1 00"], ids=["silent", "slowloris"])
def test_a_silent_or_slow_peer_times_out_and_blocks_nobody(region, grants, sock_path, sent):
    timeout = 1.0
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce, timeout_s=timeout)
    with raw_peer(sock_path) as stalled:
        started = time.monotonic()
        stalled.sendall(sent)
        assert wait_until(lambda: listener.stats.active == 1)
        os.close(request_region(sock_path, region.nonce, ME, 5.0))  # served meanwhile
        # a stalled peer delays nobody: the grant came while the stalled peer was still being waited for
        # (an ordering, not a wall-clock limit; a slow machine can only make the test fail to prove it)
        assert wait_until(lambda: results(listener.stats) == {"granted": 1}) and listener.stats.active == 1
        data, fds = reply_of(stalled)
        waited = time.monotonic() - started
    assert (data, fds) == (b"ERR timeout: no request within 1.0s\n", [])
    assert waited >= timeout * 0.9, "the stalled peer got its full timeout"
    assert wait_until(lambda: results(listener.stats) == {"granted": 1, "timeout": 1})
    assert wait_until(lambda: listener.stats.active == 0), "the conversation slot is given back"


def test_too_many_concurrent_peers_are_refused_with_a_clear_reason(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce, timeout_s=30.0, max_connections=2)
    stalled = [raw_peer(sock_path) for _ in range(2)]
    try:
        assert wait_until(lambda: listener.stats.active == 2)
        with raw_peer(sock_path) as third:
            try:
                third.sendall(request(region.nonce))
            except BrokenPipeError:
                pass  # refused before it could ask
            data, fds = reply_of(third)
        assert (data, fds) == (b"ERR busy: 2 grant requests in progress, try again later\n", [])
        with pytest.raises(ConnectError, match="refused to grant its region: busy"):
            request_region(sock_path, region.nonce, ME, 5.0)
        assert wait_until(lambda: results(listener.stats) == {"busy": 2})
    finally:
        for peer in stalled:
            peer.close()
    # Once the stalled peers are gone, their slots are free again.
    assert wait_until(lambda: listener.stats.active == 0)
    os.close(request_region(sock_path, region.nonce, ME, 5.0))
    assert wait_until(lambda: results(listener.stats) == {"busy": 2, "error": 2, "granted": 1})


def test_stop_cuts_conversations_in_progress(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce, timeout_s=30.0)
    with raw_peer(sock_path) as stalled:
        assert wait_until(lambda: listener.stats.active == 1)
        grants.stop(listener)
        assert reply_of(stalled) == (b"", []), "closed, nothing granted"
    assert wait_until(lambda: listener.stats.active == 0), "the conversation slot is given back"
    assert not os.path.exists(sock_path)


# ------------------------------------------------------------------ the socket file: created, replaced, removed


def test_stop_removes_the_socket_file_and_closes_the_granted_fd(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    assert listener._server is not None and listener._server._sock is not None
    listening = socket_of(listener._server._sock.fileno())
    assert os.readlink(f"/proc/self/fd/{listener._fd}") == region_target(region)
    before = fds_to(region_target(region), listening)
    mine = {listener._fd, listener._server._sock.fileno()}
    assert mine <= before
    grants.stop(listener)
    assert not os.path.exists(sock_path)
    assert fds_to(region_target(region), listening) == before - mine, "the listening socket and the reopened region fd"
    grants.stop(listener)  # twice is fine
    with pytest.raises(ConnectError, match="cannot get the region"):
        request_region(sock_path, region.nonce, ME, 5.0)


def test_stop_leaves_a_socket_file_that_is_not_its_own(region, grants, sock_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    os.unlink(sock_path)
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(sock_path)  # someone else's now
        grants.stop(listener)
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode), "not ours: kept"


def test_a_stale_socket_of_a_dead_process_is_replaced(region, grants, sock_path):
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(sock_path)  # bound, never listened, closed: what a killed server leaves
    assert os.path.exists(sock_path)
    url, _ = grants.serve(sock_path, region.fileno(), region.nonce)
    ShmConnector(url, CONFIG).close()


def test_a_live_socket_or_a_foreign_file_is_never_replaced(region, grants, sock_path, tmp_path):
    _, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    with pytest.raises(FileExistsError, match="served by a live process"):
        grants.serve(sock_path, region.fileno(), region.nonce)
    os.close(request_region(sock_path, region.nonce, ME, 5.0))  # the first one still serves
    foreign = tmp_path / "kvtier.tg.foreign.sock"
    foreign.write_bytes(b"a file")
    with pytest.raises(FileExistsError, match="not a socket"):
        grants.serve(str(foreign), region.fileno(), region.nonce)
    assert foreign.read_bytes() == b"a file"


def test_grant_socket_path_fits_a_unix_socket():
    assert grant_socket_path("/dev/shm", "c1", "seg0") == "/dev/shm/kvtier.c1.seg0.sock"
    long_name = "n" * 120
    path = grant_socket_path("/dev/shm", "c" * 64, long_name)
    assert len(path) <= MAX_SOCKET_PATH and path.startswith("/dev/shm/kvtier." + "c" * 64 + ".h")
    assert path == grant_socket_path("/dev/shm", "c" * 64, long_name), "stable"
    assert path != grant_socket_path("/dev/shm", "c" * 64, "m" * 120)
    short = tempfile.mkdtemp(prefix="g", dir="/tmp")
    try:
        with socket.socket(socket.AF_UNIX) as s:  # the fallback is bindable
            s.bind(grant_socket_path(short, "c" * 50, long_name))
    finally:
        shutil.rmtree(short)


# ------------------------------------------------------------------ orphans of dead processes


def leftover(tmp_path: Path, shm: Path, cluster: str, name: str) -> tuple[Path, Path]:
    """A region file and a grant socket as a killed server leaves them: (region, socket)."""
    template = DramRegion(region_path(str(tmp_path), cluster, name), 4096, cluster, name).open()
    target = Path(region_path(str(shm), cluster, name))
    target.write_bytes(Path(template.path).read_bytes())
    template.close()
    sock = Path(grant_socket_path(str(shm), cluster, name))
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(sock))
    return target, sock


def test_orphan_cleanup_removes_dead_sockets_and_keeps_live_ones(tmp_path, grants):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead_region, dead_sock = leftover(tmp_path, shm, "c1", "dead")
    lone_sock = shm / "kvtier.c1.lone.sock"  # its region deleted by hand, nobody listening
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(lone_sock))
    live = DramRegion(region_path(str(shm), "c1", "live"), 4096, "c1", "live").open()
    try:
        live_sock = grant_socket_path(str(shm), "c1", "live")
        _, listener = grants.serve(live_sock, live.fileno(), live.nonce)
        # A live server whose region file was deleted by hand still serves its socket.
        live_lone = shm / "kvtier.c1.lonelive.sock"
        _, lone_listener = grants.serve(str(live_lone), live.fileno(), live.nonce)
        other_cluster = shm / "kvtier.c2.x.sock"
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(str(other_cluster))

        assert remove_orphans(str(shm), "c1") == 1
        assert not dead_region.exists() and not dead_sock.exists() and not lone_sock.exists()
        assert os.path.exists(live.path) and os.path.exists(live_sock) and live_lone.exists()
        assert other_cluster.exists(), "another cluster's files are its own business"
        assert wait_until(lambda: results(lone_listener.stats) == {"error": 1}), "probed: it answered"
        assert results(listener.stats) == {}, "a socket paired with a locked region is not even probed"
        os.close(request_region(live_sock, live.nonce, ME, 5.0))
    finally:
        for each in grants.listeners:
            grants.stop(each)
        live.close()


def test_a_restart_removes_the_previous_incarnations_socket_with_its_region(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead_region, dead_sock = leftover(tmp_path, shm, "c1", "seg0")
    assert remove_if_orphaned(str(dead_region)) is True
    assert not dead_sock.exists()
    assert remove_stale_socket(str(dead_sock)) is False  # nothing left


# ------------------------------------------------------------------ configuration


def test_parse_uids():
    assert parse_uids("") == parse_uids("  ") == frozenset()
    assert parse_uids("1000") == {1000}
    assert parse_uids("1000, 1001 ,0") == {0, 1000, 1001}
    assert parse_uids(f"root,nobody,{pwd.getpwnam('nobody').pw_uid}") == {0, pwd.getpwnam("nobody").pw_uid}
    for bad, message in [
        ("no-such-user-kvtier", "no user named 'no-such-user-kvtier'"),
        ("1000,,1001", "empty entry"),
        ("-1", "no user named '-1'"),
        (str(2**32 - 1), "not a valid uid"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_uids(bad)


def test_segment_config_validates_shm_allowed_uids_and_the_socket_path(tmp_path):
    assert SegmentConfig(shm_allowed_uids="0, nobody").validate().shm_allowed_uids == "0, nobody"
    with pytest.raises(ValueError, match="^shm_allowed_uids: no user named 'ghost'"):
        SegmentConfig(shm_allowed_uids="ghost").validate()
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    with pytest.raises(ValueError, match="shm_dir .* is too long for the grant socket's path"):
        SegmentConfig(shm_dir=str(deep)).validate()


# ------------------------------------------------------------------ the client against a misbehaving server


def test_the_client_closes_the_granted_descriptor(region, grants, sock_path):
    url, listener = grants.serve(sock_path, region.fileno(), region.nonce)
    ShmConnector(url, CONFIG).close()  # warm up: the grant loop's own descriptors are all open now
    assert wait_until(lambda: listener.stats.active == 0)
    before = fds_to(region_target(region))
    assert listener._fd in before  # the grant server's; the region's own are the others
    connector = ShmConnector(url, CONFIG)
    try:
        assert wait_until(lambda: listener.stats.results["granted"] == 2 and listener.stats.active == 0)
        # Python's mmap keeps a private duplicate (close-on-exec) for the mapping's life; nothing else.
        extra = fds_to(region_target(region)) - before
        assert len(extra) <= 1 and fds_to(region_target(region)) >= before, extra
        assert not any(os.get_inheritable(fd) for fd in extra)
        assert connector.read([(0, 4)]) == [bytes(region.view[:4])]
    finally:
        connector.close()
    assert fds_to(region_target(region)) == before, "nothing of the region is left open once the connector is closed"


class FakeGrantServer:
    """Answers one grant request with `reply` and `fds` (or nothing at all), from a thread."""

    def __init__(self, path: str, reply: bytes | None, fds: list[int]) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.reply, self.fds = reply, fds
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(128)
            if self.reply is not None:
                socket.send_fds(conn, [self.reply], self.fds)
            self.done.wait(10.0)  # hold the connection open until the test is done

    def close(self) -> None:
        self.done.set()
        self.thread.join(10.0)
        self.listener.close()


@pytest.mark.parametrize(
    ("reply", "nfds", "error"),
    [
        ("OK {nonce}\n", 2, "sent more than one file descriptor"),
        ("OK {nonce}\n", 0, "unexpected answer .* with 0 fds"),
        ("OK {other}\n", 1, "unexpected answer"),
        ("HELLO\n", 1, "unexpected answer"),
        (None, 0, "no answer from the grant socket .* within 0.3s"),
    ],
    ids=["two-fds", "no-fd", "other-nonce", "garbage", "silent"],
)
def test_a_misbehaving_grant_server_is_refused_and_leaks_no_descriptor(region, sock_path, reply, nfds, error):
    before = fds_to(region_target(region))
    sent = [reopen(region.fileno()) for _ in range(nfds)]
    text = None if reply is None else reply.format(nonce=region.nonce.hex(), other=bytes(16).hex()).encode()
    fake = FakeGrantServer(sock_path, text, sent)
    try:
        with pytest.raises(ConnectError, match=error):
            request_region(sock_path, region.nonce, ME, 0.3)
    finally:
        fake.close()
        for fd in sent:
            os.close(fd)
    assert fds_to(region_target(region)) == before, "every descriptor received was closed"
