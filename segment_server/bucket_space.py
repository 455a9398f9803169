"""The SSD tier's room: which buckets go when the tier fills (`eviction_candidates`), deleting them
(`delete_buckets`), and the reserve that keeps a write that must not fail (a tombstone) possible on a
full file system. A mixin of `BucketStore` (kvtier.segment_server.buckets): its `self` is the store,
whose `__init__` makes the tables these use, under the store's threading rules (its docstring).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from kvtier.segment_server.bucket_format import _MAX_TOMBSTONE_TARGETS, _Bucket

# The store's logger: its messages (reserve given back, buckets deleted) keep the name operators filter on.
logger = logging.getLogger("kvtier.segment_server.buckets")

_P = ParamSpec("_P")
_T = TypeVar("_T")


def close_fds(bucket: _Bucket) -> None:
    for fd in (bucket.read_fd, bucket.write_fd):
        if fd >= 0:
            os.close(fd)


def file_system_room(directory: str) -> tuple[int, int]:
    """(size, bytes an unprivileged writer may still use) of the file system `directory` is on; both
    huge when it cannot be asked (no bound from it)."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 1 << 62, 1 << 62
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


class BucketSpace:
    """Room in the tier: eviction candidates, deletions, the reserve (a mixin of BucketStore)."""

    def eviction_candidates(self) -> list[tuple[int, list[int]]]:
        """Above the high watermark, or once a record was refused for room (DiskFull) since the last
        deletion: the sealed buckets whose deletion gets `used` down to the low watermark, and the
        refused record within the ceiling (or all sealed ones if that is not enough), as (bucket_id,
        live object locations). The watermarks apply to `_ceiling()`: the capacity, or what the file
        system has room for when that is less. Before, a record larger than the room below the high
        watermark (5% of the tier), or a file system smaller than --ssd-size, jammed the tier: every
        offload refused for good, nothing deleted. The buckets go those holding the least live data
        first, in sixteenths of a bucket, the oldest among equals: records are never rewritten, so
        overwrites and removals leave buckets of dead records behind, and deleting those first loses
        nothing, where oldest first lost the live records of old buckets with the tier half empty of
        live data. [] otherwise. Deletes nothing: the caller tells the master first, then calls
        `delete_buckets` (which carries tombstones forward, so any order is safe)."""
        ceiling = self._ceiling()
        open_bucket = self._open.allocated if self._open is not None else 0
        # An ask no deletion could give would have every sealed bucket deleted, again and again
        need = self._wanted if self._wanted <= ceiling - open_bucket else 0
        if ceiling < self._capacity:  # the file system is the limit: keep room for a bucket to grow
            need = max(need, min(self._bucket_size, ceiling // 4))
        if self._used <= self._high * ceiling and self._used + need <= ceiling:
            return []
        target = min(self._low * ceiling, ceiling - need)
        band = max(1, self._bucket_size // 16)
        sealed = [b for b in self._buckets.values() if b.sealed]  # oldest first: the sort is stable
        sealed.sort(key=lambda b: sum(r.size for r in b.live.values()) // band)
        used = self._used
        candidates = []
        for bucket in sealed:
            if used <= target:
                break
            candidates.append((bucket.bucket_id, list(bucket.live)))
            used -= bucket.allocated
        return candidates

    def _want_room(self, needed: int) -> None:
        """A record needing `needed` bytes was refused for room: ask for it (`eviction_candidates`
        ignores an ask that deleting every sealed bucket could not give)."""
        self._wanted = max(self._wanted, needed)

    @property
    def usable(self) -> int:
        """What the tier can hold now (`_ceiling`), for status: --ssd-size alone overstated a tier
        whose file system holds less."""
        return self._ceiling()

    def _ceiling(self) -> int:
        """What the tier can hold now: its capacity, or less when its file system has less room left
        (smaller than --ssd-size, or shared): ENOSPC below the watermarks must free buckets too."""
        return min(self._capacity, self._used + file_system_room(self._dir)[1])

    def delete_buckets(self, bucket_ids: list[int]) -> None:
        """Forget the buckets (plan_read/pin raise KeyError from now on) and unlink their files, at the
        last unpin for pinned ones. Unknown ids are ignored; the open bucket raises ValueError.

        Tombstones a deleted bucket holds for records in surviving buckets are appended again (and
        synced) first, in as few tombstone records as possible, so deleting out of age order never
        resurrects a record. Eviction deletes oldest first, where there is nothing to carry.
        """
        doomed = {i for i in bucket_ids if i in self._buckets}
        if self._open is not None and self._open.bucket_id in doomed:
            raise ValueError(f"bucket {self._open.bucket_id} is the open bucket and cannot be deleted")
        carry = list(
            dict.fromkeys(
                target
                for i in sorted(doomed)
                for target in self._buckets[i].tombstones
                if (target >> 20) in self._buckets and (target >> 20) not in doomed
            )
        )
        if carry:
            try:
                for lo in range(0, len(carry), _MAX_TOMBSTONE_TARGETS):
                    self._append_tombstones(carry[lo : lo + _MAX_TOMBSTONE_TARGETS])
                self.sync()
            except OSError as exc:  # freeing space matters more; the master still knows the truth
                logger.error("tombstones not carried forward count=%d error=%s", len(carry), exc)
        unlinked = 0
        with self._lock:
            for bucket_id in sorted(doomed):
                bucket = self._buckets.pop(bucket_id)
                for location in bucket.live:
                    self._drop_unverified(location)
                for held in (self._withdrawn, self._tombstoned):
                    for location in [at for at in held if at >> 20 == bucket_id]:
                        del held[location]  # gone with its file
                self._dirty.discard(bucket)
                if bucket.pins:
                    bucket.doomed = True
                else:
                    self._destroy(bucket)
                    unlinked += 1
        if doomed:
            self._wanted = 0  # asked again by the next refusal, if the room made was not enough
        if unlinked:
            self._fsync_dir()  # deleted buckets stay deleted after a crash
            self._keep_reserve()
        logger.info("buckets deleted ids=%s deferred=%d used=%d", sorted(doomed), len(doomed) - unlinked, self._used)

    def _destroy(self, bucket: _Bucket) -> None:
        """Close and unlink a bucket no longer in the table. Caller holds the lock."""
        close_fds(bucket)
        self._by_fd.pop(bucket.read_fd, None)
        try:
            os.unlink(bucket.path)
        except FileNotFoundError:
            pass
        self._used -= bucket.allocated
        bucket.live.clear()

    def _must_write(self, write: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`write(*args)`; on ENOSPC, once more after giving back the reserve's space."""
        try:
            return write(*args, **kwargs)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._release_reserve():
                raise
            return write(*args, **kwargs)

    def _release_reserve(self) -> bool:
        """Give the reserve's space back to the file system; whether there was any."""
        try:
            os.unlink(self._reserve_path)
        except FileNotFoundError:
            return False
        logger.warning("file system full: SSD tier reserve given back for a write that must not fail dir=%s", self._dir)
        return True

    def _keep_reserve(self) -> None:
        """(Re)create the reserve if it is missing; on a file system too full for it, try again later."""
        if not self._reserve_bytes or os.path.exists(self._reserve_path):
            return
        tmp = self._reserve_path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self._reserve_bytes)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self._reserve_path)  # complete or absent, never a partial reserve
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            logger.warning("SSD tier reserve not taken dir=%s error=%s", self._dir, exc)
