"""Data-plane connection limits (issue 8): a connection beyond the limit is refused with a clear
error, idle and slow connections are cut, and none of it stops the segment serving others."""

from __future__ import annotations

import socket
import time

import pytest

from kvtier.proto import frames
from kvtier.proto.frames import Op
from kvtier.proto.status import Status
from tests.integration.rawframes import connect, far_deadline, is_closed_by_peer, ping, recv_response, send_request
from tests.integration.test_metrics import scrape, value


def tcp_endpoint(proc) -> str:
    return next(e for e in proc.info["endpoints"] if e.startswith("tcp://"))


REQUEST_TIMEOUT = 2.0  # the limited segment's request_timeout_s


@pytest.fixture
def limited(bare_cluster):
    bare_cluster.start_master()
    bare_cluster.start_segment(
        "seg0",
        "16MiB",
        "--max-connections", "4",
        "--idle-timeout-s", "2",
        "--request-timeout-s", str(REQUEST_TIMEOUT),
        "--metrics", "127.0.0.1:0",
    )  # fmt: skip
    return bare_cluster


def test_a_connection_over_the_limit_is_refused_with_a_reason_and_room_comes_back(limited):
    seg = limited.segments["seg0"]
    endpoint = tcp_endpoint(seg)
    held = [connect(endpoint) for _ in range(4)]
    try:
        for i, sock in enumerate(held):  # all four are served
            send_request(sock, Op.PING, i + 1, [])
            assert recv_response(sock) == (Op.PING, i + 1, 0, b"")
        with connect(endpoint) as extra:
            op, request_id, status, message = recv_response(extra)  # unsolicited: sent at accept
            assert (op, request_id, status) == (0, 0, Status.TOO_MANY_CONNECTIONS)
            assert b"too many connections" in message and b"4" in message
            assert is_closed_by_peer(extra)
        held.pop().close()
        assert limited.wait_for(lambda: ping(endpoint), timeout=5)  # a slot is free again
    finally:
        for sock in held:
            sock.close()
    samples = scrape(seg.info["metrics"])
    assert value(samples, "kvtier_segment_refused_connections_total", segment="seg0") >= 1


def test_the_client_library_reports_a_refusal_as_a_failed_transfer_not_a_hang(limited):
    endpoint = tcp_endpoint(limited.segments["seg0"])
    held = [connect(endpoint) for _ in range(4)]
    seg = limited.segments["seg0"]
    try:
        assert limited.wait_for(
            lambda: value(scrape(seg.info["metrics"]), "kvtier_segment_connections", segment="seg0") == 4
        ), "the four held connections were accepted"
        client = limited.client(transport="tcp", timeout=3.0)
        statuses = client.batch_put(["k"], [b"v" * 100])
        assert statuses[0] != Status.OK  # no slot on the only segment: refused, not stuck
    finally:
        for sock in held:
            sock.close()
    assert limited.wait_for(lambda: limited.client(transport="tcp").batch_put(["k2"], [b"v"]) == [Status.OK])


def test_idle_and_slow_connections_are_cut_while_others_are_served(limited):
    seg = limited.segments["seg0"]
    endpoint = tcp_endpoint(seg)
    idle = connect(endpoint)
    slow = connect(endpoint)
    header = frames.pack_request(Op.READ, 9, [(0, 64)], deadline=far_deadline())
    started = time.monotonic()
    cut_slow = None
    client = limited.client(transport="tcp")
    served = 0
    try:
        # The slowloris sends its header a byte at a time; a normal client keeps working meanwhile.
        for byte in header:
            try:
                slow.send(bytes([byte]))
            except OSError:
                cut_slow = time.monotonic() - started
                break
            assert client.batch_put([f"k{served}"], [b"x" * 1000]) == [Status.OK]
            served += 1
            time.sleep(0.25)
        idle.settimeout(10)
        assert is_closed_by_peer(idle), "an idle connection past idle_timeout_s is closed"
        if cut_slow is None:
            slow.settimeout(10)
            assert is_closed_by_peer(slow)
            cut_slow = time.monotonic() - started
    finally:
        idle.close()
        slow.close()
    # request_timeout_s after its first byte, plus the sweep's period (1 s), plus one more request_timeout_s
    # of slack for a loaded machine; never left open for the whole header (2.5 s per 10 bytes)
    assert cut_slow < 2 * REQUEST_TIMEOUT + 1, "cut about request_timeout_s after its first byte"
    assert served >= 4
    assert client.batch_get([f"k{i}" for i in range(served)]) == [b"x" * 1000] * served
    samples = scrape(seg.info["metrics"])
    assert value(samples, "kvtier_segment_timed_out_connections_total", segment="seg0") >= 2


def test_a_peer_that_reads_no_responses_is_cut_and_frees_its_slot(limited):
    seg = limited.segments["seg0"]
    endpoint = tcp_endpoint(seg)
    sock = connect(endpoint)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = frames.pack_request(Op.READ, 1, [(0, 8 << 20)], deadline=far_deadline())  # 8 MiB per response, never read
    try:
        sock.settimeout(0.5)
        for _ in range(64):
            try:
                sock.sendall(request)
            except (TimeoutError, OSError):
                break
        assert limited.wait_for(lambda: "has read no response" in seg.log.read_text(), timeout=10), seg.tail()
    finally:
        sock.close()
    assert ping(endpoint)


def test_a_segment_started_under_a_low_open_file_limit_raises_it_for_its_connections(bare_cluster):
    # given a segment started with a soft open file limit of 256 (a shell's default is often 1024)
    # and room for 600 connections
    bare_cluster.start_master()
    segment = bare_cluster.start_segment(
        "seg0", "16MiB", "--max-connections", "600", prefix=["prlimit", "--nofile=256:"]
    )
    endpoint = tcp_endpoint(segment)
    # when 400 clients connect and each pings
    sockets = [connect(endpoint) for _ in range(400)]
    try:
        answers = []
        for i, sock in enumerate(sockets):
            send_request(sock, Op.PING, i + 1, [])
            answers.append(recv_response(sock)[2])
        # then every one is served (not reset at EMFILE), and a client's put still works
        assert answers == [0] * 400
        client = bare_cluster.client(transport="tcp")
        client.put("k", b"v")
        assert client.get("k") == b"v"
    finally:
        for sock in sockets:
            sock.close()
