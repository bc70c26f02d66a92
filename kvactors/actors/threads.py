"""The thread runtime: each :class:`~kvactors.actors.mailbox.Mailbox` drained by a pykka thread.

Messages wait in kvactors' own mailbox, not in pykka's inbox.
pykka carries one "drain" per burst (the mailbox's ``wake``).
The thread then handles everything that arrived meanwhile.
A busy actor thus costs a deque append per message instead of a pykka envelope and a wake-up.

pykka's own weak spots are kept out here.

* **The stop race.**
  pykka's ``tell`` checks ``is_alive()`` and then puts.
  So a message put while the actor tears down is never read.
  The mailbox puts and closes under one lock.
  Once :meth:`ThreadActorRef.close` has queued the stop message, every later ``tell`` raises
  :class:`~kvactors.actors.runtime.ActorStoppedError` at its sender instead of vanishing.
  Everything queued before the stop is processed.
* **The global registry.**
  Actors are unregistered from pykka's ``ActorRegistry`` right after they start.
  So another library's ``ActorRegistry.stop_all()`` cannot stop them, and kvactors never calls it.

There is one thread per mailbox (an actor and those colocated with it).
There is also one timer thread per runtime, which delivers every delayed message.
A ref is made before its actor (:meth:`ThreadRuntime.new_ref`).
No thread starts until the first actor does (:meth:`ThreadRuntime.start`).
So a manager whose actors fail to build leaves none behind.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pykka

from kvactors.actors.mailbox import Mailbox
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, ActorStoppedError, alone

_MAIN_THREAD = threading.main_thread().ident
"""Where Python delivers signals (asked on every claimed run: an int compare)."""


class _Drain:
    """The one message pykka carries: "handle what the mailbox holds"."""

    __slots__ = ()


_DRAIN = _Drain()


class _PykkaShell(pykka.ThreadingActor):
    """The pykka thread of one mailbox: drains it when woken, stops its actors last."""

    # A tier stuck in a blocking call must not keep the interpreter alive.
    use_daemon_thread = True

    def __init__(self, mailbox: Mailbox, thread_name: str) -> None:
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
        mailbox = self._mailbox
        with mailbox.turn:
            while (batch := mailbox.take_batch()) is not None:
                for actor, item in batch:
                    actor.deliver(item)

    def on_stop(self) -> None:
        with self._mailbox.turn:
            for actor in self._mailbox.actors:
                actor.on_stop()


class _MailboxThread:
    """A mailbox and the pykka thread that drains it.

    Made with the host's ref, before any actor on it exists. The mailbox's ``wake`` is
    :meth:`wake`, given at its construction. The thread starts with the host
    (:meth:`start`), before anything can be told to the mailbox. Thread-safe after that:
    ``wake`` runs under the mailbox's lock, ``stop`` once, from :meth:`Mailbox.close`.
    """

    __slots__ = ("_pykka_ref", "mailbox", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.mailbox = Mailbox(self.wake)
        self._pykka_ref: pykka.ActorRef[Any] | None = None

    @property
    def started(self) -> bool:
        return self._pykka_ref is not None

    def start(self) -> None:
        """Start the thread (once)."""
        pykka_ref = _PykkaShell.start(self.mailbox, self.name)
        # Out of the process-global registry: another library's stop_all() must not stop us.
        pykka.ActorRegistry.unregister(pykka_ref)
        self._pykka_ref = pykka_ref

    def wake(self) -> None:
        """One drain to the thread (the mailbox's ``wake``: only a started actor is told anything)."""
        pykka_ref = self._pykka_ref
        assert pykka_ref is not None, f"{self.name}: told before its actor started"
        pykka_ref.tell(_DRAIN)

    def stop(self) -> pykka.Future[Any] | None:
        """Queue the thread's stop after the drains already queued.

        Returns ``None`` if it never started.
        """
        return None if self._pykka_ref is None else self._pykka_ref.stop(block=False)


class ThreadActorRef:
    """A reference to an actor on a pykka thread, free of pykka's stop race.

    Made before its actor, and bound to it once by :meth:`ThreadRuntime.start`.
    Colocated actors' refs share their host's mailbox: closing one closes all.
    """

    __slots__ = ("_actor", "_claims", "_early", "_early_lock", "_mailbox", "_thread", "colocated", "name")

    _actor: Actor

    def __init__(self, name: str, thread: _MailboxThread, *, colocated: bool = False, claims: bool = True) -> None:
        self.name = name
        self._thread = thread
        self._mailbox = thread.mailbox
        self.colocated = colocated
        self._claims = claims
        # Messages told before the actor started (a tier may report from ``attach``), delivered by
        # :meth:`deliver_early` once its thread runs; None from then on.
        self._early: list[object] | None = []
        self._early_lock = threading.Lock()

    def bind(self, actor: Actor) -> None:
        """Deliver this ref's messages to ``actor`` (once, at its start)."""
        if hasattr(self, "_actor"):
            raise ValueError(f"actor {self.name} is started already")
        self._actor = actor

    def tell(self, message: object) -> None:
        """Queue ``message`` for the actor.

        Before the actor starts, the message waits here and is delivered first, in order, at its start.
        """
        if self._early is not None:
            with self._early_lock:
                if self._early is not None:
                    self._early.append(message)
                    return
        self._mailbox.put(self._actor, message, self.name)

    def deliver_early(self) -> None:
        """Queue what was told before the start, in order (once, when the actor's thread runs).

        The lock is held while queueing, so a message told meanwhile comes after them.
        """
        with self._early_lock:
            early, self._early = self._early, None
            for message in early or ():
                self._mailbox.put(self._actor, message, self.name)

    def claim(self) -> bool:
        """See :meth:`ActorRef.claim`.

        Never blocks.
        Always False once closed (or with ``claims=False``).
        Claims the thread's turn, so the actors colocated with this one are idle too until :meth:`run_claimed`.
        """
        return self._claims and self._mailbox.claim()

    def run_claimed(self, message: object, until: Callable[[], bool] | None = None) -> None:
        """Handle ``message`` on the calling thread, then what was told meanwhile (a bounded
        number, until ``until()``: :meth:`Mailbox.run_claimed`), then give the turn back. A
        ``KeyboardInterrupt`` in a handler gives the turn back and reaches the caller.

        On the main thread, ``message`` alone: Python delivers signals there, and a
        Ctrl-C must not cut another actor's handler (a finalize half sent) short."""
        if until is not alone and threading.get_ident() == _MAIN_THREAD:
            until = alone
        self._mailbox.run_claimed(self._actor, message, until)

    def close(self) -> pykka.Future[Any] | None:
        """Queue the stop after every message already told, and refuse all later ones."""
        return self._mailbox.close(self._thread.stop)

    @property
    def mailbox(self) -> Mailbox:
        return self._mailbox

    @property
    def thread(self) -> _MailboxThread:
        """The mailbox and thread this actor runs on (its host's, when colocated)."""
        return self._thread

    @property
    def closed(self) -> bool:
        return self._mailbox.closed

    def __repr__(self) -> str:
        return f"ThreadActorRef({self.name!r}, closed={self.closed})"


class _TimerThread:
    """One thread that delivers every delayed message of a runtime, in time order.

    The thread starts with the runtime's first actor or first delayed message (:meth:`start`).
    """

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, ActorRef, object]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._started = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread, unless it started or stopped already."""
        with self._cond:
            self._start()

    def _start(self) -> None:
        # Under the lock: a stop meanwhile would join a thread not started yet.
        if not self._started and not self._stopped:
            self._started = True
            self._thread.start()

    def schedule(self, when: float, ref: ActorRef, message: object) -> None:
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._heap, (when, next(self._seq), ref, message))
            self._cond.notify()
            if not self._started:
                self._start()

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

    def stop(self, timeout_s: float) -> bool:
        """Drop what is scheduled and end the thread.

        Returns whether it ended within ``timeout_s``.
        It may not, when it is in the middle of a ``tell`` to an actor whose put blocks.
        """
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
            if not self._started:
                return True
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive() or threading.current_thread() is self._thread

    @property
    def name(self) -> str:
        return self._thread.name


class ThreadRuntime:
    """Actors on pykka threads: one per actor not colocated with another, plus one timer thread.

    Thread count is fixed by the actors (one per actor not colocated with another).
    It never grows with requests.
    Two switches are there for comparisons.
    ``claims=False`` makes every :meth:`ThreadActorRef.claim` fail, so every message goes through the actors' threads.
    ``colocation=False`` gives every actor its own thread, whatever ``colocate_with`` says.
    """

    _instances = itertools.count()

    def __init__(self, name: str | None = None, *, claims: bool = True, colocation: bool = True) -> None:
        self.name = name or f"kvactors-{next(self._instances)}"
        self.claims = claims
        self.colocation = colocation
        self._timer = _TimerThread(f"{self.name}-timer")
        self._refs: list[ThreadActorRef] = []

    def new_ref(self, name: str, *, colocate_with: ActorRef | None = None) -> ThreadActorRef:
        """See :meth:`Runtime.new_ref`. A ref not colocated comes with its mailbox and thread (not started)."""
        if colocate_with is not None and self.colocation:
            assert isinstance(colocate_with, ThreadActorRef)
            return ThreadActorRef(name, colocate_with.thread, colocated=True, claims=self.claims)
        return ThreadActorRef(name, _MailboxThread(f"{self.name}-{name}"), claims=self.claims)

    def start(self, ref: ActorRef, actor: Actor) -> None:
        """See :meth:`Runtime.start`. A host starts its thread (and the first one the timer's)."""
        assert isinstance(ref, ThreadActorRef)
        thread = ref.thread
        if ref.colocated and not thread.started:
            raise ValueError(f"actor {ref.name} must start after the actor it is colocated with")
        ref.bind(actor)
        actor.bind(self, ref)
        thread.mailbox.admit(actor)
        if not ref.colocated:
            self._timer.start()
            thread.start()
        self._refs.append(ref)
        ref.deliver_early()

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> ThreadActorRef:
        ref = self.new_ref(name, colocate_with=colocate_with)
        self.start(ref, actor)
        return ref

    @property
    def refs(self) -> list[ThreadActorRef]:
        """Every actor started here, in start order."""
        return list(self._refs)

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
        """See :meth:`Runtime.stop`. The timer thread too ends within ``timeout_s``, or is
        named among what was left behind (by its thread name)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stops = []
        for ref in refs:
            assert isinstance(ref, ThreadActorRef)
            stop_future = ref.close()
            if stop_future is not None:
                stops.append((ref, stop_future))
        left = []
        for ref, stop_future in stops:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.01)
            try:
                stop_future.get(timeout=remaining)
            except pykka.Timeout:
                # A (daemon) thread stuck in a tier call cannot be killed: it is left behind.
                left.append(ref.name)
        remaining = 1.0 if deadline is None else max(deadline - time.monotonic(), 0.01)
        if not self._timer.stop(remaining):
            left.append(self._timer.name)
        return left
