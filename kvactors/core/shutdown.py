"""The supervisor's stop: drain the jobs in flight within a budget, then one shutdown round through the tiers.

A stop goes through its :class:`ShutdownPhase` s in order, each once.

1. ``DRAINING``: the jobs in flight and the promotions the primary is
   allocating may still end, until the stop's deadline (now plus its budget).
2. ``OUT_OF_TIME``: the deadline passed first. The owner times out every job
   still in flight, and nothing more is waited for.
3. ``ROUND``: the tiers' shutdown round (each tier's ``drain`` then
   ``shutdown``). Its drain gets what is left of the budget, and the round
   itself may take :data:`SHUTDOWN_GRACE_S` past the deadline.
4. ``DONE``: the round ended and the stop's reply is handed out.

No threads, no I/O, no logging. The supervisor's actor owns one and is its only
caller. ``R`` is the owner's reply type, carried along untouched. Times are the
owner's clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")

SHUTDOWN_GRACE_S = 0.25
"""How long past the stop's deadline the tiers' shutdown round may take (a tier's
``shutdown()`` after a ``drain`` that used the whole budget)."""


class ShutdownPhase(enum.Enum):
    """Where a stop is."""

    RUNNING = "running"  # no stop was asked
    DRAINING = "draining"  # waiting for the work in flight, until the deadline
    OUT_OF_TIME = "out_of_time"  # the deadline passed: nothing more is waited for before the round
    ROUND = "round"  # the tiers' shutdown round is under way
    DONE = "done"  # the round ended: the stop was answered


@dataclass(frozen=True, slots=True)
class ShutdownRound:
    """The tiers' shutdown round, as the stop's budget allows it."""

    drain_timeout_s: float
    """What is left of the budget for each tier's ``drain``."""
    deadline: float
    """When the round ends without the tiers that have not answered."""


class Shutdown(Generic[R]):
    """One supervisor's stop, from its request to its reply (see the module docstring)."""

    __slots__ = ("_reply", "awaits_round", "deadline", "grace_s", "phase", "stopping")

    def __init__(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.phase = ShutdownPhase.RUNNING
        # Two views of the phase, kept as plain attributes because the owner reads them on its hot paths.
        self.stopping = False
        """A stop was asked: no new work is taken."""
        self.awaits_round = False
        """The round has not begun yet: :meth:`round_due` must be asked after every change."""
        self.grace_s = grace_s
        self.deadline = 0.0
        self._reply: R | None = None

    def begin(self, reply: R, now: float, budget_s: float) -> float:
        """The stop asked now with ``budget_s`` to drain.

        Returns its deadline.
        Raises ``ValueError`` for a second stop, and nothing changes.
        """
        if self.phase is not ShutdownPhase.RUNNING:
            raise ValueError(f"a stop is {self.phase.value} already")
        self.phase = ShutdownPhase.DRAINING
        self.stopping = self.awaits_round = True
        self.deadline = now + budget_s
        self._reply = reply
        return self.deadline

    def timer_deadline(self) -> float | None:
        """The deadline a tick must come by (``None`` unless the stop is draining)."""
        return self.deadline if self.phase is ShutdownPhase.DRAINING else None

    def out_of_time(self, now: float) -> bool:
        """Whether the drain's deadline passed by ``now``.

        True once, when the stop goes ``OUT_OF_TIME``. The owner then times out every job in flight."""
        if self.phase is ShutdownPhase.DRAINING and now >= self.deadline:
            self.phase = ShutdownPhase.OUT_OF_TIME
            return True
        return False

    def round_due(self, now: float, *, work_left: bool) -> ShutdownRound | None:
        """The shutdown round, if it begins now (the stop goes ``ROUND``), else ``None``.

        ``work_left`` says jobs are in flight or promotions being allocated.
        A draining stop waits for them.
        One out of time does not.
        """
        if not self.awaits_round or (self.phase is ShutdownPhase.DRAINING and work_left):
            return None
        self.phase = ShutdownPhase.ROUND
        self.awaits_round = False
        return ShutdownRound(max(self.deadline - now, 0.0), self.deadline + self.grace_s)

    def finish(self) -> R:
        """The round ended: the stop's reply, to answer now (the stop goes ``DONE``).

        ``ValueError`` unless the round was under way, and nothing changes."""
        if self.phase is not ShutdownPhase.ROUND or self._reply is None:
            raise ValueError(f"no shutdown round to finish: the stop is {self.phase.value}")
        self.phase = ShutdownPhase.DONE
        return self._reply
