"""Issue 8, shared memory: a region is mapped only by the uids its segment server grants it to.

Real processes: a master and segment servers (tests/cluster.py), clients in
this process (the service's uid) and, for "a second local user", Python
subprocesses that drop to another uid before touching anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from kvtier.segment_server.region import SHM_DIR, remove_orphans
from kvtier.segment_server.shm_grant import Outcome
from tests.capability import require
from tests.integration.test_metrics import scrape

KiB = 1 << 10
NOBODY = 65534  # refused: not in shm_allowed_uids
GUEST = 65532  # allowed: --shm-allowed-uids 65532 (no passwd entry needed for a number)

# Runs as another user: imports as root (the interpreter's own library may be readable by root only,
# hence the lazily imported codecs loaded first), then drops every group and uid before touching the region.
AS_OTHER_USER = r"""
import encodings.idna, hashlib, json, os, sys
from kvtier.client import Client
from kvtier.client.config import ClientConfig
from kvtier.client.transport.shm import ShmConnector
from kvtier.proto.errors import ConnectError

master, region, endpoint, key, uid = sys.argv[1:]
os.setgroups([])
os.setgid(int(uid))
os.setuid(int(uid))
out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups()}
try:
    with open(region, "rb") as f:
        f.read(1)
    out["open"] = "opened"
except PermissionError:
    out["open"] = "PermissionError"
try:
    ShmConnector(endpoint, ClientConfig(master=master)).close()
    out["grant"] = "granted"
except ConnectError as exc:
    out["grant"] = exc.message
for transport in ("shm", "tcp", ""):
    with Client(master, transport=transport, timeout=5.0) as kv:
        data, source = kv.get(key, with_source=True)
    out[transport or "auto"] = [hashlib.sha256(data).hexdigest() if data is not None else None, source]
