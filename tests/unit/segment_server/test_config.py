"""SegmentConfig validation, sizes, defaults and the segment server's flag/env parsing."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.segment_server.config import MIN_DRAM, SegmentConfig, parse_args


@pytest.fixture(autouse=True)
def _no_segment_env(monkeypatch):
    for name in [f.name for f in dataclasses.fields(SegmentConfig)]:
        monkeypatch.delenv(f"KVTIER_SEGMENT_{name.upper()}", raising=False)


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)


@pytest.mark.parametrize(
    ("dram", "expected"),
    [
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("1MiB", MIN_DRAM),
        ("1048576", 1 << 20),
        ("2000000", 2_000_000),
        ("1.5GB", 1_500_000_000),
        ("64 mib", 64 << 20),
    ],
)
def test_dram_sizes(shm, dram, expected):
    config = SegmentConfig(dram=dram, shm_dir=shm).validate()
    assert config.dram_bytes == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dram": "lots"}, "invalid size"),
        ({"dram": "512XB"}, "invalid size"),
        ({"dram": "-1GiB"}, "invalid size"),
        ({"dram": ""}, "invalid size"),
        ({"dram": "1048575"}, "at least 1MiB"),
        ({"dram": "0.5MiB"}, "at least 1MiB"),
        ({"master": "nohost"}, "invalid address"),
        ({"listen": "127.0.0.1:99999"}, "invalid address"),
        ({"cluster_id": ""}, "cluster_id"),
        ({"cluster_id": "a/b"}, "cluster_id"),
        ({"cluster_id": "a.b"}, "cluster_id"),
        ({"cluster_id": "c" * 65}, "cluster_id"),
        ({"name": "a/b"}, "name"),
        ({"name": "n" * 121}, "name"),
        ({"ssd_verify_rate": "fast"}, "ssd_verify_rate.*invalid size"),
        ({"ssd_verify_rate": "-1MiB"}, "ssd_verify_rate.*invalid size"),
        ({"ssd_read_coalesce": "60KiB"}, "ssd-read-coalesce"),
        ({"ssd_read_coalesce": "1"}, "ssd-read-coalesce"),
        ({"ssd_read_coalesce": "many"}, "invalid size"),
    ],
)
def test_validate_rejects_bad_values(shm, changes, message):
    with pytest.raises(ValueError, match=message):
        SegmentConfig(**{"shm_dir": shm, **changes}).validate()


def test_shm_dir_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        SegmentConfig(shm_dir=str(tmp_path / "missing")).validate()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        SegmentConfig(shm_dir=str(tmp_path / "file")).validate()


def test_with_defaults_fills_a_name_once(shm):
    config = SegmentConfig(shm_dir=shm).validate().with_defaults()
    assert config.name
    assert "/" not in config.name
    assert config.with_defaults() is config
    named = SegmentConfig(name="seg0", shm_dir=shm)
    assert named.with_defaults() is named


def test_parse_args_reads_flags(shm):
    config = parse_args(["--dram", "64MiB", "--shm-dir", shm, "--name", "seg0", "--cluster-id", "c1"])
    assert config.dram_bytes == 64 << 20
    assert config.name == "seg0"
    assert config.cluster_id == "c1"
    assert config.shm_dir == shm


def test_parse_args_fills_a_default_name(shm):
    assert parse_args(["--shm-dir", shm]).name


def test_environment_fills_values_and_flags_win(monkeypatch, shm):
    monkeypatch.setenv("KVTIER_SEGMENT_DRAM", "2MiB")
    monkeypatch.setenv("KVTIER_SEGMENT_SHM_DIR", shm)
    monkeypatch.setenv("KVTIER_SEGMENT_NAME", "env-name")
    config = parse_args(["--name", "flag-name"])
    assert config.dram_bytes == 2 << 20
    assert config.name == "flag-name"


@pytest.mark.parametrize(
    "argv",
    [
        ["--dram", "lots"],
        ["--dram", "1KiB"],
        ["--master", "localhost"],
        ["--listen", "host:port"],
        ["--name", "a/b"],
        ["--shm-dir", "/nonexistent/kvtier-unit"],
        ["--bogus"],
    ],
)
def test_parse_args_exits_2_on_invalid_flags(shm, argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        parse_args(["--shm-dir", shm, *argv])
    assert excinfo.value.code == 2
    assert "kvtier-segment: error:" in capsys.readouterr().err


def test_parse_args_exits_2_on_invalid_environment(monkeypatch, shm, capsys):
    monkeypatch.setenv("KVTIER_SEGMENT_DRAM", "garbage")
    with pytest.raises(SystemExit) as excinfo:
        parse_args(["--shm-dir", shm])
    assert excinfo.value.code == 2
    assert "invalid size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("coalesce", "buffers"),
    [("0", "64MiB"), ("64KiB", "64MiB"), ("4MiB", "64MiB"), ("1GiB", "64MiB"), ("4MiB", "1MiB")],
)
def test_ssd_read_coalesce_is_off_or_at_least_64kib_whatever_the_read_buffers(shm, coalesce, buffers):
    # Above half of --ssd-read-buffers the reader caps it there: the default stays valid with the
    # smallest pool (1MiB).
    SegmentConfig(shm_dir=shm, ssd_read_coalesce=coalesce, ssd_read_buffers=buffers).validate()
