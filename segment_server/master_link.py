"""The segment server's control-plane link: mount, heartbeat, re-mount, unmount.

Runs on its own thread with a synchronous gRPC channel, so heartbeats are
never delayed by data-plane work on the event loop (a field lesson: heartbeats
starved by I/O expire healthy nodes). Failures back off exponentially from
50 ms to 3 s; SEGMENT_NOT_FOUND (the master expired us or restarted) triggers
a new mount.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.status import Status

logger = logging.getLogger(__name__)

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 3.0
_RPC_TIMEOUT_S = 2.0


class MasterLink:
    def __init__(
        self,
        master: str,
        mount_request: pb.MountSegmentRequest,
        on_mounted: Callable[[int], None],
        on_fatal: Callable[[str, int], None],
        report: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """`report` returns extra HeartbeatRequest fields (SSD usage, byte counters) for each heartbeat."""
        self._channel = grpc.insecure_channel(master)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._request = mount_request
        self._on_mounted = on_mounted
        self._on_fatal = on_fatal
        self._report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-master-link", daemon=True)
        self.segment_id = 0
        self.master_epoch = ""
        self._interval_s = 1.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, unmount: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if unmount and self.segment_id:
            try:
                self._stub.UnmountSegment(pb.UnmountSegmentRequest(segment_id=self.segment_id), timeout=_RPC_TIMEOUT_S)
                logger.info("unmounted segment_id=%d", self.segment_id)
            except grpc.RpcError as exc:
                logger.warning("unmount failed segment_id=%d code=%s", self.segment_id, exc.code())
        self._channel.close()

    def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                if not self.segment_id:
                    self._mount()
                else:
                    extra = self._report() if self._report is not None else {}
                    reply = self._stub.Heartbeat(
                        pb.HeartbeatRequest(segment_id=self.segment_id, **extra), timeout=_RPC_TIMEOUT_S
                    )
                    if reply.status == Status.SEGMENT_NOT_FOUND:
                        logger.warning("master forgot segment_id=%d; mounting again", self.segment_id)
                        self.segment_id = 0
                        continue
                backoff = _BACKOFF_MIN_S
                self._stop.wait(self._interval_s)
            except grpc.RpcError as exc:
                logger.warning("master unreachable code=%s; retrying in %.2fs", exc.code(), backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            except _Fatal as exc:
                self._on_fatal(str(exc), exc.exit_code)
                return

    def _mount(self) -> None:
        reply = self._stub.MountSegment(self._request, timeout=_RPC_TIMEOUT_S)
        if reply.status == Status.SEGMENT_DRAINED:
            raise _Fatal(f"segment was drained by an operator ({reply.error}); exiting", exit_code=0)
        if reply.status != Status.OK:
            raise _Fatal(f"master refused mount: {Status(reply.status).name}: {reply.error}")
        self.segment_id = reply.segment_id
        self.master_epoch = reply.master_epoch
        self._interval_s = max(reply.heartbeat_interval_ms / 1000, 0.05)
        logger.info(
            "mounted segment_id=%d name=%s epoch=%s heartbeat_s=%.2f",
            reply.segment_id,
            self._request.name,
            reply.master_epoch,
            self._interval_s,
        )
        self._on_mounted(reply.segment_id)


class _Fatal(Exception):
    """The master will never accept this segment (another cluster id, or it was drained)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
