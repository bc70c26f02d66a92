"""The mailbox: one actor's queue and turn, and the claims, for every runtime.

A :class:`Mailbox` is a plain state machine.
It starts no thread and knows nothing of pykka or of a scheduler.
Both runtimes drive this one class.

* With :class:`~kvactors.actors.threads.ThreadRuntime`, the owner ``THREAD`` is a pykka thread.
  ``wake`` wakes it by telling it a drain.
  It then runs :meth:`Mailbox.take_batch` until the mailbox goes idle.
* With :class:`~kvactors.testing.SimRuntime`, ``wake`` does nothing.
  The seed picks, among the mailboxes owned by ``THREAD``, which one handles its next message
  (:meth:`Mailbox.take_one`), one step at a time.

They differ only in who picks the next step.
The transitions are these, each taken under ``lock``.

* :meth:`~Mailbox.put` queues a message.
  An idle mailbox becomes the thread's, and ``wake`` is called.
  That call is under the lock, so on pykka the drain reaches the thread's inbox
  before a stop that :meth:`~Mailbox.close` queues.
* :meth:`~Mailbox.claim` makes an idle mailbox (nothing pending, no handler running, not closed) a caller's.
  The caller then runs one message on its own thread (:meth:`~Mailbox.run_claimed`).
  After it, the caller runs what was told meanwhile, a bounded number.
* :meth:`~Mailbox.end_claim` ends the claimer's turn.
  What was told meanwhile goes to the thread.
  Once the mailbox is closed, the claimer handles it itself, as no drain can follow the stop.
* :meth:`~Mailbox.take_batch` and :meth:`~Mailbox.take_one` let the thread take what is pending.
  With nothing pending, the mailbox goes idle.

Whoever owns the turn also holds ``turn`` (a lock) while it runs handlers.
So handlers never overlap, and a stop waits for a claimer still running.
Several actors may share one mailbox (colocation).
Then ``pending`` holds ``(actor, message)`` pairs, and the host comes first in ``actors``.

A mailbox is made with its ``wake`` and before its actors,
as their refs are handed to their peers before the actors are built.
The runtime adds each actor when it starts it (:meth:`Mailbox.admit`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from kvactors.actors.runtime import Actor, ActorStoppedError, alone

T = TypeVar("T")

CLAIM_FOLLOW_LIMIT = 16
"""At most this many messages told during a claimed run are handled by the claimer after its own.

It is a bound because what others tell meanwhile must not keep a caller's thread for ever."""

IDLE, THREAD, CLAIMER = 0, 1, 2
"""Who owns a mailbox's turn: nobody, the actor's thread, or a caller that claimed it."""


def _nothing() -> None:
    return None


class Mailbox:
    """One actor's (or colocated actors') queue and turn (see the module docstring).

    Thread-safe: every transition is taken under ``lock``.
    Handlers run outside it, holding ``turn``.
    ``wake`` is called under ``lock`` when an idle mailbox becomes the thread's.
    It must not call back into the mailbox.
    """

    __slots__ = ("actors", "closed", "lock", "owner", "pending", "turn", "wake")

    def __init__(self, wake: Callable[[], object] = _nothing) -> None:
        self.actors: list[Actor] = []  # the host first, then its guests, as they start
        self.lock = threading.Lock()
        self.turn = threading.Lock()
        self.pending: deque[tuple[Actor, object]] = deque()
        self.owner = IDLE
        self.closed = False
        self.wake = wake

    def admit(self, actor: Actor) -> None:
        """Run ``actor``'s messages here from now on (the first actor admitted is the host).

        The runtime calls it once per actor, at its start, before anything is told to it.
        """
        self.actors.append(actor)

    def put(self, actor: Actor, message: object, name: str) -> None:
        """Queue ``message`` for ``actor``.

        Once the mailbox is closed, raises ``ActorStoppedError`` naming ``name``, and nothing is queued.
        """
        with self.lock:
            if self.closed:
                raise ActorStoppedError(f"actor {name} is stopped")
            self.pending.append((actor, message))
            if self.owner != IDLE:
                return  # whoever owns the turn looks at pending before giving it up
            self.owner = THREAD
            try:
                self.wake()
            except BaseException:
                self.pending.pop()
                self.owner = IDLE
                raise

    def claim(self) -> bool:
        """Take the turn for the calling thread if the mailbox is idle.

        Never blocks.
        On True, the caller must call :meth:`run_claimed` (or :meth:`end_claim`) once.
        """
        if self.owner != IDLE:
            return False  # busy, as seen without the lock: a sure "no" (checked again under it otherwise)
        with self.lock:
            if self.owner != IDLE or self.closed or not self.turn.acquire(False):
                return False
            self.owner = CLAIMER
            return True

    def run_claimed(self, actor: Actor, message: object, until: Callable[[], bool] | None = None) -> None:
        """Handle ``message`` on the calling thread (which holds the claim), then what was
        told meanwhile, in order, then end the claim.

        What was told meanwhile is mostly what the handler caused
        (a colocated actor's part of the call, the releases it sent).
        It is also other senders' messages.
        The claimer handles them rather than waking the thread for them, which costs no thread hand-off.
        Then the next call from the same caller finds the mailbox idle.

        It stops once ``until()`` is true, that is once the caller's reply is in, and it returns at once.
        It also stops when nothing is pending, or when it handled :data:`CLAIM_FOLLOW_LIMIT` more messages.
        That bound is there because what others tell meanwhile must not keep a caller for ever.
        The rest goes to the thread.
        With ``until`` returning True at once, it handles the claimed message alone.
        """
        try:
            self.deliver(actor, message)
            if until is alone:  # an inline tier call, the main thread's: nothing to follow
                return
            for _ in range(CLAIM_FOLLOW_LIMIT):
                if until is not None and until():
                    break
                with self.lock:
                    if not self.pending:
                        break
                    item = self.pending.popleft()
                self.deliver(*item)
        finally:
            self.end_claim()

    def end_claim(self) -> None:
        """End a claimer's turn.

        What was told meanwhile goes to the thread.
        Once the mailbox is closed, the claimer handles it, as no drain can follow the stop.
        Releases ``turn`` whatever a handler raised.
        """
        try:
            while True:
                with self.lock:
                    if not self.pending:
                        self.owner = IDLE
                        return
                    if not self.closed:
                        self.owner = THREAD
                        self.wake()
                        return
                    batch, self.pending = self.pending, deque()
                for actor, message in batch:
                    self.deliver(actor, message)
        finally:
            self.turn.release()

    def take_batch(self) -> deque[tuple[Actor, object]] | None:
        """The thread's turn: everything pending, or ``None`` (the mailbox is idle now)."""
        with self.lock:
            if not self.pending:
                self.owner = IDLE
                return None
            batch, self.pending = self.pending, deque()
            return batch

    def take_one(self) -> tuple[Actor, object] | None:
        """The thread's turn, one message at a time: the next one, or ``None`` (idle now)."""
        with self.lock:
            if not self.pending:
                self.owner = IDLE
                return None
            return self.pending.popleft()

    def close(self, stop: Callable[[], T]) -> T | None:
        """Refuse every later :meth:`put`.

        The first call returns ``stop()``, run under the lock, so a drain woken before it is queued before it.
        Later calls return ``None``.
        """
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            return stop()

    def deliver(self, actor: Actor, message: object) -> None:
        """Run one handler (a runtime may wrap this: tracing, the running actor)."""
        actor.deliver(message)
