"""Requests' load pins, booked per key on the rows they were taken on.

Plain data, with no threads.
It is part of :class:`~kvactors.core.pool.BlockPool`'s state.
One pool lives inside one actor, and nothing here is thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from kvactors.core.pool_types import PinOwner, PoolError
from kvactors.types import OffloadKey


class LoadPins:
    """One request's load pins of one key: how many on each row, and releases owed.

    ``rows`` counts the pins taken on each row. ``owed`` counts the releases
    (``complete_load``) received but not yet applied to a row, because the
    pins lie on more than one row and a release does not say which of the
    copies ended (see :meth:`BlockPool.unpin_load`).
    """

    __slots__ = ("owed", "rows")

    def __init__(self, row: int) -> None:
        self.rows: dict[int, int] = {row: 1}
        self.owed = 0

    @property
    def taken(self) -> int:
        return sum(self.rows.values())

    @property
    def outstanding(self) -> int:
        """Pins not yet released by the request."""
        return self.taken - self.owed

    def release(self, count: int) -> dict[int, int] | None:
        """Note that ``count`` more releases arrived.

        Returns ``{row: pins to release}`` now, or ``None`` while the releases must be owed.
        They are owed while the pins lie on several rows and some are still out.

        Usually every pin lies on one row, and the releases apply at once.
        When the pins lie on several rows, a release does not say which copy ended.
        So releases are owed until every pin of the key is released.
        Then each row loses its pins.
        """
        self.owed += count
        if len(self.rows) == 1:
            ((row, pins),) = self.rows.items()
            released = {row: self.owed}
            self.rows[row] = pins - self.owed
            self.owed = 0
            return released
        if self.owed == self.taken:
            released, self.rows, self.owed = self.rows, {}, 0
            return released
        return None



class LoadPinBook:
    """Every request's load pins, in two books that never share a ``(owner, key)``.

    ``single[owner][key] == row`` means that ``owner`` holds exactly one pin of ``key``, on ``row``.
    That is the common case, with no object per pin.
    ``multi[(owner, key)]`` is a :class:`LoadPins` for a key pinned more than once by ``owner``.
    The later pins lie on the same row, or on a new row after a reset detached the old one.
    A key moves from ``single`` to ``multi`` at its second pin.
    It stays there until every pin of it is released.
    Either book answers the same as one book of :class:`LoadPins` would, as the general path is that book.
    """

    __slots__ = ("multi", "single")

    def __init__(self) -> None:
        self.single: dict[PinOwner, dict[OffloadKey, int]] = {}
        self.multi: dict[tuple[PinOwner, OffloadKey], LoadPins] = {}

    def book(self, owner: PinOwner, keys: Sequence[OffloadKey], rows: Sequence[int]) -> None:
        """Book one pin of each ``keys[i]`` on ``rows[i]`` for ``owner``."""
        mine = self.single.get(owner)
        multi = self.multi
        if mine is None:
            if not (multi and any((owner, key) in multi for key in keys)):
                fresh = dict(zip(keys, rows, strict=True))
                if len(fresh) == len(keys):  # the common case: keys new to owner, each given once
                    if fresh:
                        self.single[owner] = fresh
                    return
            mine = self.single[owner] = {}
        for key, row in zip(keys, rows, strict=True):
            if key in mine:
                # A second pin: the key moves to the general book, its first pin first.
                entry = multi[(owner, key)] = LoadPins(mine.pop(key))
                entry.rows[row] = entry.rows.get(row, 0) + 1
            elif multi and (owner, key) in multi:
                # The same row again, or a new row of the key (an old one was
                # detached by a reset while pinned): each pin is booked on its own row.
                entry = multi[(owner, key)]
                entry.rows[row] = entry.rows.get(row, 0) + 1
            else:
                mine[key] = row
        if not mine:
            del self.single[owner]

    def take(self, owner: PinOwner, keys: Sequence[OffloadKey]) -> list[int]:
        """Release one pin of each key given (see :meth:`BlockPool.unpin_load`).

        Returns the rows that lose a pin now, once per pin.
        Releases that are owed add none.
        Raises :class:`PoolError`, with nothing changed, if ``owner`` does not hold that many unreleased pins on a key.
        """
        mine = self.single.get(owner)
        if mine is not None:
            # The common case: every key pinned once, each given once. Checked before
            # anything is popped, so that a refused release leaves the book as it was
            # (its order too); otherwise the general path decides.
            try:
                rows = list(map(mine.__getitem__, keys))
            except KeyError:
                rows = None
            if rows is not None and len(set(keys)) == len(keys):
                for key in keys:
                    del mine[key]
                if not mine:
                    del self.single[owner]
                return rows
        return self._take_general(owner, keys, mine)

    def _take_general(self, owner: PinOwner, keys: Sequence[OffloadKey],
                      mine: dict[OffloadKey, int] | None) -> list[int]:
        wanted = Counter(keys)
        multi = self.multi
        for key, count in wanted.items():
            if mine is not None and key in mine:
                if count == 1:
                    continue
                raise PoolError(f"key {key.hex()[:16]} is not pinned by {owner}")
            entry = multi.get((owner, key))
            if entry is None or entry.outstanding < count:
                raise PoolError(f"key {key.hex()[:16]} is not pinned by {owner}")
        rows: list[int] = []
        for key, count in wanted.items():
            if mine is not None and key in mine:
                rows.append(mine.pop(key))
                continue
            entry = multi[(owner, key)]
            released = entry.release(count)
            if released is None:
                continue  # pins on several rows: wait for the key's last release
            if not entry.outstanding:
                del multi[(owner, key)]
            for row, pins in released.items():
                rows.extend([row] * pins)
        if mine is not None and not mine:
            del self.single[owner]
        return rows

    def outstanding_of(self, owner: PinOwner) -> int:
        """How many pins ``owner`` holds and has not released. O(pins)."""
        mine = self.single.get(owner)
        return (len(mine) if mine else 0) + sum(
            pins.outstanding for (who, _), pins in self.multi.items() if who == owner)

    def entries(self) -> Iterator[tuple[PinOwner, OffloadKey, dict[int, int], int]]:
        """``(owner, key, {row: pins}, owed)`` for every pinned key, in both books."""
        for owner, mine in self.single.items():
            for key, row in mine.items():
                yield owner, key, {row: 1}, 0
        for (owner, key), entry in self.multi.items():
            yield owner, key, entry.rows, entry.owed

    def __bool__(self) -> bool:
        return bool(self.single) or bool(self.multi)
