"""Tensor views and copy calls that move the same bytes with less work per copy.

Used by :class:`~kvactors.transfer.layouts.PageLayout` (the vLLM worker's),
whose jobs are many small strided copies (a few pages of one layer each, for
every layer). Functions of torch only; any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_WIDE_TYPES = (torch.int64, torch.int32, torch.int16)


def widest_views(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The ``uint8`` tensors viewed as the widest integer type all of them allow.

    A copy between the views moves the same bytes as 8 times fewer elements
    (``int64``). torch splits a copy across its threads by element count, and
    for a copy of a few pages that split costs more than it wins
    (``docs/performance.md``). A type is allowed when every tensor's last
    dimension is contiguous and its length, its other strides and its address
    are multiples of the type's size; otherwise the tensors come back as they are.
    """
    for dtype in _WIDE_TYPES:
        size = dtype.itemsize
        if all(t.dtype == torch.uint8 and t.dim() >= 1 and t.stride(-1) == 1 and t.shape[-1] % size == 0
               and t.data_ptr() % size == 0 and all(stride % size == 0 for stride in t.stride()[:-1])
               for t in tensors):
            return tuple(t.view(dtype) for t in tensors)
    return tensors


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, non_blocking: bool = False) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i``, in one call into torch where it can.

    ``torch._foreach_copy_`` moves a whole job's copies without a return to
    Python (and a GIL hand-off) between two of them. Where it refuses the
    tensors (mixed devices or types on some builds), the copies run one by
    one; a copy is idempotent (no ``dst`` overlaps a ``src``), so redoing
    those it may have done already is safe.
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations but {len(srcs)} sources")
    if len(dsts) > 1:
        try:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)
