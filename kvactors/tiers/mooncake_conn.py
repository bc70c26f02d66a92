"""One connection of :class:`~kvactors.tiers.mooncake.MooncakeTier` to a Mooncake Store,
and the per-thread staging buffers its zero-copy calls use.

A :class:`Conn` is a ``MooncakeDistributedStore`` set up against the master.
The tier's pool is registered with it, so that stores send the rows themselves.
The tier never closes one while it runs.
Mooncake's ``close`` holds the GIL for seconds (see ``MooncakeTier.shutdown``).

Threading: every method may be called from any thread.
The buffers of :func:`thread_buffers` belong to the calling thread.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class Conn:
    """A set-up store client and its generation (one per connection of the tier)."""

    def __init__(self, store: Any, generation: int) -> None:
        self.store = store
        self.generation = generation


class ThreadBuffers(threading.local):
    """One thread's staging area, registered with one connection."""

    def __init__(self) -> None:
        self.generation = -1
        self.stage = np.zeros(0, dtype=np.uint8)


_BUFFERS = ThreadBuffers()


def thread_buffers(conn: Conn, stage_bytes: int) -> np.ndarray:
    """This thread's staging array, at least ``stage_bytes``, registered with ``conn``.

    It grows (never shrinks) and is registered again with each new connection. ``OSError``
    if Mooncake refuses the registration."""
    buffers = _BUFFERS
    fresh = buffers.generation != conn.generation
    array = buffers.stage
    if stage_bytes > array.nbytes:
        if not fresh and array.nbytes:
            conn.store.unregister_buffer(array.ctypes.data)
        array = buffers.stage = np.empty(-(-stage_bytes // (1 << 20)) << 20, dtype=np.uint8)
    elif not fresh:
        return array
    buffers.generation = -1
    code = conn.store.register_buffer(array.ctypes.data, array.nbytes)
    if code != 0:
        raise OSError(f"mooncake register_buffer failed: code {code}")
    buffers.generation = conn.generation
    return array
