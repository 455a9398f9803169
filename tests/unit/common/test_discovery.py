"""MasterLocator without etcd (address lists), leader hints and the leader-key contract."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvtier.common.discovery import MasterLocator, leader_hint, leader_key, leader_value, parse_leader_value


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        ("not the leader; leader=10.0.0.2:5000", "10.0.0.2:5000"),
        ("not the leader; leader=", ""),
        ("not the leader; leader=host.example:7000; epoch=12", "host.example:7000"),
        ("not the leader; leader=[::1]:5000, retry", "[::1]:5000"),
        ("connection refused", ""),
        ("", ""),
        ("follower=1.2.3.4:5", ""),  # `leader=` must start a word
    ],
)
def test_leader_hint(error, hint):
    assert leader_hint(error) == hint


def test_leader_value_round_trips_and_tolerates_foreign_values():
    info = {"address": "h:1", "fast_endpoint": "tcp://h:2", "pid": 7, "name": "m0"}
    assert leader_key("c1") == "/kvtier/c1/leader"
    assert parse_leader_value(leader_value(info)) == info
    assert parse_leader_value(b"not json") == {}
    assert parse_leader_value(b"[1, 2]") == {}
    assert parse_leader_value(b"\xff\xfe") == {}


def test_single_address_stays_put():
    locator = MasterLocator("127.0.0.1:5000")
    assert not locator.is_multi
    assert locator.address == "127.0.0.1:5000"
    assert locator.refresh() == "127.0.0.1:5000"
    assert locator.refresh(hint="127.0.0.1:6000") == "127.0.0.1:6000"  # a standby's hint wins even here


def test_list_rotates_and_a_hint_wins():
    locator = MasterLocator("a:1, b:2,c:3")
    assert locator.is_multi
    assert locator.address == "a:1"
    assert [locator.refresh() for _ in range(4)] == ["b:2", "c:3", "a:1", "b:2"]
    assert locator.refresh(hint="c:3") == "c:3"
    assert locator.address == "c:3"
    assert locator.refresh() == "a:1"
    assert locator.refresh(hint="d:4") == "d:4"  # not listed: a standby knows better than our list
    assert locator.refresh() == "a:1"  # back to the list's start


def in_refresh(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "refresh":
            return True
        frame = frame.f_back
    return False


def test_concurrent_refreshes_after_one_failure_rotate_once():
    """Threads that all saw a:1 fail must all land on b:2, not skip it by rotating once each."""
    locator = MasterLocator("a:1,b:2,c:3")
    results: list[str] = []
    with locator._lock:  # hold the rotation so every thread has called refresh() before the first rotates
        threads = [threading.Thread(target=lambda: results.append(locator.refresh())) for _ in range(8)]
        for t in threads:
            t.start()
        # every thread is inside refresh() (waiting for the lock we hold), seen, not guessed by a sleep
        deadline = time.monotonic() + 10
        while not all(in_refresh(t) for t in threads):
            assert time.monotonic() < deadline, "threads never reached refresh()"
            time.sleep(0.001)
    for t in threads:
        t.join()
    assert results == ["b:2"] * 8
    assert locator.refresh() == "c:3"  # a later failure rotates again


@pytest.mark.parametrize("spec", ["", " , ", "nohost", "h:", ":5", "h:port", "etcd://h:1", "etcd://h:1/bad.name"])
def test_bad_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        MasterLocator(spec)
