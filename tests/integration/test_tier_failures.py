"""Failed tier writes never leave a visible copy (issue 17): disk full, failed fdatasync, SIGKILL
mid-offload, a master restart mid-report, failed promotions, a block device that fails writes. Real
master and segment processes, real files; moments no outside action can hit are reached with the
segment's env-gated failpoints (KVTIER_FAILPOINTS, kvtier.segment_server.failpoints).

Every check is the same invariant seen from a different failure: each key is a miss or exactly its
bytes; every disk copy the master hands out is a complete record on disk with those bytes; copies
that became durable and were reported come back after a restart; failures are counted.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.proto.status import Status
from tests.capability import missing, require
from tests.cluster import Cluster
from tests.integration.test_history_log import events
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ssd_tier import (
    ALIGN,
    MiB,
    bucket_file,
    disk_location,
    segment_info,
    sources,
    value_for,
)


def start_segment(
    cluster: Cluster, ssd_dir: Path, *extra: str, ssd_size: str = "256MiB", bucket: str = "4MiB", failpoints: str = ""
):
    """`failpoints`: the segment's KVTIER_FAILPOINTS (kvtier.segment_server.failpoints)."""
    return cluster.start_segment(
        "ssd0",
        "16MiB",
        "--ssd-dir", str(ssd_dir),
        "--ssd-size", ssd_size,
        "--ssd-bucket-size", bucket,
        "--metrics", "127.0.0.1:0",
        *extra,
        env={"KVTIER_FAILPOINTS": failpoints} if failpoints else None,
    )  # fmt: skip


def put_paced(cluster: Cluster, client: Client, keys: list[str]) -> None:
    """1 MiB puts, each waiting until DRAM is back under the high watermark (offloaded or dropped):
    every put is acknowledged, whatever happens to the tier."""
    for key in keys:
        assert client.batch_put([key], [value_for(key)]) == [0]
        assert cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.9 * s.dram_capacity, timeout=20), (
            segment_info(client)
        )


def disk_copies(client: Client, keys: list[str]) -> dict[str, int]:
    """key -> location of each disk copy the master would hand out."""
    out = {}
    for key in keys:
        ssd = [r["offset"] for r in client.locate(key) if r["tier"] == "ssd"]
        if ssd:
            out[key] = ssd[0]
    return out


def _read_device(path: Path, offset: int, length: int) -> bytes:
    """What the device holds (O_DIRECT: not the page cache, which keeps pages whose write failed),
    or the file's bytes where the file system has no O_DIRECT (tmpfs)."""
    start = offset & ~(ALIGN - 1)
    span = (offset + length - start + ALIGN - 1) & ~(ALIGN - 1)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT wants
        with buf:
            got = os.preadv(fd, [buf], start)
            return bytes(buf[offset - start : min(got, offset - start + length)])
    finally:
        os.close(fd)


def record_on_disk(ssd_dir: Path, location: int) -> tuple[str, bytes]:
    """The key and payload of the record at `location`, as the device holds them."""
    path, offset = bucket_file(ssd_dir, location)
    head = _read_device(path, offset, 36)
    assert head[:4] == b"KVTR", f"no record header at {location:#x} on the device"
    (header_len,) = struct.unpack_from("<I", head, 8)
    ns_len, key_len = struct.unpack_from("<HH", head, 12)
    (size,) = struct.unpack_from("<Q", head, 16)
    record = _read_device(path, offset, header_len + size)
    assert len(record) == header_len + size, f"record at {location:#x} is cut short"
    return record[36 + ns_len : 36 + ns_len + key_len].decode(), record[header_len:]


def assert_no_wrong_copy(cluster: Cluster, client: Client, ssd_dir: Path, keys: list[str]) -> dict[str, int]:
    """Every key a verified hit or a miss; every disk copy the master lists a complete record of its
    key with its bytes. Returns the disk copies."""
    sources(client, keys)
    copies = disk_copies(client, keys)
    for key, location in copies.items():
        on_disk_key, payload = record_on_disk(ssd_dir, location)
        assert on_disk_key == key and payload == value_for(key), f"the disk copy of {key} is not its bytes"
    info = segment_info(client)
    assert info.ssd_objects == len(copies), (info.ssd_objects, len(copies))
    return copies


