"""The names :class:`~kvactors.core.pool.BlockPool` speaks in: who holds a row, what a call did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from kvactors.types import OffloadKey

Identity: TypeAlias = tuple[str, int]
"""A request attempt: ``(req_id, attempt)``."""

PinOwner: TypeAlias = Identity | tuple[str, int, str]
"""Who holds a load pin: a request attempt, or one of its roles (its reservations:
:func:`kvactors.core.reservations.reservation_owner`)."""

Writer: TypeAlias = Identity | int
"""Who writes a row: a request's store (its identity) or a promotion (its job id)."""


class PoolError(ValueError):
    """An operation's input does not match the pool's state, and nothing changed."""


class StorePlan(NamedTuple):
    """What :meth:`BlockPool.prepare_store` allocated (a named tuple: made per call, cheaply)."""

    keys: tuple[OffloadKey, ...]
    rows: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]


class StoreOutcome(NamedTuple):
    """What :meth:`BlockPool.complete_store` did (a named tuple: made per call, cheaply).

    ``live`` writes were still indexed (they counted as the request's pending stores).
    ``stale`` ones had been detached by a deadline or a reset and only freed their rows.
    ``stored`` are the keys that became ready.
    """

    live: int
    stale: int
    stored: tuple[OffloadKey, ...]
    rows: tuple[int, ...]


@dataclass(slots=True)
class Rewrite:
    """A key its writer prepared again while its earlier writes of that key were detached
    (by a reset or a deadline), none of them completed yet.

    Each of the writer's completions of the key ends one of those writes, but which one
    is unknown: every row stays held until the last completion (``ended`` reaches
    ``len(stale_rows) + 1``), and the live row becomes ready only if all of them
    succeeded (``ok``).
    """

    stale_rows: list[int] = field(default_factory=list)
    ended: int = 0
    ok: bool = True


@dataclass(frozen=True)
class PoolHoldings:
    """What a :class:`~kvactors.core.pool.BlockPool` holds at one moment
    (:meth:`~kvactors.core.pool.BlockPool.holdings`): copies, for tests and tools."""

    ready: Mapping[OffloadKey, int]
    """Each key that is indexed and ready, and its row."""
    pending_writes: frozenset[tuple[Writer, OffloadKey]]
    """Each ``(writer, key)`` whose write is not completed yet (indexed or detached)."""
    load_pins: Mapping[tuple[PinOwner, OffloadKey], Mapping[int, int]]
    """Per ``(owner, key)`` a request (or one of its roles) holds load pins of: the pins per row."""
    job_pins: Mapping[int, tuple[int, ...]]
    """Per cascade job reading rows: the rows it pins."""
    promotions: Mapping[int, tuple[tuple[OffloadKey, int], ...]]
    """Per promotion job in flight: the ``(key, row)`` it writes."""
