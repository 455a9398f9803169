"""Shared fixtures: `cluster` (a master + two 64 MiB segments as real processes), `bare_cluster`, `etcd`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.cluster import Cluster
from tests.etcd import EtcdServer, require_etcd

# CI (`.ci/run` sets CI) draws the same examples every run: a fixed seed per test, so whether a
# change lands never depends on the draw. Local runs and `make fuzz` draw new ones each time; an
# example they find failing becomes a fix and, where it is worth it, an explicit regression test.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI") and not os.environ.get("KVTIER_FUZZ_SCALE"):
    settings.load_profile("ci")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _finish(request: pytest.FixtureRequest, cluster: Cluster) -> None:
    failed = any(
        getattr(request.node, f"rep_{when}", None) and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    cluster.stop()
    if failed:
        print(cluster.logs())  # shown under "Captured stdout teardown"
    leftovers = [
        f
        for f in cluster.leftover_region_files()
        if not any(p.info.get("region") == f and p.popen.returncode == -9 for p in cluster.segments.values())
    ]
    assert not leftovers, f"region files left behind by a clean stop: {leftovers}"


@pytest.fixture
def bare_cluster(tmp_path: Path, request: pytest.FixtureRequest):
    """A cluster with nothing started: the test starts what it needs."""
    cluster = Cluster(tmp_path)
    yield cluster
    _finish(request, cluster)


@pytest.fixture
def cluster(bare_cluster: Cluster) -> Cluster:
    """A master and two 64 MiB segment servers, running."""
    bare_cluster.start_master()
    bare_cluster.start_segment("seg0")
    bare_cluster.start_segment("seg1")
    return bare_cluster


@pytest.fixture
def etcd(tmp_path: Path, request: pytest.FixtureRequest):
    """A single-member etcd on free loopback ports (see tests/etcd.py); skipped when etcd is not installed."""
    require_etcd()
    server = EtcdServer(tmp_path)
    yield server
    server.stop()
    failed = any(
        getattr(request.node, f"rep_{when}", None) and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        print(f"etcd log tail:\n{server.tail()}")
