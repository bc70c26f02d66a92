"""The next tick an actor must wake for, armed once per deadline that needs it.

An actor whose books hold deadlines (a job's, a lookup's, a store's) wakes by a
``Tick`` it schedules for itself. :class:`Alarm` decides when one is scheduled.
A deadline just added needs a wake-up only if none armed since the last tick
comes by it. After a tick, the soonest deadline left in the books gets the next
wake-up. The alarm reads no book itself, and its owner hands it the deadlines.

A wake-up armed before a tick is forgotten by that tick, though its ``Tick`` may
still be on its way. The rearm after the tick may then schedule a second one
for the same deadline. Each extra tick finds nothing due and costs one message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Alarm:
    """One actor's wake-ups. Not thread-safe.

    The actor that owns it uses it on its own turn only. It calls :meth:`arm` for
    each deadline it adds to a book and :meth:`fire` when its ``Tick`` arrives.
    After the tick's consequences are in the books, it calls :meth:`rearm`.
    Actors do that in :meth:`~kvactors.actors.runtime.Actor.settle`.
    """

    __slots__ = ("_due", "_wake", "fired")

    def __init__(self, wake: Callable[[float], None]) -> None:
        """``wake(deadline)`` schedules a tick for ``deadline``. Only :meth:`arm` calls it."""
        self._wake = wake
        self._due: float | None = None
        self.fired = False
        """Whether a tick came since the last :meth:`rearm` (a plain attribute: read after every message)."""

    @property
    def due(self) -> float | None:
        """The soonest wake-up armed since the last tick, or ``None``."""
        return self._due

    def arm(self, deadline: float) -> None:
        """Make sure a tick comes by ``deadline``.

        A wake-up armed since the last tick for no later than ``deadline`` covers
        it, and nothing is scheduled. No book is read, so this is cheap enough to
        call for every job sent.
        """
        due = self._due
        if due is not None and due <= deadline:
            return
        self._due = deadline
        self._wake(deadline)

    def fire(self) -> None:
        """A tick came, and the wake-up armed is spent.

        Call it first in the tick's handler. Deadlines the handler adds are then
        armed afresh. The next wake-up for the deadlines already in the books
        waits for :meth:`rearm`.
        """
        self._due = None
        self.fired = True

    def rearm(self, deadlines: Iterable[float | None]) -> None:
        """After a tick, arm the soonest of ``deadlines``.

        ``deadlines`` are the books' next ones, ``None`` for a book with none.
        Read them only when :attr:`fired` is true, since that is when they count.
        """
        self.fired = False
        soonest = min((deadline for deadline in deadlines if deadline is not None), default=None)
        if soonest is not None:
            self.arm(soonest)
