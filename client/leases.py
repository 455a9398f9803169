"""Read leases whose reads are over, waiting to be handed back to the master (issue 19).

The master keeps a removed or evicted object's range for as long as a read
lease on it runs. A client that asked for a releasable lease
(`KeysRequest.releasable`) hands its id back once every transfer of the batch
is over, in the `released_leases` of its next request to the master: no
extra round trip, and the range is reusable at once (kvtier.master.leases).
"""

from __future__ import annotations

import threading

MAX_WAITING = 4096  # past it the oldest are dropped: they simply run out, as any lease does


class DoneLeases:
    """Thread-safe: reads finish on any thread, requests are built on any other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: list[int] = []

    def add(self, lease_id: int) -> None:
        if lease_id:
            with self._lock:
                if len(self._ids) >= MAX_WAITING:
                    del self._ids[0]
                self._ids.append(lease_id)

    def take(self) -> list[int]:
        """The ids to send with the request being built (each goes once)."""
        if not self._ids:
            return []
        with self._lock:
            ids, self._ids = self._ids, []
        return ids
