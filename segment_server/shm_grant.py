"""Granting the DRAM region to same-host clients: its fd over a Unix socket, to allowed uids only.

The region is a sealed memfd (kvtier.segment_server.region): it has no path
anyone could open. A same-host client maps it only after this server hands it
the file descriptor, on the segment's grant socket (`grant_socket_path`:
`<shm_dir>/kvtier.<cluster>.<segment>.sock`, mode 0666: who gets the region is
decided here from the peer's kernel-reported credentials, not by file modes):

    client -> server   b"KVTSHM1 <nonce hex> writer\\n"             the region it was told about
    server -> client   b"OK <nonce hex> writer <block>\\n" + the fd (SCM_RIGHTS)   granted
                       b"ERR <reason>\\n", then close                refused

A granted client keeps the connection open for as long as it maps the region: `block` is the
block of writer slots in the region's header it marks its copies in (kvtier.proto.region,
kvtier.segment_server.shm_writers), its own until the connection closes (the client unmapped
the region, or its process died: the kernel closes the socket either way), when the block's
slots are zeroed and go to the next client. A request without `writer` (a client of an earlier
release) is answered `OK <nonce hex>` and closed, as before; so is every request when the
server was given no writer table.

Granted when the peer's uid (SO_PEERCRED, taken by the kernel at connect) is
in `allowed_uids` (the service's own uid plus `shm_allowed_uids`) and the nonce
is this region's (a stale endpoint of an earlier incarnation is refused).
The fd sent is a second open file description of the region's memfd (sealed:
no granted process can resize it), never the name's lock file holding the
ownership flock: a client's mapping keeps a reference to the file it mapped,
and must not make a dead server's region look alive.

Bounded: at most `max_connections` conversations at once (more are refused at
once with `busy`), each answered or cut off within `timeout_s`, so a silent or
slow peer holds one socket for that long and nothing else; granted connections
held open are at most the region's writer blocks (WRITER_BLOCKS: a client asking
when all are held is refused `no_writer_slots` and uses its next transport). Every conversation
ends in exactly one `Outcome`, counted in `GrantStats` (exported as
`kvtier_segment_shm_grants_total{result}`). The wire literals are repeated in
kvtier.client.transport.shm (the client imports no segment code); the unit
tests pair the two.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import socket
import struct
from dataclasses import dataclass, field
from enum import Enum

from kvtier.common.logs import LogBudget
from kvtier.proto.region import GRANT_REQUEST, GRANT_WRITER
from kvtier.segment_server.region import remove_stale_socket
from kvtier.segment_server.shm_writers import WriterTable

logger = logging.getLogger(__name__)

REQUEST = GRANT_REQUEST  # protocol name and version, first word of the request line
MAX_REQUEST = 128  # bytes; a longer line is malformed
TIMEOUT_S = 2.0  # a peer must send its whole request within this
MAX_CONNECTIONS = 64  # conversations at once; a grant takes microseconds, so only stalled peers pile up
BACKLOG = 64
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_MAX_UID = 2**32 - 2  # (uid_t)-1 means "no uid"


class Outcome(Enum):
    """How one grant conversation ended; the value is the metric's `result` label."""

    GRANTED = "granted"  # the region's fd was sent
    REFUSED_UID = "refused_uid"  # the peer's uid is neither the service's nor in shm_allowed_uids
    REFUSED_NONCE = "refused_nonce"  # the peer asked for another region (an endpoint of an earlier incarnation)
    BUSY = "busy"  # max_connections conversations were already running
    NO_WRITER_SLOTS = "no_writer_slots"  # every block of writer slots is held by a mapped client
    TIMEOUT = "timeout"  # no complete request within timeout_s
    MALFORMED = "malformed"  # not a grant request
    ERROR = "error"  # the peer hung up, or the socket failed


