"""Where actors run: the runtime interface, and the pykka thread runtime.

The actors' logic (:class:`Actor` subclasses) is plain code that handles one
message at a time and talks to the world only through its :class:`Runtime`:
``tell`` another actor, read the clock, schedule a message for later. Two
runtimes implement that interface:

* :class:`ThreadRuntime` (production): each actor on a pykka thread, its own
  or that of the actor it is colocated with;
* :class:`kvactors.testing.SimRuntime` (tests, race hunting): every actor on the
  caller's thread, a seeded scheduler choosing what runs next.

Besides ``tell``, a ref lets a caller *claim* an idle actor and run one
message on its own thread (:meth:`ThreadActorRef.claim`): the handler still
runs alone, and after everything told before it, but no thread is woken and
the caller does not wait for one. The manager uses this for the frontend's
calls to the primary tier; it is an interleaving the actors already allow
(the actor handling the message the moment it is put), taken on purpose.

An actor may also be spawned *colocated with* another: it keeps its own
logic, state and ref, but shares the other's thread and mailbox, so the two
handle their messages one at a time, in the order they were told, across
both. Fewer threads on a request's path mean fewer hand-offs of the GIL; the
manager colocates the supervisor with the primary.

Messages to a pykka thread wait in kvactors' own mailbox (a deque behind a
lock), not in pykka's inbox: pykka carries one "drain" per burst, and the
thread handles everything that arrived meanwhile. A busy actor thus costs a
deque append per message instead of a pykka envelope and a wake-up.

pykka's own weak spots are kept out here:

* **the stop race**: pykka's ``tell`` checks ``is_alive()`` and then puts, so a
  message put while the actor tears down is never read. :class:`ThreadActorRef`
  puts and closes under one lock: once ``close`` has queued the stop message,
  every later ``tell`` raises :class:`ActorStoppedError` at its sender instead
  of vanishing, and everything queued before it is processed;
* **the global registry**: actors are unregistered from pykka's
  ``ActorRegistry`` right after they start, so another library's
  ``ActorRegistry.stop_all()`` cannot stop them, and kvactors never calls it;
* **failures**: :meth:`Actor.deliver` catches every exception of a handler
  (``BaseException`` included, which pykka would answer by stopping every actor
  in the process). A failed ask gets the exception; a failed tell is logged and
  counted, and the actor lives on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, TypeVar

import pykka

from kvactors.actors.reply import Reply
from kvactors.logs import EventLogger, null_logger

M = TypeVar("M")


class ActorStoppedError(RuntimeError):
    """A message was sent to an actor that has been stopped."""


class ActorRef(Protocol):
    """Where to send messages to one actor. Thread-safe; nothing here blocks."""

    name: str

    def tell(self, message: object) -> None:
        """Queue ``message``; the actor handles it after everything queued before it."""
        ...

    def claim(self) -> bool:
        """Take the actor's turn for the calling thread if the actor is idle.

        Idle: no handler running and every message told to it handled. True:
        the caller holds the turn and must call :meth:`run_claimed` exactly
        once; until then the actor handles nothing else. False: nothing
        changed (the caller should ``tell`` instead).
        """
        ...

    def run_claimed(self, message: object) -> None:
        """Handle ``message`` on the calling thread, then give the turn back."""
        ...


class Runtime(Protocol):
    """What an actor may ask of the world it runs in."""

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> ActorRef:
        """Start ``actor``: on its own thread, or on ``colocate_with``'s thread and mailbox
        (a runtime may decline and give it its own). Colocated actors stop together."""
        ...

    def now(self) -> float:
        """Seconds on a monotonic clock (virtual in a simulation)."""
        ...

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        """Tell ``ref`` ``message`` after ``delay_s`` seconds (never earlier)."""
        ...

    def wait(self, future: Reply[Any] | Future[Any], timeout_s: float | None) -> bool:
        """Block until ``future`` is done or ``timeout_s`` passed; return whether done."""
        ...

    def stop(self, refs: list[ActorRef], timeout_s: float | None) -> list[str]:
        """Stop ``refs`` after the messages already queued to them, then the timers.

        Returns the names of the actors that did not stop within ``timeout_s``
        (stuck in a handler: they are left behind, and never block the
        interpreter's exit)."""
        ...


def handles(*message_types: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark an :class:`Actor` method as the handler of ``message_types``."""

    def mark(method: Callable[..., None]) -> Callable[..., None]:
        method._kvactors_handles = message_types  # type: ignore[attr-defined]
        return method

    return mark


class Actor:
    """The logic of one actor: a message handler, free of threads and pykka.

    Subclasses mark their handlers with :func:`handles`; :meth:`deliver` runs
    the handler of a message's type. The runtime calls :meth:`deliver` for one
    message at a time (on the actor's thread, or on a caller's that claimed
    it), so a subclass needs no locks for its own state, but must not assume
    which thread it runs on.
    """

    _handlers: ClassVar[dict[type, str]] = {}
    name: str = "actor"
    ref: ActorRef
    runtime: Runtime
    internal_errors: int = 0
    _log: EventLogger = null_logger()

    @property
    def tracing(self) -> bool:
        """Whether ``DEBUG`` events are kept now (asked at each use: a level set later counts at once); hot
        paths skip building the ones that are not."""
        return self._log.is_enabled_for(logging.DEBUG)

    @property
    def log(self) -> EventLogger:
        """The lifecycle logger."""
        return self._log

    @log.setter
    def log(self, logger: EventLogger) -> None:
        self._log = logger

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handlers: dict[type, str] = {}
        for base in reversed(cls.__mro__):
            for attr, value in vars(base).items():
                for message_type in getattr(value, "_kvactors_handles", ()):
                    handlers[message_type] = attr
        cls._handlers = handlers

    def bind(self, runtime: Runtime, ref: ActorRef) -> None:
        """Called by the runtime once, before the first message."""
        self.runtime = runtime
        self.ref = ref

    def deliver(self, message: object) -> None:
        """Handle one message; never raises."""
        handler = self._handlers.get(type(message))
        try:
            if handler is None:
                raise TypeError(f"{self.name} has no handler for {type(message).__name__}")
            getattr(self, handler)(message)
        except BaseException as exc:
            reply = getattr(message, "reply", None)
            if reply is not None and not reply.done():
                reply.set_exception(exc)
                return
            self.internal_errors += 1
            self.log.error(
                "actor_handler_failed",
                actor=self.name,
                message=type(message).__name__,
                error=repr(exc),
                traceback=traceback.format_exc(),
            )

    def on_stop(self) -> None:
        """Called once, after the last message."""


# --------------------------------------------------------------------- threads


class Routed:
    """A message for a colocated actor, in its host's inbox (the simulation's;
    a thread mailbox keeps (actor, message) pairs instead)."""

    __slots__ = ("actor", "message")

    def __init__(self, actor: Actor, message: object) -> None:
        self.actor = actor
        self.message = message


_IDLE, _THREAD, _CLAIMER = 0, 1, 2  # who owns a mailbox's turn


class _Drain:
    """The one message pykka carries: "handle what the mailbox holds"."""

    __slots__ = ()


_DRAIN = _Drain()


class _Mailbox:
    """One pykka thread's queue and turn, shared by the actors colocated on it.

    Messages wait here, in ``pending`` (actor, message) pairs, not in pykka's
    inbox: pykka carries one :class:`_Drain` per burst, so a message costs a
    deque append instead of a pykka envelope, and a busy actor's thread is
    not woken per message.

    ``owner`` says who handles what is pending: nobody (the actor is idle,
    nothing pending), the pykka thread (a drain is queued to it or running),
    or a claimer (a caller running a message on its own thread). Only the
    owner runs handlers, and it holds ``turn`` while it does, so handlers
    never overlap and ``on_stop`` waits for a claimer still running.
    ``lock`` guards ``pending``, ``owner`` and ``closed``; a drain is told
    under it, so it reaches pykka's inbox before the stop that ``close``
    queues.
    """

    __slots__ = ("actors", "closed", "lock", "owner", "pending", "pykka_ref", "turn")

    def __init__(self, actor: Actor) -> None:
        self.actors = [actor]  # the host first, then its guests
        self.pykka_ref: pykka.ActorRef[Any] | None = None
        self.lock = threading.Lock()
        self.turn = threading.Lock()
        self.pending: deque[tuple[Actor, object]] = deque()
        self.owner = _IDLE
        self.closed = False

    def put(self, actor: Actor, message: object, name: str) -> None:
        with self.lock:
            if self.closed:
                raise ActorStoppedError(f"actor {name} is stopped")
            self.pending.append((actor, message))
            if self.owner != _IDLE:
                return  # whoever owns the turn looks at pending before giving it up
            self.owner = _THREAD
            try:
                assert self.pykka_ref is not None
                self.pykka_ref.tell(_DRAIN)
            except BaseException:
                self.pending.pop()
                self.owner = _IDLE
                raise

    def claim(self) -> bool:
        if self.owner != _IDLE:
            return False  # busy, as seen without the lock: a sure "no" (checked again under it otherwise)
        with self.lock:
            if self.owner != _IDLE or self.closed or not self.turn.acquire(blocking=False):
                return False
            self.owner = _CLAIMER
            return True

    def drain(self) -> None:
        """The pykka thread's turn: handle everything pending, then go idle."""
        with self.turn:
            while True:
                with self.lock:
                    if not self.pending:
                        self.owner = _IDLE
                        return
                    batch, self.pending = self.pending, deque()
                for actor, message in batch:
                    actor.deliver(message)

    def end_claim(self) -> None:
        """A claimer's turn ends: what was told meanwhile goes to the pykka thread
        (once closed, the claimer handles it: no drain can follow the stop)."""
        try:
            while True:
                with self.lock:
                    if not self.pending:
                        self.owner = _IDLE
                        return
                    if not self.closed:
                        self.owner = _THREAD
                        assert self.pykka_ref is not None
                        self.pykka_ref.tell(_DRAIN)
                        return
                    batch, self.pending = self.pending, deque()
                for actor, message in batch:
                    actor.deliver(message)
        finally:
            self.turn.release()


class _PykkaShell(pykka.ThreadingActor):
    """The pykka thread of one actor and of the actors colocated with it."""

    # A tier stuck in a blocking call must not keep the interpreter alive.
    use_daemon_thread = True

    def __init__(self, mailbox: _Mailbox, thread_name: str) -> None:
        super().__init__()
        self._mailbox = mailbox
        self._thread_name = thread_name

    @staticmethod
    def _create_actor_inbox() -> Any:
        # A C-level queue: put/get without queue.Queue's Python-level Condition.
        return queue.SimpleQueue()

    def on_start(self) -> None:
        threading.current_thread().name = self._thread_name

    def on_receive(self, message: Any) -> None:
        self._mailbox.drain()

    def on_stop(self) -> None:
        with self._mailbox.turn:
            for actor in self._mailbox.actors:
                actor.on_stop()


class ThreadActorRef:
    """A reference to an actor on a pykka thread, free of pykka's stop race.

    Colocated actors' refs share their host's mailbox: closing one closes all.
    """

    __slots__ = ("_actor", "_claims", "_mailbox", "name")

    def __init__(self, name: str, mailbox: _Mailbox, actor: Actor, *, claims: bool = True) -> None:
        self.name = name
        self._mailbox = mailbox
        self._actor = actor
        self._claims = claims

    def tell(self, message: object) -> None:
        self._mailbox.put(self._actor, message, self.name)

    def claim(self) -> bool:
        """See :meth:`ActorRef.claim`. Never blocks; always False once closed
        (or with ``claims=False``). Claims the thread's turn: the actors
        colocated with this one are idle too until :meth:`run_claimed`."""
        return self._claims and self._mailbox.claim()

    def run_claimed(self, message: object) -> None:
        """Handle ``message`` on the calling thread, then give the turn back.

        Messages told to this mailbox meanwhile (by the handler itself, say,
        to a colocated actor) go to the actor's thread: a caller that went on
        handling them would hold the GIL longer, and the tiers' threads would
        wait for it (finalize p99 at 8 threads 2.1 -> 3.9 ms, measured)."""
        try:
            self._actor.deliver(message)
        finally:
            self._mailbox.end_claim()

    def close(self) -> pykka.Future[Any] | None:
        """Queue the stop after every message already told; refuse all later ones."""
        mailbox = self._mailbox
        with mailbox.lock:
            if mailbox.closed:
                return None
            mailbox.closed = True
            assert mailbox.pykka_ref is not None
            return mailbox.pykka_ref.stop(block=False)

    @property
    def closed(self) -> bool:
        return self._mailbox.closed

    def __repr__(self) -> str:
        return f"ThreadActorRef({self.name!r}, closed={self.closed})"


class _TimerThread:
    """One thread that delivers every delayed message of a runtime, in time order."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, ActorRef, object]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, when: float, ref: ActorRef, message: object) -> None:
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._heap, (when, next(self._seq), ref, message))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = None if not self._heap else max(self._heap[0][0] - time.monotonic(), 0)
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                _, _, ref, message = heapq.heappop(self._heap)
            with contextlib.suppress(ActorStoppedError):
                ref.tell(message)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class ThreadRuntime:
    """Actors on pykka threads: one per actor not colocated with another, plus one timer thread.

    Thread count is fixed by the actors (one per actor not colocated with
    another) and never grows with requests. For comparisons:
    ``claims=False`` makes every :meth:`ThreadActorRef.claim` fail, so every
    message goes through the actors' threads; ``colocation=False`` gives
    every actor its own thread, whatever ``colocate_with`` says.
    """

    _instances = itertools.count()

    def __init__(self, name: str | None = None, *, claims: bool = True, colocation: bool = True) -> None:
        self.name = name or f"kvactors-{next(self._instances)}"
        self.claims = claims
        self.colocation = colocation
        self._timer = _TimerThread(f"{self.name}-timer")
        self._refs: list[ThreadActorRef] = []

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> ThreadActorRef:
        if colocate_with is not None and self.colocation:
            assert isinstance(colocate_with, ThreadActorRef)
            mailbox = colocate_with._mailbox
            mailbox.actors.append(actor)
        else:
            mailbox = _Mailbox(actor)
            mailbox.pykka_ref = _PykkaShell.start(mailbox, f"{self.name}-{name}")
            # Out of the process-global registry: another library's stop_all() must not stop us.
            pykka.ActorRegistry.unregister(mailbox.pykka_ref)
        ref = ThreadActorRef(name, mailbox, actor, claims=self.claims)
        actor.bind(self, ref)
        self._refs.append(ref)
        return ref

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        self._timer.schedule(time.monotonic() + max(delay_s, 0.0), ref, message)

    def wait(self, future: Reply[Any] | Future[Any], timeout_s: float | None) -> bool:
        if isinstance(future, Reply):
            return future.wait(timeout_s)
        try:
            future.exception(timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def stop(self, refs: list[ActorRef], timeout_s: float | None) -> list[str]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stops = []
        for ref in refs:
            assert isinstance(ref, ThreadActorRef)
            stop_future = ref.close()
            if stop_future is not None:
                stops.append((ref.name, stop_future))
        left = []
        for name, stop_future in stops:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.01)
            try:
                stop_future.get(timeout=remaining)
            except pykka.Timeout:
                # A (daemon) thread stuck in a tier call cannot be killed: it is left behind.
                left.append(name)
        self._timer.stop()
        return left
