"""The ops commands of `kvtier` (segments, keys, stat, quotas, evict, drain, top) against real processes.

Each command runs as a separate process, the way an operator runs it; its
`--json` output is compared with what the test stored and with the master's
own view, and its human output must be aligned tables: every cell of a
column starts where its header does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import crc32c
import pytest

from kvtier.proto import master_pb2 as pb
from tests.cluster import Cluster

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]
MiB = 1 << 20


def kvtier(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*KVTIER, *args, "--master", cluster.master_address], capture_output=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kvtier {args} exited {result.returncode}: {result.stderr.decode()}")
    return result


def as_json(cluster: Cluster, *args: str):
    return json.loads(kvtier(cluster, *args, "--json").stdout)


def listed_keys(cluster: Cluster, *args: str) -> list[str]:
    return [k["key"] for k in as_json(cluster, "keys", *args)["keys"]]


def assert_aligned(text: str, min_rows: int = 2) -> list[list[str]]:
    """Every block of `text` (blocks are separated by blank lines) is a table whose columns line up:
    each column starts, in every row, two spaces after the previous one, where its first row's
    does. Returns each block's first row's cells."""
    headers = []
    for block in text.strip("\n").split("\n\n"):
        lines = block.splitlines()
        assert len(lines) >= min_rows, f"not a table:\n{block}"
        starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", lines[0])]
        assert len(starts) >= 2, f"one column only:\n{block}"
        for line in lines[1:]:
            for start in starts[1:]:
                assert line[start - 2 : start] == "  " and line[start : start + 1].strip(), (
                    f"column at {start} does not line up:\n{block}"
                )
        headers.append(re.split(r"\s{2,}", lines[0].strip()))
    return headers


def put_pending(client, key: str) -> None:
    """A put that reached PutStart only: pending (invisible to readers) until the master reclaims it."""
    client._master.call("PutStart", pb.PutStartRequest(namespace=client.namespace, keys=[key], sizes=[100], replicas=1))


# ------------------------------------------------------------------ keys


def test_keys_lists_exactly_the_prefix_in_one_namespace(cluster):
    mine = cluster.client(namespace="n1")
    ours = sorted(f"a/{i}" for i in range(7))
    assert not any(mine.batch_put(ours, [os.urandom(100 + i) for i in range(7)]))
    assert not any(mine.batch_put(["a", "ab/1", "b/a/1"], [b"x"] * 3))  # near the prefix, not under it
    assert not any(cluster.client(namespace="n2").batch_put(["a/0", "a/99"], [b"y", b"y"]))  # same prefix elsewhere
    put_pending(mine, "a/pending")

    listed = as_json(cluster, "keys", "--prefix", "a/", "--namespace", "n1")

    assert [k["key"] for k in listed["keys"]] == ours
    assert listed["next_start_after"] is None and listed["namespace"] == "n1" and listed["prefix"] == "a/"
    assert [k["size"] for k in listed["keys"]] == [100 + int(k[2:]) for k in ours]
    summary = {(k["state"], k["dram_replicas"], k["ssd_replicas"], k["pin"]) for k in listed["keys"]}
    assert summary == {("complete", 1, 0, "none")}
    with_pending = as_json(cluster, "keys", "--prefix", "a/", "--namespace", "n1", "--pending")
    states = {k["key"]: k["state"] for k in with_pending["keys"]}
    assert states == {**dict.fromkeys(ours, "complete"), "a/pending": "pending"}
    assert listed_keys(cluster, "--prefix", "a/", "--namespace", "n2") == ["a/0", "a/99"]
    assert listed_keys(cluster, "--prefix", "a/") == []  # the default namespace has none

    human = kvtier(cluster, "keys", "--prefix", "a/", "--namespace", "n1")
    assert assert_aligned(human.stdout.decode()) == [["KEY", "SIZE", "STATE", "DRAM", "SSD", "PIN"]]
    assert [line.split()[0] for line in human.stdout.decode().splitlines()[1:]] == ours
    assert b"7 keys" in human.stderr


def test_paging_with_limit_returns_every_key_exactly_once(cluster):
    client = cluster.client()
    keys = sorted(f"p/{i:03d}" for i in range(23))
    assert not any(client.batch_put(keys, [b"v"] * len(keys)))
    assert not any(client.batch_put(["q/1"], [b"v"]))

    seen, start_after, calls = [], "", 0
    while True:
        page = as_json(cluster, "keys", "--prefix", "p/", "--limit", "5", "--start-after", start_after)
        assert len(page["keys"]) <= 5
        seen += [k["key"] for k in page["keys"]]
        calls += 1
        if page["next_start_after"] is None:
            break
        assert page["next_start_after"] == seen[-1]
        start_after = page["next_start_after"]

    assert seen == keys and calls == 5
    # one command paging on its own (3 keys per request) lists them all too
    assert listed_keys(cluster, "--prefix", "p/", "--limit", "0", "--page-size", "3") == keys
    assert [info.key for info in client.iter_keys("p/", page_size=4)] == keys  # the library's own paging


# ------------------------------------------------------------------ stat


def test_stat_matches_what_the_client_stored(cluster):
    client = cluster.client(instance="llm", rank=1)
    client.register_instance(tp_size=2, pp_size=1, budget=64 * MiB)
    value = os.urandom(200_000)
    client.put("blob", value, replicas=2, pin="soft", pin_ttl=600)
    assert client.get("blob") == value  # takes a read lease

    info = as_json(cluster, "stat", "blob")

    assert (info["namespace"], info["key"], info["state"]) == ("default", "blob", "complete")
    assert info["size"] == len(value) and info["checksum"] == crc32c.crc32c(value)
    assert sorted(r["segment"] for r in info["replicas"]) == ["seg0", "seg1"]
    assert [r["tier"] for r in info["replicas"]] == ["dram", "dram"]
    located = sorted((r["segment"], r["offset"]) for r in client.locate("blob"))
    assert sorted((r["segment"], r["location"]) for r in info["replicas"]) == located
    assert 0 < info["lease_s"] <= 10
    assert info["pin"] == "soft" and 500 < info["pin_ttl_s"] <= 600
    assert (info["instance"], info["rank"]) == ("llm", 1)
    assert info["age_s"] >= 0 and info["disk_reads"] == 0

    human = kvtier(cluster, "stat", "blob").stdout.decode()
    fields, replicas = assert_aligned(human)
    assert fields == ["namespace", "default"] and replicas == ["SEGMENT", "ID", "TIER", "LOCATION", "TASK"]
    assert f"0x{crc32c.crc32c(value):08x}" in human and "soft" in human and "llm rank 1" in human


def test_stat_of_a_missing_key_exits_1_with_a_clear_message(cluster):
    result = kvtier(cluster, "stat", "nope", "--json", check=False)
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr.decode().strip() == "kvtier stat: nope: not found in namespace 'default'"
    cluster.client(namespace="other").put("nope", b"x")  # another namespace's key is not ours
    assert kvtier(cluster, "stat", "nope", check=False).returncode == 1
    assert as_json(cluster, "stat", "nope", "--namespace", "other")["size"] == 1


def test_stat_and_keys_show_the_ssd_tier_after_an_offload(bare_cluster, tmp_path: Path):
    from tests.integration.test_ssd_tier import put_and_offload, start_ssd_segment, value_for

    bare_cluster.start_master("--promote-after-reads", "0")
    start_ssd_segment(bare_cluster, tmp_path)
    client = bare_cluster.client(timeout=15.0, transport="tcp")
    keys = [f"big/{i:02d}" for i in range(24)]  # 24 MiB through a 16 MiB region: the oldest go to SSD
    put_and_offload(bare_cluster, client, keys)

    listed = {k["key"]: k for k in as_json(bare_cluster, "keys", "--prefix", "big/")["keys"]}
    on_ssd = [key for key in keys if listed[key]["ssd_replicas"] and not listed[key]["dram_replicas"]]
    assert on_ssd, listed
    info = as_json(bare_cluster, "stat", on_ssd[0])
    assert [r["tier"] for r in info["replicas"]] == ["ssd"]
    assert info["size"] == MiB and info["checksum"] == crc32c.crc32c(value_for(on_ssd[0]))
    assert info["replicas"][0]["location"] == client.locate(on_ssd[0])[0]["offset"]
    # a read of it is a lookup hit served by the SSD tier, and status counts it so
    before = as_json(bare_cluster, "status")["lookup_hits_disk_only"]
    assert client.get(on_ssd[0]) == value_for(on_ssd[0])
    assert as_json(bare_cluster, "status")["lookup_hits_disk_only"] == before + 1
    segments = kvtier(bare_cluster, "segments").stdout.decode()
    assert_aligned(segments)
    assert "ssd0" in segments


# ------------------------------------------------------------------ segments, quotas, status


def test_segments_json_matches_status(cluster):
    client = cluster.client(transport="tcp")
    assert not any(client.batch_put(["a", "b", "c"], [b"1" * 100, b"2" * 100, b"3" * 1000]))
    assert client.get("c") is not None
    assert cluster.wait_for(lambda: sum(s.dram_bytes_served for s in client.cluster_status().segments) >= 1000)

    segments = as_json(cluster, "segments")
    status = as_json(cluster, "status")

    def steady(entries):  # the heartbeat age and the clock skew measured move between two calls
        return [{k: v for k, v in s.items() if k not in ("heartbeat_age_ms", "clock_skew_s")} for s in entries]

    assert steady(segments) == steady(status["segments"])
    assert [s["name"] for s in segments] == ["seg0", "seg1"]
    reply = {s.name: s for s in client.cluster_status().segments}
    for s in segments:
        assert s["segment_id"] == reply[s["name"]].segment_id and s["host_id"] == reply[s["name"]].host_id
        assert (s["dram_capacity"], s["state"], s["ssd_capacity"]) == (64 * MiB, "ACTIVE", 0)
        assert list(reply[s["name"]].endpoints) == s["endpoints"]
    assert sum(s["objects"] for s in segments) == 3 and sum(s["dram_used"] for s in segments) == status["used"]
    assert sum(s["dram_bytes_served"] for s in segments) >= 1000

    human = kvtier(cluster, "segments").stdout.decode()
    (header,) = assert_aligned(human, min_rows=3)
    assert header[:3] == ["ID", "NAME", "STATE"] and "SERVED DRAM" in header and "HEARTBEAT" in header
    assert_aligned("\n".join(kvtier(cluster, "status").stdout.decode().splitlines()[1:]))  # after its summary line


def test_quotas_json_after_register_instance(cluster):
    rank0 = cluster.client(instance="llm", rank=0)
    assert rank0.register_instance(tp_size=2, pp_size=1, budget=16 * MiB) == 8 * MiB
    rank0.batch_put(["r0/a", "r0/b"], [b"x" * 1000, b"y" * 1000])

    quotas = as_json(cluster, "quotas")

    assert quotas == rank0.quotas()
    by_rank = {q["rank"]: q for q in quotas if q["instance"] == "llm"}
    assert set(by_rank) == {0, 1}
    assert by_rank[0] == dict(instance="llm", rank=0, quota=8 * MiB, used=2048, objects=2, tp_size=2, pp_size=1)
    assert (by_rank[1]["quota"], by_rank[1]["used"], by_rank[1]["objects"]) == (8 * MiB, 0, 0)
    (header,) = assert_aligned(kvtier(cluster, "quotas").stdout.decode(), min_rows=3)
    assert header == ["INSTANCE", "RANK", "TPxPP", "QUOTA", "USED", "USED%", "OBJECTS"]


# ------------------------------------------------------------------ evict and drain


def test_evict_removes_exactly_the_prefix_and_reports_counts(cluster):
    client = cluster.client()
    doomed = [f"ev/{i:02d}" for i in range(10)]
    values = [os.urandom(1000 + i) for i in range(10)]
    assert not any(client.batch_put(doomed, values))
    kept = ["keep/1", "ev", "e/v"]
    assert not any(client.batch_put(kept, [b"k"] * 3))
    client.put("ev/pinned", b"p" * 10, pin="hard")
    put_pending(client, "ev/pending")
    elsewhere = cluster.client(namespace="other")
    elsewhere.put("ev/00", b"other namespace")

    dry = as_json(cluster, "evict", "--prefix", "ev/", "--dry-run")
    assert (dry["removed"], dry["dry_run"]) == (10, True) and client.get(doomed[0]) == values[0]

    result = kvtier(cluster, "evict", "--prefix", "ev/", "--page-size", "3", "--json")
    report = json.loads(result.stdout)

    assert report["removed"] == 10 and report["removed_bytes"] == sum(len(v) for v in values)
    assert (report["skipped_pinned"], report["skipped_pending"], report["gone"]) == (1, 1, 0)
    assert report["listed"] == 12 and report["pages"] == 4 and report["namespace"] == "default"
    progress = result.stderr.decode().splitlines()
    assert len(progress) == 4 and all(line.startswith("evict 'ev/': page") for line in progress), progress
    assert progress[-1].startswith("evict 'ev/': page 4, removed 10")
    assert client.batch_get(doomed) == [None] * 10
    assert client.batch_get(kept) == [b"k"] * 3
    assert client.get("ev/pinned") == b"p" * 10
    assert elsewhere.get("ev/00") == b"other namespace"

    # the pinned object goes with --include-pinned; the pending put is still skipped
    human = kvtier(cluster, "evict", "--prefix", "ev/", "--include-pinned").stdout.decode()
    (header,) = assert_aligned(human)
    assert header[:4] == ["NAMESPACE", "PREFIX", "REMOVED", "BYTES"]
    assert human.splitlines()[1].split()[:4] == ["default", "ev/", "1", "10"]
    assert client.get("ev/pinned") is None


def test_evict_keeps_keys_under_a_put_time_lease_unless_include_pinned(cluster):
    client = cluster.client()
    client.put("lz/leased", b"l", lease_s=600)
    client.put("lz/free", b"f")
    report = as_json(cluster, "evict", "--prefix", "lz/")
    assert (report["removed"], report["skipped_pinned"], report["gone"]) == (1, 1, 0)
    assert client.get("lz/leased") == b"l"
    report = as_json(cluster, "evict", "--prefix", "lz/", "--include-pinned")
    assert (report["removed"], report["skipped_pinned"]) == (1, 0)
    assert client.get("lz/leased") is None


def test_drain_json_on_stdout_progress_on_stderr(cluster):
    cluster.start_segment("seg2")
    client = cluster.client(transport="tcp")
    keys = [f"d/{i}" for i in range(6)]
    assert not any(client.batch_put(keys, [k.encode() * 100 for k in keys], preferred_segment="seg0"))

    result = kvtier(cluster, "drain", "seg0", "--json")

    report = json.loads(result.stdout)
    assert (report["segment"], report["state"], report["moved"], report["dropped"]) == ("seg0", "DRAINED", 6, 0)
    assert b"drain seg0: moved 6" in result.stderr
    assert client.batch_get(keys) == [k.encode() * 100 for k in keys]
    assert cluster.segments["seg0"].popen.wait(timeout=30) == 0
    human = kvtier(cluster, "drain", "seg2", "--quiet")
    assert human.stderr == b""
    (header,) = assert_aligned(human.stdout.decode())
    assert header == ["SEGMENT", "STATE", "MOVED", "MOVED BYTES", "FAILED", "NO ROOM", "DROPPED", "DROPPED SSD"]
    assert human.stdout.decode().splitlines()[1].split()[:2] == ["seg2", "DRAINED"]


# ------------------------------------------------------------------ top


def test_top_json_rates_reflect_the_workload_between_refreshes(cluster):
    client = cluster.client(transport="tcp")  # shm reads bypass the segment servers' counters
    keys = [f"t/{i}" for i in range(8)]
    assert not any(client.batch_put(keys, [os.urandom(256 * 1024) for _ in keys]))
    top = subprocess.Popen(
        [*KVTIER, "top", "--json", "--iterations", "2", "--interval", "1", "--master", cluster.master_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stop = threading.Event()
    try:
        first = json.loads(top.stdout.readline())  # an idle interval
        worker = threading.Thread(target=lambda: [client.batch_get(keys) for _ in iter(stop.is_set, True)])
        worker.start()
        second = json.loads(top.stdout.readline())  # an interval of reads
        stop.set()
        worker.join()
        assert top.wait(timeout=30) == 0 and top.stdout.read() == b"", top.stderr.read().decode()
    finally:
        stop.set()
        if top.poll() is None:
            top.kill()
            top.wait()
        top.stdout.close()
        top.stderr.close()

    assert first["rates"]["lookup_keys"] == 0 and first["hit_ratio"]["lookup"] is None
    assert first["rates"]["dram_bytes_served"] == 0
    assert second["rates"]["lookup_keys"] > 0 and second["rates"]["dram_bytes_served"] > 0
    assert second["hit_ratio"] == {"lookup": 1.0, "dram": 1.0, "ssd": 0.0}
    assert second["rpcs"]["GetReplicas"] > 0 and second["rates"]["rpc_requests"] > 0
    per_segment = sum(s["rates"]["dram_bytes_served"] for s in second["segments"])
    assert per_segment == pytest.approx(second["rates"]["dram_bytes_served"])
    assert second["capacity"]["dram"] == 128 * MiB and second["capacity"]["dram_used"] == 8 * 256 * 1024
    assert second["objects"] == 8 and 0.9 < second["interval_s"] < 3


def test_top_plain_output_is_one_aligned_row_per_refresh(cluster):
    out = kvtier(cluster, "top", "--iterations", "3", "--interval", "0.2").stdout.decode()
    (header,) = assert_aligned(out, min_rows=4)
    assert len(out.splitlines()) == 4
    assert header[:3] == ["TIME", "OBJECTS", "DRAM USED"] and "DRAM HIT%" in header and "SSD HIT%" in header


def test_top_exits_0_quietly_on_ctrl_c(cluster):
    top = subprocess.Popen(
        [*KVTIER, "top", "--interval", "0.2", "--master", cluster.master_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert top.stdout.readline().startswith(b"TIME")
        assert top.stdout.readline()  # a first refresh
        top.send_signal(signal.SIGINT)
        assert top.wait(timeout=30) == 0
        assert top.stderr.read() == b""
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
        top.stdout.close()
        top.stderr.close()


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "--limit", "-1"],
        ["keys", "--page-size", "0"],
        ["keys", "--page-size", "20000"],  # more than a page holds: said, not clamped in silence
        ["evict", "--prefix", "x/", "--page-size", "20000"],
        ["top", "--interval", "0"],
        ["top", "--iterations", "many"],
        ["evict"],
        ["stat"],
    ],
)
def test_ops_commands_reject_bad_arguments_with_one_line(args):
    result = subprocess.run([*KVTIER, *args], capture_output=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], lines


def test_events_refuses_an_epoch_without_the_seq_it_counts():
    # --epoch alone would be ignored (a stream from now), not what a resuming caller asked for
    result = subprocess.run([*KVTIER, "events", "--master", "127.0.0.1:1", "--epoch", "5"], capture_output=True)
    assert result.returncode == 2 and "--since N and --epoch E go together" in result.stderr.decode()


def test_every_command_finds_an_ha_master_through_etcd(bare_cluster, etcd):
    # given a master leading through etcd and a key stored, as the README's HA section sets it up
    bare_cluster.start_ha_masters(etcd.endpoint, 1, "--recovery-timeout-s", "1")
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    assert bare_cluster.wait_for(lambda: client.batch_put(["k"], [b"v"]) == [0], 20.0, 0.2)
    # when the CLI is pointed at etcd://HOST:PORT/CLUSTER, by flag and by KVTIER_MASTER
    status = as_json(bare_cluster, "status")
    env = {**os.environ, "KVTIER_MASTER": bare_cluster.master_address}
    keys = subprocess.run([*KVTIER, "keys", "--json"], capture_output=True, timeout=120, env=env)
    # then both reach the leader
    assert bare_cluster.master_address.startswith("etcd://")
    assert status["segments"] and keys.returncode == 0, keys.stderr.decode()
    assert [k["key"] for k in json.loads(keys.stdout)["keys"]] == ["k"]
