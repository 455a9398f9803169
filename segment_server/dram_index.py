"""The segment's index of the complete objects in its DRAM region, and the feed that keeps it.

The master tells each segment, in order, which of its DRAM ranges hold
complete objects (commit notices) and which stopped holding one (drop
notices); see kvtier.master.commits. `CommitFeed` long-polls them on its own
thread and applies them to `DramIndex`; each poll acknowledges the previous
batch, and the master answers a PutEnd only once its commits are
acknowledged. The polls go over the master's framed fast path when it has
one (kvtier.segment_server.commit_link), else over gRPC. After a master restart or failover the segment mounts again
and reports the index as its DRAM inventory (`report_dram_inventory`): that
is how a new master incarnation learns the objects the old one knew.

What is reported is only what can be verified: an entry whose bytes do not
match its checksum any more (the range was reused while a drop notice was
lost with the old master), or that overlaps a newer entry, is dropped, never
reported. The index lives as long as the region (the process): a restarted
segment server starts with an empty region and an empty index.

Entries are tuples, not objects, and notices are applied in bulk: this is
control-plane work (one entry per object, not per byte), off the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import crc32c
import grpc

from kvtier.common.poller import Backoff, MasterPoller
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import split_name
from kvtier.proto.status import Status, status_name
from kvtier.segment_server.commit_link import FramedFeedLink, fast_endpoint

logger = logging.getLogger(__name__)

_POLL_WAIT_MS = 1000
_MAX_NOTICES = 8192
_RPC_TIMEOUT_S = 10.0
_REPORT_BATCH = 10_000
_BACKOFF_MAX_S = 0.5
_HELLO_RETRY_S = 1.0  # after the fast path failed or the master had none: gRPC polls until then

# An entry: (name "namespace NUL key" (kvtier.proto.keys.join_name), size, checksum, instance, rank,
# pin, pin_deadline (monotonic; 0 = none), seq). Tuples built column-wise: applying a poll of
# thousands of notices is on the path of every PutEnd (the master answers once it is acknowledged).
Entry = tuple[str, int, int, str, int, int, float, int]
_SIZE, _CHECKSUM, _SEQ = 1, 2, 7


class DramIndex:
    """offset -> entry, for every complete object the master committed to this region. Thread-safe.

    It also holds the mount session (segment id, epoch) the notices belong to:
    notices are applied only under the session they were polled in, checked
    under the same lock the master link takes to end a session and snapshot
    the index, so no late notice of an old mount lands after its snapshot.
    """

    def __init__(self, region: memoryview, clock: Callable[[], float] = time.monotonic) -> None:
        self._region = region
        self._clock = clock
        # offset -> entry; a zero-size object (no range of its own) by "namespace NUL key"
        self._entries: dict[int | str, Entry] = {}
        self._bytes = 0  # sum of the entries' sizes, kept as they change (a scrape must not walk them)
        self._lock = threading.Lock()
        self._seq = 0  # order of commits: a newer entry wins an overlap
        self._session = (0, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def totals(self) -> tuple[int, int]:
        """(objects, bytes) of the complete objects this region holds by its own index: what the
        master's accounting of this segment is checked against (no DRAM range leaks)."""
        with self._lock:
            return len(self._entries), self._bytes

    @property
    def session(self) -> tuple[int, int]:
        return self._session

    def set_session(self, session: tuple[int, int]) -> None:
        with self._lock:
            self._session = session

    def clear(self) -> None:
        """The master will not take this index (it expelled us, or serves already): it is stale."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def apply(self, reply: pb.PollCommitsResponse, session: tuple[int, int]) -> int:
        """Apply one poll's notices in order, if `session` (polled in) is still the current one;
        how many (-1: not applied)."""
        now = self._clock()
        offsets, sizes, names = list(reply.offsets), list(reply.sizes), list(reply.names)
        count = len(offsets)
        checksums, drops = list(reply.checksums), list(reply.drops)
        instances = list(reply.instances) or [""] * count
        ranks = list(reply.ranks) or [0] * count
        pins = list(reply.pins) or [0] * count
        deadlines = [now + ttl / 1000 if ttl else 0.0 for ttl in reply.pin_ttl_ms] or [0.0] * count
        entries = self._entries
        with self._lock:
            if session != self._session:
                return -1
            seq, total = self._seq, self._bytes
            for offset, size, name, checksum, drop, instance, rank, pin, deadline in zip(
                offsets, sizes, names, checksums, drops, instances, ranks, pins, deadlines, strict=True
            ):
                where = offset if size else name
                old = entries.pop(where, None)
                if old is not None:
                    total -= old[_SIZE]
                if not drop:
                    seq += 1
                    entries[where] = (name, size, checksum, instance, rank, pin, deadline, seq)
                    total += size
            self._seq, self._bytes = seq, total
        return count

    def inventory(self) -> list[tuple[int, Entry]]:
        """Entries whose bytes verify, in increasing offset order, without overlaps (the newer of
        two overlapping entries is kept). Entries that fail are removed from the index."""
        return self.verify(self.plan())

    def plan(self) -> list[tuple[int, Entry]]:
        """The inventory before its bytes are checked: entries that fit the region, in increasing
        offset order, without overlaps (the newer of two overlapping entries is kept; the others
        leave the index). Cheap (a sort): `verify` does the per-byte work, chunk by chunk."""
        with self._lock:
            snapshot = list(self._entries.items())
        empty = [(0, e) for k, e in snapshot if isinstance(k, str)]  # zero-size: nothing to overlap or verify
        items = sorted((k, e) for k, e in snapshot if not isinstance(k, str))
        kept: list[tuple[int, Entry]] = []
        bad: list[tuple[int, Entry]] = []
        region = self._region
        for offset, entry in items:
            if offset + entry[_SIZE] > len(region):
                bad.append((offset, entry))
                continue
            if kept and kept[-1][0] + kept[-1][1][_SIZE] > offset:
                if kept[-1][1][_SEQ] > entry[_SEQ]:
                    bad.append((offset, entry))
                    continue
                bad.append(kept.pop())
            kept.append((offset, entry))
        if bad:
            self.forget(bad)
            logger.warning("dropped %d DRAM index entries that overlap a newer one or the region's end", len(bad))
        return empty + kept

    def verify(self, items: list[tuple[int, Entry]]) -> list[tuple[int, Entry]]:
        """The `items` (from `plan`) whose bytes still match their checksum; the others leave the index."""
        region = self._region
        verified, bad = [], []
        for offset, entry in items:
            size = entry[_SIZE]
            if not size or crc32c.crc32c(region[offset : offset + size]) == entry[_CHECKSUM]:
                verified.append((offset, entry))
            else:
                bad.append((offset, entry))
        if bad:
            self.forget(bad)
            logger.warning("dropped %d DRAM index entries that no longer verify", len(bad))
        return verified

    def forget(self, items: list[tuple[int, Entry]]) -> None:
        """Remove these entries (unless a newer commit replaced them meanwhile)."""
        with self._lock:
            for offset, entry in items:
                where: int | str = offset if entry[_SIZE] else entry[0]
                if self._entries.get(where) is entry:
                    del self._entries[where]
                    self._bytes -= entry[_SIZE]

    def pin_ttl_ms(self, entry: Entry) -> int:
        deadline = entry[6]
        return max(1, int((deadline - self._clock()) * 1000)) if deadline else 0


def report_dram_inventory(
    stub: Any, segment_id: int, epoch: int, index: DramIndex, items: list[tuple[int, Entry]]
) -> tuple[int, int]:
    """Verify `items` (the index's `plan()`) and send them to the master, chunk by chunk, each
    verified just before it is sent (the last chunk not yet marked done: the caller sends `done`
    after the SSD inventory). Verifying after the mount, not before, matters at scale: the master's
    recovery gate waits for a segment in the middle of its inventory (each chunk also counts as a
    heartbeat), not for one that has not mounted yet, and checking 5M entries takes tens of seconds.
    Entries that fail the check or that the master refuses leave the index at once. Returns
    (objects reported, objects refused)."""
    refused_total = reported = 0
    for lo in range(0, len(items), _REPORT_BATCH):
        chunk = index.verify(items[lo : lo + _REPORT_BATCH])
        reported += len(chunk)
        request = pb.DramObjectsRequest(segment_id=segment_id, epoch=epoch)
        for offset, entry in chunk:
            namespace, key = split_name(entry[0])
            request.namespaces.append(namespace)
            request.keys.append(key)
            request.sizes.append(entry[1])
            request.checksums.append(entry[2])
            request.offsets.append(offset)
            request.instances.append(entry[3])
            request.ranks.append(entry[4])
            request.pins.append(entry[5])
            request.pin_ttl_ms.append(index.pin_ttl_ms(entry))
        reply = stub.ReportDramObjects(request, timeout=_RPC_TIMEOUT_S)
        if reply.status != Status.OK:
            raise InventoryRefused(f"ReportDramObjects: {status_name(reply.status)}: {reply.error}")
        refused = [item for item, status in zip(chunk, reply.statuses, strict=True) if status != Status.OK]
        if refused:
            index.forget(refused)
            refused_total += len(refused)
    return reported, refused_total


class InventoryRefused(Exception):
    """The master refused the inventory as a whole (it restarted again, or we are not mounted)."""


class CommitFeed:
    """Long-polls the master's commit notices for this segment and applies them to the index."""

    def __init__(
        self,
        stub: Callable[[], Any],
        index: DramIndex,
        session: Callable[[], tuple[int, int]],
        token: str | None = "",
    ) -> None:
        """`stub()` gives the current master's stub; `session()` the (segment id, epoch) mounted
        now, (0, 0) when not mounted; `token` the bearer token for the master's fast path (None:
        never use it, e.g. the link is TLS and the fast path has none)."""
        self._stub = stub
        self.index = index
        self._session = session
        self._token = token
        self._stop = threading.Event()
        # Unreachable masters are logged at DEBUG: the master link's thread says it already.
        self._poller = MasterPoller(
            "commit feed",
            self._step,
            retryable=(grpc.RpcError, grpc.FutureCancelledError),
            backoff=Backoff(0.05, _BACKOFF_MAX_S),
            stop=self._stop,
            thread_name="kvtier-commit-feed",
            logger=logger,
            level=logging.DEBUG,
        )
        self._call: Any = None  # the long poll in flight: cancelled by stop()
        self._polled: tuple[int, int] = (0, 0)  # the session the notices acknowledged so far belong to
        self._acked = 0
        self._link: FramedFeedLink | None = None  # the fast path, while it works
        self._link_stub: Any = None  # the gRPC stub its endpoint came from: another one = the leader moved
        self._next_hello = 0.0  # monotonic time to look for the fast path again
        self.applied = 0
        self.polls = 0  # polls answered
        self.fast_polls = 0  # ... of them over the fast path (the rest went over gRPC)

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        call, link = self._call, self._link
        if call is not None:
            call.cancel()
        if link is not None:
            link.close()
        self._poller.stop(timeout=_POLL_WAIT_MS / 1000 + _RPC_TIMEOUT_S)

    def _step(self) -> float:
        """One long poll and the notices it brought (the poller's step): the wait before the next."""
        session = self._session()
        if not session[0]:
            return 0.02
        if session != self._polled:
            self._polled, self._acked = session, 0  # a new mount numbers its notices from 1
        segment_id, epoch = session
        reply = self._poll(
            pb.PollCommitsRequest(
                segment_id=segment_id,
                epoch=epoch,
                acked_seq=self._acked,
                wait_ms=_POLL_WAIT_MS,
                max_notices=_MAX_NOTICES,
            )
        )
        self.polls += 1
        if reply.status != Status.OK:  # SEGMENT_NOT_FOUND/UNAVAILABLE: the link mounts again
            self._drop_link()  # the leader may have moved: ask Hello again
            return 0.05
        applied = self.index.apply(reply, session)
        if applied < 0:
            return 0.0  # mounted again meanwhile: these notices belong to the old mount
        self.applied += applied
        self._acked = reply.first_seq + applied - 1
        return 0.0

    def _poll(self, request: pb.PollCommitsRequest) -> pb.PollCommitsResponse:
        """One poll: over the fast path when the master has one, else (or when it just broke) gRPC.
        A broken exchange is safe to repeat (module docstring of kvtier.segment_server.commit_link)."""
        timeout_s = _POLL_WAIT_MS / 1000 + _RPC_TIMEOUT_S
        link = self._fast_link()
        if link is not None:
            try:
                reply = link.poll(request, timeout_s, self._same_master)
                self.fast_polls += 1
                return reply
            except OSError as exc:
                if self._stop.is_set():
                    raise grpc.FutureCancelledError() from None
                logger.info("commit feed: fast path failed (%s); polling over gRPC for now", exc)
                self._drop_link()
        self._call = self._stub().PollCommits.future(request, timeout=timeout_s)
        if self._stop.is_set():
            self._call.cancel()
        return self._call.result()

    def _fast_link(self) -> FramedFeedLink | None:
        if self._link is not None and not self._same_master():
            self._drop_link()
            self._next_hello = 0.0  # the new leader's fast path, at once
        if self._link is not None or self._token is None or time.monotonic() < self._next_hello:
            return self._link
        self._next_hello = time.monotonic() + _HELLO_RETRY_S
        try:
            stub = self._stub()
            endpoint = fast_endpoint(stub, _RPC_TIMEOUT_S)
            if endpoint:
                self._link = FramedFeedLink(endpoint, self._token, _RPC_TIMEOUT_S)
                self._link_stub = stub
                logger.info("commit feed over the master's fast path endpoint=%s", endpoint)
        except (grpc.RpcError, OSError, ValueError) as exc:
            logger.info("commit feed: no fast path for now (%s); polling over gRPC", exc)
        if self._stop.is_set() and self._link is not None:
            self._drop_link()
        return self._link

    def _same_master(self) -> bool:
        """Whether the leader the fast link was opened to is still the one the segment follows
        (the master link moves the channel when it finds another leader)."""
        try:
            return self._stub() is self._link_stub
        except grpc.RpcError:  # no leader known right now: nobody else to ask either
            return True

    def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()
            self._next_hello = time.monotonic() + _HELLO_RETRY_S
