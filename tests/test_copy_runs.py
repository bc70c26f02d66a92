"""``copy_runs``: coalescing row pairs into slice copies."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvactors.transfer.runs import copy_runs, expand_runs

ids = st.integers(min_value=0, max_value=40)


@st.composite
def id_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    pairs = draw(st.lists(st.tuples(ids, ids), max_size=60))
    # Mix in long consecutive stretches, the case that matters.
    if pairs and draw(st.booleans()):
        s, d = pairs[0]
        stretch = draw(st.integers(min_value=1, max_value=20))
        pairs[1:1] = [(s + i, d + i) for i in range(1, stretch)]
    return [s for s, _ in pairs], [d for _, d in pairs]


@given(id_pairs())
def test_runs_cover_exactly_the_pairs_in_order(pairs: tuple[list[int], list[int]]) -> None:
    src, dst = pairs
    runs = copy_runs(src, dst)
    assert expand_runs(runs) == list(zip(src, dst, strict=True))
    assert all(length >= 1 for _, _, length in runs)


@given(id_pairs())
def test_runs_are_maximal(pairs: tuple[list[int], list[int]]) -> None:
    runs = copy_runs(*pairs)
    for (s1, d1, n1), (s2, d2, _) in itertools.pairwise(runs):
        assert not (s2 == s1 + n1 and d2 == d1 + n1), "two adjacent runs could have been one"


@given(id_pairs())
def test_slice_copies_match_an_indexed_copy(pairs: tuple[list[int], list[int]]) -> None:
    src_ids, dst_ids = pairs
    src = torch.randint(0, 256, (64, 8), dtype=torch.uint8)
    expected = torch.zeros((64, 8), dtype=torch.uint8)
    for s, d in zip(src_ids, dst_ids, strict=True):  # row by row, last write wins
        expected[d] = src[s]
    got = torch.zeros((64, 8), dtype=torch.uint8)
    for s, d, n in copy_runs(src_ids, dst_ids):
        got[d : d + n].copy_(src[s : s + n])
    assert torch.equal(got, expected)


def test_examples() -> None:
    assert copy_runs([], []) == []
    assert copy_runs([3], [7]) == [(3, 7, 1)]
    assert copy_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    assert copy_runs([0, 1, 5, 6], [10, 11, 12, 13]) == [(0, 10, 2), (5, 12, 2)]
    assert copy_runs([2, 1, 0], [0, 1, 2]) == [(2, 0, 1), (1, 1, 1), (0, 2, 1)]


def test_length_mismatch() -> None:
    with pytest.raises(ValueError):
        copy_runs([1, 2], [1])
