"""MasterLink (segment_server/master_link.py) over real gRPC, against a scripted master servicer.

The master's own mount and recovery logic is tested in tests/unit/master/ and, both sides live,
in tests/integration/ (test_master_restart.py, test_master_ha.py). Checked here is the segment's
side of the contract: the order mount -> inventory -> done -> session published, heartbeats under
that session, a re-mount when the master no longer knows us and none when it is only not the
leader, the exits (drained: 0, refused: 1, credentials: 2), and the unmount on stop.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import crc32c
import grpc
import pytest

from kvtier.common.discovery import MasterLocator
from kvtier.proto import master_pb2 as pb
from kvtier.proto import master_pb2_grpc
from kvtier.proto.status import Status
from kvtier.segment_server.dram_index import DramIndex
from kvtier.segment_server.master_link import MasterChannels, MasterLink
from tests.grants import wait_until
from tests.unit.segment_server.test_dram_index import notices

OK = int(Status.OK)


class ScriptedMaster(master_pb2_grpc.MasterServicer):
    """Answers mounts from `mounts` (then OK with the next segment id), heartbeats with
    `heartbeat_status`, and records every call as (method, request, link session at the time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, object]] = []
        self.mounts: list[pb.MountSegmentResponse] = []
        self.next_id = 1
        self.heartbeat_status = OK
        self.heartbeat_error = ""
        self.abort_with: grpc.StatusCode | None = None
        self.refuse: set[str] = set()  # keys ReportDramObjects refuses (a conflict on the master)

    def record(self, method: str, request, context) -> None:
        with self.lock:
            self.calls.append((method, request))
        if self.abort_with is not None:
            context.abort(self.abort_with, "scripted refusal")

    def methods(self) -> list[str]:
        with self.lock:
            return [method for method, _ in self.calls]

    def requests(self, method: str) -> list:
        with self.lock:
            return [request for m, request in self.calls if m == method]

    def MountSegment(self, request, context):  # noqa: N802 (the RPC's name)
        self.record("MountSegment", request, context)
        with self.lock:
            if self.mounts:
                return self.mounts.pop(0)
            segment_id, self.next_id = self.next_id, self.next_id + 1
        return pb.MountSegmentResponse(
            status=OK, segment_id=segment_id, epoch=10 + segment_id, heartbeat_interval_ms=50
        )

    def ReportDramObjects(self, request, context):  # noqa: N802
        self.record("ReportDramObjects", request, context)
        refused = int(Status.CHECKSUM_MISMATCH)  # what the master answers a conflicting copy
        return pb.KeyStatusResponse(status=OK, statuses=[refused if k in self.refuse else OK for k in request.keys])

    def Heartbeat(self, request, context):  # noqa: N802
        self.record("Heartbeat", request, context)
        return pb.HeartbeatResponse(status=self.heartbeat_status, error=self.heartbeat_error)

    def UnmountSegment(self, request, context):  # noqa: N802
        self.record("UnmountSegment", request, context)
        return pb.UnmountSegmentResponse(status=OK)


@pytest.fixture
def master():
    servicer = ScriptedMaster()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    servicer.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer
    server.stop(0).wait()


class Link:
    """A MasterLink with its callbacks recorded."""

    def __init__(self, master: ScriptedMaster, index: DramIndex | None = None, **kwargs) -> None:
        self.index = index if index is not None else DramIndex(memoryview(bytearray(4096)))
        self.mounted: list[int] = []
        self.fatal: list[tuple[str, int]] = []
        self.disk_reports: list[tuple[int, int, tuple[int, int]]] = []
        self.channels = MasterChannels(MasterLocator(f"127.0.0.1:{master.port}"))
        self.link = MasterLink(
            self.channels,
            pb.MountSegmentRequest(name="seg0", cluster_id="c"),
            self.index,
            on_mounted=self.mounted.append,
            on_fatal=lambda message, code: self.fatal.append((message, code)),
            report=lambda: {"ssd_used": 123},
            report_disk=lambda stub, segment_id, epoch: self.disk_reports.append(
                (segment_id, epoch, self.link.session())
            ),
            **kwargs,
        )
        self.link.start()

    def stop(self, unmount: bool = True) -> None:
        self.link.stop(unmount=unmount)
        self.channels.close()


