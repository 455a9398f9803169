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


def test_a_held_up_reply_that_agrees_with_a_tighter_estimate_leaves_it(local):
    """After a prompt exchange, a reply held up 12 s changes nothing (the estimate is still within what
    it proves): taking its latest bound ran the clock 11.5 s ahead, refusing valid grants meanwhile."""
    clock = MasterClock()
    sent = local[0]
    local[0] = sent + 0.001
    clock.observe(sent, local[0], 5_000_000)  # prompt: the master's clock 5,000,000 at our send
    sent = local[0] = sent + 10.0
    local[0] = sent + 12.0
    clock.observe(sent, local[0], 5_010_000 + 500)  # stamped 0.5 s after its send, received 11.5 s later
    truth = 5_000_000 + 22_001
    assert abs(clock.now_ms() - truth) <= 1  # (float ms rounding)


def test_a_reply_that_proves_the_estimate_behind_moves_it_to_the_latest_bound(local):
    """The master's clock stepped forward 5 s (or the estimate was behind): the next reply's earliest
    bound is past the estimate, which must never stay behind (ended grants would be served)."""
    clock = MasterClock()
    sent = local[0]
    local[0] = sent + 0.001
    clock.observe(sent, local[0], 5_000_000)
    sent = local[0] = sent + 1.0
    local[0] = sent + 0.002
    clock.observe(sent, local[0], 5_006_000)  # 5 s more than our clock says passed
    assert clock.now_ms() >= 5_006_000
