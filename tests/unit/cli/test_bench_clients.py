"""`kvtier bench --clients N` reads each many-client figure against one client alone (issue 19)."""

from __future__ import annotations

import os
import time

from kvtier.bench.clients import ClientsResult, cpu_seconds, needed_dram, overlap_rates, verdicts

MiB = 1 << 20


def result(clients: int, gbps: float, rates: list[float], errors: int = 0, fair: bool = True) -> ClientsResult:
    return ClientsResult("tcp", "batch_put", MiB, clients, gbps, rates, 0.0, errors, 0.1, 0.1, 0.05, 1.0, fair=fair)


def test_many_clients_must_match_one_be_fair_and_make_no_errors():
    one = result(1, 3.0, [3.0])
    rows = verdicts([one, result(4, 3.1, [0.8, 0.8, 0.7, 0.8])])
    assert len(rows) == 1 and rows[0]["met"] and rows[0]["clients"] == 4
    assert not verdicts([one, result(4, 2.9, [0.7] * 4)])[0]["met"]  # the aggregate fell below one client
    assert not verdicts([one, result(4, 3.5, [1.5, 0.5, 0.8, 0.7], fair=False)])[0]["met"]
    assert not verdicts([one, result(4, 3.5, [0.9] * 4, errors=1)])[0]["met"]


def test_cpu_seconds_come_from_proc_and_grow_with_work():
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # burn CPU, not wall time
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.1


def test_each_segment_gets_room_for_every_clients_puts_of_one_workload():
    # 4 clients, 32 x 1 MiB batches, 256 MiB per run: 8 batches + the read set each, twice over 2 segments.
    assert needed_dram(4, [MiB], 32, 256 * MiB, 2) == 2 * 4 * (256 + 32) * MiB // 2


def test_per_client_rates_are_taken_while_every_client_ran():
    """Fixed work each: a client that finished first is not credited with the machine it left."""
    fast = [0.0, 1.0, 2.0, 3.0, 4.0]  # four batches, one a second
    slow = [0.0, 2.0, 4.0, 6.0, 8.0]  # the same work at half the speed
    assert overlap_rates([fast, slow], 10) == [10.0, 5.0]  # over [0, 4]: 4 and 2 batches
    # The batch in flight at the window's edges counts in proportion; a late start shortens it.
    late = [1.0, 2.5, 4.0, 5.5]
    rates = overlap_rates([fast, late], 10)
    assert rates[0] == 10.0  # [1, 4]: batches 2-4 of the fast client
    assert abs(rates[1] - 20 / 3) < 1e-9  # 2 batches in 3 s
    assert overlap_rates([[0.0, 1.0], [2.0, 3.0]], 10) is None  # never ran together: no such window
