"""Where actors run, as the interface the actors and the manager program against.

The actors' logic (:class:`Actor` subclasses) is plain code that handles one
message at a time. It talks to the world only through its :class:`Runtime`.
It may ``tell`` another actor, read the clock, and schedule a message for later.
Two runtimes implement that interface, on one mailbox
(:mod:`kvactors.actors.mailbox`, which keeps the queue, the turn and the claims).

* :class:`~kvactors.actors.threads.ThreadRuntime` is for production. Each actor
  runs on a pykka thread, its own or that of the actor it is colocated with.
* :class:`kvactors.testing.SimRuntime` is for tests and race hunting. A seeded
  scheduler chooses what runs next.

This module imports no pykka, so the seeded scheduler runs without it.

Besides ``tell``, a ref lets a caller *claim* an idle actor and run one
message on its own thread (:meth:`ActorRef.claim`). The handler still runs
alone, and after everything told before it. No thread is woken, and the
caller does not wait for one. The manager uses this for the frontend's calls
to the primary tier. It is an interleaving the actors already allow (the
actor handling the message the moment it is put), taken on purpose.

An actor may also be spawned *colocated with* another. It keeps its own
logic, state and ref, but shares the other's thread and mailbox. The two
then handle their messages one at a time, in the order they were told, across
both.

Refs come before actors. Actors that talk to each other (the primary and the
supervisor, the supervisor and the tiers) each take their peers' refs in
their constructor. A runtime therefore hands out refs first
(:meth:`Runtime.new_ref`), the actors are built with them, and then each is
started (:meth:`Runtime.start`). A ref is bound to its actor once, by the
runtime, at its start. A message told to a ref before then waits in the ref
and is delivered first, at the start (a tier may report from ``attach``).
:meth:`Runtime.spawn` does both steps for an actor that needs no peers.

Failures follow one policy, stated here. What fails is contained where it
happened, except an interrupt of the process.

* A handler's ``Exception`` is its failure, and :meth:`Actor.deliver` catches
  it. A failed ask gets the exception. A failed tell is logged and counted,
  and the actor lives on.
  :meth:`Actor.settle` still follows it, so a tick cut short arms the next one.
  Entries a book gave up at a tick are acted on one at a time
  (:meth:`Actor.each_contained`), so one that raises is counted and the others go on.
* A tier plugin's call is foreign code. Anything it raises is that tier's
  failure, ``SystemExit`` and ``KeyboardInterrupt`` included. It is logged and
  counted, a job it was running fails, and its actor catches it
  (:mod:`kvactors.actors.secondary`). A plugin that calls ``sys.exit()``
  must not kill an actor's thread. No real interrupt can land there either.
  On threads, plugin calls never run on the main thread, the only one Python
  delivers signals to. A claim made there runs its own message alone
  (:meth:`~kvactors.actors.threads.ThreadActorRef.run_claimed`).
* A callback of a :class:`~kvactors.TransferEngine` future is foreign code
  too, run on an engine thread. Anything it raises is logged there
  (``completion_failed``), and the engine goes on.
* ``KeyboardInterrupt`` and ``SystemExit`` in a handler (a Ctrl-C while the
  main thread runs a claimed call) are not caught. They reach the thread
  that ran it, after the claim is given back.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, TypeVar

from kvactors.actors.reply import Reply
from kvactors.logs import EventLogger, null_logger

M = TypeVar("M")
T = TypeVar("T")
_DEBUG = logging.DEBUG


class ActorStoppedError(RuntimeError):
    """A message was sent to an actor that has been stopped."""


class ActorRef(Protocol):
    """Where to send messages to one actor. Thread-safe, and nothing here blocks."""

    name: str

    def tell(self, message: object) -> None:
        """Queue ``message``. The actor handles it after everything queued before it."""
        ...

    def claim(self) -> bool:
        """Take the actor's turn for the calling thread if the actor is idle.

        Idle means no handler running and every message told to it handled.
        ``True`` means the caller holds the turn and must call :meth:`run_claimed`
        exactly once. Until then the actor handles nothing else. ``False`` means
        nothing changed, and the caller should ``tell`` instead.
        """
        ...

    def run_claimed(self, message: object, until: Callable[[], bool] | None = None) -> None:
        """Handle ``message`` on the calling thread, then the messages told meanwhile, in order.

        The messages told meanwhile run until ``until()`` is true (the caller's reply is in)
        or none is left. Their number is bounded by
        :data:`~kvactors.actors.mailbox.CLAIM_FOLLOW_LIMIT`. Then the turn is given back.
        """
        ...


def alone() -> bool:
    """An ``until`` for :meth:`ActorRef.run_claimed` that runs the claimed message alone, nothing told meanwhile."""
    return True


class Runtime(Protocol):
    """What an actor may ask of the world it runs in."""

    def new_ref(self, name: str, *, colocate_with: ActorRef | None = None) -> ActorRef:
        """A ref for an actor not built yet, named ``name``, to hand to its peers.

        Its actor runs on a thread of its own, or on ``colocate_with``'s thread and
        mailbox (a runtime may decline and give it its own). Colocated actors stop
        together. Nothing runs and no thread starts until :meth:`start`.
        A message told to the ref before then is delivered at the start, before any later one.
        """
        ...

    def start(self, ref: ActorRef, actor: Actor) -> None:
        """Bind ``ref`` (from :meth:`new_ref`) to ``actor`` and start it.

        A colocated actor starts after the actor it is colocated with.
        ``ValueError`` if ``ref`` is bound already or its host has not started.
        """
        ...

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> ActorRef:
        """:meth:`new_ref` and :meth:`start` in one step, for an actor that needs no peers' refs."""
        ...

    def now(self) -> float:
        """Seconds on a monotonic clock (virtual in a simulation)."""
        ...

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        """Tell ``ref`` ``message`` after ``delay_s`` seconds (never earlier)."""
        ...

    def wait(self, future: Reply[Any] | Future[Any], timeout_s: float | None) -> bool:
        """Block until ``future`` is done or ``timeout_s`` passed, and return whether it is done."""
        ...

    def stop(self, refs: list[ActorRef], timeout_s: float | None) -> list[str]:
        """Stop ``refs`` after the messages already queued to them, then the timers.

        Returns the names of the actors that did not stop within ``timeout_s``.
        Those are stuck in a handler. They are left behind, and never block the
        interpreter's exit.
        """
        ...


def handles(*message_types: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark an :class:`Actor` method as the handler of ``message_types``."""

    def mark(method: Callable[..., None]) -> Callable[..., None]:
        method._kvactors_handles = message_types  # type: ignore[attr-defined]
        return method

    return mark


class Actor:
    """The logic of one actor, a message handler free of threads and pykka.

    Subclasses mark their handlers with :func:`handles`. :meth:`deliver` runs
    the handler of a message's type. The runtime calls :meth:`deliver` for one
    message at a time, on the actor's thread or on a caller's that claimed it.
    A subclass therefore needs no locks for its own state, but must not assume
    which thread it runs on.
    """

    _handlers: ClassVar[dict[type, str]] = {}
    name: str = "actor"
    ref: ActorRef
    runtime: Runtime
    internal_errors: int = 0
    _log: EventLogger = null_logger()

    _enabled_for: Callable[[int], bool] = _log.is_enabled_for

    @property
    def tracing(self) -> bool:
        """Whether ``DEBUG`` events are kept now.

        It is asked at each use, so a level set later counts at once. Hot paths skip
        building the events that are not kept.
        """
        return self._enabled_for(_DEBUG)

    @property
    def log(self) -> EventLogger:
        """The lifecycle logger."""
        return self._log

    @log.setter
    def log(self, logger: EventLogger) -> None:
        self._log = logger
        self._enabled_for = logger.is_enabled_for  # bound once: ``tracing`` is read on every hot path

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handlers: dict[type, str] = {}
        for base in reversed(cls.__mro__):
            for attr, value in vars(base).items():
                for message_type in getattr(value, "_kvactors_handles", ()):
                    handlers[message_type] = attr
        cls._handlers = handlers

    def bind(self, runtime: Runtime, ref: ActorRef) -> None:
        """Called by the runtime once, at :meth:`Runtime.start`, before the first message."""
        self.runtime = runtime
        self.ref = ref

    def deliver(self, message: object) -> None:
        """Handle one message, then :meth:`settle`, even after a handler that raised.

        An ``Exception`` of either is contained (see the module docstring).
        A handler that failed still leaves its consequences to :meth:`settle`.
        So a tick whose handler raised part-way still arms the next one.
        A ``BaseException`` that is not one (``KeyboardInterrupt``, ``SystemExit``)
        propagates to the thread running the handler, with no :meth:`settle`.
        """
        handler = self._handlers.get(type(message))
        try:
            if handler is None:
                raise TypeError(f"{self.name} has no handler for {type(message).__name__}")
            getattr(self, handler)(message)
        except Exception as exc:
            self._contain(message, exc)
        try:
            self.settle()
        except Exception as exc:
            self._contain(message, exc)

    def _contain(self, message: object, exc: Exception) -> None:
        """``message``'s handling failed with ``exc``.

        An ask not answered yet gets the exception.
        Otherwise it is an internal error, counted and logged.
        """
        reply = getattr(message, "reply", None)
        if reply is not None and not reply.done():
            reply.set_exception(exc)
            return
        self.count_internal_error(type(message).__name__, exc)

    def each_contained(self, items: Iterable[T], act: Callable[[T], object], what: str) -> list[T]:
        """Call ``act`` on each of ``items``; returns the items whose call raised an ``Exception``.

        Each such failure is counted and logged as an internal error (:meth:`count_internal_error`).
        The items after it are still acted on.
        It is for entries a book has given up already (expired at a tick), which nothing else would act on.
        ``what`` names the message being handled, for the log.
        """
        failed = []
        for item in items:
            try:
                act(item)
            except Exception as exc:
                self.count_internal_error(what, exc)
                failed.append(item)
        return failed

    def count_internal_error(self, what: str, exc: Exception) -> None:
        """Count and log ``exc``, a failure inside this actor while it handled ``what``.

        Call it from an ``except`` block, so that the traceback is the failure's.
        """
        self.internal_errors += 1
        self.log.error(
            "actor_handler_failed",
            actor=self.name,
            message=what,
            error=repr(exc),
            traceback=traceback.format_exc(),
        )

    def settle(self) -> None:
        """Act on what must follow any message. Called after every handler, even one that raised, on the same turn.

        An actor whose state has consequences that any handler may bring about
        acts on them here, once, instead of at the end of each handler. A barrier
        now due is one such consequence, and the next tick after one fired is
        another. A failure here counts as the handler's.
        """

    def on_stop(self) -> None:
        """Called once, after the last message."""
