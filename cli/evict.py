"""`kvtier evict`: remove a namespace's objects under a key prefix, one listed page at a time.

Each page is one `ListKeys` and one batched `Remove`, so the master never handles an unbounded batch
and the command can report progress. Operator tooling, built on the client's public calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.client.client import Client
from kvtier.client.keys import MAX_PAGE
from kvtier.proto.status import Status


@dataclass
class EvictReport:
    """What `evict_prefix` did. Object bytes count each object once, whatever its replicas."""

    namespace: str
    prefix: str
    removed: int = 0
    removed_bytes: int = 0
    skipped_pinned: int = 0  # hard pins, soft pins and put-time leases in force, kept (unless include_pinned)
    skipped_pending: int = 0  # puts not finished: not removable yet
    gone: int = 0  # listed, but removed or evicted by someone else before our Remove
    listed: int = 0  # keys seen under the prefix
    pages: int = 0
    dry_run: bool = False


_REMOVE_BATCH = 1000  # keys per Remove: well under any sensible --max-batch-keys


def evict_prefix(
    client: Client,
    prefix: str,
    *,
    page_size: int = MAX_PAGE,
    include_pinned: bool = False,
    dry_run: bool = False,
    progress: Callable[[EvictReport], None] | None = None,
) -> EvictReport:
    """Remove this client's namespace's objects whose key starts with `prefix`, page by page.

    Each page is one `ListKeys` (pending puts included, to count them) and one
    batched `Remove` of the page's removable keys; `progress` is called after
    each. Pinned objects (hard, or soft with time left) are skipped unless
    `include_pinned`: a pin is the writer's promise that the cache keeps them,
    and so is a put-time lease (kvtier.master.upsert): kept, counted as pinned.
    Pending puts are skipped (they may complete afterwards). Objects being
    read are removed like `Client.remove` does: readers holding a lease
    finish, the space is freed when the lease ends. With `dry_run` nothing is
    removed; `removed` counts what would have been. Keys put under the prefix
    while it runs may survive it. Raises KvtierError when the master refuses.
    """
    report = EvictReport(client.namespace, prefix, dry_run=dry_run)
    start_after = ""
    while True:
        page = client.list_keys(prefix, start_after=start_after, limit=page_size, include_pending=True)
        report.pages += 1
        report.listed += len(page.keys)
        doomed = []
        for info in page.keys:
            if info.state == "pending":
                report.skipped_pending += 1
            elif info.pin != "none" and not include_pinned:
                report.skipped_pinned += 1
            else:
                doomed.append(info)
        if dry_run:
            report.removed += len(doomed)
            report.removed_bytes += sum(info.size for info in doomed)
        elif doomed:
            # Removed in sub-batches: a master may allow fewer keys per request than a page holds.
            statuses = []
            for lo in range(0, len(doomed), _REMOVE_BATCH):
                keys = [info.key for info in doomed[lo : lo + _REMOVE_BATCH]]
                statuses += client.batch_remove(keys, force=include_pinned)  # force: put-time leases too
            for info, status in zip(doomed, statuses, strict=True):
                if status == Status.OK:
                    report.removed += 1
                    report.removed_bytes += info.size
                elif status == Status.PUT_IN_PROGRESS:  # removed and put again since the listing
                    report.skipped_pending += 1
                elif status == Status.LEASE_HELD:  # a put-time lease: the writer's promise, as a pin
                    report.skipped_pinned += 1
                else:
                    report.gone += 1
        if progress is not None:
            progress(report)
        if not page.next_start_after:
            return report
        start_after = page.next_start_after
