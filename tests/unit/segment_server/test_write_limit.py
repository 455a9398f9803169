"""The offload bandwidth cap (--ssd-write-limit) on a fake clock: a token bucket per offloaded record."""

from __future__ import annotations

from kvtier.segment_server.config import SegmentConfig
from kvtier.segment_server.write_limit import WriteLimit


def test_unlimited_never_waits():
    limit = WriteLimit(0)
    assert [limit.delay(1 << 30) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_paces_records_to_the_rate_after_one_burst():
    now = [0.0]
    limit = WriteLimit(1000, clock=lambda: now[0])  # burst: a tenth of a second, 100 bytes
    waits = []
    for _ in range(10):
        wait = limit.delay(100)
        waits.append(wait)
        now[0] += wait  # take() sleeps that long
    assert waits[0] == 0.0
    assert abs(now[0] - 0.9) < 1e-9  # 1000 bytes at 1000 B/s, the first 100 free


def test_a_record_larger_than_the_burst_goes_then_its_debt_is_paid():
    now = [0.0]
    limit = WriteLimit(1000, clock=lambda: now[0])
    assert limit.delay(1000) == 0.0  # the bucket was full
    assert abs(limit.delay(10) - 0.91) < 1e-9  # 900 bytes of debt plus this record's 10


def test_the_segment_option_takes_human_sizes():
    assert SegmentConfig(master="127.0.0.1:1", ssd_write_limit="2MiB").ssd_write_limit_bytes == 2 << 20


def test_a_capped_worker_asks_for_about_a_second_of_records_per_poll():
    assert WriteLimit(0).max_tasks(256) == 256
    assert WriteLimit(2 << 20).max_tasks(256) == 2
    assert WriteLimit(100 << 10).max_tasks(256) == 1
    assert WriteLimit(10 << 30).max_tasks(256) == 256