def tier_write_failures(cluster: Cluster, op: str, reason: str) -> float:
    samples = scrape(cluster.segments["ssd0"].info["metrics"])
    return value(samples, "kvtier_segment_tier_write_failures_total", segment="ssd0", op=op, reason=reason)


def master_failures(cluster: Cluster, op: str, status: str) -> float:
    samples = scrape(cluster.master.info["metrics"])
    return value(samples, "kvtier_master_tier_task_failures_total", op=op, status=status)


# ---------------------------------------------------------------------------------------- disk full


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 10 MiB tmpfs: the file system itself runs out of room (ENOSPC, short writes)."""
    path = tmp_path / "smallfs"
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=10m,mode=0700", "kvtier-test", str(path)], capture_output=True, text=True
    )
    require("root", done.returncode == 0, f"mount -t tmpfs: {done.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path: Path) -> None:
    """Take every last byte of the file system (not a single free page left)."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (MiB, 4096):
            try:
                while f.write(b"\0" * chunk):
                    pass
            except OSError:
                continue


def test_disk_full_mid_offload_leaves_no_partial_copy_and_recovery_only_complete_records(small_fs, bare_cluster):
    # The file system runs out of room below the tier's own capacity, and a filler takes the rest.
    # (The store's own capacity no longer makes offloads fail while a sealed bucket can be deleted
    # for room: test_buckets.py, "refused_for_room"; an SSD tier of 16 MiB: test_ssd_tier.py.)
    ssd_dir, ssd_size, bucket = small_fs, "256MiB", "4MiB"  # it thinks it has room
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "0")
    start_segment(bare_cluster, ssd_dir, ssd_size=ssd_size, bucket=bucket)
    keys = [f"full/{i:03d}" for i in range(40)]  # 40 MiB through 16 MiB of DRAM into ~10 MiB of disk
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)
        assert bare_cluster.wait_for(lambda: tier_write_failures(bare_cluster, "offload", "no_space") >= 1, timeout=30)
        assert bare_cluster.wait_for(lambda: master_failures(bare_cluster, "offload", "NO_SPACE") >= 1, timeout=10)
        assert client.cluster_status().tiering["offload_failures"] >= 1
        before = assert_no_wrong_copy(bare_cluster, client, ssd_dir, keys)
        assert before, "some objects reached the disk before it was full"
        # a removal on the full disk: its tombstone must still be written (FORGET), or the key could come back
        fill_up(ssd_dir / "filler")
        gone = next(iter(before))
        client.remove(gone)
        del before[gone]
        assert client.get(gone) is None
    # a crash with a full disk, and a restart on it: the segment starts, and only complete records come back
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    start_segment(bare_cluster, ssd_dir, ssd_size=ssd_size, bucket=bucket)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: segment_info(client).ssd_objects >= len(before), timeout=15)
        after = assert_no_wrong_copy(bare_cluster, client, ssd_dir, keys)
        assert after == before, "every durable, reported disk copy came back, and nothing else"
        assert client.get(gone) is None, "a key removed while the disk was full came back"
        # and the segment keeps taking puts into DRAM, full disk or not
        assert client.batch_put(["after"], [value_for("after")]) == [0]
        assert client.get("after") == value_for("after")


# ---------------------------------------------------------------------------------------- SIGKILL


def put_until(client: Client, keys: list[str], reached: Callable[[], bool]) -> list[str]:
    """Put `keys` one at a time until `reached()`; the keys acknowledged. With the tier stalled on a
    failpoint, DRAM can fill before the failpoint's log line is seen: the put that finds no room then
    waits for offload and fails OFFLOAD_BEHIND (nothing stored), which ends the fill too."""
    acknowledged: list[str] = []
    for key in keys:
        status = client.batch_put([key], [value_for(key)])[0]
        if status == Status.OFFLOAD_BEHIND:
            break
        assert status == 0, Status(status).name
        acknowledged.append(key)
        if reached():
            break
    return acknowledged


