"""The shared-memory region file format and host identity: the contract of the `shm` transport.

The segment server writes this header when it creates a region; a same-host
client reads it to prove that the file it mapped is the region the segment
advertised (same nonce) on the same machine and boot (same host id). Both
sides import it from here so they cannot drift apart.

    header  magic "KVTREGN1" | format:u32 | data_offset:u64 | capacity:u64 |
            nonce:16 bytes | cluster id:64, segment name:128, boot id:64 (NUL-padded)
    at SESSION_OFFSET (format 2 on): the segment's current mount session, u64 (0 while unmounted)

The mount session (kvtier.proto.frames.mount_session) is rewritten by the
segment at each mount and cleared when a mount ends; a same-host client
starts a copy only while it is the session its grant names, as the segment
checks a frame's (kvtier.segment_server.mount_session).

The data area the master allocates from starts at `data_offset` (HEADER_SIZE).
"""

from __future__ import annotations

import functools
import struct

MAGIC = b"KVTREGN1"
FORMAT = 2
SESSIONS_FORMAT = 2  # from this format on the header publishes the mount session (older: none)
HEADER_SIZE = 4096  # the data area starts here: page-aligned
HEADER = struct.Struct("<8sIQQ16s64s128s64s")
SESSION_OFFSET = 512  # past HEADER, 8-byte aligned: one aligned store rewrites it
SESSION = struct.Struct("<Q")
assert HEADER.size <= SESSION_OFFSET and SESSION_OFFSET + SESSION.size <= HEADER_SIZE
# The grant socket's request word and version (segment_server/shm_grant.py, client/transport/shm.py).
GRANT_REQUEST = b"KVTSHM1"

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
