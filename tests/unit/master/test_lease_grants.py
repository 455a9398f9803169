"""Direct-read leases granted only once the master's saved state holds them (docs/architecture.md,
"Direct reads"): what MountSegment and Heartbeat answers name, before and after a save held, to a
segment that takes grants and to an older one that serves under the mount's lease at once. Plain
MasterState and MasterHandlers, no processes."""

from __future__ import annotations

from kvtier.master.config import MasterConfig
from kvtier.master.handlers import MasterHandlers
from kvtier.master.state import MasterState
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.test_commits import FakeClock

EPOCH = 7
OWN_MS = 2000  # 2 x the default heartbeat_interval_s


def _mount(handlers: MasterHandlers, name: str, lease_grants: bool) -> pb.MountSegmentResponse:
    reply = handlers.MountSegment(
        pb.MountSegmentRequest(
            name=name,
            cluster_id="unit",
            endpoints=["tcp://127.0.0.1:9"],
            dram_capacity=1 << 20,
            keyed_reads=True,
            lease_grants=lease_grants,
        )
    )
    assert reply.status == Status.OK, reply.error
    return reply


def test_a_mount_caps_what_is_granted_later_and_an_older_segment_gets_only_what_is_granted_now():
    state = MasterState(MasterConfig(cluster_id="unit").validate(), clock=FakeClock())
    handlers = MasterHandlers(state, EPOCH)
    assert state.granted_lease_ms == 0  # no save of this epoch held yet
    assert _mount(handlers, "new", lease_grants=True).direct_read_lease_ms == OWN_MS  # the cap
    old = _mount(handlers, "old", lease_grants=False)
    assert old.direct_read_lease_ms == 0  # it would serve under it at once: nothing is saved yet
    beat = handlers.Heartbeat(pb.HeartbeatRequest(segment_id=old.segment_id, epoch=EPOCH))
    assert beat.status == Status.OK and beat.HasField("direct_read_lease_ms") and beat.direct_read_lease_ms == 0
    state.granted_lease_ms = OWN_MS  # what the server sets once a save held (kvtier.master.server)
    assert _mount(handlers, "later", lease_grants=False).direct_read_lease_ms == OWN_MS
    beat = handlers.Heartbeat(pb.HeartbeatRequest(segment_id=old.segment_id, epoch=EPOCH))
    assert beat.direct_read_lease_ms == OWN_MS
