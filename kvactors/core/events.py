"""The events a tier keeps for the next ``take_events``, bounded.

``take_events`` is optional for a caller.
vLLM's scheduler asks every step, but a frontend that never asks must not make the runtime grow without bound.
So an :class:`EventBuffer` keeps at most ``max_keys`` keys.
Past that, it drops its oldest events whole and counts them.
The events are notifications, never the data.
A consumer mirrors them, as vLLM's prefix-cache events do.
Dropping them loses no block.

A plain class, with no threads and no locks.
Not thread-safe: its owner locks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvactors.types import OffloadingEvent, OffloadKey

if TYPE_CHECKING:
    from kvactors.logs import EventLogger

__all__ = ["MAX_PENDING_EVENT_KEYS", "EventBuffer", "warn_on_overflow"]

MAX_PENDING_EVENT_KEYS = 1 << 20
"""Keys a buffer keeps for the next ``take_events`` (at some 80 bytes a key, under 100 MiB)."""


class EventBuffer:
    """Events of one tier since the last :meth:`take`, oldest first, at most ``max_keys`` keys.

    One event larger than that is kept alone.
    ``on_overflow(buffer)`` is called when an overflow begins, at the first drop since the last :meth:`take`.
    """

    __slots__ = ("_events", "_keys", "_on_overflow", "_overflowing", "dropped_events", "dropped_keys", "max_keys",
                 "tier")

    def __init__(self, tier: str, max_keys: int | None = None, *,
                 on_overflow: Callable[[EventBuffer], None] | None = None) -> None:
        if max_keys is None:
            max_keys = MAX_PENDING_EVENT_KEYS  # read now: a test may lower it
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.tier = tier
        self.max_keys = max_keys
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._keys = 0
        self._overflowing = False
        self._on_overflow = on_overflow
        self.dropped_events = 0  # in all, since the buffer was made
        self.dropped_keys = 0

    def __len__(self) -> int:
        return len(self._events)

    def add(self, keys: Iterable[OffloadKey], removed: bool) -> bool:
        """Keep one event of ``keys`` (none if there are none). Whether this call began an
        overflow (the first drop since the last :meth:`take`)."""
        batch = tuple(keys)
        if not batch:
            return False
        events = self._events
        events.append(OffloadingEvent(batch, self.tier, removed))
        self._keys += len(batch)
        if self._keys <= self.max_keys:
            return False
        if len(events) == 1:
            return False  # one event larger than the bound: kept alone
        while self._keys > self.max_keys and len(events) > 1:
            dropped = len(events.popleft().keys)
            self._keys -= dropped
            self.dropped_keys += dropped
            self.dropped_events += 1
        began, self._overflowing = not self._overflowing, True
        if began and self._on_overflow is not None:
            self._on_overflow(self)
        return began

    def take(self) -> list[OffloadingEvent]:
        """The events kept, oldest first. The buffer is empty after."""
        events = list(self._events)
        self._events.clear()
        self._keys = 0
        self._overflowing = False
        return events


def warn_on_overflow(log: EventLogger, *, pool: bool = False) -> Callable[[EventBuffer], None]:
    """An ``on_overflow`` that logs one warning per overflow.

    The warning is ``events_dropped``, on a tier's component log.
    With ``pool``, it is ``pool_events_dropped``, on the primary's lifecycle log.
    """
    detail = "take_events was not called for too long"

    def warn(buffer: EventBuffer) -> None:
        if pool:
            log.warning("pool_events_dropped", tier=buffer.tier, dropped_keys=buffer.dropped_keys,
                        max_keys=buffer.max_keys, detail=detail)
        else:
            log.warning("events_dropped", tier=buffer.tier, dropped_keys=buffer.dropped_keys,
                        max_keys=buffer.max_keys, detail=detail)

    return warn
