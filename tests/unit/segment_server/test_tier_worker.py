"""TierWorker (segment_server/tier_worker.py) on a real BucketStore and a real DRAM buffer.

The master's side is a scripted stand-in that records what the worker reports (the master's own
tiering is tested in tests/unit/master/test_tiering.py, both together in
tests/integration/test_ssd_tier.py). What is checked here is what the docs promise of the worker:
a disk copy is reported only once it is durable (the master frees the DRAM copy on that report), a
promotion past its deadline never writes DRAM, bytes that no longer match are never stored, and
copies nobody will read again are tombstoned.
"""

from __future__ import annotations

import logging
import os
import queue
import random
from pathlib import Path

import crc32c
import grpc
import pytest

from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from kvtier.segment_server import tier_worker as tw
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.tier_worker import TierWorker
from tests.grants import wait_until

CLUSTER = "tiertest"
SEGMENT_ID, EPOCH = 7, 3
REGION = 1 << 20
OK = int(Status.OK)


class ScriptedMaster:
    """The master's tier RPCs as the worker sees them: polls answer the scripted task batches in
    order (then nothing, after the poll's wait), every other call is recorded. `on_done(request)`
    runs inside TierTasksDone, as the master would act on the report."""

    def __init__(self) -> None:
        self.batches: queue.Queue[pb.PollTierTasksResponse] = queue.Queue()
        self.done: queue.Queue[pb.TierTasksDoneRequest] = queue.Queue()
        self.done_answers: list[int] | None = None  # statuses TierTasksDone answers (default: all OK)
        self.on_done = lambda request: None
        self.dropped: list[pb.DiskObjectsRequest] = []
        self.polls: list[pb.PollTierTasksRequest] = []

    def PollTierTasks(self, request, timeout):  # noqa: N802 (the RPC's name)
        self.polls.append(request)
        try:
            return self.batches.get(timeout=min(request.wait_ms / 1000, 0.2))
        except queue.Empty:
            return pb.PollTierTasksResponse(status=OK)

    def TierTasksDone(self, request, timeout):  # noqa: N802
        self.on_done(request)
        self.done.put(request)
        statuses = self.done_answers or [OK] * len(request.task_ids)
        return pb.KeyStatusResponse(status=OK, statuses=statuses)

    def DropDiskReplicas(self, request, timeout):  # noqa: N802
        self.dropped.append(request)
        return pb.KeyStatusResponse(status=OK, statuses=[OK] * len(request.keys))

    def report(self, timeout: float = 10.0) -> pb.TierTasksDoneRequest:
        return self.done.get(timeout=timeout)


@pytest.fixture
def ssd(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def store(ssd: Path):
    store = BucketStore(ssd, 64 << 20, CLUSTER, bucket_size=1 << 20)
    store.recover()
    yield store
    store.close()


@pytest.fixture
def region() -> memoryview:
    return memoryview(bytearray(REGION))


@pytest.fixture
def master():
    return ScriptedMaster()


@pytest.fixture
def worker(store, region, master):
    worker = TierWorker(lambda: master, store, region, lambda: (SEGMENT_ID, EPOCH))
    worker.start()
    yield worker
    worker.stop()


def tasks(*items: tuple, ttl_ms: int = 60_000) -> pb.PollTierTasksResponse:
    """items: (task id, kind, key, size, checksum, dram offset, disk location)."""
    reply = pb.PollTierTasksResponse(status=OK, task_ttl_ms=ttl_ms)
    for task_id, kind, key, size, checksum, offset, location in items:
        reply.task_ids.append(task_id)
        reply.kinds.append(kind)
        reply.namespaces.append("ns")
        reply.keys.append(key)
        reply.sizes.append(size)
        reply.checksums.append(checksum)
        reply.dram_offsets.append(offset)
        reply.disk_locations.append(location)
    return reply


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def restarted(worker: TierWorker, store: BucketStore, directory: Path) -> dict[int, str]:
    """Stop the worker, close its store, and return what a restart recovers: {location: key}."""
    worker.stop()
    store.close()
    again = BucketStore(directory, 64 << 20, CLUSTER, bucket_size=1 << 20)
    try:
        return {r.location: r.key for r in again.recover()}
    finally:
        again.close()


def test_an_offload_is_reported_only_after_its_copy_is_durable(worker, store, ssd, region, master, monkeypatch):
    # The master frees the DRAM copy when it reads this report: the disk copy must already have been
    # fdatasync'ed by then. fdatasync is observed (not replaced) to see the order.
    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (real_fdatasync(fd), synced.append(fd))[0])
    seen_at_report: list[int] = []
    master.on_done = lambda request: seen_at_report.append(len(synced))
    data = [blob(i, 10_000 + i) for i in range(3)]
    for i, payload in enumerate(data):
        region[i * 65536 : i * 65536 + len(payload)] = payload
    master.batches.put(
        tasks(*((10 + i, pb.OFFLOAD, f"k{i}", len(p), crc32c.crc32c(p), i * 65536, 0) for i, p in enumerate(data)))
    )
    report = master.report()
    assert list(report.task_ids) == [10, 11, 12] and list(report.statuses) == [OK] * 3
    assert (report.segment_id, report.epoch) == (SEGMENT_ID, EPOCH)
    assert seen_at_report == [1], "one fdatasync for the whole batch (group commit), before the report"
    locations = list(report.disk_locations)
    assert len(set(locations)) == 3
    assert worker.offloaded == 3 and worker.offloaded_bytes == sum(map(len, data))
    assert restarted(worker, store, ssd) == {loc: f"k{i}" for i, loc in enumerate(locations)}


