"""The SSD tier's bucket store: append-only bucket files of checksummed records (appends, group
commits, reads, eviction, background-verification bookkeeping). The byte layout is in
kvtier.segment_server.bucket_format, mounting (recovery) in kvtier.segment_server.bucket_mount.

Threading: one writer at a time calls everything except `pin`/`unpin`/`plan_read` (the event loop, the
verifier) and `next_unverified`/`verified` (the verifier thread), which may come from other threads;
writers on several threads serialize their calls themselves (the tier worker's store lock: its own
thread, and the master link's during a mount). One lock guards the bucket table, the live-record maps,
the unverified set, pin counts and `used`; the writer mutates them only under it and reads them without
it (it is the only mutator of the rest; `verified` only takes records off the unverified set, under the
lock).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import ParamSpec, TypeVar

import crc32c

from kvtier.proto.keys import cluster_id_problem
from kvtier.segment_server.bucket_format import (
    _BUCKET_HEAD,
    _INDEX_ENTRY,
    _INDEX_HEAD,
    _LOCATOR_BODY,
    _LOCATOR_SIZE,
    _MAX_TOMBSTONE_TARGETS,
    _U32,
    _U64,
    ALIGN,
    BUCKET_MAGIC,
    FLAG_OBJECT,
    FLAG_TOMBSTONE,
    FORMAT_VERSION,
    INDEX_MAGIC,
    LOCATOR_MAGIC,
    MAX_BUCKET_ID,
    MAX_BUCKET_SIZE,
    MAX_NAME_BYTES,
    RESERVE_NAME,
    DiskRecord,
    ReadPlan,
    RecordError,
    Slot,
    _align,
    _Bucket,
    _Head,
    _location,
    _parse_header,
    _record_header,
)
from kvtier.segment_server.bucket_mount import BucketRecovery
from kvtier.segment_server.bucket_space import BucketSpace, close_fds, file_system_room

logger = logging.getLogger(__name__)

_RESERVE_BYTES = 4 << 20


_P = ParamSpec("_P")
_T = TypeVar("_T")


class DiskFull(OSError):
    """The store has no room for a record: its capacity is used up or the file system said ENOSPC."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


