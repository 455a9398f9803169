"""The segment server's side of the data-plane frame protocol (see kvtier.proto.frames).

`DataProtocol` is an `asyncio.BufferedProtocol`: the event loop reads straight
into buffers this class hands out. Headers and range tables land in small
per-connection buffers; WRITE payloads land directly in the region at their
target offsets, so no payload byte is copied in user space. READ responses
are queued with `writelines` as slices of the region (no copy either); the
bytes stay valid because the master does not free a range while its read
lease runs.

Grants (see kvtier.proto.frames): every READ and WRITE carries its grant's
deadline (the capability expiry, or FLAG_DEADLINE without a secret) and no
byte of it touches the region after the grant ends (deadline + CLOCK_SKEW_MS,
converted once per request to a monotonic instant). A WRITE checks it before
each region buffer it hands the event loop (one clock read per receive call,
none per byte); once past, it stops, drains the rest into scratch and answers
LEASE_EXPIRED. A READ's response is tracked by stream position (bytes queued
on this connection, less what the transport still holds); one timer per
connection, at the earliest grant end of the responses still queued, aborts
the connection if any of their bytes are still there (abort() drops queued
views unsent). Both are logged ("frame cut") and counted per op. A grant also
names the segment's mount it was issued under (kvtier.segment_server.mount_session):
a READ or WRITE of another mount is refused, and the frames admitted under a mount
are cut the same way once it ends (a WRITE at its next receive, queued READ
responses with their connection).

Invariants that keep the stream in sync:
- `get_buffer` never returns an empty buffer (uvloop closes the connection on
  one), so zero-length ranges are skipped before a payload state is entered,
  and a header buffer is exactly the missing header bytes;
- a WRITE whose ranges are rejected still has its payload drained into a
  scratch buffer before the error response is sent;
- a header that cannot be trusted (bad magic, version, op, limits) gets a
  PROTOCOL_ERROR response and the connection is closed.
Backpressure: while the transport's write buffer is above its high-water mark
no new request is read (`pause_reading` until `resume_writing`).

READ_DISK (objects on the SSD tier) and COMMIT (a client's PutEnd, relayed to
the master by kvtier.segment_server.commit_relay) are the requests served
asynchronously: their payload lands in a small buffer, then reading stops
while `DiskReader` reads, verifies and streams the records, or the relay waits
for the master, so responses stay in request order and one connection has at
most one of them in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from google.protobuf.message import DecodeError

from kvtier.common.framed_listener import FramedConnection
from kvtier.common.logs import LogBudget, format_request_id
from kvtier.proto import frames
from kvtier.proto import master_pb2 as pb
from kvtier.proto.auth import CLOCK_SKEW_MS, wall_ms
from kvtier.proto.frames import Op
from kvtier.proto.status import Status, status_name
from kvtier.segment_server.commit_relay import CommitRelay
from kvtier.segment_server.data_plane_stats import Connections, DataPlaneStats
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.keyed_reads import KeyedReads
from kvtier.segment_server.master_clock import MasterClock, local_s
from kvtier.segment_server.mount_session import CapabilityCheck, MountSession

logger = logging.getLogger(__name__)
_log = LogBudget(logger, "data plane")  # refusals and cuts: a flood of bad peers is no flood of lines

_HEADER, _RANGES, _PAYLOAD, _DRAIN, _CLOSED, _NAMES, _BUSY = range(7)
_SCRATCH_SIZE = 256 << 10
_HOLD_S = 0.05  # a WRITE's answer held for its COMMIT's goes alone after this (a slow relay)
# Where bytes to discard land (a refused WRITE's payload, input after a close): one buffer for every
# connection of the process (one event loop thread), so an idle connection costs no scratch space.
_SCRATCH = memoryview(bytearray(_SCRATCH_SIZE))
# A range table larger than this is dropped after its request instead of kept for the next one.
_TABLE_KEEP = 64 << 10
_OPS = {int(op) for op in Op}
_GRANTED = (Op.READ, Op.WRITE, Op.READ_DISK, Op.READ_KEYED)  # ops whose table may name a grant's mount
_REGION = (Op.READ, Op.WRITE)
# A range table or a payload of names is received into a buffer that starts this small and doubles
# as the bytes arrive: a header announcing megabytes costs the segment only what the peer sends.
_FIRST_ROOM = 4096


def _larger(buffer: bytearray, filled: int, need: int) -> bytearray:
    """A new buffer twice as large (at most `need`) holding `buffer`'s first `filled` bytes (a new one,
    not a resize: the event loop may still hold a view of the old)."""
    larger = bytearray(min(need, max(2 * len(buffer), _FIRST_ROOM)))
    larger[:filled] = buffer[:filled]
    return larger


_SPECIAL = frames.FLAG_TRACED | frames.FLAG_DEADLINE | frames.FLAG_CAPS  # flags with a leading table entry


class DataProtocol(FramedConnection):
    """One client connection. Created per connection by the TCP listener."""

    ANSWERS = "response"

    def __init__(
        self,
        region: memoryview,
        stats: DataPlaneStats,
        disk: DiskReader | None = None,
        connections: Connections | None = None,
        caps: CapabilityCheck | None = None,
        clock: MasterClock | None = None,
        relay: CommitRelay | None = None,
        keyed: KeyedReads | None = None,
        mount: MountSession | None = None,
    ) -> None:
        # The largest frame is a WRITE of the whole region.
        super().__init__(connections, stats, len(region))
        self._region = region
        # Grant expiries are times on the master's clock (kvtier.segment_server.master_clock).
        self._now_ms = clock.now_ms if clock is not None else wall_ms
        self._caps = caps  # with a cluster secret: every READ, WRITE and READ_DISK needs capabilities
        self._cap_tags: bytes | None = None  # of the current request
        self._cap_expiry = 0
        self._windows: tuple[int, ...] = ()  # FLAG_WINDOW: (skip, take) per range of the current READ
        self._deadline_ms = 0  # of the current request: its grant's deadline (0: it carries none)
        # The segment's mount (None: not checked, a connection driven by a test); the mount sessions
        # the current request's grant names (its deadline's and its capability's: 0 = none named),
        # and the one it was admitted under.
        self._mount = mount
        self._grant_sessions = (0, 0)
        self._frame_session = 0
        self._cut_at = 0.0  # the current WRITE's grant end, on local_s() (CLOCK_BOOTTIME: counts a suspend)
        self._write_done = 0  # payload bytes of the current WRITE's completed ranges
        # Stream position: bytes this connection has queued on its transport. A READ response still
        # queued is (its end position, its grant end (local_s()), request id, trace, mount session).
        self._queued = 0
        self._reads: deque[tuple[int, float, int, int, int]] = deque()
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_timer_at = 0.0
        self._request_start = time.monotonic()  # first byte of the current (or last) request
        self._disk = disk
        self._relay = relay  # relays COMMIT frames' PutEnds to the master (None: answers them UNAVAILABLE)
        self._keyed = keyed  # serves READ_KEYED (direct reads; None: answers them UNAVAILABLE)
        self._wrote = False  # the last request was a WRITE that completed: a COMMIT may follow it
        self._after_write = False  # ... the request before the current one was
        self._held = b""  # a WRITE's response held back for its COMMIT's (FLAG_COMMIT_FOLLOWS): one send
        self._held_timer: asyncio.TimerHandle | None = None  # sends it alone if the relay takes long
        self._drained: asyncio.Event | None = None  # set while the transport accepts writes (READ_DISK waits on it)
        self._capacity = len(region)
        self._stats = stats
        self._header = bytearray(frames.REQUEST.size)
        self._header_view = memoryview(self._header)
        self._table = bytearray(0)
        self._names = bytearray(0)  # READ_DISK object names, or a COMMIT's message
        self._state = _HEADER
        self._filled = 0  # bytes received into the current buffer
        self._need = frames.REQUEST.size  # size of the current buffer
        # Current request.
        self._op = 0
        self._request_id = 0
        self._flags = 0
        self._trace = 0  # the client's request id (FLAG_TRACED), for logs
        self._nranges = 0
        self._payload_len = 0
        self._ranges: tuple[int, ...] = ()
        self._range_index = 0  # WRITE: the last range of the run the payload is filling
        self._run_base = 0  # WRITE: region offset of that run's first byte
        self._drain_left = 0
        self._drain_status = 0
        self._drain_message = ""

    # ----------------------------------------------------------- asyncio hooks

    def refusal(self, limit: int) -> bytes:
        data = f"too many connections: this segment serves {limit} at most".encode()
        return frames.pack_response(0, 0, Status.TOO_MANY_CONNECTIONS, len(data)) + data

    def _lost(self) -> None:
        self._reads.clear()
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._drained is not None:
            self._drained.set()  # wake a disk request so it notices the connection is gone

    def _is_closed(self) -> bool:
        return self._state == _CLOSED

    def _mark_closed(self) -> None:
        self._state = _CLOSED

    def _server_busy(self) -> bool:
        return self._state == _BUSY  # a disk response: its sender has its own send timeout

    def _between_requests(self) -> bool:
        return self._state == _HEADER and self._filled == 0

    def _request_since(self) -> float:
        return self._request_start

    def _log_abort(self, reason: str) -> None:
        _log.log(
            logging.INFO,
            "connection closed",
            extra={"rid": format_request_id(self._trace), "fields": {"peer": self._peer(), "reason": reason}},
        )

    def _writing_paused(self) -> None:
        if self._drained is not None:
            self._drained.clear()
        if self._transport is not None:
            self._transport.pause_reading()

    def _writing_resumed(self) -> None:
        if self._drained is not None:
            self._drained.set()
        if self._transport is not None and self._state not in (_CLOSED, _BUSY):
            self._transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        state = self._state
        if state == _PAYLOAD:
            if local_s() > self._cut_at:  # the grant ended: not one more byte into the region
                return self._cut_write("the grant of these ranges ended")
            if self._mount is not None and self._mount.current[0] != self._frame_session:
                return self._cut_write("the segment's mount this grant belongs to ended")
            base = self._run_base
            return self._region[base + self._filled : base + self._need]
        if state == _HEADER:
            return self._header_view[self._filled :]
        if state == _RANGES:
            if self._filled == len(self._table):  # all the room given is filled: room for more
                self._table = _larger(self._table, self._filled, self._need)
            return memoryview(self._table)[self._filled : self._need]
        if state == _DRAIN:
            return _SCRATCH[: min(self._drain_left, _SCRATCH_SIZE)]
        if state == _NAMES:
            if self._filled == len(self._names):
                self._names = _larger(self._names, self._filled, self._need)
            return memoryview(self._names)[self._filled : self._need]
        return _SCRATCH  # closed: swallow whatever is still in flight

    def buffer_updated(self, nbytes: int) -> None:
        state = self._state
        if state == _HEADER and self._filled == 0:
            self._request_start = time.monotonic()
        if state == _DRAIN:
            self._drain_left -= nbytes
            if self._drain_left == 0:
                self._send_error(self._drain_status, self._drain_message)
                self._start_header()
            return
        self._filled += nbytes
        if self._filled < self._need:
            return
        if state == _PAYLOAD:
            self._stats.bytes_written += self._need
            self._write_done += self._need
            self._next_write_range()
        elif state == _HEADER:
            self._on_header()
        elif state == _RANGES:
            ranges = frames.unpack_ranges(self._table, self._nranges)
            traced = self._flags & frames.FLAG_TRACED
            if traced:
                self._trace, ranges = ranges[0], ranges[2:]
                self._nranges -= 1
            self._deadline_ms = 0
            leading = 1 if traced else 0  # table entries before the capability block
            if self._flags & frames.FLAG_DEADLINE:
                self._deadline_ms, self._grant_sessions, ranges = ranges[0], (ranges[1], 0), ranges[2:]
                self._nranges -= 1
                leading += 1
            if self._flags & frames.FLAG_WINDOW:  # one (skip, take) per range ends the table
                caps = 1 if self._flags & frames.FLAG_CAPS else 0
                count, odd = divmod(self._nranges - caps, 3 if caps else 2)
                if odd or count == 0:
                    return self._fatal(f"{self._nranges} table entries do not hold a window per range")
                self._windows, ranges = ranges[-2 * count :], ranges[: -2 * count]
                self._nranges -= count
            if self._flags & frames.FLAG_CAPS:  # (expiry, session), n ranges, n tags: 1 + 2n entries
                if self._nranges % 2 == 0:
                    return self._fatal(f"capability block of {self._nranges} entries (expected 1 + 2 per range)")
                count = self._nranges // 2
                first_tag = leading + 1 + count  # table entry where the tags start
                self._cap_expiry = ranges[0]
                self._grant_sessions = (self._grant_sessions[0], ranges[1])
                # The capability's expiry bounds the frame; a deadline entry can only shorten it.
                self._deadline_ms = min(self._deadline_ms or ranges[0], ranges[0])
                self._cap_tags = bytes(self._table[16 * first_tag : 16 * (first_tag + count)])
                ranges = ranges[2 : 2 + 2 * count]
                self._nranges = count
            self._ranges = ranges
            if len(self._table) > _TABLE_KEEP:  # a huge table was needed once: do not keep it
                self._table = bytearray(0)
            self._on_request()
        elif state == _NAMES:
            {Op.READ_DISK: self._on_disk_request, Op.READ_KEYED: self._on_keyed}.get(self._op, self._on_commit)()

    # ----------------------------------------------------------- state machine

    def _receive_names(self) -> None:
        """The request's payload next, into its own buffer: READ_DISK's and READ_KEYED's object names,
        a COMMIT's message (handled once all of it is in: the _NAMES state)."""
        self._names = bytearray(min(self._payload_len, _FIRST_ROOM))  # grown as bytes arrive (_larger)
        self._state = _NAMES
        self._filled = 0
        self._need = self._payload_len

    def _start_header(self) -> None:
        self._state = _HEADER
        self._filled = 0
        self._need = frames.REQUEST.size

    def _on_header(self) -> None:
        magic, version, op, request_id, nranges, flags, payload_len = frames.REQUEST.unpack(self._header)
        self._op, self._request_id, self._flags, self._trace = op, request_id, flags, 0
        self._after_write, self._wrote = self._wrote, False
        self._cap_tags = None
        self._deadline_ms = 0
        self._grant_sessions = (0, 0)
        self._windows = ()
        self._started = time.perf_counter()
        if magic != frames.MAGIC or version != frames.VERSION:
            return self._fatal(f"bad frame magic/version {magic:#x}/{version}")
        if op not in _OPS:
            return self._fatal(f"unknown op {op}")
        if nranges > frames.MAX_RANGES_PER_FRAME:
            return self._fatal(f"{nranges} ranges in one frame; the limit is {frames.MAX_RANGES_PER_FRAME}")
        if op == Op.WRITE and not self.frame_fits(payload_len):
            return self._fatal(f"write payload of {payload_len} bytes exceeds the region ({self._capacity})")
        if flags & frames.FLAG_TRACED and nranges == 0:
            return self._fatal("a traced frame without its trace entry")
        if flags & frames.FLAG_CAPS and nranges == 0:
            return self._fatal("a frame with capabilities but no capability block")
        if flags & frames.FLAG_WINDOW and op != Op.READ:
            return self._fatal(f"op {op} with read windows (FLAG_WINDOW is for READ only)")
        if flags & frames.FLAG_COMMIT_FOLLOWS and op != Op.WRITE:
            return self._fatal(f"op {op} with FLAG_COMMIT_FOLLOWS (a WRITE's flag)")
        if self._held and op != Op.COMMIT:  # announced, yet no COMMIT came: its WRITE's answer first
            self._send(b"")
        special = (flags & _SPECIAL).bit_count()  # one table entry each (a popcount: this runs per request)
        if nranges < special:
            return self._fatal(f"{nranges} table entries for {special} flagged entries")
        if op in (Op.READ_DISK, Op.READ_KEYED):
            if payload_len > nranges * frames.MAX_DISK_NAME:
                return self._fatal(f"{Op(op).name} names of {payload_len} bytes for {nranges} ranges")
        elif op == Op.COMMIT:
            if payload_len > frames.MAX_COMMIT_BYTES:
                return self._fatal(f"a COMMIT of {payload_len} bytes; the limit is {frames.MAX_COMMIT_BYTES}")
            if flags & ~frames.FLAG_TRACED or nranges != special:
                return self._fatal("a COMMIT carries no ranges (its trace entry only)")
        elif op != Op.WRITE and payload_len:
            return self._fatal(f"op {op} must not carry a payload")
        self._stats.requests += 1
        self._nranges = nranges
        self._payload_len = payload_len
        if nranges == 0:
            self._ranges = ()
            return self._on_request()
        need = 16 * nranges
        if len(self._table) < need:
            self._table = bytearray(min(need, _FIRST_ROOM))  # grown as the table arrives (_larger)
        self._state = _RANGES
        self._filled = 0
        self._need = need

    def _on_request(self) -> None:
        op, ranges, capacity = self._op, self._ranges, self._capacity
        if self._mount is not None and op in _GRANTED and (refused := self._other_mount(op in _REGION)):
            return self._drain(Status.LEASE_EXPIRED, refused)  # asked again, the master names this mount
        if self._caps is not None and op in (Op.READ, Op.WRITE) and (denied := self._capability_problem(op)):
            self._stats.capability_denials += 1
            if op == Op.WRITE:
                return self._drain(Status.CAPABILITY_DENIED, denied)
            self._send_error(Status.CAPABILITY_DENIED, denied)
            return self._start_header()
        if op in (Op.READ, Op.WRITE):
            if not self._deadline_ms:  # every region access is bounded by a grant
                self._stats.capability_denials += 1
                return self._refuse(
                    Status.CAPABILITY_DENIED,
                    "a READ or WRITE must carry its grant's deadline (FLAG_DEADLINE or FLAG_CAPS)",
                )
            left_ms = self._deadline_ms + CLOCK_SKEW_MS - self._now_ms()
            if left_ms <= 0:
                return self._refuse(Status.LEASE_EXPIRED, f"the grant of these ranges ended {-left_ms} ms ago")
            self._cut_at = local_s() + left_ms / 1000
        if op == Op.COMMIT:
            return self._start_commit()
        if op == Op.READ_KEYED:
            return self._start_keyed()
        if op == Op.READ_DISK:
            if self._payload_len == 0:
                return self._on_disk_request()
            # Refuse before buffering the names (up to ~80 MiB): the ranges and their tags are in.
            if self._disk is None:
                return self._drain(Status.NOT_FOUND, "this segment has no SSD tier")
            if self._caps is not None and (denied := self._capability_problem(Op.READ_DISK)):
                self._stats.capability_denials += 1
                return self._drain(Status.CAPABILITY_DENIED, denied)
            return self._receive_names()
        total = 0
        bad = None
        for i in range(0, len(ranges), 2):
            offset, length = ranges[i], ranges[i + 1]
            if offset + length > capacity:
                bad = (offset, length)
                break
            total += length
        if op == Op.WRITE:
            if bad is None and total != self._payload_len:
                return self._fatal(f"write payload_len {self._payload_len} != sum of range lengths {total}")
            if bad is not None:
                self._stats.range_errors += 1
                return self._drain(
                    Status.INVALID_RANGE, f"range offset={bad[0]} length={bad[1]} outside region of {capacity}"
                )
            self._range_index = -1
            self._write_done = 0
            self._next_write_range()
        elif op == Op.READ:
            if bad is not None:
                self._stats.range_errors += 1
                self._send_error(
                    Status.INVALID_RANGE, f"range offset={bad[0]} length={bad[1]} outside region of {capacity}"
                )
                return self._start_header()
            if self._windows:  # only a window of each range (verified ranged reads)
                ranges, total = self._windowed(ranges)
                if total < 0:
                    self._stats.range_errors += 1
                    self._send_error(Status.INVALID_RANGE, "a read window lies outside its range")
                    return self._start_header()
            region = self._region
            parts = [frames.pack_response(op, self._request_id, 0, total)]
            for i in range(0, len(ranges), 2):
                if ranges[i + 1]:
                    parts.append(region[ranges[i] : ranges[i] + ranges[i + 1]])
            self._transport.writelines(parts)
            self._queued += frames.RESPONSE.size + total
            if total and self._transport.get_write_buffer_size():  # region views wait in the transport
                self._track_read(self._cut_at)
            self._stats.bytes_read += total
            self._stats.latency["READ"].observe(time.perf_counter() - self._started)
            self._start_header()
        else:  # PING
            self._send(frames.pack_response(op, self._request_id, 0))
            self._start_header()

    def _windowed(self, ranges: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The flat (offset, length) table of this READ's windows and their total; total -1 when a
        window lies outside its range (the ranges themselves were checked against the region)."""
        windows, out, total = self._windows, [], 0
        for i in range(0, len(ranges), 2):
            skip, take = windows[i], windows[i + 1]
            if skip + take > ranges[i + 1]:
                return (), -1
            out += (ranges[i] + skip, take)
            total += take
        return tuple(out), total

    def _next_write_range(self) -> None:
        """Enter the next run of the current WRITE, or finish it.

        A run is the next non-empty range together with the ranges after it that continue it in
        the region (a batch's objects are usually allocated back to back): the event loop then
        receives a run in as few calls as the socket allows, instead of at least one call (and two
        Python callbacks) per range. Empty ranges carry no bytes and neither start nor break a run.
        """
        ranges, count = self._ranges, self._nranges
        index = self._range_index + 1
        while index < count and ranges[2 * index + 1] == 0:
            index += 1
        if index < count:
            base = ranges[2 * index]
            end = base + ranges[2 * index + 1]
            last = index
            index += 1
            while index < count:
                length = ranges[2 * index + 1]
                if length and ranges[2 * index] != end:
                    break
                if length:
                    end += length
                    last = index
                index += 1
            self._range_index = last
            self._run_base = base
            self._state = _PAYLOAD
            self._filled = 0
            self._need = end - base
            return
        response = frames.pack_response(Op.WRITE, self._request_id, 0)
        if self._flags & frames.FLAG_COMMIT_FOLLOWS and self._relay is not None:
            self._held = response  # sent with the COMMIT's answer (kvtier.proto.frames)
        else:
            self._send(response)
        self._stats.latency["WRITE"].observe(time.perf_counter() - self._started)
        self._wrote = True
        self._start_header()

    def _drain(self, status: Status, message: str) -> None:
        if self._payload_len == 0:
            self._send_error(status, message)
            return self._start_header()
        self._state = _DRAIN
        self._drain_left = self._payload_len
        self._drain_status, self._drain_message = status, message

    def _send_error(self, status: int, message: str, level: int = logging.WARNING) -> None:
        if status != Status.PROTOCOL_ERROR:  # _fatal logged those
            _log.log(
                level,
                "request refused",
                extra={
                    "rid": format_request_id(self._trace),
                    "fields": {
                        "peer": self._peer(),
                        "op": Op(self._op).name if self._op in _OPS else self._op,
                        "status": status_name(status),
                        "detail": message,
                    },
                },
            )
        data = message.encode()[: frames.MAX_ERROR_MESSAGE]
        self._send(frames.pack_response(self._op, self._request_id, status, len(data)) + data)

    def _send(self, data: bytes) -> None:
        if self._held:  # a WRITE's response held for its COMMIT goes out first, in the same send
            data, self._held = self._held + data, b""
        self._transport.write(data)
        self._queued += len(data)

    def _refuse(self, status: Status, message: str) -> None:
        """Answer the current READ or WRITE with an error before any byte of it touched the region."""
        if self._op == Op.WRITE:
            return self._drain(status, message)
        self._send_error(status, message)
        return self._start_header()

    # ----------------------------------------------------------- grant deadlines

    def _log_cut(self, op: str, request_id: int, trace: int, detail: str) -> None:
        self._stats.frames_cut[op] += 1
        _log.log(
            logging.WARNING,
            "frame cut: its grant ended",
            extra={
                "rid": format_request_id(trace),
                "fields": {"peer": self._peer(), "op": op, "request": request_id, "detail": detail},
            },
        )

    def _other_mount(self, region: bool) -> str:
        """Why this request's grant is not of the segment's current mount ("" = it is; a grant naming
        none, from a client older than mount sessions, is taken as the current mount's). `region`
        (READ, WRITE): no grant is valid while the segment is not mounted; READ_DISK and READ_KEYED
        check what they serve themselves, and are refused only a grant naming another mount (its
        tags would fail under this mount's key: LEASE_EXPIRED says to look up again)."""
        current = self._mount.current[0]  # type: ignore[union-attr]
        if not current and region:
            return "this segment is not mounted on a master: no grant is valid now"
        deadline_session, cap_session = self._grant_sessions  # unpacked: this runs per frame
        if (deadline_session and deadline_session != current) or (cap_session and cap_session != current):
            return (
                "granted under an earlier mount of this segment (it was dropped and mounted again, or its "
                "master restarted): ask the master again"
            )
        self._frame_session = current
        return ""

    def _cut_write(self, reason: str) -> memoryview:
        """The current WRITE outlived its grant (or the mount the grant belongs to): the rest of its
        payload goes to scratch, then LEASE_EXPIRED (the connection stays in sync). Returns the buffer
        for the bytes arriving now."""
        left = self._payload_len - self._write_done - self._filled
        detail = f"{reason}: {left} of {self._payload_len} payload bytes not written"
        self._log_cut("WRITE", self._request_id, self._trace, detail)
        self._state = _DRAIN
        self._drain_left = left
        self._drain_status = Status.LEASE_EXPIRED
        self._drain_message = f"{reason} before the payload arrived: nothing more was written"
        return _SCRATCH[: min(left, _SCRATCH_SIZE)]

    def _track_read(self, cut_at: float) -> None:
        """A READ response (ending at the current stream position) is still queued: make sure a timer
        looks at it when its grant ends."""
        self._reads.append((self._queued, cut_at, self._request_id, self._trace, self._frame_session))
        if self._read_timer is None or cut_at < self._read_timer_at:
            self._arm_read_timer(cut_at)

    def _arm_read_timer(self, at: float) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer_at = at
        # On the monotonic clock (the loop's): late by a host suspend's length (docs/architecture.md).
        self._read_timer = asyncio.get_running_loop().call_later(max(0.0, at - local_s()), self._check_reads)

    def _check_reads(self) -> None:
        """Forget READ responses the kernel has taken; abort if one still queued is past its grant."""
        self._read_timer = None
        transport, reads = self._transport, self._reads
        if transport is None or self._state == _CLOSED:
            reads.clear()
            return
        sent = self._queued - transport.get_write_buffer_size()
        while reads and reads[0][0] <= sent:
            reads.popleft()
        if not reads:
            return
        first = min(entry[1] for entry in reads)
        if first > local_s():
            return self._arm_read_timer(first)
        end, _cut_at, request_id, trace, _session = next(entry for entry in reads if entry[1] == first)
        self._log_cut("READ", request_id, trace, f"{end - sent} bytes up to its end unsent; the connection is aborted")
        reads.clear()
        self.abort("a READ response outlived its grant")

    def cut_reads_of_ended_mounts(self) -> None:
        """Abort the connection if a READ response admitted under an ended mount is still queued."""
        transport, reads = self._transport, self._reads
        if transport is None or self._state == _CLOSED or not reads or self._mount is None:
            return
        sent = self._queued - transport.get_write_buffer_size()
        while reads and reads[0][0] <= sent:
            reads.popleft()
        current = self._mount.current[0]
        stale = next((entry for entry in reads if entry[4] != current), None)
        if stale is None:
            return
        end, _cut_at, request_id, trace, _session = stale
        detail = f"the segment's mount ended: {end - sent} bytes up to its end unsent; the connection is aborted"
        self._log_cut("READ", request_id, trace, detail)
        reads.clear()
        self.abort("a READ response outlived its segment's mount")

    def _capability_problem(self, op: int) -> str:
        """Why this request's ranges may not be served ("" = every range has its valid capability)."""
        key = self._caps.key()
        if key is None:
            return "this segment is not mounted on a master: no capability is valid yet"
        if self._cap_tags is None:
            return "this segment serves only ranges with capabilities from the master (the cluster has a secret)"
        return key.check(op, self._cap_expiry, self._ranges, self._cap_tags, self._now_ms())

    def _fatal(self, message: str) -> None:
        self._stats.protocol_errors += 1
        peer = self._peer()
        _log.log(
            logging.WARNING,
            "protocol error, closing the connection",
            extra={"rid": format_request_id(self._trace), "fields": {"peer": peer, "detail": message}},
        )
        self._send_error(Status.PROTOCOL_ERROR, message)
        self._state = _CLOSED
        self._transport.close()

    # ----------------------------------------------------------- direct reads

    def _start_keyed(self) -> None:
        """A READ_KEYED's ranges are in: refuse it (its names drained) or buffer its names."""
        ranges = self._ranges
        if self._keyed is None:
            return self._drain(Status.UNAVAILABLE, "this segment serves no direct reads")
        if self._caps is not None and (denied := self._capability_problem(Op.READ)):  # a READ's grant
            self._stats.capability_denials += 1
            return self._drain(Status.CAPABILITY_DENIED, denied)
        if (total := sum(ranges[1::2])) > frames.MAX_KEYED_FRAME_BYTES:
            return self._drain(
                Status.INVALID_RANGE, f"{total} bytes in one READ_KEYED; the limit is {frames.MAX_KEYED_FRAME_BYTES}"
            )
        if any(ranges[i] + ranges[i + 1] > self._capacity for i in range(0, len(ranges), 2)):
            self._stats.range_errors += 1
            return self._drain(Status.INVALID_RANGE, f"a range outside the region of {self._capacity}")
        if self._payload_len == 0:
            return self._on_keyed()
        self._receive_names()

    def _on_keyed(self) -> None:
        """Check and copy each range (kvtier.segment_server.keyed_reads), answer in one send."""
        try:
            names = frames.unpack_names(self._names, self._nranges)
        except ValueError as exc:
            return self._fatal(f"malformed READ_KEYED names: {exc}")
        finally:
            self._names = bytearray(0)
        parts, served = self._keyed.serve(self._ranges, names)
        total = sum(len(part) for part in parts)
        self._transport.writelines([frames.pack_response(Op.READ_KEYED, self._request_id, 0, total), *parts])
        self._queued += frames.RESPONSE.size + total  # copies: nothing of the region waits in the transport
        self._stats.bytes_read += served
        self._stats.latency["READ_KEYED"].observe(time.perf_counter() - self._started)
        self._start_header()

    # ----------------------------------------------------------- commit through the segment

    def _start_commit(self) -> None:
        """A COMMIT's header is in: refuse it (its payload drained) or buffer its message."""
        if not self._after_write:
            self._stats.commits_refused += 1
            return self._drain(Status.INVALID_ARGUMENT, "a COMMIT must come right behind a WRITE that completed")
        if self._relay is None:
            return self._drain(Status.UNAVAILABLE, "this segment relays no commits")
        if self._payload_len == 0:
            return self._on_commit()
        self._receive_names()

    def _on_commit(self) -> None:
        """Relay the PutEnd; read nothing more from this connection until it is answered."""
        message, self._names = bytes(self._names), bytearray(0)
        try:  # a message the master could not decode would cut the relay's connection for every put
            pb.RelayPutEndRequest.FromString(message)
        except DecodeError:
            self._stats.commits_refused += 1
            self._send_error(Status.INVALID_ARGUMENT, "a COMMIT's payload is no RelayPutEndRequest")
            return self._start_header()
        if self._held:  # the client must learn that its bytes are in even when the relay is slow
            self._held_timer = asyncio.get_running_loop().call_later(_HOLD_S, self._release_held)
        self._state = _BUSY
        self._transport.pause_reading()
        self._relay.commit(message, self._commit_answered)

    def _commit_answered(self, status: int, answer: bytes) -> None:
        """The relay's answer: (0, the RelayPutEndResponse for the client) or (status, a message).
        Once: a second call (a failure path answering again) finds the connection past the COMMIT."""
        if self._state != _BUSY or self._op != Op.COMMIT or self._transport is None:
            return
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        if status == 0:
            self._send(frames.pack_response(Op.COMMIT, self._request_id, 0, len(answer)) + answer)
            self._stats.latency["COMMIT"].observe(time.perf_counter() - self._started)
        else:  # the client sends its PutEnd itself: nothing is lost, nothing to warn about
            self._send_error(status, answer.decode(errors="replace"), logging.INFO)
        self._start_header()
        if not self._write_paused:
            self._transport.resume_reading()

    def _release_held(self) -> None:
        """The relay is slow: the WRITE's held answer goes now (its COMMIT's follows when it comes),
        so a client timing out on the COMMIT still knows its bytes are in and may send PutEnd itself."""
        self._held_timer = None
        if self._held and self._state != _CLOSED and self._transport is not None:
            self._send(b"")

    # ----------------------------------------------------------- the SSD tier

    def _on_disk_request(self) -> None:
        ranges = self._ranges
        try:
            names = frames.unpack_disk_names(self._names if self._payload_len else b"", self._nranges)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._fatal(f"malformed READ_DISK names: {exc}")
        finally:
            self._names = bytearray(0)  # parsed: the buffer is not kept for the connection's life
        if self._caps is not None and (denied := self._capability_problem(Op.READ_DISK)):
            self._stats.capability_denials += 1
            self._send_error(Status.CAPABILITY_DENIED, denied)
            return self._start_header()
        total = sum(ranges[1::2])
        if self._disk is None:
            self._send_error(Status.NOT_FOUND, "this segment has no SSD tier")
            return self._start_header()
        if total > frames.MAX_DISK_FRAME_BYTES:
            self._send_error(
                Status.INVALID_RANGE, f"{total} bytes in one READ_DISK; the limit is {frames.MAX_DISK_FRAME_BYTES}"
            )
            return self._start_header()
        self._state = _BUSY
        self._transport.pause_reading()
        if self._drained is None:
            self._drained = asyncio.Event()
        if not self._write_paused:
            self._drained.set()
        task = asyncio.get_running_loop().create_task(
            self._disk.serve(self._transport, self._drained, self._request_id, ranges, names, self._stats, self._trace)
        )
        task.add_done_callback(self._disk_done)

    def _disk_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("READ_DISK failed", exc_info=task.exception())
            if self._transport is not None:
                # The response may be half written: the stream cannot continue. abort(), not close():
                # a graceful close would still send queued views of read buffers already reused.
                self._transport.abort()
            return
        if self._state == _CLOSED or self._transport is None:
            return
        self._stats.latency["READ_DISK"].observe(time.perf_counter() - self._started)
        # The disk reader wrote the whole response on the transport: keep the stream position true.
        self._queued += frames.RESPONSE.size + 4 * self._nranges + sum(self._ranges[1::2])
        self._start_header()
        if not self._write_paused:
            self._transport.resume_reading()