def test_sigkill_after_an_offload_is_durable_but_before_it_is_reported(bare_cluster, tmp_path):
    """The window between fdatasync and TierTasksDone: the copies are on disk, the master never heard
    of them. Keys removed meanwhile must never come back from them; the rest may (right bytes)."""
    ssd_dir = tmp_path / "ssd"
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "0", "--put-timeout-s", "3")
    proc = start_segment(bare_cluster, ssd_dir, failpoints="tier.offload_synced=stall:30")
    keys = [f"window/{i:03d}" for i in range(20)]
    with bare_cluster.client() as client:
        # fill past the offload watermark without waiting for the stalled tier
        put = put_until(client, keys, lambda: "failpoint tier.offload_synced reached" in proc.tail(200))
        assert bare_cluster.wait_for(lambda: "failpoint tier.offload_synced reached" in proc.tail(200), timeout=20)
        # while the durable copies wait to be reported: remove half of what was put
        removed = put[::2]
        for k in removed:
            client.remove(k)
        bare_cluster.kill(proc)
    proc = start_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: "reported disk inventory" in proc.tail(400), timeout=15)
        assert_no_wrong_copy(bare_cluster, client, ssd_dir, put)
        assert client.batch_get(removed) == [None] * len(removed), "a removed key came back from an unreported copy"


def test_master_restart_between_an_offloads_fdatasync_and_its_report(bare_cluster, tmp_path):
    """The report of durable copies reaches no master that asked for them (the master restarted).
    The new master rebuilds from the segments' inventories: copies of keys removed meanwhile must
    not be among them."""
    ssd_dir = tmp_path / "ssd"
    # A remove may wait for a FORGET behind the worker's 4 s stall, past the master's wait (segment_ttl_s
    # + ~1.4 s): then it is answered with the FORGET owed (saved), and the restart refuses that copy too.
    bare_cluster.start_master("--promote-after-reads", "0")
    proc = start_segment(bare_cluster, ssd_dir, failpoints="tier.offload_synced=stall:4")
    keys = [f"mr/{i:03d}" for i in range(20)]
    reached = "failpoint tier.offload_synced reached"
    with bare_cluster.client() as client:
        put = put_until(client, keys, lambda: reached in proc.tail(200))
        assert bare_cluster.wait_for(lambda: reached in proc.tail(200), timeout=20)
        removed = put[::2]
        for k in removed:
            client.remove(k)
    bare_cluster.restart_master("--promote-after-reads", "0")
    inventories = lambda: proc.tail(2000).count("reported disk inventory")  # noqa: E731
    assert bare_cluster.wait_for(lambda: inventories() >= 2, timeout=20), "the segment mounted on the new master"
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: "tier.offload_synced" in proc.tail(2000) and inventories() >= 2)
        assert_no_wrong_copy(bare_cluster, client, ssd_dir, put)
        assert client.batch_get(removed) == [None] * len(removed), "a removed key came back from an unreported copy"


