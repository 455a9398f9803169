"""The master's clock as a segment keeps it (kvtier.segment_server.master_clock): grant ends are judged
on it, so it may run ahead of the master's (grants end early) but never behind (ended grants served)."""

from __future__ import annotations

import pytest

from kvtier.segment_server import master_clock
from kvtier.segment_server.master_clock import MasterClock


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(master_clock, "local_s", lambda: now[0])
    return now


def test_a_reply_held_up_for_seconds_never_puts_the_estimate_behind_the_master(local):
    """The master stamped its reply 0.5 s after our send; the reply then sat 11.5 s in a socket (a
    master or segment stopped while it was in flight). Taken at the middle of the round trip the
    estimate was 5.5 s behind, and grants that had ended (ranges the master had reused) were served."""
    clock = MasterClock()
    master_at_send = 5_000_000
    sent = local[0]
    local[0] = sent + 12.0
    clock.observe(sent, local[0], master_at_send + 500)
    true_master_now = master_at_send + 12_000
    assert clock.now_ms() >= true_master_now
    assert clock.now_ms() - true_master_now <= 500  # ahead by at most the round trip's unknown part
    assert clock.rtt_ms == 12_000


def test_a_prompt_reply_gives_the_masters_clock_within_the_round_trip(local):
    clock = MasterClock()
    sent = local[0]
    local[0] = sent + 0.002
    clock.observe(sent, local[0], 7_000_001)  # stamped 1 ms after our send
    local[0] += 10.0
    assert 7_010_002 <= clock.now_ms() <= 7_010_003
