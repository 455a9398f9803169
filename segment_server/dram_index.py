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

Entries are packed (issue 19: ten million objects): one `bytes` per entry, a
fixed 24-byte header (size, commit sequence, checksum, party) and then the
name's UTF-8, the value of a dict keyed by offset. The party is an index into
a small table of the (engine instance, rank, pin) triples the entries share;
the rare soft-pin deadline lives in a side dict. About 120 bytes traced per
entry beside the name, against 360 for the tuple of eight objects it replaces
(docs/benchmarks.md). The inventory reads the packed headers column-wise
(`map` over `struct.unpack_from`, not a Python loop per entry), and builds
`Entry` tuples only for the chunk about to be sent. Notices are applied in
bulk: this is control-plane work (one entry per object, not per byte), off the
event loop.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, compress, islice, repeat
from operator import add, eq, gt, itemgetter
from typing import Any

import crc32c
import grpc

from kvtier.common.poller import Backoff, MasterPoller
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import NAME_SEPARATOR
from kvtier.proto.status import Status, status_name
from kvtier.segment_server.commit_link import FramedFeedLink, fast_endpoint

logger = logging.getLogger(__name__)

_POLL_WAIT_MS = 1000
_MAX_NOTICES = 8192
_RPC_TIMEOUT_S = 10.0
_REPORT_BATCH = 10_000
_BACKOFF_MAX_S = 0.5
_HELLO_RETRY_S = 1.0  # after the fast path failed or the master had none: gRPC polls until then

# An entry as the inventory hands it out: (name "namespace NUL key" (kvtier.proto.keys.join_name),
# size, checksum, instance, rank, pin, pin_deadline (monotonic; 0 = none), seq).
Entry = tuple[str, int, int, str, int, int, float, int]

# The packed entry: size, seq, checksum, party (index into the DramIndex._party_* columns); then the name.
# The size comes first so that planning reads it alone (_SIZE_OF), without unpacking the rest.
# Native byte order: `verify` reads the headers back through memoryview.cast, which is native.
_HEAD = struct.Struct("=QQII")
_HEADER = _HEAD.size
_SIZE_OF = struct.Struct("=Q").unpack_from
_CHECKSUM_OF = struct.Struct("=16xI").unpack_from
_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)
_HEAD_BYTES = itemgetter(slice(0, _HEADER))
_NAME_BYTES = itemgetter(slice(_HEADER, None))
Party = tuple[str, int, int]  # (engine instance, rank, pin): shared by most entries, interned


@dataclass(slots=True)
class Plan:
    """The inventory before its bytes are checked (`DramIndex.plan`): parallel lists, zero-size
    entries first (offset 0), then by increasing offset. Two lists, not a tuple per entry: at
    millions of entries the plan is what the segment holds beside its index while it reports."""

    offsets: list[int]
    packed: list[bytes]
    deadlines: dict[int | str, float]  # soft-pin deadlines at planning time (few)
    groups: dict[int | str, tuple[int, int]] = field(default_factory=dict)  # group tags at planning time

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, part: slice) -> Plan:
        return Plan(self.offsets[part], self.packed[part], self.deadlines, self.groups)


