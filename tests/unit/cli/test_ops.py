"""`kvtier status` / `kvtier segments` rendering (cli/ops.py)."""

from __future__ import annotations

from kvtier.cli.ops import segment_dict, state_text
from kvtier.proto import master_pb2 as pb


def test_the_state_column_shows_clock_skew_and_quarantine():
    plain = segment_dict(pb.SegmentInfo(name="a", state="ACTIVE"))
    assert state_text(plain) == "ACTIVE" and plain["quarantined"] is False
    both = segment_dict(
        pb.SegmentInfo(
            name="a", state="ACTIVE", clock_skewed=True, clock_skew_s=30.0, quarantined=True, quarantine_left_s=24.6
        )
    )
    assert state_text(both) == "ACTIVE CLOCK_SKEW +30.0s QUARANTINED 25s"
    assert both["quarantined"] and both["quarantine_left_s"] == 24.6
