"""stk.train.preflight: the bucket check, rank ranges, and ranks that see other output directories."""

from __future__ import annotations

import pytest

from stk.errors import BatchCheckFailed, PreflightFailed
from stk.train.preflight import _one_view, _ranges, check_buckets


def test_short_buckets_fail_or_get_their_minimum_repeats():
    buckets = {(8, 8): ["a", "b", "c"], (8, 16): ["d"] * 10}
    with pytest.raises(BatchCheckFailed) as failed:
        check_buckets(buckets, {(8, 8): 1, (8, 16): 1}, 8, 8, oversubscribe=False)
    message = str(failed.value)
    assert "1 bucket(s)" in message and "(64x64): 3 images, 3 samples; needs --repeats >= 3" in message
    assert check_buckets(buckets, {(8, 8): 1, (8, 16): 1}, 8, 8, oversubscribe=True) == {(8, 8): 3, (8, 16): 1}
    assert check_buckets(buckets, {(8, 8): 3, (8, 16): 1}, 8, 8, oversubscribe=False) == {(8, 8): 3, (8, 16): 1}


def test_rank_ranges_read_well():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and _ranges([3]) == "3"


def test_ranks_that_see_other_output_dirs_are_grouped_by_node_the_odd_ones_last():
    """What four nodes see when node c mounts a copy of the directory and node d cannot list it."""
    reports = [(0, "a", (0, 1, 2)), (1, "a", (0, 1, 2)), (2, "b", (0, 1, 2)), (3, "c", (3,)), (4, "d", ())]
    with pytest.raises(PreflightFailed) as caught:
        _one_view("/shared/run", reports, 5)
    assert str(caught.value).splitlines()[:4] == [
        "--output-dir /shared/run is not one directory shared by every rank:",
        "  a, b, rank(s) 0-2: see the files of rank(s) 0-2 only",
        "  c, rank(s) 3: see the files of rank(s) 3 only",
        "  d, rank(s) 4: see no rank's files",
    ]
    _one_view("/shared/run", [(0, "a", (0, 1)), (1, "b", (0, 1))], 2)  # every rank saw every token
