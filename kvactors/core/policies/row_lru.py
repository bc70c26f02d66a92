"""Least-recently-used eviction kept through a pool's rows."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvactors.types import OffloadKey


class RowLRUPolicy:
    """The LRU order as a doubly linked list threaded through a pool's rows. O(1) a row.

    Made by :meth:`LRUPolicy.bind_rows <kvactors.core.policies.lru.LRUPolicy.bind_rows>`.
    ``key_of[row]`` is the key at a row (read only by :meth:`snapshot`). Two lists of
    row links cost a few bytes a row instead of an ``OrderedDict`` entry.
    Evicts in the same order as :class:`~kvactors.core.policies.lru.LRUPolicy`.
    Not thread-safe: it lives inside its pool.
    """

    __slots__ = ("_key_of", "_len", "_linked", "_next", "_prev", "_tail")

    peeks = True

    def __init__(self, key_of: Sequence[OffloadKey | None], num_rows: int) -> None:
        self._key_of = key_of
        self._tail = num_rows  # the sentinel row: _next[tail] is the oldest, _prev[tail] the newest
        # Lists, not arrays: their items are the row ints the pool already holds
        # (no new int objects), and indexing them is faster.
        self._next: list[int] = [num_rows] * (num_rows + 1)
        self._prev: list[int] = [num_rows] * (num_rows + 1)
        self._linked = bytearray(num_rows)
        self._len = 0

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

    # ------------------------------------------------------------ the row policy

    def add_row(self, row: int) -> None:
        if not self._linked[row]:
            self._linked[row] = 1
            self._len += 1
            self._link(row)

    def discard_row(self, row: int) -> None:
        if self._linked[row]:
            self._linked[row] = 0
            self._len -= 1
            self._unlink(row)

    def add_rows(self, rows: Iterable[int]) -> None:
        linked, nxt, prev, tail = self._linked, self._next, self._prev, self._tail
        added = 0
        for row in rows:
            if not linked[row]:
                linked[row] = 1
                added += 1
                last = prev[tail]
                nxt[last] = row
                prev[row] = last
                nxt[row] = tail
                prev[tail] = row
        self._len += added

    def discard_rows(self, rows: Iterable[int]) -> None:
        linked, nxt, prev = self._linked, self._next, self._prev
        removed = 0
        for row in rows:
            if linked[row]:
                linked[row] = 0
                removed += 1
                before, after = prev[row], nxt[row]
                nxt[before] = after
                prev[after] = before
        self._len -= removed

    def access_rows(self, rows: Iterable[int]) -> None:
        linked, nxt, prev, tail = self._linked, self._next, self._prev, self._tail
        for row in rows:
            if linked[row] and prev[tail] != row:
                before, after = prev[row], nxt[row]
                nxt[before] = after
                prev[after] = before
                last = prev[tail]
                nxt[last] = row
                prev[row] = last
                nxt[row] = tail
                prev[tail] = row

    def take_victims(self, count: int, spare: Collection[int]) -> list[int]:
        linked, nxt, prev, tail = self._linked, self._next, self._prev, self._tail
        taken: list[int] = []
        row = nxt[tail]
        if not spare:
            # The oldest ``count`` rows, cut out as one run.
            while len(taken) < count and row != tail:
                linked[row] = 0
                taken.append(row)
                row = nxt[row]
            nxt[tail] = row
            prev[row] = tail
            self._len -= len(taken)
            return taken
        while len(taken) < count and row != tail:
            after = nxt[row]
            if row not in spare:
                linked[row] = 0
                before = prev[row]
                nxt[before] = after
                prev[after] = before
                taken.append(row)
            row = after
        self._len -= len(taken)
        return taken

    def peek_victims(self, count: int, spare: Collection[int]) -> list[int]:
        nxt, tail = self._next, self._tail
        rows: list[int] = []
        row = nxt[tail]
        while len(rows) < count and row != tail:
            if row not in spare:
                rows.append(row)
            row = nxt[row]
        return rows

    def has_row(self, row: int) -> bool:
        return bool(self._linked[row])

    def __len__(self) -> int:
        return self._len

    # ------------------------------------------------------------ for tests

    def snapshot(self) -> tuple[object, ...]:
        """The keys of the linked rows, oldest first (what :class:`LRUPolicy` keeps)."""
        order, row, nxt, key_of = [], self._next[self._tail], self._next, self._key_of
        while row != self._tail:
            order.append(key_of[row])
            row = nxt[row]
        return tuple(order)

    def check(self) -> None:
        """Walked both ways from the sentinel, the list visits exactly the linked rows,
        each once, in mirrored orders."""
        tail, nxt, prev = self._tail, self._next, self._prev
        forward: list[int] = []
        row = nxt[tail]
        while row != tail:
            assert len(forward) <= self._len, "the LRU list loops"
            assert prev[nxt[row]] == row, f"row {row}: its successor does not point back"
            forward.append(row)
            row = nxt[row]
        backward: list[int] = []
        row = prev[tail]
        while row != tail:
            assert len(backward) <= self._len, "the LRU list loops backwards"
            backward.append(row)
            row = prev[row]
        assert forward == backward[::-1], "the LRU list differs walked backwards"
        assert len(forward) == self._len and set(forward) == {r for r in range(tail) if self._linked[r]}
