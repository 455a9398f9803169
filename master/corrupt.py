"""Readers' reports of replicas whose bytes fail verification (the `ReportCorrupt` RPC).

A copy that fails its object's checksum can only ever be a miss: a reader that
meets one reports it, and the master drops that replica, or the whole object
when it was the last, so `exists` stops answering True and the next put of
the key writes it anew (a complete object's put is otherwise idempotent and
would never rewrite the bad bytes).

A report names the replica as GetReplicas returned it (segment id and name,
tier, offset) and the checksum the reader verified against. It drops something
only when the object still has that checksum and that replica, on a segment of
that name (segment ids are reassigned when the master restarts): a late or repeated
report, or one about a copy that drained, was evicted or was re-put
elsewhere meanwhile, drops nothing (NOT_FOUND). Freed DRAM ranges wait for
their read leases as for any removal, disk copies are forgotten through the
segment's FORGET task, and DRAM drops reach the segments as commit-log drop
notices (kvtier.master.commits), all through MasterState's own removal paths.

Plain Python on the master's event loop, like MasterState.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.common.logs import LogBudget
from kvtier.master.events import EventKind
from kvtier.master.records import OFFSET_MASK, TIER_DRAM, TIER_SSD, ObjectState, name_prefix, replica
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState

logger = logging.getLogger(__name__)
# A client looping on reports (or a badly damaged region) must not flood the log.
_log = LogBudget(logger, "corrupt replica")

_TIER_NAMES = {TIER_DRAM: "dram", TIER_SSD: "ssd"}


@dataclass(frozen=True, slots=True)
class CorruptReport:
    """One replica a reader found damaged, as GetReplicas named it."""

    key: str
    segment_id: int
    tier: int
    offset: int
    checksum: int  # the object's checksum the reader verified against
    segment_name: str = ""  # the segment's name as the reader saw it ("" = not checked)


@dataclass(slots=True)
class CorruptReplicas:
    """Applies reports to a MasterState and counts what they dropped."""

    state: MasterState
    # Replicas dropped, by tier name: kvtier_master_corrupt_replicas_total{tier}.
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_TIER_NAMES.values(), 0))
    stale: int = 0  # reports that matched no replica any more (kvtier_master_corrupt_reports_stale_total)

    def report(self, namespace: str, reports: Sequence[CorruptReport]) -> list[int]:
        """OK per report that dropped its replica, NOT_FOUND per one that matched nothing."""
        state = self.state
        prefix = name_prefix(namespace)
        out = []
        for r in reports:
            # An offset past OFFSET_MASK would spill into the packed tier and segment bits.
            valid = r.tier in _TIER_NAMES and 0 <= r.offset <= OFFSET_MASK
            record = state.record(namespace, r.key) if valid else None
            packed = replica(r.segment_id, r.offset, r.tier) if valid else -1
            segment = state.segments.get(r.segment_id)
            if (
                segment is None
                or (r.segment_name and segment.name != r.segment_name)  # an id of an earlier master
                or record is None
                or record.state is not ObjectState.COMPLETE
                or record.checksum != r.checksum
                or packed not in record.replicas
            ):
                self.stale += 1
                out.append(int(Status.NOT_FOUND))
                continue
            last = len(record.replicas) == 1
            if r.tier == TIER_DRAM:
                if last:
                    state.events.gone(record, EventKind.EVICTED, "corrupt")
                    state.discard(prefix + r.key)
                else:
                    state.drop_dram_replica(record, r.segment_id)
                    state.events.changed(record, "corrupt")
            else:  # the segment is told to tombstone the disk copy (FORGET)
                state.tiering.remove_disk_copy(record, packed, forget=True, reason="corrupt")
            tier = _TIER_NAMES[r.tier]
            self.dropped[tier] += 1
            _log.log(
                logging.WARNING,
                "corrupt replica dropped namespace=%s key=%.80s segment=%s tier=%s offset=%d object_%s",
                namespace,
                r.key,
                segment.name,
                tier,
                r.offset,
                "removed" if last else "kept",
            )
            out.append(int(Status.OK))
        return out
