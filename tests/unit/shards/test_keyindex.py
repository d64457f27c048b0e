"""stk.shards.keyindex: a cache's keys as sorted columns."""

from __future__ import annotations

import numpy as np

from stk.shards.keyindex import KeyIndex


def test_keys_are_found_sorted_and_the_first_of_a_repeated_key_wins() -> None:
    index = KeyIndex()
    index.add(np.array([b"bb", b"a"], "S64"), group=0)  # stored S64: the padding is no part of a key
    index.add(np.array([b"c", b"bb", b"abc"], "S64"), group=1)
    index.freeze()
    assert index.strings() == ["a", "abc", "bb", "c"] and index.keys.itemsize == 3
    assert index.find("bb") == (0, 0)  # the first shard's, as manifest order lists it
    assert index.find("abc") == (1, 2) and index.find("a") == (0, 1)
    for absent in ("ab", "d", "abcd", "ü", ""):
        assert index.find(absent) is None, absent


def test_an_empty_index_finds_nothing() -> None:
    index = KeyIndex()
    index.freeze()
    assert len(index) == 0 and index.find("a") is None and index.strings() == []
