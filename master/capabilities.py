"""The master's side of data-plane capabilities: minting tags for the ranges it hands out.

With a cluster secret, every replica range a reply names (GetReplicas, PutStart,
MigrateStart) comes with a 16-byte tag that lets the holder do exactly one
operation on exactly that range of exactly that segment until an expiry: the
read lease's end for reads, the put deadline for writes (kvtier.proto.auth). A
segment server performs nothing without one. Without a secret nothing is minted
and segments check nothing (a loopback-only or explicitly insecure cluster).

Keys are per segment name, master epoch, segment incarnation and mount session,
derived, never sent: a new master incarnation, a restarted segment or a segment
mounted again voids every earlier tag.
Tags live no longer than their ranges stay reserved: read tags until the read
lease ends, write tags `ttl_s` after their PutStart, and the master frees no
range before that plus CLOCK_SKEW_MS (MasterState._reuse_at). The same expiry
is every reply's `tag_expiry_ms` with or without a secret: clients send it as
each frame's deadline (kvtier.proto.frames FLAG_DEADLINE), so a segment bounds
every READ and WRITE by its grant even where no tag is minted. Minting costs
~1 us per range (measured in docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.master.config import MasterConfig
from kvtier.master.records import TIER_SSD
from kvtier.master.state_types import SegmentRecord
from kvtier.proto.auth import CLOCK_SKEW_MS, CapabilityKey, capability_key, wall_ms
from kvtier.proto.frames import Op, mount_session


class Minter:
    def __init__(self, secret: bytes | None) -> None:
        self.enabled = secret is not None
        self._secret = secret
        self._keys: dict[tuple[int, str, int], CapabilityKey] = {}  # (segment id, incarnation, epoch)

    def key(self, segment: SegmentRecord | None, epoch: int) -> CapabilityKey:
        """The key of a mounted segment's current mount (a segment gone since gets a key nothing verifies)."""
        if segment is None:
            name, incarnation, segment_id, session = "", "gone", 0, 0
        else:
            name, incarnation, segment_id = segment.name, segment.incarnation, segment.segment_id
            # an older segment keys its tags as before mount sessions
            session = mount_session(segment_id, epoch) if segment.mount_sessions else 0
        found = self._keys.get((segment_id, incarnation, epoch))
        if found is None:
            if len(self._keys) > 4096:  # segments long gone, or older epochs
                self._keys.clear()
            found = self._keys[(segment_id, incarnation, epoch)] = CapabilityKey(
                capability_key(self._secret, name, epoch, incarnation, session)
            )
        return found

    def replica_tags(
        self,
        segment_of: Callable[[int], SegmentRecord | None],
        epoch: int,
        counts: Sequence[int],
        segments: Sequence[int],
        offsets: Sequence[int],
        sizes: Sequence[int],
        expiry_ms: int,
        tiers: Sequence[int] | None = None,
        op: int = Op.READ,
    ) -> bytes:
        """Tags of the replicas of a reply's flat arrays (replica j of key i has size sizes[i]); reads
        of SSD replicas (tiers[j] = TIER_SSD = proto Tier SSD) get READ_DISK tags, the rest `op`."""
        out = []
        position = 0  # into the flat replica arrays
        for i, count in enumerate(counts):
            size = sizes[i]
            for j in range(position, position + count):
                this_op = Op.READ_DISK if tiers is not None and tiers[j] == TIER_SSD else op
                key = self.key(segment_of(segments[j]), epoch)
                out.append(key.tag(this_op, expiry_ms, offsets[j], size))
            position += count
        return b"".join(out)

    def ttl_s(self, config: MasterConfig) -> float:
        """How long a PutStart's write grant lives (its tags, or without a secret its frames' deadline):
        the read lease's length, at most the put deadline. The master frees no range sooner than that
        plus CLOCK_SKEW_MS (MasterState._reuse_at), with or without capabilities."""
        return min(config.put_timeout_s, config.lease_s)

    @staticmethod
    def expiry_in(seconds: float) -> int:
        """The expiry to mint for a tag whose range stays reserved `seconds` from now: the segment
        accepts a tag until expiry + CLOCK_SKEW_MS, so that is when it must stop verifying."""
        return wall_ms() + int(seconds * 1000) - CLOCK_SKEW_MS
