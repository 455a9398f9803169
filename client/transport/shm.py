"""The `shm` connector: same-host copies straight between caller memory and the segment's region.

A segment server advertises `shm://<grant socket path>?host=<host id>&nonce=<hex>&uid=<uid>`.
The region file is 0600 and owned by the service's uid: the client does not
open it by path, it asks the segment's grant socket for it, and the server
sends the file descriptor (SCM_RIGHTS) only if this process's uid is the
service's or one it allows (kvtier.segment_server.shm_grant):

    client -> server   b"KVTSHM1 <nonce hex> writer\n"
    server -> client   b"OK <nonce hex> writer <block>\n" + the fd, or b"ERR <reason>\n"

The connection stays open while the region is mapped: `block` is this connector's block of writer
slots in the region's header (kvtier.proto.region), and each copy into the region is announced in
one of its slots (offset, length, the grant's cutoff; state odd) from before its grant is checked
until its last byte is copied. The segment reports those to the master, which keeps the range of a
put that never completed from other objects while a writer (stopped mid-copy, say) is still in it.
A segment of an earlier release refuses the request as malformed; the client then asks as before
(`KVTSHM1 <nonce hex>`) and gets the region without slots (and without that guard).

It is used only when it is proven to be the same region, and one nobody can resize: the host id
(machine id + boot id, never a hostname) must equal this machine's before
anything is asked; the process serving the socket and the file received must
belong to the uid the segment advertised (no other local user can stand in
for it); and the mapped file must carry the same random 16-byte nonce in its
header, which the segment server wrote at creation. The fd received must be
sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW, checked
with F_GET_SEALS before mapping): any process granted the region could
otherwise truncate it and kill every process mapping it with SIGBUS. Anything else (another
host, no socket, a refusal, a stale or foreign file) raises ConnectError and
the client falls back to the next transport (TCP).

The region is mapped once (MAP_SHARED | MAP_POPULATE: first-touch page faults
would cost more than the copies) and kept for the connector's life; the fd is
closed right after mapping. Copies
are memcpy (ctypes.memmove, GIL released) in L2-sized chunks, each checksummed
right after it is copied, so the connector returns the CRC32C of what it
copied at little extra memory traffic. Payload bytes never touch a
socket; the segment server is not involved in the transfer at all, so
visibility still comes only from the master's PutEnd after the copy returns.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

import crc32c

from kvtier.client.chunks import ChunkSums
from kvtier.client.config import ClientConfig
from kvtier.client.transport.base import Buffer, Caps
from kvtier.proto.auth import CLOCK_SKEW_MS, wall_ms
from kvtier.proto.chunks import CHUNK_BYTES
from kvtier.proto.errors import ConnectError
from kvtier.proto.region import (
    GRANT_REQUEST,
    GRANT_WRITER,
    HEADER,
    MAGIC,
    SESSION,
    SESSION_OFFSET,
    SESSIONS_FORMAT,
    SLOTS_PER_BLOCK,
    WRITER_BLOCKS,
    WRITER_SLOT,
    WRITER_STATE,
    WRITERS_FORMAT,
    writer_slot,
)
from kvtier.proto.region import host_id as local_host_id
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

_OK = 0
_BAD_RANGE = int(Status.INVALID_RANGE)
_EXPIRED = int(Status.LEASE_EXPIRED)

# The grant protocol (kvtier.segment_server.shm_grant, whose unit tests pair it with this side).
_GRANT_REPLY_MAX = 512
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_NONCE_SIZE = 16  # bytes, as in the region header
# Seals a region must carry before it is mapped: nobody can change its size (and so unmap pages under us).
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_FD_SPACE = socket.CMSG_LEN(4)  # room for exactly one fd: more are cut off (MSG_CTRUNC) and closed by the kernel
# The cutoff a writer slot names for a copy under no grant (kvtier.proto.region WRITER_SLOT). A slot is
# written whole (state and fields in one store): a reading torn by a copy starting at that moment can only
# name a range nobody relies on (its writer checks its grant after; a stopped writer's stores are old).
_NO_CUTOFF = 2**64 - 1


# Copies run in chunks that fit in L2, each checksummed right after it is copied while it
# is still in cache: one pass over memory instead of two. Large chunks go through
# ctypes.memmove, which releases the GIL, so two client threads copy in parallel. Below
# _MEMMOVE_MIN a memoryview assignment is cheaper than the ctypes call and its address lookups
# (64 KiB: about half the time, session 9) and holds the GIL for microseconds only.
_CHUNK = 256 << 10
_MEMMOVE_MIN = 128 << 10


def _address(view: memoryview) -> int | None:
    """Address of a writable contiguous buffer, or None (read-only: no GIL-free copy)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))  # its first byte's: no array type per call


