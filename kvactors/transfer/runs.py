"""Coalescing row copies into slice copies.

A copy of ``n`` rows given as two lists of row ids can be done row by row, or
with one indexed copy (``index_copy_``, ``index_select``), but both are slow
on the CPU compared with one contiguous ``copy_`` (figures in
``docs/performance.md``). Consecutive row
ids on both sides form a *run* that one slice copy
``dst[d:d + n].copy_(src[s:s + n])`` moves at full speed.

Pure functions, no torch: tested with hypothesis.
"""

from __future__ import annotations

from collections.abc import Sequence

Run = tuple[int, int, int]
"""``(src_start, dst_start, length)``: rows ``src[s:s+n]`` go to ``dst[d:d+n]``."""


def copy_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Run]:
    """Coalesce the row pairs ``(src_ids[i], dst_ids[i])`` into maximal runs.

    Pairs are taken in the order given; a pair extends the current run when
    both its ids follow the run's last pair by exactly one. Copying the runs in
    order moves exactly the rows the pairs name, in the same order (so, should
    a destination row appear twice, the last write still wins). Every run has
    ``length >= 1``; an empty input gives ``[]``.

    Raises ``ValueError`` if the two sequences differ in length.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source rows but {len(dst_ids)} destination rows")
    runs: list[Run] = []
    if not src_ids:
        return runs
    n = len(src_ids)
    start_src, start_dst = src_ids[0], dst_ids[0]
    # The common case, whole requests of ascending rows on both sides: one run, found
    # with two C-speed comparisons instead of a Python loop over the pairs.
    if (src_ids[-1] - start_src == n - 1 and dst_ids[-1] - start_dst == n - 1
            and list(src_ids) == list(range(start_src, start_src + n))
            and list(dst_ids) == list(range(start_dst, start_dst + n))):
        return [(start_src, start_dst, n)]
    start_src = prev_src = src_ids[0]
    start_dst = prev_dst = dst_ids[0]
    length = 1
    for src, dst in zip(src_ids[1:], dst_ids[1:], strict=True):
        if src == prev_src + 1 and dst == prev_dst + 1:
            length += 1
        else:
            runs.append((start_src, start_dst, length))
            start_src, start_dst, length = src, dst, 1
        prev_src, prev_dst = src, dst
    runs.append((start_src, start_dst, length))
    return runs


def expand_runs(runs: Sequence[Run]) -> list[tuple[int, int]]:
    """The row pairs a list of runs copies, in order (the inverse of :func:`copy_runs`)."""
    return [(src + i, dst + i) for src, dst, length in runs for i in range(length)]
