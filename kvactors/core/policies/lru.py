"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict

from kvactors.types import OffloadKey


class LRUPolicy:
    """Evicts the key used least recently. An ``OrderedDict``: O(1) everywhere."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def add(self, key: OffloadKey) -> None:
        self._order[key] = None

    def access(self, key: OffloadKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def victim(self) -> OffloadKey | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
