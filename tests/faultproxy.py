"""A fault-injecting TCP proxy for tests: delay, jitter and "loss" on a chosen path.

This kernel has no netem, so network faults that are not a clean cut come from here. `FaultProxy`
listens on (host, port) and forwards every connection to `target`; each chunk read in either
direction is held for `delay_s` plus a uniform `jitter_s` (in order: a connection's chunks never
overtake each other), and with probability `loss` a chunk is "lost", which TCP would hide as a
retransmission stall, so it becomes one of:

    "drop"   the connection is aborted (both sides see a reset): a retrying client reconnects
    "stall"  the chunk and everything after it on that connection are held for `stall_s`

The proxy runs its own event loop on a thread; `set(...)` changes the faults while it runs (new
values apply to chunks read from then on). Counters (`connections`, `chunks`, `dropped`, `stalled`)
say what it did. Seeded: the same seed gives the same sequence of decisions.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass


@dataclass
class Faults:
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0  # probability per chunk
    loss_mode: str = "drop"  # "drop" or "stall"
    stall_s: float = 1.0


class FaultProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], seed: int = 0, **faults) -> None:
        self.target = target
        self.faults = Faults(**faults)
        self._rng = random.Random(seed)
        self.connections = self.chunks = self.dropped = self.stalled = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, *listen))
            except BaseException as exc:  # noqa: BLE001 (reported to the constructor)
                errors.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        self.address = self._server.sockets[0].getsockname()[:2]

    def set(self, **faults) -> None:
        self.faults = Faults(**faults)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        pair = (writer, up_writer)
        try:
            await asyncio.gather(self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair))
        finally:
            for w in pair:
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair) -> None:
        # A queue keeps the chunks in order while each waits out its own delay.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof() if writer.can_write_eof() else None
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        held_until = 0.0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    queue.put_nowait((0.0, b""))
                    break
                self.chunks += 1
                f = self.faults
                due = loop.time() + f.delay_s + (self._rng.uniform(0, f.jitter_s) if f.jitter_s else 0.0)
                if f.loss and self._rng.random() < f.loss:
                    if f.loss_mode == "drop":
                        self.dropped += 1
                        for w in pair:
                            w.transport.abort()
                        return
                    self.stalled += 1
                    held_until = due + f.stall_s
                queue.put_nowait((max(due, held_until), data))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def shut() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
