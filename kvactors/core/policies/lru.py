"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvactors.types import OffloadKey


class LRUPolicy:
    """Evicts the key used least recently. O(1) everywhere.

    Standalone it keeps an ``OrderedDict`` of keys. A pool that maps keys to
    rows itself calls :meth:`bind_rows` (while the policy is empty): the order
    then lives in two lists of row links (a doubly linked list threaded
    through the rows, 17 bytes per row instead of an ``OrderedDict`` entry
    of about 100), and keys are found through the pool's own index.
    The order and every answer are the same in both modes.
    """

    __slots__ = ("_key_of", "_len", "_linked", "_next", "_order", "_prev", "_row_of", "_tail")

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] | None = OrderedDict()
        self._row_of: Callable[[OffloadKey], int | None] | None = None

    def bind_rows(self, row_of: Callable[[OffloadKey], int | None],
                  key_of: Sequence[OffloadKey | None], num_rows: int) -> None:
        """Track rows instead of keys: ``row_of(key)`` is the row a tracked key
        is at (it must stay so while the key is tracked: the pool discards a
        key before unindexing it), ``key_of[row]`` the key at a row."""
        if self._order:
            raise ValueError("bind_rows needs an empty policy")
        self._order = None
        self._row_of = row_of
        self._key_of = key_of
        self._tail = num_rows  # the sentinel row: _next[tail] is the oldest, _prev[tail] the newest
        # Lists, not arrays: their items are the row ints the pool already holds
        # (no new int objects), and indexing them is about twice as fast.
        self._next: list[int] = [num_rows] * (num_rows + 1)
        self._prev: list[int] = [num_rows] * (num_rows + 1)
        self._linked = bytearray(num_rows)
        self._len = 0

    # ------------------------------------------------------------ row mode helpers

    def _link(self, row: int) -> None:
        tail, prev = self._tail, self._prev
        last = prev[tail]
        self._next[last] = row
        prev[row] = last
        self._next[row] = tail
        prev[tail] = row

    def _unlink(self, row: int) -> None:
        nxt, prev = self._next, self._prev
        before, after = prev[row], nxt[row]
        nxt[before] = after
        prev[after] = before

    # ------------------------------------------------------------ by row (bound mode; the pool's hot paths)

    def access_row(self, row: int) -> None:
        """:meth:`access` of the key at ``row`` (bound mode)."""
        tail, nxt, prev = self._tail, self._next, self._prev
        if self._linked[row] and prev[tail] != row:
            before, after = prev[row], nxt[row]
            nxt[before] = after
            prev[after] = before
            last = prev[tail]
            nxt[last] = row
            prev[row] = last
            nxt[row] = tail
            prev[tail] = row

    def add_row(self, row: int) -> None:
        """:meth:`add` of the key at ``row`` (bound mode)."""
        if not self._linked[row]:
            self._linked[row] = 1
            self._len += 1
            self._link(row)

    def discard_row(self, row: int) -> None:
        """:meth:`discard` of the key at ``row`` (bound mode)."""
        if self._linked[row]:
            self._linked[row] = 0
            self._len -= 1
            self._unlink(row)

    def has_row(self, row: int) -> bool:
        return bool(self._linked[row])

    # ------------------------------------------------------------ the policy

    def add(self, key: OffloadKey) -> None:
        if self._order is not None:
            self._order[key] = None
            return
        row = self._row_of(key)  # type: ignore[misc]
        if row is None:
            raise KeyError("a key added to a row-bound policy must be indexed")
        if not self._linked[row]:
            self._linked[row] = 1
            self._len += 1
            self._link(row)

    def access(self, key: OffloadKey) -> None:
        if self._order is not None:
            if key in self._order:
                self._order.move_to_end(key)
            return
        row = self._row_of(key)  # type: ignore[misc]
        if row is not None and self._linked[row] and self._prev[self._tail] != row:
            self._unlink(row)
            self._link(row)

    def discard(self, key: OffloadKey) -> None:
        if self._order is not None:
            self._order.pop(key, None)
            return
        row = self._row_of(key)  # type: ignore[misc]
        if row is not None and self._linked[row]:
            self._linked[row] = 0
            self._len -= 1
            self._unlink(row)

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
        if self._order is not None:
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
        if not self._len:
            return None
        tail, key_of = self._tail, self._key_of
        row = self._next[tail]
        if exclude:
            while row != tail and key_of[row] in exclude:
                row = self._next[row]
            if row == tail:
                return None
        self._linked[row] = 0
        self._len -= 1
        self._unlink(row)
        return self._key_of[row]

    def __len__(self) -> int:
        return len(self._order) if self._order is not None else self._len

    def __contains__(self, key: object) -> bool:
        if self._order is not None:
            return key in self._order
        row = self._row_of(key)  # type: ignore[arg-type, misc]
        return row is not None and bool(self._linked[row])
