"""The freezer keeps the cyclic collector off the master's long-lived records (master/long_lived.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvtier.master.config import MasterConfig
from kvtier.master.long_lived import LongLivedFreezer


def test_it_freezes_at_the_minimum_then_at_each_quarter_of_growth_never_under_churn():
    calls = []
    freezer = LongLivedFreezer(growth=0.25, minimum=1000, freeze=lambda: calls.append(1))
    assert not freezer.observe(999)
    assert freezer.observe(1000) and len(calls) == 1
    assert not any(freezer.observe(n) for n in (1100, 1249, 1000, 1249))  # churn around the same size
    assert freezer.observe(1250) and len(calls) == 2
    assert not freezer.observe(1500)
    assert freezer.observe(1563) and freezer.freezes == 3


def test_zero_switches_it_off():
    calls = []
    freezer = LongLivedFreezer(minimum=0, freeze=lambda: calls.append(1))
    assert not freezer.observe(10_000_000) and calls == []


class Record:
    __slots__ = ("name", "replicas", "__weakref__")  # tracked by the collector, like the master's records

    def __init__(self, name: str) -> None:
        self.name, self.replicas = name, (1, 2)


def test_frozen_records_leave_the_collectors_generations_and_removed_ones_are_still_freed():
    gc.collect()
    table = {f"k{i}": Record(f"k{i}") for i in range(20_000)}
    try:
        assert LongLivedFreezer(minimum=len(table)).observe(len(table))
        tracked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert not any(id(r) in tracked for r in table.values())  # a full collection walks none of them
        assert gc.get_freeze_count() >= len(table)
        probe = table.pop("k0")
        freed = weakref.ref(probe)
        before = gc.get_freeze_count()
        del probe  # reference counting frees a frozen object that no table holds
        # (the count may fall by more: threads left by other tests free frozen objects of their own)
        assert freed() is None and gc.get_freeze_count() <= before - 1
    finally:
        gc.unfreeze()


def test_a_negative_minimum_is_refused_in_one_line():
    with pytest.raises(ValueError, match="gc_freeze_min_objects must be >= 0"):
        MasterConfig(gc_freeze_min_objects=-1).validate()


def test_a_reset_unfreezes_so_replaced_tables_can_be_collected_and_counts_anew():
    calls = []
    freezer = LongLivedFreezer(minimum=100, freeze=lambda: calls.append(1))
    assert freezer.observe(1000)
    gc.freeze()  # what the real freeze did
    try:
        freezer.reset()
        assert gc.get_freeze_count() == 0
        assert freezer.observe(100) and len(calls) == 2  # a new epoch's tables: frozen again from the minimum
    finally:
        gc.unfreeze()
