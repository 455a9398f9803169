"""End to end: a user's path through the installed `kvtier` command, a whole local cluster and the library.

What the user types, not what the code calls: the console scripts the install put beside the
interpreter (`kvtier`, which starts `python -m kvtier.master` and `python -m kvtier.segment_server`
as processes), `kvtier up` in the foreground, the CLI in another terminal, a program using
`kvtier.client.Client`, Ctrl-C, and the same commands again after a restart. Each test checks the
result the user sees (bytes, exit codes, `--json` documents), never internal state.

Integration tests (tests/integration/) check one behaviour each against real processes; these check
that the pieces a user strings together still fit.
"""

from __future__ import annotations

import os
import random
import signal
import zlib
from pathlib import Path

import pytest

from kvtier.client import Client, Status
from tests.e2e.terminal import Up, free_port, kvtier, kvtier_json, wait_for

MiB = 1 << 20


def value_for(key: str, size: int = MiB) -> bytes:
    return random.Random(zlib.crc32(key.encode())).randbytes(size)


@pytest.fixture
def up_args(tmp_path: Path):
    """Arguments of a small `kvtier up` whose state and SSD tier live under tmp_path, and its address."""
    address = f"127.0.0.1:{free_port()}"
    args = [
        "--listen", address, "--cluster-id", f"e2e{os.getpid()}", "--dram", "16MiB",
        "--ssd", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    return args, address


@pytest.mark.slow  # ~10 s: make test-slow (CI runs it)
def test_kvtier_up_cli_and_library_and_the_ssd_tier_across_a_restart(up_args, tmp_path: Path):
    args, master = up_args
    keys = [f"doc/{i:02d}" for i in range(28)]  # 28 MiB through 16 MiB of DRAM: the early ones go to SSD
    up = Up(args, tmp_path / "up1.log")
    try:
        assert any(f"master {master}" in line for line in up.lines), up.lines

        # The CLI, as README's first steps show it.
        kvtier("put", "--master", master, "greeting", "-", stdin=b"hello\n")
        assert kvtier("get", "--master", master, "greeting").stdout == b"hello\n"

        # A program using the library, in 1 MiB puts the offload keeps pace with.
        with Client(master, timeout=15.0) as kv:

            def under_watermark() -> bool:
                segment = kv.cluster_status().segments[0]
                return segment.dram_used <= 0.9 * segment.dram_capacity

            for key in keys:
                kv.put(key, value_for(key))
                wait_for(under_watermark, "the offload to bring DRAM under its high watermark")
            assert kv.get("greeting") == b"hello\n", "the library reads what the CLI wrote"
            assert kv.get(keys[-1]) == value_for(keys[-1])
            assert kv.remove(keys[0]) is True
            assert kv.get(keys[0]) is None

        # What the operator sees.
        missing = kvtier("get", "--master", master, keys[0], check=False)
        assert missing.returncode == 1 and b"not found" in missing.stderr
        listing = kvtier_json("keys", "--master", master, "--prefix", "doc/")
        assert [k["key"] for k in listing["keys"]] == keys[1:]
        assert all(k["size"] == MiB and k["state"] == "complete" for k in listing["keys"])
        on_ssd = [k["key"] for k in listing["keys"] if k["ssd_replicas"]]
        assert on_ssd, f"nothing reached the SSD tier: {listing}"
        stat = kvtier_json("stat", "--master", master, on_ssd[0])
        assert stat["size"] == MiB and "ssd" in {r["tier"] for r in stat["replicas"]}
        status = kvtier_json("status", "--master", master)
        assert status["objects"] == 1 + len(keys) - 1 and status["role"] == "leader"
        assert status["segments"][0]["ssd_capacity"] == 64 * MiB

        assert up.ctrl_c() == 0
        assert any("stopped" in line for line in up.lines), up.lines
    finally:
        up.kill()

    # The same command again, with the same directories: what was on the SSD tier is back, with its
    # bytes; what was removed stays removed; DRAM-only objects died with the segment's memory.
    up = Up(args, tmp_path / "up2.log")
    try:
        assert kvtier("get", "--master", master, on_ssd[0]).stdout == value_for(on_ssd[0])
        with Client(master, timeout=15.0) as kv:
            got = kv.batch_get(on_ssd, with_source=True)
            assert [value == value_for(key) for key, (value, _) in zip(on_ssd, got, strict=True)] == [True] * len(
                on_ssd
            )
            assert kv.get(keys[0]) is None, "a removed object came back after the restart"
            # Every read is an object that was put with exactly its bytes, or a miss.
            for key, value in zip(keys, kv.batch_get(keys), strict=True):
                assert value is None or value == value_for(key), key
            assert kv.batch_put(["after/restart"], [b"new"]) == [Status.OK]
        assert kvtier("get", "--master", master, "after/restart").stdout == b"new"
        assert up.ctrl_c() == 0
    finally:
        up.kill()


@pytest.fixture
def durable(bare_cluster, tmp_path: Path):
    """The cluster fixture's processes with a master that keeps its state: a master and two segments."""
    state_dir = str(tmp_path / "master-state")
    bare_cluster.start_master("--state-dir", state_dir)
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    bare_cluster.state_dir = state_dir
    return bare_cluster


@pytest.mark.slow  # ~6 s each: make test-slow (CI runs it)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_cli_and_library_see_the_same_objects_across_a_master_restart(durable, sig: int):
    master = durable.master_address
    kvtier("put", "--master", master, "--namespace", "team-a", "cli/blob", "-", stdin=value_for("cli/blob", 300_000))
    client = durable.client(namespace="team-a", timeout=15.0)
    keys = [f"lib/{i}" for i in range(40)]
    assert client.batch_put(keys, [value_for(k, 4096) for k in keys], replicas=2) == [Status.OK] * len(keys)
    assert client.batch_remove(keys[:5]) == [Status.OK] * 5
    other = durable.client(namespace="team-b")
    assert other.batch_put(["lib/0"], [b"another namespace"]) == [Status.OK]
    before = kvtier_json("status", "--master", master)

    durable.restart_master("--state-dir", durable.state_dir, sig=sig)

    # The library waits out the master's recovery; the CLI reads what the library wrote and back.
    assert client.get("cli/blob") == value_for("cli/blob", 300_000)
    got = kvtier("get", "--master", master, "--namespace", "team-a", keys[5]).stdout
    assert got == value_for(keys[5], 4096)
    assert [value == value_for(k, 4096) for k, value in zip(keys[5:], client.batch_get(keys[5:]), strict=True)] == [
        True
    ] * 35
    removed = kvtier("get", "--master", master, "--namespace", "team-a", keys[0], check=False)
    assert removed.returncode == 1, "a removed object came back after the restart"
    assert other.get("lib/0") == b"another namespace"
    listing = kvtier_json("keys", "--master", master, "--namespace", "team-a", "--prefix", "lib/")
    assert sorted(k["key"] for k in listing["keys"]) == sorted(keys[5:])
    assert all(k["dram_replicas"] == 2 for k in listing["keys"]), "both replicas were rebuilt"
    after = kvtier_json("status", "--master", master)
    assert after["epoch"] > before["epoch"] and after["role"] == "leader"
    assert after["objects"] == before["objects"] == 1 + 35 + 1

    # And the cluster goes on: a remove through the CLI-visible path, a new put, both seen by both.
    assert client.remove(keys[5]) is True
    assert kvtier("get", "--master", master, "--namespace", "team-a", keys[5], check=False).returncode == 1
    kvtier("put", "--master", master, "--namespace", "team-a", "cli/after", "-", stdin=b"after the restart")
    assert client.get("cli/after") == b"after the restart"
