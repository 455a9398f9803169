"""Background verification of the SSD tier's payloads after a mount.

Mounting reads record headers only (`BucketStore.recover`), so a restart takes
seconds however large the tier is; every object it finds starts unverified.
This module reads their payloads afterwards, on its own thread, throttled to
`--ssd-verify-rate` bytes per second (0 = off): records of buckets that were
never sealed first (only they can hold records a crash tore), then sealed
buckets oldest first. A record whose payload CRC, header or cluster tag fails,
or that cannot be read (EIO, the file ends inside it), is corrupt: the verifier
hands it to the tier worker, which tombstones it (the store's only writer) and
reports it to the master with `ReportCorrupt`, so the master stops handing that
copy out (the object goes when it was its last replica).

Until a record is verified it may be read: a client checks every payload it
gets against the master's checksum and a promotion checks it too, so an
unverified corrupt copy can only ever be a miss (reported by the reader), never
wrong bytes. Records appended after the mount are checked as they are written
and never need this.

Threading: the verifier thread only reads (through `BucketStore.pin`, so a
bucket deleted meanwhile stays readable until it is done) and appends to a
thread-safe queue; `apply` runs on the tier worker's thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import crc32c
import grpc

from kvtier.common.logs import LogBudget
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from kvtier.segment_server.bucket_format import ALIGN, DiskRecord, RecordError
from kvtier.segment_server.buckets import BucketStore

logger = logging.getLogger(__name__)
_corrupt_log = LogBudget(logger, "ssd record corrupt")  # a badly damaged disk must not flood the log

CHUNK = 4 << 20  # bytes per read (and per throttle step); a multiple of 4096 for O_DIRECT fds
_MAX_UNREPORTED = 65536  # corrupt copies kept for a retry of ReportCorrupt while the master is away
_RPC_TIMEOUT_S = 10.0


class Throttle:
    """Paces reads to `rate` bytes per second: a read may start once the reads before it have had
    their share of time, so by any time t at most rate * t + (one read) bytes have started. Idle time
    is not saved up for a burst."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self._rate = rate
        self._clock = clock
        self._next = 0.0

    def delay(self, nbytes: int) -> float:
        """Seconds to wait before reading `nbytes`; books them."""
        now = self._clock()
        start = max(now, self._next)
        self._next = start + nbytes / self._rate
        return start - now


