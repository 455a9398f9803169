"""Commit through the segment, the client's side: a put whose bytes all go to one segment over tcp
sends its PutEnd right behind its WRITE, in a COMMIT frame on the same connection, and the
segment relays it to the master (kvtier.segment_server.commit_relay, docs/architecture.md).

One round trip less per put: the client no longer waits for its WRITE's answer before asking
the master, and the master no longer waits for the segment's acknowledgement of the commit
notice (the segment applies it before it answers). Whatever the segment cannot relay (an older
segment, no fast path to the master, a timeout) leaves `statuses` None and says why in
`refused`: the client then sends its PutEnd itself, which is safe to repeat (a key committed
already with the same checksum is answered OK).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.client.chunks import put_checksums
from kvtier.common.logs import request_id as current_request_id
from kvtier.proto import master_pb2 as pb
from kvtier.proto.chunks import CHUNK_BYTES
from kvtier.proto.frames import MAX_COMMIT_BYTES
from kvtier.proto.status import status_name

__all__ = ["MAX_COMMIT_BYTES", "SegmentCommit", "commit_bytes_bound"]

_OK = 0
_PER_KEY = 64  # protobuf bytes of a key's entry besides its name and chunk CRCs, generously
_MESSAGE = 1024  # the rest of the message (namespace, put id, leases, token), generously


def commit_bytes_bound(keys: list[str], sizes: list[int]) -> int:
    """An upper bound of a COMMIT's payload for these keys and value sizes: one that could exceed
    MAX_COMMIT_BYTES is not sent (the segment would close the connection)."""
    names = sum(4 * len(key) + _PER_KEY for key in keys)
    return _MESSAGE + names + sum(4 * (size // CHUNK_BYTES + 1) for size in sizes)


@dataclass(slots=True, eq=False)
class SegmentCommit:
    """The PutEnd of a put whose ranges all go to one segment, to send behind their WRITE."""

    namespace: str
    keys: list[str]  # in the order of the write's ranges
    put_id: int
    token: str  # the client's bearer token: the master checks the relayed call as the client's
    released_leases: Sequence[int] = ()
    statuses: list[int] | None = None  # per key, once the segment relayed the master's answer
    refused: str = field(default="")  # why not, when it did not: the client sends PutEnd itself

    def message(self, views: list[memoryview], checksums: list[int | None], blobs: list[bytes | None]) -> bytes:
        """The COMMIT frame's payload, once the connector checksummed the values on their way."""
        chunks = put_checksums(views, list(range(len(views))), checksums, blobs)
        put_end = pb.PutEndRequest(
            namespace=self.namespace,
            keys=self.keys,
            checksums=checksums,
            put_id=self.put_id,
            released_leases=self.released_leases,
            chunk_checksums=chunks if any(chunks) else (),
            request_id=current_request_id.get(),
        )
        return pb.RelayPutEndRequest(put_end=put_end, token=self.token).SerializeToString()

    def answered(self, payload: bytes) -> None:
        """The segment's answer (a RelayPutEndResponse): statuses when the master answered OK."""
        reply = pb.RelayPutEndResponse.FromString(payload)
        if reply.status == _OK and len(reply.statuses) == len(self.keys):
            self.statuses = list(reply.statuses)
        else:
            self.refused = f"{status_name(reply.status)}: {reply.error}"
