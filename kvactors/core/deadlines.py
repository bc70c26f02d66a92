"""A deadline queue: items that expire at a time, with O(log n) add and lazy removal."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class DeadlineQueue(Generic[T]):
    """Items with deadlines; :meth:`pop_expired` returns those whose time has come.

    Removal is lazy (the heap entry is skipped later), so :meth:`discard` is
    O(1). Not thread-safe; times are whatever clock the owner uses.
    """

    __slots__ = ("_deadlines", "_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._deadlines: dict[T, float] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, item: object) -> bool:
        return item in self._deadlines

    def add(self, item: T, deadline: float) -> None:
        self._deadlines[item] = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), item))

    def discard(self, item: T) -> None:
        self._deadlines.pop(item, None)

    def next_deadline(self) -> float | None:
        """The earliest live deadline, or ``None``."""
        while self._heap:
            deadline, _, item = self._heap[0]
            if self._deadlines.get(item) == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None

    def pop_expired(self, now: float) -> list[T]:
        """Remove and return the items whose deadline is ``<= now``, earliest first."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, item = heapq.heappop(self._heap)
            if self._deadlines.get(item) == deadline:
                del self._deadlines[item]
                expired.append(item)
        return expired

    def clear(self) -> None:
        self._heap.clear()
        self._deadlines.clear()
