"""Least-recently-used eviction over keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvactors.core.policies.row_lru import RowLRUPolicy
from kvactors.types import OffloadKey


class LRUPolicy:
    """Evicts the key used least recently: an ``OrderedDict`` of keys, O(1) everywhere.

    A pool keeps the same order through its rows instead (:meth:`bind_rows`). Every
    answer is the same. Not thread-safe: it lives inside its pool.
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def bind_rows(self, row_of: Callable[[OffloadKey], int | None],
                  key_of: Sequence[OffloadKey | None], num_rows: int) -> RowLRUPolicy:
        """The same order, kept through the pool's rows (:class:`RowLRUPolicy`), used instead of this one."""
        if self._order:
            raise ValueError("bind_rows needs an empty policy")
        return RowLRUPolicy(key_of, num_rows)

    def add(self, key: OffloadKey) -> None:
        self._order[key] = None

    def access(self, key: OffloadKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
        if not exclude:
            if not self._order:
                return None
            key, _ = self._order.popitem(last=False)
            return key
        for key in self._order:
            if key not in exclude:
                del self._order[key]  # and stop iterating at once
                return key
        return None

    def snapshot(self) -> tuple[object, ...]:
        """The tracked keys, oldest first."""
        return tuple(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
