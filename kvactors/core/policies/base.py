"""The eviction policy interface."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from kvactors.types import OffloadKey


class EvictionPolicy(Protocol):
    """Orders the *evictable* keys of a pool: resident, ready, and not in use.

    The pool tells the policy when a key becomes evictable (:meth:`add`), when
    it stops being so (:meth:`discard`: pinned, being written, removed), and when
    it is used (:meth:`access`). :meth:`victim` picks the next key to evict and
    forgets it. Every method is O(1), except that :meth:`victim` walks past the
    keys it is told to spare (O(len(exclude)) at worst); no method is
    thread-safe (a policy lives inside one actor).
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
