"""The history checker under faults (tests/chaos/): client processes over tcp and shm put, get and remove
self-describing values while the harness SIGSTOPs/SIGCONTs and SIGKILLs clients, segments and the master;
every read must be one a correct cache could give (docs/testing.md).

The short run is part of `make test`; the long one (`-m chaos`) is `make test-chaos`. A failing run keeps
its whole history and the processes' logs (the path is in the failure message). Knobs: KVTIER_CHAOS_FAULTS
(comma-separated fault names, "none"), KVTIER_CHAOS_SEED, KVTIER_CHAOS_SECONDS and KVTIER_CHAOS_SSD=0 (long run),
KVTIER_ARTIFACTS (where runs are kept).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.harness import ALL_FAULTS, SHORT_RUN_FAULTS, ChaosConfig, faults_from_env, run_chaos


def seed() -> dict:
    text = os.environ.get("KVTIER_CHAOS_SEED")
    return {"seed": int(text)} if text else {}


@pytest.mark.slow  # ~22 s: make test-slow (CI runs it)
def test_short_history_under_faults_has_no_violation():
    # Faults known to produce violations on today's code (KNOWN_FAILING) are left out: see docs/testing.md.
    config = ChaosConfig(seconds=20, workers=4, segments=2, faults=faults_from_env(SHORT_RUN_FAULTS), **seed())
    result = run_chaos(config)
    assert result.report.counts["values"] > 0, "no read returned a value: the run tested nothing\n" + result.message()
    assert result.ok, result.message()


@pytest.mark.chaos
def test_long_history_under_every_fault_has_no_violation():
    config = ChaosConfig(
        seconds=float(os.environ.get("KVTIER_CHAOS_SECONDS", "600")),
        workers=8,
        segments=3,
        faults=faults_from_env(ALL_FAULTS),
        fault_gap_s=(0.2, 1.0),
        ssd=os.environ.get("KVTIER_CHAOS_SSD", "1") != "0",  # seg0 with an SSD tier
        **seed(),
    )
    result = run_chaos(config)
    assert result.report.counts["values"] > 0, "no read returned a value\n" + result.message()
    assert result.ok, result.message()
