"""The eviction policy interface."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from kvactors.types import OffloadKey


class EvictionPolicy(Protocol):
    """Orders the *evictable* keys of a pool: resident, ready, and not in use.

    Preconditions (the pool guarantees):

    * Every call comes from the one thread that owns the pool (the primary tier's
      actor), one at a time: no method needs to be thread-safe.
    * :meth:`add` is called when a key becomes evictable, only for a key not
      tracked already; :meth:`discard` when it stops being so (pinned, being
      written, removed); :meth:`access` when it is used (tracked or not).
    * :meth:`victim` is asked only when the pool needs room; the key it returns is
      then evicted at once.

    The policy is responsible for:

    * Tracking exactly the keys added and not yet discarded or returned by
      :meth:`victim` (the pool checks ``len`` and ``in`` against its own state).
    * Every method O(1), except that :meth:`victim` may walk past the keys it is
      told to spare (O(len(exclude)) at worst).
    * Never raising for a key it does not track, except where a method says so.
    """

    def add(self, key: OffloadKey) -> None:
        """``key`` became evictable. It must not be tracked already."""

    def access(self, key: OffloadKey) -> None:
        """``key`` was used; no-op if it is not tracked."""

    def discard(self, key: OffloadKey) -> None:
        """``key`` is no longer evictable; no-op if it is not tracked."""

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
        """Remove and return the key to evict next, or ``None`` if there is none.

        Keys in ``exclude`` are spared: they stay tracked, in their place, and
        the next key the policy would evict after them is taken instead (the
        pool spares the keys of the ``prepare_store`` that needs the room).
        """

    def __len__(self) -> int:
        """The number of evictable keys."""

    def __contains__(self, key: object) -> bool: ...
