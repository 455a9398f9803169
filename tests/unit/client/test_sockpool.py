"""SocketPool against a real loopback echo server; send_all and recv_exact over socket pairs."""

from __future__ import annotations

import contextlib
import errno
import itertools
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvtier.client.sockpool import (
    _IOV_MAX,
    SocketPool,
    call_deadline,
    recv_exact,
    recv_exact_into,
    recv_exact_into_all,
    send_all,
)
from kvtier.proto.errors import ConnectError, ReadError

TIMEOUT_S = 10.0


def wait_for(predicate, timeout: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class EchoServer:
    """A loopback TCP server echoing everything back; counts accepted and closed-by-peer connections."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.accepted = 0
        self.peer_closed = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
                thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _echo(self, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(1 << 16)
                if not data:
                    with self._lock:
                        self.peer_closed += 1
                    return
                conn.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self.listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(TIMEOUT_S)
        for conn in conns:
            conn.close()


@pytest.fixture
def server():
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def pools():
    """Creates pools; closes them at teardown."""
    created: list[SocketPool] = []

    def make(address, timeout: float = 5.0, limit: int = 4) -> SocketPool:
        pool = SocketPool(address, timeout, limit, "test server")
        created.append(pool)
        return pool

    yield make
    for pool in created:
        pool.close()


def echo(sock: socket.socket, message: bytes) -> bytes:
    send_all(sock, [message])
    return recv_exact(sock, len(message))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ SocketPool


def test_sockets_are_blocking_with_kernel_timeouts_and_nodelay(server, pools):
    pool = pools(server.address, timeout=0.2)
    with pool.socket() as sock:
        assert sock.gettimeout() is None
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert echo(sock, b"hello") == b"hello"
    with pytest.raises(OSError):  # a silent peer costs the receive timeout, it does not hang
        with pool.socket() as sock:
            sock.recv(1)
    assert sock.fileno() == -1, "a socket whose block raised is closed"


def receive_timeout(sock: socket.socket) -> float:
    seconds, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    return seconds + micros / 1e6


def test_a_call_deadline_bounds_an_exchange_and_the_pool_restores_its_timeouts(server, pools):
    pool = pools(server.address, timeout=TIMEOUT_S)
    with pool.socket() as sock:
        assert receive_timeout(sock) == pytest.approx(TIMEOUT_S, abs=0.01)
    token = call_deadline.set(time.monotonic() + 0.2)
    try:
        with pool.socket() as again:
            assert again is sock and receive_timeout(sock) <= 0.2
            assert echo(sock, b"within the deadline") == b"within the deadline"
    finally:
        call_deadline.reset(token)
    with pool.socket() as again:  # an exchange without a deadline waits the pool's timeout again
        assert again is sock and receive_timeout(sock) == pytest.approx(TIMEOUT_S, abs=0.01)
    token = call_deadline.set(time.monotonic() + 0.2)
    try:
        started = time.monotonic()
        with pytest.raises(OSError):  # a silent peer costs what is left of the call, not the pool's timeout
            with pool.socket() as sock:
                sock.recv(1)
        assert time.monotonic() - started < TIMEOUT_S / 2
    finally:
        call_deadline.reset(token)


def test_a_call_deadline_bounds_the_wait_for_a_free_socket(server, pools):
    pool = pools(server.address, timeout=TIMEOUT_S, limit=1)
    with pool.socket():
        token = call_deadline.set(time.monotonic() + 0.1)
        try:
            started = time.monotonic()
            with pytest.raises(ConnectError, match="no free connection"):
                with pool.socket():
                    pass
            assert time.monotonic() - started < TIMEOUT_S / 2
        finally:
            call_deadline.reset(token)


def test_threads_contending_never_open_more_than_the_limit(server, pools):
    limit, threads, rounds = 3, 12, 25
    pool = pools(server.address, timeout=TIMEOUT_S, limit=limit)
    lock = threading.Lock()
    in_use: set[int] = set()
    peak = {"in_use": 0, "open": 0}
    errors: list[str] = []
    start = threading.Barrier(threads)

    def worker(n: int) -> None:
        try:
            start.wait(TIMEOUT_S)
            for i in range(rounds):
                with pool.socket() as sock:
                    with lock:
                        if sock.fileno() in in_use:
                            errors.append(f"socket {sock.fileno()} handed to two threads at once")
                        in_use.add(sock.fileno())
                        peak["in_use"] = max(peak["in_use"], len(in_use))
                        peak["open"] = max(peak["open"], pool._open)
                    message = f"{n}/{i}".encode() * 50
                    if echo(sock, message) != message:
                        errors.append(f"wrong echo for {n}/{i}")
                    with lock:
                        in_use.discard(sock.fileno())
        except Exception as exc:  # reported below: a thread's exception would be lost
            errors.append(repr(exc))

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT_S * 2)
    assert not any(w.is_alive() for w in workers)
    assert errors == []
    assert 1 <= peak["in_use"] <= limit
    assert peak["open"] <= limit
    assert 1 <= server.accepted <= limit, "sockets are reused, never more than the limit opened"
    assert pool._open == len(pool._idle) <= limit


def test_an_exhausted_pool_waits_then_times_out_with_connect_error(server, pools):
    pool = pools(server.address, timeout=0.3, limit=1)
    with pool.socket() as held:
        with pytest.raises(ConnectError, match="no free connection to test server"):
            with pool.socket():
                pass
        assert echo(held, b"still mine") == b"still mine"
    with pool.socket() as again:
        assert again is held, "the healthy socket went back to the pool"
    assert server.accepted == 1


def test_a_waiter_gets_the_socket_once_it_is_returned(server, pools):
    pool = pools(server.address, timeout=TIMEOUT_S, limit=1)
    got: list = []

    def waiter() -> None:
        with pool.socket() as sock:
            got.append((sock, echo(sock, b"waited")))

    with pool.socket() as held:
        thread = threading.Thread(target=waiter)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive(), "no second socket while the only one is held"
    thread.join(TIMEOUT_S)
    assert got == [(held, b"waited")]
    assert server.accepted == 1


def test_a_waiter_times_out_even_when_woken_for_sockets_others_took(server, pools):
    """Wake-ups that do not free a socket (another thread took it first) must not restart the wait."""
    pool = pools(server.address, timeout=0.5, limit=1)
    stop = threading.Event()
    outcome: list = []

    def wake() -> None:
        while not stop.wait(0.02):
            with pool._cond:
                pool._cond.notify_all()

    def waiter() -> None:
        try:
            with pool.socket():
                outcome.append("got a socket")
        except ConnectError as exc:
            outcome.append(exc)

    waker = threading.Thread(target=wake)
    with pool.socket():
        waker.start()
        thread = threading.Thread(target=waiter)
        thread.start()
        thread.join(TIMEOUT_S)
        stop.set()
        waker.join(TIMEOUT_S)
        timed_out = not thread.is_alive()
        thread.join(TIMEOUT_S)
    assert timed_out, "the waiter's deadline kept moving with every wake-up"
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectError)


def test_a_socket_whose_block_raised_is_closed_not_reused(server, pools):
    pool = pools(server.address, timeout=0.5, limit=1)
    with pytest.raises(RuntimeError):
        with pool.socket() as broken:
            assert echo(broken, b"ok") == b"ok"
            raise RuntimeError("the exchange failed half way")
    assert broken.fileno() == -1
    assert pool._open == 0 and pool._idle == []
    with pool.socket() as fresh:  # the slot was freed: no wait, no timeout at limit 1
        assert fresh is not broken
        assert echo(fresh, b"fresh") == b"fresh"
    assert server.accepted == 2
    assert wait_for(lambda: server.peer_closed == 1)


def test_a_failed_connect_frees_its_slot(pools):
    pool = pools(("127.0.0.1", closed_port()), timeout=0.5, limit=1)
    for _ in range(3):
        with pytest.raises(ConnectError, match="cannot connect to test server"):
            with pool.socket():
                pass
    assert pool._open == 0


def test_close_closes_idle_sockets_and_those_returned_later(server, pools):
    pool = pools(server.address, limit=4)
    with contextlib.ExitStack() as stack:
        idle = [stack.enter_context(pool.socket()) for _ in range(3)]
        for sock in idle:
            assert echo(sock, b"x") == b"x"
    assert len(pool._idle) == 3
    with pool.socket() as in_use:
        pool.close()
        assert all(s.fileno() == -1 for s in idle if s is not in_use)
        assert echo(in_use, b"finishing") == b"finishing", "a socket in use is not pulled from under its user"
    assert in_use.fileno() == -1, "returned to a closed pool: closed"
    assert pool._idle == [] and pool._open == 0
    assert wait_for(lambda: server.peer_closed == 3)
    pool.close()  # twice is fine


# ------------------------------------------------------------------ send_all


@pytest.fixture
def pair():
    """A connected AF_UNIX stream pair with small buffers: a sender soon waits for its reader.

    The Python-level timeout makes the sockets non-blocking underneath, so a
    large `sendmsg` really returns after a part of its bytes.
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.settimeout(TIMEOUT_S)
    b.settimeout(TIMEOUT_S)
    yield a, b
    a.close()
    b.close()


class SlowReader(threading.Thread):
    """Reads `size` bytes in small pieces, pausing now and then."""

    def __init__(self, sock: socket.socket, size: int) -> None:
        super().__init__()
        self.sock, self.size = sock, size
        self.data = bytearray()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for n in itertools.count():
                if len(self.data) >= self.size:
                    return
                chunk = self.sock.recv(min(997, self.size - len(self.data)))
                if not chunk:
                    return
                self.data += chunk
                if n % 64 == 0:
                    time.sleep(0.001)
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> bytes:
        self.join(TIMEOUT_S)
        assert not self.is_alive() and self.error is None, self.error
        return bytes(self.data)


class RecordingSocket:
    """Delegates sendmsg to a real socket and records each call.

    With `budgets`, each call offers the kernel at most the next budget's bytes,
    so partial sends land at chosen places (inside a buffer, on a boundary, 1 byte).
    Like Linux, refuses more than IOV_MAX buffers in one call.
    """

    def __init__(self, sock: socket.socket, budgets=None) -> None:
        self.sock = sock
        self.budgets = itertools.cycle(budgets) if budgets else None
        self.calls: list[tuple[int, int, int]] = []  # (buffers offered, bytes offered, bytes taken)

    def sendmsg(self, buffers) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        if len(views) > _IOV_MAX:
            raise OSError(errno.EMSGSIZE, "Message too long")
        take = views
        if self.budgets is not None:
            left, take = next(self.budgets), []
            for view in views:
                if left == 0:
                    break
                take.append(view[:left])
                left -= len(take[-1])
        sent = self.sock.sendmsg(take)
        self.calls.append((len(views), sum(len(v) for v in views), sent))
        return sent

    def getsockopt(self, *args):  # the timeouts a transfer's later syscalls get (sockpool.more_time)
        return self.sock.getsockopt(*args)

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return self.sock.fileno()

    def partial_sends(self) -> int:
        return sum(1 for _, offered, sent in self.calls if sent < offered)


def mixed_buffers(total: int) -> list:
    """Buffers of every kind and many sizes (some empty) adding up to about `total` bytes."""
    rng = np.random.default_rng(total)
    out: list = []
    kinds = itertools.cycle(["bytes", "bytearray", "memoryview", "numpy", "empty"])
    size = 0
    while size < total:
        n = int(rng.integers(1, 40_000))
        data = rng.integers(0, 256, n, dtype=np.uint8)
        kind = next(kinds)
        if kind == "bytes":
            out.append(data.tobytes())
        elif kind == "bytearray":
            out.append(bytearray(data.tobytes()))
        elif kind == "memoryview":
            out.append(memoryview(b"??" + data.tobytes())[2:])
        elif kind == "numpy":
            out.append(data)
        else:
            out.append(b"")
            n = 0
        size += n
    return out


def joined(buffers: list) -> bytes:
    return b"".join(bytes(memoryview(b)) for b in buffers)


def test_send_all_to_a_slow_reader_delivers_every_byte_in_order(pair):
    a, b = pair
    buffers = mixed_buffers(1 << 20)
    expected = joined(buffers)
    sender = RecordingSocket(a)
    reader = SlowReader(b, len(expected))
    send_all(sender, list(buffers))  # type: ignore[arg-type]
    assert reader.result() == expected
    assert sender.partial_sends() > 0, "1 MiB into a 4 KiB socket buffer: the kernel takes it in parts"
    assert sum(sent for _, _, sent in sender.calls) == len(expected)


def test_send_all_continues_after_partial_sends_inside_and_across_buffers(pair):
    a, b = pair
    buffers = mixed_buffers(300_000)
    expected = joined(buffers)
    sender = RecordingSocket(a, [1, 7, 4093, 65_536, 3, 20_000])
    reader = SlowReader(b, len(expected))
    send_all(sender, list(buffers))  # type: ignore[arg-type]
    assert reader.result() == expected
    assert sender.partial_sends() > 10
    assert sum(sent for _, _, sent in sender.calls) == len(expected)


@pytest.mark.parametrize("stingy", [False, True])
def test_send_all_sends_more_buffers_than_one_sendmsg_takes(pair, stingy):
    a, b = pair
    buffers = [bytes([i % 251]) * (i % 17) for i in range(3 * _IOV_MAX + 5)]  # every 17th is empty
    expected = joined(buffers)
    sender = RecordingSocket(a, [5000, 3, 100_000] if stingy else None)
    reader = SlowReader(b, len(expected))
    send_all(sender, list(buffers))  # type: ignore[arg-type]
    assert reader.result() == expected
    assert max(c[0] for c in sender.calls) <= _IOV_MAX
    assert len(sender.calls) >= 4


def test_send_all_over_a_real_socket_with_more_than_iov_max_buffers(pair):
    a, b = pair
    buffers = [bytes([i % 256]) * 3 for i in range(2 * _IOV_MAX + 1)]
    expected = joined(buffers)
    reader = SlowReader(b, len(expected))
    send_all(a, buffers)
    assert reader.result() == expected


# ------------------------------------------------------------------ recv_exact / recv_exact_into


def test_recv_exact_waits_for_every_piece(pair):
    a, b = pair
    data = np.random.default_rng(7).integers(0, 256, 200_000, dtype=np.uint8).tobytes()

    def write() -> None:
        for start in range(0, len(data), 3000):
            a.sendall(data[start : start + 3000])

    for receive in ("recv_exact", "recv_exact_into"):
        writer = threading.Thread(target=write)
        writer.start()
        if receive == "recv_exact":
            got = recv_exact(b, len(data))
        else:
            buf = bytearray(len(data))
            recv_exact_into(b, memoryview(buf))
            got = bytes(buf)
        writer.join(TIMEOUT_S)
        assert got == data
    assert recv_exact(b, 0) == b""
    recv_exact_into(b, memoryview(bytearray(0)))


@pytest.mark.parametrize("sent", [0, 1, 99])
def test_eof_mid_frame_is_a_read_error(pair, sent):
    a, b = pair
    a.sendall(b"x" * sent)
    a.close()
    with pytest.raises(ReadError, match="closed the connection mid-frame"):
        recv_exact(b, 100)


@pytest.mark.parametrize("sent", [0, 1, 99])
def test_eof_mid_frame_is_a_read_error_into(pair, sent):
    a, b = pair
    a.sendall(b"x" * sent)
    a.close()
    buf = bytearray(100)
    with pytest.raises(ReadError, match="closed the connection mid-frame"):
        recv_exact_into(b, memoryview(buf))
    assert buf[:sent] == b"x" * sent


def test_a_closed_pool_refuses_new_exchanges_and_wakes_its_waiters(server, pools):
    pool = pools(server.address, timeout=30.0, limit=1)
    outcome: list[BaseException] = []
    with pool.socket():

        def wait_for_a_socket() -> None:
            try:
                with pool.socket():
                    pass
            except ConnectError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait_for_a_socket)
        waiter.start()
        assert wait_for(lambda: waiter.is_alive())
        started = time.monotonic()
        pool.close()
        waiter.join(timeout=5)
        assert not waiter.is_alive(), "close() left a waiter sleeping out its 30 s timeout"
        assert time.monotonic() - started < 5
    assert len(outcome) == 1 and "closed" in str(outcome[0])
    with pytest.raises(ConnectError, match="closed"):
        with pool.socket():
            pass


