"""A fault-injecting TCP proxy for tests: delay, jitter and "loss" on a chosen path.

This kernel has no netem, so network faults that are not a clean cut come from here. `FaultProxy`
listens on (host, port) and forwards every connection to `target`; each chunk read in either
direction is held for `delay_s` plus a uniform `jitter_s` (in order: a connection's chunks never
overtake each other), and with probability `loss` a chunk is "lost", which TCP would hide as a
retransmission stall, so it becomes one of:

    "drop"   the connection is aborted (both sides see a reset): a retrying client reconnects
    "stall"  the chunk and everything after it on that connection are held for `stall_s`

A mid-frame cut: with `cut_after_bytes`, a connection is reset (RST) once that many bytes went from
the target to the client on it, those bytes delivered first; `cuts` limits how many connections are
cut that way (0: every one), so "cut once, then healthy" needs no racing `set()`.

The proxy runs its own event loop on a thread; `set(...)` changes the faults while it runs (new
values apply to chunks read from then on). Counters (`connections`, `chunks`, `dropped`, `stalled`)
say what it did. Seeded: the same seed gives the same sequence of decisions.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from dataclasses import dataclass


@dataclass
class Faults:
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0  # probability per chunk
    loss_mode: str = "drop"  # "drop" or "stall"
    stall_s: float = 1.0
    cut_after_bytes: int = 0  # reset a connection after this many bytes towards the client (0: never)
    cuts: int = 0  # connections cut so at most (0: unlimited)


class FaultProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], seed: int = 0, **faults) -> None:
        self.target = target
        self.faults = Faults(**faults)
        self._rng = random.Random(seed)
        self.connections = self.chunks = self.dropped = self.stalled = self.cut = 0
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
        self.cut = 0  # `cuts` counts from here

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
            await asyncio.gather(
                self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair, towards_client=True)
            )
        finally:
            for w in pair:
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair, towards_client: bool = False
    ) -> None:
        # A queue keeps the chunks in order while each waits out its own delay.
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:  # a cut: reset both sides once what came before it is out
                    while writer.transport.get_write_buffer_size():
                        await asyncio.sleep(0.001)
                    for w in pair:
                        sock = w.transport.get_extra_info("socket")
                        if sock is not None:  # SO_LINGER 0: close sends a reset, not a FIN
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        w.transport.abort()
                    return
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
        forwarded = 0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    queue.put_nowait((0.0, b""))
                    break
                self.chunks += 1
                f = self.faults
                if (
                    towards_client
                    and f.cut_after_bytes
                    and forwarded + len(data) >= f.cut_after_bytes
                    and (not f.cuts or self.cut < f.cuts)
                ):
                    self.cut += 1
                    queue.put_nowait((loop.time(), data[: f.cut_after_bytes - forwarded]))
                    queue.put_nowait((0.0, None))
                    await sender
                    return
                forwarded += len(data)
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
