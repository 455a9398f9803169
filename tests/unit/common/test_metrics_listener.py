"""The metrics listener (kvtier.common.metrics): its threads are a constant of the configuration
whatever connects, a silent peer is cut, and only the documented paths answer."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.core import GaugeMetricFamily

from kvtier.common import metrics


class _One:
    def collect(self):
        yield GaugeMetricFamily("kvtier_test_value", "A value.", value=7)


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.5)
    return metrics.serve_metrics("127.0.0.1:0", _One(), readiness=lambda: "")


def _get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_half_sent_requests_hold_a_bounded_number_of_threads_and_are_cut(listener):
    before = threading.active_count()
    host, port = listener.rsplit(":", 1)
    stalled = []
    for _ in range(3 * metrics.MAX_SCRAPES):  # each sends half a request line and nothing more
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"GET /metr")
        stalled.append(sock)
    time.sleep(0.2)
    assert threading.active_count() - before <= 2 * metrics.MAX_SCRAPES  # a handler and a timer each
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # each is cut after SCRAPE_TIMEOUT_S
    assert threading.active_count() <= before
    status, body = _get(listener, "/metrics")
    assert status == 200 and "kvtier_test_value 7.0" in body, "it serves on after them"
    for sock in stalled:
        sock.close()


def test_only_the_documented_paths_answer(listener):
    assert _get(listener, "/healthz") == (200, "ok\n")
    assert _get(listener, "/readyz") == (200, "ready\n")
    assert _get(listener, "/readyz/leader")[0] == 404  # a segment has no leader probe
    assert _get(listener, "/anything")[0] == 404


def test_a_peer_sending_a_byte_now_and_then_is_cut_at_the_connections_deadline(listener):
    """The handler's timeout bounds each receive: a byte every 0.3 s (under the 0.5 s timeout) held a
    slot for ever; the connection as a whole gets SCRAPE_TIMEOUT_S."""
    host, port = listener.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    started = time.monotonic()
    cut = False
    for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 40:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            cut = True
            break
        time.sleep(0.05 if time.monotonic() - started < 0.2 else 0.3)
        if time.monotonic() - started > 3:
            break
    if not cut:
        sock.settimeout(2)
        try:
            cut = sock.recv(1) == b""
        except OSError:
            cut = True
    assert cut and time.monotonic() - started < 3
    sock.close()
