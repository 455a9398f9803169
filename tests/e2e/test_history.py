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
import shutil

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


@pytest.mark.slow  # ~35 s: make test-slow
def test_history_with_a_stalled_ssd_tier_under_master_kills_has_no_violation():
    """seg0's tier worker stalls on every batch of FORGETs past the master's wait for them, so removes
    are answered with their FORGETs owed (saved), and the master is killed meanwhile: no removed object
    may come back from the disk copies its successor rebuilds from (docs/architecture.md, SSD tier).
    The tree before the fix gave STALE reads here with seed 7."""
    config = ChaosConfig(
        seconds=20,
        workers=4,
        segments=2,
        dram="4MiB",  # small: values go to seg0's SSD tier
        ssd=True,
        tier_stall_s=4.0,
        faults=("kill_master", "stop_client"),
        **seed(),
    )
    result = run_chaos(config, keep=True)
    try:
        assert result.ok, result.message()
        assert result.report.counts["values"] > 0, "no read returned a value\n" + result.message()
        # FORGETs were stalled (whether a wait ran out before a kill is up to the run's timing: seed 7
        # gave three such waits in 40 s, STALE reads on the tree before)
        logs = "".join(p.read_text(errors="replace") for p in result.run_dir.glob("segment-seg0*.log"))
        assert "failpoint tier.forget reached" in logs, "no FORGET was stalled: the run did not test the stall"
    finally:
        if result.ok:
            shutil.rmtree(result.run_dir, ignore_errors=True)


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
