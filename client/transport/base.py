"""What a client-side transport (connector) provides.

A connector moves bytes between caller memory and one segment server's
region. It is created per segment endpoint, shared by threads, and bounds its
own resources (sockets, mappings) by configuration. Every method returns one
status per range (`Status.OK` = 0) and never raises for data-plane failures:
a failed range is a failed key, the rest of the batch goes on.

Reads of a segment's SSD tier are a capability: the segment server reads its
own files and streams the verified records, so only a connector that talks to
the server process (tcp) can carry them; one that maps the region (shm)
cannot. A connector says so in `reads_disk`, and those that do are
`DiskConnector`s; the registry (kvtier.client.transport.connect_disk) picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

Buffer = memoryview  # a flat, byte-formatted view ("B", contiguous)
# The grant of a call's ranges, from the master (kvtier.proto.auth): (expiry_ms, one 16-byte tag per
# range in order (none when the cluster has no secret), the segment's mount session it belongs to
# (SegmentEndpoint.session, kvtier.proto.frames)); None from a master that names no expiry.
# Connectors that go through the segment server (tcp) send it in every frame; those that map the
# region (shm) copy nothing after its expiry, nor while the region names another mount.
Caps = tuple[int, Sequence[bytes], int] | None
# One object of a segment's SSD tier: (disk location, size, b"namespace\0key").
DiskItem = tuple[int, int, bytes]


class Connector(Protocol):
    scheme: ClassVar[str]
    reads_disk: ClassVar[bool]  # a DiskConnector: it can read the segment's SSD tier (read_disk)

    def write(
        self,
        ranges: Sequence[tuple[int, Buffer]],
        checksums: list[int | None] | None = None,
        caps: Caps = None,
        chunks: list[bytes | None] | None = None,
    ) -> list[int]:
        """Copy each buffer into the region at its offset. OK only once the bytes are in place.

        A connector that can checksum while it copies (shm) fills `checksums[i]`
        with the CRC32C of range i's stored bytes; others leave it None. With
        `checksums` and `chunks`, one that does also fills `chunks[i]` with the
        chunk-CRC blob (kvtier.proto.chunks) of a range larger than one chunk,
        in the same pass, consistent with `checksums[i]`.
        """

    def read_into(
        self, ranges: Sequence[tuple[int, Buffer]], checksums: list[int | None] | None = None, caps: Caps = None
    ) -> list[int]:
        """Fill each (writable) buffer from the region at its offset; its length is the range length.

        `checksums` as for `write`: the CRC32C of the bytes delivered, when computed on the way.
        """

    def read(self, ranges: Sequence[tuple[int, int]], caps: Caps = None) -> list[bytes | int]:
        """The bytes of each (offset, length) range, or a negative status."""

    def read_windows(
        self, grant: tuple[int, int], windows: Sequence[tuple[int, Buffer]], caps: Caps = None
    ) -> list[int]:
        """Fill each (skip, buffer) window with the len(buffer) bytes at skip within the granted
        range `grant` = (offset, length) (one object's replica; `caps` its grant): a part of an
        object read under the object's own capability (FLAG_WINDOW in kvtier.proto.frames)."""

    def close(self) -> None: ...


class DiskConnector(Connector, Protocol):
    """A connector with `reads_disk = True`: it also reads objects of the segment's SSD tier."""

    def read_disk(
        self,
        items: Sequence[DiskItem],
        views: Sequence[Buffer] | None = None,
        checksums: list[int | None] | None = None,
        caps: Caps = None,
    ) -> list[bytes | int]:
        """Per item the bytes (or, with `views`, OK after filling views[i]) or a negative status; one
        bad record fails only its item. `checksums` as for `read_into`. The segment reads, checks and
        streams the records (READ_DISK in kvtier.proto.frames); the client never opens a file."""