@pytest.fixture
def links():
    started: list[Link] = []

    def start(master: ScriptedMaster) -> Link:
        started.append(Link(master))
        return started[-1]

    yield start
    for link in started:
        link.stop(unmount=False)


def test_mount_then_inventory_then_session_then_heartbeats(master, links):
    link = links(master)
    assert wait_until(lambda: master.methods().count("Heartbeat") >= 2)
    methods = master.methods()
    assert methods[:3] == ["MountSegment", "ReportDramObjects", "Heartbeat"], methods
    assert master.requests("MountSegment")[0].inventory, "the mount announces an inventory"
    done = master.requests("ReportDramObjects")[-1]
    assert (done.segment_id, done.epoch, done.done) == (1, 11, True)
    # the disk inventory went in before `done`, while the session was not yet published
    assert link.disk_reports == [(1, 11, (0, 0))]
    assert link.link.session() == (1, 11) and link.mounted == [1]
    beat = master.requests("Heartbeat")[0]
    assert (beat.segment_id, beat.epoch, beat.ssd_used) == (1, 11, 123)
    assert link.link.readiness() == ""


def test_a_master_that_no_longer_knows_the_segment_gets_a_new_mount(master, links):
    link = links(master)
    assert wait_until(lambda: "Heartbeat" in master.methods())
    master.heartbeat_status = int(Status.SEGMENT_NOT_FOUND)  # it restarted, or expired us
    assert wait_until(lambda: master.methods().count("MountSegment") == 2)
    master.heartbeat_status = OK
    assert wait_until(lambda: link.link.session() == (2, 12))
    assert link.mounted == [1, 2] and link.fatal == []


def test_a_master_that_is_not_the_leader_does_not_cost_the_mount(master, links):
    link = links(master)
    assert wait_until(lambda: "Heartbeat" in master.methods())
    master.heartbeat_status, master.heartbeat_error = int(Status.UNAVAILABLE), "not the leader"
    beats = master.methods().count("Heartbeat")
    assert wait_until(lambda: master.methods().count("Heartbeat") >= beats + 3)
    assert master.methods().count("MountSegment") == 1 and link.link.session() == (1, 11)


@pytest.mark.parametrize(
    ("reply", "code", "words"),
    [
        (pb.MountSegmentResponse(status=int(Status.SEGMENT_DRAINED), error="by ops"), 0, "drained"),
        (pb.MountSegmentResponse(status=int(Status.CLUSTER_MISMATCH), error="other cluster"), 2, "--cluster-id"),
        (pb.MountSegmentResponse(status=int(Status.INVALID_ARGUMENT), error="no name"), 1, "INVALID_ARGUMENT"),
    ],
    ids=["drained", "other-cluster", "refused"],
)
def test_a_mount_the_master_will_never_accept_ends_the_segment(master, links, reply, code, words):
    master.mounts.append(reply)
    link = links(master)
    assert wait_until(lambda: link.fatal)
    (message, exit_code), *more = link.fatal
    assert exit_code == code and words in message and more == []
    assert master.methods() == ["MountSegment"], "no retry, no inventory"
    assert link.link.session() == (0, 0) and link.mounted == []


def test_refused_credentials_end_the_segment_as_a_configuration_error(master, links):
    master.abort_with = grpc.StatusCode.UNAUTHENTICATED
    link = links(master)
    assert wait_until(lambda: link.fatal)
    assert link.fatal[0][1] == 2 and "credentials" in link.fatal[0][0]
    assert link.link.session() == (0, 0)


def test_stop_unmounts_under_the_current_session(master):
    link = Link(master)
    try:
        assert wait_until(lambda: link.link.session() == (1, 11))
    finally:
        link.stop(unmount=True)
    (unmount,) = master.requests("UnmountSegment")
    assert (unmount.segment_id, unmount.epoch) == (1, 11)


def test_an_unreachable_master_is_retried_and_the_mount_kept(master, links):
    link = links(master)
    assert wait_until(lambda: link.link.session() == (1, 11))
    master.abort_with = grpc.StatusCode.UNAVAILABLE  # every call fails from now on
    attempts = len(master.methods())
    assert wait_until(lambda: len(master.methods()) >= attempts + 3), "retried with backoff"
    assert link.link.session() == (1, 11), "an unanswered heartbeat keeps the mount"
    assert link.fatal == []


