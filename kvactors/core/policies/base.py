"""The eviction policy interfaces.

A policy is chosen as an :class:`EvictionPolicy`, which orders keys. The pool speaks
to it only through the :class:`RowPolicy` that :meth:`EvictionPolicy.bind_rows` returns,
which orders the pool's rows. LRU keeps its order through the rows themselves
(:class:`~kvactors.core.policies.row_lru.RowLRUPolicy`). Any other policy, ARC among
them, is seen through its keys (:class:`~kvactors.core.policies.keyed.KeyedRowPolicy`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from kvactors.types import OffloadKey


class RowPolicy(Protocol):
    """Orders the *evictable* rows of a pool: indexed, ready, and not in use.

    Preconditions (the pool guarantees them):

    * Every call comes from the one thread that owns the pool (the primary tier's
      actor), one at a time. No method needs to be thread-safe.
    * A row is added when it becomes evictable and discarded when it stops being so
      (pinned, being written, removed). The key at a tracked row does not change.
    * :meth:`take_victims` is called only when the pool needs room. The rows it
      returns are evicted and reused at once.

    The policy is responsible for:

    * Tracking exactly the rows added and not yet discarded or taken (the pool checks
      ``len`` and :meth:`has_row` against its own state).
    * Doing the work of a call on many rows in that one call (the pool's hot paths
      make one call per request, never one per row).
    """

    def add_row(self, row: int) -> None:
        """``row`` became evictable. A row tracked already keeps its place."""

    def discard_row(self, row: int) -> None:
        """``row`` is no longer evictable. A no-op for a row not tracked."""

    def add_rows(self, rows: Iterable[int]) -> None:
        """:meth:`add_row` of each of ``rows``, in order."""

    def discard_rows(self, rows: Iterable[int]) -> None:
        """:meth:`discard_row` of each of ``rows``, in order."""

    def access_rows(self, rows: Iterable[int]) -> None:
        """Each of ``rows`` was used, in order. A no-op for a row not tracked."""

    def take_victims(self, count: int, spare: Collection[int]) -> list[int]:
        """Remove and return the ``count`` rows to evict next, in eviction order.

        Rows in ``spare`` stay tracked in their place (the pool spares the rows of the
        keys of the ``prepare_store`` that needs the room). Fewer rows come back only
        when fewer are tracked.
        """

    def peek_victims(self, count: int, spare: Collection[int]) -> list[int]:
        """The rows :meth:`take_victims` would take now, changing nothing.

        Empty when the policy cannot tell without changing its state (see :attr:`peeks`).
        """

    @property
    def peeks(self) -> bool:
        """Whether :meth:`peek_victims` answers."""

    def has_row(self, row: int) -> bool:
        """Whether ``row`` is tracked (evictable)."""

    def __len__(self) -> int:
        """The number of evictable rows."""

    def snapshot(self) -> tuple[object, ...]:
        """A comparable copy of the policy's whole state, in eviction order. O(rows), for tests."""

    def check(self) -> None:
        """Assert that the policy's own structures are whole. O(rows), for tests."""


class EvictionPolicy(Protocol):
    """Orders the *evictable* keys of a pool: resident, ready, and not in use.

    Preconditions (the pool, or the :class:`RowPolicy` that adapts this one, guarantees them):

    * Every call comes from the one thread that owns the pool (the primary tier's
      actor), one at a time. No method needs to be thread-safe.
    * :meth:`add` is called when a key becomes evictable, only for a key not tracked
      already. :meth:`discard` is called when it stops being so (pinned, being written,
      removed). :meth:`access` is called when it is used (tracked or not).
    * :meth:`victim` is asked only when the pool needs room. The key it returns is then
      evicted at once.

    The policy is responsible for:

    * Tracking exactly the keys added and not yet discarded or returned by :meth:`victim`.
    * Every method O(1), except that :meth:`victim` may walk past the keys it is told to
      spare (O(len(exclude)) at worst).
    * Never raising for a key it does not track, except where a method says so.
    """

    def bind_rows(self, row_of: Callable[[OffloadKey], int | None],
                  key_of: Sequence[OffloadKey | None], num_rows: int) -> RowPolicy:
        """The policy the pool uses, over its rows. This one must be empty and is not used again
        unless the returned policy wraps it.

        ``row_of(key)`` is the row a tracked key is at, ``key_of[row]`` the key at a row.
        Both stay valid while the key is tracked.
        """

    def add(self, key: OffloadKey) -> None:
        """``key`` became evictable. It must not be tracked already."""

    def access(self, key: OffloadKey) -> None:
        """``key`` was used. A no-op if it is not tracked."""

    def discard(self, key: OffloadKey) -> None:
        """``key`` is no longer evictable. A no-op if it is not tracked."""

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
        """Remove and return the key to evict next, or ``None`` if there is none.

        Keys in ``exclude`` are spared. They stay tracked in their place, and the next
        key the policy would evict after them is taken instead.
        """

    def snapshot(self) -> tuple[object, ...]:
        """A comparable copy of the policy's whole state, in eviction order. O(keys), for tests."""

    def __len__(self) -> int:
        """The number of evictable keys."""

    def __contains__(self, key: object) -> bool: ...
