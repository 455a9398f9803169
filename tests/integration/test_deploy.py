"""deploy/ against the real services: systemd units, example configs, compose, Kubernetes, Dockerfile, dashboard.

Every config a deployment file hands to `kvtier-master` / `kvtier-segment` (a TOML file, plus the
environment and flags of a compose service or a Kubernetes container) goes through the real
`--print-config`; sizes written in units, limits and volumes are checked against the configs they
serve; the dashboard's metric names against what a running cluster exports. External tools
(`systemd-analyze`, `docker compose`, `kubectl kustomize`) run where they are installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.common.config import EtcdSecurity
from kvtier.common.etcd_client import EtcdClient
from kvtier.common.units import parse_size
from kvtier.master.config import SERVICE_STATE_ROOT, MasterConfig, default_state_dir
from kvtier.proto.region import HEADER_SIZE
from kvtier.segment_server.config import SegmentConfig
from kvtier.segment_server.server import FD_RESERVE, max_buckets
from tests.capability import require
from tests.etcd import ETCD_BINARY, EtcdServer, etcd_available, require_etcd
from tests.integration.test_alerts import rule_metric_names
from tests.integration.test_tls import pki  # noqa: F401  (the fixture)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BIN = Path(sys.executable).parent  # the venv's console scripts: kvtier-master, kvtier-segment
SERVICES = {"kvtier-master": (MasterConfig, "KVTIER_MASTER_"), "kvtier-segment": (SegmentConfig, "KVTIER_SEGMENT_")}
MiB = 1 << 20
HEADROOM = 512 * MiB  # deploy/README.md: a segment's memory = dram + ssd_read_buffers + ~512MiB

# ------------------------------------------------------------------ helpers


# What a deployment gives a service as its cluster secret, stood in for on this machine: a secret
# file path that exists only on a real host (/etc/kvtier/cluster.secret, a mounted Kubernetes
# Secret, a compose secret in /run/secrets, a systemd credential) is replaced by this one.
TEST_SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module", autouse=True)
def _secret_file(tmp_path_factory):
    global TEST_SECRET_FILE
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    path.write_text(TEST_SECRET)
    path.chmod(0o600)
    TEST_SECRET_FILE = str(path)


TEST_SECRET_FILE = ""

# Certificates and keys a deployment mounts (etcd client certificates, the master's TLS files) are
# stood in for the same way, by a test CA's files (tests/integration/test_tls.py's pki).
TEST_PKI: Path = Path()
PEM_STAND_INS = {
    "etcd_ca_file": "ca.pem",
    "etcd_cert_file": "client.pem",
    "etcd_key_file": "client.key",
    "tls_ca_file": "ca.pem",
    "tls_client_ca_file": "ca.pem",
    "tls_cert_file": "server.pem",
    "tls_key_file": "server.key",
}
HOST_FILES = {"secret_file", *PEM_STAND_INS}  # options naming a file on the real host


@pytest.fixture(scope="module", autouse=True)
def _test_pki(request):
    """The test CA where openssl makes one (.ci/run installs it); without, configs naming PEM files fail."""
    global TEST_PKI
    if shutil.which("openssl") is not None:
        TEST_PKI = request.getfixturevalue("pki")


def _configured(service: str, config: Path | None, env: dict[str, str], key: str) -> str | None:
    name = env.get(f"{SERVICES[service][1]}{key.upper()}")
    if name is None and config is not None:
        name = tomllib.loads(config.read_text()).get(key)
    return name


def _missing_secret_file(service: str, config: Path | None, env: dict[str, str]) -> bool:
    name = _configured(service, config, env, "secret_file")
    return bool(name) and not os.path.exists(name)


def _pem_stand_ins(service: str, config: Path | None, env: dict[str, str], flags: tuple[str, ...]) -> list[str]:
    """Flags replacing every configured PEM file that exists only on a real host by the test CA's."""
    out = []
    for key, stand_in in PEM_STAND_INS.items():
        flag = "--" + key.replace("_", "-")
        name = _configured(service, config, env, key)
        if name and not os.path.exists(name) and flag not in flags:
            out += [flag, str(TEST_PKI / stand_in)]
    return out


def print_config(
    service: str, config: Path | None, env: dict[str, str] | None = None, *flags: str
) -> subprocess.CompletedProcess:
    """`<service> --config F --print-config` as a subprocess, with no KVTIER_* variable of ours leaking in."""
    prefix = SERVICES[service][1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(prefix) and k != "KVTIER_SECRET"}
    env = dict(env or {})
    if _missing_secret_file(service, config, env) and "--secret-file" not in flags:
        flags = (*flags, "--secret-file", TEST_SECRET_FILE)
    flags = (*flags, *_pem_stand_ins(service, config, env, flags))
    args = [str(BIN / service), *(["--config", str(config)] if config else []), *flags, "--print-config"]
    return subprocess.run(args, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60)


def effective(service: str, config: Path | None, env: dict[str, str] | None = None, *flags: str) -> dict:
    """The effective config the service would run with; fails the test with its one-line error otherwise.

    The service ignores environment variables that name no option, so a misspelt one is caught here."""
    cls, prefix = SERVICES[service]
    options = {f.name for f in dataclasses.fields(cls)} | {"config"}
    for name in env or {}:
        assert name != "KVTIER_SECRET", "a secret is never passed through the environment: secret_file"
        assert name.startswith(prefix) and name[len(prefix) :].lower() in options, f"{service} has no {name}"
    result = print_config(service, config, env, *flags)
    assert result.returncode == 0, f"{service} rejected {config} env={env}: {result.stderr.strip()}"
    return tomllib.loads(result.stdout)


def service_of(path: Path) -> str:
    return "kvtier-master" if path.name.startswith("master") else "kvtier-segment"


def segment_memory(cfg: dict) -> int:
    """What a segment needs in its memory cgroup: the region (tmpfs, charged to it), read buffers, headroom."""
    return parse_size(cfg["dram"]) + parse_size(cfg["ssd_read_buffers"]) + HEADROOM


def k8s_quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def docker_size(text: str | int) -> int:
    """Compose byte values: b, k, m, g are powers of 1024."""
    text = str(text).lower()
    factors = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(text[:-1]) * factors[text[-1]] if text[-1] in factors else int(text)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def example_tomls() -> list[Path]:
    return sorted(DEPLOY.rglob("*.toml"))


# ------------------------------------------------------------------ example configs


