"""The segment's current mount, as its data plane judges grants by it.

A master that drops a segment and mounts it again (it was stopped or cut off
past `segment_ttl_s`), or a restarted or newly elected master, hands the
segment's ranges out afresh: its new books know nothing of the grants of the
previous mount, some of which may still have most of their life. So every
grant names its mount (kvtier.proto.frames.mount_session, SegmentEndpoint's
`session`), and the data plane serves a READ or WRITE only under the mount
it names (DataProtocol). The mount ends before the link asks for the next
one: from then on no frame of the old mount writes another byte into the
region (a WRITE in progress is cut at its next receive), and READ responses
still queued are cut with their connections (`on_ended`, on the event loop).
Same-host clients read the session from the region's header
(kvtier.proto.region SESSION_OFFSET) before each copy.

With a cluster secret the session is also part of the capability key
(`CapabilityCheck`), so a tag minted for an earlier mount fails its MAC. A
master from before mount sessions names none (MountSegmentResponse's
`mount_sessions` unset): its clients' frames carry 0, the key is the one of
before sessions, and the segment still cuts its own frames when a mount ends.

Set by the master link's thread, read on the event loop: `current` is one
tuple, replaced whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtier.proto import region as region_format
from kvtier.proto.auth import CapabilityKey, capability_key
from kvtier.proto.frames import mount_session


class MountSession:
    """(session, segment id, master epoch, session in the capability key) of the mount the data plane
    serves; zeros while unmounted."""

    def __init__(self, header: memoryview | None = None) -> None:
        self.current: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._header = header  # the region's header: same-host clients check the session there
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_ended: Callable[[], None] | None = None
        self._publish(0)

    def attach(self, loop: asyncio.AbstractEventLoop, on_ended: Callable[[], None]) -> None:
        """`on_ended` runs on `loop` after each mount ends (it cuts READ responses still queued)."""
        self._loop, self._on_ended = loop, on_ended

    def set(self, segment_id: int, epoch: int, keyed: bool = True) -> None:
        """The link's mount changed: (0, 0) when it ended, else the new mount's id and epoch; `keyed`:
        its master names sessions (and keys capabilities with them)."""
        session = mount_session(segment_id, epoch)
        previous = self.current[0]
        if session == previous:
            return
        self.current = (session, segment_id, epoch, session if keyed else 0) if session else (0, 0, 0, 0)
        self._publish(session)
        if previous and self._loop is not None and self._on_ended is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_ended)
            except RuntimeError:  # the loop closed: the process is stopping, no frame is served
                pass

    def _publish(self, session: int) -> None:
        if self._header is not None:
            region_format.SESSION.pack_into(self._header, region_format.SESSION_OFFSET, session)


class CapabilityCheck:
    """This segment's capability key: from the cluster secret, its name, its incarnation and its
    current mount (the master's epoch and session, kvtier.proto.auth); None while it is not mounted."""

    def __init__(self, secret: bytes, name: str, mount: MountSession, incarnation: str = "") -> None:
        self._secret = secret
        self._name = name
        self._mount = mount
        self._incarnation = incarnation  # the region's nonce, as the mount request names it
        self._key: CapabilityKey | None = None
        self._key_session = 0

    def key(self) -> CapabilityKey | None:
        session, _segment_id, epoch, keyed = self._mount.current
        if not session:
            return None
        if session != self._key_session:
            self._key = CapabilityKey(capability_key(self._secret, self._name, epoch, self._incarnation, keyed))
            self._key_session = session
        return self._key
