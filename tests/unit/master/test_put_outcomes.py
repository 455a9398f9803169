"""A PutEnd retried after its first answer was lost says what became of the put (master/put_outcomes.py).

A relayed PutEnd whose answer waits for a stalled segment's acknowledgement is given up by the
segment after its bound, and the client sends its own PutEnd. When the put was committed and the key
removed or replaced in between, that retry must not answer NOT_PENDING ("stores nothing"): readers
may already have read the value.
"""

from __future__ import annotations

import pytest

from kvtier.master import put_outcomes
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto.status import Status
from tests.unit.master.test_eviction import make_state
from tests.unit.master.test_state import NS, FakeClock, mount, put

OK = Status.OK
UPSERT = PutOptions(overwrite=True)


@pytest.fixture
def state() -> MasterState:
    state = make_state(FakeClock())
    mount(state, "s0", 1 << 20)
    return state


def test_a_retried_put_end_of_a_put_committed_then_removed_is_ok(state: MasterState) -> None:
    started = put(state, "k", checksum=5)
    assert state.remove(NS, ["k"]) == [OK]
    assert state.put_end(NS, ["k"], [5], started.put_id) == [OK]
    assert state.put_end(NS, ["k"], [6], started.put_id) == [Status.NOT_PENDING]  # not this put's bytes
    assert state.get_replicas(NS, ["k"]).statuses == [Status.NOT_FOUND]  # and nothing came back


def test_a_retried_put_end_of_a_put_committed_then_replaced_is_ok_and_changes_nothing(state: MasterState) -> None:
    first = put(state, "k", checksum=5)
    assert state.remove(NS, ["k"]) == [OK]
    second = put(state, "k", checksum=9)
    assert state.put_end(NS, ["k"], [5], first.put_id) == [OK]
    assert state.get_replicas(NS, ["k"]).checksums == [9]
    upsert = state.put_start(NS, ["k"], [1000], 1, UPSERT)
    assert state.put_end(NS, ["k"], [11], upsert.put_id) == [OK]
    assert state.put_end(NS, ["k"], [9], second.put_id) == [OK]  # replaced by the upsert: still stored once
    assert state.remove(NS, ["k"]) == [OK]
    assert state.put_end(NS, ["k"], [11], upsert.put_id) == [OK]  # an upsert committed, then removed
    assert state.get_replicas(NS, ["k"]).statuses == [Status.NOT_FOUND]


def test_a_put_that_never_committed_stays_not_pending(state: MasterState) -> None:
    revoked = state.put_start(NS, ["r"], [1000], 1)
    assert state.put_revoke(NS, ["r"], revoked.put_id) == [OK]
    assert state.put_end(NS, ["r"], [1], revoked.put_id) == [Status.NOT_PENDING]
    put(state, "other", checksum=3)
    assert state.put_end(NS, ["never"], [3], revoked.put_id) == [Status.NOT_PENDING]


def test_a_put_of_a_previous_incarnation_is_ok_when_its_bytes_are_stored_else_unknown(state: MasterState) -> None:
    """Its first PutEnd may have committed in the incarnation before (answer lost) and the key been
    removed or replaced since: never NOT_PENDING ("stores nothing"), which readers could contradict."""
    put(state, "k", checksum=5)
    foreign = (state.put_outcomes.first_id - 1000) % (1 << 63)  # an id this incarnation never issued
    assert state.put_end(NS, ["k"], [5], foreign) == [OK]  # e.g. recovered from a segment's inventory
    assert state.put_end(NS, ["k"], [6], foreign) == [Status.TIMEOUT]
    assert state.put_end(NS, ["gone"], [5], foreign) == [Status.TIMEOUT]


def test_what_is_forgotten_is_answered_as_unknown_never_as_not_pending(
    state: MasterState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(put_outcomes, "KEPT", 4)
    state.put_outcomes = put_outcomes.PutOutcomes(put_outcomes.KEPT)  # the bound, made small
    revoked_early = state.put_start(NS, ["r"], [1000], 1)
    assert state.put_revoke(NS, ["r"], revoked_early.put_id) == [OK]
    early = [put(state, f"k{i}", checksum=i) for i in range(6)]
    revoked_late = state.put_start(NS, ["s"], [1000], 1)
    assert state.put_revoke(NS, ["s"], revoked_late.put_id) == [OK]
    late = put(state, "late", checksum=42)
    assert state.remove(NS, [f"k{i}" for i in range(6)] + ["late"]) == [OK] * 7
    assert len(state.put_outcomes) == 4  # bounded: the oldest three were forgotten
    assert state.put_end(NS, ["k0"], [0], early[0].put_id) == [Status.TIMEOUT]  # maybe stored: unknown
    assert state.put_end(NS, ["r"], [1], revoked_early.put_id) == [Status.TIMEOUT]  # as old as the forgotten
    assert state.put_end(NS, ["s"], [1], revoked_late.put_id) == [Status.NOT_PENDING]  # newer: known
    assert state.put_end(NS, ["k5"], [5], early[5].put_id) == [OK]
    assert state.put_end(NS, ["late"], [42], late.put_id) == [OK]


def test_a_retried_group_put_end_after_a_member_left_is_ok_and_the_group_stays_broken(state: MasterState) -> None:
    keys = ["kv", "side"]
    started = state.put_start(NS, keys, [100, 100], 1)
    assert state.groups.put_end(NS, keys, [7, 8], started.put_id) == [OK, OK]
    assert state.remove(NS, ["side"]) == [OK]
    assert state.groups.put_end(NS, keys, [7, 8], started.put_id) == [OK, OK]
    assert state.groups.get_replicas(NS, keys).statuses == [Status.NOT_FOUND] * 2  # not made whole again
    assert state.exists(NS, keys)[0] == [True, False]


def test_a_group_that_never_committed_stays_not_pending(state: MasterState) -> None:
    keys = ["kv", "side"]
    started = state.put_start(NS, keys, [100, 100], 1)
    assert state.put_revoke(NS, ["side"], started.put_id) == [OK]
    assert state.groups.put_end(NS, keys, [7, 8], started.put_id) == [Status.NOT_PENDING] * 2
    assert state.groups.put_end(NS, keys, [7, 8], started.put_id) == [Status.NOT_PENDING] * 2


def test_a_retried_put_end_of_a_put_lost_with_its_segment_is_segment_not_found(state: MasterState) -> None:
    started = put(state, "k", checksum=5)
    state.unmount_segment(next(iter(state.segments)))  # its only copy goes with it
    assert state.get_replicas(NS, ["k"]).statuses == [Status.NOT_FOUND]
    assert state.put_end(NS, ["k"], [5], started.put_id) == [Status.SEGMENT_NOT_FOUND]  # never OK
    mount(state, "s1", 1 << 20)
    again = put(state, "k", checksum=5)  # the same bytes stored again: the key holds them
    assert state.put_end(NS, ["k"], [5], started.put_id) == [OK]
    assert again.put_id != started.put_id
