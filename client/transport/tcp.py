"""The `tcp` connector: the framed protocol over pooled blocking sockets.

Payloads go out with scatter-gather `sendmsg` straight from the caller's
buffers and come in with `recv_into` (MSG_WAITALL) straight into the caller's
buffers, so no payload is copied in user space. Requests to one segment are
pipelined: all frames of a batch are sent before the responses are read. The
last response in flight, when small, is received with its header in one
scatter call (nothing follows it on the socket, so nothing is read ahead of
its frame); values returned as bytes of up to 16 KiB are then cut from one
scratch buffer, the only copy, which costs less than the receive call saved.

A put to one segment sends its PutEnd behind its WRITE, in the same `sendmsg`
(a COMMIT frame, kvtier.client.commit), for the segment to relay to the master.

Sockets come from a bounded `SocketPool` (blocking, kernel timeouts, at most
`connections_per_segment` per endpoint; a socket that failed is closed).
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import Callable, Iterator, Sequence

import crc32c

from kvtier.client.chunks import ChunkSums
from kvtier.client.commit import SegmentCommit
from kvtier.client.config import ClientConfig
from kvtier.client.failures import Refused, failure_kind
from kvtier.client.sockpool import (
    SocketPool,
    call_deadline,
    more_time,
    recv_exact,
    recv_exact_into,
    recv_exact_into_all,
    send_all,
)
from kvtier.client.transport.base import Buffer, Caps, DiskItem
from kvtier.common.logs import request_id as current_request_id
from kvtier.common.units import parse_hostport
from kvtier.proto import frames
from kvtier.proto.chunks import CHUNK_BYTES
from kvtier.proto.errors import ConnectError, ProtocolError, ReadError
from kvtier.proto.frames import Op
from kvtier.proto.status import Status, to_status

logger = logging.getLogger(__name__)

_OK = 0
_CHUNK = 512 << 10  # per socket call when checksumming on the way: fits in L2 with room to spare
_FAILED = int(Status.TRANSFER_FAILED)
_TOO_MANY = int(Status.TOO_MANY_CONNECTIONS)
_MAX_RANGES = frames.MAX_RANGES_PER_FRAME - 1  # one table entry goes to the trace (request id)
# A last READ frame's payload is received with its header (TcpConnector._ahead) when it has at most
# this many ranges (one iovec each, far below IOV_MAX) and, for values returned as bytes (copied
# out of one scratch buffer), at most this many bytes: a copy larger than that costs more than the
# receive call it saves.
_AHEAD_RANGES = 256
_AHEAD_COPY = 16 << 10
_MAX_COMMIT_ANSWER = 64 << 20  # a RelayPutEndResponse: a few bytes per key
_STATUS_BYTES = frames.DISK_STATUS.size  # a READ_KEYED answer's status before each range's bytes


def _fill(sock: socket.socket, views: list[memoryview], got: int) -> None:
    """Receive the rest of `views`, whose first `got` bytes (in order) are in already."""
    rest = []
    for view in views:
        if got >= len(view):
            got -= len(view)
            continue
        rest.append(view[got:] if got else view)
        got = 0
    if rest:
        if call_deadline.get() is not None:  # the header's wait used some of the call: only the rest
            more_time(sock)
        recv_exact_into_all(sock, rest)


class TcpConnector:
    scheme = "tcp"
    reads_disk = True  # a DiskConnector (kvtier.client.transport.base): the segment streams its SSD records
    # `write` can send a put's PutEnd behind its WRITE (kvtier.client.commit); False once the segment
    # showed it cannot (an older segment: COMMIT is a protocol error there).
    commits = True
    # Told the kind of every failed transfer (kvtier.client.failures), set by the client that owns it.
    on_failure: Callable[[str], None] | None = None

    def __init__(self, endpoint: str, config: ClientConfig) -> None:
        self.endpoint = endpoint
        self._address = parse_hostport(endpoint.split("://", 1)[-1])
        self._frame_bytes = config.frame_bytes
        self._pool = SocketPool(self._address, config.timeout, config.connections_per_segment, f"segment {endpoint}")
        self._request_ids = itertools.count(1)

    def close(self) -> None:
        self._pool.close()

    # ------------------------------------------------------------- framing

    def _frames(self, sizes: Sequence[int], frame_bytes: int = 0, caps: bool = False) -> Iterator[tuple[int, int]]:
        """Split ranges into frames: [start, end) index pairs within the payload and range limits
        (with capabilities a range takes two table entries, and their expiry one)."""
        frame_bytes = frame_bytes or self._frame_bytes
        max_ranges = (_MAX_RANGES - 1) // 2 if caps else _MAX_RANGES
        start, payload = 0, 0
        for i, size in enumerate(sizes):
            if i > start and (payload + size > frame_bytes or i - start >= max_ranges):
                yield start, i
                start, payload = i, 0
            payload += size
        if start < len(sizes):
            yield start, len(sizes)

    def _read_response(
        self, sock: socket.socket, request_id: int, header: bytearray, ahead: list[memoryview] | None = None
    ) -> tuple[int, int, int]:
        """A response's (status, payload_len, payload bytes already received). With `ahead` (the
        buffers its payload goes to, when it is the last response in flight: nothing follows it on
        the socket), the receive that brings the header also fills them with what came with it, so a
        small read costs one receive call instead of two. An error's message may sit in them then
        (`_error_message` collects it)."""
        view = memoryview(header)
        got = 0
        if ahead:
            got = sock.recvmsg_into([view, *ahead])[0]  # no MSG_WAITALL: what has arrived, header first
            if got == 0:
                raise ReadError("peer closed the connection mid-frame")
            if got < len(view):
                recv_exact_into(sock, view[got:])
                got = len(view)
            got -= len(view)
        else:
            recv_exact_into(sock, view)
        magic, version, _op, rid, status, _flags, payload_len = frames.RESPONSE.unpack(header)
        if got > payload_len:
            raise ProtocolError(f"{self.endpoint} sent {got - payload_len} bytes past its response")
        if magic == frames.MAGIC and rid == 0 and status == _TOO_MANY:  # refused at connect
            raise Refused(f"segment {self.endpoint}: {self._error_message(sock, payload_len, ahead, got)}")
        if magic != frames.MAGIC or version != frames.VERSION or rid != request_id:
            raise ProtocolError(f"bad response from {self.endpoint}: magic={magic:#x} request={rid}/{request_id}")
        return status, payload_len, got

    def _error_message(
        self, sock: socket.socket, payload_len: int, ahead: list[memoryview] | None = None, got: int = 0
    ) -> str:
        """The message of an error response; its first `got` bytes already landed in `ahead`."""
        if payload_len > frames.MAX_ERROR_MESSAGE:
            raise ProtocolError(f"error message of {payload_len} bytes from {self.endpoint}")
        head = bytearray()
        for view in ahead or ():
            if len(head) >= got:
                break
            head += view[: got - len(head)]
        rest = recv_exact(sock, payload_len - got) if payload_len > got else b""
        return (bytes(head) + rest).decode(errors="replace")

    def _ahead(
        self, ranges: Sequence[tuple[int, Buffer | int]], sizes: list[int], start: int, end: int, into: bool
    ) -> list[memoryview] | None:
        """Where the payload of the last READ frame in flight may go with its header's receive (see
        `_read_response`): the caller's buffers when it is small (the one scatter receive the frame
        would take anyway), a scratch buffer to cut the values from when it is a few small values;
        None (header first, then the payload) otherwise."""
        if end - start > _AHEAD_RANGES:
            return None
        total = sum(sizes[start:end])
        if into and total <= _CHUNK:
            return [ranges[i][1] for i in range(start, end) if sizes[i]]  # type: ignore[misc]
        if not into and 0 < total <= _AHEAD_COPY:
            return [memoryview(bytearray(total))]
        return None

    def _run(
        self,
        op: Op,
        ranges: Sequence[tuple[int, Buffer | int]],
        into: bool,
        checksums: list[int | None] | None = None,
        caps: Caps = None,
        chunks: list[bytes | None] | None = None,
        commit: SegmentCommit | None = None,
    ) -> list:
        """Send every frame, then read every response; per-range results.

        With `commit` (a WRITE in one frame), its PutEnd goes right behind the frame (COMMIT) and
        the segment's answer lands in `commit`.

        With `checksums`, the CRC32C of each payload is computed chunk by chunk
        next to the socket call that moves it (just before a chunk is sent, just
        after it is received), while the chunk is in cache: one pass over
        memory instead of two.
        """
        sizes = [r[1] if isinstance(r[1], int) else len(r[1]) for r in ranges]
        results: list = [_FAILED] * len(ranges)
        trace = current_request_id.get()  # the client call's id: the segment logs it
        commit_id = 0  # the COMMIT frame's request id, once sent
        writes_read = False  # every WRITE response is in: a failure now is the COMMIT's alone
        spans = list(self._frames(sizes, caps=caps is not None))
        # The segment checks the one WRITE right before a COMMIT: a write of one frame only.
        with_commit = commit is not None and len(spans) == 1 and checksums is not None and chunks is not None
        if commit is not None and not with_commit:
            commit.refused = "the write took more than one frame"
        flags = frames.FLAG_COMMIT_FOLLOWS if with_commit else 0
        try:
            with self._pool.socket() as sock:
                sent = []
                for start, end in spans:
                    request_id = next(self._request_ids)
                    table = [(ranges[i][0], sizes[i]) for i in range(start, end)]
                    payload_len = sum(sizes[start:end]) if op == Op.WRITE else 0
                    frame_caps = (caps[0], b"".join(caps[1][start:end]), caps[2]) if caps is not None else None
                    buffers: list = [
                        frames.pack_request(op, request_id, table, payload_len, trace, frame_caps, flags=flags)
                    ]
                    if op == Op.WRITE and checksums is not None:
                        # Chunks go out once _CHUNK bytes are checksummed and waiting (still in
                        # cache): small objects share a sendmsg instead of costing one each.
                        waiting = 0
                        for i in range(start, end):
                            view = ranges[i][1]
                            crc = 0
                            # with `chunks`: the chunk CRCs of a large value in the same pass
                            sums = ChunkSums() if chunks is not None and sizes[i] > CHUNK_BYTES else None
                            for lo in range(0, sizes[i], _CHUNK):
                                chunk = view[lo : lo + _CHUNK]  # type: ignore[index]
                                if sums is not None:
                                    sums.add(chunk)  # type: ignore[arg-type]
                                else:
                                    crc = crc32c.crc32c(chunk, crc)
                                buffers.append(chunk)
                                waiting += len(chunk)
                                if waiting >= _CHUNK:
                                    send_all(sock, buffers)
                                    buffers, waiting = [], 0
                            checksums[i] = sums.whole if sums is not None else crc
                            if sums is not None:
                                chunks[i] = sums.blob()  # type: ignore[index]
                    elif op == Op.WRITE:
                        buffers.extend(ranges[i][1] for i in range(start, end) if sizes[i])
                    if with_commit:  # every checksum is known now: the PutEnd goes in the same send
                        commit_id = next(self._request_ids)
                        body = commit.message([r[1] for r in ranges], checksums, chunks)  # type: ignore[union-attr,misc]
                        buffers += (frames.pack_request(Op.COMMIT, commit_id, [], len(body), trace), body)
                    send_all(sock, buffers)
                    sent.append((request_id, start, end))
                header = bytearray(frames.RESPONSE.size)
                for request_id, start, end in sent:
                    ahead = None
                    if op == Op.READ and request_id == sent[-1][0]:  # nothing follows its response
                        ahead = self._ahead(ranges, sizes, start, end, into)
                    status, payload_len, got = self._read_response(sock, request_id, header, ahead)
                    if status != _OK:
                        message = self._error_message(sock, payload_len, ahead, got)
                        logger.warning(
                            "segment %s refused %s: %s: %s", self.endpoint, op.name, to_status(status).name, message
                        )
                        results[start:end] = [status] * (end - start)
                        continue
                    if op == Op.READ:
                        expected = sum(sizes[start:end])
                        if payload_len != expected:
                            raise ProtocolError(f"{self.endpoint} sent {payload_len} bytes for {expected}")
                        if ahead is not None:
                            _fill(sock, ahead, got)
                            if into:  # checksummed right after, still in cache
                                for i in range(start, end):
                                    if checksums is not None:
                                        checksums[i] = crc32c.crc32c(ranges[i][1])  # type: ignore[arg-type]
                                    results[i] = _OK
                            else:
                                scratch, pos = ahead[0], 0
                                for i in range(start, end):
                                    results[i] = bytes(scratch[pos : pos + sizes[i]])
                                    pos += sizes[i]
                            continue
                        small: list[int] = []  # small ranges waiting to be received together
                        waiting = 0
                        for i in range(start, end):
                            if into and checksums is not None and sizes[i] < _CHUNK:
                                # Small objects land with one scatter receive per _CHUNK bytes and
                                # are checksummed right after, still in cache.
                                small.append(i)
                                waiting += sizes[i]
                                if waiting >= _CHUNK or i == end - 1:
                                    self._receive_small(sock, ranges, small, checksums)
                                    results[small[0] : i + 1] = [_OK] * len(small)
                                    small, waiting = [], 0
                            elif into and checksums is not None:
                                if small:
                                    self._receive_small(sock, ranges, small, checksums)
                                    results[small[0] : i] = [_OK] * len(small)
                                    small, waiting = [], 0
                                view = ranges[i][1]
                                crc = 0
                                for lo in range(0, sizes[i], _CHUNK):
                                    chunk = view[lo : lo + _CHUNK]  # type: ignore[index]
                                    recv_exact_into(sock, chunk)
                                    crc = crc32c.crc32c(chunk, crc)
                                checksums[i] = crc
                                results[i] = _OK
                            elif into:
                                recv_exact_into(sock, ranges[i][1])  # type: ignore[arg-type]
                                results[i] = _OK
                            else:
                                results[i] = recv_exact(sock, sizes[i]) if sizes[i] else b""
                    else:
                        results[start:end] = [_OK] * (end - start)
                writes_read = True
                if commit_id:
                    self._read_commit(sock, commit_id, header, commit)  # type: ignore[arg-type]
        except (ConnectError, ReadError, ProtocolError, OSError) as exc:  # OSError: timeouts (EAGAIN), resets
            if commit_id and writes_read:  # the bytes are in: only the relayed PutEnd has no answer
                commit.refused = f"no answer to COMMIT: {exc}"  # type: ignore[union-attr]
            else:
                self._failed(op.name, exc)
        return results

    def _read_commit(self, sock: socket.socket, commit_id: int, header: bytearray, commit: SegmentCommit) -> None:
        """The COMMIT's answer into `commit`. A protocol error (an older segment that has no COMMIT
        closes the connection) raises, so the socket is not reused, and stops further COMMITs here."""
        status, payload_len, _ = self._read_response(sock, commit_id, header)
        if status != _OK:
            message = self._error_message(sock, payload_len)
            commit.refused = f"{to_status(status).name}: {message}"
            if status == Status.PROTOCOL_ERROR:
                self.commits = False
                raise ProtocolError(f"{self.endpoint} does not take COMMIT frames: {message}")
            return
        if payload_len > _MAX_COMMIT_ANSWER:
            raise ProtocolError(f"a COMMIT answer of {payload_len} bytes from {self.endpoint}")
        commit.answered(recv_exact(sock, payload_len))

    def _failed(self, op: str, exc: ConnectError | ReadError | ProtocolError | OSError) -> None:
        """A transfer failed: log it, and tell the client which kind (kvtier.client.failures)."""
        message = exc if isinstance(exc, OSError) else exc.message
        logger.warning("transfer failed endpoint=%s op=%s: %s", self.endpoint, op, message)
        kind = failure_kind(exc)
        if kind is not None and self.on_failure is not None:
            self.on_failure(kind)

    @staticmethod
    def _receive_small(
        sock: socket.socket, ranges: Sequence[tuple[int, Buffer | int]], indices: list[int], checksums: list
    ) -> None:
        """Receive the payloads of consecutive ranges `indices` (each under _CHUNK) into their
        buffers with one scatter receive, then checksum each."""
        views = [ranges[i][1] for i in indices]
        recv_exact_into_all(sock, [v for v in views if len(v)])  # type: ignore[arg-type]
        for i, view in zip(indices, views, strict=True):
            checksums[i] = crc32c.crc32c(view)

    # ------------------------------------------------------------- Connector API

    def write(
        self,
        ranges: Sequence[tuple[int, Buffer]],
        checksums: list[int | None] | None = None,
        caps: Caps = None,
        chunks: list[bytes | None] | None = None,
        commit: SegmentCommit | None = None,
    ) -> list[int]:
        return self._run(Op.WRITE, ranges, into=False, checksums=checksums, caps=caps, chunks=chunks, commit=commit)

    def read_into(
        self, ranges: Sequence[tuple[int, Buffer]], checksums: list[int | None] | None = None, caps: Caps = None
    ) -> list[int]:
        return self._run(Op.READ, ranges, into=True, checksums=checksums, caps=caps)

    def read(self, ranges: Sequence[tuple[int, int]], caps: Caps = None) -> list[bytes | int]:
        return self._run(Op.READ, ranges, into=False, caps=caps)

    def read_windows(
        self, grant: tuple[int, int], windows: Sequence[tuple[int, Buffer]], caps: Caps = None
    ) -> list[int]:
        """Fill each (skip, buffer) window from the granted range `grant` = (offset, length): the
        len(buffer) bytes at offset + skip. One READ frame with FLAG_WINDOW (kvtier.proto.frames):
        every window names the whole grant, so the grant's one tag covers them all. Per window
        OK or a negative status (all fail together)."""
        count = len(windows)
        results = [_FAILED] * count
        if count > (_MAX_RANGES - 1) // 3:
            return [int(Status.INVALID_ARGUMENT)] * count
        frame_caps = None
        if caps is not None:  # the grant's tag once per window (the frame carries one per range)
            frame_caps = (caps[0], bytes(caps[1][0]) * count if caps[1] else b"", caps[2])
        try:
            with self._pool.socket() as sock:
                request_id = next(self._request_ids)
                spans = [(skip, len(view)) for skip, view in windows]
                trace = current_request_id.get()
                table = [grant] * count
                send_all(sock, [frames.pack_request(Op.READ, request_id, table, 0, trace, frame_caps, windows=spans)])
                header = bytearray(frames.RESPONSE.size)
                status, payload_len, _ = self._read_response(sock, request_id, header)
                if status != _OK:
                    message = self._error_message(sock, payload_len)
                    logger.warning("segment %s refused READ: %s: %s", self.endpoint, to_status(status).name, message)
                    return [status] * count
                expected = sum(take for _, take in spans)
                if payload_len != expected:
                    raise ProtocolError(f"{self.endpoint} sent {payload_len} bytes for {expected}")
                for i, (_, view) in enumerate(windows):
                    recv_exact_into(sock, view)
                    results[i] = _OK
        except (ConnectError, ReadError, ProtocolError, OSError) as exc:
            self._failed("READ", exc)
        return results

    # ------------------------------------------------------------- the SSD tier

    def read_disk(
        self,
        items: Sequence[DiskItem],
        views: Sequence[Buffer] | None = None,
        checksums: list[int | None] | None = None,
        caps: Caps = None,
    ) -> list[bytes | int]:
        """Objects on the segment's SSD tier: items are (disk location, size, b"namespace\\0key").

        Per item the bytes (or, with `views`, OK after filling views[i]) or a
        negative status; one bad record fails only its item. `checksums` as
        for `read_into`. The segment reads, checks and streams the records
        (see READ_DISK in kvtier.proto.frames); this side never opens a file.
        """
        return self._read_named(Op.READ_DISK, frames.MAX_DISK_FRAME_BYTES, items, views, checksums, caps)

    def read_keyed(
        self,
        items: Sequence[DiskItem],
        views: Sequence[Buffer] | None = None,
        checksums: list[int | None] | None = None,
        caps: Caps = None,
    ) -> list[bytes | int]:
        """Direct reads (kvtier.client.locations): items are (DRAM offset, size, b"namespace\\0key")
        of copies a lookup named; the segment serves each only if its own index still says so
        (READ_KEYED in kvtier.proto.frames). Results and `checksums` as for `read_disk`."""
        return self._read_named(Op.READ_KEYED, frames.MAX_KEYED_FRAME_BYTES, items, views, checksums, caps)

    def read_keyed_one(
        self, offset: int, size: int, name: bytes, view: Buffer | None, expiry_ms: int, tag: bytes
    ) -> tuple[bytes | int, int | None]:
        """`read_keyed` of one object (a get's direct read): its bytes (or OK, into `view`) or a
        negative status, and the CRC32C of the bytes that came (None with a status). One send and,
        mostly, one receive: the general batch path walked for one key cost more than the round
        trip (docs/benchmarks.md, session 15)."""
        if size + _STATUS_BYTES > _CHUNK:  # larger than a direct read (DIRECT_READ_MAX_BYTES): the general way
            crcs: list[int | None] = [None]
            into = None if view is None else [memoryview(view)[:size]]
            result = self.read_keyed([(offset, size, name)], into, crcs, caps=(expiry_ms, [tag], 0))[0]
            if isinstance(result, bytes):
                return result, crc32c.crc32c(result)
            return result, crcs[0] if result == _OK else None
        names = frames.NAME_LENGTH.pack(len(name)) + name
        status = bytearray(_STATUS_BYTES)
        data = memoryview(bytearray(size) if view is None else view)[:size]
        parts = [memoryview(status), data] if size else [memoryview(status)]
        header = bytearray(frames.RESPONSE.size)
        try:
            with self._pool.socket() as sock:
                request_id = next(self._request_ids)
                request = frames.pack_one_range(
                    Op.READ_KEYED, request_id, offset, size, len(names), current_request_id.get(), (expiry_ms, tag, 0)
                )
                sock.sendall(request + names)
                answer, payload_len, got = self._read_response(sock, request_id, header, parts)
                if answer != _OK:
                    message = self._error_message(sock, payload_len, parts, got)
                    logger.warning(
                        "segment %s refused READ_KEYED: %s: %s", self.endpoint, to_status(answer).name, message
                    )
                    return answer, None
                if payload_len != _STATUS_BYTES + size:
                    raise ProtocolError(f"{self.endpoint} sent {payload_len} bytes for {_STATUS_BYTES + size}")
                _fill(sock, parts, got)
        except (ConnectError, ReadError, ProtocolError, OSError) as exc:
            self._failed(Op.READ_KEYED.name, exc)
            return _FAILED, None
        (item_status,) = frames.DISK_STATUS.unpack(status)
        if item_status != _OK:
            return item_status, None
        return (_OK if view is not None else bytes(data)), crc32c.crc32c(data)

    def _read_named(
        self,
        op: Op,
        max_frame: int,
        items: Sequence[DiskItem],
        views: Sequence[Buffer] | None,
        checksums: list[int | None] | None,
        caps: Caps,
    ) -> list[bytes | int]:
        """READ_DISK and READ_KEYED: ranges that name their objects, answered per range."""
        sizes = [item[1] for item in items]
        results: list[bytes | int] = [_FAILED] * len(items)
        status_buf = bytearray(frames.DISK_STATUS.size)
        trace = current_request_id.get()  # the client call's id: the segment logs it
        try:
            with self._pool.socket() as sock:
                # One frame at a time, not pipelined: the segment stops reading while it serves a
                # disk request, so a second large request sent before reading the first response
                # could fill both directions of the socket and stall both sides.
                header = bytearray(frames.RESPONSE.size)
                frame_bytes = min(self._frame_bytes, max_frame)
                for start, end in self._frames(sizes, frame_bytes, caps=caps is not None):
                    request_id = next(self._request_ids)
                    names = frames.pack_disk_names([items[i][2] for i in range(start, end)])
                    table = [(items[i][0], sizes[i]) for i in range(start, end)]
                    frame_caps = (caps[0], b"".join(caps[1][start:end]), caps[2]) if caps is not None else None
                    request = frames.pack_request(op, request_id, table, len(names), trace, frame_caps)
                    send_all(sock, [request, names])
                    expected = 4 * (end - start) + sum(sizes[start:end])
                    if expected <= _CHUNK and end - start <= _AHEAD_RANGES:
                        self._named_at_once(
                            sock, request_id, header, op, start, end, expected, sizes, views, checksums, results
                        )
                        continue
                    status, payload_len, _ = self._read_response(sock, request_id, header)
                    if status != _OK:
                        self._named_refused(op, status, self._error_message(sock, payload_len), results, start, end)
                        continue
                    if payload_len != expected:
                        raise ProtocolError(f"{self.endpoint} sent {payload_len} bytes for {expected}")
                    for i in range(start, end):
                        recv_exact_into(sock, memoryview(status_buf))
                        (item_status,) = frames.DISK_STATUS.unpack(status_buf)
                        if views is None:
                            data = recv_exact(sock, sizes[i]) if sizes[i] else b""
                            results[i] = data if item_status == _OK else item_status
                            continue
                        view = views[i]
                        crc = 0
                        for lo in range(0, sizes[i], _CHUNK):
                            chunk = view[lo : lo + _CHUNK]
                            recv_exact_into(sock, chunk)
                            if checksums is not None:
                                crc = crc32c.crc32c(chunk, crc)
                        if checksums is not None:
                            checksums[i] = crc
                        results[i] = item_status
        except (ConnectError, ReadError, ProtocolError, OSError) as exc:
            self._failed(op.name, exc)
        return results

    def _named_at_once(
        self,
        sock: socket.socket,
        request_id: int,
        header: bytearray,
        op: Op,
        start: int,
        end: int,
        expected: int,
        sizes: list[int],
        views: Sequence[Buffer] | None,
        checksums: list[int | None] | None,
        results: list[bytes | int],
    ) -> None:
        """The answer of a READ_DISK or READ_KEYED frame of at most _CHUNK bytes, nothing behind it on
        the socket: each range's status and bytes go straight to their place (the caller's buffers,
        or one buffer the values are cut from), with the header's receive when they came with it
        (a few small objects: one receive in all) and one scatter receive for the rest."""
        statuses = memoryview(bytearray(4 * (end - start)))
        if views is None:
            whole = memoryview(bytearray(sum(sizes[start:end])))
            cuts = [0, *itertools.accumulate(sizes[start:end])]
            datas = [whole[cuts[n] : cuts[n + 1]] for n in range(end - start)]
        else:
            datas = [memoryview(views[i])[: sizes[i]] for i in range(start, end)]
        parts = []
        for n, data in enumerate(datas):
            parts.append(statuses[4 * n : 4 * n + 4])
            if len(data):
                parts.append(data)
        status, payload_len, got = self._read_response(sock, request_id, header, parts)
        if status != _OK:
            return self._named_refused(
                op, status, self._error_message(sock, payload_len, parts, got), results, start, end
            )
        if payload_len != expected:
            raise ProtocolError(f"{self.endpoint} sent {payload_len} bytes for {expected}")
        rest = []
        for part in parts:  # what did not come with the header
            if got >= len(part):
                got -= len(part)
            else:
                rest.append(part[got:])
                got = 0
        if rest:
            recv_exact_into_all(sock, rest)
        for n, i in enumerate(range(start, end)):
            (item_status,) = frames.DISK_STATUS.unpack_from(statuses, 4 * n)
            if views is None:
                results[i] = bytes(datas[n]) if item_status == _OK else item_status
                continue
            if checksums is not None:
                checksums[i] = crc32c.crc32c(datas[n])
            results[i] = item_status

    def _named_refused(self, op: Op, status: int, message: str, results: list, start: int, end: int) -> None:
        logger.warning("segment %s refused %s: %s: %s", self.endpoint, op.name, to_status(status).name, message)
        results[start:end] = [status] * (end - start)
