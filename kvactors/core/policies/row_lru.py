"""Least-recently-used eviction kept through a pool's rows."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from kvactors.types import OffloadKey


class RowLRUPolicy:
    """The LRU order as a doubly linked list threaded through a pool's rows. O(1) everywhere.

    Made by :meth:`LRUPolicy.bind_rows <kvactors.core.policies.lru.LRUPolicy.bind_rows>`
    for a pool that maps keys to rows itself: ``row_of(key)`` is the row a tracked key
    is at (it must stay so while the key is tracked: the pool discards a key before
    unindexing it), ``key_of[row]`` the key at a row. Two lists of row links (a few
    bytes per row instead of an ``OrderedDict`` entry); keys are found through
    the pool's own index, and the pool's hot paths call the ``*_row`` methods directly.
    Evicts in the same order as :class:`~kvactors.core.policies.lru.LRUPolicy`.
    """

    __slots__ = ("_key_of", "_len", "_linked", "_next", "_prev", "_row_of", "_tail")

    def __init__(self, row_of: Callable[[OffloadKey], int | None],
                 key_of: Sequence[OffloadKey | None], num_rows: int) -> None:
        self._row_of = row_of
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

    # ------------------------------------------------------------ by row (the pool's hot paths)

    def access_row(self, row: int) -> None:
        """:meth:`access` of the key at ``row``."""
        self.access_rows((row,))

    def add_row(self, row: int) -> None:
        """:meth:`add` of the key at ``row``."""
        if not self._linked[row]:
            self._linked[row] = 1
            self._len += 1
            self._link(row)

    def discard_row(self, row: int) -> None:
        """:meth:`discard` of the key at ``row``."""
        if self._linked[row]:
            self._linked[row] = 0
            self._len -= 1
            self._unlink(row)

    def add_rows(self, rows: Iterable[int]) -> None:
        """:meth:`add_row` of each of ``rows``, in order (one call for a request's rows)."""
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
        """:meth:`discard_row` of each of ``rows``."""
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
        """:meth:`access_row` of each of ``rows``, in order."""
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

    def take_victims(self, count: int, exclude: Collection[OffloadKey] = ()) -> list[int]:
        """The rows of the keys ``count`` calls of :meth:`victim` with ``exclude`` would
        return, in that order, removed in one pass (fewer if there are not as many)."""
        linked, nxt, prev, tail, key_of = self._linked, self._next, self._prev, self._tail, self._key_of
        taken: list[int] = []
        row = nxt[tail]
        if not exclude:
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
            if not exclude or key_of[row] not in exclude:
                linked[row] = 0
                before = prev[row]
                nxt[before] = after
                prev[after] = before
                taken.append(row)
            row = after
        self._len -= len(taken)
        return taken

    def peek_victims(self, count: int, exclude: Collection[OffloadKey] = ()) -> list[int]:
        """The rows :meth:`take_victims` would take, oldest first, without taking them."""
        nxt, tail, key_of = self._next, self._tail, self._key_of
        rows: list[int] = []
        row = nxt[tail]
        while len(rows) < count and row != tail:
            if not exclude or key_of[row] not in exclude:
                rows.append(row)
            row = nxt[row]
        return rows

    def has_row(self, row: int) -> bool:
        return bool(self._linked[row])

    # ------------------------------------------------------------ the policy, by key

    def add(self, key: OffloadKey) -> None:
        row = self._row_of(key)
        if row is None:
            raise KeyError("a key added to a row-bound policy must be indexed")
        self.add_row(row)

    def access(self, key: OffloadKey) -> None:
        row = self._row_of(key)
        if row is not None and self._linked[row] and self._prev[self._tail] != row:
            self._unlink(row)
            self._link(row)

    def discard(self, key: OffloadKey) -> None:
        row = self._row_of(key)
        if row is not None:
            self.discard_row(row)

    def victim(self, exclude: Collection[OffloadKey] = ()) -> OffloadKey | None:
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
        return key_of[row]

    def check_links(self) -> None:
        """Assert the list is whole: walked both ways from the sentinel it visits exactly the
        linked rows, each once, in mirrored orders. O(rows); for tests."""
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

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: object) -> bool:
        row = self._row_of(key) if isinstance(key, bytes) else None
        return row is not None and bool(self._linked[row])
