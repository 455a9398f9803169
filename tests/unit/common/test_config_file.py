"""Config files: TOML merged under environment and flags, validated with one clear line, printed back."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.config import parse_args as master_args
from kvtier.segment_server.config import SegmentConfig
from kvtier.segment_server.config import parse_args as segment_args


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for cls, prefix in ((MasterConfig, "KVTIER_MASTER_"), (SegmentConfig, "KVTIER_SEGMENT_")):
        monkeypatch.delenv(f"{prefix}CONFIG", raising=False)
        for field in dataclasses.fields(cls):
            monkeypatch.delenv(f"{prefix}{field.name.upper()}", raising=False)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "service.toml"
    path.write_text(text)
    return str(path)


def _exit_message(capsys, parse, argv) -> str:
    with pytest.raises(SystemExit) as excinfo:
        parse(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage dump
    return err


def test_file_values_are_used_and_converted(tmp_path):
    path = _write(tmp_path, 'listen = "127.0.0.2:6000"\nlease_s = 4\nmax_batch_keys = 500\nfast_listen = "off"\n')
    config = master_args(["--config", path])
    assert config.listen == "127.0.0.2:6000"
    assert config.lease_s == 4.0 and isinstance(config.lease_s, float)
    assert config.max_batch_keys == 500
    assert config.fast_listen == "off"
    assert config.segment_ttl_s == MasterConfig().segment_ttl_s  # untouched keys keep their defaults


def test_environment_beats_file_and_flags_beat_both(tmp_path, monkeypatch):
    path = _write(tmp_path, 'lease_s = 4\ncluster_id = "from-file"\nput_timeout_s = 9\n')
    monkeypatch.setenv("KVTIER_MASTER_LEASE_S", "5")
    monkeypatch.setenv("KVTIER_MASTER_CLUSTER_ID", "from-env")
    config = master_args(["--config", path, "--cluster-id", "from-flag"])
    assert (config.put_timeout_s, config.lease_s, config.cluster_id) == (9.0, 5.0, "from-flag")


def test_config_path_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_SEGMENT_CONFIG", _write(tmp_path, f'dram = "64MiB"\nshm_dir = "{tmp_path}"\n'))
    config = segment_args([])
    assert config.dram_bytes == 64 << 20
    assert config.shm_dir == str(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("lease-s = 1\n", "did you mean 'lease_s'"),
        ('lease_s = "soon"\n', "lease_s must be a number, got 'soon'"),
        ("max_batch_keys = 1.5\n", "max_batch_keys must be a whole number"),
        ("listen = 6000\n", "listen: invalid address"),  # a number is taken as text, then validated
        ('listen = "0.0.0.0:6000"\n', "set advertise"),  # every interface: no address to advertise
        ('etcd = "http://x"\n', "etcd: invalid address"),
        ('metrics = "nohostport"\n', "metrics: invalid address"),
        ("lease_s = 0\n", "lease_s must be positive"),
        ('log_level = "LOUD"\n', "log_level must be one of"),
        ("lease_s = \n", "is not valid TOML"),
        ("[master]\nlease_s = 1\n", "unknown key 'master'"),  # keys are top level
    ],
)
def test_bad_files_exit_2_naming_the_problem(tmp_path, capsys, text, expected):
    err = _exit_message(capsys, master_args, ["--config", _write(tmp_path, text)])
    assert err.startswith("kvtier-master: error:")
    assert expected in err


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    err = _exit_message(capsys, segment_args, ["--config", str(tmp_path / "nope.toml")])
    assert "cannot read config file" in err and "nope.toml" in err


def test_print_config_round_trips(tmp_path, capsys):
    path = _write(tmp_path, f'dram = "8MiB"\nshm_dir = "{tmp_path}"\noffload = false\nssd_threads = 2\n')
    with pytest.raises(SystemExit) as excinfo:
        segment_args(["--config", path, "--listen", "127.0.0.1:7000", "--print-config"])
    assert excinfo.value.code == 0
    printed = capsys.readouterr().out
    assert 'listen = "127.0.0.1:7000"' in printed
    assert "offload = false" in printed
    # What --print-config prints is a config file that gives the same config back.
    again = _write(tmp_path, printed)
    config = segment_args(["--config", again])
    expected = segment_args(["--config", path, "--listen", "127.0.0.1:7000"])
    assert dataclasses.replace(config, name="") == dataclasses.replace(expected, name="")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('dram = "lots"\n', "dram: invalid size"),
        ('ssd_read_buffers = "x"\n', "ssd_read_buffers: invalid size"),
        ('listen = "0.0.0.0:0"\n', "set advertise"),
        ('listen = "0.0.0.0:0"\nadvertise = "node-1:7000"\n', "without a port"),
        ('master = "etcd://h:1"\n', "master:"),
    ],
)
def test_bad_segment_values_name_their_key(tmp_path, capsys, text, expected):
    path = _write(tmp_path, f'shm_dir = "{tmp_path}"\n{text}')
    err = _exit_message(capsys, segment_args, ["--config", path])
    assert expected in err


def test_a_wildcard_listener_advertises_the_given_host(tmp_path):
    insecure = ["--allow-insecure", "true"]  # reachable from other machines: a secret, or this
    config = segment_args(
        ["--shm-dir", str(tmp_path), "--listen", "0.0.0.0:0", "--advertise", "node-1.example", *insecure]
    )
    assert config.advertise == "node-1.example"
    master = master_args(["--listen", "[::]:7000", "--advertise", "master-0.kvtier:7000", *insecure])
    assert master.advertise == "master-0.kvtier:7000"
