"""The SSD tier's on-disk bucket format: constants, record and bucket headers, footers, locators,
and the helpers that encode, parse and verify them (the store is kvtier.segment_server.buckets).

On-disk format (all integers little-endian, ALIGN = 4096):

- A bucket is a file ``bucket-<id as 16 hex digits>.kvb`` in the store's directory. Bucket ids are
  assigned increasing (max existing id + 1 on start), never reused.
- File header, the first 4096 bytes: magic ``b"KVTB"``, format version u16 (=1), reserved u16,
  bucket id u64, created unix time f64, cluster id length u16 + cluster id bytes (UTF-8, <= 64 bytes),
  then CRC32C u32 of all preceding header bytes; zero padding to 4096.
- Records start at 4096-aligned offsets. Record header: magic ``b"KVTR"``, version u16 (=1),
  flags u16 (0 = object, 1 = tombstone), header_len u32 (bytes of the header including the names
  below, excluding padding: 36 + namespace_len + key_len), namespace_len u16, key_len u16, size u64
  (payload bytes), payload_crc u32 (CRC32C of the payload), cluster_crc u32 (CRC32C of the UTF-8
  cluster id), header_crc u32 (CRC32C of the header bytes with this field set to zero), then namespace
  bytes and key bytes (UTF-8). Field offsets: magic 0, version 4, flags 6, header_len 8, namespace_len
  12, key_len 14, size 16, payload_crc 24, cluster_crc 28, header_crc 32, names 36.
  Version 2 (an object put as a member of a group, kvtier.master.groups) is version 1 with a group
  tag after the key: group id u64 (never 0) and member count u32, so header_len is 48 +
  namespace_len + key_len; a master rebuilding from the disk inventory forms the group again.
  Ungrouped objects and tombstones are written as version 1, which older readers keep reading (they
  refuse a version 2 record, which then reads as a miss). The payload
  follows the header immediately (at record offset + header_len). The next record starts at the next
  4096-aligned offset after the payload. The bucket header holds the full cluster id; each record
  holds a CRC32C tag of it, so a record can be recognised as this cluster's on its own (recovery drops
  a record whose tag is not ours, like one whose payload CRC fails).
- A tombstone record (empty namespace and key) has a payload of N >= 1 u64 locations (size a positive
  multiple of 8), each naming a record it declares dead (written when the master removes objects that
  had a disk copy, so a restart does not resurrect them). One record carries many locations, so a mass
  removal costs 64 KiB per 8192 locations (writers cap a record at 64 KiB of locations; readers accept
  any count). Writers write each tombstone record twice, the copy right after it (or at the start of
  the next bucket): a damaged page of it must not bring removed objects back; readers apply both (the
  second changes nothing). A tombstone whose size is not a positive multiple of 8 is an invalid record.
- Sealing: when a bucket reaches ``bucket_size`` bytes or ``bucket_keys`` records (whichever first),
  it is sealed: an index footer is appended at a 4096-aligned offset: magic ``b"KVTI"``, count u32,
  then per record (offset u64, header_len u32, size u64, flags u16), then CRC32C u32 over the footer;
  then the last 16 bytes of the file are a locator: footer offset u64 + magic ``b"KVTE"`` + CRC32C u32
  of those 12 bytes. The file is fdatasync'ed after sealing and a new bucket is opened for appends.
  An entry with header_len 0 marks a stretch recovery found unreadable (see Recovery); it keeps the
  entries tiling the file and names no record.
- Reserve: a file ``reserve.kvr`` of up to 4 MiB (1/8 of the capacity at most), preallocated, whose
  space is given back at the first ENOSPC of a tombstone or of a recovery write (see RESERVE_NAME).
- Location: an int < 2**48 naming a record: ``bucket_id << 20 | (record_offset // 4096)``. Hence
  bucket_size <= 4 GiB (2**20 * 4096) and bucket ids < 2**28.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

import crc32c

ALIGN = 4096
FORMAT_VERSION = 1
GROUPED_VERSION = 2  # a record with a group tag after its names (see the module docstring)
FLAG_OBJECT = 0
FLAG_TOMBSTONE = 1
BUCKET_MAGIC = b"KVTB"
RECORD_MAGIC = b"KVTR"
INDEX_MAGIC = b"KVTI"
LOCATOR_MAGIC = b"KVTE"
MAX_BUCKET_SIZE = (1 << 20) * ALIGN  # the location keeps 20 bits of aligned offset
MAX_BUCKET_ID = 1 << 28  # bucket_id << 20 stays below 2**48
MAX_CLUSTER_ID_BYTES = 64
MAX_NAME_BYTES = 0xFFFF  # u16 field width of namespace_len and key_len; the key rules (kvtier.proto.keys) are stricter

_BUCKET_HEAD = struct.Struct("<4sHHQdH")  # magic, version, reserved, bucket id, created, cluster id length
# magic, version, flags, header_len, ns_len, key_len, size, payload_crc, cluster_crc, header_crc
_RECORD_HEAD = struct.Struct("<4sHHIHHQIII")
_HEADER_CRC_AT = 32  # offset of header_crc inside the record header (the last fixed field)
_INDEX_HEAD = struct.Struct("<4sI")
_INDEX_ENTRY = struct.Struct("<QIQH")
_LOCATOR_BODY = struct.Struct("<Q4s")
_LOCATOR_SIZE = _LOCATOR_BODY.size + 4
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TOMBSTONE_TARGET = _U64.size  # bytes per location in a tombstone payload
_MAX_TOMBSTONE_TARGETS = 8192  # locations per tombstone record written (64 KiB of payload)
_GROUP_TAG = struct.Struct("<QI")  # group id, member count: after the names of a GROUPED_VERSION record
_MAX_HEADER_LEN = _RECORD_HEAD.size + 2 * MAX_NAME_BYTES + _GROUP_TAG.size
_NAME_RE = re.compile(r"bucket-([0-9a-f]{16})\.kvb")
# Space set aside on the file system for the writes that must not fail when it is full: tombstones
# (a FORGET, a stale copy refused at mount), a new open bucket and a footer at recovery. Given back
# at the first ENOSPC of such a write, taken again once buckets are deleted. Not counted in `used`.
RESERVE_NAME = "reserve.kvr"

_Entry = tuple[int, int, int, int]  # footer entry: offset, header_len, size, flags


@dataclass(slots=True, frozen=True)
class DiskRecord:
    """One live object on disk."""

    location: int
    namespace: str
    key: str
    size: int  # payload bytes
    checksum: int  # CRC32C of the payload (== the object's checksum in the master)
    group_id: int = 0  # the group it was put with (0: none) and its member count, from its header
    group_size: int = 0

    @property
    def header_len(self) -> int:
        return record_header_len(len(self.namespace.encode()), len(self.key.encode()), self.group_id)


@dataclass(slots=True, frozen=True)
class ReadPlan:
    """How a caller reads one record with one aligned read (offset and length are 4096-aligned)."""

    fd: int  # open fd of the bucket file (valid while the caller holds a pin, see BucketStore.pin)
    file_offset: int  # 4096-aligned record start
    read_length: int  # header_len + size rounded up to 4096; may extend past EOF (reads may return short)
    header_len: int
    size: int


@dataclass(slots=True, frozen=True)
class Slot:
    """Room reserved at the end of the open bucket for one object record (see `BucketStore.reserve`)."""

    bucket_id: int
    offset: int  # 4096-aligned record start in the bucket file
    header: bytes  # the record header, payload_crc = the object's checksum
    size: int  # payload bytes
    span: int  # header + payload rounded up to 4096: the next slot starts at offset + span
    namespace: str
    key: str
    checksum: int
    group_id: int = 0
    group_size: int = 0

    @property
    def location(self) -> int:
        return _location(self.bucket_id, self.offset)


class RecordError(Exception):
    """A record that cannot be verified; the message says why."""


@dataclass(slots=True, frozen=True)
class _Head:
    """A parsed and CRC-verified record header."""

    flags: int
    header_len: int
    size: int
    payload_crc: int
    cluster_crc: int  # CRC32C of the writer's cluster id: checked by the caller, not by _parse_header
    namespace: str
    key: str
    group_id: int = 0  # GROUPED_VERSION: its group tag; 0 otherwise
    group_size: int = 0


@dataclass(slots=True, eq=False)
class _Bucket:
    """What the bucket store knows of one bucket file (built by the store and by mounting)."""

    bucket_id: int
    path: str
    read_fd: int  # handed out in ReadPlans; O_DIRECT when enabled and supported
    write_fd: int = -1  # -1 once sealed: a sealed bucket is never written again
    end: int = ALIGN  # next record offset (sealed: the footer offset)
    length: int = ALIGN  # file length, to cut a failed write back off
    allocated: int = ALIGN  # bytes counted in `used`
    count: int = 0  # records (objects and tombstones) in the file
    sealed: bool = False
    entries: list[_Entry] = field(default_factory=list)  # the future footer; emptied once sealed
    live: dict[int, DiskRecord] = field(default_factory=dict)  # location -> live object record
    tombstones: list[int] = field(default_factory=list)  # tombstoned locations in *other* buckets
    pins: int = 0
    doomed: bool = False  # deleted while pinned: unlinked at the last unpin


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _location(bucket_id: int, offset: int) -> int:
    return bucket_id << 20 | offset // ALIGN


def _header_crc(header: bytes | memoryview) -> int:
    """CRC32C of a record header with its header_crc field read as zero."""
    value = crc32c.crc32c(header[:_HEADER_CRC_AT])
    value = crc32c.crc32c(bytes(4), value=value)
    return crc32c.crc32c(header[_HEADER_CRC_AT + 4 :], value=value)


def record_header_len(namespace_len: int, key_len: int, group_id: int = 0) -> int:
    """Bytes of an object record's header: its fixed part, its names and, when grouped, its group tag."""
    return _RECORD_HEAD.size + namespace_len + key_len + (_GROUP_TAG.size if group_id else 0)