@dataclass(slots=True)
class GrantStats:
    """Conversations by outcome, and those running now. Mutated on the event loop only."""

    results: dict[str, int] = field(default_factory=lambda: {outcome.value: 0 for outcome in Outcome})
    active: int = 0
    held: int = 0  # granted connections kept open (clients mapping the region, each with a writer block)


def parse_uids(text: str) -> frozenset[int]:
    """`"1000, vllm, 1001"` as uids: numbers as given, names looked up in this host's user database.

    ValueError naming the first entry that is neither (an empty text is no uid at all)."""
    uids = set()
    if not text.strip():
        return frozenset()
    for item in (part.strip() for part in text.split(",")):
        if item.isdigit():
            if int(item) > _MAX_UID:
                raise ValueError(f"{item} is not a valid uid")
            uids.add(int(item))
            continue
        if not item:
            raise ValueError(f"empty entry in {text!r} (comma-separated uids or user names)")
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"no user named {item!r} on this host") from None
    return frozenset(uids)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel saw it at connect."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def reopen(fd: int) -> int:
    """A new open file description of the file open as `fd` (same inode, read-write, close-on-exec)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


class GrantServer:
    """Serves one region's grant socket on the running event loop.

    `fd` is sent to granted peers and stays owned by the caller. start() raises
    FileExistsError when a live process serves `path` or it is not a socket
    (a stale socket of a dead process is replaced). stop() removes the socket
    file, if it is still the one this server bound.
    """

    def __init__(
        self,
        path: str,
        fd: int,
        nonce: bytes,
        allowed_uids: frozenset[int],
        stats: GrantStats,
        *,
        timeout_s: float = TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        writers: WriterTable | None = None,
    ) -> None:
        self.path = path
        self._writers = writers
        self._fd = fd
        self._nonce = nonce
        self._granted_reply = b"OK " + nonce.hex().encode() + b"\n"
        self._allowed = allowed_uids
        self._stats = stats
        self._log = LogBudget(logger, "shm grant")
        self._timeout_s = timeout_s
        self._max = max_connections
        self._sock: socket.socket | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file bound
        self._acceptor: asyncio.Task | None = None
        self._conversations: set[asyncio.Task] = set()
        self._held: set[asyncio.Task] = set()  # granted connections, each holding a writer block

    async def start(self) -> None:
        remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot bind the shm grant socket {self.path}: {exc.strerror}") from None
            info = os.stat(self.path)
            self._identity = (info.st_dev, info.st_ino)
            os.chmod(self.path, 0o666)  # anyone may ask; the credential check decides
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            self._unlink()
            raise
        self._sock = sock
        self._acceptor = asyncio.create_task(self._accept())
        logger.info(
            "shm grant socket listening path=%s allowed_uids=%s timeout_s=%s max_connections=%d",
            self.path,
            ",".join(map(str, sorted(self._allowed))),
            self._timeout_s,
            self._max,
        )

    async def stop(self) -> None:
        """Stop accepting, cut the conversations in progress, remove the socket file. Safe to call twice."""
        tasks = [t for t in (self._acceptor, *self._conversations, *self._held) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._acceptor = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._unlink()

    def _unlink(self) -> None:
        """Remove the socket file if it is still the one we bound (never someone else's)."""
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                logger.warning("shm grant accept failed error=%s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            if self._stats.active >= self._max:
                self._finish(conn, Outcome.BUSY, f"busy: {self._max} grant requests in progress, try again later")
                continue
            self._stats.active += 1
            task = asyncio.create_task(self._converse(conn))
            self._conversations.add(task)
            task.add_done_callback(self._conversations.discard)

    async def _converse(self, conn: socket.socket) -> None:
        held = False  # handed to _hold, which closes it
        try:
            try:
                line = await asyncio.wait_for(self._read_request(conn), self._timeout_s)
            except TimeoutError:
                self._finish(conn, Outcome.TIMEOUT, f"timeout: no request within {self._timeout_s}s")
                return
            except OSError as exc:
                self._finish(conn, Outcome.ERROR, "", detail=str(exc))
                return
            if line is None:
                self._finish(conn, Outcome.ERROR, "", detail="peer hung up before asking")
                return
            words = line.split()
            if not 2 <= len(words) <= 3 or words[0] != REQUEST or words[2:] not in ([], [GRANT_WRITER]):
                expected = f"{REQUEST.decode()} <nonce hex> [{GRANT_WRITER.decode()}]"
                self._finish(conn, Outcome.MALFORMED, f"malformed request: expected {expected}")
                return
            _pid, uid, _gid = peer_credentials(conn)
            if uid not in self._allowed:
                reason = f"uid {uid} may not map this region (neither the service's uid nor in shm_allowed_uids)"
                self._finish(conn, Outcome.REFUSED_UID, reason)
                return
            if words[1] != self._nonce.hex().encode():
                self._finish(conn, Outcome.REFUSED_NONCE, "nonce mismatch: this socket serves another region")
                return
            block = None
            if words[2:] and self._writers is not None:
                block = self._writers.assign()
                if block is None:
                    reason = f"no_writer_slots: all {self._writers.capacity} writer blocks are held by mapped clients"
                    self._finish(conn, Outcome.NO_WRITER_SLOTS, reason)
                    return
            reply = self._granted_reply if block is None else self._granted_reply[:-1] + b" writer %d\n" % block
            try:
                socket.send_fds(conn, [reply], [self._fd])
            except OSError as exc:  # the peer is gone (a fresh socket's buffer always takes a few bytes)
                self._finish(conn, Outcome.ERROR, "", detail=str(exc))
                if block is not None:
                    self._writers.release(block)
                return
            self._finish(conn, Outcome.GRANTED, "")
            if block is not None:  # the block is the client's while it keeps the connection open
                task = asyncio.create_task(self._hold(conn, block))
                self._held.add(task)
                task.add_done_callback(self._held.discard)
                held = True
        finally:
            if not held:
                conn.close()
            self._stats.active -= 1

    async def _hold(self, conn: socket.socket, block: int) -> None:
        """Keep `block` assigned until the client closes its end (or dies: the kernel closes it)."""
        loop = asyncio.get_running_loop()
        self._stats.held += 1
        try:
            while await loop.sock_recv(conn, 64):
                pass  # a client says nothing after its request: whatever it sends is ignored
        except OSError:
            pass  # reset: gone all the same
        finally:
            self._stats.held -= 1
            assert self._writers is not None
            self._writers.release(block)
            conn.close()

    async def _read_request(self, conn: socket.socket) -> bytes | None:
        """The request line without its newline; None if the peer hung up first; at most MAX_REQUEST bytes."""
        loop = asyncio.get_running_loop()
        data = b""
        while b"\n" not in data:
            if len(data) > MAX_REQUEST:
                return b""  # malformed
            chunk = await loop.sock_recv(conn, MAX_REQUEST + 1)
            if not chunk:
                return None
            data += chunk
        line, _, _ = data.partition(b"\n")
        return line if len(line) <= MAX_REQUEST else b""

    def _finish(self, conn: socket.socket, outcome: Outcome, reason: str, detail: str = "") -> None:
        """Count and log the outcome; send the refusal's reason line. Never blocks (non-blocking send)."""
        self._stats.results[outcome.value] += 1
        try:
            pid, uid, _gid = peer_credentials(conn)
        except OSError:
            pid = uid = -1
        if reason:
            try:
                conn.send(b"ERR " + reason.encode() + b"\n")
            except OSError:
                pass
        if outcome is Outcome.BUSY:
            conn.close()
        refused = outcome in (Outcome.REFUSED_UID, Outcome.REFUSED_NONCE)
        self._log.log(  # within a budget: a local user looping connect() must not flood the log
            logging.WARNING if refused else logging.INFO,
            "shm grant result=%s peer_pid=%d peer_uid=%d path=%s%s",
            outcome.value,
            pid,
            uid,
            self.path,
            f" reason={reason or detail!r}" if reason or detail else "",
        )