def test_a_mount_that_discards_the_index_reports_nothing_of_it(master, links):
    region = bytearray(4096)
    region[:100] = b"a" * 100
    master.mounts.append(pb.MountSegmentResponse(status=OK, segment_id=5, epoch=15, discard_index=True))
    index = DramIndex(memoryview(region))
    index.apply(notices((False, 0, "a", b"a" * 100)), (0, 0))
    assert len(index) == 1
    link = Link(master, index)
    try:
        assert wait_until(lambda: link.link.session() == (5, 15))
        assert len(link.index) == 0, "the index the master did not take is emptied"
        reported = [r for r in master.requests("ReportDramObjects") if not r.done]
        assert all(len(r.keys) == 0 for r in reported), "nothing of the discarded index is reported"
    finally:
        link.stop(unmount=False)


def test_an_outage_is_logged_once_and_its_end_noted(master, links, caplog):
    link = links(master)
    assert wait_until(lambda: link.link.session() == (1, 11))
    with caplog.at_level(logging.DEBUG, logger="kvtier.segment_server.master_link"):
        master.abort_with = grpc.StatusCode.UNAVAILABLE
        attempts = len(master.methods())
        assert wait_until(lambda: len(master.methods()) >= attempts + 4)
        master.abort_with = None
        assert wait_until(lambda: any("master answers again" in r.getMessage() for r in caplog.records))
    beats = master.methods().count("Heartbeat")
    assert wait_until(lambda: master.methods().count("Heartbeat") > beats), "heartbeats resume"
    outage = [r for r in caplog.records if "master link: master unreachable (StatusCode.UNAVAILABLE)" in r.getMessage()]
    assert len(outage) >= 4
    assert [r.levelno for r in outage].count(logging.WARNING) == 1, "one warning per outage, not per attempt"
    assert master.methods().count("MountSegment") == 1 and link.link.session() == (1, 11)


def test_the_inventory_reports_every_field_chunk_by_chunk_and_forgets_what_the_master_refused(master):
    """More entries than one ReportDramObjects carries (10,000): every field of every entry reaches
    the master once, in offset order, a corrupted entry never, and a refused one leaves the index."""
    count, size = 12_345, 16
    region = bytearray(count * size)
    index = DramIndex(memoryview(region), clock=lambda: 100.0)
    reply = pb.PollCommitsResponse(first_seq=1)
    for i in range(count):
        value = i.to_bytes(size, "little")
        region[i * size : (i + 1) * size] = value
        reply.offsets.append(i * size)
        reply.sizes.append(size)
        reply.checksums.append(crc32c.crc32c(value))
        reply.drops.append(False)
        reply.names.append(f"ns{i % 2}\x00k{i}")
        reply.instances.append(f"engine-{i % 3}")
        reply.ranks.append(i % 4)
        reply.pins.append(pb.PIN_SOFT if i == 10_001 else pb.PIN_NONE)
        reply.pin_ttl_ms.append(4000 if i == 10_001 else 0)
    index.apply(reply, (0, 0))
    region[7 * size] ^= 0xFF  # k7's bytes changed: never reported
    master.refuse = {"k3", "k10002"}
    link = Link(master, index)
    try:
        assert wait_until(lambda: link.link.session() == (1, 11))
    finally:
        link.stop(unmount=False)
    chunks = [r for r in master.requests("ReportDramObjects") if not r.done]
    assert [len(r.keys) for r in chunks] == [9_999, count - 1 - 9_999]  # the first chunk lost k7
    got = [
        (r.offsets[j], r.namespaces[j], r.keys[j], r.sizes[j], r.checksums[j], r.instances[j], r.ranks[j], r.pins[j])
        for r in chunks
        for j in range(len(r.keys))
    ]
    want = [
        (i * size, f"ns{i % 2}", f"k{i}", size, crc32c.crc32c(i.to_bytes(size, "little")), f"engine-{i % 3}", i % 4)
        + (pb.PIN_SOFT if i == 10_001 else pb.PIN_NONE,)
        for i in range(count)
        if i != 7
    ]
    assert got == want
    soft = chunks[1].keys[:].index("k10001")
    assert chunks[1].pin_ttl_ms[soft] == 4000 and sum(chunks[1].pin_ttl_ms) == 4000
    assert len(index) == count - 3, "the corrupted entry and the two refused ones left the index"
    assert {entry[0] for _, entry in index.inventory()}.isdisjoint({"ns1\x00k3", "ns1\x00k7", "ns0\x00k10002"})
