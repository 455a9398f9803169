"""Groups, all or none (issue 21): objects put as one group become visible together, and a group read
returns every member or a miss for every member.

Hybrid models keep a request's state in more than one pool (KV blocks plus a side pool of, e.g., Mamba
states): a reader that finds the KV blocks but not the side pool entry computes garbage. So a writer
may put such objects as one group (`PutEndRequest.group`) and read them back as one
(`KeysRequest.group`).

- Visible together. One PutEnd carries every member. `GroupTable.put_end` checks that each member is
  pending under this put or already complete; if any is not (reclaimed, revoked, another writer's),
  it revokes this put's pending members and answers the same failure for every key. Otherwise it
  completes them (MasterState.put_end) and records the group, in the same synchronous call: the
  master's event loop runs no reader in between, so no GetReplicas sees some members and not others.
- All or none when read. The table keeps, for grouped objects only, name -> (group, record): the
  record object the group was formed with. `intact` holds when every key asked is a visible, complete
  record that is *that* record, all of one group, and the keys are exactly its members. A member
  evicted, removed, replaced or lost with its segment is no longer that record, so the group reads as
  a miss for every member from then on, whatever happens to the others (they stay readable one by one).
  Identity, not bookkeeping, is what makes this safe: a missed cleanup could only cost memory.
- Memory: one entry per grouped object (a dict slot and a 2-tuple) and one small `Group` per group,
  dropped when the record leaves the tables (`left`, from MasterState._delete). Ungrouped objects cost
  nothing.
- A master restart (or a standby taking over) rebuilds records from the segments' inventories. Each
  group has a random 63-bit id; a member's commit notice names it and the member count (`tag_of`), the
  segment keeps both in its DRAM index and reports them with the member (kvtier.segment_server.dram_index);
  an OFFLOAD names them too, and the disk record keeps them (kvtier.segment_server.bucket_format, version 2)
  for the disk inventory (kvtier.master.tiering.report_disk_objects).
  The new incarnation forms the group again (`adopted`) once every one of its members was adopted
  under that id, each still the visible complete record adopted: a member missing (evicted, removed,
  upserted, lost, offloaded before it joined the group), or any member not adopted but known otherwise,
  and the group stays unformed, a miss for every member, never a partial group. Members already
  stored when the group was put keep, in the DRAM index, the id of the notice that committed them
  (their first group's, or none): such a group is not rebuilt from DRAM (a miss until put again); an
  offload after it joined writes the later group's id to disk, and the id a member is adopted under
  first decides.
- Eviction takes members one by one, like any object; the first one gone makes the group a miss.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.master.records import ObjectRecord, ObjectState, name_prefix
from kvtier.master.state_types import GetResult
from kvtier.proto.status import Status

if TYPE_CHECKING:  # type only: MasterState builds this table
    from kvtier.master.state import MasterState

_COMPLETE = ObjectState.COMPLETE
_PENDING = ObjectState.PENDING


_ids = random.SystemRandom()  # group ids must not repeat across incarnations: random, not counted


class Group:
    """One group put: its member count and id (what the segments keep, `tag_of`). Shared by its
    members' entries; identity is the object."""

    __slots__ = ("size", "group_id", "__weakref__")

    def __init__(self, size: int, group_id: int = 0) -> None:
        self.size = size
        self.group_id = group_id or _ids.getrandbits(63) | 1  # never 0, which means "no group"