@dataclass(slots=True)
class Verified:
    """What `DramIndex.verify` found intact: parallel columns, one item per entry, in plan order
    (a request's repeated fields are extended from them whole). Iterating gives (offset, Entry)."""

    offsets: list[int]
    packed: list[bytes]  # the index's own entries: `forget_planned` removes them unless replaced
    names: list[str]
    sizes: list[int]
    checksums: list[int]
    instances: list[str]
    ranks: list[int]
    pins: list[int]
    deadlines: list[float]
    seqs: list[int]
    groups: list[tuple[int, int]] | None = None  # (group id, member count) per entry; None: no member

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self) -> Iterator[tuple[int, Entry]]:
        entries = zip(
            self.names,
            self.sizes,
            self.checksums,
            self.instances,
            self.ranks,
            self.pins,
            self.deadlines,
            self.seqs,
            strict=True,
        )
        return zip(self.offsets, entries, strict=True)


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
        self._entries: dict[int, bytes] = {}  # offset -> packed entry
        self._empty: dict[str, bytes] = {}  # zero-size objects (no range of their own), by name
        self._deadlines: dict[int | str, float] = {}  # soft pins' deadlines, for the entries that have one
        # (group id, member count) of the entries committed as a group's members (kvtier.master.groups):
        # reported with them, so a new master incarnation forms the group again. Few: groups are rare.
        self._groups: dict[int | str, tuple[int, int]] = {}
        # (instance, rank, pin) triples, interned: an entry holds the index. Bounded by the distinct
        # owners the master ever committed here, not by the objects; only appended to (kept by
        # clear()), so the ids a plan holds stay valid while it is verified.
        self._party_ids: dict[Party, int] = {("", 0, 0): 0}
        self._party_instances, self._party_ranks, self._party_pins = [""], [0], [0]
        self._bytes = 0  # sum of the entries' sizes, kept as they change (a scrape must not walk them)
        self._lock = threading.Lock()
        self._seq = 0  # order of commits: a newer entry wins an overlap
        # (session, applied): the mount session notices belong to, and the commit log's sequence
        # number of the last notice applied under it (notices come by two roads, the feed's polls and
        # RelayPutEnd answers, each applied once, in order). One tuple, replaced whole under the lock,
        # so a reader without it (the event loop) always sees a matching pair.
        self._mark: tuple[tuple[int, int], int] = ((0, 0), 0)
        # The last mounted session that ended and its last applied notice: sent with the next mount
        # (MountSegmentRequest.previous_*), which may take several tries, so only a mounted session
        # ending replaces it: the master releases from the segment's fence the names whose notices
        # the index applied (kvtier.master.fences).
        self._previous: tuple[tuple[int, int], int] = ((0, 0), 0)

    def __len__(self) -> int:
        return len(self._entries) + len(self._empty)

    def holding(self, offset: int, name: bytes, size: int) -> bytes | None:
        """The packed entry at `offset` if it is the object `name` ("namespace NUL key", UTF-8) of
        `size` bytes, else None. Without the lock (a direct read on the event loop): one dict lookup;
        a caller that compares the result again later learns whether a notice replaced it."""
        entry = self._entries.get(offset)
        if entry is None or entry[_HEADER:] != name or _SIZE_OF(entry)[0] != size:
            return None
        return entry

    @staticmethod
    def checksum_of(entry: bytes) -> int:
        return _CHECKSUM_OF(entry)[0]

    def totals(self) -> tuple[int, int]:
        """(objects, bytes) of the complete objects this region holds by its own index: what the
        master's accounting of this segment is checked against (no DRAM range leaks)."""
        with self._lock:
            return len(self._entries) + len(self._empty), self._bytes

    @property
    def session(self) -> tuple[int, int]:
        return self._mark[0]

    @property
    def applied(self) -> int:
        """Sequence number of the last commit-log notice applied under the current session."""
        return self._mark[1]

    def session_and_applied(self) -> tuple[tuple[int, int], int]:
        """The session and its last applied notice, read together (an acknowledgement must never
        name one session's sequence number under another's segment id). Without the lock: one
        tuple, replaced whole under it (the event loop must not wait for the feed's batches)."""
        return self._mark

    def set_session(self, session: tuple[int, int]) -> None:
        with self._lock:
            current = self._mark[0]
            if session != current:
                if current[0]:  # a mounted session ends: remember how far its notices got
                    self._previous = self._mark
                self._mark = (session, 0)  # a new mount numbers its notices from 1

    def previous_session(self) -> tuple[tuple[int, int], int]:
        """((segment id, epoch), applied) of the last mounted session that ended (zeros: none)."""
        with self._lock:
            return self._previous

    def clear(self) -> None:
        """The master will not take this index (it expelled us, or serves already): it is stale."""
        with self._lock:
            self._entries.clear()
            self._empty.clear()
            self._deadlines.clear()
            self._groups.clear()
            self._bytes = 0

    def apply(self, reply: pb.PollCommitsResponse, session: tuple[int, int]) -> int:
        """Apply one poll's notices in order, if `session` (polled in) is still the current one,
        skipping those applied already (a RelayPutEnd's answer may have brought them first); the
        sequence number of the last notice applied now (-1: not applied)."""
        with self._lock:
            if session != self._mark[0]:
                return -1
            self._apply_locked(reply)
            return self._mark[1]

    def apply_relayed(self, notices: pb.PollCommitsResponse, session: tuple[int, int]) -> bool:
        """Apply the notices a RelayPutEnd answer brought, if every notice before them is applied
        (False: some are not yet; the feed brings them, these included). Already applied: True.
        Never waits for the lock (the event loop calls it): False while the feed applies a batch."""
        if not self._follows(notices, session):
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._follows(notices, session):  # again: the feed may have moved meanwhile
                return False
            self._apply_locked(notices)
            return True
        finally:
            self._lock.release()

    def _follows(self, notices: pb.PollCommitsResponse, session: tuple[int, int]) -> bool:
        """Whether `notices` belong to the current session and nothing before them is missing."""
        current, applied = self._mark
        return session == current and notices.first_seq <= applied + 1

    def _apply_locked(self, reply: pb.PollCommitsResponse) -> None:
        session, applied = self._mark
        skip = applied + 1 - reply.first_seq  # notices of this reply applied already
        count = len(reply.offsets)
        if skip >= count:
            return
        now = self._clock()
        offsets, sizes, names = list(reply.offsets), list(reply.sizes), list(reply.names)
        checksums, drops = list(reply.checksums), list(reply.drops)
        instances = list(reply.instances) or [""] * count
        ranks = list(reply.ranks) or [0] * count
        pins = list(reply.pins) or [0] * count
        deadlines = [now + ttl / 1000 if ttl else 0.0 for ttl in reply.pin_ttl_ms] or [0.0] * count
        tags = list(zip(reply.group_ids, reply.group_sizes, strict=True)) or [(0, 0)] * count
        if skip > 0:
            columns = (offsets, sizes, names, checksums, drops, instances, ranks, pins, deadlines, tags)
            offsets, sizes, names, checksums, drops, instances, ranks, pins, deadlines, tags = (
                c[skip:] for c in columns
            )
        entries, empty, timed, tagged = self._entries, self._empty, self._deadlines, self._groups
        pack = _HEAD.pack
        party_ids = self._party_ids
        seq, total = self._seq, self._bytes
        for offset, size, name, checksum, drop, instance, rank, pin, deadline, tag in zip(
            offsets, sizes, names, checksums, drops, instances, ranks, pins, deadlines, tags, strict=True
        ):
            table: dict[Any, bytes]
            table, where = (entries, offset) if size else (empty, name)
            old = table.pop(where, None)
            if old is not None:
                total -= _SIZE_OF(old)[0]
            if tagged:
                tagged.pop(where, None)
            if not drop:
                if tag[0]:
                    tagged[where] = tag
                seq += 1
                party = party_ids.get((instance, rank, pin))
                if party is None:
                    party = party_ids[instance, rank, pin] = len(party_ids)
                    self._party_instances.append(instance)
                    self._party_ranks.append(rank)
                    self._party_pins.append(pin)
                table[where] = pack(size, seq, checksum, party) + name.encode()
                total += size
                if deadline:
                    timed[where] = deadline
                    continue
            if timed:
                timed.pop(where, None)
        self._seq, self._bytes = seq, total
        self._mark = (session, reply.first_seq + count - 1)

    def inventory(self) -> list[tuple[int, Entry]]:
        """Entries whose bytes verify, in increasing offset order, without overlaps (the newer of
        two overlapping entries is kept). Entries that fail are removed from the index."""
        return list(self.verify(self.plan()))

    def plan(self) -> Plan:
        """The inventory before its bytes are checked: entries that fit the region, in increasing
        offset order, without overlaps (the newer of two overlapping entries is kept; the others
        leave the index). Cheap: a sort of the offsets and one pass over the sizes in C (`map`);
        the per-entry Python loop runs only when some entry overlaps or passes the region's end.
        `verify` does the per-byte work, chunk by chunk."""
        with self._lock:  # a dict copy under the lock, sorted outside it: apply() waits for the copy only
            ranges = self._entries.copy()
            empty = list(self._empty.values())  # zero-size: nothing to overlap or verify
            deadlines = dict(self._deadlines)
            groups = dict(self._groups)
        offsets = sorted(ranges)
        packed = list(map(ranges.__getitem__, offsets))
        del ranges
        # Each entry must end at or before the next one's offset, and the last at the region's end.
        ends = map(add, offsets, map(_FIRST, map(_SIZE_OF, packed)))
        if any(map(gt, ends, chain(islice(offsets, 1, None), (len(self._region),)))):
            offsets, packed = self._resolve(offsets, packed)
        return Plan([0] * len(empty) + offsets, empty + packed, deadlines, groups)

    def _resolve(self, offsets: list[int], packed: list[bytes]) -> tuple[list[int], list[bytes]]:
        """`plan`'s slow path: drop the entries past the region's end and, of two overlapping, the
        older (lower seq). Ranges were reused while drop notices were lost with a master: rare."""
        kept_offsets: list[int] = []
        kept: list[bytes] = []
        bad: list[tuple[int, bytes]] = []
        limit, last_end = len(self._region), 0
        for offset, entry in zip(offsets, packed, strict=True):
            end = offset + _SIZE_OF(entry)[0]
            if end > limit:
                bad.append((offset, entry))
                continue
            if kept and last_end > offset:
                if _HEAD.unpack_from(kept[-1])[1] > _HEAD.unpack_from(entry)[1]:
                    bad.append((offset, entry))
                    continue
                bad.append((kept_offsets.pop(), kept.pop()))
            kept_offsets.append(offset)
            kept.append(entry)
            last_end = end
        self.forget_planned(bad)
        logger.warning("dropped %d DRAM index entries that overlap a newer one or the region's end", len(bad))
        return kept_offsets, kept

    def verify(self, plan: Plan) -> Verified:
        """The entries of `plan` (or a slice of it) whose bytes still match their checksum; the
        others leave the index. Column-wise, one C-level pass per field: no tuple per entry is
        kept alive (at millions of entries those made the garbage collector the main cost)."""
        offsets, packed = plan.offsets, plan.packed
        count = len(offsets)
        # The headers side by side, read as one array: sizes and seqs every 3rd u64, checksums and
        # parties every 6th u32 (native order, as _HEAD packs them).
        heads = memoryview(b"".join(map(_HEAD_BYTES, packed)))
        sizes, seqs = heads.cast("Q")[0::3].tolist(), heads.cast("Q")[1::3].tolist()
        checksums, parties = heads.cast("I")[4::6].tolist(), heads.cast("I")[5::6].tolist()
        region = self._region
        ranges = map(region.__getitem__, map(slice, offsets, map(add, offsets, sizes)))
        ok = list(map(eq, map(crc32c.crc32c, ranges), checksums))
        names = list(map(bytes.decode, map(_NAME_BYTES, packed)))
        wheres = None
        if plan.deadlines or plan.groups:
            wheres = [offset if size else name for offset, size, name in zip(offsets, sizes, names, strict=True)]
        if plan.deadlines:
            deadlines = list(map(plan.deadlines.get, wheres, repeat(0.0, count)))
        else:
            deadlines = [0.0] * count
        tags = list(map(plan.groups.get, wheres, repeat((0, 0), count))) if plan.groups else None
        with self._lock:  # appended to only: the ids in the plan stay valid
            instances = list(map(self._party_instances.__getitem__, parties))
            ranks = list(map(self._party_ranks.__getitem__, parties))
            pins = list(map(self._party_pins.__getitem__, parties))
        columns = [offsets, packed, names, sizes, checksums, instances, ranks, pins, deadlines, seqs]
        if tags is not None:
            columns.append(tags)
        if not all(ok):
            bad = []
            for i, (size, good) in enumerate(zip(sizes, ok, strict=True)):
                if not size:
                    ok[i] = True  # zero-size: no bytes to check
                elif not good:
                    bad.append((offsets[i], packed[i]))
            if bad:
                self.forget_planned(bad)
                logger.warning("dropped %d DRAM index entries that no longer verify", len(bad))
                columns = [list(compress(column, ok)) for column in columns]
        return Verified(*columns)

    def forget_planned(self, items: list[tuple[int, bytes]]) -> None:
        """Remove planned entries from the index, unless a newer commit replaced them since (the
        index no longer holds that very bytes object)."""
        with self._lock:
            for offset, packed in items:
                size = _SIZE_OF(packed)[0]
                table: dict[Any, bytes]
                table, where = (self._entries, offset) if size else (self._empty, _NAME_BYTES(packed).decode())
                if table.get(where) is packed:
                    self._drop(table, where, size)

    def _drop(self, table: dict[Any, bytes], where: int | str, size: int) -> None:
        del table[where]
        self._deadlines.pop(where, None)
        self._groups.pop(where, None)
        self._bytes -= size

    def pin_ttl_ms(self, entry: Entry) -> int:
        return self.ttl_ms(entry[6])

    def ttl_ms(self, deadline: float) -> int:
        """A soft pin's time left (at least 1 ms while it has a deadline; 0: none)."""
        return max(1, int((deadline - self._clock()) * 1000)) if deadline else 0