def pwrite_all(fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> None:
    """Write every buffer at `offset` on, looping over short writes (ENOSPC when nothing is written)."""
    views = [memoryview(b) for b in buffers if b]
    while views:
        written = os.pwritev(fd, views, offset)
        if written <= 0:  # a regular file only writes nothing when the device is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views:
            views[0] = views[0][written:]


def _disk_error(exc: OSError, what: str) -> OSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{what}: {exc.strerror}")
    return exc


class BucketStore(BucketSpace, BucketRecovery):
    """Bucket files in one directory: appends, group-committed syncs, recovery, reads and eviction.

    Lifecycle: construct (touches no file), `recover()` once, then use, then `close()`. The open
    bucket is never an eviction candidate: with capacity < 2 * bucket_size it can fill the store
    with nothing to evict (appends then raise DiskFull until something is deleted).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        cluster_id: str,
        *,
        bucket_size: int = 256 << 20,
        bucket_keys: int = 65536,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        direct_io: bool = False,
    ) -> None:
        if not 2 * ALIGN <= bucket_size <= MAX_BUCKET_SIZE:
            raise ValueError(
                f"bucket_size must be between {2 * ALIGN} bytes and 4 GiB ({MAX_BUCKET_SIZE}): "
                f"a location keeps only 20 bits of 4096-byte record offset, got {bucket_size}"
            )
        if not 1 <= bucket_keys <= 1 << 20:
            raise ValueError(f"bucket_keys must be between 1 and {1 << 20}, got {bucket_keys}")
        if capacity < 2 * ALIGN:
            raise ValueError(f"capacity must be at least {2 * ALIGN} bytes, got {capacity}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        if problem := cluster_id_problem(cluster_id):
            raise ValueError(problem)
        self._dir = os.fspath(directory)
        self._capacity = capacity
        self._cluster_id = cluster_id
        self._cluster = cluster_id.encode()
        self._cluster_crc = crc32c.crc32c(self._cluster)  # the tag every record of ours carries
        self._bucket_size = bucket_size
        self._bucket_keys = bucket_keys
        self._high = high_watermark
        self._low = low_watermark
        self._direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._direct_writes = self._direct_io  # group writes; off for good after the file system refused
        self._group_fd: tuple[int, int] | None = None  # (bucket id, O_DIRECT write fd) of the open bucket
        self._slots: list[Slot] = []  # reserved in the open bucket, not yet committed
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}  # by id, in id (= age) order: recover sorts, new ids increase
        self._by_fd: dict[int, _Bucket] = {}  # read fd -> bucket, including doomed ones, for unpin
        self._open: _Bucket | None = None
        self._dirty: set[_Bucket] = set()
        self._dir_dirty = False  # a bucket file was created since the last sync
        self._sync_failed: OSError | None = None  # an fdatasync outside sync() failed since the last one
        # Records withdrawn without a tombstone (`withdraw`): not served, not reported, but on disk and
        # recovered at the next mount; a later tombstone of the location is still written.
        self._withdrawn: dict[int, DiskRecord] = {}
        # Records tombstoned since the last successful `sync`: withdrawn again if it fails (the
        # tombstone may be lost with the failed pages), so a retried FORGET writes another.
        self._tombstoned: dict[int, DiskRecord] = {}
        self._next_id = 0
        self._used = 0
        # Room a refused record needed (DiskFull) since the last deletion: a record larger than the
        # room left below the high watermark must make the tier delete buckets all the same.
        self._wanted = 0
        # Live records found at mount whose payload is not verified yet, in verification order (see
        # recover); appended records are verified as they are written and never enter it.
        self._unverified: dict[int, DiskRecord] = {}
        self._unverified_bytes = 0
        # Tombstone records found unreadable at mount (known from a sealed bucket's footer, or by their
        # payload CRC): each is written twice, so one of them loses nothing (bucket_mount).
        self.tombstones_unreadable = 0
        self._reserve_path = os.path.join(self._dir, RESERVE_NAME)
        # At most an eighth of the tier and a quarter of its file system: on an 8 MiB file system the
        # 4 MiB reserve took half, and every offload failed ENOSPC with the tier reporting 0% used. (Given
        # back when the file system is full, it is also the room a restart finds there.)
        self._reserve_bytes = min(_RESERVE_BYTES, capacity // 8, file_system_room(self._dir)[0] // 4) // ALIGN * ALIGN
        self._state = "new"  # new -> recovered -> closed

    # --- appends ----------------------------------------------------------------------------

    def append(self, namespace: str, key: str, payload: memoryview | bytes, checksum: int) -> int:
        """Append one object record and return its location; durable only after the next `sync()`.

        Raises RecordError (nothing written) if the payload's CRC32C is not `checksum`, DiskFull when
        used + the record's size would exceed capacity or the file system is full, ValueError for a
        name longer than 65535 bytes. After any failure the store is consistent and usable.
        """
        ns, kb = namespace.encode(), key.encode()
        if len(ns) > MAX_NAME_BYTES or len(kb) > MAX_NAME_BYTES:
            raise ValueError(f"namespace and key must be at most {MAX_NAME_BYTES} UTF-8 bytes")
        # Copy before checksumming: the source may be shared memory a client can still modify, and the
        # bytes written must be exactly the bytes whose CRC matched the master's checksum.
        data = payload if isinstance(payload, bytes) else bytes(payload)
        crc = crc32c.crc32c(data)
        if crc != checksum:
            raise RecordError(f"payload CRC32C {crc:#010x} != expected {checksum:#010x} key={key:.80}")
        bucket, location = self._write_record(FLAG_OBJECT, ns, kb, data, crc, check_capacity=True)
        with self._lock:
            bucket.live[location] = DiskRecord(location, namespace, key, len(data), crc)
        self._seal_if_full()
        return location

    def tombstone(self, location: int) -> None:
        """Declare one live record dead: `tombstone_many((location,))`."""
        self.tombstone_many((location,))

    def tombstone_named(self, items: Iterable[tuple[int, str, str]]) -> int:
        """FORGETs: `tombstone_many` of each (location, namespace, key) whose live record is that object.
        A location holding another object's record is left alone: the FORGET was for its previous life
        (its bucket deleted, the id taken again after a restart). Returns how many were left so."""
        targets: list[int] = []
        other = 0
        for location, namespace, key in items:
            bucket = self._buckets.get(location >> 20)
            record = bucket.live.get(location) if bucket is not None else None
            record = record or self._withdrawn.get(location)
            if record is None:
                continue
            if record.namespace != namespace or record.key != key:
                other += 1
                continue
            targets.append(location)
        self.tombstone_many(targets)
        return other

    def tombstone_many(self, locations: Iterable[int]) -> None:
        """Declare live records dead with one tombstone record per 8192 of them; durable only after `sync()`.

        Unknown, already dead and repeated locations are ignored; nothing is written if none is left.
        Tombstones are not held to `capacity` (they free space later and must not fail for lack of it);
        a file system ENOSPC raises DiskFull and leaves the records of the failed record live (those of
        records written before it are dead; if the first of its two copies was written, they are dead
        after a restart too: a miss, never a removed object back).
        """
        targets = []
        for location in dict.fromkeys(locations):
            bucket = self._buckets.get(location >> 20)
            if bucket is not None and (location in bucket.live or location in self._withdrawn):
                targets.append(location)
        for lo in range(0, len(targets), _MAX_TOMBSTONE_TARGETS):
            chunk = targets[lo : lo + _MAX_TOMBSTONE_TARGETS]
            self._append_tombstones(chunk)
            with self._lock:
                for location in chunk:
                    bucket = self._buckets.get(location >> 20)
                    record = bucket.live.pop(location, None) if bucket is not None else None
                    record = self._withdrawn.pop(location, None) or record
                    if record is not None:
                        self._tombstoned[location] = record
                    self._drop_unverified(location)

    def withdraw(self, locations: Iterable[int]) -> None:
        """Stop serving and reporting these records, writing nothing (for records whose write failed
        after they were appended, e.g. a failed fdatasync: whatever reached the disk is re-verified by
        the next recovery, and should be tombstoned by the caller where it can)."""
        with self._lock:
            for location in locations:
                bucket = self._buckets.get(location >> 20)
                if bucket is not None and (record := bucket.live.pop(location, None)) is not None:
                    self._withdrawn[location] = record  # a FORGET of it still writes its tombstone
                self._drop_unverified(location)

    def _append_tombstones(self, targets: Sequence[int]) -> None:
        """Write a tombstone record for 1 to _MAX_TOMBSTONE_TARGETS locations, twice (into the reserve's
        space when the file system is full: a removed object must not come back for want of a page).

        Twice, on separate pages: after a master restart the tombstone is the only record of an
        acknowledged removal, and a damaged page of it (a flipped bit fails its header CRC: recovery
        drops the stretch, or cuts it as a torn tail) brought every object it named back. An object
        record that fails its checks is a miss; a tombstone that does is a wrong answer. A page costs
        little: one record names up to 8192 locations."""
        payload = b"".join(_U64.pack(target) for target in targets)
        crc = crc32c.crc32c(payload)
        holders: list[_Bucket] = []
        for _ in range(2):
            holder, _ = self._must_write(
                self._write_record, FLAG_TOMBSTONE, b"", b"", payload, crc, check_capacity=False
            )
            if holder not in holders:  # (the second copy may open a new bucket)
                holders.append(holder)
                holder.tombstones += [target for target in targets if target >> 20 != holder.bucket_id]
        self._seal_if_full()

    def _write_record(
        self, flags: int, ns: bytes, kb: bytes, data: bytes, crc: int, *, check_capacity: bool
    ) -> tuple[_Bucket, int]:
        self._check_state()
        assert self._open is not None
        if self._slots:
            raise RuntimeError("an append while group slots are reserved: commit them first")
        header = _record_header(flags, ns, kb, len(data), crc, self._cluster_crc)
        span = _align(len(header) + len(data))
        bucket = self._open
        roll = bucket.count > 0 and (bucket.end + span > self._bucket_size or self._full(bucket))
        if check_capacity:
            footer = _INDEX_HEAD.size + bucket.count * _INDEX_ENTRY.size + 4 + _LOCATOR_SIZE
            needed = span + (_align(footer) + ALIGN if roll else 0)
            if self._used + needed > self._capacity:
                self._want_room(needed)
                raise DiskFull(f"disk tier full: used={self._used} record={span} capacity={self._capacity}")
        if roll:
            bucket = self._roll()
        offset = bucket.end
        try:
            pwrite_all(bucket.write_fd, [header, data], offset)
        except OSError as exc:
            self._cut_back(bucket)
            raise _disk_error(exc, f"writing bucket {bucket.path}") from exc
        bucket.length = offset + len(header) + len(data)
        bucket.end = _align(bucket.length)
        bucket.count += 1
        bucket.entries.append((offset, len(header), len(data), flags))
        self._dirty.add(bucket)
        with self._lock:
            self._used += bucket.end - bucket.allocated
            bucket.allocated = bucket.end
        return bucket, _location(bucket.bucket_id, offset)

    def _cut_back(self, bucket: _Bucket) -> None:
        """Remove whatever a failed write left past the last complete record."""
        try:
            os.ftruncate(bucket.write_fd, bucket.length)
        except OSError as exc:  # the next write at the same offset overwrites it anyway
            logger.warning("cannot truncate failed write path=%s error=%s", bucket.path, exc)

    def _full(self, bucket: _Bucket) -> bool:
        return bucket.end >= self._bucket_size or bucket.count >= self._bucket_keys

    def _seal_if_full(self) -> None:
        assert self._open is not None
        if self._full(self._open):
            try:
                self._roll()
            except OSError as exc:  # the next append retries before it writes
                logger.warning("bucket seal deferred bucket=%d error=%s", self._open.bucket_id, exc)

    def _roll(self) -> _Bucket:
        """Seal the open bucket and open a new one, all or nothing; the new bucket is returned."""
        old = self._open
        assert old is not None
        try:
            new = self._create_bucket()
        except OSError as exc:
            raise _disk_error(exc, "creating a bucket") from exc
        try:
            self._seal(old)
        except OSError as exc:
            close_fds(new)
            os.unlink(new.path)  # empty and never registered; its id stays consumed
            raise _disk_error(exc, f"sealing bucket {old.path}") from exc
        self._register(new)
        self._open = new
        return new

    def _register(self, bucket: _Bucket) -> None:
        """Make a new bucket current; its header and directory entry become durable at the next sync."""
        self._dirty.add(bucket)
        self._dir_dirty = True
        with self._lock:
            self._buckets[bucket.bucket_id] = bucket
            self._by_fd[bucket.read_fd] = bucket
            self._used += bucket.allocated

    def _create_bucket(self) -> _Bucket:
        bucket_id = self._next_id
        while True:
            if bucket_id >= MAX_BUCKET_ID:
                raise RuntimeError(f"bucket ids exhausted in {self._dir} (ids must stay below 2**28)")
            path = os.path.join(self._dir, f"bucket-{bucket_id:016x}.kvb")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                bucket_id += 1
        self._next_id = bucket_id + 1
        try:
            cluster = self._cluster
            header = bytearray(_BUCKET_HEAD.pack(BUCKET_MAGIC, FORMAT_VERSION, 0, bucket_id, time.time(), len(cluster)))
            header += cluster
            header += _U32.pack(crc32c.crc32c(header))
            pwrite_all(fd, [bytes(header).ljust(ALIGN, b"\0")], 0)
            read_fd = self._open_read_fd(path)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        logger.info("bucket created path=%s", path)
        return _Bucket(bucket_id, path, read_fd=read_fd, write_fd=fd)

    def _seal(self, bucket: _Bucket) -> None:
        """Append the footer and locator, fdatasync, and stop writing the bucket."""
        footer = bytearray(_INDEX_HEAD.pack(INDEX_MAGIC, len(bucket.entries)))
        for entry in bucket.entries:
            footer += _INDEX_ENTRY.pack(*entry)
        footer += _U32.pack(crc32c.crc32c(footer))
        locator = _LOCATOR_BODY.pack(bucket.end, LOCATOR_MAGIC)
        footer += locator + _U32.pack(crc32c.crc32c(locator))
        try:
            pwrite_all(bucket.write_fd, [bytes(footer)], bucket.end)
        except OSError:
            self._cut_back(bucket)
            raise
        try:
            # Also makes every record of the bucket durable: sealing never leaves one behind a sync.
            os.fdatasync(bucket.write_fd)
        except OSError as exc:
            # The kernel reports a failed writeback once: a later fdatasync of this bucket would
            # succeed although records appended since the last sync may be lost. The next sync()
            # raises instead, so none of them is reported durable.
            self._sync_failed = exc
            self._cut_back(bucket)
            raise
        if self._group_fd is not None and self._group_fd[0] == bucket.bucket_id:
            self._close_group_fd()
        os.close(bucket.write_fd)
        bucket.write_fd = -1
        bucket.sealed = True
        bucket.entries = []
        bucket.length = bucket.end + len(footer)
        self._dirty.discard(bucket)
        with self._lock:
            self._used += _align(bucket.length) - bucket.allocated
            bucket.allocated = _align(bucket.length)
        logger.info("bucket sealed path=%s records=%d bytes=%d", bucket.path, bucket.count, bucket.length)

    def sync(self) -> None:
        """fdatasync every bucket with unsynced appends (and the directory after a new bucket).

        After it returns, every record appended before the call survives a crash. An OSError means the
        appends since the last successful sync may be lost: treat them as not durable (a retry that
        succeeds does not prove otherwise, the kernel may have dropped the failed pages). It is also
        raised when an fdatasync of a seal failed since the last sync (even one swallowed by a
        deferred seal), for the same reason.
        """
        failed, self._sync_failed = self._sync_failed, None
        try:
            for bucket in list(self._dirty):
                os.fdatasync(bucket.write_fd)
                self._dirty.discard(bucket)
            if self._dir_dirty:
                self._fsync_dir()
                self._dir_dirty = False
            if failed is not None:
                raise OSError(failed.errno, f"an earlier fdatasync failed: {failed.strerror}")
        except OSError:
            with self._lock:  # their tombstones may be lost: a later tombstone of them is written again
                self._withdrawn.update(self._tombstoned)
                self._tombstoned.clear()
            raise
        self._tombstoned.clear()

    def _fsync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- group appends (kvtier.segment_server.group_writer) -----------------------------------

    def reserve(
        self, namespace: str, key: str, size: int, checksum: int, group: tuple[int, int] = (0, 0)
    ) -> Slot | None:
        """Reserve the next record's room in the open bucket; the caller writes header + payload at
        `slot.offset` (through `group_fd`) and then calls `commit`. Slots are contiguous.

        None when the record needs a new bucket while slots are outstanding: commit them, then ask
        again (a bucket is sealed only after every record in it is written). Raises DiskFull when
        the record (with reserved ones) would exceed capacity, ValueError for a name too long, and
        the errors of rolling over to a new bucket. `group`: the object's group tag (id, member count),
        kept in its header (kvtier.segment_server.bucket_format, version 2) when the id is not 0.
        """
        self._check_state()
        assert self._open is not None
        ns, kb = namespace.encode(), key.encode()
        if len(ns) > MAX_NAME_BYTES or len(kb) > MAX_NAME_BYTES:
            raise ValueError(f"namespace and key must be at most {MAX_NAME_BYTES} UTF-8 bytes")
        header = _record_header(FLAG_OBJECT, ns, kb, size, checksum, self._cluster_crc, group)
        span = _align(len(header) + size)
        bucket = self._open
        start = self._slots[-1].offset + self._slots[-1].span if self._slots else bucket.end
        count = bucket.count + len(self._slots)
        roll = count > 0 and (
            start + span > self._bucket_size or start >= self._bucket_size or count >= self._bucket_keys
        )
        if roll and self._slots:
            return None
        footer = _INDEX_HEAD.size + count * _INDEX_ENTRY.size + 4 + _LOCATOR_SIZE
        reserved = start - bucket.end
        needed = reserved + span + (_align(footer) + ALIGN if roll else 0)
        if self._used + needed > self._capacity:
            self._want_room(needed)
            raise DiskFull(f"disk tier full: used={self._used} record={span} capacity={self._capacity}")
        if roll:
            bucket = self._roll()
            start = bucket.end
        slot = Slot(bucket.bucket_id, start, header, size, span, namespace, key, checksum, *group)
        self._slots.append(slot)
        return slot

    def release_last(self) -> None:
        """Give back the last reserved slot; its bytes must not have been written."""
        self._slots.pop()

    def group_fd(self) -> tuple[int, bool]:
        """(fd, direct) to write reserved slots with: an O_DIRECT fd of the open bucket where the file
        system takes it (buffers, offsets and lengths must then be 4096-aligned), else its buffered fd.
        Valid until the next `reserve` that rolls, `commit` or `close`."""
        assert self._open is not None
        bucket = self._open
        if self._direct_writes:
            if self._group_fd is not None and self._group_fd[0] == bucket.bucket_id:
                return self._group_fd[1], True
            self._close_group_fd()
            try:
                fd = os.open(bucket.path, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_writes_refused()
            else:
                self._group_fd = (bucket.bucket_id, fd)
                return fd, True
        return bucket.write_fd, False

    def buffered_fd(self) -> int:
        """The open bucket's buffered write fd (for a group write the file system refused O_DIRECT)."""
        assert self._open is not None
        return self._open.write_fd

    def direct_writes_refused(self) -> None:
        """The file system refused an O_DIRECT open or write (EINVAL): write buffered from now on."""
        if self._direct_writes:
            self._direct_writes = False
            logger.warning("O_DIRECT writes not supported, writes stay buffered directory=%s", self._dir)

    def _close_group_fd(self) -> None:
        if self._group_fd is not None:
            os.close(self._group_fd[1])
            self._group_fd = None

    def commit(self, written: int, live: Sequence[bool]) -> None:
        """Account the first `written` reserved slots as records on file and release the rest, cutting
        the file back after the last one written. live[i] False: slot i's payload failed its checksum;
        its header is zeroed (mounting reads headers only and must not list it) and it is never served.
        Durable only after the next `sync()`.
        """
        slots, self._slots = self._slots, []
        if not slots:
            return
        bucket = self._buckets[slots[0].bucket_id]
        assert bucket is self._open
        records = []
        for slot, alive in zip(slots[:written], live, strict=True):
            if alive:
                bucket.entries.append((slot.offset, len(slot.header), slot.size, FLAG_OBJECT))
                tag = (slot.group_id, slot.group_size)
                records.append(DiskRecord(slot.location, slot.namespace, slot.key, slot.size, slot.checksum, *tag))
                continue
            # Its header names the object's checksum over bytes that fail it, and mounting reads
            # headers only (payloads are verified later): a failed write must never be listed, so its
            # header is zeroed and the footer marks the slot an unreadable stretch.
            try:
                pwrite_all(bucket.write_fd, [bytes(len(slot.header))], slot.offset)
            except OSError as exc:
                logger.warning("cannot erase a failed record's header path=%s error=%s", bucket.path, exc)
            bucket.entries.append((slot.offset, 0, slot.span, FLAG_OBJECT))
        if written:
            last = slots[written - 1]
            bucket.length = last.offset + len(last.header) + last.size
            bucket.end = _align(bucket.length)
            bucket.count += written
            self._dirty.add(bucket)
        if written < len(slots):
            self._cut_back(bucket)  # a failed or abandoned write may have left bytes past the last record
        with self._lock:
            self._used += bucket.end - bucket.allocated
            bucket.allocated = bucket.end
            bucket.live.update((record.location, record) for record in records)
        self._seal_if_full()

    # --- reads ------------------------------------------------------------------------------

    def _open_read_fd(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if self._direct_io:
            try:
                return os.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_io = False  # once: the file system (e.g. tmpfs) will not change its mind
                logger.warning("O_DIRECT not supported, reads stay buffered directory=%s", self._dir)
        return os.open(path, flags)

    def _plan(self, location: int) -> tuple[_Bucket, ReadPlan]:
        bucket = self._buckets.get(location >> 20)
        record = bucket.live.get(location) if bucket is not None else None
        if bucket is None or record is None:
            raise KeyError(location)
        header_len = record.header_len
        plan = ReadPlan(
            bucket.read_fd, (location & 0xFFFFF) * ALIGN, _align(header_len + record.size), header_len, record.size
        )
        return bucket, plan

    def plan_read(self, location: int) -> ReadPlan:
        """How to read a live record; KeyError if it is unknown, tombstoned or its bucket was deleted.

        The fd may be closed by a later `delete_buckets`: readers on another thread must use `pin`.
        """
        with self._lock:
            return self._plan(location)[1]

    def pin(self, location: int) -> ReadPlan:
        """Like `plan_read`, and the bucket's file and fd stay alive until `unpin(plan)`. Thread-safe."""
        with self._lock:
            bucket, plan = self._plan(location)
            bucket.pins += 1
            return plan

    def unpin(self, plan: ReadPlan) -> None:
        """Release a `pin`; the last unpin of a deleted bucket unlinks it. Thread-safe; a no-op after close."""
        with self._lock:
            if self._state == "closed":
                return
            bucket = self._by_fd.get(plan.fd)
            if bucket is None or bucket.pins == 0:
                raise ValueError(f"unpin of a plan that is not pinned: {plan}")
            bucket.pins -= 1
            if bucket.pins == 0 and bucket.doomed:
                self._destroy(bucket)

    @staticmethod
    def payload_of(
        buf: memoryview, plan: ReadPlan, namespace: str, key: str, cluster_id: str | None = None
    ) -> memoryview:
        """Verify a record read with `plan` and return its payload (a slice of `buf`, no copy).

        Checks magic, version, object flags, header CRC, names, size and, when `cluster_id` is given,
        the record's cluster tag (CRC32C of `cluster_id`); RecordError otherwise. The payload CRC is for
        the reader to check against the master's checksum.
        """
        buf = memoryview(buf).cast("B")
        head = BucketStore.check_header(buf, plan, namespace, key, cluster_id)
        end = head.header_len + head.size
        if len(buf) < end:
            raise RecordError(f"short read: {len(buf)} of {end} bytes")
        return buf[head.header_len : end]

    @staticmethod
    def check_header(
        buf: memoryview | bytes, plan: ReadPlan, namespace: str, key: str, cluster_id: str | None = None
    ) -> _Head:
        """The checks of `payload_of` that need only the record's header (at the start of `buf`)."""
        head = _parse_header(buf)
        if cluster_id is not None and head.cluster_crc != (expected := crc32c.crc32c(cluster_id.encode())):
            raise RecordError(
                f"record of another cluster: tag {head.cluster_crc:#010x}, expected {expected:#010x} for {cluster_id!r}"
            )
        if head.flags != FLAG_OBJECT:
            raise RecordError("record is a tombstone")
        if head.header_len != plan.header_len or head.size != plan.size:
            raise RecordError(f"record has header_len={head.header_len} size={head.size}, plan says {plan}")
        if head.namespace != namespace or head.key != key:
            raise RecordError(f"record is {head.namespace}/{head.key}, expected {namespace}/{key}")
        return head

    # --- background verification ------------------------------------------------------------

    def next_unverified(self) -> DiskRecord | None:
        """The next live record found at mount whose payload is not verified yet (None: all are).
        Thread-safe. It stays next until `verified` is called for it, or it is tombstoned or deleted."""
        with self._lock:
            return next(iter(self._unverified.values()), None)

    def verified(self, location: int) -> None:
        """The verifier is done with the record (found good, or found bad and handed over to be
        tombstoned). Thread-safe; unknown locations are ignored."""
        with self._lock:
            self._drop_unverified(location)

    def _drop_unverified(self, location: int) -> None:
        """Caller holds the lock."""
        record = self._unverified.pop(location, None)
        if record is not None:
            self._unverified_bytes -= record.size

    @property
    def unverified_bytes(self) -> int:
        """Payload bytes of live records whose verification is still to come (the verifier's backlog)."""
        return self._unverified_bytes

    # --- inventory and lifecycle ------------------------------------------------------------

    def records(self) -> list[DiskRecord]:
        """Live object records, oldest first (the inventory reported to the master)."""
        with self._lock:
            return [record for bucket in self._buckets.values() for record in bucket.live.values()]

    @property
    def used(self) -> int:
        """Bytes our bucket files occupy (files have no holes: length rounded up to 4096), including
        deleted buckets still pinned by readers."""
        return self._used

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def cluster_id(self) -> str:
        """The cluster whose buckets and records this store reads and writes."""
        return self._cluster_id

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    @property
    def open_bucket_id(self) -> int:
        """The bucket appends go to; -1 before `recover` and after `close`."""
        return self._open.bucket_id if self._open is not None else -1

    def _check_state(self) -> None:
        if self._state != "recovered":
            raise RuntimeError(f"bucket store is {self._state}: call recover() first, and not after close()")

    def close(self) -> None:
        """Close every fd; seals nothing (a restart continues the open bucket). Unsynced appends are
        left to the page cache. Deleted buckets still pinned are unlinked now. Safe to call twice."""
        self._close_group_fd()
        self._slots = []
        with self._lock:
            for bucket in set(self._buckets.values()) | set(self._by_fd.values()):
                if bucket.doomed:
                    self._destroy(bucket)
                else:
                    close_fds(bucket)
            self._buckets.clear()
            self._by_fd.clear()
            self._withdrawn.clear()
            self._tombstoned.clear()
            self._dirty.clear()
            self._unverified.clear()
            self._unverified_bytes = 0
            self._open = None
            self._state = "closed"
