"""The names :class:`~kvactors.core.pool.BlockPool` speaks in: who holds a row, what a call did."""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from kvactors.types import OffloadKey

Identity: TypeAlias = tuple[str, int]
"""A request attempt: ``(req_id, attempt)``."""

Writer: TypeAlias = Identity | int
"""Who writes a row: a request's store (its identity) or a promotion (its job id)."""


class PoolError(ValueError):
    """An operation's input does not match the pool's state; nothing changed."""


class StorePlan(NamedTuple):
    """What :meth:`BlockPool.prepare_store` allocated (a named tuple: made per call, cheaply)."""

    keys: tuple[OffloadKey, ...]
    rows: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]


class StoreOutcome(NamedTuple):
    """What :meth:`BlockPool.complete_store` did (a named tuple: made per call, cheaply).

    ``live`` writes were still indexed (they counted as the request's pending
    stores); ``stale`` ones had been detached by a deadline or a reset and only
    freed their rows. ``stored`` are the keys that became ready.
    """

    live: int
    stale: int
    stored: tuple[OffloadKey, ...]
    rows: tuple[int, ...]
