"""Start-up with defaults and start-up failures, on real processes.

A standalone master started with defaults saves its state in the default directory, so a kill -9
loses nothing; opting out (--state-dir none) is a warning. Every start-up failure of kvtier-master,
kvtier-segment and `kvtier up` is one line on stderr naming the option to change, exit status 2.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.master.config import SERVICE_STATE_ROOT, default_state_dir
from kvtier.segment_server.region import grant_socket_path
from kvtier.segment_server.server import available_memory

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def default_dir(bare_cluster, tmp_path: Path, monkeypatch):
    """The default state directory of this test's (unique) cluster, removed afterwards. As root it is
    /var/lib/kvtier/<cluster>; otherwise XDG_STATE_HOME, pointed at the test's tmp directory."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    root_existed = os.path.exists(SERVICE_STATE_ROOT)
    path = Path(default_state_dir(bare_cluster.cluster_id))
    assert bare_cluster.cluster_id in path.parts and not path.exists()
    yield path
    shutil.rmtree(path, ignore_errors=True)
    if not root_existed:
        try:
            os.rmdir(SERVICE_STATE_ROOT)  # only if this test created it and left it empty
        except OSError:
            pass


def test_a_master_started_with_defaults_loses_nothing_on_kill_9(bare_cluster, default_dir: Path):
    bare_cluster.start_master(default_state_dir=True)
    bare_cluster.start_segment("seg0")
    client = bare_cluster.client()
    for i in range(20):
        client.put(f"k{i}", b"value %d" % i)
    assert (default_dir / "master-state.json").exists(), "the default state directory holds the state"
    bare_cluster.restart_master(default_state_dir=True)  # SIGKILL, then the same defaults
    assert [client.get(f"k{i}") for i in range(20)] == [b"value %d" % i for i in range(20)]


def test_print_config_shows_the_resolved_state_dir(bare_cluster, default_dir: Path):
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.master", "--cluster-id", bare_cluster.cluster_id, "--print-config"],
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 0
    assert f'state_dir = "{default_dir}"' in result.stdout.decode().splitlines()
    with_etcd = subprocess.run(
        [sys.executable, "-m", "kvtier.master", "--etcd", "127.0.0.1:2379", "--print-config"],
        capture_output=True,
        timeout=30,
    )
    assert 'state_dir = ""' in with_etcd.stdout.decode().splitlines(), "with etcd the state lives in etcd"


def test_opting_out_of_the_state_dir_is_a_warning(bare_cluster):
    master = bare_cluster.start_master("--state-dir", "none")
    warnings = [line for line in master.log.read_text().splitlines() if "state_dir=none" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0].upper(), warnings


# ------------------------------------------------------------------ start-up failures


