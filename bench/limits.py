"""The two limits `kvtier bench` measures in the same run, and its figures as ratios of them.

A figure in GB/s means little on its own (this machine's memcpy and loopback
rates drift by 10-20% between sittings, and differ between machines); a
ratio to what the machine can do right now does not. The wire's limits are:

- **memcpy**: `ctypes.memmove` between two 64 MiB buffers, the copy the shm
  transport makes (same host);
- **loopback**: a Python blocking-socket stream over 127.0.0.1 (`sendall`
  from one thread, `recv_into` with MSG_WAITALL in another, 1 MiB calls):
  what any Python process can push through the kernel's TCP stack here,
  the ceiling of the tcp transport.

Both are measured before and after the workloads and the higher of each is the limit: a machine
busy with something else for a moment makes the ratios look worse, never better.

And the small-operation peers (issue 19's latency targets, `--compare redis`):
a single 4 KiB put p50 against a redis-py SET, a single get against a GET, a
32 x 4 KiB batch_put against one SET, each beside its **round-trip floor**: the
round trips the operation makes (a get: GetReplicas, then the READ; a put over
tcp to one segment, as the bench's single-segment cluster makes it: PutStart,
the WRITE with its COMMIT, and the segment's relay of that PutEnd to the master,
docs/architecture.md "Commit through the segment"; four when PutEnd goes to the
master itself) times a 64-byte echo round trip between a
Python blocking socket and a uvloop server in another process, measured in the
same run. It says what no amount of work per request could beat without fewer
round trips: a target below the floor needs a different protocol.
"""

from __future__ import annotations

import ctypes
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_MEMCPY_BYTES = 64 << 20
_STREAM_CALL = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    memcpy_gbps: float
    loopback_gbps: float

    def of(self, transport: str) -> float:
        return self.memcpy_gbps if transport == "shm" else self.loopback_gbps

    def best(self, other: Limits) -> Limits:
        """Each limit's higher measurement (taken before and after the workloads)."""
        return Limits(max(self.memcpy_gbps, other.memcpy_gbps), max(self.loopback_gbps, other.loopback_gbps))


def memcpy_gbps(repeat: int = 3, total: int = 1 << 30) -> float:
    """Median GB/s of `total` bytes copied 64 MiB at a time with ctypes.memmove (GIL released)."""
    src = (ctypes.c_char * _MEMCPY_BYTES).from_buffer(bytearray(b"\x5a" * _MEMCPY_BYTES))
    dst = (ctypes.c_char * _MEMCPY_BYTES).from_buffer(bytearray(_MEMCPY_BYTES))
    ctypes.memmove(dst, src, _MEMCPY_BYTES)  # fault the pages in
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(max(1, total // _MEMCPY_BYTES)):
            ctypes.memmove(dst, src, _MEMCPY_BYTES)
        rates.append(max(1, total // _MEMCPY_BYTES) * _MEMCPY_BYTES / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def loopback_gbps(repeat: int = 3, total: int = 1 << 30) -> float:
    """Median GB/s of a Python blocking-socket stream over 127.0.0.1, `total` bytes per run."""
    rates = []
    for _ in range(repeat):
        with socket.create_server(("127.0.0.1", 0)) as server:
            sender = socket.create_connection(server.getsockname())
            receiver, _ = server.accept()
        with sender, receiver:
            reader = threading.Thread(target=_drain, args=(receiver, total), daemon=True)
            chunk = bytes(_STREAM_CALL)
            started = time.perf_counter()
            reader.start()
            for _ in range(total // _STREAM_CALL):
                sender.sendall(chunk)
            reader.join()
            rates.append(total // _STREAM_CALL * _STREAM_CALL / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def _drain(sock: socket.socket, total: int) -> None:
    buf = memoryview(bytearray(_STREAM_CALL))
    received = 0
    while received < total // _STREAM_CALL * _STREAM_CALL:
        n = sock.recv_into(buf, _STREAM_CALL, socket.MSG_WAITALL)
        if not n:
            return
        received += n


def measure_limits(repeat: int = 3) -> Limits:
    return Limits(memcpy_gbps(repeat), loopback_gbps(repeat))


# The wire targets of issue 19: (workload, size) -> ratio of the limit; 64 KiB batches are absolute GB/s.
WIRE_SIZES = (64 << 10, 1 << 20, 4 << 20)
WIRE_WORKLOADS = ("batch_put", "batch_get_into")
RATIO_TARGET = {"tcp": 0.8, "shm": 0.85}
SMALL_BATCH_GBPS = {"tcp": 1.5, "shm": 2.0}


def wire_target(transport: str, size: int) -> tuple[str, float]:
    """("ratio" | "GB/s", the target) for a wire figure."""
    if size == 64 << 10:
        return "GB/s", SMALL_BATCH_GBPS.get(transport, 1.5)
    return "ratio", RATIO_TARGET.get(transport, 0.8)


# Small operations against Redis (issue 19): name -> (our workload, the peer's workload, target ratio).
LATENCY_RATIOS = {
    "put 4 KiB p50 / SET p50": ("put", "put", 3.0),
    "get 4 KiB p50 / GET p50": ("get", "get", 1.5),
    "batch_put 32x4 KiB p50 / SET p50": ("batch_put", "put", 5.0),
}

# Round trips of each small operation (see the module's docstring): a target under round trips x echo is
# out of reach whatever each request costs.
# The bench's gets re-read a set of keys (an engine re-reading hot blocks): after the first lookup each
# is a direct read, one round trip to the segment (docs/architecture.md, "Direct reads").
ROUND_TRIPS = {"put": 3, "get": 1, "batch_put": 3}

_ECHO_SERVER = """
import asyncio, sys, uvloop
class Echo(asyncio.Protocol):
    def connection_made(self, transport): self.transport = transport
    def data_received(self, data): self.transport.write(data)
async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
uvloop.run(main())
"""


def echo_round_trip_ms(samples: int = 3000) -> float:
    """p50 ms of a 64-byte round trip: a Python blocking socket (TCP_NODELAY) to a uvloop echo server in
    another process, over 127.0.0.1: the cheapest request/answer a Python process makes here."""
    server = subprocess.Popen(
        [sys.executable, "-c", _ECHO_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            message = b"x" * 64
            times = []
            for _ in range(samples):
                started = time.perf_counter()
                sock.sendall(message)
                received = 0
                while received < len(message):
                    received += len(sock.recv(256))
                times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000
    finally:
        server.stdin.close()
        server.wait(timeout=10)
        server.stdout.close()