class Verifier:
    """Verifies the payloads of the records a mount found, in the background (see module docstring).

    Counters (read without a lock by the metrics thread): `verified` records and `verified_bytes`
    found good, `corrupt` records found bad; the backlog is `store.unverified_bytes`.
    """

    def __init__(
        self,
        store: BucketStore,
        rate: int,
        *,
        chunk: int = CHUNK,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        """`rate` in bytes per second, 0 = off. `wait(seconds)` sleeps and returns True when the
        verifier is stopping (default: the stop event's wait)."""
        if rate < 0:
            raise ValueError(f"rate must be >= 0, got {rate}")
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}, got {chunk}")
        self.store = store
        self.rate = rate
        self._chunk = chunk
        self._throttle = Throttle(rate, clock) if rate else None
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self._found: deque[DiskRecord] = deque()  # corrupt, for the tier worker to tombstone and report
        self._unreported: list[DiskRecord] = []  # tombstoned; the master has not taken the report yet
        self.verified = 0
        self.verified_bytes = 0
        self.corrupt = 0

    # ------------------------------------------------------------------ the verifier thread

    def start(self) -> None:
        """Start verifying on a thread of its own (nothing to do when off or nothing is unverified)."""
        if not self.rate or self.store.next_unverified() is None:
            return
        self._thread = threading.Thread(target=self._run, name="kvtier-ssd-verifier", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_RPC_TIMEOUT_S)

    def _run(self) -> None:
        started = time.monotonic()
        logger.info("ssd verification started backlog_bytes=%d rate=%d", self.store.unverified_bytes, self.rate)
        try:
            while not self._stop.is_set() and self.run_once():
                pass
        except Exception:  # the tier keeps serving (readers verify): say so, loudly
            logger.exception("ssd verification stopped by an error; unverified copies stay readers' to check")
            return
        if not self._stop.is_set():
            logger.info(
                "ssd verification done records=%d bytes=%d corrupt=%d seconds=%.1f",
                self.verified,
                self.verified_bytes,
                self.corrupt,
                time.monotonic() - started,
            )

    def run_once(self) -> bool:
        """Verify the next unverified record; False when there is none left (or the verifier stops)."""
        record = self.store.next_unverified()
        if record is None:
            return False
        problem = self.check(record)
        if self._stop.is_set():
            return False
        self.store.verified(record.location)
        if problem is None:
            self.verified += 1
            self.verified_bytes += record.size
        elif problem:
            self.corrupt += 1
            self._found.append(record)
            _corrupt_log.log(
                logging.WARNING,
                "ssd record corrupt location=%#x namespace=%.80s key=%.80s problem=%s",
                record.location,
                record.namespace,
                record.key,
                problem,
            )
        return True

    def check(self, record: DiskRecord) -> str | None:
        """What is wrong with the record on disk; None when it is good, "" when it is gone (deleted or
        tombstoned meanwhile) or the verifier stops while reading it."""
        try:
            plan = self.store.pin(record.location)
        except KeyError:
            return ""
        # Page-aligned (an anonymous mapping): the bucket's read fd may be O_DIRECT.
        buf = mmap.mmap(-1, min(self._chunk, plan.read_length))
        view = memoryview(buf)
        try:
            crc = 0
            done = 0  # bytes of the record read
            end = plan.header_len + plan.size
            while done < end:
                n = min(len(view), plan.read_length - done)
                if self._throttle is not None and (delay := self._throttle.delay(n)) > 0 and self._wait(delay):
                    self._stop.set()
                    return ""
                got = os.preadv(plan.fd, [view[:n]], plan.file_offset + done)
                if done == 0:
                    BucketStore.check_header(view[:got], plan, record.namespace, record.key, self.store.cluster_id)
                lo = max(plan.header_len - done, 0)
                hi = min(end - done, got)
                if lo < hi:
                    crc = crc32c.crc32c(view[lo:hi], value=crc)
                if got < n and done + got < end:
                    return f"torn: the file ends {end - done - got} bytes before the record does"
                done += got
            if crc != record.checksum:
                return f"payload CRC32C {crc:#010x} != {record.checksum:#010x}"
            return None
        except RecordError as exc:
            return str(exc)
        except OSError as exc:  # a copy that cannot be read is lost all the same
            return f"read error: {exc}"
        finally:
            view.release()
            buf.close()
            self.store.unpin(plan)

    # ------------------------------------------------------------------ the tier worker's side

    def apply(self, stub: Any, segment_id: int) -> None:
        """Tombstone the corrupt records found so far and report them to the master (ReportCorrupt),
        retrying reports the master did not take. Runs on the tier worker's thread (the store's
        writer); never raises for the master's sake: a report not taken now is retried next call."""
        found = []
        while self._found:
            found.append(self._found.popleft())
        if found:
            try:
                self.store.tombstone_many(r.location for r in found)
                self.store.sync()
            except OSError as exc:  # still live on disk: the next call tries again
                logger.error("cannot tombstone corrupt ssd records count=%d error=%s", len(found), exc)
                self._found.extendleft(reversed(found))
                return
            self._unreported += found
            if len(self._unreported) > _MAX_UNREPORTED:
                lost = len(self._unreported) - _MAX_UNREPORTED
                del self._unreported[:lost]
                logger.error("corrupt ssd records not reported to the master count=%d (the master was away)", lost)
        if self._unreported and segment_id:
            self._report(stub, segment_id)

    def _report(self, stub: Any, segment_id: int) -> None:
        by_namespace: dict[str, list[DiskRecord]] = {}
        for record in self._unreported:
            by_namespace.setdefault(record.namespace, []).append(record)
        left: list[DiskRecord] = []
        for namespace, records in by_namespace.items():
            try:
                reply = stub.ReportCorrupt(
                    pb.ReportCorruptRequest(
                        namespace=namespace,
                        keys=[r.key for r in records],
                        segment_ids=[segment_id] * len(records),
                        tiers=[pb.SSD] * len(records),
                        offsets=[r.location for r in records],
                        checksums=[r.checksum for r in records],
                    ),
                    timeout=_RPC_TIMEOUT_S,
                )
                ok = reply.status == Status.OK
            except grpc.RpcError as exc:
                logger.warning("ReportCorrupt for ssd records failed code=%s; retrying later", exc.code())
                ok = False
            if not ok:
                left += records
        self._unreported = left
