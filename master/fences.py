"""Per-segment fences: what a returning segment may bring back.

When the master drops a segment's copies en masse (expulsion for silence,
replacement by a new process under the same name, unmount), the segment's
DRAM index and SSD tier keep describing objects the master no longer tracks
there. If the segment returns (the same process after a partition or a
SIGSTOP, or a new process with its SSD directory), most of those copies are
still right, and dropping them throws away cache that nothing touched (a
network blip must not wipe a segment). Some are wrong: their key was removed
or put again with other bytes while the segment was away, or the segment had
not yet acknowledged a notice or a FORGET about them.

A fence, opened when the segment is dropped and kept by segment name (or, empty,
when a new incarnation's recovery ends without a segment it expected: every
change from then on is one the segment has not seen), is the set of object names
whose state may differ from what that segment last acknowledged:
- seeded with the names of its unacknowledged commit-log notices (commits and
  drops, kvtier.master.commits) that name a version which is no longer the
  key's when the segment is dropped (removed, replaced, evicted), and its
  unacknowledged FORGETs (kvtier.master.tiering). A notice about the version
  that is still the key's (its commit, its DRAM copy freed after an offload,
  a promotion, a drain's move) changed nothing: a copy of that version the
  segment brings back is right, and any later change touches the fence;
  fencing those lost the verified disk copies of untouched objects to every
  kill -9 of a busy segment;
- grown by every key committed (PutEnd) or deleted (remove, eviction, a
  failed or reclaimed put) while it is open, and by every key a client asks to
  remove even when the master no longer knows it (it may be one of the
  segment's own, lost with it): Remove names, RemovePrefix prefixes. Losing a
  key because the segment holding it was dropped is not a change of its bytes
  and does not grow it.

Invariants:
1. A copy reported by a returning segment is re-adopted only if its key is
   not in the segment's fence, and then only as the master's recovery rules
   allow (key absent: the object comes back; key complete with the same size
   and checksum: one more replica; anything else: refused). So a key removed
   or re-put while the segment was away is never brought back: either the
   change happened while the fence was open (in it), or before the drop, and
   then the segment had acknowledged it (drop notice / FORGET applied), or it
   had not (the seed).
2. The fence stays open until the segment's inventory is complete
   (`close`); a drop while it is open merges the new seed into it.
3. Bounded: all fences together hold at most `max_keys` names (and
   prefixes); past that the oldest fence turns into "everything" (its names
   are let go) and that segment discards its DRAM index and its SSD copies
   are refused, as without fences (logged with the reason). Each open fence
   costs one name per change; at most `max_fences` fences are kept (past
   that the oldest is forgotten, which is as safe: its name is saved as
   expelled, and an expelled segment without a fence discards its copies).
4. Released by what the segment proves (issue 19, "Commit through the
   segment"): a relayed put is acknowledged to its client once the segment
   applied its notices, before the master hears the segment's acknowledgement,
   so a partition right after a put leaves that put's notices unacknowledged.
   Fencing their names would lose acknowledged, untouched objects. So each
   name seeded from the commit log keeps the segment id it was seeded from and
   the sequence number of its last unacknowledged notice (`seeded`). The
   segment remembers, when a mount session ends, that session's segment id and
   the last notice its index applied under it, and sends them when it mounts
   again (`MountSegmentRequest.previous_segment_id`, `previous_applied_seq`,
   `previous_epoch`). A seeded name with the same segment id and a sequence
   number at or below the applied one leaves the fence (`release`, counted in
   `released`): the segment's index reflects every notice about it, as if it had
   acknowledged them. Names seeded from elsewhere (unacknowledged FORGETs,
   unsettled offloads: about SSD copies, which the index says nothing of), seeded
   again by another drop under another segment id, and every name touched while
   the fence is open are never released. `seeded` is a subset of `names`: it
   adds no name to what `max_keys` bounds, and an overflow clears it too.
5. In memory only. A master restart cannot prove anything about a segment
   that was away: dropped names are saved as *expelled* (kvtier.master.persist),
   and such a segment discards its DRAM index and its SSD copies are refused
   when it returns to a master that has no fence for it.

Plain Python, owned by MasterState's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Fence:
    """Names (kvtier.master.records.object_name) a returning segment must not bring back."""

    segment: str
    names: set[str] = field(default_factory=set)
    prefixes: list[str] = field(default_factory=list)  # RemovePrefix while away: every name starting so
    everything: bool = False  # overflowed: nothing of the segment's previous life is re-adopted
    # Names seeded from the commit log and untouched since: name -> (segment id seeded from, sequence
    # number of its last unacknowledged notice). A subset of `names` (invariant 4).
    seeded: dict[str, tuple[int, int]] = field(default_factory=dict)
    reason: str = ""  # why it is "everything"

    def admits(self, name: str) -> bool:
        """Whether a copy of `name` reported by the segment may be re-adopted."""
        return not self.everything and name not in self.names and not any(map(name.startswith, self.prefixes))


class Fences:
    """Open fences by segment name. See the module docstring."""

    def __init__(self, max_keys: int = 1_000_000, max_fences: int = 1024) -> None:
        self.max_keys = max_keys  # names (and prefixes) held by all fences together
        self.max_fences = max_fences
        self._open: dict[str, Fence] = {}  # insertion order: oldest first
        self._growing: list[Fence] = []  # open fences that still record names (not "everything"), oldest first
        self._total = 0  # names and prefixes held by the growing fences
        self.refused = 0  # copies refused because their key was fenced
        self.readopted = 0  # copies re-adopted under a fence (DRAM and SSD)
        self.overflows = 0  # fences turned into "everything"
        self.released = 0  # seeded names released: the returning segment had applied their notices

    def __len__(self) -> int:
        return len(self._open)

    @property
    def recording(self) -> bool:
        """Whether some open fence records changes (the hot paths skip `touch` otherwise)."""
        return bool(self._growing)

    def get(self, segment: str) -> Fence | None:
        return self._open.get(segment)

    def open(
        self, segment: str, seed: Iterable[str], notices: Mapping[str, int] | None = None, segment_id: int = 0
    ) -> Fence:
        """The segment's copies were dropped: open its fence (or merge the seed into the open one).
        `seed`: names fenced for good; `notices`: names of the commit log's unacknowledged notices of
        mount `segment_id`, each with the sequence number of its last one (released by `release`)."""
        fence = self._open.get(segment)
        if fence is None:
            if len(self._open) >= self.max_fences:
                # Forgetting a fence is as safe as "everything": the name is saved as expelled, and
                # an expelled segment without a fence discards its copies.
                oldest = next(iter(self._open.values()))
                self._overflow(oldest, f"more than {self.max_fences} segments away at once")
                del self._open[oldest.segment]
            fence = self._open[segment] = Fence(segment)
            self._growing.append(fence)
        if not fence.everything:
            before = len(fence.names)
            names, seeded = fence.names, fence.seeded
            for name, seq in (notices or {}).items():
                if name not in names:
                    names.add(name)
                    seeded[name] = (segment_id, seq)
                elif (prior := seeded.get(name)) is not None and prior[0] == segment_id:
                    seeded[name] = (segment_id, max(seq, prior[1]))
                else:  # touched, seeded from elsewhere, or by another mount: fenced for good
                    seeded.pop(name, None)
            for name in seed:
                names.add(name)
                seeded.pop(name, None)
            self._total += len(names) - before
            self._bound()
        logger.info("fence opened segment=%s names=%d everything=%s", segment, len(fence.names), fence.everything)
        return fence

    def release(self, segment: str, segment_id: int, applied_seq: int) -> int:
        """The segment mounts again and says its index applied every notice up to `applied_seq` of
        its mount `segment_id`: the names seeded from that mount's notices at or below it, untouched
        since, leave its fence (invariant 4). How many."""
        fence = self._open.get(segment)
        if fence is None or fence.everything or not segment_id or not fence.seeded:
            return 0
        done = [n for n, (sid, seq) in fence.seeded.items() if sid == segment_id and seq <= applied_seq]
        for name in done:
            del fence.seeded[name]
            fence.names.discard(name)
        if fence in self._growing:
            self._total -= len(done)
        self.released += len(done)
        if done:
            logger.info("fence released segment=%s names=%d applied_seq=%d", segment, len(done), applied_seq)
        return len(done)

    def touch(self, name: str) -> None:
        """The object `name` changed (committed anew or deleted): no open fence re-adopts it."""
        for fence in self._growing:
            if name not in fence.names:
                fence.names.add(name)
                self._total += 1
            elif fence.seeded:
                fence.seeded.pop(name, None)  # changed since: fenced for good
        if self._total > self.max_keys:
            self._bound()

    def touch_prefix(self, start: str) -> None:
        """Every object whose name starts with `start` was removed (RemovePrefix), also those the
        master did not know (lost with a segment that may return)."""
        for fence in self._growing:
            fence.prefixes.append(start)
            self._total += 1
        self._bound()

    def touch_many(self, names: Iterable[str]) -> None:
        if self._growing:
            for name in names:
                self.touch(name)

    def close(self, segment: str) -> None:
        """The segment's inventory is complete: what it reported is settled."""
        fence = self._open.pop(segment, None)
        if fence is not None and fence in self._growing:
            self._growing.remove(fence)
            self._total -= len(fence.names) + len(fence.prefixes)

    def _bound(self) -> None:
        """Over `max_keys` names in all: the oldest fences (which hold the most) give up first."""
        while self._total > self.max_keys and self._growing:
            self._overflow(self._growing[0], f"more than {self.max_keys} keys changed while segments were away")

    def _overflow(self, fence: Fence, reason: str) -> None:
        if fence.everything:
            return
        if fence in self._growing:
            self._growing.remove(fence)
            self._total -= len(fence.names) + len(fence.prefixes)
        fence.everything = True
        fence.reason = reason
        fence.names = set()
        fence.seeded = {}
        fence.prefixes = []
        self.overflows += 1
        logger.warning("fence covers everything segment=%s reason=%s: it discards its copies", fence.segment, reason)
