"""A client's segment failures (kvtier.client.failures): what it avoids, what it reports and when,
and that its memory stays bounded. Fake clock, no sockets."""

from __future__ import annotations

from kvtier.client import failures as f
from kvtier.client.failures import Refused, SegmentFailures, failure_kind
from kvtier.proto.errors import ConnectError, ProtocolError, ReadError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_segment_is_avoided_for_avoid_s_then_forgotten():
    clock = Clock()
    failures = SegmentFailures(avoid_s=10.0, report_interval_s=0.5, clock=clock)
    failures.note("a", "connect")
    clock.now += 4
    failures.note("b", "timeout")
    assert failures.avoid() == ["a", "b"] and failures.recently_failed() == {"a", "b"}
    clock.now += 6.5
    assert failures.avoid() == ["b"]
    clock.now += 10
    assert failures.avoid() == [] and failures.recently_failed() == frozenset()


def test_reports_are_batched_and_sent_at_most_once_per_interval():
    clock = Clock()
    failures = SegmentFailures(avoid_s=10.0, report_interval_s=0.5, clock=clock)
    assert failures.take_report() == []
    failures.note("a", "connect")
    failures.note("a", "connect")
    failures.note("a", "transfer")
    assert sorted(failures.take_report()) == [("a", 1, "transfer"), ("a", 2, "connect")]
    failures.note("a", "timeout")
    assert failures.take_report() == [], "within the interval: kept for later"
    clock.now += 0.5
    assert failures.take_report() == [("a", 1, "timeout")]
    assert failures.take_report() == []


def test_memory_is_bounded_whatever_the_number_of_segments():
    clock = Clock()
    failures = SegmentFailures(avoid_s=10.0, report_interval_s=0.5, clock=clock)
    for i in range(10 * f.MAX_SEGMENTS):
        failures.note(f"seg{i}", ("connect", "timeout", "transfer")[i % 3])
    assert len(failures.avoid()) == f.MAX_SEGMENTS
    assert len(failures.avoid()[-1]) and failures.avoid()[-1] == f"seg{10 * f.MAX_SEGMENTS - 1}", "newest kept"
    assert len(failures.take_report()) <= 3 * f.MAX_SEGMENTS


def test_what_counts_as_a_failure_of_the_segment():
    assert failure_kind(ConnectError("cannot connect")) == "connect"
    assert failure_kind(BlockingIOError(11, "Resource temporarily unavailable")) == "timeout"  # SO_RCVTIMEO
    assert failure_kind(TimeoutError()) == "timeout"
    assert failure_kind(ReadError("peer closed the connection mid-frame")) == "transfer"
    assert failure_kind(ConnectionResetError()) == "transfer"
    assert failure_kind(ProtocolError("bad frame")) == "transfer"
    assert failure_kind(Refused("at its connection limit")) is None, "busy, not unreachable"


def test_one_read_call_notes_a_segment_once_however_many_of_its_attempts_fail():
    class Reporter(f.FailureReports):
        def __init__(self) -> None:
            self._failures = SegmentFailures(10.0, 0.0, Clock())

    reporter = Reporter()
    seen: set[str] = set()
    token = f.call_failures.set(seen)
    try:
        reporter._segment_failed("a", "transfer")  # the first attempt
        reporter._segment_failed("a", "timeout")  # the retry after a fresh lookup
        reporter._transport_failed("b", ConnectError("refused"))
    finally:
        f.call_failures.reset(token)
    assert seen == {"a", "b"}, "what the read path tells cut-off keys by"
    reporter._segment_failed("a", "transfer")  # the next call (or a put): noted again
    assert sorted(reporter._failures.take_report()) == [("a", 2, "transfer"), ("b", 1, "connect")]
