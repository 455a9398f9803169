"""The master's name index (kvtier.master.name_index): a sorted set whose seeks cost O(log n)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.master.name_index import LOAD, NameIndex, prefix_end


def test_adds_and_discards_keep_the_names_sorted_and_unique_across_chunk_splits():
    rng = random.Random(3)
    names = [f"ns\x00{rng.getrandbits(40):010x}" for _ in range(5 * 2 * LOAD)]
    index = NameIndex()
    for name in names:
        index.add(name)
        index.add(name)  # a second add changes nothing
    assert len(index) == len(set(names))
    assert index.after("", inclusive=True) == sorted(set(names))
    gone = set(rng.sample(names, len(names) // 2))
    for name in gone:
        index.discard(name)
        index.discard(name)  # a second discard changes nothing
    assert index.after("", inclusive=True) == sorted(set(names) - gone)
    assert all((name in index) == (name not in gone) for name in names)


def test_a_seek_gives_the_names_after_a_start_before_an_end_up_to_a_limit():
    index = NameIndex()
    index.add_many(f"ns\x00k{i:04d}" for i in range(3000))
    assert index.after("ns\x00k0100", limit=2) == ["ns\x00k0101", "ns\x00k0102"]
    assert index.after("ns\x00k0100", limit=2, inclusive=True) == ["ns\x00k0100", "ns\x00k0101"]
    assert index.after("ns\x00k0998", end="ns\x00k1001") == ["ns\x00k0999", "ns\x00k1000"]
    assert index.after("ns\x00k2999") == []
    assert index.after("zz") == []
    assert index.after("ns\x00k02", end=prefix_end("ns\x00k02"), limit=0, inclusive=True) == [
        f"ns\x00k02{i:02d}" for i in range(100)
    ]


def test_prefix_end_bounds_exactly_the_names_with_the_prefix():
    assert prefix_end("") == ""
    assert prefix_end("ns\x00ab") == "ns\x00ac"
    assert "ns\x00ab\uffff" < prefix_end("ns\x00ab") <= "ns\x00ac"


def test_prefix_end_of_a_prefix_ending_in_the_largest_code_point():
    largest = chr(0x10FFFF)
    assert prefix_end("ns\x00a" + largest) == "ns\x00b"
    assert prefix_end("ns\x00a" + largest * 3) == "ns\x00b"
    assert prefix_end(largest * 2) == "", "nothing is greater: no bound"
    names = ["ns\x00a", "ns\x00a" + largest, "ns\x00a" + largest + "x", "ns\x00a" + largest * 2, "ns\x00b"]
    end = prefix_end("ns\x00a" + largest)
    assert [n for n in names if "ns\x00a" + largest <= n < end] == names[1:4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.text("abc", max_size=4)), max_size=300), st.text("abc", max_size=3))
def test_the_index_agrees_with_a_sorted_set(ops, start):
    index, model = NameIndex(), set()
    for add, name in ops:
        (index.add if add else index.discard)(name)
        (model.add if add else model.discard)(name)
    assert len(index) == len(model)
    assert index.after(start) == sorted(n for n in model if n > start)
    assert index.after(start, inclusive=True, limit=3) == sorted(n for n in model if n >= start)[:3]
