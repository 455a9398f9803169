"""The shared-memory region file format and host identity: the contract of the `shm` transport.

The segment server writes this header when it creates a region; a same-host
client reads it to prove that the file it mapped is the region the segment
advertised (same nonce) on the same machine and boot (same host id). Both
sides import it from here so they cannot drift apart.

    header  magic "KVTREGN1" | format:u32 | data_offset:u64 | capacity:u64 |
            nonce:16 bytes | cluster id:64, segment name:128, boot id:64 (NUL-padded)
    at SESSION_OFFSET (format 2 on): the segment's current mount session, u64 (0 while unmounted)
    at WRITERS_OFFSET (format 3 on): WRITER_BLOCKS blocks of SLOTS_PER_BLOCK writer slots, each
            state:u64 | offset:u64 | length:u64 | cutoff_ms:u64   (WRITER_SLOT)

The mount session (kvtier.proto.frames.mount_session) is rewritten by the
segment at each mount and cleared when a mount ends; a same-host client
starts a copy only while it is the session its grant names, as the segment
checks a frame's (kvtier.segment_server.mount_session).

Writer slots (format 3): a same-host client copies into the mapping itself, and a copy cannot be
taken back. A writer stopped in the middle of one (SIGSTOP, a frozen cgroup, a debugger) past its
grant would finish it on whatever the range holds by then. So each writer says what it is copying:
the grant socket hands a client that asks one block of slots (held for as long as its grant socket
connection stays open: until it unmaps the region, or its process dies), and around each range it
copies into the region it writes a slot whole (`state` odd, offset, length, the grant's cutoff), and
makes `state` even again after the copy. The segment reads the slots it handed out and reports the
ranges of odd ones to the master with the wall time of the reading (HeartbeatRequest.writer_*);
the master does not reuse the range of a put that never completed until a reading taken after the
grant's cutoff shows no writer in it (kvtier.master.range_book). A slot is odd from before the
writer checks its grant until after its last byte is copied, so a writer stopped anywhere in
between is seen; the transitions need no memory barrier: what matters is a writer stopped for
seconds, whose stores have long been visible.

The data area the master allocates from starts at `data_offset` (HEADER_SIZE).
"""

from __future__ import annotations

import functools
import struct

MAGIC = b"KVTREGN1"
FORMAT = 3
SESSIONS_FORMAT = 2  # from this format on the header publishes the mount session (older: none)
WRITERS_FORMAT = 3  # from this format on the header holds writer slots (older: none)
HEADER_SIZE = 64 << 10  # the data area starts here: page-aligned (4 KiB before format 3)
HEADER = struct.Struct("<8sIQQ16s64s128s64s")
SESSION_OFFSET = 512  # past HEADER, 8-byte aligned: one aligned store rewrites it
SESSION = struct.Struct("<Q")
assert HEADER.size <= SESSION_OFFSET and SESSION_OFFSET + SESSION.size <= 4096
WRITERS_OFFSET = 4096
WRITER_SLOT = struct.Struct("<QQQQ")  # state (odd: copying), offset, length, cutoff_ms
WRITER_STATE = struct.Struct("<Q")  # the slot's first word alone
SLOTS_PER_BLOCK = 8  # copies one client may have in flight into the region at once
WRITER_BLOCKS = (HEADER_SIZE - WRITERS_OFFSET) // (WRITER_SLOT.size * SLOTS_PER_BLOCK)  # 240 clients
# The grant socket's request word and version (segment_server/shm_grant.py, client/transport/shm.py),
# and the word after the nonce by which a client asks for a block of writer slots.
GRANT_REQUEST = b"KVTSHM1"
GRANT_WRITER = b"writer"


def writer_slot(block: int, index: int) -> int:
    """Byte offset in the region of slot `index` of writer block `block`."""
    return WRITERS_OFFSET + (block * SLOTS_PER_BLOCK + index) * WRITER_SLOT.size


_MACHINE_ID = "/etc/machine-id"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def boot_id() -> str:
    return _read(_BOOT_ID)


@functools.cache
def host_id() -> str:
    """This machine's identity for this boot: machine id + boot id, never a hostname. Read once."""
    return f"{_read(_MACHINE_ID)}:{boot_id()}"
