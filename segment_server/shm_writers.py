"""Writer slots: which ranges same-host clients are copying into the region right now.

A same-host client copies into the mapped region itself (kvtier.client.transport.shm) and a copy
cannot be taken back: a writer stopped in the middle of one past its grant (SIGSTOP, a frozen
cgroup, a debugger) would finish it on whatever the range holds by then. So the region's header
holds WRITER_BLOCKS blocks of SLOTS_PER_BLOCK slots (kvtier.proto.region); the grant socket hands
each client one block for as long as its grant connection stays open (kvtier.segment_server.shm_grant),
the client marks a slot odd around each copy, and this table reads the blocks handed out and says
which ranges are being written (`sample`), for the heartbeat to report to the master, which keeps
the range of a put that never completed from any other object while a writer is in it.

Assigned and released on the event loop only; `sample` runs on the heartbeat thread and only reads
the header (a block released meanwhile reads as idle: its states were zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.proto.auth import wall_ms
from kvtier.proto.region import SLOTS_PER_BLOCK, WRITER_BLOCKS, WRITER_SLOT, WRITER_STATE, writer_slot

_STABLE_TRIES = 8  # re-reads of a slot caught mid-change before it is taken as read


@dataclass(frozen=True, slots=True)
class WriterSample:
    """What the slots said at `sampled_ms` (this host's wall clock, the one writers judge their
    grants by): the (offset, length) of every copy in progress and the cutoff of the grant each
    started under (`cutoffs`, parallel), and how many had run past it (`stalled`: a writer stopped
    mid-copy)."""

    sampled_ms: int
    ranges: tuple[tuple[int, int], ...]
    cutoffs: tuple[int, ...]
    stalled: int


class WriterTable:
    """The writer blocks of one region's header (`header`: a writable view of its first HEADER_SIZE bytes)."""

    def __init__(self, header: memoryview, blocks: int = WRITER_BLOCKS) -> None:
        self._header = header
        self._free = list(range(blocks - 1, -1, -1))  # pop() hands out the lowest first
        self._assigned: set[int] = set()
        self.last: WriterSample | None = None  # the heartbeat's latest sample (for metrics)
        for block in range(blocks):  # idle from the start, whatever the header held
            self._zero(block)

    @property
    def assigned(self) -> int:
        return len(self._assigned)

    @property
    def capacity(self) -> int:
        return len(self._free) + len(self._assigned)

    def assign(self) -> int | None:
        """A free block for a new client (all its slots idle), or None when every block is held."""
        if not self._free:
            return None
        block = self._free.pop()
        self._assigned.add(block)
        return block

    def release(self, block: int) -> None:
        """The client holding `block` is gone (its grant connection closed): nothing it left is a copy."""
        if block in self._assigned:
            self._assigned.discard(block)
            self._zero(block)
            self._free.append(block)

    def _zero(self, block: int) -> None:
        for index in range(SLOTS_PER_BLOCK):
            WRITER_STATE.pack_into(self._header, writer_slot(block, index), 0)

    def sample(self) -> WriterSample:
        """The copies in progress now. The clock is read before the slots: a copy seen idle here
        started after `sampled_ms`, so it checked its grant after that (and refused an ended one)."""
        now = wall_ms()
        ranges = []
        cutoffs = []
        stalled = 0
        header, unpack = self._header, WRITER_SLOT.unpack_from
        for block in list(self._assigned):
            for index in range(SLOTS_PER_BLOCK):
                position = writer_slot(block, index)
                for _ in range(_STABLE_TRIES):
                    state, offset, length, cutoff_ms = unpack(header, position)
                    if not state & 1 or WRITER_STATE.unpack_from(header, position)[0] == state:
                        break  # idle, or a copy whose fields did not change while read
                if state & 1:
                    ranges.append((offset, length))
                    cutoffs.append(cutoff_ms)
                    stalled += cutoff_ms < now
        return WriterSample(now, tuple(ranges), tuple(cutoffs), stalled)