def test_an_offloaded_group_member_keeps_its_group_tag_on_disk_and_in_the_inventory(worker, store, region, master):
    """The OFFLOAD names the member's group (PollTierTasksResponse.group_ids): its record carries it
    (bucket format version 2) and the disk inventory reports it; a batch naming no group writes
    version 1 records whose inventory has no group columns."""
    data = [blob(i, 5000 + i) for i in range(3)]
    for i, payload in enumerate(data):
        region[i * 65536 : i * 65536 + len(payload)] = payload
    batch = tasks(*((20 + i, pb.OFFLOAD, f"m{i}", len(p), crc32c.crc32c(p), i * 65536, 0) for i, p in enumerate(data)))
    batch.group_ids.extend([0xABC, 0, 0xABC])
    batch.group_sizes.extend([2, 0, 2])
    master.batches.put(batch)
    assert list(master.report().statuses) == [OK] * 3
    assert {r.key: (r.group_id, r.group_size) for r in store.records()} == {
        "m0": (0xABC, 2),
        "m1": (0, 0),
        "m2": (0xABC, 2),
    }
    request = tw._disk_objects(SEGMENT_ID, EPOCH, sorted(store.records(), key=lambda r: r.key))
    assert list(request.group_ids) == [0xABC, 0, 0xABC] and list(request.group_sizes) == [2, 0, 2]
    plain = tw._disk_objects(SEGMENT_ID, EPOCH, [r for r in store.records() if r.key == "m1"])
    assert not plain.group_ids and not plain.group_sizes


def test_an_offload_whose_dram_bytes_changed_is_refused_and_nothing_is_stored(worker, store, region, master):
    payload = blob(1, 5000)
    region[:5000] = payload
    region[100] ^= 0xFF  # the range was reused meanwhile: its bytes are not the object's any more
    outside = REGION - 100
    master.batches.put(
        tasks(
            (1, pb.OFFLOAD, "changed", 5000, crc32c.crc32c(payload), 0, 0),
            (2, pb.OFFLOAD, "outside", 5000, crc32c.crc32c(payload), outside, 0),
        )
    )
    report = master.report()
    assert list(report.statuses) == [int(Status.CHECKSUM_MISMATCH), int(Status.INVALID_RANGE)]
    assert "CHECKSUM_MISMATCH" in report.error
    assert store.records() == [] and worker.offloaded == 0


def test_a_promotion_within_its_time_writes_the_dram_range(worker, store, region, master):
    payload = blob(2, 7000)
    location = store.append("ns", "p", payload, crc32c.crc32c(payload))
    store.sync()
    master.batches.put(tasks((5, pb.PROMOTE, "p", 7000, crc32c.crc32c(payload), 4096, location)))
    assert list(master.report().statuses) == [OK]
    assert bytes(region[4096 : 4096 + 7000]) == payload and worker.promoted == 1


