"""A deadline queue: items that expire at a time, with O(log n) add and lazy removal.

Most deadlines never fire, as a job reports, or a lookup is answered, long before its timeout.
So removal only forgets the item and leaves its heap entry for later.
The heap is rebuilt from the live entries once the dead ones outnumber them, amortized O(1) a removal.
So it holds at most ``2 * live + COMPACT_SLACK`` entries,
instead of every deadline of the last timeout's worth of traffic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

COMPACT_SLACK = 64
"""Dead heap entries a queue may hold beyond its live count before it is rebuilt."""


class DeadlineQueue(Generic[T]):
    """Items with deadlines. :meth:`pop_expired` returns those whose time has come.

    Removal is lazy.
    The heap entry is skipped later, or dropped when the heap is rebuilt.
    So :meth:`discard` is O(1) amortized.
    Not thread-safe.
    Times are whatever clock the owner uses.
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

    @property
    def held(self) -> int:
        """Entries in the heap, live or removed and not dropped yet (at most ``2 * len(self) + COMPACT_SLACK``)."""
        return len(self._heap)

    def add(self, item: T, deadline: float) -> None:
        live, heap = self._deadlines, self._heap
        live[item] = deadline
        heapq.heappush(heap, (deadline, next(self._seq), item))
        if len(heap) > 2 * len(live) + COMPACT_SLACK:  # an item added again leaves its old entry dead too
            self._compact()

    def discard(self, item: T) -> None:
        live = self._deadlines
        if live.pop(item, None) is not None and len(self._heap) > 2 * len(live) + COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries (the dead outnumber them)."""
        live = self._deadlines
        first: dict[T, tuple[float, int, T]] = {}
        for entry in self._heap:
            item = entry[2]
            if live.get(item) == entry[0]:
                # An item added twice at one time has two such entries: the older one is the one that fires.
                kept = first.get(item)
                if kept is None or entry[1] < kept[1]:
                    first[item] = entry
        self._heap = list(first.values())
        heapq.heapify(self._heap)

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
        if expired and len(self._heap) > 2 * len(self._deadlines) + COMPACT_SLACK:
            self._compact()  # fewer live items: the dead entries not yet due may outnumber them now
        return expired

    def clear(self) -> None:
        self._heap.clear()
        self._deadlines.clear()