class GroupTable:
    """Which complete objects were put together. See the module docstring.

    Called from the master's event loop only, like MasterState; nothing here awaits.
    """

    def __init__(self, state: MasterState) -> None:
        self._state = state
        self._of: dict[str, tuple[Group, ObjectRecord]] = {}  # object name -> (its group, the member)
        # Groups being formed from reported members (`adopted`): group id -> (member count, name ->
        # the record adopted), and name -> the group id it waits in. Bounded by the adopted members.
        self._forming: dict[int, tuple[int, dict[str, ObjectRecord]]] = {}
        self._forming_of: dict[str, int] = {}
        # Groups alive (some member still holds them), by id: a returning segment's copy of a member
        # joins its group again (`adopted`). Weak: a group goes with its last member's entry.
        self._by_id: weakref.WeakValueDictionary[int, Group] = weakref.WeakValueDictionary()
        self.groups_rebuilt = 0
        self.groups_committed = 0
        self.groups_revoked = 0

    def __len__(self) -> int:
        return len(self._of)

    def put_end(
        self,
        namespace: str,
        keys: Sequence[str],
        checksums: Sequence[int],
        put_id: int,
        committed: list[tuple[int, ObjectRecord, tuple[int, ...]]] | None = None,
    ) -> list[int]:
        """Complete the members of put `put_id` all at once, or none: the same status for every key.

        OK: every key is now complete and the group recorded (a retried group PutEnd finds its own
        members complete and answers OK again). A key already complete from another put joins the
        group as it is (a plain put never changes a complete key: first writer wins, as for every
        put; an upsert swaps in a new record, which the group does not hold).
        INVALID_ARGUMENT: a key given twice, or no keys. NOT_PENDING: some key has no pending put
        under `put_id` and is not complete; this put's pending members are revoked.
        """
        state = self._state
        n = len(keys)
        if n == 0 or len(set(keys)) != n:
            return [int(Status.INVALID_ARGUMENT)] * n
        prefix = name_prefix(namespace)
        ours: list[int] = []  # indices pending under this put
        for i, key in enumerate(keys):
            record = state.visible(prefix + key)
            if record is None:
                break
            if record.state is _PENDING:
                if record.put_id != put_id:
                    break
                ours.append(i)
            elif record.put_id == put_id and record.checksum != checksums[i]:
                break  # a retried PutEnd naming other bytes than its first
        else:
            pending_keys = [keys[i] for i in ours]
            statuses = state.put_end(namespace, pending_keys, [checksums[i] for i in ours], put_id, committed)
            if committed is not None:  # put_end numbered them in `pending_keys`: renumber in `keys`
                committed[:] = [(ours[j], record, replicas) for j, record, replicas in committed]
            if any(s != Status.OK for s in statuses):  # cannot happen after the checks above; be safe
                return [int(Status.NOT_PENDING)] * n
            if self.intact(namespace, keys):  # a retried PutEnd: the group keeps the id its notices named
                return [int(Status.OK)] * n
            group = Group(n)
            self._by_id[group.group_id] = group
            of = self._of
            for key in keys:
                name = prefix + key
                of[name] = (group, state.visible(name))  # type: ignore[assignment]  # complete: checked above
            self.groups_committed += 1
            return [int(Status.OK)] * n
        revoked = state.put_revoke(namespace, keys, put_id)  # what is still pending under this put
        if int(Status.OK) not in revoked and (record is None or record.state is _PENDING):
            # Nothing of this put was pending: it may have committed whole, and this member left
            # since (a PutEnd retried after its answer was lost; kvtier.master.put_outcomes).
            outcome = state.put_outcomes.retried(prefix + keys[i], put_id, checksums[i], None)
            if outcome != Status.NOT_PENDING:
                return [outcome] * n
        self.groups_revoked += 1
        return [int(Status.NOT_PENDING)] * n

    def intact(self, namespace: str, keys: Sequence[str]) -> bool:
        """Whether `keys` are exactly the members of one group, each still the complete object it was put as."""
        if not keys:
            return False
        prefix = name_prefix(namespace)
        of, visible = self._of, self._state.visible
        first = of.get(prefix + keys[0])
        if first is None or first[0].size != len(keys) or len(set(keys)) != len(keys):
            return False
        group = first[0]
        for key in keys:
            name = prefix + key
            entry = of.get(name)
            if entry is None or entry[0] is not group:
                return False
            record = visible(name)
            if record is not entry[1] or record.state is not _COMPLETE:
                return False
        return True

    def get_replicas(self, namespace: str, keys: Sequence[str], releasable: bool = False) -> GetResult:
        """MasterState.get_replicas for a whole group: its placements when `intact`, else NOT_FOUND
        for every key (and no lease). The check and the lookup run in one step of the event loop."""
        state = self._state
        if self.intact(namespace, keys):
            return state.get_replicas(namespace, keys, releasable)
        n = len(keys)
        miss = int(Status.NOT_FOUND)
        return GetResult([miss] * n, [0] * n, [0] * n, [0] * n, [], [], [], int(state.config.lease_s * 1000))

    def tag_of(self, record: ObjectRecord) -> tuple[int, int]:
        """(group id, member count) of the group `record` is a member of as this very record, else (0, 0):
        what its commit notice tells its segment (kvtier.master.handlers_segment.fill_notices)."""
        entry = self._of.get(record.name) if self._of else None
        if entry is None or entry[1] is not record:
            return 0, 0
        return entry[0].group_id, entry[0].size

    def adopted(self, record: ObjectRecord, group_id: int, size: int) -> None:
        """A segment's inventory brought `record` (kvtier.master.recovery) as a member of group
        `group_id` of `size` members: once every member came, each still the visible complete record
        adopted and none a member of another group, the group is formed again, in one step."""
        name = record.name
        if not group_id or size < 1 or name in self._of or self._forming_of.get(name, group_id) != group_id:
            return
        alive = self._by_id.get(group_id)
        if alive is not None:
            # A segment that was away (expelled, its copies dropped) brings back a member of a group
            # whose other members stayed: the fence admitted it, so it is the version committed under
            # this id, and it takes its place in the group again.
            if alive.size == size and record.state is _COMPLETE and self._state.visible(name) is record:
                self._of[name] = (alive, record)
            return
        members = self._forming.setdefault(group_id, (size, {}))[1]
        if self._forming[group_id][0] != size:
            return  # reported with another count: not one group put
        members[name] = record
        self._forming_of[name] = group_id
        if len(members) < size:
            return
        del self._forming[group_id]
        for member in members:
            del self._forming_of[member]
        visible = self._state.visible
        if any(visible(n) is not r or r.state is not _COMPLETE or n in self._of for n, r in members.items()):
            return
        group = Group(size, group_id)
        self._by_id[group_id] = group
        for member, member_record in members.items():
            self._of[member] = (group, member_record)
        self.groups_rebuilt += 1

    def left(self, record: ObjectRecord) -> None:
        """`record` left the tables (MasterState._delete): forget its entry, if it is a member."""
        if self._forming_of and (group_id := self._forming_of.get(record.name)) is not None:
            members = self._forming[group_id][1]
            if members.get(record.name) is record:  # it cannot be formed with this member any more
                for member in members:
                    del self._forming_of[member]
                del self._forming[group_id]
        of = self._of
        if of and (entry := of.get(record.name)) is not None and entry[1] is record:
            del of[record.name]
