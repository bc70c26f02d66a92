"""The supervisor's gathers: rounds through every secondary tier (events, barrier, shutdown).

A gather asks each tier once and **ends** once.
It ends when every tier it waits for has answered or was found stuck, when its deadline passed,
or when a stop cut it short.
A stuck tier does not end a *patient* gather, which a caller's own timeout bounds.
The tiers that did not answer are its ``missing``.
An answer that comes after its gather ended (or from a tier no longer waited for) is *late*.
The book keeps the events a late answer brings for the next events gather.

No threads, no I/O, no logging.
The supervisor's actor owns one book and is its only caller.
``D`` is the owner's done-callback type, carried along untouched.
Times are the owner's clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvactors.core.deadlines import DeadlineQueue

D = TypeVar("D")


class GatherKind(enum.StrEnum):
    """What a gather asks each tier for (a ``str``: logged as its value)."""

    BARRIER = "barrier"
    """Nothing: the answer says every earlier message to the tier was handled."""
    EVENTS = "events"
    """The tier's ``take_events()``."""
    SHUTDOWN = "shutdown"
    """The tier's ``drain`` then ``shutdown``."""


@dataclass(slots=True)
class Gather(Generic[D]):
    gather_id: int
    what: GatherKind
    waiting: set[str]
    on_done: D
    patient: bool = False
    payloads: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    ended: bool = False


class GatherBook(Generic[D]):
    """Open gathers, their deadlines, and late payloads (see the module docstring)."""

    __slots__ = ("_deadlines", "_ids", "_late", "_open")

    def __init__(self) -> None:
        self._open: dict[int, Gather[D]] = {}
        self._deadlines: DeadlineQueue[int] = DeadlineQueue()
        self._ids = 0
        self._late: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    def begin(self, what: GatherKind, on_done: D, *, waiting: Iterable[str], missing: Iterable[str] = (),
              patient: bool = False) -> Gather[D]:
        """A new gather (a fresh id) waiting for ``waiting``.

        ``missing`` is the tiers not waited for.
        """
        self._ids += 1
        return Gather(self._ids, what, set(waiting), on_done, patient, missing=set(missing))

    def wait(self, gather: Gather[D], due: float | None) -> None:
        """``gather`` waits for its tiers' messages, until ``due`` (``None``: no deadline)."""
        if not gather.waiting:
            raise ValueError(f"gather {gather.gather_id} waits for no tier: end it")
        self._open[gather.gather_id] = gather
        if due is not None:
            self._deadlines.add(gather.gather_id, due)

    def end(self, gather: Gather[D]) -> bool:
        """``gather`` ends now, and what it still waits for is missing.

        Returns False, and changes nothing, if it had ended already.
        That happens because a list from :meth:`expire` or :meth:`tier_stuck` may hold a gather
        that ending an earlier one in it (a stop's) ended too.
        The owner must not run its callback twice.
        """
        if gather.ended:
            return False
        gather.ended = True
        self._open.pop(gather.gather_id, None)  # a gather that waited for no tier was never open
        self._deadlines.discard(gather.gather_id)
        gather.missing.update(gather.waiting)
        gather.waiting.clear()
        return True

    def answered(self, gather_id: int, tier: str, payload: tuple[Any, ...]) -> Gather[D] | None:
        """``tier`` answered: the gather if that was its last wait (end it), else ``None``.
        A late answer's payload is kept for :meth:`take_late`."""
        gather = self._open.get(gather_id)
        if gather is None or tier not in gather.waiting:
            if payload:
                self._late.setdefault(tier, []).extend(payload)
            return None
        gather.payloads[tier] = payload
        gather.waiting.discard(tier)
        return gather if not gather.waiting else None

    def tier_stuck(self, tier: str) -> list[Gather[D]]:
        """No impatient gather waits for ``tier`` any more: those it was the last wait of."""
        done = []
        for gather in self._open.values():
            if tier in gather.waiting and not gather.patient:
                gather.waiting.discard(tier)
                gather.missing.add(tier)
                if not gather.waiting:
                    done.append(gather)
        return done

    def expire(self, now: float) -> list[Gather[D]]:
        """Open gathers whose deadline is ``<= now``, earliest first (end them)."""
        return [self._open[i] for i in self._deadlines.pop_expired(now) if i in self._open]

    def open_gathers(self) -> list[Gather[D]]:
        return list(self._open.values())

    def take_late(self, tier: str) -> list[Any]:
        """The payloads ``tier`` brought too late for their gathers, oldest first.

        The book forgets them.
        """
        return self._late.pop(tier, [])
