"""The bytes a test block holds: :func:`pattern` of its key, and :func:`rows_hold` to check a pool's rows.

Every ready block of a workload of :mod:`kvactors.testing.workload` holds ``pattern(key)``.
The fault tiers fill a row of a key that must not become ready with :data:`JUNK`.
So serving it shows up as wrong bytes.
Thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import torch

from kvactors.types import OffloadKey

JUNK = 0xEE
"""What a row of a key that must not become ready is filled with."""

_patterns: dict[tuple[OffloadKey, int], torch.Tensor] = {}
_patterns_lock = threading.Lock()


def pattern(key: OffloadKey, block_bytes: int) -> torch.Tensor:
    """The bytes a block of ``key`` holds (deterministic, distinct per key)."""
    cached = _patterns.get((key, block_bytes))
    if cached is not None:
        return cached
    digest = hashlib.blake2b(key, digest_size=32).digest()
    raw = (digest * (block_bytes // len(digest) + 1))[:block_bytes]
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with _patterns_lock:
        if len(_patterns) > 100_000:
            _patterns.clear()
        _patterns[(key, block_bytes)] = tensor
    return tensor


def rows_hold(pool: torch.Tensor, keys: Sequence[OffloadKey], rows: Sequence[int]) -> list[int]:
    """Positions where ``pool[row]`` does not hold ``pattern(key)``."""
    block_bytes = int(pool.shape[1])
    return [i for i, (key, row) in enumerate(zip(keys, rows, strict=True))
            if not torch.equal(pool[row], pattern(key, block_bytes))]


