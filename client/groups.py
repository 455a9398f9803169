"""Groups, all or none (issue 21): objects put as one group become visible together, and a group read
returns every member or a miss for every member.

    statuses = client.put_group(["kv/blk7", "mamba/blk7"], [kv_bytes, state_bytes])
    values = client.get_group(["kv/blk7", "mamba/blk7"])   # [kv, state] or [None, None]

For hybrid models (KV blocks plus a side pool, e.g. Mamba states): a reader that gets the KV blocks
without their side-pool entry computes garbage, so neither must be returned without the other.

- `put_group`: one PutStart, the writes, one PutEnd naming every member (`PutEndRequest.group`).
  The master makes every member visible in that one step or none (kvtier.master.groups). Any
  member's failure (no room, a failed write, ...) revokes the members this call started and is
  every key's status: statuses are all equal. A write that failed on its segment's connection is
  retried once, the whole group, on another placement (as `batch_put` does per key). Members
  already stored (by an earlier put of the key) join the group as they are: a key's bytes never
  change once complete.
- `get_group` / `get_group_into`: the keys must be exactly the group's members, in any order. The
  master answers placements only when every member is still the object the group was put with
  (`KeysRequest.group`); and when any member's bytes cannot be read or verified here, every key
  is a miss. So: every value, or None (a negative Status for `_into`) for every key. A member
  evicted, removed or lost with its segment makes the group a miss until it is put again; after a
  master restart the group reads whole again once every member is back from a segment's DRAM or SSD
  tier (a disk record keeps its member's group id).
- The members stay ordinary objects: `get`, `exists`, `remove` work on each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.client.tracing import traced
from kvtier.proto.keys import check_key
from kvtier.proto.status import Status, to_status

if TYPE_CHECKING:
    from kvtier.client.client import Client

_OK = 0
_NOT_FOUND = int(Status.NOT_FOUND)


def _member_keys(keys: Sequence[str]) -> list[str]:
    checked = [check_key(k) for k in keys]
    if len(set(checked)) != len(checked):
        raise ValueError("a group names each key once")
    return checked


def _not_handed(client: Client, sizes: list[int], sources: list[str | None]) -> None:
    """A group read collapsed to a miss: the members `_fetch` counted as served (size >= 0) were not
    handed to the caller after all, so they move from hits (and served_*) to misses."""
    deltas: dict[str, int] = {"group_misses": 1}
    for size, source in zip(sizes, sources, strict=True):
        if size < 0:
            continue
        deltas["hits"] = deltas.get("hits", 0) - 1
        deltas["misses"] = deltas.get("misses", 0) + 1
        if source is not None:  # None: an empty object, read without a transfer
            tier, path = source.split("/", 1)
            deltas[f"served_{tier}_{path}"] = deltas.get(f"served_{tier}_{path}", 0) - 1
            deltas[f"served_bytes_{tier}_{path}"] = deltas.get(f"served_bytes_{tier}_{path}", 0) - size
    client._count(**deltas)


class GroupCalls:
    """`put_group`, `get_group`, `get_group_into`: mixed into `Client`. See the module docstring."""

    @traced
    def put_group(
        self: Client,
        keys: Sequence[str],
        values: Sequence[Any],
        *,
        replicas: int = 1,
        pin: str | None = None,
        pin_ttl: float = 0.0,
        preferred_segment: str = "",
    ) -> list[Status]:
        """Store `values` under `keys` as one group: the same `Status` for every key. OK: all are
        visible, together; anything else: none of this call's writes is (options as `batch_put`)."""
        from kvtier.client.client import _PINS, _SEGMENT_FAILED, _pin_ttl_ms, as_bytes_view

        keys = _member_keys(keys)
        if pin not in _PINS:
            raise ValueError(f"pin must be one of {sorted(k for k in _PINS if k)} or None, got {pin!r}")
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        if not keys:
            return []
        views = [as_bytes_view(v) for v in values]
        placement = (replicas, _PINS[pin], _pin_ttl_ms(pin_ttl), preferred_segment, False, 0)  # no upsert, no lease
        started = time.monotonic()
        statuses, retry, written = self._put_once(keys, views, *placement, group=True)
        if retry and statuses[0] in _SEGMENT_FAILED and time.monotonic() - started < self.config.timeout / 2:
            statuses, _, again = self._put_once(keys, views, *placement, group=True)
            written += again
            self._count(put_retries=len(keys))
        self._report_failures()
        failed = statuses[0] != _OK
        self._count(puts=len(keys), put_failures=len(keys) if failed else 0, bytes_written=written, group_puts=1)
        return [to_status(s) for s in statuses]

    @traced
    def get_group(self: Client, keys: Sequence[str]) -> list[bytes | None]:
        """Every member's value, or None for every key (see the module docstring)."""
        sources: list[str | None] = [None] * len(keys)
        results = self._fetch(_member_keys(keys), None, sources, group=True)
        if any(isinstance(r, int) for r in results):
            _not_handed(self, [len(r) if isinstance(r, bytes) else -1 for r in results], sources)
            return [None] * len(results)
        return results  # type: ignore[return-value]  # all bytes: checked above

    @traced
    def get_group_into(self: Client, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read every member into its buffer: bytes written per key, or one negative Status for every
        key (the buffers' contents then unspecified)."""
        from kvtier.client.client import as_writable_view

        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_writable_view(b) for b in buffers]
        sources: list[str | None] = [None] * len(keys)
        results = self._fetch(_member_keys(keys), views, sources, group=True)
        miss = next((r for r in results if isinstance(r, int) and r < 0), _OK)
        if miss != _OK:
            _not_handed(self, results, sources)  # type: ignore[arg-type]  # sizes or negative statuses
            return [miss] * len(results)
        return results  # type: ignore[return-value]  # sizes