def test_a_remove_answered_while_its_forget_waits_never_comes_back_after_a_master_restart(bare_cluster, tmp_path):
    """The segment's tier worker stalls on the FORGETs past the master's wait for them (segment_ttl_s
    + about a second): the removes are answered all the same (a stalled disk must not hold every remove
    of the cluster). The master then dies before the tombstones are written; its successor rebuilds
    from the segment's inventory, which still lists the copies: they must not come back."""
    ssd_dir = tmp_path / "ssd"
    bare_cluster.start_master("--promote-after-reads", "0")
    proc = start_segment(bare_cluster, ssd_dir, failpoints="tier.forget=stall:20")
    keys = [f"owed/{i:03d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)
        on_disk = disk_copies(client, keys)
        assert len(on_disk) >= 4, on_disk
        removed = sorted(on_disk)[:4]
        assert [client.remove(k) for k in removed] == [True] * 4
        assert "failpoint tier.forget reached" in proc.tail(400)
    bare_cluster.restart_master("--promote-after-reads", "0")
    inventories = lambda: proc.tail(2000).count("reported disk inventory")  # noqa: E731
    assert bare_cluster.wait_for(lambda: inventories() >= 2, timeout=15), "the segment mounted on the new master"
    with bare_cluster.client() as client:
        assert client.batch_get(removed) == [None] * len(removed), "a removed key came back after a master restart"
        assert not [k for k in removed if client.locate(k)], "a removed key's disk copy was registered again"
        # every key not removed: one still in DRAM at the snapshot above may have been offloaded since
        # (its disk copy counts in the segment's ssd_objects)
        kept = [k for k in keys if k not in removed]
        assert_no_wrong_copy(bare_cluster, client, ssd_dir, kept)
    bare_cluster.kill(proc)  # its tier worker still sleeps in the failpoint: no clean stop


@pytest.mark.parametrize("moment", ["tier.offload_sync", "tier.offload_synced"])
def test_sigkill_at_a_chosen_moment_of_offload_then_restart(bare_cluster, tmp_path, moment):
    """The segment dies just before its batch's fdatasync, or just after it (not yet reported)."""
    ssd_dir = tmp_path / "ssd"
    bare_cluster.start_master("--promote-after-reads", "0")
    proc = start_segment(bare_cluster, ssd_dir, failpoints=f"{moment}=kill")
    keys = [f"at/{i:03d}" for i in range(24)]
    put: list[str] = []
    with bare_cluster.client(timeout=2.0) as client:
        for key in keys:
            if not proc.alive:
                break
            if client.batch_put([key], [value_for(key)]) == [0]:
                put.append(key)
        assert bare_cluster.wait_for(lambda: not proc.alive, timeout=20), "the failpoint was never reached"
    proc = start_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: "reported disk inventory" in proc.tail(400), timeout=15)
        copies = assert_no_wrong_copy(bare_cluster, client, ssd_dir, put)
        # what was durable comes back (its bytes are right, its key untouched); DRAM-only objects died
        # with the process
        if moment == "tier.offload_synced":
            assert copies, "the durable, unreported copies of untouched keys came back"
        assert all(client.get(k) == value_for(k) for k in copies)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_a_random_moment_of_offload_then_restart(bare_cluster, tmp_path, seed):
    rng = random.Random(seed)
    ssd_dir = tmp_path / "ssd"
    history = tmp_path / "history.jsonl"
    bare_cluster.start_master("--promote-after-reads", "0", "--history-log", str(history))
    start_segment(bare_cluster, ssd_dir)
    keys = [f"kill{seed}/{i:03d}" for i in range(48)]
    kill_after = rng.randrange(20, 40)  # past 16 MiB of DRAM: offload is running
    reported: dict[str, int] = {}
    with bare_cluster.client() as client:
        for i, key in enumerate(keys[:kill_after]):
            assert client.batch_put([key], [value_for(key)]) == [0]
            if i == kill_after - 1:
                reported = disk_copies(client, keys[:kill_after])  # reported durable before the kill
                bare_cluster.kill(bare_cluster.segments["ssd0"])
    start_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: segment_info(client).ssd_objects >= len(reported), timeout=15)
        after = assert_no_wrong_copy(bare_cluster, client, ssd_dir, keys)
        missing_back = [k for k in reported if k not in after]
        assert not missing_back, f"durable, reported copies did not come back: {missing_back}"
        got = client.batch_get(list(reported))
        assert got == [value_for(k) for k in reported]
        # the history is consistent: every acknowledged put that is now a miss is explained (its DRAM
        # copy died with the process, or the watermark pass dropped it), none vanished silently
        misses = [k for k, v in zip(keys[:kill_after], client.batch_get(keys[:kill_after]), strict=True) if v is None]
        explained = {e["key"] for e in events(history) if e.get("event") == "object"}
        assert not set(misses) - explained, f"misses with no history: {sorted(set(misses) - explained)}"


