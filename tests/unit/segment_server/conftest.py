"""Fixtures of the shm grant tests (test_shm_grant.py, test_shm_writers.py; other modules here define
their own `region`): a real region of 4 MiB and its grant socket path (the grant loop: tests/unit/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.segment_server.region import DramRegion, grant_socket_path, region_path

REGION_BYTES = 4 << 20


@pytest.fixture
def region(tmp_path: Path):
    region = DramRegion(region_path(str(tmp_path), "tg", "seg0"), REGION_BYTES, "tg", "seg0").open()
    yield region
    region.close()


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return grant_socket_path(str(tmp_path), "tg", "seg0")
