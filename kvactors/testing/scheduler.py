"""A seeded, single-threaded runtime: the same actors, a scheduler instead of threads.

:class:`SimRuntime` implements :class:`~kvactors.actors.runtime.Runtime`, so a
``TieringManager`` (and everything behind it) runs on it unchanged. There are
no threads: each actor has a FIFO inbox, exactly like a pykka inbox, and
:meth:`SimRuntime.step` picks, from a seeded ``random.Random``, what happens
next:

* deliver the next message of one actor that has mail;
* run one *deferred task* (work that would happen on another thread: a tier's
  I/O completing, a copy finishing), registered with :meth:`defer`;
* run one step of a *client* (a generator standing for a frontend thread,
  registered with :meth:`spawn_client`); a client's claim of an idle actor
  (:meth:`SimActorRef.claim`) is granted or not by the seed too, and a
  claimed message is handled within the client's step;
* advance virtual time to the next timer (so deadlines race with completions).

A seed therefore fixes a whole interleaving, and the same seed replays it
exactly. Real threads explore interleavings by luck; this explores them on
purpose (``architecture-notes.md``: a planted race found in 735 of 1000 seeds,
0 of 100 thread runs).

Blocking calls made from outside any client (``manager.lookup(...)`` in a test)
work too: :meth:`wait` keeps stepping until the reply is there.

An actor can be *stuck in a call* (:meth:`SimRuntime.hang_current`, from
inside its handler): it handles nothing more, and cannot be claimed, until
virtual time reaches its thaw, as a thread blocked inside that call would.
:meth:`SimRuntime.expect_by` checks that a reply comes by its deadline: if
the scheduler must advance time past it (nothing else left to run) while the
reply is still missing, that reply depends on something later than its
deadline (a stuck actor's thaw, say), and :attr:`SimRuntime.late` says so. A
jump of time the seed chose while work was pending (a slow machine) restarts
every expected reply's clock: only waits the runtime could not avoid count.

Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, ActorStoppedError, Routed

Client = Generator["Reply[Any] | Future[Any] | None", None, None]
"""A simulated frontend thread: yields a future to wait for it, or ``None`` to let others run."""


class SimActorRef:
    """An actor's inbox in a :class:`SimRuntime`.

    A colocated actor's ref has no inbox of its own: it puts its messages,
    :class:`~kvactors.actors.runtime.Routed`, in its host's, as on threads.
    """

    __slots__ = ("actor", "closed", "frozen", "guests", "host", "inbox", "name", "running", "runtime", "stopping")

    def __init__(self, runtime: SimRuntime, actor: Actor, name: str, host: SimActorRef | None = None) -> None:
        self.runtime = runtime
        self.actor = actor
        self.name = name
        self.host = host
        self.guests: list[SimActorRef] = []
        self.inbox: deque[object] = deque()
        self.closed = False
        self.running = False
        self.frozen = False  # stuck in a call: nothing is delivered until it thaws
        self.stopping = False  # stopped while stuck: on_stop once its inbox is drained

    def tell(self, message: object) -> None:
        host = self.host
        if host is not None:
            host.tell(Routed(self.actor, message))
            return
        if self.closed:
            raise ActorStoppedError(f"actor {self.name} is stopped")
        self.inbox.append(message)

    def claim(self) -> bool:
        """Granted when the actor is idle (no mail, not running) and the seed says so:
        on threads a claim of an idle actor can fail too (another caller's turn)."""
        if self.host is not None:
            return self.host.claim()
        if self.closed or self.inbox or self.running or self.frozen:
            return False
        return self.runtime.rng.random() < self.runtime.claim_chance

    def run_claimed(self, message: object) -> None:
        if self.host is not None:
            self.host.run_claimed(Routed(self.actor, message))
            return
        self.runtime._deliver_now(self, message, claimed=True)

    def __repr__(self) -> str:
        return f"SimActorRef({self.name!r}, inbox={len(self.inbox)})"


class SimulationStuck(RuntimeError):
    """A wait can never end: nothing left to run and the future is not done."""


class _Thaw:
    """A timer's target that ends an actor's stuck call."""

    __slots__ = ("ref",)

    def __init__(self, ref: SimActorRef) -> None:
        self.ref = ref

    def tell(self, message: object) -> None:
        self.ref.frozen = False


class _Expected:
    __slots__ = ("future", "label", "start", "within")

    def __init__(self, future: Reply[Any] | Future[Any], label: str, start: float, within: float) -> None:
        self.future = future
        self.label = label
        self.start = start
        self.within = within


class SimRuntime:
    """The deterministic scheduler; see the module docstring.

    ``time_jump_chance``: how often, when other work is possible, the scheduler
    jumps to the next timer instead (higher makes deadlines fire "early", as a
    slow machine would). ``claim_chance``: how often a claim of an idle actor
    is granted (the claimed message then runs within the caller's step).
    ``trace``: keep a readable log of every choice.
    """

    def __init__(self, seed: int, *, time_jump_chance: float = 0.02, claim_chance: float = 0.5,
                 trace: bool = False) -> None:
        self.seed = seed
        self.claim_chance = claim_chance
        self.rng = random.Random(seed)
        self.time_jump_chance = time_jump_chance
        self.steps = 0
        self.trace: list[str] | None = [] if trace else None
        self._now = 0.0
        self._refs: list[SimActorRef] = []
        self._timers: list[tuple[float, int, ActorRef | _Thaw, object]] = []
        self._timer_seq = itertools.count()
        self._tasks: list[tuple[str, Callable[[], None]]] = []
        self._clients: list[tuple[str, Client, Reply[Any] | Future[Any] | None]] = []
        self._current: list[tuple[SimActorRef, bool]] = []  # deliveries in progress (claims nest)
        self._expected: list[_Expected] = []
        self.late: list[str] = []
        """Replies that came later than their deadline (see :meth:`expect_by`)."""

    # ------------------------------------------------------------ the Runtime interface

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> SimActorRef:
        host = None
        if colocate_with is not None:
            assert isinstance(colocate_with, SimActorRef) and colocate_with.host is None
            host = colocate_with
        ref = SimActorRef(self, actor, name, host)
        actor.bind(self, ref)
        if host is not None:
            host.guests.append(ref)
        else:
            self._refs.append(ref)  # the scheduler's list: refs with an inbox
        return ref

    def now(self) -> float:
        return self._now

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        heapq.heappush(self._timers, (self._now + max(delay_s, 0.0), next(self._timer_seq), ref, message))

    def wait(self, future: Reply[Any] | Future[Any], timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else self._now + timeout_s
        while not future.done():
            if deadline is not None and self._now >= deadline:
                return False
            if not self.step(until=deadline):
                if deadline is None:
                    # On threads this wait would hang forever: make the deadlock visible.
                    raise SimulationStuck(f"seed {self.seed}: nothing left to run after {self.steps} steps")
                return False
        return True

    def stop(self, refs: list[ActorRef], timeout_s: float | None) -> list[str]:
        # Everything already queued to these actors is delivered first, as pykka does;
        # colocated actors stop with their host. One stuck in a call past the timeout
        # is left behind: it refuses new messages, handles its queued ones when it
        # thaws, then stops.
        hosts = [ref.host or ref for ref in refs if isinstance(ref, SimActorRef)]
        targets = [ref for ref in self._refs if any(ref is host for host in hosts)]
        deadline = None if timeout_s is None else self._now + timeout_s
        while any(ref.inbox for ref in targets) and self.step(until=deadline):
            pass
        left = []
        for ref in targets:
            if ref.closed:
                continue
            for stopping in (ref, *ref.guests):
                stopping.closed = True
            if ref.inbox or ref.frozen:
                ref.stopping = True
                left.append(ref.name)
            else:
                self._on_stop(ref)
        return left

    @staticmethod
    def _on_stop(ref: SimActorRef) -> None:
        ref.stopping = False
        for stopping in (ref, *ref.guests):
            stopping.actor.on_stop()

    # ------------------------------------------------------------ simulation-only hooks

    def hang_current(self, seconds: float) -> bool:
        """The actor whose handler is running is stuck in it for ``seconds`` of
        virtual time (from the moment the handler returns). Ignored (False) in a
        claimed call: that runs on the claimer's thread, which would be the one stuck."""
        if not self._current:
            return False
        ref, claimed = self._current[-1]
        if claimed or ref.host is not None:
            return False
        ref.frozen = True
        heapq.heappush(self._timers, (self._now + max(seconds, 0.0), next(self._timer_seq), _Thaw(ref), None))
        return True

    def expect_by(self, future: Reply[Any] | Future[Any], within_s: float, label: str) -> None:
        """Record in :attr:`late` if ``future`` is not done by ``within_s`` from now,
        where time had to advance to get it (see the module docstring)."""
        self._expected.append(_Expected(future, label, self._now, within_s))

    def defer(self, label: str, task: Callable[[], None]) -> None:
        """Run ``task`` at a later step chosen by the scheduler (work of another thread)."""
        self._tasks.append((label, task))

    def spawn_client(self, name: str, client: Client) -> None:
        """Run ``client`` step by step, interleaved with everything else."""
        self._clients.append((name, client, None))

    def ref(self, name: str) -> SimActorRef:
        """The ref of the actor spawned as ``name`` (colocated ones included)."""
        for ref in self._refs:
            for candidate in (ref, *ref.guests):
                if candidate.name == name:
                    return candidate
        raise KeyError(name)

    @property
    def pending_work(self) -> int:
        """Messages, tasks and runnable clients waiting (timers not counted)."""
        return sum(len(ref.inbox) for ref in self._refs) + len(self._tasks) + len(self._clients)

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until nothing is left to do (timers included); returns the steps taken."""
        start = self.steps
        while self.steps - start < max_steps and self.step():
            pass
        return self.steps - start

    # ------------------------------------------------------------ the scheduler

    def step(self, until: float | None = None) -> bool:
        """Do one thing; ``False`` if there was nothing to do.

        Timers fire only when time advances; with ``until``, time never
        advances past it.
        """
        options: list[Callable[[], None]] = []
        for ref in self._refs:
            if ref.inbox and not ref.frozen:
                options.append(functools.partial(self._deliver, ref))
        if self._tasks:
            options.append(self._run_task)
        for index, (_, _, waiting) in enumerate(self._clients):
            if waiting is None or waiting.done():
                options.append(functools.partial(self._resume, index))
        can_jump = bool(self._timers) and (until is None or self._timers[0][0] <= until)
        if can_jump and (not options or self.rng.random() < self.time_jump_chance):
            self._jump_time(forced=not options)
        elif options:
            options[self.rng.randrange(len(options))]()
        else:
            return False
        self.steps += 1
        return True

    def _deliver(self, ref: SimActorRef) -> None:
        self._deliver_now(ref, ref.inbox.popleft(), claimed=False)
        if ref.stopping and not ref.inbox and not ref.frozen:
            self._on_stop(ref)

    def _deliver_now(self, ref: SimActorRef, message: object, *, claimed: bool) -> None:
        if self.trace is not None:
            to, shown = (message.actor.name, message.message) if type(message) is Routed else (ref.name, message)
            self.trace.append(f"{self.steps} {to} <- {type(shown).__name__}{' (claimed)' if claimed else ''}")
        ref.running = True
        self._current.append((ref, claimed))
        try:
            if type(message) is Routed:
                message.actor.deliver(message.message)
            else:
                ref.actor.deliver(message)
        finally:
            ref.running = False
            self._current.pop()

    def _run_task(self) -> None:
        label, task = self._tasks.pop(self.rng.randrange(len(self._tasks)))
        if self.trace is not None:
            self.trace.append(f"{self.steps} task {label}")
        task()

    def _resume(self, index: int) -> None:
        name, client, _ = self._clients[index]
        if self.trace is not None:
            self.trace.append(f"{self.steps} client {name}")
        try:
            waiting = next(client)
        except StopIteration:
            del self._clients[index]
            return
        self._clients[index] = (name, client, waiting)

    def _jump_time(self, *, forced: bool) -> None:
        when = self._timers[0][0]
        if self._expected:
            self._check_expected(when, forced)
        self._now = max(self._now, when)
        if self.trace is not None:
            self.trace.append(f"{self.steps} time -> {self._now:.3f}")
        while self._timers and self._timers[0][0] <= self._now:
            _, _, ref, message = heapq.heappop(self._timers)
            with contextlib.suppress(ActorStoppedError):  # a timer outliving its actor
                ref.tell(message)
            if type(ref) is _Thaw and ref.ref.stopping and not ref.ref.inbox:
                self._on_stop(ref.ref)

    def _check_expected(self, when: float, forced: bool) -> None:
        kept = []
        for expected in self._expected:
            if expected.future.done():
                continue
            if not forced:
                expected.start = max(expected.start, when)  # a slow machine: the clock restarts
            elif when > expected.start + expected.within + 1e-9:
                self.late.append(f"{expected.label} not answered by its deadline ({expected.within:g} s): time "
                                 f"had to advance to {when - expected.start:g} s for it")
                continue
            kept.append(expected)
        self._expected = kept