def test_recv_exact_into_all_fills_many_buffers_in_order_across_short_receives(pair):
    """One scatter receive for a run of small objects (issue 19); the sender trickles the bytes
    through a 4 KiB socket buffer, so every call returns short and inside a buffer."""
    a, b = pair
    sizes = [(i * 7919) % 3000 for i in range(2 * _IOV_MAX + 3)]  # some empty, more than one call holds
    payload = bytes(i % 251 for i in range(sum(sizes)))
    views, at = [], 0
    store = bytearray(len(payload))
    for size in sizes:
        views.append(memoryview(store)[at : at + size])
        at += size
    sender = threading.Thread(target=a.sendall, args=(payload,))
    sender.start()
    recv_exact_into_all(b, views)
    sender.join(TIMEOUT_S)
    assert bytes(store) == payload


def test_recv_exact_into_all_raises_read_error_when_the_peer_closes_mid_frame(pair):
    a, b = pair
    a.sendall(b"x" * 100)
    a.close()
    with pytest.raises(ReadError):
        recv_exact_into_all(b, [memoryview(bytearray(60)), memoryview(bytearray(60))])


def test_a_peer_trickling_bytes_cannot_hold_a_transfer_past_its_calls_deadline():
    """The kernel's timeout bounds one syscall: a peer sending a byte every 0.05 s restarted it at
    every short receive, and a call with a 1 s timeout took 7 s. Past the call's deadline the
    transfer fails (EAGAIN, as the kernel's own timeout), and the socket's timeouts come back."""
    from kvtier.client import sockpool

    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                theirs.send(b"x")
            except OSError:
                return
            time.sleep(0.05)

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    sockpool._set_timeouts(ours, 0.3)
    token = sockpool.call_deadline.set(time.monotonic() + 0.6)
    started = time.monotonic()
    try:
        with pytest.raises(BlockingIOError):
            sockpool.recv_exact_into(ours, memoryview(bytearray(1000)))  # 50 s of bytes at that pace
    finally:
        sockpool.call_deadline.reset(token)
        stop.set()
    assert time.monotonic() - started < 1.0
    assert ours.fileno() in sockpool._shortened  # set back at its next exchange from a pool
    sockpool._shortened.discard(ours.fileno())
    ours.close()
    theirs.close()
    feeder.join()
