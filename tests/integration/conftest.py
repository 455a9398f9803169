"""Integration-tier helpers on top of the shared `cluster` / `bare_cluster` fixtures."""

from __future__ import annotations

import pytest

from kvtier.segment_server.region import SHM_DIR, remove_orphans


@pytest.fixture(autouse=True)
def _reap_killed_segment_regions(request: pytest.FixtureRequest):
    """Remove the region files SIGKILLed segments leave in /dev/shm (64 MiB each) after the test.

    Only files whose owner is dead are removed (`remove_orphans` skips locked
    ones), so the clean-stop leftover check of the shared fixture still applies
    to every live segment.
    """
    cluster = request.getfixturevalue("bare_cluster") if "bare_cluster" in request.fixturenames else None
    yield
    if cluster is not None:
        remove_orphans(SHM_DIR, cluster.cluster_id)


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Run a test once per data-plane transport the client can be forced to (`Client(transport=...)`)."""
    return request.param