def test_a_promotion_past_its_deadline_does_not_write_dram(worker, store, region, master):
    payload = blob(3, 7000)
    location = store.append("ns", "p", payload, crc32c.crc32c(payload))
    store.sync()
    # task_ttl_ms=0: the deadline (half the task's time) has passed before the record is read. The
    # master frees the range when the time is up: it may belong to another object by now.
    region[4096 : 4096 + 7000] = b"\xab" * 7000  # that other object
    master.batches.put(tasks((5, pb.PROMOTE, "p", 7000, crc32c.crc32c(payload), 4096, location), ttl_ms=0))
    report = master.report()
    assert list(report.statuses) == [int(Status.TIMEOUT)] and "too late" in report.error
    assert bytes(region[4096 : 4096 + 7000]) == b"\xab" * 7000, "the range was written after its deadline"
    assert worker.promoted == 0
    assert [r.location for r in store.records()] == [location], "the disk copy stays"


def test_a_promotion_judges_its_time_on_the_masters_clock_not_from_when_the_task_arrived(store, region, master):
    """The answer handing a PROMOTE out sat in a stopped segment's socket: counted from its arrival
    the task's time looked fresh, and the copy landed in a range the master had freed and given to
    another object. Its end (promote_by_ms) is a time on the master's clock, as the segment keeps it."""
    from kvtier.segment_server.master_clock import MasterClock, local_s

    clock = MasterClock()
    sent = local_s()
    clock.observe(sent, sent + 0.001, 5_000_000)  # the master's clock: 5,000,000 ms now
    worker = TierWorker(lambda: master, store, region, lambda: (SEGMENT_ID, EPOCH), clock=clock)
    worker.start()
    try:
        payload = blob(8, 7000)
        location = store.append("ns", "p", payload, crc32c.crc32c(payload))
        store.sync()
        region[4096 : 4096 + 7000] = b"\xab" * 7000  # the range's next object
        late = tasks((5, pb.PROMOTE, "p", 7000, crc32c.crc32c(payload), 4096, location))  # a full minute's ttl
        late.promote_by_ms = 5_000_000 - 4_000  # ...but its time on the master's clock ended 4 s ago
        master.batches.put(late)
        assert list(master.report().statuses) == [int(Status.TIMEOUT)]
        assert bytes(region[4096 : 4096 + 7000]) == b"\xab" * 7000
        fresh = tasks((6, pb.PROMOTE, "p", 7000, crc32c.crc32c(payload), 8192, location))
        fresh.promote_by_ms = 5_000_000 + 30_000
        master.batches.put(fresh)
        assert list(master.report().statuses) == [OK]
        assert bytes(region[8192 : 8192 + 7000]) == payload
    finally:
        worker.stop()


def test_a_promotion_of_a_copy_that_does_not_match_is_refused(worker, store, region, master):
    payload = blob(4, 3000)
    location = store.append("ns", "p", payload, crc32c.crc32c(payload))
    store.sync()
    master.batches.put(
        tasks(
            (1, pb.PROMOTE, "p", 3000, crc32c.crc32c(payload) ^ 1, 0, location),  # the master has other bytes
            (2, pb.PROMOTE, "other-key", 3000, crc32c.crc32c(payload), 0, location),  # another object's record
            (3, pb.PROMOTE, "p", 3000, crc32c.crc32c(payload), 0, location + 1),  # no record there
        )
    )
    assert list(master.report().statuses) == [
        int(Status.CHECKSUM_MISMATCH),
        int(Status.CHECKSUM_MISMATCH),
        int(Status.NOT_FOUND),
    ]
    assert bytes(region[:3000]) == bytes(3000) and worker.promoted == 0


def test_forgets_are_tombstoned_durably_and_do_not_come_back(worker, store, ssd, master):
    kept, gone = blob(5, 2000), blob(6, 2000)
    keep_at = store.append("ns", "kept", kept, crc32c.crc32c(kept))
    gone_at = store.append("ns", "gone", gone, crc32c.crc32c(gone))
    store.sync()
    master.batches.put(tasks((1, pb.FORGET, "gone", 2000, crc32c.crc32c(gone), 0, gone_at)))
    assert list(master.report().statuses) == [OK]
    assert worker.forgotten == 1
    assert restarted(worker, store, ssd) == {keep_at: "kept"}