@pytest.mark.parametrize("path", example_tomls(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_example_config_is_accepted_as_written(path: Path):
    """Each TOML file in deploy/ loads, and every key it sets is in the effective config unchanged."""
    written = tomllib.loads(path.read_text())
    assert written, f"{path} sets nothing"
    cfg = effective(service_of(path), path)
    for key, value in written.items():
        if key in HOST_FILES and not os.path.exists(value):
            continue  # a path on the real host, stood in for here (print_config)
        assert cfg[key] == value, f"{path}: {key} = {value!r} became {cfg[key]!r}"


@pytest.mark.parametrize("name", ["master.toml", "master-ha.toml", "segment.toml"])
def test_reference_configs_document_every_key_and_their_defaults_are_real(name: str, tmp_path: Path):
    """deploy/config/ is the reference: every option appears (set, or as a commented "# key = default"),
    each under a comment, and every commented default, uncommented, is accepted and is the real default."""
    path = DEPLOY / "config" / name
    service = service_of(path)
    cls = SERVICES[service][0]
    key_line = re.compile(r"^(#\s*)?([a-z_]+)\s*=\s*(.+)$")
    lines = path.read_text().splitlines()
    keys, defaults = set(), {}
    for i, line in enumerate(lines):
        match = key_line.match(line)
        if not match:
            continue
        commented, key = bool(match.group(1)), match.group(2)
        keys.add(key)
        if commented:
            defaults[key] = tomllib.loads(f"{key} = {match.group(3)}")[key]
        # the block of lines this key belongs to starts with a prose comment
        j = i
        while j > 0 and lines[j - 1].strip() and key_line.match(lines[j - 1]):
            j -= 1
        above = lines[j - 1] if j > 0 else ""
        assert above.startswith("#") and not key_line.match(above), f"{name}:{i + 1}: {key} has no comment above it"
    fields = {f.name for f in dataclasses.fields(cls)}
    assert keys <= fields, f"{name} names options that do not exist: {sorted(keys - fields)}"
    assert fields <= keys, f"{name} does not document: {sorted(fields - keys)}"
    uncommented = tmp_path / name
    uncommented.write_text(re.sub(r"(?m)^#\s*([a-z_]+\s*=)", r"\1", path.read_text()))
    cfg = effective(service, uncommented)
    real_defaults = cls()
    for key, value in defaults.items():
        # an empty state_dir of a standalone master is resolved to its default directory
        resolved = default_state_dir(cfg["cluster_id"]) if key == "state_dir" and not cfg.get("etcd") else value
        assert cfg[key] == resolved, f"{name}: commented {key} = {value!r} was not taken"
        assert value == getattr(real_defaults, key), (
            f"{name}: '# {key} = {value!r}' claims a default, the real one is {getattr(real_defaults, key)!r}"
        )


@pytest.mark.parametrize(
    ("service", "text", "key"),
    [
        ("kvtier-segment", 'dramm = "1GiB"\n', "dramm"),  # unknown key
        ("kvtier-segment", 'dram = "lots"\n', "dram"),  # not a size
        ("kvtier-segment", 'ssd_queue_depth = "deep"\n', "ssd_queue_depth"),  # wrong type
        ("kvtier-segment", "ssd_low_watermark = 0.99\n", "ssd_low_watermark"),  # out of range
        ("kvtier-master", 'listen-address = "0.0.0.0:50051"\n', "listen-address"),  # unknown key
        ("kvtier-master", "high_watermark = 1.5\n", "high_watermark"),  # out of range
        ("kvtier-master", 'segment_ttl_s = "ten"\n', "segment_ttl_s"),  # wrong type
        ("kvtier-master", 'listen = "nohostport"\n', "listen"),  # not HOST:PORT
    ],
)
def test_a_bad_config_exits_2_with_one_line_naming_the_key(service: str, text: str, key: str, tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = print_config(service, path)
    assert result.returncode == 2, f"{text!r} was accepted: {result.stdout}"
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"not one line: {result.stderr}"
    assert key in lines[0], f"the error does not name {key!r}: {lines[0]}"


# ------------------------------------------------------------------ systemd


def read_unit(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> values in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def one(unit: dict[str, list[str]], key: str) -> str:
    values = unit.get(f"Service.{key}") or unit.get(key)
    assert values, f"{key} is not set"
    return values[-1]


def systemd_bytes(text: str) -> int:
    factors = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(text[:-1]) * factors[text[-1]] if text[-1] in factors else int(text)


UNITS = DEPLOY / "systemd"


def test_units_pass_systemd_analyze_verify(tmp_path: Path):
    """Verified as installed, except that ExecStart points at this venv's binaries (verify checks they exist).
    Any diagnostic about the units fails the test, warnings included ("Unknown key", "Invalid ...")."""
    require("systemd-analyze", shutil.which("systemd-analyze") is not None, "apt-get install systemd (.ci/run does)")

    def verify(directory: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                "systemd-analyze",
                "verify",
                "--man=no",
                "--generators=no",
                str(directory / "kvtier-master.service"),
                str(directory / "kvtier-segment@a.service"),  # an instance of the template, as enabled
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def install(directory: Path, break_it: bool = False) -> None:
        directory.mkdir()
        for unit in UNITS.glob("*.service"):
            text = unit.read_text()
            assert "ExecStart=/opt/kvtier/bin/" in text, f"{unit.name}: ExecStart moved, update this test"
            text = re.sub(r"(?m)^(Exec\w+=-?)/opt/kvtier/bin/", rf"\g<1>{BIN}/", text)
            if break_it:
                text = text.replace("TasksMax=", "TasksMaxx=")
            (directory / unit.name).write_text(text)

    install(tmp_path / "units")
    result = verify(tmp_path / "units")
    diagnostics = [line for line in (result.stdout + result.stderr).splitlines() if "kvtier" in line]
    assert result.returncode == 0 and not diagnostics, f"systemd-analyze verify:\n{result.stdout}{result.stderr}"
    # The same check on a broken copy must complain, or it proves nothing here.
    install(tmp_path / "broken", break_it=True)
    broken = verify(tmp_path / "broken")
    assert "TasksMaxx" in broken.stdout + broken.stderr, "systemd-analyze verify no longer reports unknown keys"


def test_units_are_hardened_and_sized_from_their_configs():
    master = read_unit(UNITS / "kvtier-master.service")
    segment = read_unit(UNITS / "kvtier-segment@.service")
    for name, unit in (("master", master), ("segment", segment)):
        assert one(unit, "User") == one(unit, "Group") == "kvtier", name
        assert "Service.DynamicUser" not in unit, f"{name}: files need a stable owner"
        for key, value in {
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "NoNewPrivileges": "yes",
            "ProtectKernelTunables": "yes",
            "ProtectKernelModules": "yes",
            "ProtectKernelLogs": "yes",
            "ProtectControlGroups": "yes",
            "Restart": "on-failure",
            "RestartPreventExitStatus": "2",  # a bad config: restarting cannot fix it
        }.items():
            assert one(unit, key) == value, f"{name}: {key}"
        assert one(unit, "RestrictAddressFamilies").split() == ["AF_INET", "AF_INET6", "AF_UNIX"], name
        for key in ("LimitNOFILE", "TasksMax", "MemoryMax"):
            one(unit, key)

    # master: its only writable path is the state directory; its config leaves state_dir at the
    # default, which is /var/lib/kvtier/<cluster_id> where writable (the unit makes it so)
    assert one(master, "StateDirectory") == "kvtier"
    assert one(master, "ReadWritePaths").split() == [SERVICE_STATE_ROOT]
    exec_master = one(master, "ExecStart").split()
    assert exec_master == ["/opt/kvtier/bin/kvtier-master", "--config", "/etc/kvtier/master.toml"]
    assert "state_dir" not in tomllib.loads((DEPLOY / "config" / "master.toml").read_text())
    cfg = effective("kvtier-master", DEPLOY / "config" / "master.toml")
    assert cfg["state_dir"] == default_state_dir(cfg["cluster_id"]), "--print-config shows the resolved default"

    # segment: host /dev/shm stays shared (same-host clients map the region), the SSD dir is writable
    assert one(segment, "ExecStart").split() == [
        "/opt/kvtier/bin/kvtier-segment",
        "--config",
        "/etc/kvtier/segment-%i.toml",
    ]
    assert one(segment, "ReadWritePaths").split() == ["/var/lib/kvtier/ssd/%i", "/dev/shm"]
    assert one(segment, "StateDirectory") == "kvtier/ssd/%i"
    assert segment.get("Service.PrivateDevices", ["no"])[-1] == "no", "a private /dev hides the host's /dev/shm"
    assert "Service.PrivateIPC" not in segment and "Service.TemporaryFileSystem" not in segment
    assert one(segment, "RemoveIPC") == "no"
    cfg = effective("kvtier-segment", DEPLOY / "config" / "segment.toml")
    assert cfg["ssd_dir"] == "/var/lib/kvtier/ssd/a", "instance a's SSD dir is the unit's StateDirectory"
    assert systemd_bytes(one(segment, "MemoryMax")) == segment_memory(cfg), "MemoryMax = dram + buffers + 512MiB"
    buckets = max_buckets(parse_size(cfg["ssd_size"]), parse_size(cfg["ssd_bucket_size"]), cfg["ssd_bucket_keys"])
    assert int(one(segment, "LimitNOFILE")) >= buckets + FD_RESERVE, "the segment would refuse to start"


DRAIN_BANDWIDTH = 200 * MiB  # deploy/README.md, "Drain on stop": what a grace period is sized from


def drain_timeout(argv: list[str]) -> float:
    return float(argv[argv.index("--timeout") + 1])


def test_segments_drain_on_stop_within_a_stop_timeout_sized_from_dram():
    segment = read_unit(UNITS / "kvtier-segment@.service")
    stop = one(segment, "ExecStop")
    assert stop.startswith("-/opt/kvtier/bin/kvtier drain "), "a failed drain must not fail the stop"
    argv = stop[1:].split()
    assert argv[argv.index("--segment-config") + 1] == "/etc/kvtier/segment-%i.toml", "the instance's own config"
    cfg = effective("kvtier-segment", DEPLOY / "config" / "segment.toml")
    assert drain_timeout(argv) >= 2 * parse_size(cfg["dram"]) / DRAIN_BANDWIDTH
    assert int(one(segment, "TimeoutStopSec").removesuffix("s")) >= drain_timeout(argv) + 30
    # the secret reaches both the server and the drain as a credential file, never as a value
    for name, unit, variable in (
        ("segment", segment, "SEGMENT"),
        ("master", read_unit(UNITS / "kvtier-master.service"), "MASTER"),
    ):
        assert one(unit, "LoadCredential") == "cluster.secret:/etc/kvtier/cluster.secret", name
        assert f"KVTIER_{variable}_SECRET_FILE=%d/cluster.secret" in unit["Service.Environment"], name
        assert not any("KVTIER_SECRET=" in e for e in unit.get("Service.Environment", [])), name


def test_the_units_execstop_command_really_drains_the_segment(bare_cluster, tmp_path: Path):
    """The unit's exact ExecStop (binary directory, config path and %d the only substitutions), run
    with the unit's Environment=, moves the segment's objects to the other segment before it stops."""
    credentials = tmp_path / "credentials"  # what LoadCredential= makes: $CREDENTIALS_DIRECTORY
    credentials.mkdir(mode=0o700)
    (credentials / "cluster.secret").write_text(TEST_SECRET)
    (credentials / "cluster.secret").chmod(0o400)
    bare_cluster.secret_file = str(credentials / "cluster.secret")
    bare_cluster.start_master()
    leaving = bare_cluster.start_segment("node-a", "16MiB")
    client = bare_cluster.client(transport="tcp")
    keys = [f"drain/{i}" for i in range(40)]
    values = [os.urandom(64 << 10) for _ in keys]
    assert not any(client.batch_put(keys, values))
    staying = bare_cluster.start_segment("node-b", "16MiB")
    # the segment's config as the unit reads it: name and master in the file, secret from Environment=
    config = tmp_path / "segment-a.toml"
    config.write_text(
        f'master = "{bare_cluster.master.info["address"]}"\ncluster_id = "{bare_cluster.cluster_id}"\nname = "node-a"\n'
    )
    segment = read_unit(UNITS / "kvtier-segment@.service")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for assignment in segment["Service.Environment"]:
        name, _, value = assignment.partition("=")
        env[name] = value.replace("%d", str(credentials))
    stop = one(segment, "ExecStop").removeprefix("-")
    stop = stop.replace("/opt/kvtier/bin/", f"{BIN}/").replace("/etc/kvtier/segment-%i.toml", str(config))
    assert "%" not in stop, stop
    result = subprocess.run(stop.split(), env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"node-a\s+\S+\s+(\d+)", result.stdout), result.stdout
    # the drained server unmounted and exited 0 by itself (Restart=on-failure leaves it down)
    assert leaving.popen.wait(timeout=30) == 0
    assert staying.alive
    assert client.batch_get(keys) == values, "every object moved to node-b before node-a stopped"


def test_drain_by_segment_config_refuses_a_config_that_names_no_segment(tmp_path: Path):
    config = tmp_path / "segment.toml"
    config.write_text('master = "127.0.0.1:1"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for argv, expected in (
        (["drain"], "name the segment, or give --segment-config"),
        (["drain", "--segment-config", str(config)], "sets no segment name"),
        (["drain", "other", "--segment-config", str(config)], "sets no segment name"),
    ):
        result = subprocess.run([str(BIN / "kvtier"), *argv], env=clean, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and expected in result.stderr, (argv, result.stderr)
    named = {**clean, "KVTIER_SEGMENT_NAME": "node-a"}  # the environment names it, as the DaemonSet's does
    result = subprocess.run(
        [str(BIN / "kvtier"), "drain", "node-b", "--segment-config", str(config)],
        env=named, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "'node-b' is not 'node-a'" in result.stderr, result.stderr


# ------------------------------------------------------------------ compose

COMPOSE = DEPLOY / "compose" / "compose.yaml"


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) where it works, else Debian's `docker-compose` (v1, which .ci/run
    installs): both validate and interpolate the file without a container engine."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


MAKE_SECRETS = DEPLOY / "compose" / "make-secrets.sh"


@pytest.fixture(scope="module")
def compose_secrets(tmp_path_factory) -> Path:
    """The secrets directory make-secrets.sh makes (as root here: CI and this machine run tests as root)."""
    directory = tmp_path_factory.mktemp("compose") / "secrets"
    result = subprocess.run(["sh", str(MAKE_SECRETS), str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return directory


def test_docker_compose_config_accepts_the_file(compose_secrets: Path):
    command = compose_command()
    if command is None:
        if os.environ.get("CI"):  # .ci/run installs docker-compose: a skip would hide a broken setup
            pytest.fail("neither `docker compose` nor `docker-compose` works in CI")
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for profile in ("single", "ha"):
        argv = [*command, "-f", str(COMPOSE), "--profile", profile, "config"]
        env = {**clean, "KVTIER_SECRETS": str(compose_secrets)}
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, f"profile {profile}: {result.stderr}"
        resolved = yaml.safe_load(result.stdout)
        services = resolved["services"]
        # (compose v1 prints every service whatever the profile: the profiles are checked statically below)
        kvtier = [n for n, service in services.items() if is_kvtier(service)]
        assert len(kvtier) >= (3 if profile == "single" else 5), (profile, sorted(services))
        secrets = resolved["secrets"]
        for name in kvtier:
            assert "cluster_secret" in [
                str(s if isinstance(s, str) else s["source"]) for s in services[name]["secrets"]
            ]
        for name, secret in secrets.items():
            assert Path(secret["file"]).parent == compose_secrets and Path(secret["file"]).exists(), name


def test_compose_passes_no_secret_through_the_environment_and_make_secrets_makes_working_etcd_certificates(
    compose_secrets: Path, tmp_path: Path
):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        for variable in service.get("environment") or {}:
            assert "SECRET" not in variable.upper() or variable.endswith("_FILE"), (name, variable)
            assert "PASSWORD" not in variable.upper() or variable.endswith("__FILE"), (name, variable)
    # the cluster secret and the client key: uid 10001's alone; the secret long enough to be accepted
    for file in ("cluster.secret", "etcd-client.key"):
        info = (compose_secrets / file).stat()
        assert info.st_uid == 10001 and info.st_mode & 0o077 == 0, file
    assert len((compose_secrets / "cluster.secret").read_text().strip()) >= 32
    # the etcd certificates work: a member with them, client certificates required, and our client
    made = tmp_path / "pki"  # under the names tests/etcd.py reads
    made.mkdir()
    names = {"ca.pem": "etcd-ca.pem", "server.pem": "etcd-server.pem", "server.key": "etcd-server.key"}
    names |= {"client.pem": "etcd-client.pem", "client.key": "etcd-client.key"}
    for ours, theirs in names.items():
        shutil.copy(compose_secrets / theirs, made / ours)
    require_etcd()
    etcd = EtcdServer(tmp_path, tls=made, client_cert_auth=True)
    try:
        security = EtcdSecurity(str(made / "ca.pem"), str(made / "client.pem"), str(made / "client.key"))
        with EtcdClient(etcd.url, timeout=3.0, security=security) as client:
            client.put("/compose", b"tls")
            assert client.get("/compose").value == b"tls"
    finally:
        etcd.stop()


def is_kvtier(service: dict) -> bool:
    return service.get("command", [""])[0] in SERVICES


def compose_service_config(name: str, service: dict) -> tuple[str, Path, dict[str, str], list[str]]:
    """(binary, config file on this machine, KVTIER_* environment, extra flags) of a kvtier service."""
    command = service["command"]
    assert command[0] in SERVICES, f"{name}: {command}"
    assert command[1] == "--config", f"{name}: configs come from a file"
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    source = mounts.get(command[2])
    assert source, f"{name}: {command[2]} is not mounted"
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    return command[0], (COMPOSE.parent / source).resolve(), env, command[3:]


def test_compose_services_run_with_accepted_configs_and_sized_shm():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    by_profile: dict[str, list[str]] = {}
    for name, service in services.items():
        for profile in service.get("profiles", []):
            by_profile.setdefault(profile, []).append(name)
    assert set(by_profile) == {"single", "ha"}
    metrics_ports = set()
    for profile, names in by_profile.items():
        kvtier = {n: compose_service_config(n, services[n]) for n in names if is_kvtier(services[n])}
        masters = {n: c for n, c in kvtier.items() if c[0] == "kvtier-master"}
        segments = {n: c for n, c in kvtier.items() if c[0] == "kvtier-segment"}
        assert len(masters) == (1 if profile == "single" else 3), profile
        assert len(segments) == 2, profile
        assert {"prometheus", "grafana"} <= set(names)
        for name, service in ((n, services[n]) for n in names):
            for dependency in service.get("depends_on", []):
                assert dependency in names, f"{name} depends on {dependency}, not in profile {profile}"
        configs = {}
        for name, (binary, path, env, flags) in kvtier.items():
            configs[name] = cfg = effective(binary, path, env, *flags)
            metrics_ports.add(port_of(cfg["metrics"]))
        master_configs = [configs[n] for n in masters]
        if profile == "ha":
            members = [f"etcd-{i}" for i in (1, 2, 3)]
            assert set(members) <= set(names)
            etcd_urls = {c["etcd"] for c in master_configs}
            assert etcd_urls == {f"etcd://{','.join(m + ':2379' for m in members)}/default"}
            for name in members:  # TLS for clients and peers, client certificates required
                flags = " ".join(services[name]["command"])
                assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags, name
                assert f"--advertise-client-urls=https://{name}:2379" in flags, name
            written = tomllib.loads((COMPOSE.parent / "master-ha.toml").read_text())
            for name in masters:  # the files are the service's compose secrets
                mounted = {f"/run/secrets/{secret}" for secret in services[name]["secrets"]}
                assert {written[k] for k in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file")} <= mounted, name
            for name in masters:
                assert configs[name]["advertise"] == configs[name]["listen"] == f"{name}:50051"
        else:
            # state_dir left at its default, /var/lib/kvtier/<cluster_id> (the image's user can
            # write /var/lib/kvtier), on a named volume mounted there
            assert master_configs[0]["state_dir"], "a standalone master needs its state"
            assert "state_dir" not in tomllib.loads((COMPOSE.parent / "master.toml").read_text())
            state_volumes = [v for v in services["master"]["volumes"] if v.split(":")[1] == SERVICE_STATE_ROOT]
            assert state_volumes and not state_volumes[0].startswith("."), "state_dir must be a named volume"
        spec = master_configs[0]["etcd"] or master_configs[0]["listen"]
        for name in segments:
            cfg, service = configs[name], services[name]
            assert cfg["master"] == spec, f"{name} does not point at this profile's master"
            if profile == "ha":
                mounted = {f"/run/secrets/{secret}" for secret in service["secrets"]}
                assert service["environment"]["KVTIER_SEGMENT_ETCD_CERT_FILE"] in mounted, name
            assert cfg["cluster_id"] == master_configs[0]["cluster_id"]
            assert cfg["listen"].split(":")[0] == name, f"{name} must bind (and so advertise) its own address"
            assert docker_size(service["shm_size"]) >= parse_size(cfg["dram"]) + HEADER_SIZE
            assert docker_size(service["mem_limit"]) >= segment_memory(cfg)
            ssd_mounts = [v for v in service["volumes"] if v.split(":")[1] == cfg["ssd_dir"]]
            assert ssd_mounts and not ssd_mounts[0].startswith("."), f"{name}: the SSD tier on a named volume"
        names_of_segments = {configs[n]["name"] for n in segments}
        assert len(names_of_segments) == 2, "segment names are unique"
    assert metrics_ports == {9450}, "the image's HEALTHCHECK and prometheus.yml expect 9450"
    # every file a service mounts from the repository exists
    repository_mounts = [
        (name, volume.split(":")[0])
        for name, service in services.items()
        for volume in service.get("volumes", [])
        if volume.startswith(".")
    ]
    assert {name for name, _ in repository_mounts} >= {"master", "segment-a", "prometheus", "grafana"}
    for name, source in repository_mounts:
        assert (COMPOSE.parent / source).exists(), f"{name} mounts a missing {source}"


def test_prometheus_scrapes_every_compose_service_on_its_metrics_port():
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    for job in prometheus["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets.update(dict.fromkeys(sd["names"], sd["port"]))
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if is_kvtier(service):
            assert targets.get(name) == 9450, f"prometheus.yml does not scrape {name}"


def test_grafana_provisioning_finds_prometheus_and_the_dashboard():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"] and "prometheus" in services
    providers = yaml.safe_load((provisioning / "dashboards" / "kvtier.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    dashboard_target = mounts["../grafana/kvtier-dashboard.json"]
    assert Path(dashboard_target).parent == Path(providers[0]["options"]["path"])
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"


# ------------------------------------------------------------------ Kubernetes

KUBE = DEPLOY / "kubernetes"
FIELD_VALUES = {"status.podIP": "10.1.2.3", "spec.nodeName": "node-1.example", "metadata.name": "kvtier-master-0"}


def kustomize(directory: Path) -> tuple[list[dict], dict[str, dict[str, str]]]:
    """Objects and generated ConfigMaps (name -> key -> text) of a kustomization, resources followed."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    configmaps: dict[str, dict[str, str]] = {}
    for resource in spec.get("resources", []):
        path = directory / resource
        if path.is_dir():
            more, maps = kustomize(path)
            objects += more
            configmaps.update(maps)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        document = yaml.safe_load((directory / patch["path"]).read_text())
        target = next(
            o
            for o in objects
            if (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
            == (document["kind"], document["metadata"]["name"], document["metadata"].get("namespace"))
        )
        strategic_merge(target, document)
    for generator in spec.get("configMapGenerator", []):
        data = {}
        for item in generator.get("files", []):
            key, _, file = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
            data[key] = (directory / file).read_text()
        behavior = generator.get("behavior", "create")
        name = generator["name"]
        assert (name in configmaps) == (behavior != "create"), f"{directory}: {behavior} {name}"
        configmaps[name] = {**configmaps[name], **data} if behavior == "merge" else data
    return objects, configmaps


# The merge keys of the lists our patches touch (Kubernetes' strategic merge patch).
MERGE_KEYS = {
    "containers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def strategic_merge(target: dict, patch: dict) -> None:
    """Apply a strategic-merge patch in place, for what deploy/'s patches use: maps merge, lists with
    a merge key merge by it (an item with `$patch: delete` removes its match), other values replace."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(target.get(key), list):
            merge_key = MERGE_KEYS[key]
            for item in value:
                match = next((t for t in target[key] if t.get(merge_key) == item[merge_key]), None)
                if item.get("$patch") == "delete":
                    assert match is not None, f"patch deletes a missing {key} {item[merge_key]}"
                    target[key].remove(match)
                elif match is not None:
                    strategic_merge(match, item)
                else:
                    target[key].append(item)
        else:
            target[key] = value


def container_env(container: dict) -> dict[str, str]:
    """KVTIER_* variables with fieldRefs and $(VAR) references resolved to plausible pod values."""
    values: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            values[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            values[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], item["value"])
    return {k: v for k, v in values.items() if k.startswith("KVTIER_")}


def kube_container_config(pod: dict, container: dict, configmaps: dict, tmp_path: Path) -> tuple[str, dict]:
    command = container["command"]
    assert command[0] in SERVICES and command[1] == "--config", command
    directory, _, filename = command[2].rpartition("/")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[directory])
    text = configmaps[volume["configMap"]["name"]][filename]
    path = tmp_path / f"{container['name']}-{filename}"
    path.write_text(text)
    # The cluster secret comes from a Secret volume that only the pod's group can read.
    secret_dir = tomllib.loads(text)["secret_file"].rpartition("/")[0]
    secret = next(v for v in pod["volumes"] if v["name"] == mounts[secret_dir])["secret"]
    assert secret["secretName"] == "kvtier-cluster-secret" and secret["defaultMode"] & 0o007 == 0
    assert pod["securityContext"]["fsGroup"] == 10001, "the Secret's group must be the service's"
    return command[0], effective(command[0], path, container_env(container), *command[3:])


VARIANTS = ["standalone", "ha", "tls"]
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


def kvtier_workloads(objects: list[dict]) -> dict[str, dict]:
    """The kvtier workloads by name (the etcd reference of ha/ has its own test)."""
    return {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] in WORKLOAD_KINDS and o["spec"]["template"]["spec"]["containers"][0]["command"][0] in SERVICES
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_kubernetes_workloads_run_with_accepted_configs_probes_and_limits(variant: str, tmp_path: Path):
    objects, configmaps = kustomize(KUBE / variant)
    kinds = [o["kind"] for o in objects]
    assert kinds.count("Namespace") == 2 and "ServiceMonitor" in kinds and "PrometheusRule" in kinds
    workloads = kvtier_workloads(objects)
    seen = {}
    for workload in workloads.values():
        pod = workload["spec"]["template"]["spec"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for container in pod["containers"]:
            binary, cfg = kube_container_config(pod, container, configmaps, tmp_path)
            seen[binary] = (workload, pod, container, cfg)
            security = container["securityContext"]
            assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
            assert pod["securityContext"]["runAsUser"] != 0
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["metrics"] == port_of(cfg["metrics"])
            assert cfg["metrics"] == f"10.1.2.3:{ports['metrics']}", "metrics bind the pod address, not every one"
            assert pod["automountServiceAccountToken"] is False, "no service-account token: no API calls"
            assert not pod.get("initContainers"), "no init container (the last one ran as root)"
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
            limits, requests = container["resources"]["limits"], container["resources"]["requests"]
            assert k8s_quantity(limits["memory"]) >= k8s_quantity(requests["memory"])
    master_workload, master_pod, master_container, master_cfg = seen["kvtier-master"]
    segment_workload, segment_pod, segment_container, segment_cfg = seen["kvtier-segment"]
    assert master_cfg["listen"] == "10.1.2.3:50051", "the master binds (and announces) the pod's address"
    if variant in ("standalone", "tls"):
        assert master_workload["kind"] == "Deployment" and master_workload["spec"]["replicas"] == 1
        assert master_workload["spec"]["strategy"]["type"] == "Recreate"
        mounts = {m["mountPath"]: m["name"] for m in master_container["volumeMounts"]}
        # state_dir left at its default, /var/lib/kvtier/<cluster_id>, on the PVC mounted there
        assert master_cfg["state_dir"] and not master_cfg["etcd"]
        state = next(v for v in master_pod["volumes"] if v["name"] == mounts[SERVICE_STATE_ROOT])
        claim = state["persistentVolumeClaim"]["claimName"]
        assert any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim for o in objects)
        # the master Service in the masters' namespace, from the segments' own
        assert segment_cfg["master"] == "kvtier-master.kvtier.svc:50051"
        if variant == "tls":
            assert master_cfg["tls_cert_file"] and master_cfg["fast_listen"] == "off"
            assert segment_cfg["tls_ca_file"]
            assert "fast" not in {p["name"] for p in master_container["ports"]}
    else:
        assert master_workload["kind"] == "StatefulSet" and master_workload["spec"]["replicas"] == 3
        assert master_cfg["etcd"].startswith("etcd://etcd-0.etcd.kvtier.svc:2379,") and not master_cfg["state_dir"]
        assert master_cfg["etcd_cert_file"] and master_cfg["etcd_key_file"] and master_cfg["etcd_ca_file"]
        assert segment_cfg["master"] == master_cfg["etcd"], "segments find the leader in etcd"
        assert segment_cfg["etcd_cert_file"], "and present the etcd client certificate"
        # standbys that follow are ready (/readyz), so the masters roll one at a time under a PDB
        assert master_workload["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        master_budget = next(
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"] == master_workload["spec"]["selector"]["matchLabels"]
        )
        assert master_budget["spec"]["maxUnavailable"] == 1
    assert segment_cfg["cluster_id"] == master_cfg["cluster_id"]

    # segment: a DaemonSet with its region in an explicitly sized memory /dev/shm, NVMe on hostPath
    assert segment_workload["kind"] == "DaemonSet"
    assert segment_cfg["name"] == "node-1.example" and segment_cfg["listen"] == "10.1.2.3:7000"
    mounts = {m["mountPath"]: m["name"] for m in segment_container["volumeMounts"]}
    volumes = {v["name"]: v for v in segment_pod["volumes"]}
    shm = volumes[mounts[segment_cfg["shm_dir"]]]["emptyDir"]
    assert shm["medium"] == "Memory"
    limits = segment_container["resources"]["limits"]
    assert parse_size(segment_cfg["dram"]) + HEADER_SIZE <= k8s_quantity(shm["sizeLimit"])
    assert k8s_quantity(shm["sizeLimit"]) <= k8s_quantity(limits["memory"])
    assert k8s_quantity(limits["memory"]) == segment_memory(segment_cfg), "memory = dram + buffers + 512Mi"
    assert segment_container["resources"]["requests"] == limits, "Guaranteed QoS: the last pod evicted"
    ssd = volumes[mounts[segment_cfg["ssd_dir"]]]["hostPath"]
    assert ssd["type"] == "Directory", "an unmounted NVMe fails the pod instead of filling the root disk"

    # drain on stop: preStop drains the segment its own config names, within the grace period
    prestop = segment_container["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[:2] == ["kvtier", "drain"]
    assert prestop[prestop.index("--segment-config") + 1] == segment_container["command"][2], "the same config"
    assert drain_timeout(prestop) >= 2 * parse_size(segment_cfg["dram"]) / DRAIN_BANDWIDTH
    assert segment_pod["terminationGracePeriodSeconds"] >= drain_timeout(prestop) + 30

    # Services select real pods; the ServiceMonitor finds them by label and port name
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in objects if w["kind"] in WORKLOAD_KINDS]
    services = [o for o in objects if o["kind"] == "Service"]
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [
        s for s in services if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["name"] for s in selected} == {"kvtier-master", "kvtier-segment"}
    for service in services:
        assert any(service["spec"]["selector"].items() <= labels.items() for labels in pod_labels), service
    for service in selected:
        assert any(p["name"] == monitor["spec"]["endpoints"][0]["port"] for p in service["spec"]["ports"])
        # unready pods stay reachable: a recovering master must hear from its segments
        assert service["spec"]["publishNotReadyAddresses"] is True


NAMESPACES = {"kvtier", "kvtier-segments"}
RESTRICTED_VOLUMES = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps a pod spec from Pod Security "restricted" (the checks that apply to deploy/'s pods)."""
    out = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            out.append(host)
    out += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    pod_security = pod.get("securityContext", {})
    if pod_security.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("seccompProfile")
    for container in pod.get("initContainers", []) + pod["containers"]:
        security = container.get("securityContext", {})
        if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
            out.append(f"{container['name']}: runAsNonRoot")
        if 0 in (security.get("runAsUser"), pod_security.get("runAsUser")):
            out.append(f"{container['name']}: runAsUser 0")
        if security.get("allowPrivilegeEscalation") is not False:
            out.append(f"{container['name']}: allowPrivilegeEscalation")
        if security.get("capabilities", {}).get("drop") != ["ALL"] or security.get("capabilities", {}).get("add"):
            out.append(f"{container['name']}: capabilities")
        if security.get("privileged"):
            out.append(f"{container['name']}: privileged")
    return out


def policy_peers(policies: list[dict], namespace: str, labels: dict, port: int, direction: str) -> list[dict]:
    """The peers (as written) that the policies selecting this pod admit on `port`, in `direction`
    ("ingress" or "egress")."""
    peers = []
    key = "from" if direction == "ingress" else "to"
    for policy in policies:
        spec = policy["spec"]
        if policy["metadata"]["namespace"] != namespace:
            continue
        if not spec["podSelector"].get("matchLabels", {}).items() <= labels.items():
            continue
        for rule in spec.get(direction, []):
            if any(p["port"] == port for p in rule.get("ports", [])):
                peers += [{**peer, "_namespace": namespace} for peer in rule[key]]
    return peers


@pytest.mark.parametrize("variant", VARIANTS)
def test_kubernetes_namespaces_pod_security_and_network_policies(variant: str):
    objects, _ = kustomize(KUBE / variant)
    namespaces = {o["metadata"]["name"]: o["metadata"]["labels"] for o in objects if o["kind"] == "Namespace"}
    assert set(namespaces) == NAMESPACES
    assert all(o["metadata"].get("namespace") in NAMESPACES for o in objects if o["kind"] != "Namespace")
    # masters (and etcd) meet "restricted", enforced; segments meet it except their hostPath, warned
    assert namespaces["kvtier"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert namespaces["kvtier-segments"]["pod-security.kubernetes.io/warn"] == "restricted"
    assert namespaces["kvtier-segments"]["pod-security.kubernetes.io/audit"] == "restricted"
    for workload in (o for o in objects if o["kind"] in WORKLOAD_KINDS):
        pod = workload["spec"]["template"]["spec"]
        violations = restricted_violations(pod)
        if workload["metadata"]["namespace"] == "kvtier":
            assert not violations, (workload["metadata"]["name"], violations)
        else:
            assert violations == ["volume ssd"], (workload["metadata"]["name"], violations)
        assert pod["automountServiceAccountToken"] is False, workload["metadata"]["name"]

    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for namespace in NAMESPACES:
        deny = [p for p in policies if p["metadata"]["namespace"] == namespace and p["spec"]["podSelector"] == {}]
        assert any(
            set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
            for p in deny
        ), namespace
    master = ("kvtier", {"app.kubernetes.io/name": "kvtier-master"})
    segment = ("kvtier-segments", {"app.kubernetes.io/name": "kvtier-segment"})
    engine = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"kvtier.io/client": "true"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    segments_from_masters = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvtier-segments"}},
        "podSelector": {"matchLabels": segment[1]},
    }

    def admitted(pod, port, direction="ingress") -> list[dict]:
        return [
            {k: v for k, v in p.items() if k != "_namespace"} for p in policy_peers(policies, *pod, port, direction)
        ]

    for port in (50051, 50052):  # control: engines and segments only
        assert admitted(master, port) == [engine, segments_from_masters], port
    assert admitted(segment, 7000) == [engine, {"podSelector": {"matchLabels": segment[1]}}]
    for pod in (master, segment):
        assert admitted(pod, 9450) == [monitoring], pod  # metrics: monitoring only
        for port in (7000, 50051, 50052, 9450, 2379):
            assert not any(p == {} or p == {"namespaceSelector": {}} for p in admitted(pod, port)), (pod, port)
    # egress: masters reach etcd alone; segments the masters, each other (drain) and etcd
    assert admitted(master, 2379, "egress") == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "etcd"}}}]
    assert (
        admitted(segment, 50051, "egress") and admitted(segment, 7000, "egress") and admitted(segment, 2379, "egress")
    )
    assert not admitted(master, 7000, "egress"), "masters dial no segment"


def test_the_etcd_reference_is_three_members_over_tls_with_client_certificates():
    objects, _ = kustomize(KUBE / "ha")
    etcd = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd")
    spec, pod = etcd["spec"], etcd["spec"]["template"]["spec"]
    assert spec["replicas"] == 3 and spec["serviceName"] == "etcd"
    (container,) = pod["containers"]
    flags = dict(arg.removeprefix("--").partition("=")[::2] for arg in container["command"][1:])
    for name in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file"):
        assert flags[name].startswith("/etc/etcd/tls/"), name
    assert "client-cert-auth" in flags and "peer-client-cert-auth" in flags
    assert flags["listen-client-urls"].startswith("https://") and flags["listen-peer-urls"].startswith("https://")
    members = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    domain = f"{spec['serviceName']}.{etcd['metadata']['namespace']}.svc"
    assert members == {f"etcd-{i}": f"https://etcd-{i}.{domain}:2380" for i in range(3)}
    # every flag is one etcd knows (the installed etcd's --help; the image's is newer, not older)
    if etcd_available():
        known = subprocess.run([ETCD_BINARY, "--help"], capture_output=True, text=True, timeout=30)
        help_text = known.stdout + known.stderr
        assert all(f"--{name}" in help_text for name in flags), [n for n in flags if f"--{n}" not in help_text]
    # the masters and segments dial exactly the members, by the names the server certificate covers
    _, configmaps = kustomize(KUBE / "ha")
    url = tomllib.loads(configmaps["kvtier-master"]["master.toml"])["etcd"]
    endpoints = url.removeprefix("etcd://").rpartition("/")[0].split(",")
    assert endpoints == [f"etcd-{i}.{domain}:2379" for i in range(3)]
    budget = next(o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "etcd")
    assert budget["spec"]["maxUnavailable"] == 1, "quorum: one of three down at a time"


def server_certificate(directory: Path, ip: str) -> tuple[Path, Path]:
    """A server certificate for `ip`, signed by the test CA."""
    cert, key, ext = directory / "server.pem", directory / "server.key", directory / "server.ext"
    ext.write_text(f"subjectAltName=IP:{ip}\n")
    run = {"capture_output": True, "check": True, "timeout": 60}
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", directory / "server.csr",
                    "-subj", "/CN=kvtier-master"], **run)  # fmt: skip
    subprocess.run(["openssl", "x509", "-req", "-in", directory / "server.csr", "-CA", TEST_PKI / "ca.pem",
                    "-CAkey", TEST_PKI / "ca.key", "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext],
                   **run)  # fmt: skip
    key.chmod(0o600)
    return cert, key


def test_the_tls_overlay_master_starts_as_shipped(bare_cluster, tmp_path: Path):
    """The overlay's exact master.toml and container environment (the pod IP a loopback address here);
    only the paths of files that exist on a real host (the Secrets, the PVC) point at test ones."""
    objects, configmaps = kustomize(KUBE / "tls")
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "kvtier-master")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    config = tmp_path / "master.toml"
    config.write_text(configmaps["kvtier-master"]["master.toml"])
    pod_ip = "127.0.0.22"
    env = {k: v.replace("10.1.2.3", pod_ip) for k, v in container_env(container).items()}
    env["KVTIER_MASTER_STATE_DIR"] = str(tmp_path / "state")  # the PVC
    assert container["command"][1:] == ["--config", "/etc/kvtier/master.toml"]  # the ConfigMap's file
    argv = [str(BIN / container["command"][0]), "--config", str(config)]
    cert, key = server_certificate(tmp_path, pod_ip)  # the Secret kvtier-master-tls: a SAN for the pod IP
    argv += ["--secret-file", TEST_SECRET_FILE, "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    argv += ["--ready-file", str(tmp_path / "ready")]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    # The base's environment alone (its fast-path address) next to TLS is what used to stop it: exit 2.
    base_env = {**env, "KVTIER_MASTER_FAST_LISTEN": f"{pod_ip}:50052"}
    refused = subprocess.run([*argv, "--print-config"], env={**clean, **base_env}, capture_output=True, text=True)
    assert refused.returncode == 2 and "fast_listen" in refused.stderr, refused.stderr
    log = tmp_path / "master.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env={**clean, **env}, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert bare_cluster.wait_for(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, timeout=30)
        assert proc.poll() is None, log.read_text()
        info = json.loads((tmp_path / "ready").read_text())
        assert info["address"] == f"{pod_ip}:50051" and info["fast_endpoint"] == ""
        with urllib.request.urlopen(f"http://{pod_ip}:9450/readyz", timeout=5) as response:
            assert response.status == 200
        from kvtier.client import Client

        with Client(
            info["address"], timeout=10.0, secret_file=TEST_SECRET_FILE, tls_ca_file=str(TEST_PKI / "ca.pem")
        ) as c:
            assert c.batch_exists(["over-tls"]) == [False]  # a metadata call over TLS
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


# Optional, also under CI: no Debian package has a kubectl whose kustomize knows `labels:`
# (kubernetes-client 1.20 bundles kustomize v2), and a kubectl from elsewhere is a download CI does
# not make. The static checks above (kustomize() follows resources and generators the same way)
# run everywhere; this one adds the real tool where it is installed.
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (optional, see comment)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_kubectl_kustomize_builds(variant: str):
    result = subprocess.run(["kubectl", "kustomize", str(KUBE / variant)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    workload = ("StatefulSet" if variant == "ha" else "Deployment", "kvtier-master")
    assert workload in names and ("DaemonSet", "kvtier-segment") in names
    # generated ConfigMaps carry a content hash, and the workloads were rewritten to use it
    generated = {name for kind, name in names if kind == "ConfigMap"}
    assert len(generated) == 2, generated  # kvtier-master-<hash>, kvtier-segment-<hash>
    assert all(re.fullmatch(r"kvtier-(master|segment)-[a-z0-9]{10}", name) for name in generated), generated
    assert all(o["metadata"].get("namespace") in NAMESPACES for o in objects if o["kind"] != "Namespace")
    used = {
        v["configMap"]["name"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
        for v in o["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    }
    assert used == generated


# ------------------------------------------------------------------ Dockerfile

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def dockerfile_stages() -> list[list[str]]:
    """Instructions (continuation lines joined, comments dropped) per stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_dockerfile_runtime_stage_has_no_compiler_and_runs_as_a_fixed_non_root_user():
    build, runtime = dockerfile_stages()
    assert build[0].startswith("FROM python:3.11-slim AS ")
    assert any("gcc" in line for line in build) and any("[ssd]" in line for line in build)
    assert runtime[0] == "FROM python:3.11-slim"
    assert not any(re.search(r"\b(gcc|cc|make|build-essential)\b", line) for line in runtime if line.startswith("RUN"))
    user = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert user and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user[-1]), "a numeric uid:gid, so runAsNonRoot can check it"
    uid, gid = user[-1].split(":")
    owned = f"install -d -o {uid} -g {gid} -m 0700 {SERVICE_STATE_ROOT} "
    assert any(owned in line for line in runtime if line.startswith("RUN")), "the default state_dir is writable"
    exposed = {int(p) for line in runtime if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert {50051, 50052, 7000, 9450} <= exposed
    assert any(line.startswith("HEALTHCHECK ") for line in runtime)


def healthcheck_argv() -> list[str]:
    line = next(line for line in dockerfile_stages()[-1] if line.startswith("HEALTHCHECK "))
    argv = json.loads(line[line.index(" CMD ") + 5 :])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def test_the_image_healthcheck_passes_on_running_servers_and_fails_without_one(bare_cluster):
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    seg = bare_cluster.start_segment("seg0", "16MiB", "--metrics", "127.0.0.1:0")
    argv = healthcheck_argv()
    for info in (bare_cluster.master.info, seg.info):
        port = str(port_of(info["metrics"]))
        result = subprocess.run(argv, env={**os.environ, "KVTIER_HEALTH_PORT": port}, capture_output=True, timeout=30)
        assert result.returncode == 0, result.stderr.decode()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = str(s.getsockname()[1])
    result = subprocess.run(argv, env={**os.environ, "KVTIER_HEALTH_PORT": free}, capture_output=True, timeout=30)
    assert result.returncode == 1


# ------------------------------------------------------------------ Grafana dashboard

DASHBOARD = DEPLOY / "grafana" / "kvtier-dashboard.json"
METRIC = re.compile(r"\b((?:kvtier|process)_[a-z0-9_]+)\b")


def dashboard_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows keep theirs inside
    return out


def dashboard_metric_names(dashboard: dict) -> dict[str, str]:
    """metric name -> title of a panel (or variable) using it."""
    names = {}
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            names.update(dict.fromkeys(METRIC.findall(target["expr"]), panel["title"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            names.update(dict.fromkeys(METRIC.findall(variable["definition"]), f"${variable['name']}"))
    return names


def exported_names(text: str) -> set[str]:
    """Sample names a Prometheus query can use, including those of families exported without samples yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_dashboard_is_well_formed_and_shows_the_four_hits_side_by_side():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    # the first row: lookup hits, bytes transferred, served and verified, physical disk reads
    first_row = []
    for panel in dashboard["panels"][1:]:
        if panel["type"] == "row":
            break
        first_row.append(" ".join(t["expr"] for t in panel["targets"]))
    row_text = "\n".join(first_row)
    for metric in (
        "kvtier_master_lookup_hits_total",
        "kvtier_segment_served_bytes_total",
        "kvtier_client_transferred_bytes_total",
        "kvtier_client_served_objects_total",
        "kvtier_segment_disk_read_bytes_total",
        "kvtier_segment_offloaded_bytes_total",
    ):
        assert metric in row_text, f"{metric} is not in the first row"
    assert "tier" in row_text and "transport" in row_text


def test_every_metric_on_the_dashboard_and_in_the_alerts_is_exported_by_a_running_cluster(bare_cluster, tmp_path: Path):
    bare_cluster.start_master("--metrics", "127.0.0.1:0")
    seg = bare_cluster.start_segment(
        "seg0", "64MiB", "--metrics", "127.0.0.1:0", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "64MiB"
    )
    namespace = f"dash{os.getpid()}"
    client = bare_cluster.client(namespace=namespace, metrics=True, transport="tcp", instance="dash", rank=0)
    client.register_instance(tp_size=2, pp_size=1, budget=32 << 20)
    keys = [f"d/{i}" for i in range(20)]
    values = [os.urandom(4096) for _ in keys]
    assert not any(client.batch_put(keys, values))
    assert client.batch_get(keys + ["d/absent"]) == values + [None]
    assert client.batch_exists(keys[:3]) == [True] * 3

    exported = set()
    for address in (bare_cluster.master.info["metrics"], seg.info["metrics"]):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
            exported |= exported_names(response.read().decode())
    exported |= exported_names(generate_latest(REGISTRY).decode())  # the client's, in this process

    wanted = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(wanted) > 30
    missing = {name: panel for name, panel in wanted.items() if name not in exported}
    assert not missing, f"dashboard metrics no process exports: {missing}"
    # the alerts (deploy/prometheus/rules): a family exported without samples yet (a counter no event
    # has touched) still has its HELP/TYPE lines, which is what exported_names reads
    alerting = rule_metric_names()
    assert len(alerting) > 10
    assert not alerting - exported, f"alert rules read metrics no process exports: {sorted(alerting - exported)}"
    # the quota gauges carry engine_instance, never Prometheus's own instance label
    with urllib.request.urlopen(f"http://{bare_cluster.master.info['metrics']}/metrics", timeout=5) as response:
        quota = [
            sample
            for family in text_string_to_metric_families(response.read().decode())
            if family.name.startswith("kvtier_master_quota")
            for sample in family.samples
        ]
    assert quota and all(set(s.labels) == {"engine_instance", "rank"} for s in quota), quota
