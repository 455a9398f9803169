"""The `kvtier` command line against a real cluster, run as a separate process like an operator would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def kvtier(*args: str, stdin: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*KVTIER, *args], input=stdin, capture_output=True, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"kvtier {args} exited {result.returncode}: {result.stderr.decode()}")
    return result


def stop_up(proc: subprocess.Popen) -> None:
    """A `kvtier up` a test leaves (passing or not): Ctrl-C, which stops its master and segments too;
    SIGKILL would leave them running without it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_put_from_stdin_and_get_to_stdout_and_file(cluster, tmp_path: Path):
    payload = os.urandom(200_000)
    kvtier("put", "--master", cluster.master_address, "blob", "-", stdin=payload)
    assert kvtier("get", "--master", cluster.master_address, "blob").stdout == payload
    out = tmp_path / "out.bin"
    kvtier("get", "--master", cluster.master_address, "blob", "-o", str(out))
    assert out.read_bytes() == payload
    source = tmp_path / "in.bin"
    source.write_bytes(b"from a file")
    kvtier("put", "--master", cluster.master_address, "--namespace", "ns2", "small", str(source))
    assert kvtier("get", "--master", cluster.master_address, "--namespace", "ns2", "small").stdout == b"from a file"
    assert cluster.client(namespace="ns2").get("small") == b"from a file"


def test_put_of_a_stored_key_says_it_kept_the_value_and_upsert_replaces_it(cluster, tmp_path: Path):
    """It printed "stored greet" while the old value stayed (a put never replaces a complete key)."""
    master = ("--master", cluster.master_address)
    kvtier("put", *master, "greet", "-", stdin=b"hi")
    again = kvtier("put", *master, "greet", "-", stdin=b"hello there")
    assert b"stored already" in again.stderr and b"kept" in again.stderr
    assert kvtier("get", *master, "greet").stdout == b"hi"
    kvtier("put", *master, "--upsert", "greet", "-", stdin=b"hello there")
    assert kvtier("get", *master, "greet").stdout == b"hello there"
    (tmp_path / "afile").write_text("")
    bad = kvtier("get", *master, "greet", "-o", str(tmp_path / "afile/out"), check=False)
    assert bad.returncode == 2 and b"Traceback" not in bad.stderr
    assert bad.stderr.decode().strip().endswith("change -o")


def test_get_of_a_missing_key_exits_1_with_a_message(cluster):
    result = kvtier("get", "--master", cluster.master_address, "nope", check=False)
    assert result.returncode == 1
    assert result.stdout == b""
    assert b"not found" in result.stderr


def test_status_json_matches_the_cluster(cluster):
    client = cluster.client()
    client.batch_put(["a", "b", "c"], [b"1" * 100, b"2" * 100, b"3" * 100])
    data = json.loads(kvtier("status", "--master", cluster.master_address, "--json").stdout)
    assert data["cluster_id"] == cluster.cluster_id
    assert data["objects"] == 3
    assert {s["name"] for s in data["segments"]} == {"seg0", "seg1"}
    assert data["capacity"] == 2 * 64 * 1024 * 1024
    assert data["used"] == sum(s["dram_used"] for s in data["segments"]) == 3 * 128  # 100 B rounded to 64 B units
    assert all(s["state"] == "ACTIVE" for s in data["segments"])
    assert data["eviction_policy"] == "lru"  # the default


def test_status_table_names_every_segment(cluster):
    text = kvtier("status", "--master", cluster.master_address).stdout.decode()
    assert cluster.cluster_id in text
    assert "seg0" in text and "seg1" in text and "ACTIVE" in text


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--master", "nonsense"],
        ["put", "--master", "127.0.0.1:1", "--replicas", "0", "k", "-"],
        ["up", "--dram", "lots"],
        ["up", "--segments", "0"],
        ["bogus-command"],
        ["get"],
    ],
)
def test_invalid_arguments_exit_2_with_one_line(args):
    result = kvtier(*args, check=False)
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "1,4"], "for --tier ssd only"),  # the DRAM bench takes one thread count
        (["--tier", "ssd", "--threads", "1,x"], "whole numbers"),
        (["--tier", "ssd", "--threads", "0,4"], "must be positive"),
    ],
)
def test_bench_refuses_bad_thread_counts_before_starting_anything(args, message):
    result = kvtier("bench", *args, check=False)
    assert result.returncode == 2 and message in result.stderr.decode(), result.stderr