def test_a_forget_of_a_locations_previous_life_spares_the_copy_its_batch_writes_there(
    worker, store, ssd, region, master, tmp_path
):
    """After a restart a bucket id is taken again: a FORGET of an earlier copy of the same key at a
    location can come in the batch whose OFFLOAD writes the key's new copy there (offloads are
    written first). The new copy stays."""
    payload = blob(8, 4000)
    region[:4000] = payload
    scratch = BucketStore(tmp_path / "scratch", 64 << 20, CLUSTER, bucket_size=1 << 20)
    scratch.recover()
    there = scratch.append("ns", "k", payload, crc32c.crc32c(payload))  # where the offload will land
    scratch.close()
    master.batches.put(
        tasks(
            (1, pb.OFFLOAD, "k", 4000, crc32c.crc32c(payload), 0, 0),
            (2, pb.FORGET, "k", 0, 0, 0, there),
        )
    )
    report = master.report()
    assert list(report.statuses) == [OK, OK] and report.disk_locations[0] == there
    assert restarted(worker, store, ssd) == {there: "k"}


def test_a_copy_written_for_an_offload_the_master_gave_up_on_is_tombstoned(worker, store, ssd, region, master):
    payload = blob(7, 4000)
    region[:4000] = payload
    master.done_answers = [int(Status.NOT_PENDING)]  # the offload expired at the master meanwhile
    master.batches.put(tasks((1, pb.OFFLOAD, "late", 4000, crc32c.crc32c(payload), 0, 0)))
    report = master.report()
    assert list(report.statuses) == [OK]
    # the orphan is tombstoned right after the report: wait for the worker's next poll
    polls = len(master.polls)
    assert wait_until(lambda: len(master.polls) > polls)
    assert store.records() == []
    assert restarted(worker, store, ssd) == {}


def test_the_worker_polls_only_while_mounted_and_with_its_mount_epoch(store, region, master):
    session = [(0, 0)]
    worker = TierWorker(lambda: master, store, region, lambda: session[0])
    worker.start()
    try:
        assert not wait_until(lambda: master.polls, timeout=0.3), "polled while not mounted"
        session[0] = (SEGMENT_ID, EPOCH)
        assert wait_until(lambda: master.polls)
        assert (master.polls[0].segment_id, master.polls[0].epoch) == (SEGMENT_ID, EPOCH)
        assert master.polls[0].max_tasks > 0 and master.polls[0].wait_ms > 0
    finally:
        worker.stop()


def test_a_tier_full_mid_batch_reports_the_records_before_it_and_no_location_after(ssd, region, master):
    # One group write: the records that fit are reported with their locations (after the sync), the
    # rest NO_SPACE with location 0, and a restart recovers exactly the reported ones.
    store = BucketStore(ssd, 40 * 4096, CLUSTER, bucket_size=1 << 20)
    store.recover()
    worker = TierWorker(lambda: master, store, region, lambda: (SEGMENT_ID, EPOCH))
    worker.start()
    try:
        data = [blob(i, 3 * 4096) for i in range(16)]  # 4 pages each, 40 pages of capacity
        for i, payload in enumerate(data):
            region[i * 65536 : i * 65536 + len(payload)] = payload
        master.batches.put(
            tasks(*((i + 1, pb.OFFLOAD, f"k{i}", len(p), crc32c.crc32c(p), i * 65536, 0) for i, p in enumerate(data)))
        )
        report = master.report()
        fitted = [i for i, s in enumerate(report.statuses) if s == OK]
        assert fitted == list(range(len(fitted))) and 0 < len(fitted) < len(data)
        assert set(report.statuses[len(fitted) :]) == {int(Status.NO_SPACE)}
        assert list(report.disk_locations[len(fitted) :]) == [0] * (len(data) - len(fitted))
        assert "SSD tier full" in report.error
        reported = {loc: f"k{i}" for i, loc in enumerate(report.disk_locations[: len(fitted)])}
        assert restarted(worker, store, ssd) == reported
    finally:
        worker.stop()
        store.close()


# ------------------------------------------------------------------ an unreachable master (kvtier.common.poller)


