"""Mounting the SSD tier: `BucketStore.recover` and the reading of bucket files it does (mixed into
kvtier.segment_server.buckets.BucketStore, whose state it fills; the byte layout is in
kvtier.segment_server.bucket_format).

Recovery (mounting) reads record headers, never object payloads, so it takes seconds however large
the tier: a sealed bucket with a valid locator and footer is read through its footer entries (one page
per record, or one pread for a run of small records; all of a bucket's reads queued at once); a record
whose header fails verification there is dropped alone. Otherwise (the open bucket, or a footer that is
invalid) records are scanned linearly. At an invalid record header the scan probes the following
4096-aligned offsets for the next valid header (magic, version, header CRC, payload within the file):
if there is one, the stretch before it is dropped (logged) and the scan goes on from there; if not,
the rest is a torn tail, cut off in an open bucket (a record whose payload would extend past the end of
the file is torn: this is decided from headers alone). A valid record is never truncated. In either
path a record whose cluster tag is not ours is dropped alone, and tombstone payloads are read and
checked (they decide which records are dead). Every object record recovered starts unverified: its
payload CRC is checked later by the background verifier (kvtier.segment_server.verifier; never-sealed
buckets first, then oldest first), which has a record whose payload is corrupt or torn tombstoned then,
not at mount. Until then readers are safe all the same: the client checks every payload against the
master's checksum and a promotion checks it before copying.
"""

from __future__ import annotations

import logging
import os
import time

import crc32c

from kvtier.segment_server.bucket_format import (
    _BUCKET_HEAD,
    _MAX_HEADER_LEN,
    _NAME_RE,
    _RECORD_HEAD,
    _U32,
    _U64,
    ALIGN,
    BUCKET_MAGIC,
    FLAG_OBJECT,
    FLAG_TOMBSTONE,
    FORMAT_VERSION,
    MAX_BUCKET_ID,
    MAX_CLUSTER_ID_BYTES,
    RECORD_MAGIC,
    DiskRecord,
    RecordError,
    _align,
    _Bucket,
    _Entry,
    _Head,
    _location,
    _parse_header,
    _read_index,
)

logger = logging.getLogger("kvtier.segment_server.buckets")  # the store's logger: one name for its logs

_SMALL_RECORD = 64 << 10  # at mount, runs of records this small (file span) are read with one pread...
_RUN_READ = 1 << 20  # ...of up to this many bytes; a larger record costs one page read for its header