def test_failed_fdatasync_of_an_offload_leaves_no_copy_that_could_come_back(bare_cluster, tmp_path):
    """fdatasync says EIO: the batch's records may or may not be on disk. None is reported, none is
    served, and none comes back after a restart (their keys are removed meanwhile here)."""
    ssd_dir = tmp_path / "ssd"
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "0")
    start_segment(bare_cluster, ssd_dir, failpoints="tier.offload_sync=eio")
    keys = [f"eio/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)
        assert bare_cluster.wait_for(lambda: tier_write_failures(bare_cluster, "offload", "io_error") >= 1)
        assert master_failures(bare_cluster, "offload", "INTERNAL") >= 1
        assert assert_no_wrong_copy(bare_cluster, client, ssd_dir, keys) == {}, "no disk copy was registered"
        for key in keys:
            client.remove(key)
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    proc = start_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: "reported disk inventory" in proc.tail(400), timeout=15)
        assert segment_info(client).ssd_objects == 0
        assert client.batch_get(keys) == [None] * len(keys), "a removed key came back from a failed offload"


# ---------------------------------------------------------------------------------------- promotion


def test_promotion_of_a_disk_copy_corrupted_on_disk_registers_nothing(bare_cluster, tmp_path):
    ssd_dir = tmp_path / "ssd"
    # the third read of a disk-only object promotes it: the scan below is the first (GetReplicas
    # counts), disk_location the second, and the third comes once the record is damaged
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "3")
    start_segment(bare_cluster, ssd_dir)
    keys = [f"prom/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)
        for key in keys[-6:]:  # room under the watermark for a promotion
            client.remove(key)
        assert bare_cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.8 * s.dram_capacity)
        on_disk = [k for k in keys[:-6] if not any(r["tier"] == "dram" for r in client.locate(k))]
        victim = on_disk[0]
        location = disk_location(client, victim)
        path, offset = bucket_file(ssd_dir, location)
        with open(path, "r+b") as f:
            f.seek(offset + ALIGN + MiB // 3)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x5A]))
        client.locate(victim)  # the third: PROMOTE, and the segment finds the record damaged
        assert bare_cluster.wait_for(lambda: master_failures(bare_cluster, "promote", "CHECKSUM_MISMATCH") >= 1)
        assert tier_write_failures(bare_cluster, "promote", "checksum") >= 1
        assert client.locate(victim) == [], "no DRAM replica, and the damaged disk copy is gone"
        assert client.get(victim) is None
        assert client.cluster_status().tiering["promote_failures"] >= 1
        assert_no_wrong_copy(bare_cluster, client, ssd_dir, [k for k in keys[:-6] if k != victim])


def test_promotion_past_its_deadline_writes_no_dram_and_frees_the_range(bare_cluster, tmp_path):
    ssd_dir = tmp_path / "ssd"
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "1", "--put-timeout-s", "2")
    proc = start_segment(bare_cluster, ssd_dir, failpoints="tier.promote_read=stall:1.5")
    keys = [f"late/{i:02d}" for i in range(24)]
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)
        for key in keys[-6:]:
            client.remove(key)
        assert bare_cluster.wait_for(lambda: (s := segment_info(client)).dram_used <= 0.8 * s.dram_capacity)
        used = segment_info(client).dram_used
        cold = next(k for k in keys[:-6] if not any(r["tier"] == "dram" for r in client.locate(k)))
        assert bare_cluster.wait_for(lambda: "failpoint tier.promote_read reached" in proc.tail(200))
        assert bare_cluster.wait_for(lambda: tier_write_failures(bare_cluster, "promote", "deadline") >= 1)
        assert bare_cluster.wait_for(lambda: master_failures(bare_cluster, "promote", "TIMEOUT") >= 1)
        # (every read of `cold` starts another promotion, which stalls and fails the same way)
        assert segment_info(client).dram_used == used, "the promotion's range was freed"
        assert client.get(cold, with_source=True) == (value_for(cold), "ssd/tcp"), "no DRAM replica registered"


# ---------------------------------------------------------------------------------------- a failing device


