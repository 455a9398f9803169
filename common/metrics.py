"""Prometheus exposition shared by the master and the segment servers (`--metrics HOST:PORT`).

Each service gives a collector that reads its own counters at scrape time:
nothing on a hot path touches prometheus-client. The HTTP listener binds
exactly the address it is given, on its own thread; `/metrics` also carries
the process's CPU, RSS and open fds (prometheus-client's process collector)
and its thread count. The same listener answers the probes of service
managers: `/healthz` (200 while the process serves HTTP) and `/readyz` (200
when the service's `readiness` callback has no objection, else 503 and the
reason, one line), and any further readiness paths a service adds the same way; any other path is
404. At most MAX_SCRAPES connections are served at once (more are closed at once: a scraper tries
again at its next interval) and each gets SCRAPE_TIMEOUT_S in all: the listener's threads (a handler
and a timer per connection served) are a constant, whatever connects (300 half-sent requests once
held 300 threads for good).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.common.latency import LatencyHistogram
from kvtier.common.units import parse_hostport


def histogram_family(name: str, documentation: str, label: str, histograms: dict[str, LatencyHistogram]) -> Metric:
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.buckets(), histogram.total)
    return family


class _Threads(Collector):
    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("process_threads", "Threads of this process.", value=threading.active_count())


MAX_SCRAPES = 8  # connections served at once
SCRAPE_TIMEOUT_S = 10.0  # for each: a peer silent this long is cut


class _HttpServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper never holds up shutdown

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the limit: no thread for it
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        # The handler's timeout bounds each receive; this bounds the connection (a byte every 9 s
        # would hold a slot for ever): its socket is shut down at the deadline, which ends the handler.
        cut = threading.Timer(SCRAPE_TIMEOUT_S, _shut, args=(request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a scraper that timed out or went away: nothing to print


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # StreamRequestHandler sets it on the connection

    def log_message(self, format: str, *args: object) -> None:  # scrapes are not log lines
        pass


def _probe_app(metrics_app: Callable, probes: dict[str, Callable[[], str]]) -> Callable:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if (readiness := probes.get(path)) is not None:
            try:
                reason = readiness()
            except Exception as exc:  # a probe must answer, and say why
                reason = f"readiness check failed: {exc}"
            if reason:
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [reason.encode() + b"\n"]
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ready\n"]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /metrics, /healthz, " + ", ".join(sorted(probes)).encode() + b"\n"]
        return metrics_app(environ, start_response)

    return app


def serve_metrics(
    listen: str,
    collector: Collector,
    readiness: Callable[[], str] = lambda: "",
    more_probes: dict[str, Callable[[], str]] | None = None,
) -> str:
    """Serve `/metrics`, `/healthz` and `/readyz` on exactly `listen` (HOST:PORT, port 0 = any); the
    bound address. `readiness` returns "" when ready, else why not (called on the HTTP thread);
    `more_probes` adds paths answered the same way (the master's `/readyz/leader`)."""
    probes = {"/readyz": readiness, **(more_probes or {})}
    host, port = parse_hostport(listen)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(_Threads())
    registry.register(collector)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_HttpServer,), {"address_family": family})
    server = make_server(
        host, port, _probe_app(make_wsgi_app(registry), probes), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="kvtier-metrics", daemon=True).start()
    bound_host, bound_port = server.server_address[:2]
    return f"{bound_host}:{bound_port}"
