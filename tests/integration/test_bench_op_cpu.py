"""`kvtier bench --compare redis`: what one small operation costs each process (bench/op_cpu.py)."""

from __future__ import annotations

from kvtier.bench.op_cpu import measure_op_cpu


def test_each_process_cpu_per_operation_puts_on_all_three_and_direct_gets_skip_the_master(cluster):
    client = cluster.client(transport="tcp")
    segments = [segment.pid for segment in cluster.segments.values()]
    rows = {row.workload: row for row in measure_op_cpu(client, cluster.master.pid, segments, ops=600)}
    assert set(rows) == {"put", "get", "batch_put"}
    assert rows["put"].ops == rows["get"].ops == 600 and rows["batch_put"].ops == 150
    put, get = rows["put"], rows["get"]
    # /proc counts clock ticks (10 ms): 600 puts spend about ten of them in each process
    assert min(put.client_us, put.master_us, put.segment_us) > 0 and put.wall_us > 0
    # a re-read key is served by its segment alone (a direct read): the master spends next to nothing
    assert client.stats()["direct_reads"] >= 600
    assert get.master_us < put.master_us / 3
    assert not any(client.batch_exists(["opcpu/put/0", "opcpu/get/0", "opcpu/bput/0/0"]))  # cleaned up