@pytest.fixture
def failing_device(tmp_path: Path):
    """ext4 (no journal) on a loop device whose backing file lives on a 12 MiB tmpfs: the file system
    believes it has 64 MiB. Writes the backing file cannot hold fail in the block layer, under the
    page cache: appends succeed and fdatasync fails (real errors from a real block device, no
    injection). This stack is no honest disk, though: measured here, the fdatasync before the first
    failing one can return OK for bytes that never reached the backing file. So tests on it check
    what clients see (verified hits or misses), not the device's bytes of reported copies."""
    tools = [t for t in ("losetup", "mkfs.ext4") if not shutil.which(t)]
    if tools:
        missing("loop-device", f"{', '.join(tools)} not installed")
    back, mnt = tmp_path / "back", tmp_path / "failing"
    back.mkdir()
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "kvtier-back", str(back)], capture_output=True)
    require("root", done.returncode == 0, f"mount -t tmpfs: {done.stderr.decode().strip()}")
    image = back / "disk.img"
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode != 0:
        subprocess.run(["umount", "-l", str(back)], check=False)
        missing("loop-device", f"losetup: {loop.stderr.strip()}")
    device = loop.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", device], check=True, capture_output=True)
        subprocess.run(["mount", device, str(mnt)], check=True, capture_output=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)  # autoclear once unused
        subprocess.run(["umount", "-l", str(back)], check=False, capture_output=True)


def test_a_device_failing_writes_under_the_file_system_leaves_no_visible_copy(failing_device, bare_cluster):
    ssd_dir = failing_device
    bare_cluster.start_master("--metrics", "127.0.0.1:0", "--promote-after-reads", "0")
    start_segment(bare_cluster, ssd_dir, ssd_size="48MiB")
    keys = [f"dev/{i:03d}" for i in range(40)]
    with bare_cluster.client() as client:
        put_paced(bare_cluster, client, keys)

        def failed() -> float:
            return sum(tier_write_failures(bare_cluster, "offload", r) for r in ("io_error", "no_space"))

        assert bare_cluster.wait_for(lambda: failed() >= 1, timeout=30), "the device never failed a write"
        sources(client, keys)  # every read a verified hit or a miss
        # objects without a registered disk copy (their offload failed, or they were dropped) are
        # removed: their records, if any reached the device, must never come back
        doomed = [k for k in keys if k not in disk_copies(client, keys)]
        for key in doomed:
            client.remove(key)
    bare_cluster.kill(bare_cluster.segments["ssd0"])
    proc = start_segment(bare_cluster, ssd_dir, ssd_size="48MiB")
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: "reported disk inventory" in proc.tail(400), timeout=15)
        sources(client, keys)
        assert client.batch_get(doomed) == [None] * len(doomed), "a removed key came back"


def test_status_says_what_an_ssd_tier_on_a_smaller_file_system_can_hold(small_fs, bare_cluster):
    """`kvtier status` and the segment's metrics said 256 MiB for a tier whose file system holds
    10 MiB: ssd_usable (heartbeat, status, `kvtier segments --json`, a gauge) says what it can hold."""
    import json
    import sys

    bare_cluster.start_master()
    segment = start_segment(bare_cluster, small_fs, ssd_size="256MiB")
    with bare_cluster.client() as client:
        assert bare_cluster.wait_for(lambda: segment_info(client).ssd_usable > 0, timeout=15)
        info = segment_info(client)
        assert info.ssd_capacity == 256 * MiB
        assert 0 < info.ssd_usable <= 10 * MiB
        listed = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "segments", "--json", "--master", bare_cluster.master_address],
            capture_output=True,
            timeout=60,
            check=True,
        )
        [row] = json.loads(listed.stdout)
        assert row["ssd_capacity"] == 256 * MiB and 0 < row["ssd_usable"] <= 10 * MiB
        shown = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "status", "--master", bare_cluster.master_address],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
        assert "256.0 MiB (fs: " in shown, shown
    samples = scrape(segment.info["metrics"])
    assert 0 < value(samples, "kvtier_segment_ssd_usable_bytes", segment="ssd0") <= 10 * MiB
