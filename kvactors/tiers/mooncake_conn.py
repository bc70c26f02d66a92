"""One connection of :class:`~kvactors.tiers.mooncake.MooncakeTier` to a Mooncake Store,
and the per-thread staging buffers its zero-copy calls use.

A connection has the tier's pool registered (stores send the rows themselves).

A :class:`Conn` is a ``MooncakeDistributedStore`` set up against the master. When the
tier gives it up (its master restarted, or stopped answering)
it is *retired*: closed by the last call that used it, on that call's lane thread, never
under a call still running on it (Mooncake's ``close`` is not safe against those).

Threading: every method may be called from any thread; the buffers of
:func:`thread_buffers` belong to the calling thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np


class Conn:
    """A set-up store client and the calls running on it (see the module)."""

    def __init__(self, store: Any, generation: int) -> None:
        self.store = store
        self.generation = generation
        self._lock = threading.Lock()
        self._calls = 0
        self._retired = False
        self._closed = False

    @contextlib.contextmanager
    def using(self) -> Iterator[Any]:
        """The store, for one call; a retired connection is closed when its last call ends."""
        with self._lock:
            self._calls += 1
        try:
            yield self.store
        finally:
            with self._lock:
                self._calls -= 1
                close = self._retired and self._calls == 0 and not self._closed
                self._closed = self._closed or close
            if close:
                self._close()

    def retire(self) -> bool:
        """Mark it given up; ``True`` if no call runs on it (the caller then closes it: :meth:`close_now`)."""
        with self._lock:
            self._retired = True
            idle = self._calls == 0 and not self._closed
            self._closed = self._closed or idle
        return idle

    def close_now(self) -> None:
        """Close it (after :meth:`retire` said it was idle). Blocking: on a lane thread."""
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.close()


class ThreadBuffers(threading.local):
    """Per thread: a staging area, registered with one connection."""

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