def _copy(
    dst: memoryview,
    dst_addr: int | None,
    src: memoryview,
    src_addr: int | None,
    check: memoryview,
    sums: ChunkSums | None = None,
    granted: Callable[[], bool] | None = None,
) -> int | None:
    """Copy `src` into `dst` (same length); return the CRC32C of `check` (one of the two) after the copy.
    With `sums`, its chunk CRCs are fed in the same pass (_CHUNK is a multiple of their chunk size).
    With `granted`, a large copy asks it before each chunk and stops (None) once it says no."""
    size = len(src)
    if size < _MEMMOVE_MIN:
        dst[:] = src
        if sums is not None:
            sums.add(check)
            return sums.whole
        return crc32c.crc32c(check)
    if dst_addr is None:
        dst_addr = _address(dst)
    if src_addr is None:
        src_addr = _address(src)
    crc = 0
    for start in range(0, size, _CHUNK):
        if granted is not None and not granted():
            return None
        end = min(start + _CHUNK, size)
        if dst_addr is not None and src_addr is not None:
            ctypes.memmove(dst_addr + start, src_addr + start, end - start)
        else:
            dst[start:end] = src[start:end]
        if sums is not None:
            sums.add(check[start:end])
        else:
            crc = crc32c.crc32c(check[start:end], crc)
    return sums.whole if sums is not None else crc


def _always() -> bool:
    return True


def _peer_uid(sock: socket.socket) -> int:
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]


def request_region(path: str, nonce: bytes, owner: int, timeout: float) -> int:
    """Ask the grant socket at `path` for the region with `nonce`, without writer slots (to read it):
    its fd, the caller closing it. ConnectError as `request_writer_grant`."""
    return _request(path, nonce, owner, timeout, writer=False)[0]


def request_writer_grant(path: str, nonce: bytes, owner: int, timeout: float) -> tuple[int, socket.socket | None, int]:
    """Ask the grant socket at `path` for the region with `nonce` and a block of writer slots:
    (its fd, the grant connection, the block), the caller closing the fd, and the connection when it
    unmaps the region (which gives the block back); (fd, None, -1) from a segment without writer slots.

    ConnectError when there is no such socket, its server is not uid `owner`, it refuses (with the
    server's reason), or it answers anything but one fd and `OK <nonce>` (`writer <block>`).
    """
    try:
        return _request(path, nonce, owner, timeout, writer=True)
    except ConnectError as exc:
        if "malformed request" not in str(exc):
            raise
    # A segment of an earlier release refuses the `writer` word as malformed: the region without slots.
    return _request(path, nonce, owner, timeout, writer=False)


