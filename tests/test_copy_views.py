"""kvactors.transfer.views: wide views move the same bytes; copy_all equals a loop of copy_."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors.transfer.views import copy_all, widest_views

pytestmark = pytest.mark.timeout(60)


def _layout(layers: int, page: int, rows: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A device tensor of one layer, and the pool (rows of every layer's page) with that layer's column."""
    gen = torch.Generator().manual_seed(layers * 1000 + page)
    dev = torch.randint(0, 256, (rows, page), dtype=torch.uint8, generator=gen)
    pool = torch.zeros(rows, layers * page, dtype=torch.uint8)
    return dev, pool, pool[:, layer * page:(layer + 1) * page]


@pytest.mark.parametrize(("page", "dtype"),
                         [(4096, torch.int64), (12, torch.int32), (6, torch.int16), (7, torch.uint8)])
def test_the_widest_type_all_tensors_allow_is_chosen(page: int, dtype: torch.dtype) -> None:
    dev, _, column = _layout(3, page, 8, 1)
    wide_dev, wide_column = widest_views(dev, column)
    assert wide_dev.dtype == wide_column.dtype == dtype
    assert wide_dev.data_ptr() == dev.data_ptr() and wide_column.data_ptr() == column.data_ptr()


def test_a_misaligned_column_keeps_the_narrower_type() -> None:
    dev = torch.zeros(4, 16, dtype=torch.uint8)
    pool = torch.zeros(4, 40, dtype=torch.uint8)
    column = pool[:, 2:18]  # starts 2 bytes into each row: int16 at most
    assert widest_views(dev, column)[1].dtype == torch.int16
    assert widest_views(dev.t())[0].dtype == torch.uint8  # last dimension not contiguous


def test_other_dtypes_are_left_alone() -> None:
    t = torch.zeros(4, 16, dtype=torch.float32)
    assert widest_views(t)[0] is t


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 5), page=st.integers(1, 40), rows=st.integers(1, 12), data=st.data())
def test_copies_through_wide_views_move_exactly_the_bytes_of_uint8_copies(
        layers: int, page: int, rows: int, data: st.DataObject) -> None:
    layer = data.draw(st.integers(0, layers - 1))
    start = data.draw(st.integers(0, rows - 1))
    n = data.draw(st.integers(1, rows - start))
    dev, pool, column = _layout(layers, page, rows, layer)
    expected = pool.clone()
    expected[:, layer * page:(layer + 1) * page][start:start + n] = dev[start:start + n]
    wide_dev, wide_column = widest_views(dev, column)
    copy_all([wide_column[start:start + n]], [wide_dev[start:start + n]])
    assert torch.equal(pool, expected)
    dev.zero_()
    copy_all([wide_dev[start:start + n]], [wide_column[start:start + n]])  # and back
    assert torch.equal(dev[start:start + n], expected[:, layer * page:(layer + 1) * page][start:start + n])


def test_copy_all_equals_a_loop_of_copies() -> None:
    srcs = [torch.randint(0, 256, (5, 64), dtype=torch.uint8) for _ in range(6)]
    dsts = [torch.zeros(5, 64, dtype=torch.uint8) for _ in range(6)]
    copy_all(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_copy_all_falls_back_to_one_copy_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("not on this build")

    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    srcs = [torch.randint(0, 256, (3, 8), dtype=torch.uint8) for _ in range(3)]
    dsts = [torch.zeros(3, 8, dtype=torch.uint8) for _ in range(3)]
    copy_all(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_copy_all_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 destinations but 1 sources"):
        copy_all([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
