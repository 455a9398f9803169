"""A same-host writer stopped in the middle of a copy past its grant damages no other object.

A client that maps a segment's region copies into it without the segment, and a copy cannot be taken
back: a writer SIGSTOPped mid-copy, whose put the master reclaims meanwhile, finishes the copy when it
is continued, on whatever the range holds by then. Its copy is announced in a writer slot of the
region's header (kvtier.proto.region); the segment reports it, and the master keeps the range from
other objects while the writer lives (kvtier.master.range_book). Real master, segment and writer
processes; the test reads the slots through its own grant of the region, as any same-host client
would map it, and freezes the writer while a slot of its says it is copying.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from kvtier.client.transport.shm import request_region
from kvtier.proto.region import SLOTS_PER_BLOCK, WRITER_BLOCKS, WRITER_SLOT, writer_slot
from kvtier.proto.status import Status

MiB = 1 << 20
STALLED = 24 * MiB  # the writer's object: a copy long enough to be caught in the middle
FILL = 4 * MiB
FILL_OBJECTS = 8  # 32 MiB: with the writer's 24 MiB held, the 64 MiB region stays under the 90% watermark
PUT_TIMEOUT_S = 1.0  # --put-timeout-s and --lease-s: the write grant is 1 s, reuse 2 s (clock skew) after

WRITER = textwrap.dedent(
    """
    import os, sys, time
    from kvtier.client import Client
    client = Client(sys.argv[1], transport="shm", timeout=5.0)
    value = bytes(range(256)) * ({size} // 256)
    print("ready", flush=True)
    round = 0
    while True:  # put and remove while the go file is there: the test stops it in the middle of a copy
        if not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
            continue
        key = f"stalled/{{round}}"
        client.batch_put([key], [value])
        client.remove(key)
        round += 1
    """
).replace("{size}", str(STALLED))


@pytest.fixture
def cluster(bare_cluster):
    timeouts = ("--put-timeout-s", str(PUT_TIMEOUT_S), "--lease-s", str(PUT_TIMEOUT_S))
    bare_cluster.start_master(*timeouts)
    bare_cluster.start_segment("seg0", "64MiB")
    return bare_cluster


def writer_slots(cluster) -> mmap.mmap:
    """The region's header, mapped through a grant of our own (read-only use: it takes no block)."""
    client = cluster.client(transport="shm")
    endpoint = next(e for s in client.cluster_status().segments for e in s.endpoints if e.startswith("shm://"))
    url = urlsplit(endpoint)
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    fd = request_region(unquote(url.path), bytes.fromhex(query["nonce"]), int(query["uid"]), 5.0)
    try:
        return mmap.mmap(fd, writer_slot(WRITER_BLOCKS, 0), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def copies(header: mmap.mmap) -> list[tuple[int, int]]:
    """(offset, length) of every slot whose state says a copy is in progress."""
    found = []
    for block in range(WRITER_BLOCKS):
        for index in range(SLOTS_PER_BLOCK):
            state, offset, length, _cutoff = WRITER_SLOT.unpack_from(header, writer_slot(block, index))
            if state & 1:
                found.append((offset, length))
    return found


def releasing(client) -> int:
    """seg0's dram_releasing; -1 while it is not mounted (a restarted master it has not reached yet)."""
    return next((s.dram_releasing for s in client.cluster_status().segments if s.name == "seg0"), -1)


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def stop_mid_copy(cluster, writer: subprocess.Popen, header: mmap.mmap) -> tuple[int, int]:
    """SIGSTOP the writer while a slot says it is copying its object; the range it is in."""
    for _ in range(200):
        deadline = time.monotonic() + 5.0
        while not (seen := [c for c in copies(header) if c[1] == STALLED]) and time.monotonic() < deadline:
            time.sleep(0.0005)  # a copy of STALLED bytes takes milliseconds; the writer needs the CPU
        assert seen, "the writer never announced its copy in a writer slot"
        writer.send_signal(signal.SIGSTOP)
        assert cluster.wait_for(lambda: stopped(writer.pid), timeout=5.0)
        if held := [c for c in copies(header) if c[1] == STALLED]:
            return held[0]
        writer.send_signal(signal.SIGCONT)  # it finished that copy before it stopped: try again
    raise AssertionError("never stopped the writer in the middle of a copy")


def fill_and_check(cluster, client, header, writer, offset: int, length: int) -> None:
    """New objects take what is free (below the eviction watermark), none of them where the stopped writer
    is; when it goes on and finishes its copy, every one of them reads back intact."""
    keys = [f"fill/{i:02d}" for i in range(FILL_OBJECTS)]
    values = {key: os.urandom(FILL) for key in keys}
    assert client.batch_put(keys, list(values.values())) == [Status.OK] * len(keys)
    placed = [(r["offset"], r["size"]) for key in keys for r in client.locate(key)]
    assert len(placed) == len(keys)
    assert not [p for p in placed if p[0] < offset + length and offset < p[0] + p[1]], (
        f"objects were placed in the range [{offset}, {offset + length}) a stopped writer is copying into"
    )
    writer.send_signal(signal.SIGCONT)
    assert cluster.wait_for(lambda: not [c for c in copies(header) if c == (offset, length)], timeout=10.0)
    got = client.batch_get(keys)
    assert [g == values[k] for k, g in zip(keys, got, strict=True)] == [True] * len(keys), (
        "an object stored after the writer's grant ended was damaged by its late copy"
    )


@pytest.fixture
def stopped_writer(cluster, tmp_path):
    """A same-host writer process stopped in the middle of a copy: (it, the mapped header, offset, length)."""
    header = writer_slots(cluster)
    go = tmp_path / "go"
    go.touch()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, cluster.master_address, str(go)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        offset, length = stop_mid_copy(cluster, writer, header)
        go.unlink()  # continued, it finishes the round it is in and puts nothing more
        yield writer, header, offset, length
    finally:
        writer.kill()
        writer.wait(10)
        writer.stdout.close()
        header.close()


def test_a_writer_stopped_mid_copy_keeps_its_range_from_other_objects_until_it_dies(cluster, stopped_writer):
    writer, header, offset, length = stopped_writer
    client = cluster.client()  # tcp: another host's engine, say
    # when its put is reclaimed and its grant is long over (put timeout 1 s, grant 1 s, margin 2 s)
    assert cluster.wait_for(lambda: releasing(client) >= length, timeout=15.0), "the range was not held"
    time.sleep(2 * PUT_TIMEOUT_S + 2.0 + 1.0)
    assert releasing(client) >= length, "a stopped writer's range went back to the free space"
    fill_and_check(cluster, client, header, writer, offset, length)
    # once the writer is gone its block is released and the range comes back
    writer.kill()
    assert cluster.wait_for(lambda: releasing(client) == 0, timeout=15.0), "the dead writer's range stayed held"


def test_a_master_restarted_while_a_writer_is_stopped_mid_copy_places_nothing_in_its_range(cluster, stopped_writer):
    writer, header, offset, length = stopped_writer
    # the new master's books have the range free: the segment names the copy when it mounts there
    cluster.restart_master("--put-timeout-s", str(PUT_TIMEOUT_S), "--lease-s", str(PUT_TIMEOUT_S))
    client = cluster.client()
    assert cluster.wait_for(lambda: releasing(client) >= length, timeout=20.0), "the range was not held"
    fill_and_check(cluster, client, header, writer, offset, length)
    writer.kill()
    assert cluster.wait_for(lambda: releasing(client) == 0, timeout=15.0), "the dead writer's range stayed held"