def _record_header(
    flags: int,
    namespace: bytes,
    key: bytes,
    size: int,
    payload_crc: int,
    cluster_crc: int,
    group: tuple[int, int] = (0, 0),
) -> bytes:
    """A record header; `group` (id, member count) with a non-zero id makes it a GROUPED_VERSION one."""
    n, k = len(namespace), len(key)
    group_id, group_size = group
    header_len = record_header_len(n, k, group_id)
    version = GROUPED_VERSION if group_id else FORMAT_VERSION
    header = bytearray(
        _RECORD_HEAD.pack(RECORD_MAGIC, version, flags, header_len, n, k, size, payload_crc, cluster_crc, 0)
    )
    header += namespace + key
    if group_id:
        header += _GROUP_TAG.pack(group_id, group_size)
    _U32.pack_into(header, _HEADER_CRC_AT, crc32c.crc32c(header))
    return bytes(header)


def _parse_header(buf: bytes | memoryview) -> _Head:
    """Parse and verify the record header at the start of `buf`; RecordError says what is wrong."""
    if len(buf) < _RECORD_HEAD.size:
        raise RecordError(f"record header truncated: {len(buf)} bytes")
    magic, version, flags, header_len, ns_len, key_len, size, payload_crc, cluster_crc, header_crc = (
        _RECORD_HEAD.unpack_from(buf)
    )
    if magic != RECORD_MAGIC:
        raise RecordError(f"bad record magic {bytes(magic)!r}")
    if version not in (FORMAT_VERSION, GROUPED_VERSION):
        raise RecordError(f"unknown record version {version}")
    if flags not in (FLAG_OBJECT, FLAG_TOMBSTONE) or (version == GROUPED_VERSION and flags != FLAG_OBJECT):
        raise RecordError(f"unknown record flags {flags} (version {version})")
    tag = _GROUP_TAG.size if version == GROUPED_VERSION else 0
    if header_len != _RECORD_HEAD.size + ns_len + key_len + tag:
        raise RecordError(f"header_len {header_len} does not match name lengths {ns_len}+{key_len} (version {version})")
    if len(buf) < header_len:
        raise RecordError(f"record header truncated: {len(buf)} of {header_len} bytes")
    if _header_crc(buf[:header_len]) != header_crc:
        raise RecordError("record header CRC mismatch")
    if flags == FLAG_TOMBSTONE and (size == 0 or size % _TOMBSTONE_TARGET):
        raise RecordError(f"tombstone payload of {size} bytes")
    names = _RECORD_HEAD.size
    try:
        namespace = bytes(buf[names : names + ns_len]).decode()
        key = bytes(buf[names + ns_len : names + ns_len + key_len]).decode()
    except UnicodeDecodeError as exc:
        raise RecordError(f"record name is not UTF-8: {exc}") from None
    group_id = group_size = 0
    if tag:
        group_id, group_size = _GROUP_TAG.unpack_from(buf, header_len - tag)
        if not group_id or not group_size:
            raise RecordError(f"group tag {group_id:#x}/{group_size} names no group")
    return _Head(flags, header_len, size, payload_crc, cluster_crc, namespace, key, group_id, group_size)