class _Pages:
    """A bucket file's bytes as mounting reads them: each read is one pread, unless it falls inside the
    previous one (a run of small records read together, see `_from_footer`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        self._at = 0

    def pread(self, length: int, offset: int, ahead: int = 0) -> bytes:
        """`length` bytes at `offset` (fewer at the end of the file); a miss reads max(length, ahead)."""
        start = offset - self._at
        if 0 <= start and offset + length <= self._at + len(self._buf):
            return self._buf[start : start + length]
        self._buf = os.pread(self.fd, max(length, ahead), offset)
        self._at = offset
        return self._buf[:length]


def _read_head(pages: _Pages, offset: int, limit: int, ahead: int = ALIGN) -> _Head:
    """The verified header of the record at `offset`; RecordError if torn, invalid or ending past `limit`.
    Reads its first page (or `ahead` bytes) and, only for names longer than that, the rest."""
    buf = pages.pread(ALIGN, offset, ahead)
    if len(buf) >= _RECORD_HEAD.size and buf[:4] == RECORD_MAGIC:
        header_len = _U32.unpack_from(buf, 8)[0]
        if len(buf) < header_len <= _MAX_HEADER_LEN:
            buf = pages.pread(header_len, offset)
    head = _parse_header(buf)
    if offset + head.header_len + head.size > limit:
        raise RecordError(f"payload of {head.size} bytes runs past the end of the file")
    return head


def _next_head(pages: _Pages, offset: int, limit: int) -> tuple[int, _Head] | None:
    """The first valid record (offset, header) at a 4096-aligned offset after `offset` whose payload ends
    by `limit`; None if there is none. Reads 4 bytes per page (a header only where the magic matches)."""
    offset += ALIGN
    while offset < limit:
        if os.pread(pages.fd, len(RECORD_MAGIC), offset) == RECORD_MAGIC:
            try:
                return offset, _read_head(pages, offset, limit)
            except RecordError:
                pass
        offset += ALIGN
    return None


def _runs(entries: list[_Entry], ends: list[int]) -> list[int]:
    """Per footer entry, the bytes mounting reads from its offset: a page for a large record, a run of
    small records (up to _RUN_READ) for the first of them, 0 for the others of a run."""
    out = []
    run_end = 0
    for i, (offset, *_) in enumerate(entries):
        if offset < run_end:
            out.append(0)
            continue
        run_end = offset + ALIGN
        if ends[i] - offset <= _SMALL_RECORD:
            j = i
            while j < len(entries) and ends[j] - entries[j][0] <= _SMALL_RECORD and ends[j] - offset <= _RUN_READ:
                run_end = ends[j]
                j += 1
        out.append(run_end - offset)
    return out


class BucketRecovery:
    """BucketStore's recovery (mounting), split out of it: a mixin with no state of its own."""

    # --- recovery ---------------------------------------------------------------------------

    def recover(self) -> list[DiskRecord]:
        """Load every bucket of ours, repair the open one's torn tail, and return the live objects.

        Reads record headers (and tombstone payloads), never object payloads: every object returned
        starts unverified (see `next_unverified`). Files of another cluster or format, or with a bad
        header, are logged and left untouched (not counted in `used`). Records whose header fails or
        whose cluster tag is not ours are dropped (the scan goes on past them, see Recovery in the
        module docstring); tombstoned records are dead.
        Ends with an open bucket for appends (creating one if needed). Call once, before anything else.
        """
        if self._state != "new":
            raise RuntimeError("recover() must be called once, on a new store")
        started = time.monotonic()
        found = sorted(
            (int(m.group(1), 16), entry.name)
            for entry in os.scandir(self._dir)
            if (m := _NAME_RE.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False)
        )
        # Ignored files keep their ids taken too: creating a bucket must never collide with one.
        self._next_id = max((i + 1 for i, _ in found if i < MAX_BUCKET_ID), default=0)
        loaded = [b for bucket_id, name in found if (b := self._load(bucket_id, os.path.join(self._dir, name)))]
        for bucket in loaded:
            self._buckets[bucket.bucket_id] = bucket
            self._by_fd[bucket.read_fd] = bucket
            self._used += bucket.allocated
        for bucket in loaded:
            for target in bucket.tombstones:
                holder = self._buckets.get(target >> 20)
                if holder is not None:
                    holder.live.pop(target, None)
            # Keep only what a later delete of this bucket must carry forward (see delete_buckets).
            bucket.tombstones = [
                t for t in bucket.tombstones if (t >> 20) != bucket.bucket_id and (t >> 20) in self._buckets
            ]
        self._state = "recovered"
        # Verification order: buckets that were never sealed first (only they can hold records torn by
        # a crash: sealing syncs a whole bucket), then the sealed ones, oldest first.
        for bucket in sorted(loaded, key=lambda b: (b.sealed, b.bucket_id)):
            for location, record in bucket.live.items():
                self._unverified[location] = record
                self._unverified_bytes += record.size
        for bucket in loaded[:-1]:
            if not bucket.sealed:  # only the newest bucket may stay open
                self._must_write(self._seal, bucket)
        last = loaded[-1] if loaded else None
        if last is not None and not last.sealed and not self._full(last):
            self._open = last
        else:
            if last is not None and not last.sealed:
                self._must_write(self._seal, last)
            self._open = self._must_write(self._create_bucket)
            self._register(self._open)
        self._keep_reserve()
        records = self.records()
        logger.info(
            "buckets recovered dir=%s buckets=%d records=%d used=%d unverified_bytes=%d seconds=%.2f",
            self._dir,
            len(loaded),
            len(records),
            self._used,
            self._unverified_bytes,
            time.monotonic() - started,
        )
        return records

    def _load(self, bucket_id: int, path: str) -> _Bucket | None:
        """Scan one bucket file; None (logged) when it is not ours to serve."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            file_len = os.fstat(fd).st_size
            problem = self._header_problem(os.pread(fd, ALIGN, 0), bucket_id)
            if problem:
                logger.warning("bucket file ignored path=%s reason=%s", path, problem)
                return None
            bucket = _Bucket(bucket_id, path, read_fd=-1)
            pages = _Pages(fd)
            items, stop, torn = self._scan(bucket, pages, file_len)
            for offset, head, _ in items:
                if head is not None:
                    self._admit(bucket, pages, offset, head)
            bucket.count = len(items)
            bucket.end = stop
            if bucket.sealed:
                bucket.length = file_len
            else:
                # A dropped stretch keeps an entry (header_len 0) so the future footer tiles the file.
                bucket.entries = [
                    (off, h.header_len, h.size, h.flags) if h is not None else (off, 0, end - off, FLAG_OBJECT)
                    for off, h, end in items
                ]
                bucket.write_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                if torn is not None:
                    # The torn tail never reached a completed sync (or is garbage): cut it off.
                    logger.warning("torn bucket tail truncated path=%s offset=%d reason=%s", path, stop, torn)
                    os.ftruncate(bucket.write_fd, stop)
                    os.fdatasync(bucket.write_fd)
                    file_len = stop
                bucket.length = file_len
            bucket.allocated = _align(bucket.length)
            bucket.read_fd = self._open_read_fd(path)
            return bucket
        finally:
            os.close(fd)

    def _header_problem(self, raw: bytes, bucket_id: int) -> str | None:
        if len(raw) < ALIGN:
            return f"file shorter than its {ALIGN}-byte header"
        magic, version, _, header_id, _, cluster_len = _BUCKET_HEAD.unpack_from(raw)
        if magic != BUCKET_MAGIC:
            return f"bad magic {magic!r}"
        if bucket_id >= MAX_BUCKET_ID:
            return "bucket id not below 2**28"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        end = _BUCKET_HEAD.size + cluster_len
        if cluster_len > MAX_CLUSTER_ID_BYTES or crc32c.crc32c(raw[:end]) != _U32.unpack_from(raw, end)[0]:
            return "bad header CRC"
        if raw[_BUCKET_HEAD.size : end] != self._cluster:
            return f"cluster id {raw[_BUCKET_HEAD.size : end].decode(errors='replace')!r}"
        if header_id != bucket_id:
            return f"header names bucket {header_id}"
        return None

    def _scan(
        self, bucket: _Bucket, pages: _Pages, file_len: int
    ) -> tuple[list[tuple[int, _Head | None, int]], int, str | None]:
        """The bucket's records in file order as (offset, verified header, aligned end), where the scan
        stopped, and why it stopped early (a torn tail, open buckets only) or None.

        A header of None marks a dropped stretch from offset to end: a record whose header is invalid
        (or, in a footer, disagrees with its entry), logged. A valid locator marks the bucket sealed;
        its footer, when valid (it then tiles the file exactly), gives the record offsets. Otherwise
        records are scanned linearly, probing past an invalid header for the next valid one.
        """
        footer_off, entries = _read_index(pages.fd, file_len)
        limit = file_len
        if footer_off is not None:
            bucket.sealed = True
            limit = footer_off
            if entries is not None:
                return self._from_footer(bucket, pages, entries, footer_off), footer_off, None
            logger.warning("bucket footer invalid, scanning records path=%s", bucket.path)
        items: list[tuple[int, _Head | None, int]] = []
        offset = ALIGN
        while offset < limit:
            try:
                # One page per header: the kernel's read-ahead serves a sequential scan of small records.
                head = _read_head(pages, offset, limit)
            except RecordError as exc:
                found = _next_head(pages, offset, limit)
                if found is None:
                    if bucket.sealed:
                        logger.warning(
                            "sealed bucket scan stopped path=%s offset=%d reason=%s", bucket.path, offset, exc
                        )
                        return items, limit, None
                    return items, offset, str(exc)
                following, head = found
                logger.warning(
                    "bucket stretch dropped: invalid record header path=%s offset=%d end=%d reason=%s",
                    bucket.path,
                    offset,
                    following,
                    exc,
                )
                items.append((offset, None, following))
                offset = following
            end = _align(offset + head.header_len + head.size)
            items.append((offset, head, end))
            offset = end
        return items, offset, None

    def _from_footer(
        self, bucket: _Bucket, pages: _Pages, entries: list[_Entry], footer_off: int
    ) -> list[tuple[int, _Head | None, int]]:
        """The records a valid footer names; one whose header fails verification is dropped alone.

        Reads one page per record, or, for a run of small records, one pread of up to _RUN_READ bytes
        for the whole run (small payloads come along unread: fewer system calls and disk requests).
        Read-ahead is off: between the headers of large records lie payloads nobody reads here."""
        os.posix_fadvise(pages.fd, 0, 0, os.POSIX_FADV_RANDOM)
        ends = [e[0] for e in entries[1:]] + [footer_off]
        aheads = _runs(entries, ends)
        for (offset, *_), ahead in zip(entries, aheads, strict=True):
            if ahead:  # queue every read now: the disk serves them in parallel, the loop below waits less
                os.posix_fadvise(pages.fd, offset, ahead, os.POSIX_FADV_WILLNEED)
        items: list[tuple[int, _Head | None, int]] = []
        for i, (offset, header_len, size, flags) in enumerate(entries):
            end = ends[i]
            head: _Head | None = None
            try:
                if header_len == 0:
                    raise RecordError("stretch found unreadable before the bucket was sealed")
                head = _read_head(pages, offset, end, ahead=max(ALIGN, aheads[i]))
                if (head.header_len, head.size, head.flags) != (header_len, size, flags):
                    raise RecordError(
                        f"header says header_len={head.header_len} size={head.size} flags={head.flags}, "
                        f"footer says {header_len} {size} {flags}"
                    )
            except RecordError as exc:
                head = None
                logger.warning(
                    "bucket stretch dropped: invalid record header path=%s offset=%d end=%d reason=%s",
                    bucket.path,
                    offset,
                    end,
                    exc,
                )
                if flags == FLAG_TOMBSTONE and header_len:
                    self._tombstone_unreadable(bucket, offset)
            items.append((offset, head, end))
        return items

    def _tombstone_unreadable(self, bucket: _Bucket, offset: int) -> None:
        """A tombstone record failed its checks (the footer says what it was, or its payload CRC): counted
        and logged. Each is written twice (BucketStore._append_tombstones), so one damaged copy loses
        nothing; both lost would bring the objects it named back."""
        self.tombstones_unreadable += 1
        logger.error(
            "tombstone record unreadable path=%s offset=%d: its copy keeps the removal unless damaged too",
            bucket.path,
            offset,
        )

    def _admit(self, bucket: _Bucket, pages: _Pages, offset: int, head: _Head) -> None:
        """Keep a record with a valid header as live (payload unverified) or apply its tombstone (whose
        payload is read and checked here) if its cluster tag is ours; otherwise drop it (logged)."""
        if head.cluster_crc != self._cluster_crc:
            logger.warning(
                "record dropped: cluster tag %#010x is not ours (%#010x) path=%s offset=%d key=%.80s",
                head.cluster_crc,
                self._cluster_crc,
                bucket.path,
                offset,
                head.key,
            )
            return
        location = _location(bucket.bucket_id, offset)
        if head.flags == FLAG_OBJECT:
            # Its payload is verified later, in the background (kvtier.segment_server.verifier); until
            # then every reader checks it against the master's checksum anyway.
            bucket.live[location] = DiskRecord(
                location, head.namespace, head.key, head.size, head.payload_crc, head.group_id, head.group_size
            )
            return
        payload = pages.pread(head.size, offset + head.header_len)
        if len(payload) == head.size and crc32c.crc32c(payload) == head.payload_crc:
            bucket.tombstones += [target for (target,) in _U64.iter_unpack(payload)]
            return
        logger.warning("tombstone dropped: payload CRC mismatch path=%s offset=%d", bucket.path, offset)
        self._tombstone_unreadable(bucket, offset)
