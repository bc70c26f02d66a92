"""The scheduler's mailboxes and refs: the shared :class:`~kvactors.actors.mailbox.Mailbox`, as seeds run it.

:class:`SimHost` is what a mailbox and a ref need of the scheduler that owns them.
:class:`~kvactors.testing.scheduler.SimRuntime` is one.
This module does not import the scheduler, and the scheduler imports it.
Not thread-safe, as the scheduler is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvactors.actors.mailbox import Mailbox
from kvactors.actors.runtime import Actor

if TYPE_CHECKING:
    import random


class SimHost(Protocol):
    """The scheduler, as its mailboxes and refs see it."""

    rng: random.Random
    """The seed's choices (a claim granted or not)."""
    claim_chance: float
    """How often a claim of an idle actor is granted."""

    def run_handler(self, box: SimMailbox, actor: Actor, message: object, *, claimed: bool) -> None:
        """Run ``actor``'s handler of ``message`` now, as part of the current step."""
        ...

    def preempt_claimer(self) -> None:
        """Maybe let others run first, between a claimer's claim and its handler.

        A claimer may be preempted there.
        """
        ...


class SimMailbox(Mailbox):
    """A :class:`Mailbox` as the scheduler runs it: named, and maybe stuck in a call.

    Made with its host's ref, before its actors (as on threads); ``wake`` does nothing.
    """

    __slots__ = ("frozen", "name", "runtime", "stopped")

    def __init__(self, runtime: SimHost, name: str) -> None:
        super().__init__()
        self.runtime = runtime
        self.name = name
        self.frozen = False  # stuck in a call: nothing is delivered until it thaws
        self.stopped = False

    def deliver(self, actor: Actor, message: object) -> None:
        # Only claimers deliver through here (the scheduler's steps call run_handler themselves).
        self.runtime.run_handler(self, actor, message, claimed=True)

    def __repr__(self) -> str:
        return f"SimMailbox({self.name!r}, pending={len(self.pending)}, owner={self.owner})"


class SimActorRef:
    """An actor's ref in a :class:`SimRuntime`.

    Its mailbox is shared with the actors colocated on it.
    It is made before its actor and bound to it once, at the actor's start (``actor`` is unset until then).
    """

    __slots__ = ("actor", "colocated", "early", "mailbox", "name", "runtime")

    actor: Actor

    def __init__(self, runtime: SimHost, name: str, mailbox: SimMailbox, *, colocated: bool = False) -> None:
        self.runtime = runtime
        self.name = name
        self.mailbox = mailbox
        self.colocated = colocated
        self.early: list[object] | None = []  # told before the start, as on threads

    def bind(self, actor: Actor) -> None:
        """Deliver this ref's messages to ``actor`` (once, at its start)."""
        if hasattr(self, "actor"):
            raise ValueError(f"actor {self.name} is started already")
        self.actor = actor

    def tell(self, message: object) -> None:
        if self.early is not None:
            self.early.append(message)
            return
        self.mailbox.put(self.actor, message, self.name)

    def deliver_early(self) -> None:
        """Queue what was told before the start, in order (once, at the start)."""
        early, self.early = self.early, None
        for message in early or ():
            self.mailbox.put(self.actor, message, self.name)

    def claim(self) -> bool:
        """Grant the claim when the mailbox is idle and the seed says so.

        On threads, a claim of an idle actor can fail too, when it is another caller's turn.
        """
        box = self.mailbox
        if box.closed:
            return False
        return self.runtime.rng.random() < self.runtime.claim_chance and box.claim()

    def run_claimed(self, message: object, until: Callable[[], bool] | None = None) -> None:
        # A client may be preempted between its claim and the handler: others run meanwhile.
        self.runtime.preempt_claimer()
        self.mailbox.run_claimed(self.actor, message, until)

    @property
    def closed(self) -> bool:
        return self.mailbox.closed

    def __repr__(self) -> str:
        return f"SimActorRef({self.name!r}, pending={len(self.mailbox.pending)})"