def test_help_lists_every_command_and_each_ops_command_takes_json():
    text = kvtier("--help").stdout.decode()
    commands = "up status segments quotas keys stat drain replica evict top events put get bench".split()
    assert "{" + ",".join(commands) + "}" in text
    for command in ("status", "segments", "quotas", "keys", "stat", "drain", "evict", "top", "events", "bench"):
        assert "--json" in kvtier(command, "--help").stdout.decode(), command
    for operation in ("remove", "copy", "move"):
        assert "--json" in kvtier("replica", operation, "--help").stdout.decode(), operation


def test_invalid_key_exits_2(cluster):
    result = kvtier("put", "--master", cluster.master_address, "", "-", stdin=b"x", check=False)
    assert result.returncode == 2
    assert b"INVALID_KEY" in result.stderr


def test_an_unreachable_master_fails_cleanly():
    result = subprocess.run(
        [*KVTIER, "status", "--master", "127.0.0.1:1"], capture_output=True, timeout=60, env={**os.environ}
    )
    assert result.returncode == 1
    assert b"Traceback" not in result.stderr


def test_server_binaries_reject_bad_flags_with_one_line():
    for module, flag in (("kvtier.master", "--lease-s"), ("kvtier.segment_server", "--dram")):
        result = subprocess.run([sys.executable, "-m", module, flag, "soon"], capture_output=True, timeout=60)
        assert result.returncode == 2
        assert len(result.stderr.decode().strip().splitlines()) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_serves_then_stops_cleanly_on_sigint(tmp_path: Path):
    port = _free_port()
    cluster_id = f"up{os.getpid()}"
    with subprocess.Popen(
        [
            *KVTIER, "up", "--listen", f"127.0.0.1:{port}", "--dram", "32MiB", "--cluster-id", cluster_id,
            "--ssd", "32MiB", "--ssd-dir", str(tmp_path / "ssd"), "--state-dir", str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:  # fmt: skip
        try:
            lines = []
            while True:
                line = proc.stdout.readline().decode()
                lines.append(line)
                if "Ctrl-C stops" in line or not line:
                    break
            assert any(f"master 127.0.0.1:{port}" in line for line in lines), lines
            assert any("segment" in line and "tcp://127.0.0.1:" in line for line in lines), lines
            kvtier("put", "--master", f"127.0.0.1:{port}", "k", "-", stdin=b"up works")
            assert kvtier("get", "--master", f"127.0.0.1:{port}", "k").stdout == b"up works"
            assert list(Path("/dev/shm").glob(f"kvtier.{cluster_id}.*")), "the segment's region file exists while up"
            segment = json.loads(kvtier("status", "--master", f"127.0.0.1:{port}", "--json").stdout)["segments"][0]
            assert segment["ssd_capacity"] == 32 << 20 and segment["disk_engine"] in ("io_uring", "threads")
            assert list((tmp_path / "ssd" / "local0").glob("bucket-*.kvb")), "the SSD tier lives in --ssd-dir"
            assert (tmp_path / "state" / "master-state.json").exists(), "the master saves its state in --state-dir"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
            assert b"stopped" in proc.stdout.read()
            assert not list(Path("/dev/shm").glob(f"kvtier.{cluster_id}.*")), "Ctrl-C left a region file behind"
        finally:
            stop_up(proc)


def test_up_keeps_serving_after_one_of_its_segments_is_drained(tmp_path: Path):
    port = _free_port()
    cluster_id = f"updrain{os.getpid()}"
    master = f"127.0.0.1:{port}"
    stderr = tmp_path / "up.stderr"
    with (
        open(stderr, "wb") as err,
        subprocess.Popen(
            [*KVTIER, "up", "--listen", master, "--dram", "16MiB", "--segments", "2", "--cluster-id", cluster_id],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=tmp_path,  # its default SSD tiers go to ./.kvtier/ssd
        ) as proc,
    ):
        try:
            while "Ctrl-C stops" not in (line := proc.stdout.readline().decode()):
                assert line, "kvtier up exited during start-up"
            kvtier("put", "--master", master, "k", "-", stdin=b"survives the drain")
            segments = json.loads(kvtier("status", "--master", master, "--json").stdout)["segments"]
            assert len(segments) == 2
            kvtier("drain", "--master", master, segments[0]["name"])
            # The drained process exits at its next heartbeat, and kvtier up notices within its poll.
            deadline = time.monotonic() + 30
            while b"left the cluster (drained)" not in stderr.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert b"left the cluster (drained)" in stderr.read_bytes(), "kvtier up never saw the segment leave"
            assert proc.poll() is None, "kvtier up stopped when a segment left on purpose"
            assert kvtier("get", "--master", master, "k").stdout == b"survives the drain"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            stop_up(proc)