def report_dram_inventory(stub: Any, segment_id: int, epoch: int, index: DramIndex, plan: Plan) -> tuple[int, int]:
    """Verify `plan` (the index's `plan()`) and send it to the master, chunk by chunk, each
    verified just before it is sent (the last chunk not yet marked done: the caller sends `done`
    after the SSD inventory). Verifying after the mount, not before, matters at scale: the master's
    recovery gate waits for a segment in the middle of its inventory (each chunk also counts as a
    heartbeat), not for one that has not mounted yet, and checking 5M entries takes tens of seconds.
    Entries that fail the check or that the master refuses leave the index at once. Returns
    (objects reported, objects refused)."""
    refused_total = reported = 0
    for lo in range(0, len(plan), _REPORT_BATCH):
        chunk = index.verify(plan[lo : lo + _REPORT_BATCH])
        count = len(chunk)
        reported += count
        # Whole columns at once: a field append per entry was most of the report's cost.
        request = pb.DramObjectsRequest(
            segment_id=segment_id,
            epoch=epoch,
            namespaces=list(map(_FIRST, map(str.partition, chunk.names, repeat(NAME_SEPARATOR, count)))),
            keys=list(map(_THIRD, map(str.partition, chunk.names, repeat(NAME_SEPARATOR, count)))),
            sizes=chunk.sizes,
            checksums=chunk.checksums,
            offsets=chunk.offsets,
            instances=chunk.instances,
            ranks=chunk.ranks,
            pins=chunk.pins,
            pin_ttl_ms=list(map(index.ttl_ms, chunk.deadlines)) if any(chunk.deadlines) else [0] * count,
        )
        if chunk.groups is not None and any(map(_FIRST, chunk.groups)):
            request.group_ids.extend(map(_FIRST, chunk.groups))
            request.group_sizes.extend(map(_SECOND, chunk.groups))
        reply = stub.ReportDramObjects(request, timeout=_RPC_TIMEOUT_S)
        if reply.status != Status.OK:
            raise InventoryRefused(f"ReportDramObjects: {status_name(reply.status)}: {reply.error}")
        if len(reply.statuses) != count:
            raise InventoryRefused(f"ReportDramObjects: {len(reply.statuses)} statuses for {count} objects")
        refused = [i for i, status in enumerate(reply.statuses) if status != Status.OK]
        if refused:
            index.forget_planned([(chunk.offsets[i], chunk.packed[i]) for i in refused])
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

    @property
    def endpoint(self) -> str:
        """The master's fast-path endpoint this feed polls over now ("" = none, gRPC): the commit
        relay's (kvtier.segment_server.commit_relay) too. Any thread."""
        link = self._link
        return link.endpoint if link is not None else ""

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
        self.applied += len(reply.offsets)
        self._acked = applied  # with what RelayPutEnd answers applied meanwhile, if more
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
