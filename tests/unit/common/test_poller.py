"""The master poller and its back-off (common/poller.py), on real threads.

Checked: delays double up to the cap, never exceed it with jitter, and start over after a success;
a poller retries retryable failures, logs "master unreachable" once per change of state (repeats at
DEBUG, the recovery at INFO), survives unexpected exceptions, ends on StopPolling (from the step or
from `on_failure`), and stops at once while it waits; `retry_call` repeats a call while its
condition holds and gives up (None) when it no longer does.
"""

from __future__ import annotations

import logging
import threading

import pytest

from kvtier.common.poller import Backoff, MasterPoller, StopPolling, retry_call
from tests.grants import wait_until

LOGGER = "kvtier.test.poller"
TINY = Backoff(0.001, 0.004, jitter=0.5)


def tiny() -> Backoff:
    return Backoff(TINY.first_s, TINY.max_s, TINY.jitter)


class Down(Exception):
    """The master did not answer (a retryable failure)."""


class Script:
    """A step that fails with the queued exceptions, then answers; counts its calls."""

    def __init__(self, *failures: BaseException, pause: float = 0.0) -> None:
        self.failures = list(failures)
        self.calls = 0
        self.pause = pause
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
        return self.pause


def run_until(poller: MasterPoller, done) -> None:
    poller.start()
    try:
        assert wait_until(done, timeout=10), "the poller did not get there"
    finally:
        assert poller.stop(timeout=10), "the poller did not stop"


# ------------------------------------------------------------------ Backoff


def test_delays_double_up_to_the_cap_and_start_over_after_a_reset():
    backoff = Backoff(0.05, 0.5, jitter=0)
    assert [backoff.next() for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert backoff.failures == 6
    backoff.reset()
    assert (backoff.next(), backoff.failures) == (0.05, 1)


def test_jitter_only_shortens_a_delay_within_its_share():
    backoff = Backoff(0.1, 0.1, jitter=0.2)
    delays = [backoff.next() for _ in range(200)]
    assert all(0.08 <= d <= 0.1 for d in delays)
    assert len(set(delays)) > 1, "no jitter at all"


@pytest.mark.parametrize(("first", "cap", "jitter"), [(0, 1, 0), (2, 1, 0), (0.1, 1, 1.0), (0.1, 1, -0.1)])
def test_a_nonsensical_backoff_is_refused(first, cap, jitter):
    with pytest.raises(ValueError, match="back-off"):
        Backoff(first, cap, jitter)


# ------------------------------------------------------------------ MasterPoller


def test_failures_are_retried_and_logged_once_per_change_of_state(caplog):
    step = Script(Down("refused"), Down("refused"), Down("refused"), KeyError("bug"), Down("refused"), pause=0.01)
    poller = MasterPoller(
        "test loop", step, retryable=(Down,), backoff=tiny(), logger=logging.getLogger(LOGGER), thread_name="t"
    )
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        run_until(poller, lambda: step.calls >= 6)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    unreachable = [(level, m) for level, m in lines if "test loop: master unreachable (refused); retrying in" in m]
    assert [level for level, _ in unreachable] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]
    assert any(level == logging.ERROR and m.startswith("test loop failed; retrying in") for level, m in lines)
    answers = [m for level, m in lines if level == logging.INFO]
    assert answers and answers[0] == "test loop: master answers again after 5 failures"
    assert poller.backoff.failures == 0 and poller.backoff.current_s == TINY.first_s


def test_on_failure_names_the_failure_and_may_end_the_poller(caplog):
    seen: list[BaseException] = []

    def on_failure(exc: BaseException) -> str:
        seen.append(exc)
        if len(seen) == 2:
            raise StopPolling
        return "code=UNAVAILABLE"

    step = Script(Down("a"), Down("b"), Down("never reached"))
    poller = MasterPoller("link", step, retryable=(Down,), backoff=tiny(), on_failure=on_failure)
    with caplog.at_level(logging.WARNING, logger="kvtier.common.poller"):
        poller.run()  # returns: StopPolling ended it
    assert [str(e) for e in seen] == ["a", "b"] and step.calls == 2
    assert "link: master unreachable (code=UNAVAILABLE); retrying in" in caplog.text


def test_a_step_that_raises_stop_polling_ends_the_loop():
    step = Script(Down("x"), StopPolling())
    poller = MasterPoller("feed", step, retryable=(Down,), backoff=tiny())
    poller.run()
    assert step.calls == 2


def test_stop_ends_a_poller_that_waits_between_steps_at_once():
    step = Script(pause=3600.0)  # the step's pace: an hour; stop() must not wait for it
    stop = threading.Event()
    poller = MasterPoller("slow", step, retryable=(Down,), stop=stop)
    poller.start()
    assert wait_until(lambda: step.calls == 1, timeout=10)
    assert poller.stop(timeout=10), "stop() waited for the step's pause"
    assert stop.is_set() and step.calls == 1


def test_stop_ends_a_poller_that_backs_off_at_once():
    step = Script(*[Down("down")] * 100)
    poller = MasterPoller("down", step, retryable=(Down,), backoff=Backoff(3600.0, 3600.0))
    poller.start()
    assert wait_until(lambda: step.calls == 1, timeout=10)
    assert poller.stop(timeout=10), "stop() waited for the back-off"
    assert step.calls == 1


def test_a_poller_stopped_before_it_started_is_ended():
    poller = MasterPoller("idle", Script(), retryable=(Down,))
    assert poller.stop(timeout=1)


# ------------------------------------------------------------------ retry_call


def test_retry_call_repeats_until_the_call_answers():
    step = Script(Down("1"), Down("2"), pause=7.0)
    assert (
        retry_call(step, retryable=(Down,), go_on=lambda: True, stop=threading.Event(), what="r", backoff=tiny()) == 7.0
    )
    assert step.calls == 3


def test_retry_call_gives_up_when_its_condition_ends_or_on_stop(caplog):
    mounted = [True, True, False]
    step = Script(*[Down("down")] * 10)
    with caplog.at_level(logging.WARNING, logger="kvtier.common.poller"):
        got = retry_call(
            step, retryable=(Down,), go_on=lambda: mounted.pop(0), stop=threading.Event(), what="report", backoff=tiny()
        )
    assert got is None and step.calls == 3
    assert caplog.text.count("report failed (down); retrying in") == 2
    stop = threading.Event()
    stop.set()
    step = Script(*[Down("down")] * 10)
    assert retry_call(step, retryable=(Down,), go_on=lambda: True, stop=stop, what="r") is None
    assert step.calls == 1


def test_retry_call_lets_other_exceptions_through():
    with pytest.raises(KeyError):
        retry_call(Script(KeyError("bug")), retryable=(Down,), go_on=lambda: True, stop=threading.Event(), what="r")
