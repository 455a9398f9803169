"""A FastPathProtocol driven without sockets: a fake transport, and get_buffer()/buffer_updated()
fed like the event loop would (shared by test_fastpath.py and test_fastpath_fuzz.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.master.auth import Authenticator
from kvtier.master.commit_wait import CommitWaiter
from kvtier.master.config import MasterConfig
from kvtier.master.fastpath import Connections, FastPathLimits, FastPathProtocol
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState
from kvtier.proto import rpcframe

HEADER = rpcframe.HEADER


class FakeTransport:
    """Records what the protocol does to its transport."""

    def __init__(self) -> None:
        self.stream = bytearray()  # everything written, in order
        self.closed = False  # close() or abort()
        self.aborted = False
        self.reading = True

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.stream += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        assert self.reading, "pause_reading while paused"
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading, "resume_reading while reading"
        self.reading = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 4242)}.get(name, default)


@dataclass
class Conn:
    protocol: FastPathProtocol
    transport: FakeTransport
    buffer_sizes: list[int] = field(default_factory=list)

    def feed(self, data: bytes, chunk: int | list[int] | None = None) -> int:
        """Deliver `data` like the event loop: into get_buffer()'s buffer, at most `chunk` bytes a
        read (cycling through a list), while the transport reads and is open. Returns bytes taken."""
        sizes = chunk if isinstance(chunk, list) and chunk else [chunk or len(data) or 1]
        pos = i = 0
        while pos < len(data) and self.transport.reading and not self.transport.closed:
            buf = self.protocol.get_buffer(-1)
            assert len(buf) > 0, "get_buffer returned an empty buffer"
            n = min(len(buf), max(1, sizes[i % len(sizes)]), len(data) - pos)
            i += 1
            buf[:n] = data[pos : pos + n]
            pos += n
            self.protocol.buffer_updated(n)  # with the view still held, as asyncio's transports do
            del buf
            self.buffer_sizes.append(len(self.protocol._buf))
        return pos

    def lose(self) -> None:
        self.transport.closed = True
        self.protocol.connection_lost(None)


def frames_of(stream: bytes) -> list[tuple[int, int, bytes]]:
    """(method, request_id, payload) of every frame in `stream`; every frame whole and well-formed."""
    out = []
    pos = 0
    while pos < len(stream):
        assert len(stream) - pos >= HEADER.size, f"a cut header at {pos}"
        magic, method, request_id, size = HEADER.unpack_from(stream, pos)
        assert magic == rpcframe.MAGIC, f"bad magic {magic:#x} in a response"
        pos += HEADER.size
        assert len(stream) - pos >= size, "a cut response"
        out.append((method, request_id, bytes(stream[pos : pos + size])))
        pos += size
    return out


def make_handlers(secret: bytes | None = None) -> MasterHandlers:
    handlers = MasterHandlers(MasterState(MasterConfig(cluster_id="unit").validate()), 1)
    handlers.auth = Authenticator(secret)
    return handlers


def connect(
    handlers: MasterHandlers | None = None, connections: Connections | None = None, limits: FastPathLimits | None = None
) -> Conn:
    handlers = handlers or make_handlers()
    connections = connections or Connections(limits or FastPathLimits())
    protocol = FastPathProtocol(handlers, CommitWaiter(handlers, 1.0), connections)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return Conn(protocol, transport)
