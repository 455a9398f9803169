"""Fixtures the unit tests of several packages share."""

from __future__ import annotations

import pytest

from tests.grants import GrantLoop


@pytest.fixture
def grants():
    """A grant loop: shm listeners served on a uvloop thread of their own, stopped at teardown."""
    loop = GrantLoop()
    yield loop
    loop.close()
