"""One request's load pins of one key, booked on the rows they were taken on.

Plain data, no threads: part of :class:`~kvactors.core.pool.BlockPool`'s state.
"""

from __future__ import annotations


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
        """``count`` more releases arrived: ``{row: pins to release}`` now, or ``None``
        while they must be owed (the pins lie on several rows and some are still out).

        Usually every pin lies on one row, and the releases apply at once. When they
        lie on several rows, a release does not say which copy ended, so releases are
        owed until every pin of the key is released; then each row loses its pins.
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


_LoadPins = LoadPins
"""The former name (the planted-bug tests book pins with it)."""
