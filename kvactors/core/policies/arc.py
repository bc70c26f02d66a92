"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), over evictable keys.

``T1`` holds keys used once recently, ``T2`` keys used at least twice.
The ghost lists ``B1``/``B2`` remember keys recently evicted from each.
A hit in a ghost list moves the target size ``p`` of ``T1`` towards the list that would have kept it.
Unlike a textbook cache, the pool decides residency.
Keys that are pinned or being written are discarded from the policy,
and added back when they become evictable again.
``victim`` is only asked when the pool needs room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvactors.core.policies.keyed import KeyedRowPolicy
from kvactors.types import OffloadKey


class ARCPolicy:
    """ARC with ghost lists bounded by ``capacity`` (the pool's block count).

    Not thread-safe: it lives inside its pool.
    """

    __slots__ = ("_b1", "_b2", "_capacity", "_p", "_t1", "_t2")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self._capacity = capacity
        self._p = 0.0
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    @property
    def target_recent(self) -> float:
        """``p``: how many of the evictable keys ARC wants in ``T1``."""
        return self._p

    def bind_rows(self, row_of: Callable[[OffloadKey], int | None],
                  key_of: Sequence[OffloadKey | None], num_rows: int) -> KeyedRowPolicy:
        """This policy, seen by the pool through its rows (:class:`KeyedRowPolicy`)."""
        if len(self):
            raise ValueError("bind_rows needs an empty policy")
        return KeyedRowPolicy(self, row_of, key_of)

    def add(self, key: OffloadKey) -> None:
        if key in self._b1:
            # A recently evicted once-used key came back: favour recency.
            self._p = min(float(self._capacity), self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def access(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def discard(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
        recent, frequent = _oldest(self._t1, exclude), _oldest(self._t2, exclude)
        if recent is not None and (len(self._t1) > self._p or frequent is None):
            del self._t1[recent]
            self._remember(self._b1, recent)
            return recent
        if frequent is not None:
            del self._t2[frequent]
            self._remember(self._b2, frequent)
            return frequent
        return None

    def _remember(self, ghosts: OrderedDict[OffloadKey, None], key: OffloadKey) -> None:
        ghosts[key] = None
        while len(self._b1) + len(self._b2) > self._capacity:
            # Trim the longer ghost list first, as ARC's directory bound does.
            longer = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            longer.popitem(last=False)

    def snapshot(self) -> tuple[object, ...]:
        """``(p, T1, T2, B1, B2)``, each list oldest first."""
        return self._p, tuple(self._t1), tuple(self._t2), tuple(self._b1), tuple(self._b2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


def _oldest(keys: OrderedDict[OffloadKey, None], exclude: Collection[OffloadKey]) -> OffloadKey | None:
    """The least recently used of ``keys`` not in ``exclude``, if any."""
    if not exclude:
        return next(iter(keys), None)
    return next((key for key in keys if key not in exclude), None)
