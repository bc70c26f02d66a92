"""The scheduler's mailboxes and refs: the shared :class:`~kvactors.actors.mailbox.Mailbox`, as seeds run it.

Split from :mod:`kvactors.testing.scheduler` (which uses them); not thread-safe, as it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvactors.actors.mailbox import Mailbox
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor

if TYPE_CHECKING:
    from kvactors.testing.scheduler import SimRuntime

class SimMailbox(Mailbox):
    """A :class:`Mailbox` as the scheduler runs it: named, and maybe stuck in a call."""

    __slots__ = ("frozen", "name", "runtime", "stopped")

    def __init__(self, runtime: SimRuntime, actor: Actor, name: str) -> None:
        super().__init__(actor)
        self.runtime = runtime
        self.name = name
        self.frozen = False  # stuck in a call: nothing is delivered until it thaws
        self.stopped = False

    def deliver(self, actor: Actor, message: object) -> None:
        # Only claimers deliver through here (the scheduler's steps call _run_handler).
        self.runtime._run_handler(self, actor, message, claimed=True)

    def __repr__(self) -> str:
        return f"SimMailbox({self.name!r}, pending={len(self.pending)}, owner={self.owner})"


class SimActorRef:
    """An actor's ref in a :class:`SimRuntime`: its mailbox, shared with the actors colocated on it."""

    __slots__ = ("actor", "mailbox", "name", "runtime")

    def __init__(self, runtime: SimRuntime, actor: Actor, name: str, mailbox: SimMailbox) -> None:
        self.runtime = runtime
        self.actor = actor
        self.name = name
        self.mailbox = mailbox

    def tell(self, message: object) -> None:
        self.mailbox.put(self.actor, message, self.name)

    def claim(self) -> bool:
        """Granted when the mailbox is idle and the seed says so: on threads a
        claim of an idle actor can fail too (another caller's turn)."""
        box = self.mailbox
        if box.closed:
            return False
        return self.runtime.rng.random() < self.runtime.claim_chance and box.claim()

    def run_claimed(self, message: object) -> None:
        # A client may be preempted between its claim and the handler: others run meanwhile.
        runtime = self.runtime
        if runtime._client_of and runtime.rng.random() < CHECKPOINT_CHANCE:
            runtime.checkpoint()
        self.mailbox.run_claimed(self.actor, message)

    @property
    def closed(self) -> bool:
        return self.mailbox.closed

    def __repr__(self) -> str:
        return f"SimActorRef({self.name!r}, pending={len(self.mailbox.pending)})"


SEPARATE_IDLE_CHANCE = 0.25
"""How often a mailbox whose thread handled its last message goes idle in a step of its own
(else at once): the moment between, when a claim is refused, is reachable, and rarely costs a step."""

CHECKPOINT_CHANCE = 0.5
"""How often a client pauses between its claim and the claimed handler (others run meanwhile)."""


class _Stop:
    """The option of stopping a closed, idle mailbox."""

    __slots__ = ("box",)

    def __init__(self, box: SimMailbox) -> None:
        self.box = box


_TASKS = object()  # the option of running one deferred task


class _Thaw:
    """A timer's target that ends a mailbox's stuck call."""

    __slots__ = ("box",)

    def __init__(self, box: SimMailbox) -> None:
        self.box = box

    def tell(self, message: object) -> None:
        self.box.frozen = False


class _Expected:
    __slots__ = ("future", "label", "start", "within")

    def __init__(self, future: Reply[Any] | Future[Any], label: str, start: float, within: float) -> None:
        self.future = future
        self.label = label
        self.start = start
        self.within = within
