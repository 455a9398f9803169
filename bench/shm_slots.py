"""What announcing same-host copies in writer slots costs (`python -m kvtier.bench.shm_slots`).

A same-host write announces each range in a writer slot of the region header before its grant check
and clears it after the copy (docs/architecture.md, "Writer slots"). This maps one real region
through its real grant socket twice, once with a block of writer slots and once without (a segment
that hands out none), and times the connector's write of a batch of small ranges with each,
alternately, beside a plain memoryview copy of the same bytes (the memcpy floor of the same run).
No master, no segment process: the copy path alone, where the slots' cost would show.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time

from kvtier.client.config import ClientConfig
from kvtier.client.transport.shm import ShmConnector
from kvtier.proto.auth import wall_ms
from kvtier.proto.region import host_id
from kvtier.segment_server.listeners import ShmListener
from kvtier.segment_server.region import DramRegion, grant_socket_path, region_path
from kvtier.segment_server.shm_writers import WriterTable


def _run_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def measure(size: int, batch: int, calls: int, rounds: int) -> list[tuple[str, float]]:
    """(mode, microseconds per write call) for each round of each mode, alternating."""
    loop, thread = _run_loop()
    config = ClientConfig(master="127.0.0.1:1", timeout=5.0)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        region = DramRegion(region_path(directory, "bench", "slots"), max(size * batch, 1 << 20), "bench", "slots")
        region.open()
        connectors = {}
        try:
            for mode, writers in (("slots", WriterTable(region.header)), ("no slots", None)):
                path = grant_socket_path(directory, "bench", "slots")
                listener = ShmListener(path, region.fileno(), host_id(), region.nonce, writers=writers)
                url = asyncio.run_coroutine_threadsafe(listener.start(), loop).result(10)
                connectors[mode] = ShmConnector(url, config)  # the grant socket stays open for "slots"
                asyncio.run_coroutine_threadsafe(listener.stop(), loop).result(10)
            data = [os.urandom(size) for _ in range(batch)]
            ranges = [(i * size, value) for i, value in enumerate(data)]
            caps = (wall_ms() + 3_600_000, [b""] * batch, 0)
            target = memoryview(bytearray(size * batch))
            for _ in range(rounds):
                for mode, connector in connectors.items():
                    started = time.perf_counter()
                    for _ in range(calls):
                        connector.write(ranges, [None] * batch, caps)
                    results.append((mode, (time.perf_counter() - started) / calls * 1e6))
                started = time.perf_counter()
                for _ in range(calls):
                    for i, value in enumerate(data):
                        target[i * size : (i + 1) * size] = value
                results.append(("memoryview copy", (time.perf_counter() - started) / calls * 1e6))
        finally:
            for connector in connectors.values():
                connector.close()
            region.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="bytes per range (default 4096)")
    parser.add_argument("--batch", type=int, default=32, help="ranges per write call (default 32)")
    parser.add_argument("--calls", type=int, default=3000, help="write calls per round (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes alternating (default 3)")
    args = parser.parse_args()
    for mode, micros in measure(args.size, args.batch, args.calls, args.rounds):
        per_range = micros / args.batch
        print(f"{mode:>16}: {micros:8.1f} us per call of {args.batch} x {args.size} B ({per_range:.2f} us/range)")


if __name__ == "__main__":
    main()
