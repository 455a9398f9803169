"""The little a master saves (kvtier.master.persist): its shape on disk, the file store, the epoch."""

from __future__ import annotations

import json
import time

import pytest

from kvtier.master.persist import (
    STATE_FILE,
    FileStateStore,
    NoStateStore,
    SavedState,
    StateUnreadable,
    next_standalone_epoch,
)


def saved() -> SavedState:
    return SavedState(
        epoch=42,
        segments=["seg0", "seg1"],
        instances={"llama": [2, 1, 1 << 30]},
        expelled=["seg-old"],
        direct_read_lease_ms=8000,
        owed_forgets={"seg1": [(1 << 20 | 5, "default\x00k")]},
        drained=[("seg-gone", "a1b2c3")],
    )


def test_saved_state_round_trips_through_json():
    assert SavedState.from_json(saved().to_json()) == saved()


def test_a_file_from_an_older_master_reads_with_defaults_for_what_it_lacks():
    assert SavedState.from_json(b'{"epoch": 7, "segments": ["a"]}') == SavedState(epoch=7, segments=["a"])
    assert SavedState.from_json(b"{}") == SavedState()
    assert SavedState.from_json(b'{"epoch": 1, "unknown": true}') == SavedState(epoch=1), "unknown fields ignored"


def test_values_are_read_as_their_types():
    state = SavedState.from_json(b'{"epoch": "9", "segments": [1], "instances": {"i": ["2", "1", "5"]}}')
    assert state == SavedState(epoch=9, segments=["1"], instances={"i": [2, 1, 5]})


def test_the_file_store_starts_empty_then_loads_what_it_saved(tmp_path):
    store = FileStateStore(str(tmp_path / "state" / "nested"))  # made when missing
    assert store.load() is None, "a first start"
    store.save(saved())
    assert FileStateStore(str(tmp_path / "state" / "nested")).load() == saved(), "a new process reads it"
    store.save(SavedState(epoch=43))
    assert store.load() == SavedState(epoch=43), "a save replaces the whole state"
    assert sorted(p.name for p in store.path.parent.iterdir()) == [STATE_FILE], "no temporary file left"
    assert json.loads(store.path.read_bytes())["epoch"] == 43


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", b'{"epoch": "soon"}', b'{"instances": {"i": 3}}'],
    ids=["not-json", "not-an-object", "bad-epoch", "bad-instance"],
)
def test_a_file_that_cannot_be_read_is_unreadable_not_empty(tmp_path, content: bytes):
    # Treating it as a first start would forget whom to wait for, and the next save would overwrite it.
    store = FileStateStore(str(tmp_path))
    store.path.write_bytes(content)
    with pytest.raises(StateUnreadable, match=STATE_FILE):
        store.load()
    assert store.path.read_bytes() == content, "loading never changes the file"


def test_without_a_store_nothing_is_kept():
    store = NoStateStore()
    store.save(saved())
    assert store.load() is None


def test_each_standalone_epoch_is_larger_than_the_last_and_than_the_clock():
    now_ms = int(time.time() * 1000)
    assert next_standalone_epoch(None) >= now_ms
    assert next_standalone_epoch(SavedState(epoch=5)) >= now_ms, "an old saved epoch: the clock wins"
    future = now_ms + 10**9  # saved by a host whose clock ran ahead, or a clock stepped back since
    assert next_standalone_epoch(SavedState(epoch=future)) == future + 1