def _one_line_failure(args: list[str], option: str, timeout: float = 45) -> str:
    result = subprocess.run(args, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    stderr = result.stderr.decode()
    assert result.returncode == 2, (result.returncode, stderr)
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert option in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken(tmp_path: Path):
    """A loopback address something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _master(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.master", "--state-dir", str(tmp_path / "state"), *args]


@pytest.mark.parametrize(
    ("flags", "option"),
    [
        (["--listen", "{taken}"], "--listen"),
        (["--listen", "127.0.0.1:0", "--fast-listen", "{taken}"], "--fast-listen"),
        (["--listen", "127.0.0.1:0", "--metrics", "{taken}"], "--metrics"),
    ],
)
def test_master_port_in_use_is_one_line(tmp_path: Path, taken: str, flags: list[str], option: str):
    line = _one_line_failure(_master(tmp_path, *(f.format(taken=taken) for f in flags)), option)
    assert line.startswith("kvtier-master: ") and taken in line and "in use" in line


def test_master_unwritable_state_dir_is_one_line(tmp_path: Path):
    (tmp_path / "file").write_text("not a directory")
    args = [sys.executable, "-m", "kvtier.master", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "file/s")]
    _one_line_failure(args, "--state-dir")


def test_a_second_master_on_a_state_dir_in_use_is_one_line(bare_cluster, tmp_path: Path):
    # given a master serving with its state directory (each master rewrites the whole state file from
    # its own view: two would erase each other's record of the segments they expelled)
    first = bare_cluster.start_master("--state-dir", str(tmp_path / "state"))
    # when a second master starts on the same directory, at another address
    line = _one_line_failure(_master(tmp_path, "--listen", "127.0.0.1:0"), "--state-dir")
    # then it refuses, naming the holder, and the first keeps serving
    assert "in use by another master" in line and f"pid {first.popen.pid}" in line
    client = bare_cluster.client()
    bare_cluster.start_segment("seg0")
    assert bare_cluster.wait_for(lambda: client.batch_put(["k"], [b"v"]) == [0], 10.0, 0.1)
    # and once the first is killed, the directory is free again
    bare_cluster.restart_master("--state-dir", str(tmp_path / "state"))
    assert bare_cluster.wait_for(lambda: client.get("k") == b"v", 20.0, 0.2)


def test_master_secret_file_open_to_everyone_is_one_line(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    secret.chmod(0o644)
    line = _one_line_failure(_master(tmp_path, "--listen", "127.0.0.1:0", "--secret-file", str(secret)), "secret")
    assert "secret_file" in line  # the key; the flag is --secret-file


@pytest.mark.parametrize("etcd", ["etcd://127.0.0.1:{port}/{cluster}", "etcd://no-such-host.invalid:2379/{cluster}"])
def test_master_unreachable_etcd_is_one_line(etcd: str):
    spec = etcd.format(port=free_port(), cluster="default")
    args = [sys.executable, "-m", "kvtier.master", "--listen", "127.0.0.1:0", "--etcd", spec]
    assert "cannot reach etcd" in _one_line_failure(args, "--etcd")


def _segment(bare_cluster, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "kvtier.segment_server",
        "--master", bare_cluster.master_address,
        "--cluster-id", bare_cluster.cluster_id,
        "--dram", "8MiB",
        *args,
    ]  # fmt: skip


@pytest.fixture
def master(bare_cluster):
    bare_cluster.start_master()
    return bare_cluster


@pytest.mark.parametrize(("flag", "option"), [("--listen", "--listen"), ("--metrics", "--metrics")])
def test_segment_port_in_use_is_one_line(master, taken: str, flag: str, option: str):
    line = _one_line_failure(_segment(master, "--name", "s", flag, taken), option)
    assert line.startswith("kvtier-segment: ") and "in use" in line


def test_segment_unwritable_ssd_dir_is_one_line(master, tmp_path: Path):
    (tmp_path / "file").write_text("not a directory")
    _one_line_failure(_segment(master, "--ssd-dir", str(tmp_path / "file/ssd"), "--ssd-size", "32MiB"), "--ssd-dir")


def test_segment_secret_file_open_to_everyone_is_one_line(master, tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    secret.chmod(0o644)
    assert "secret_file" in _one_line_failure(_segment(master, "--secret-file", str(secret)), "secret")


def _more_than_available() -> str:
    """A region size over what the host could give (the region is a memfd: memory, not /dev/shm room)."""
    return f"{available_memory() // (1 << 20) + 1024}MiB"


def test_segment_region_larger_than_memory_is_one_line(master):
    line = _one_line_failure(_segment(master, "--dram", _more_than_available()), "--dram")
    assert "memory available" in line
    assert not list(Path("/dev/shm").glob(f"kvtier.{master.cluster_id}.*")), "nothing is left behind"


def test_segment_grant_socket_in_the_way_is_one_line(master):
    path = Path(grant_socket_path("/dev/shm", master.cluster_id, "blocked"))
    path.mkdir()  # not a socket: never ours to remove
    try:
        _one_line_failure(_segment(master, "--name", "blocked"), "--name")
        assert not list(Path("/dev/shm").glob(f"kvtier.{master.cluster_id}.*.region")), "no region left behind"
    finally:
        path.rmdir()


def test_segment_name_in_use_is_one_line(master):
    master.start_segment("twin")
    _one_line_failure(_segment(master, "--name", "twin"), "--name")


def test_kvtier_up_with_its_port_taken_is_one_line(tmp_path: Path, taken: str):
    args = [sys.executable, "-m", "kvtier.cli.main", "up", "--listen", taken, "--dram", "16MiB", "--ssd", "0"]
    line = _one_line_failure([*args, "--state-dir", str(tmp_path / "state")], "--listen")
    assert taken in line and "in use" in line


def test_kvtier_up_with_a_region_larger_than_memory_is_one_line(tmp_path: Path):
    too_big = _more_than_available()
    args = [sys.executable, "-m", "kvtier.cli.main", "up", "--listen", f"127.0.0.1:{free_port()}", "--ssd", "0"]
    line = _one_line_failure([*args, "--dram", too_big, "--state-dir", str(tmp_path / "state")], "--dram")
    assert line.startswith("kvtier-segment: ")


def test_a_second_live_segment_under_a_mounted_name_is_refused_and_exits_naming_the_option(master, tmp_path: Path):
    """Another host (here another --shm-dir: the region file lock guards one directory) starting a
    segment under a mounted name: refused while that one heartbeats, exit code 2 naming --name. The two
    used to unmount each other at every heartbeat, for good, taking acknowledged puts with them."""
    master.start_segment("seg0", "16MiB")
    client = master.client()
    keys, values = [f"k{i}" for i in range(8)], [os.urandom(10_000) for _ in range(8)]
    assert client.batch_put(keys, values) == [0] * 8
    shm = tempfile.mkdtemp(prefix="kvt-shm-", dir="/tmp")  # short: a Unix socket path lives in it
    try:
        args = _segment(master, "--name", "seg0", "--listen", "127.0.0.1:0", "--shm-dir", shm)
        result = subprocess.run(args, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "--name" in last and "another live segment" in last, last
    assert client.batch_get(keys) == values, "the live segment kept its objects all along"


@pytest.mark.parametrize(
    ("files", "option"),
    [
        ({"--tls-cert-file": "garbage", "--tls-key-file": "garbage"}, "--tls-cert-file / --tls-key-file"),
        ({"--tls-cert-file": "missing", "--tls-key-file": "garbage"}, "--tls-cert-file"),
        ({"--ready-file": "in-a-file"}, "--ready-file"),
        ({"--history-log": "in-a-file"}, "--history-log"),
    ],
    ids=["garbage-cert", "missing-cert", "ready-file", "history-log"],
)
def test_master_tls_files_and_output_files_are_checked_at_start_one_line(tmp_path: Path, files: dict, option: str):
    """A garbage certificate was reported as "cannot listen: change --listen" after gRPC C-core lines; a
    missing key file was a traceback; an unwritable --ready-file a traceback after "master serving"."""
    (tmp_path / "garbage").write_text("not a PEM file\n")
    (tmp_path / "afile").write_text("")
    paths = {"garbage": tmp_path / "garbage", "missing": tmp_path / "missing.pem", "in-a-file": tmp_path / "afile/x"}
    args = [item for flag, what in files.items() for item in (flag, str(paths[what]))]
    _one_line_failure(_master(tmp_path, "--listen", "127.0.0.1:0", *args), option)


def test_segment_garbage_ca_file_and_a_metrics_address_equal_to_listen_are_one_line(master, tmp_path: Path):
    """A garbage CA made the segment retry its master for ever; --metrics equal to --listen was found
    only after the mount, as a log line."""
    (tmp_path / "ca.pem").write_text("not a PEM file\n")
    _one_line_failure(_segment(master, "--tls-ca-file", str(tmp_path / "ca.pem")), "--tls-ca-file")
    port = "127.0.0.1:47979"
    _one_line_failure(_segment(master, "--listen", port, "--metrics", port), "--metrics")


def test_a_holder_stopped_for_a_few_heartbeats_keeps_its_name_and_objects_from_a_duplicate(master):
    """A duplicate retrying the name took it once the holder had been silent three heartbeat intervals:
    a holder stopped for a moment (SIGSTOP, a GC pause, a frozen VM) lost every object for good."""
    import signal
    import time

    holder = master.start_segment("seg0", "16MiB")
    client = master.client()
    keys, values = [f"k{i}" for i in range(8)], [os.urandom(10_000) for _ in range(8)]
    assert client.batch_put(keys, values) == [0] * 8
    shm = tempfile.mkdtemp(prefix="kvt-shm-", dir="/tmp")
    try:
        args = _segment(master, "--name", "seg0", "--listen", "127.0.0.1:0", "--shm-dir", shm)
        duplicate = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        time.sleep(2.0)  # it is being refused
        holder.popen.send_signal(signal.SIGSTOP)
        time.sleep(6 * master.heartbeat_interval_s)  # well under segment_ttl_s
        holder.popen.send_signal(signal.SIGCONT)
        try:
            assert duplicate.wait(timeout=30) == 2, duplicate.stderr.read().decode()
        finally:
            duplicate.kill()
            duplicate.wait()
            duplicate.stderr.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert holder.popen.poll() is None, "the holder still serves"
    assert client.batch_get(keys) == values
