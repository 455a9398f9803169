"""MasterConfig validation and the master's flag/env parsing."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.master.config import MasterConfig, parse_args


@pytest.fixture(autouse=True)
def _no_master_env(monkeypatch):
    for name in [f.name for f in dataclasses.fields(MasterConfig)]:
        monkeypatch.delenv(f"KVTIER_MASTER_{name.upper()}", raising=False)


def test_defaults_are_valid():
    config = MasterConfig()
    assert config.validate() is config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"listen": "no-port"}, "invalid address"),
        ({"listen": "127.0.0.1:65536"}, "invalid address"),
        ({"listen": "127.0.0.1:http"}, "invalid address"),
        ({"segment_ttl_s": 0.0}, "segment_ttl_s must be positive"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s must be positive"),
        ({"lease_s": 0.0}, "lease_s must be positive"),
        ({"put_timeout_s": -0.5}, "put_timeout_s must be positive"),
        ({"tick_interval_s": 0.0}, "tick_interval_s must be positive"),
        ({"lease_s": 1e7}, "at most 2592000 s"),  # 32-bit ms on the wire: every read failed INTERNAL
        ({"segment_ttl_s": float("inf")}, "segment_ttl_s must be positive and at most"),  # every mount failed
        ({"lease_s": float("nan")}, "lease_s must be positive"),
        ({"clock_skew_tolerance_s": 2.0}, "clock_skew_tolerance_s must be below 2 s"),
        ({"segment_ttl_s": 1.9, "heartbeat_interval_s": 1.0}, "at least twice"),
        ({"max_batch_keys": 0}, "max_batch_keys"),
        ({"alignment": 0}, "power of two"),
        ({"alignment": 48}, "power of two"),
        ({"cluster_id": ""}, "cluster_id"),
        ({"cluster_id": "a/b"}, "cluster_id"),
        ({"cluster_id": "a.b"}, "cluster_id"),
        ({"cluster_id": "x" * 65}, "cluster_id"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs must be at least 1"),
        ({"max_concurrent_streams": 0}, "max_concurrent_streams must be at least 1"),
        ({"idle_timeout_s": 0.0}, "idle_timeout_s must be positive"),
        ({"request_timeout_s": -1.0}, "request_timeout_s must be positive"),
        ({"max_message_size": "lots"}, "max_message_size: invalid size"),
        ({"max_message_size": "512MiB"}, "between 64KiB and 256MiB"),
        ({"max_message_size": "1KiB"}, "between 64KiB and 256MiB"),
        ({"max_message_size": "64MiB", "max_buffered_size": "32MiB"}, "at least one message"),
    ],
)
def test_validate_rejects_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        MasterConfig(**changes).validate()


@pytest.mark.parametrize(
    "changes",
    [
        {"segment_ttl_s": 2.0, "heartbeat_interval_s": 1.0},
        {"alignment": 1},
        {"alignment": 4096},
        {"cluster_id": "x" * 64},
        {"listen": "[::1]:0"},
        {"listen": ":50051"},
        {"max_batch_keys": 1},
        {"max_message_size": "64KiB", "max_buffered_size": "64KiB"},
        {"max_message_size": "256MiB", "max_buffered_size": "256MiB"},
    ],
)
def test_validate_accepts_boundary_values(changes):
    config = MasterConfig(**changes)
    config.validate()
    assert {name: getattr(config, name) for name in changes} == changes, "validate() keeps the values"
    # and the same values given as flags arrive unchanged in the config the master runs with
    argv = [arg for name, value in changes.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    parsed = parse_args(argv)
    assert {name: getattr(parsed, name) for name in changes} == changes
    # every other field is the default (state_dir resolved to its default directory as at start)
    assert parsed == dataclasses.replace(MasterConfig(), **changes).with_defaults()


def test_parse_args_reads_flags():
    config = parse_args(["--listen", "127.0.0.3:6000", "--lease-s", "2.5", "--alignment", "4096", "--cluster-id", "c"])
    assert config.listen == "127.0.0.3:6000"
    assert config.lease_s == 2.5
    assert config.alignment == 4096
    assert config.cluster_id == "c"
    assert config.segment_ttl_s == MasterConfig().segment_ttl_s


def test_environment_fills_values_and_flags_win(monkeypatch):
    monkeypatch.setenv("KVTIER_MASTER_LEASE_S", "3")
    monkeypatch.setenv("KVTIER_MASTER_CLUSTER_ID", "from-env")
    config = parse_args(["--cluster-id", "from-flag"])
    assert config.lease_s == 3.0
    assert isinstance(config.lease_s, float)
    assert config.cluster_id == "from-flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--lease-s", "abc"],  # not a number
        ["--alignment", "1.5"],  # not an int
        ["--alignment", "48"],  # fails validation
        ["--lease-s", "0"],
        ["--segment-ttl-s", "1", "--heartbeat-interval-s", "1"],
        ["--listen", "localhost"],
        ["--cluster-id", "a/b"],
        ["--no-such-flag", "1"],
    ],
)
def test_parse_args_exits_2_on_invalid_flags(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        parse_args(argv)
    assert excinfo.value.code == 2
    assert "kvtier-master: error:" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value"), [("LEASE_S", "soon"), ("ALIGNMENT", "48"), ("MAX_BATCH_KEYS", "many")])
def test_parse_args_exits_2_on_invalid_environment(monkeypatch, capsys, name, value):
    monkeypatch.setenv(f"KVTIER_MASTER_{name}", value)
    with pytest.raises(SystemExit) as excinfo:
        parse_args([])
    assert excinfo.value.code == 2
    assert "kvtier-master: error:" in capsys.readouterr().err


def test_a_misspelt_environment_variable_is_an_error_naming_the_right_one(monkeypatch, capsys):
    """KVTIER_MASTER_SEGMENT_TTL (no _S) was ignored without a word, while a misspelt TOML key fails."""
    monkeypatch.setenv("KVTIER_MASTER_SEGMENT_TTL", "3")
    with pytest.raises(SystemExit) as excinfo:
        parse_args([])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "unknown environment variable KVTIER_MASTER_SEGMENT_TTL" in err and "KVTIER_MASTER_SEGMENT_TTL_S" in err


def test_a_tenant_with_the_cluster_secret_is_refused(tmp_path):
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\nsecret_file = "{secret}"\nnamespaces = ["alice/*"]\n')
    with pytest.raises(ValueError, match="tenant 'alice' has the cluster's secret"):
        MasterConfig(secret_file=str(secret), tenants_file=str(tenants)).validate()


def test_default_state_dir_is_per_cluster_under_var_lib_when_writable_else_xdg(monkeypatch, tmp_path):
    from kvtier.master import config as master_config

    monkeypatch.setattr(master_config, "_writable", lambda path: True)
    assert master_config.default_state_dir("prod", {}) == "/var/lib/kvtier/prod"
    monkeypatch.setattr(master_config, "_writable", lambda path: False)
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    assert master_config.default_state_dir("prod", env) == str(tmp_path / "xdg" / "kvtier" / "prod")
    for xdg in ("", "relative/path"):  # unset or relative: ~/.local/state (the XDG spec)
        expected = str(tmp_path / "home" / ".local" / "state" / "kvtier" / "prod")
        assert master_config.default_state_dir("prod", {**env, "XDG_STATE_HOME": xdg}) == expected


def test_writable_looks_at_the_nearest_existing_directory(tmp_path):
    from kvtier.master.config import _writable

    assert _writable(tmp_path / "a" / "b")
    (tmp_path / "file").write_text("")
    assert not _writable(tmp_path / "file" / "b")


def test_an_empty_state_dir_resolves_to_the_default_but_none_and_etcd_do_not(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    from kvtier.master.config import default_state_dir

    resolved = MasterConfig(cluster_id="c1").validate().with_defaults()
    assert resolved.state_dir == default_state_dir("c1") and resolved.saves_state_to == resolved.state_dir
    opted_out = MasterConfig(state_dir="none").validate().with_defaults()
    assert opted_out.state_dir == "none" and opted_out.saves_state_to == ""
    ha = MasterConfig(etcd="127.0.0.1:2379").validate().with_defaults()
    assert ha.state_dir == "" and ha.saves_state_to == ""
    assert MasterConfig(etcd="127.0.0.1:2379", state_dir="none").validate().saves_state_to == ""
    with pytest.raises(ValueError, match="state_dir is for a standalone master"):
        MasterConfig(etcd="127.0.0.1:2379", state_dir="/x").validate()
    assert parse_args(["--cluster-id", "c2"]).state_dir == default_state_dir("c2")


def _credentials(tmp_path, text: str, mode: int):
    path = tmp_path / "etcd.credentials"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(
    ("text", "mode", "message"),
    [
        ("root:pw\n", 0o644, "readable by others"),
        ("no-colon\n", 0o600, "USER:PASSWORD"),
        (":pw\n", 0o600, "USER:PASSWORD"),
        ("root:\n", 0o600, "USER:PASSWORD"),
    ],
)
def test_etcd_credentials_file_must_be_private_and_hold_user_password(tmp_path, text, mode, message):
    config = MasterConfig(etcd="127.0.0.1:2379", etcd_credentials_file=_credentials(tmp_path, text, mode))
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_etcd_credentials_keep_colons_in_the_password(tmp_path):
    from kvtier.common.config import read_credentials

    path = _credentials(tmp_path, "kvtier:a:b:c\n", 0o640)  # group-readable: a Kubernetes fsGroup Secret
    assert MasterConfig(etcd="127.0.0.1:2379", etcd_credentials_file=path).validate()
    assert read_credentials(path) == ("kvtier", "a:b:c")


def test_etcd_security_options_need_etcd_and_go_together(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="need etcd"):
        MasterConfig(etcd_ca_file=str(pem)).validate()
    with pytest.raises(ValueError, match="go together"):
        MasterConfig(etcd="127.0.0.1:2379", etcd_cert_file=str(pem)).validate()
    with pytest.raises(ValueError, match="needs etcd_ca_file"):
        MasterConfig(etcd="127.0.0.1:2379", etcd_cert_file=str(pem), etcd_key_file=str(pem)).validate()
    ok = MasterConfig(etcd="127.0.0.1:2379", etcd_ca_file=str(pem), etcd_cert_file=str(pem), etcd_key_file=str(pem))
    assert ok.validate().etcd_security.tls


def test_a_put_backpressure_past_half_the_write_grant_is_a_warning_at_start(caplog):
    """A put waits for offload at most half its write grant (min(put_timeout_s, lease_s) / 2): a
    longer put_backpressure_s was cut silently, and the operator believed puts waited that long."""
    import logging

    from kvtier.master.server import check_startup

    config = MasterConfig(listen="127.0.0.1:0", state_dir="none", put_backpressure_s=20.0, lease_s=10.0)
    with caplog.at_level(logging.WARNING, logger="kvtier.master.server"):
        check_startup(config.validate())
    [warning] = [r.getMessage() for r in caplog.records if "put_backpressure_s" in r.getMessage()]
    assert "5" in warning and "lease_s" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.master.server"):
        check_startup(MasterConfig(listen="127.0.0.1:0", state_dir="none", put_backpressure_s=4.0).validate())
        dropping = MasterConfig(listen="127.0.0.1:0", state_dir="none", put_backpressure_s=20.0, lease_s=10.0)
        check_startup(dataclasses.replace(dropping, dram_full_policy="drop").validate())  # puts never wait
    assert not [r for r in caplog.records if "put_backpressure_s" in r.getMessage()]