def _request(
    path: str, nonce: bytes, owner: int, timeout: float, writer: bool
) -> tuple[int, socket.socket | None, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    keep = False
    try:
        sock.settimeout(timeout)
        reply = b""
        try:
            sock.connect(path)
            if (server_uid := _peer_uid(sock)) != owner:
                raise ConnectError(f"grant socket {path} is served by uid {server_uid}, not the segment's uid {owner}")
            try:
                ask = b" " + GRANT_WRITER if writer else b""
                sock.sendall(GRANT_REQUEST + b" " + nonce.hex().encode() + ask + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at once (busy): the reason is waiting to be read
            while b"\n" not in reply and len(reply) < _GRANT_REPLY_MAX:
                # recvmsg, not socket.recv_fds: that one drops its flags before 3.12, and the fd must be
                # close-on-exec from the start (another thread may fork and exec meanwhile).
                data, ancillary, flags, _ = sock.recvmsg(_GRANT_REPLY_MAX, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
                if flags & socket.MSG_CTRUNC:
                    raise ConnectError(f"grant socket {path} sent more than one file descriptor")
                if not data:
                    break
                reply += data
        except TimeoutError:
            raise ConnectError(f"no answer from the grant socket {path} within {timeout}s") from None
        except OSError as exc:
            raise ConnectError(f"cannot get the region from {path}: {exc.strerror or exc}") from None
        line = reply.partition(b"\n")[0].decode(errors="replace")
        if line.startswith("ERR "):
            raise ConnectError(f"the segment refused to grant its region: {line[4:]}")
        words = line.split()
        block = int(words[3]) if len(words) == 4 and words[2] == "writer" and words[3].isdigit() else -1
        if words[:2] != ["OK", nonce.hex()] or len(words) not in (2, 4) or len(words) == 4 and block < 0:
            raise ConnectError(f"unexpected answer from the grant socket {path}: {line[:80]!r} with {len(fds)} fds")
        if len(fds) != 1:
            raise ConnectError(f"unexpected answer from the grant socket {path}: {line[:80]!r} with {len(fds)} fds")
        keep = block >= 0
        return fds.pop(), sock if keep else None, block
    finally:
        for fd in fds:
            os.close(fd)
        if not keep:
            sock.close()


def check_sealed(fd: int, path: str) -> None:
    """ConnectError unless the file can be neither shrunk nor grown by anyone (memfd seals).

    A mapping of a file that another process shrinks faults (SIGBUS) on its next touch of the lost
    pages: the whole engine process dies. Only a region whose size is sealed is ever mapped.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: not a file that supports seals (a plain file, a /dev/shm file)
        seals = 0
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        reason = f"{path} granted a region that is not sealed against resizing (seals {seals:#x}): not mapping it"
        logger.warning("%s; using the next transport", reason)  # a segment of an older release, or a fake
        raise ConnectError(reason)


def _forked() -> None:
    """A forked child copies nothing into a region (its clients refuse calls made there): the grant
    connections it inherited are closed in it, so that the blocks of writer slots they hold go back
    when the parent lets go of them, not when the last child ends (a fork pool's lifetime)."""
    for connector in list(_HOLDING_BLOCKS):
        grant, connector._grant = connector._grant, None
        if grant is not None:
            grant.close()


# Connectors whose grant connection holds a block of writer slots (closed in a forked child).
_HOLDING_BLOCKS: weakref.WeakSet[ShmConnector] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class ShmConnector:
    scheme = "shm"
    # A transfer is a copy in the calling thread; objects at least this large are copied and
    # checksummed with the GIL released, so several threads can share a batch of them (smaller ones
    # are copied holding it: splitting their batch only adds hand-offs, measured in benchmarks.md).
    parallel_copy_min = _MEMMOVE_MIN
    reads_disk = False  # it maps the region; the SSD tier is read by the segment server (a tcp connector)

    def __init__(self, endpoint: str, config: ClientConfig) -> None:
        self.endpoint = endpoint
        url = urlsplit(endpoint)
        path = unquote(url.path)
        query = parse_qs(url.query)
        host = query.get("host", [""])[0]
        if not host or host != local_host_id():
            raise ConnectError(f"segment region {path} is on another host")
        try:
            nonce = bytes.fromhex(query.get("nonce", [""])[0])
            owner = int(query.get("uid", [""])[0])
            if len(nonce) != _NONCE_SIZE:
                raise ValueError
        except ValueError:
            raise ConnectError(f"malformed nonce or uid in the shm endpoint {endpoint}") from None
        fd, grant, block = request_writer_grant(path, nonce, owner, config.timeout)
        try:
            self._map_region(fd, path, nonce, owner, grant, block)
        except BaseException:
            if grant is not None:
                grant.close()
            raise

    def _map_region(
        self, fd: int, path: str, nonce: bytes, owner: int, grant: socket.socket | None, block: int
    ) -> None:
        try:
            check_sealed(fd, path)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
                raise ConnectError(f"{path} granted a file that is not a region owned by uid {owner}")
            size = info.st_size
            if size < HEADER.size:
                raise ConnectError(f"{path} granted a file that is not a kvtier region")
            try:
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except OSError as exc:
                raise ConnectError(f"cannot map the region granted by {path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        magic, fmt, data_offset, capacity, file_nonce, *_ = HEADER.unpack_from(self._map)
        if magic != MAGIC or file_nonce != nonce or data_offset + capacity > size:
            self._map.close()
            raise ConnectError(f"{path} granted a file that is not the advertised region (nonce mismatch)")
        self._view = memoryview(self._map)[data_offset : data_offset + capacity]
        self._capacity = capacity
        self._sessions = fmt >= SESSIONS_FORMAT  # the segment publishes its mount session (older ones: no)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._base = ctypes.addressof(self._anchor) + data_offset
        # Writer slots (FORMAT 3): the block the grant gave us, held while `_grant` stays open; each
        # write call announces its copies in one slot of it (`_take_slot`), a slot's state counting up.
        self._grant = grant
        if grant is not None:
            _HOLDING_BLOCKS.add(self)
        slots = fmt >= WRITERS_FORMAT and 0 <= block < WRITER_BLOCKS
        indexes = reversed(range(SLOTS_PER_BLOCK)) if slots else ()
        self._free_slots = [writer_slot(block, index) for index in indexes]  # pop(): the first slot first
        self._slot_states = dict.fromkeys(self._free_slots, 0)
        self._slots = threading.Condition(threading.Lock()) if slots else None

    # A copy runs between _enter and _leave (try/finally: a generator context manager would cost
    # more than a small copy): the mapping stays alive; the last user of a closed connector unmaps it.
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise ConnectError(f"connector for {self.endpoint} is closed")
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            unmap = self._closed and self._users == 0
        if unmap:
            self._unmap()

    # A mapped region needs no capability tags (the process that maps it is trusted: same uid), but
    # the grant's expiry still bounds this connector's copies: no range is started after it ends,
    # and one under way is announced in a writer slot, so a process paused in the middle of it keeps
    # the range from other objects until it goes on or dies (kvtier.master.range_book).
    def write(
        self,
        ranges: Sequence[tuple[int, Buffer]],
        checksums: list[int | None] | None = None,
        caps: Caps = None,
        chunks: list[bytes | None] | None = None,
    ) -> list[int]:
        ranges = [(offset, memoryview(buf)) for offset, buf in ranges]
        self._enter()
        slot = -1
        try:
            slot = self._take_slot()
            return self._transfer(ranges, checksums, into_region=True, caps=caps, chunks=chunks, slot=slot)
        finally:
            self._give_slot(slot)
            self._leave()

    def _take_slot(self) -> int:
        """A free writer slot of our block (its offset in the region), waiting for one when every
        slot is in use by other threads' writes; -1 when the segment has no writer slots."""
        if self._slots is None:
            return -1
        with self._slots:
            while not self._free_slots:
                self._slots.wait()
            return self._free_slots.pop()

    def _give_slot(self, slot: int) -> None:
        if self._slots is not None and slot >= 0:
            with self._slots:
                self._free_slots.append(slot)
                self._slots.notify()

    def read_into(
        self, ranges: Sequence[tuple[int, Buffer]], checksums: list[int | None] | None = None, caps: Caps = None
    ) -> list[int]:
        ranges = [(offset, memoryview(buf)) for offset, buf in ranges]
        self._enter()
        try:
            return self._transfer(ranges, checksums, into_region=False, caps=caps)
        finally:
            self._leave()

    def read_windows(
        self, grant: tuple[int, int], windows: Sequence[tuple[int, Buffer]], caps: Caps = None
    ) -> list[int]:
        """Fill each (skip, buffer) window from the granted range `grant` = (offset, length), as the
        tcp connector's read_windows: only the windows' bytes are copied out of the mapping."""
        offset, length = grant
        if any(skip + len(view) > length for skip, view in windows):
            return [_BAD_RANGE] * len(windows)
        return self.read_into([(offset + skip, view) for skip, view in windows], caps=caps)

    def read(self, ranges: Sequence[tuple[int, int]], caps: Caps = None) -> list[bytes | int]:
        """Each range's bytes, copied while its grant holds (as `read_into`: LEASE_EXPIRED otherwise)."""
        self._enter()
        try:
            region, capacity = self._view, self._capacity
            granted = self._grant_check(caps)
            out: list[bytes | int] = []
            for offset, size in ranges:
                if offset + size > capacity:
                    out.append(_BAD_RANGE)
                elif not granted():
                    out.append(_EXPIRED)
                else:
                    data = bytes(region[offset : offset + size])
                    out.append(data if granted() else _EXPIRED)  # the mount may have ended meanwhile
            return out
        finally:
            self._leave()

    def _grant_check(self, caps: Caps) -> Callable[[], bool]:
        """Whether a copy under `caps` may go on now: before its expiry + CLOCK_SKEW_MS, and (where
        the region publishes it, FORMAT 2) while the segment's mount is the one the grant names."""
        if caps is None:
            return _always
        grant_end, session = caps[0] + CLOCK_SKEW_MS, caps[2] if self._sessions else 0
        header, unpack = self._map, SESSION.unpack_from

        def granted() -> bool:
            if wall_ms() > grant_end:
                return False
            return not session or unpack(header, SESSION_OFFSET)[0] == session

        return granted

    def _transfer(
        self,
        ranges: Sequence[tuple[int, Buffer]],
        checksums: list[int | None] | None,
        into_region: bool,
        caps: Caps = None,
        chunks: list[bytes | None] | None = None,
        slot: int = -1,
    ) -> list[int]:
        """Copy each buffer into (or out of) the region; the CRC is of the destination's bytes. A range
        whose grant (caps' expiry + CLOCK_SKEW_MS) has ended, or whose grant belongs to a mount of
        the segment other than the one the region's header names now (it was dropped and mounted
        again, or its master restarted: the range may be another object's), is not copied, or not
        copied further, or (read) not taken if the mount ended during the copy: LEASE_EXPIRED.
        With `slot` (a write's writer slot), each range is announced there from before its grant is
        checked until its last byte is copied."""
        region, capacity = self._view, self._capacity
        granted = self._grant_check(caps)
        header = self._map
        cutoff = caps[0] + CLOCK_SKEW_MS if caps is not None else _NO_CUTOFF
        state = self._slot_states[slot] if slot >= 0 else 0
        announce, done = WRITER_SLOT.pack_into, WRITER_STATE.pack_into
        out = []
        try:
            for index, (offset, buf) in enumerate(ranges):
                end = offset + len(buf)
                if end > capacity:
                    out.append(_BAD_RANGE)
                    continue
                if slot >= 0:  # announced before the grant check: a writer stopped after it is seen
                    state += 1
                    announce(header, slot, state, offset, end - offset, cutoff)
                if not granted():
                    crc = None
                else:
                    stored = region[offset:end]
                    if into_region and chunks is not None and len(buf) > CHUNK_BYTES:  # chunk CRCs: same pass
                        sums = ChunkSums()
                        crc = _copy(stored, self._base + offset, buf, None, stored, sums, granted)
                        chunks[index] = sums.blob()
                    elif into_region:
                        crc = _copy(stored, self._base + offset, buf, None, stored, granted=granted)
                    else:
                        crc = _copy(buf, None, stored, self._base + offset, buf, granted=granted)
                        if crc is not None and not granted():  # the bytes read may be the next mount's
                            crc = None
                if slot >= 0:
                    state += 1
                    done(header, slot, state)
                if crc is None:
                    out.append(_EXPIRED)
                    continue
                if checksums is not None:
                    checksums[index] = crc
                out.append(_OK)
        finally:
            if slot >= 0:
                if state & 1:  # a copy that raised (a bad buffer): it is over all the same
                    state += 1
                    done(header, slot, state)
                self._slot_states[slot] = state
        return out

    def close(self) -> None:
        """Unmap now, or when the last copy in flight finishes. Later calls raise ConnectError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unmap = self._users == 0
        if unmap:
            self._unmap()

    def _unmap(self) -> None:
        del self._anchor  # the ctypes view exports the mapping: drop it before closing
        self._view.release()
        self._map.close()
        if self._grant is not None:  # after the mapping: no copy of ours can be in the region now
            self._grant.close()
            self._grant = None