class Unreachable(grpc.RpcError):
    """What a gRPC stub raises when the master does not answer."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class FlakyMaster(ScriptedMaster):
    """A ScriptedMaster whose first `down_polls` polls and `down_reports` reports fail as unreachable;
    `on_failed_report` runs at each failed report."""

    def __init__(self, down_polls: int = 0, down_reports: int = 0) -> None:
        super().__init__()
        self.down_polls, self.down_reports = down_polls, down_reports
        self.failed_polls = self.failed_reports = 0
        self.on_failed_report = lambda: None

    def PollTierTasks(self, request, timeout):  # noqa: N802
        if self.failed_polls < self.down_polls:
            self.failed_polls += 1
            raise Unreachable()
        return super().PollTierTasks(request, timeout)

    def TierTasksDone(self, request, timeout):  # noqa: N802
        if self.failed_reports < self.down_reports:
            self.failed_reports += 1
            self.on_failed_report()
            raise Unreachable()
        return super().TierTasksDone(request, timeout)


def test_an_unreachable_master_is_polled_again_and_its_tasks_then_run(store, region, caplog):
    master = FlakyMaster(down_polls=4)
    payload = blob(11, 4000)
    region[:4000] = payload
    master.batches.put(tasks((1, pb.OFFLOAD, "k", 4000, crc32c.crc32c(payload), 0, 0)))
    worker = TierWorker(lambda: master, store, region, lambda: (SEGMENT_ID, EPOCH))
    with caplog.at_level(logging.DEBUG, logger="kvtier.segment_server.tier_worker"):
        worker.start()
        try:
            report = master.report()
        finally:
            worker.stop()
    assert master.failed_polls == 4 and list(report.statuses) == [OK]
    unreachable = [r for r in caplog.records if "tier worker: master unreachable" in r.getMessage()]
    assert [r.levelno for r in unreachable] == [logging.WARNING] + [logging.DEBUG] * 3, "one warning per outage"
    assert any("master answers again after 4 failures" in r.getMessage() for r in caplog.records)


def test_a_report_the_master_did_not_take_is_sent_again_while_the_mount_lasts(store, region):
    master = FlakyMaster(down_reports=3)
    payload = blob(12, 4000)
    region[:4000] = payload
    master.batches.put(tasks((1, pb.OFFLOAD, "k", 4000, crc32c.crc32c(payload), 0, 0)))
    worker = TierWorker(lambda: master, store, region, lambda: (SEGMENT_ID, EPOCH))
    worker.start()
    try:
        report = master.report()
    finally:
        worker.stop()
    assert master.failed_reports == 3 and list(report.statuses) == [OK]
    assert [r.location for r in store.records()] == list(report.disk_locations), "the reported copy stays"


def test_a_report_no_master_took_before_a_remount_is_abandoned_and_its_copy_tombstoned(store, ssd, region):
    master = FlakyMaster(down_reports=1000)
    session = [(SEGMENT_ID, EPOCH)]
    master.on_failed_report = lambda: (
        session.__setitem__(0, (SEGMENT_ID, EPOCH + 1)) if master.failed_reports > 2 else None
    )
    payload = blob(13, 4000)
    region[:4000] = payload
    master.batches.put(tasks((1, pb.OFFLOAD, "k", 4000, crc32c.crc32c(payload), 0, 0)))
    worker = TierWorker(lambda: master, store, region, lambda: session[0])
    worker.start()
    try:
        assert wait_until(lambda: worker.failures["offload", "abandoned"] == 1)
        assert master.failed_reports == 3, "retried under the mount, given up once it ended"
        assert store.records() == []
    finally:
        worker.stop()
    assert restarted(worker, store, ssd) == {}


def test_a_promotion_polled_under_an_ended_mount_does_not_write_dram(store, region, master, monkeypatch):
    # given a PROMOTE polled under the current mount, and a mount that ends while its record is read
    session = [(SEGMENT_ID, EPOCH)]
    worker = TierWorker(lambda: master, store, region, lambda: session[0])
    payload = blob(2, 7000)
    location = store.append("ns", "p", payload, crc32c.crc32c(payload))
    store.sync()
    real_hit = tw.failpoints.hit

    def remount_meanwhile(name):
        if name == "tier.promote_read":  # the record is read; DRAM not written yet
            session[0] = (0, 0)  # the link ends the mount ...
            session[0] = (SEGMENT_ID + 1, EPOCH)  # ... and mounts again: every range free
            region[4096 : 4096 + 7000] = b"B" * 7000  # B's acknowledged object on that range
        real_hit(name)

    monkeypatch.setattr(tw.failpoints, "hit", remount_meanwhile)
    master.batches.put(tasks((5, pb.PROMOTE, "p", 7000, crc32c.crc32c(payload), 4096, location)))
    worker.start()
    try:
        master.report()
    finally:
        worker.stop()
    assert bytes(region[4096 : 4096 + 7000]) == b"B" * 7000, "the previous mount's PROMOTE overwrote B's object"
