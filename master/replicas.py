"""Dropping one segment's replicas of keys (issue 21: `remove_replica`, `kvtier replica remove`).

Copies and moves are migrations (kvtier.master.drain, `migrate_keys`): a client copies and
verifies the bytes, the master records. Removal is the master's alone: the replica leaves the
object's record at once (no reader is handed it from then on) and its DRAM range is freed when
the read leases on it end (`MasterState.drop_dram_replica`); a disk copy is tombstoned by its
segment (`Tiering.remove_disk_copy`). The last complete replica is refused with LAST_REPLICA, so
an operator never loses an object by accident; `allow_last` removes the object instead, as
`Remove` would (Mooncake's `batch_replica_clear` does that).

A replica with a tier task of its own in flight on that segment (an offload to its SSD, a promotion
into its DRAM) answers PUT_IN_PROGRESS: finishing, the task would put a copy back there.

Owned by `MasterState`'s thread like everything else; only MasterState's public methods are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.master.events import EventKind
from kvtier.master.records import TIER_DRAM, ObjectState, name_prefix, replica_segment, replica_tier
from kvtier.proto.status import Status

if TYPE_CHECKING:
    from kvtier.master.state import MasterState


def remove_replicas(
    state: MasterState, namespace: str, keys: Sequence[str], segment_name: str, allow_last: bool
) -> tuple[Status, list[int]]:
    """Drop the replicas (DRAM and SSD) segment `segment_name` holds of each key. SEGMENT_NOT_FOUND
    for an unknown segment; per key OK, NOT_FOUND, PUT_IN_PROGRESS, REPLICA_NOT_FOUND, LAST_REPLICA."""
    segment = state.segment_named(segment_name)
    if segment is None:
        return Status.SEGMENT_NOT_FOUND, []
    segment_id = segment.segment_id
    prefix = name_prefix(namespace)
    out = []
    for key in keys:
        record = state.visible(prefix + key)
        if record is None:
            out.append(int(Status.NOT_FOUND))
            continue
        if record.state is not ObjectState.COMPLETE or state.drainer.moving(record):
            # A move's unacknowledged target is no replica to count on: removing the source during the
            # move's wait dropped the last acknowledged copy (LAST_REPLICA could not fire).
            out.append(int(Status.PUT_IN_PROGRESS))
            continue
        mine = [r for r in record.replicas if replica_segment(r) == segment_id]
        if _tier_task_on(state, record.name, segment_id):
            out.append(int(Status.PUT_IN_PROGRESS))  # it would bring a copy back there when done
        elif not mine:
            out.append(int(Status.REPLICA_NOT_FOUND))
        elif len(mine) == len(record.replicas):
            if allow_last and state.upserts.held(record, state.clock()):
                out.append(int(Status.LEASE_HELD))  # as Remove without force: a put-time lease runs
            elif allow_last:
                state.events.gone(record, EventKind.REMOVED, "remove:replica")
                state.discard(record.name)
                out.append(int(Status.OK))
            else:
                out.append(int(Status.LAST_REPLICA))
        else:
            if any(replica_tier(r) == TIER_DRAM for r in mine):
                state.drop_dram_replica(record, segment_id)
            for packed in mine:
                if replica_tier(packed) != TIER_DRAM:
                    state.tiering.remove_disk_copy(record, packed, forget=True)
            if state.history is not None:
                state.history.left(record, "removed:replica", segment_name, replica=True)
            state.events.changed(record, "removed:replica")
            out.append(int(Status.OK))
    return Status.OK, out


def _tier_task_on(state: MasterState, name: str, segment_id: int) -> bool:
    """An offload or promotion of object `name` on `segment_id` is queued or in flight."""
    tiering = state.tiering
    tasks = (tiering.offloading.get(name), tiering.promotion_of(name))
    return any(task is not None and task.segment_id == segment_id for task in tasks)