def _read_index(fd: int, file_len: int) -> tuple[int | None, list[_Entry] | None]:
    """(footer offset, entries) of a sealed bucket; (None, None) without a valid locator, and entries
    None when the footer is invalid or does not tile the file exactly (so it can never point into the
    middle of a payload)."""
    if file_len < ALIGN + _INDEX_HEAD.size + 4 + _LOCATOR_SIZE:
        return None, None
    raw = os.pread(fd, _LOCATOR_SIZE, file_len - _LOCATOR_SIZE)
    footer_off, magic = _LOCATOR_BODY.unpack_from(raw)
    if magic != LOCATOR_MAGIC or crc32c.crc32c(raw[:12]) != _U32.unpack_from(raw, 12)[0]:
        return None, None
    if footer_off % ALIGN or not ALIGN <= footer_off <= file_len - _LOCATOR_SIZE - _INDEX_HEAD.size - 4:
        return None, None
    raw = os.pread(fd, file_len - _LOCATOR_SIZE - footer_off, footer_off)
    magic, count = _INDEX_HEAD.unpack_from(raw)
    if magic != INDEX_MAGIC or len(raw) != _INDEX_HEAD.size + count * _INDEX_ENTRY.size + 4:
        return footer_off, None
    if crc32c.crc32c(raw[:-4]) != _U32.unpack_from(raw, len(raw) - 4)[0]:
        return footer_off, None
    entries = [_INDEX_ENTRY.unpack_from(raw, _INDEX_HEAD.size + i * _INDEX_ENTRY.size) for i in range(count)]
    expected = ALIGN
    for offset, header_len, size, _ in entries:
        if offset != expected:
            return footer_off, None
        expected = _align(offset + header_len + size)
    return footer_off, entries if expected == footer_off else None
