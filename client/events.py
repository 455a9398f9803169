"""Watching the master's event stream (WatchEvents; docs/events.md): what a cache-aware router
follows to know which keys are stored where.

`Client.watch_events(prefix, since, kinds)` returns an `EventStream`: iterate it for `Event`s in
`seq` order, `close()` it (or use it as a context manager) to stop. When the master ends the
stream it raises `WatchEnded`, a KvtierError whose `status` says why:

- WATCH_CUT_SLOW: this reader fell more than the master's `events_watcher_queue` behind; resume
  with `since=stream.last_seq + 1, epoch=stream.epoch` (while those events are still held);
- WATCH_MISSED / WATCH_EPOCH_CHANGED: events were missed (too old, or the master restarted or
  failed over): resync (list the keys) and watch from now on;
- WATCH_CLOSED: the master stopped serving this stream (a new epoch, no longer the leader);
- TOO_MANY_WATCHERS, EVENTS_DISABLED, UNAVAILABLE (a standby), PERMISSION_DENIED at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import grpc

from kvtier.proto import master_pb2 as pb
from kvtier.proto.errors import ConnectError, KvtierError
from kvtier.proto.keys import check_prefix
from kvtier.proto.status import Status, to_status

if TYPE_CHECKING:
    from kvtier.client.master import MasterClient

EPOCH_HEADER, START_HEADER = "kvtier-epoch", "kvtier-start-seq"  # kvtier.master.event_stream
KINDS = {pb.STORED: "stored", pb.REMOVED: "removed", pb.EVICTED: "evicted", pb.TIER_CHANGED: "tier_changed"}
KIND_VALUES = {name: value for value, name in KINDS.items()}


# Refused before the handler (kvtier.master.auth's interceptor, an undecodable request).
_GRPC_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: Status.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.TOO_MANY_CONNECTIONS,
}


class WatchEnded(KvtierError):
    """The master ended (or refused) the event stream; `status` says why, the message in words."""


@dataclass(slots=True, frozen=True)
class Event:
    """One event. `tiers`/`segments`: the object's copies after it (empty once it is gone)."""

    seq: int  # per master epoch, increasing (gaps: events the filter skipped)
    epoch: int  # the master epoch; a new one restarts seq
    kind: str  # "stored", "removed", "evicted" or "tier_changed"
    namespace: str
    key: str
    size: int
    tiers: tuple[str, ...]  # "dram" / "ssd", one per copy
    segments: tuple[str, ...]  # the segment of each copy ("" when no longer mounted)
    reason: str  # "put", "remove", "remove_prefix", "watermark", "offloaded", "promoted", ...
    time: float  # seconds since 1970, the master's clock, when it was published

    @classmethod
    def from_pb(cls, message: Any) -> Event:
        return cls(
            message.seq,
            message.epoch,
            KINDS.get(message.kind, f"unknown({message.kind})"),
            message.namespace,
            message.key,
            message.size,
            tuple(message.tiers),
            tuple(message.segments),
            message.reason,
            message.time,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tiers"], out["segments"] = list(self.tiers), list(self.segments)
        return out


class EventStream:
    """An open WatchEvents stream: an iterator of `Event`s; closable, also from another thread."""

    def __init__(self, calls: Any) -> None:
        self._calls = calls  # the gRPC response iterator (also the call: cancel())
        self._closed = threading.Event()
        self.epoch = 0  # the master epoch of this stream (0 = refused)
        self.last_seq = 0  # the last event's seq (or the one before the first): resume from +1
        # Blocks until the master subscribed the watcher (or refused: then next() raises): from
        # here on, every event published is in this stream.
        headers = dict(calls.initial_metadata() or ())
        if EPOCH_HEADER in headers:
            self.epoch = int(headers[EPOCH_HEADER])
            self.last_seq = int(headers[START_HEADER]) - 1

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        try:
            message = next(self._calls)
        except StopIteration:
            raise WatchEnded(Status.WATCH_CLOSED, "the master ended the event stream") from None
        except grpc.RpcError as exc:
            if self._closed.is_set():
                raise StopIteration from None
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ConnectError(f"WatchEvents: master unavailable: {exc.details()}") from None
            status = _GRPC_STATUS.get(code, Status.INTERNAL)
            raise WatchEnded(status, f"WatchEvents: {code.name}: {exc.details()}") from None
        if message.kind == pb.EVENT_END or message.status:
            self.close()
            raise WatchEnded(to_status(message.status), message.error)
        event = Event.from_pb(message)
        self.epoch, self.last_seq = event.epoch, event.seq
        return event

    def close(self) -> None:
        """Stop the stream (the master forgets the watcher). Idempotent."""
        if not self._closed.is_set():
            self._closed.set()
            self._calls.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventWatching:
    """`Client.watch_events`; needs the client's `namespace` and master link (`_master`)."""

    namespace: str
    _master: MasterClient

    def watch_events(
        self,
        prefix: str = "",
        since: int = 0,
        kinds: Iterable[str] | None = None,
        *,
        epoch: int = 0,
        all_namespaces: bool = False,
    ) -> EventStream:
        """Events of this namespace's keys starting with `prefix` (every namespace with
        `all_namespaces`: cluster credentials only), of `kinds` ("stored", "removed", "evicted",
        "tier_changed"; None = all). `since` 0: from now on; N: every event from seq N on that the
        master still holds, N a seq of master epoch `epoch` (both from an earlier stream).
        Returns once the master subscribed it: every event published afterwards is in the stream
        (subscribe, then list the keys, and nothing falls between). Refusals raise `WatchEnded`
        on the first `next()`; see the module docstring."""
        values = []
        for kind in kinds or ():
            if kind not in KIND_VALUES:
                raise KvtierError(Status.INVALID_ARGUMENT, f"unknown event kind {kind!r}; one of {sorted(KIND_VALUES)}")
            values.append(KIND_VALUES[kind])
        request = pb.WatchEventsRequest(
            namespace="" if all_namespaces else self.namespace,
            prefix=check_prefix(prefix),
            since=since,
            epoch=epoch,
            kinds=values,
        )
        return EventStream(self._master.stream("WatchEvents", request))
