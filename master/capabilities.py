"""The master's side of data-plane capabilities: minting tags for the ranges it hands out.

With a cluster secret, every replica range a reply names (GetReplicas, PutStart,
MigrateStart) comes with a 16-byte tag that lets the holder do exactly one
operation on exactly that range of exactly that segment until an expiry: the
read lease's end for reads, the put deadline for writes (kvtier.proto.auth). A
segment server performs nothing without one. Without a secret nothing is minted
and segments check nothing (a loopback-only or explicitly insecure cluster).

Keys are per segment and master epoch, derived, never sent: a new master
incarnation, or a segment remounting under another name, voids every earlier
tag. Minting costs ~1 us per range (measured in docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.master.records import TIER_SSD
from kvtier.proto.auth import CapabilityKey, capability_key, wall_ms
from kvtier.proto.frames import Op


class Minter:
    def __init__(self, secret: bytes | None) -> None:
        self.enabled = secret is not None
        self._secret = secret
        self._keys: dict[tuple[str, int], CapabilityKey] = {}

    def key(self, segment_name: str, epoch: int) -> CapabilityKey:
        found = self._keys.get((segment_name, epoch))
        if found is None:
            if len(self._keys) > 4096:  # names of segments long gone, or older epochs
                self._keys.clear()
            found = self._keys[(segment_name, epoch)] = CapabilityKey(capability_key(self._secret, segment_name, epoch))
        return found

    def replica_tags(
        self,
        name_of: Callable[[int], str],
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
                key = self.key(name_of(segments[j]), epoch)
                out.append(key.tag(this_op, expiry_ms, offsets[j], size))
            position += count
        return b"".join(out)

    @staticmethod
    def expiry_in(seconds: float) -> int:
        return wall_ms() + int(seconds * 1000)
