"""`kvtier bench` reads its figures against the limits it measured in the same run (issue 19)."""

from __future__ import annotations

from kvtier.bench.limits import Limits, echo_round_trip_ms, loopback_gbps, memcpy_gbps
from kvtier.bench.run import Result, latency_ratios, wire_ratios

MiB = 1 << 20


def result(workload: str, size: int, gbps: float = 0.0, p50_ms: float = 0.0) -> Result:
    return Result(workload, size, 32, gbps, 0.0, 0.0, p50_ms, p50_ms)


def test_each_wire_figure_is_read_against_its_transports_limit():
    limits = Limits(memcpy_gbps=8.0, loopback_gbps=5.0)
    by_transport = {
        "tcp": [result("batch_put", MiB, 4.5), result("batch_get_into", 4 * MiB, 3.0), result("get", MiB, 9.9)],
        "shm": [result("batch_put", 64 << 10, 2.5), result("batch_get_into", MiB, 7.0)],
    }
    rows = {(w.transport, w.workload, w.size): w for w in wire_ratios(by_transport, limits)}
    assert set(rows) == {
        ("tcp", "batch_put", MiB),
        ("tcp", "batch_get_into", 4 * MiB),
        ("shm", "batch_put", 64 << 10),
        ("shm", "batch_get_into", MiB),
    }  # single-key workloads are not wire figures
    assert rows[("tcp", "batch_put", MiB)].ratio == 0.9 and rows[("tcp", "batch_put", MiB)].met
    assert rows[("tcp", "batch_get_into", 4 * MiB)].ratio == 0.6 and not rows[("tcp", "batch_get_into", 4 * MiB)].met
    assert rows[("shm", "batch_put", 64 << 10)].met  # 64 KiB: an absolute 2.0 GB/s over shm
    assert rows[("shm", "batch_get_into", MiB)].ratio == 7.0 / 8.0 and rows[("shm", "batch_get_into", MiB)].met


def test_small_operations_are_read_against_the_peers_single_set_and_get():
    ours = [result("put", 4096, p50_ms=0.3), result("get", 4096, p50_ms=0.2), result("batch_put", 4096, p50_ms=0.6)]
    peer = [result("put", 4096, p50_ms=0.1), result("get", 4096, p50_ms=0.1), result("batch_put", 4096, p50_ms=0.2)]
    rows = {r.name: r for r in latency_ratios(ours, peer)}
    assert [round(r.ratio, 6) for r in rows.values()] == [3.0, 2.0, 6.0]  # batch_put against ONE SET
    assert [r.met for r in rows.values()] == [True, False, False]


def test_each_small_operation_is_shown_beside_its_round_trip_floor():
    ours = [result("put", 4096, p50_ms=0.9), result("get", 4096, p50_ms=0.4), result("batch_put", 4096, p50_ms=1.0)]
    peer = [result("put", 4096, p50_ms=0.1), result("get", 4096, p50_ms=0.2), result("batch_put", 4096, p50_ms=0.2)]
    rows = {r.name: r for r in latency_ratios(ours, peer, echo_ms=0.05)}
    # a put is three round trips (PutStart, the WRITE with its COMMIT, the segment's relay), a repeated
    # get one (a direct read)
    assert [r.round_trips for r in rows.values()] == [3, 1, 3]
    # floor = round trips x echo / the peer's p50: a put cannot be under 1.5x a SET here, a get under 0.25x a GET
    assert [round(r.floor_ratio, 6) for r in rows.values()] == [1.5, 0.25, 1.5]
    assert all(r.floor_ratio == 0 for r in latency_ratios(ours, peer))  # no echo measured: no floor


def test_an_echo_round_trip_is_measured_against_a_uvloop_server():
    assert 0 < echo_round_trip_ms(samples=50) < 1000


def test_the_limits_are_measured():
    assert memcpy_gbps(repeat=1, total=64 * MiB) > 0
    assert loopback_gbps(repeat=1, total=16 * MiB) > 0


def test_the_metadata_rates_at_scale_are_read_against_the_first_checkpoint_of_the_same_run():
    from kvtier.bench.master_bench import Checkpoint, MasterResult, default_checkpoints, rate_ratios

    def result(*checkpoints: Checkpoint) -> MasterResult:
        return MasterResult(10, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0, 0, list(checkpoints))

    at_1m = Checkpoint(1_000_000, 100.0, 400.0, 200.0, 240.0)
    at_10m = Checkpoint(10_000_000, 90.0, 300.0, 200.0, 235.0)
    assert rate_ratios(result(at_1m, at_10m)) == {
        "put_keys_per_s": 0.9,
        "exists_keys_per_s": 0.75,
        "get_replicas_keys_per_s": 1.0,
    }
    assert rate_ratios(result(at_10m)) == {}  # one checkpoint: nothing to compare
    assert default_checkpoints(10_000_000) == [1_000_000] and default_checkpoints(1_000_000) == []
