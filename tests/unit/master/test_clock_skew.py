"""kvtier.master.clock_skew: a skew counts only when the whole round-trip interval is beyond the tolerance."""

from __future__ import annotations

import pytest

from kvtier.master.clock_skew import read_skew


@pytest.mark.parametrize(
    ("sent", "received", "rtt", "skewed"),
    [
        (1_000, 1_000, 0, False),  # in step
        (31_000, 1_000, 0, True),  # 30 s ahead
        (1_000, 31_000, 0, True),  # 30 s behind
        (1_000, 2_500, 2_000, False),  # 1.5 s "behind" by the stamps, but a 2 s round trip explains it
        (1_000, 4_000, 1_000, True),  # 3 s behind, a 1 s round trip cannot explain more than 1 s of it
    ],
    ids=["in-step", "ahead", "behind", "slow-round-trip", "behind-despite-round-trip"],
)
def test_a_segment_is_skewed_only_beyond_what_the_round_trip_explains(sent, received, rtt, skewed):
    reading = read_skew(sent, received, rtt, tolerance_s=1.0)
    assert reading is not None and reading.skewed is skewed
    assert reading.skew_s == pytest.approx((sent - received + rtt / 2) / 1000)


def test_a_segment_that_sends_no_clock_changes_nothing():
    assert read_skew(0, 1_000, 0, tolerance_s=1.0) is None
