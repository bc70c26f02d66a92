"""``PrimaryDoor``: the one way the facades' calls reach the primary tier's actor.

Both facades (:class:`~kvactors.TieringManager` and :class:`~kvactors.aio.AsyncTieringManager`)
put their messages through one door.
The door owns what must be decided once per message, whoever calls.

* The **gate** makes "stopped" and "queued" one step.
  So no message lands behind the shutdown that :meth:`close` queued.
* The **claim** lets the caller run the handler on its own thread while the primary is idle
  (:meth:`~kvactors.actors.runtime.ActorRef.run_claimed`).
  The caller also runs what was told meanwhile, up to ``until``.
* The **registry** of live request attempts refuses a duplicate ``on_new_request`` at its caller,
  without a round trip.
  The primary forgets an attempt (:meth:`forget`) once its record is gone.

Thread-safe: any number of threads may use one door at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvactors.actors import messages as m
from kvactors.actors.runtime import ActorRef, ActorStoppedError
from kvactors.core.errors import LifecycleError, ManagerStoppedError
from kvactors.logs import EventLogger
from kvactors.types import ReqContext


class PrimaryDoor:
    """The gate, the claims and the live-request registry of one runtime (see the module docstring).

    ``answer_bound_s`` is how long a caller waits for an answer before it gives up, on a wedged primary.
    ``log`` is the runtime's lifecycle logger.
    """

    __slots__ = ("_closed", "_gate", "_live", "_primary", "answer_bound_s", "log")

    def __init__(self, primary: ActorRef, *, answer_bound_s: float, log: EventLogger) -> None:
        self._primary = primary
        self.answer_bound_s = answer_bound_s
        self.log = log
        self._gate = threading.Lock()
        self._live: set[tuple[str, int]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, message: object, *, claim: bool = True, until: Callable[[], bool] | None = None) -> None:
        """Run ``message`` here if the primary is idle (and ``claim``), else queue it to the primary's thread.

        Raises ``ManagerStoppedError`` once the door is closed, and nothing is sent.
        After a claim, the caller handles what was told to the primary's mailbox meanwhile
        (:meth:`~kvactors.actors.mailbox.Mailbox.run_claimed`).
        With ``until`` ``None``, it handles up to 16 messages.
        Otherwise it handles them until ``until()`` is true, when a blocking call's reply is in.
        """
        with self._gate:
            claimed = self._put(message, claim)
        # A claimed message runs after the gate: the claim already orders it before anything
        # queued later, and the other callers need not wait for the handler.
        if claimed:
            self._primary.run_claimed(message, until)

    def register(self, ctx: ReqContext, *, claim: bool = True, until: Callable[[], bool] | None = None) -> None:
        """Send ``on_new_request`` for ``ctx`` (checked already), as :meth:`send` does.

        Raises ``LifecycleError`` if the attempt is live (or finishing), and nothing is sent then.
        """
        identity = ctx.identity
        message = m.NewRequest(ctx)
        with self._gate:
            if identity in self._live and not self._closed:
                raise LifecycleError(f"on_new_request: request {ctx} is already active (or finishing)")
            claimed = self._put(message, claim)
            self._live.add(identity)
        if claimed:
            self._primary.run_claimed(message, until)

    def forget(self, identity: tuple[str, int]) -> None:
        """Note that the primary's record of ``identity`` is gone, so a new lifetime may be registered.

        The primary's handler calls it, on whatever thread runs it, never under the gate.
        """
        with self._gate:
            self._live.discard(identity)

    def close(self, last: object) -> bool:
        """Queue ``last`` (the shutdown) and refuse every later message.

        Returns whether this call closed the door.
        False means it was closed already, and nothing was queued.
        """
        with self._gate:
            if self._closed:
                return False
            self._closed = True
            self._primary.tell(last)
            return True

    def _put(self, message: object, claim: bool) -> bool:
        """Claim the idle primary, or queue the message. Runs under the gate.

        Returns True when the caller runs the claim.
        """
        if self._closed:
            raise ManagerStoppedError("the TieringManager is stopped")
        if claim and self._primary.claim():
            return True
        try:
            self._primary.tell(message)
        except ActorStoppedError:
            raise ManagerStoppedError("the TieringManager is stopped") from None
        return False
