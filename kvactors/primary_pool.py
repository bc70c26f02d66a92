"""The primary pool's memory: a new zeroed tensor, or a caller's, checked.

A new tensor that cannot be allocated raises a ``MemoryError`` naming its sizes.

Pure functions, for any thread.
"""

from __future__ import annotations

import os

import torch

BOOKKEEPING_BYTES_PER_BLOCK = 256
"""An upper bound of the primary's bookkeeping per pool row (``docs/performance.md``: ``bench_scale``)."""


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def allocate_pool(num_blocks: int, block_bytes: int) -> torch.Tensor:
    """The pool tensor, or a ``MemoryError`` that names the sizes (never torch's allocator text)."""
    need = num_blocks * (block_bytes + BOOKKEEPING_BYTES_PER_BLOCK)
    sizes = f"num_blocks={num_blocks} x block_bytes={block_bytes}"
    physical = _physical_memory()
    if physical is not None and need > physical:
        # Refused before trying: torch.zeros would touch every page (or the OOM killer would end it).
        raise MemoryError(f"the primary pool of {sizes} needs about {need} bytes (with its bookkeeping), "
                          f"more than this machine's {physical} bytes of memory")
    try:
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    except (RuntimeError, MemoryError) as exc:
        raise MemoryError(f"cannot allocate the primary pool of {sizes} = {num_blocks * block_bytes} bytes "
                          f"({type(exc).__name__})") from None


def check_pool(pool: object, num_blocks: int, block_bytes: int) -> torch.Tensor:
    """``pool``, if it can be the primary pool as is.

    It must be a contiguous CPU ``uint8`` tensor ``(num_blocks, block_bytes)``.
    Raises ``ValueError`` otherwise.
    """
    if (not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.device.type != "cpu"
            or tuple(pool.shape) != (num_blocks, block_bytes) or not pool.is_contiguous()):
        got = f"{pool.dtype} {tuple(pool.shape)} on {pool.device}" if isinstance(pool, torch.Tensor) \
            else type(pool).__name__
        raise ValueError(f"pool must be a contiguous CPU uint8 tensor of shape ({num_blocks}, {block_bytes}), "
                         f"got {got}")
    return pool