print(json.dumps(out))
"""


def shm_endpoint(proc) -> str:
    (endpoint,) = [e for e in proc.info["endpoints"] if e.startswith("shm://")]
    return endpoint


def socket_of(proc) -> Path:
    return Path(unquote(urlsplit(shm_endpoint(proc)).path))


def as_user(uid: int, cluster, proc, key: str) -> dict:
    """Run AS_OTHER_USER as `uid` against segment `proc`; its JSON report."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_TRANSPORT"}
    args = [cluster.master_address, proc.info["region"], shm_endpoint(proc), key, str(uid)]
    result = subprocess.run(
        [sys.executable, "-c", AS_OTHER_USER, *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, f"uid {uid}: {result.stderr}\n{cluster.logs()}"
    report = json.loads(result.stdout)
    assert (report["uid"], report["euid"], report["gid"], report["groups"]) == (uid, uid, uid, [])
    return report


def grants(samples: dict, segment: str) -> dict[str, float]:
    """kvtier_segment_shm_grants_total of `segment` by result, the non-zero ones; every result is exported."""
    exported = {
        dict(labels)["result"]: count
        for (name, labels), count in samples.items()
        if name == "kvtier_segment_shm_grants_total" and dict(labels)["segment"] == segment
    }
    assert set(exported) == {outcome.value for outcome in Outcome}, exported
    return {result: count for result, count in exported.items() if count}


# ------------------------------------------------------------------ through the grant, same uid


def test_a_same_host_client_maps_the_region_through_the_grant(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    seg = cluster.start_segment("seg0", "64MiB", "--metrics", "127.0.0.1:0")
    endpoint = shm_endpoint(seg)
    sock = socket_of(seg)
    assert sock == Path(seg.info["region"]).with_suffix(".sock"), "next to the region"
    assert parse_qs(urlsplit(endpoint).query)["uid"] == [str(os.geteuid())]

    client = cluster.client()
    values = {f"g/{i}": os.urandom(100 * KiB + i) for i in range(6)}
    client.batch_put(list(values), list(values.values()))
    for key, (data, source) in zip(values, client.batch_get(list(values), with_source=True), strict=True):
        assert (data, source) == (values[key], "dram/shm"), key
    buf = bytearray(200 * KiB)
    assert client.get_into("g/0", buf, with_source=True) == (len(values["g/0"]), "dram/shm")
    assert bytes(buf[: len(values["g/0"])]) == values["g/0"]
    assert client.stats().get("checksum_mismatches", 0) == 0
    assert grants(scrape(seg.info["metrics"]), "seg0") == {"granted": 1}, "one grant per client and segment"


# ------------------------------------------------------------------ another local user


def test_a_second_local_user_cannot_map_a_region_unless_allowed(bare_cluster):
    require("root", os.geteuid() == 0, "needs root to run a subprocess as other uids (CI runs as root)")
    cluster = bare_cluster
    cluster.start_master()
    seg = cluster.start_segment("seg0", "64MiB", "--shm-allowed-uids", str(GUEST), "--metrics", "127.0.0.1:0")
    client = cluster.client()
    secret = os.urandom(64 * KiB)
    client.put("secret", secret)
    assert client.get("secret", with_source=True) == (secret, "dram/shm")
    digest = hashlib.sha256(secret).hexdigest()
    before = grants(scrape(seg.info["metrics"]), "seg0")

    nobody = as_user(NOBODY, cluster, seg, "secret")
    assert nobody["open"] == "PermissionError", "the region file is 0600: not openable by path"
    assert nobody["grant"] == (
        f"the segment refused to grant its region: uid {NOBODY} may not map this region "
        "(neither the service's uid nor in shm_allowed_uids)"
    )
    assert nobody["shm"] == [None, None], "forced to shm: a miss, never the bytes"
    assert nobody["tcp"] == nobody["auto"] == [digest, "dram/tcp"], "falls back to TCP"
    refused = grants(scrape(seg.info["metrics"]), "seg0")
    assert refused.get("granted") == before.get("granted")
    assert refused["refused_uid"] >= 3, refused  # its ShmConnector, and its two clients that tried shm

    guest = as_user(GUEST, cluster, seg, "secret")
    assert guest["open"] == "PermissionError", "allowed users get the region only through the grant"
    assert guest["grant"] == "granted"
    assert guest["shm"] == guest["auto"] == [digest, "dram/shm"]
    assert guest["tcp"] == [digest, "dram/tcp"]
    after = grants(scrape(seg.info["metrics"]), "seg0")
    assert after["granted"] - before.get("granted", 0) == 3, after  # ShmConnector, shm and auto clients
    assert after["refused_uid"] == refused["refused_uid"]
    assert set(after) <= {"granted", "refused_uid"}, after


# ------------------------------------------------------------------ files: modes, owners, removal


def test_region_is_private_and_the_socket_is_removed_at_stop(bare_cluster):
    cluster = bare_cluster
    cluster.start_master()
    seg = cluster.start_segment("seg0")
    region, sock = Path(seg.info["region"]), socket_of(seg)
    info = region.stat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid()), "owned by the server's uid"
    info = sock.lstat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o666
    assert info.st_uid == os.geteuid()
    assert cluster.client().get("nothing") is None

    cluster.kill(seg, signal.SIGTERM)
    assert seg.popen.returncode == 0
    assert not region.exists() and not sock.exists(), "a clean stop removes the region and its grant socket"


def test_a_killed_segment_restarts_while_clients_still_map_its_old_region(bare_cluster):
    """Granted mappings hold no lock: the name can start again, and the dead socket is replaced."""
    cluster = bare_cluster
    cluster.start_master()
    old = cluster.start_segment("a")
    mapped = cluster.client()
    mapped.put("before", b"old bytes")
    assert mapped.get("before", with_source=True) == (b"old bytes", "dram/shm")  # the old region stays mapped
    sock = socket_of(old)
    old_inode = sock.lstat().st_ino

    cluster.kill(old)
    assert sock.exists(), "SIGKILL leaves the socket behind"

    new = cluster.start_segment("a")  # raises if the old region still looked alive
    assert socket_of(new) == sock and sock.lstat().st_ino != old_inode
    assert shm_endpoint(new) != shm_endpoint(old), "a new nonce"
    fresh = cluster.client()
    fresh.put("after", b"new bytes")
    assert fresh.get("after", with_source=True) == (b"new bytes", "dram/shm")
    assert sorted(cluster.leftover_region_files()) == sorted([new.info["region"], str(sock)])

    cluster.kill(new)
    assert remove_orphans(SHM_DIR, cluster.cluster_id) == 1
    assert cluster.leftover_region_files() == [], "the reaper removes a dead segment's socket with its region"
