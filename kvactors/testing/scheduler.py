"""A seeded, single-threaded runtime: the same actors, a scheduler instead of threads.

:class:`SimRuntime` implements :class:`~kvactors.actors.runtime.Runtime`.
So a ``TieringManager`` (and everything behind it) runs on it unchanged.
Each actor has the same :class:`~kvactors.actors.mailbox.Mailbox` as on threads (the queue, the turn, the claims).
:meth:`SimRuntime.step` picks what happens next, from a seeded ``random.Random``.
It picks one of these moves.

* One step of one mailbox that its "thread" owns.
  The step delivers its next message or, with nothing pending, goes idle.
  These are two steps, as the thread's two moves.
  So a claim may find the actor's handler done but its thread still owning it.
* Stop a closed, idle mailbox (the stop a thread would handle after its last drain).
* Run one *deferred task*, registered with :meth:`defer`.
  That is work that would happen on another thread, such as a tier's I/O completing or a copy finishing.
* Resume a *client* until it waits again.
  A client is a frontend thread, registered with :meth:`spawn_client`.
  It is a greenlet, or a real thread, that runs only while the scheduler hands it the baton
  (see :mod:`kvactors.testing.clients`).
  The seed also decides whether a client's claim of an idle actor (:meth:`SimActorRef.claim`) is granted.
  The claimer pauses between the claim and the handler, as a thread may be preempted there.
  What is told meanwhile waits, and the claim hands it to the actor's thread after.
* Advance virtual time to the next timer, so deadlines race with completions.

A seed therefore fixes a whole interleaving, and the same seed replays it exactly.
Real threads explore interleavings by luck.
This explores them on purpose.
``docs/performance.md`` shows a planted race the seeds find and thread runs do not.

Blocking calls work from a client.
There :meth:`wait` pauses it until the reply is set or virtual time passes the bound.
They also work from outside any client, such as ``manager.lookup(...)`` in a test.
There :meth:`wait` keeps stepping until the reply is there.
When code the scheduler itself runs takes a claim, the claim runs within that step.
An example is an inline tier call made by the supervisor's handler.
On threads nothing else can reach that tier meanwhile, as the supervisor, its only sender, is the one running.
So no interleaving is lost.

An actor can be *stuck in a call* (:meth:`SimRuntime.hang_current`, from inside its handler).
It then handles nothing more, and cannot be claimed, until virtual time reaches its thaw,
as a thread blocked inside that call would.
:meth:`SimRuntime.expect_by` checks that a reply comes by its deadline.
The scheduler may have to advance time past that deadline (nothing else left to run)
while the reply is still missing.
Then that reply depends on something later than its deadline (a stuck actor's thaw, say),
and :attr:`SimRuntime.late` says so.
A jump of time the seed chose while work was pending (a slow machine) restarts every expected reply's clock.
So only waits the runtime could not avoid count.

Not thread-safe: one thread drives it (its clients run only while it waits for them).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from kvactors.actors.mailbox import IDLE, THREAD
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, ActorStoppedError
from kvactors.core.arguments import check_timeout
from kvactors.testing import clients
from kvactors.testing.simrefs import SimActorRef, SimMailbox

__all__ = ["SimActorRef", "SimMailbox", "SimRuntime", "SimulationStuck"]


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
    """A reply :meth:`SimRuntime.expect_by` watches for."""

    __slots__ = ("future", "label", "start", "within")

    def __init__(self, future: Reply[Any] | Future[Any], label: str, start: float, within: float) -> None:
        self.future = future
        self.label = label
        self.start = start
        self.within = within


class SimulationStuck(RuntimeError):
    """A wait can never end: nothing left to run and the future is not done."""


class SimRuntime:
    """The deterministic scheduler (see the module docstring).

    ``time_jump_chance`` is how often, when other work is possible, the scheduler jumps to the next timer instead.
    Higher makes deadlines fire "early", as a slow machine would.
    ``claim_chance`` is how often a claim of an idle actor is granted.
    ``trace`` keeps a readable log of every choice.
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
        self._stalled_s = 0.0  # virtual time skipped by slow-machine jumps
        self._boxes: list[SimMailbox] = []
        self._refs: list[SimActorRef] = []
        self._timers: list[tuple[float, int, ActorRef | _Thaw, object]] = []
        self._timer_seq = itertools.count()
        self._tasks: list[tuple[str, Callable[[], None]]] = []
        self._clients: list[clients.Client] = []
        self._carrier = clients.ClientThread  # as chosen when this runtime was made
        self._client_of: dict[object, clients.Client] = {}  # by self._carrier.current()
        self._current: list[tuple[SimMailbox, Actor, bool]] = []  # handlers running (claims nest)
        self._expected: list[_Expected] = []
        self.late: list[str] = []
        """Replies that came later than their deadline (see :meth:`expect_by`)."""

    # ------------------------------------------------------------ the Runtime interface

    def new_ref(self, name: str, *, colocate_with: ActorRef | None = None) -> SimActorRef:
        """See :meth:`~kvactors.actors.runtime.Runtime.new_ref`. The scheduler sees it from its start on."""
        if colocate_with is not None:
            assert isinstance(colocate_with, SimActorRef)
            return SimActorRef(self, name, colocate_with.mailbox, colocated=True)
        return SimActorRef(self, name, SimMailbox(self, name))

    def start(self, ref: ActorRef, actor: Actor) -> None:
        """See :meth:`~kvactors.actors.runtime.Runtime.start`, as on threads: a host's mailbox
        becomes one the scheduler steps."""
        assert isinstance(ref, SimActorRef)
        box = ref.mailbox
        if ref.colocated and not box.actors:
            raise ValueError(f"actor {ref.name} must start after the actor it is colocated with")
        ref.bind(actor)
        actor.bind(self, ref)
        box.admit(actor)
        if not ref.colocated:
            self._boxes.append(box)
        self._refs.append(ref)
        ref.deliver_early()

    def spawn(self, actor: Actor, name: str, *, colocate_with: ActorRef | None = None) -> SimActorRef:
        ref = self.new_ref(name, colocate_with=colocate_with)
        self.start(ref, actor)
        return ref

    def now(self) -> float:
        return self._now

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        heapq.heappush(self._timers, (self._now + max(delay_s, 0.0), next(self._timer_seq), ref, message))

    def wait(self, future: Reply[Any] | Future[Any], timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else self._now + timeout_s
        client = self._client_of.get(self._carrier.current()) if self._client_of else None
        if client is not None:
            if client.expect is not None:
                self.expect_by(future, *client.expect)
            return client.wait(future, deadline, timeout_s or 0.0)
        stalled_at = self._stalled_s
        credit = timeout_s  # stalls credited to this wait, at most its own bound: it still ends
        while not future.done():
            if deadline is not None and credit:
                # As a client's: a slow-machine jump restarts this bounded wait's clock.
                stall = min(self._stalled_s - stalled_at, credit)
                deadline += stall
                credit -= stall
                stalled_at = self._stalled_s
            if deadline is not None and self._now >= deadline:
                return False
            if not self.step(until=deadline):
                if deadline is None:
                    # On threads this wait would hang forever: make the deadlock visible.
                    raise SimulationStuck(f"seed {self.seed}: nothing left to run after {self.steps} steps")
                return False
        return True

    def stop(self, refs: list[ActorRef], timeout_s: float | None) -> list[str]:
        # As on threads: closed at once (later tells raise), what is queued is still
        # handled, then each stops; colocated actors stop with their host. One stuck in
        # a call past the timeout is left behind, and stops once it has thawed and drained.
        boxes: list[SimMailbox] = []
        for ref in refs:
            if isinstance(ref, SimActorRef) and ref.mailbox not in boxes:
                boxes.append(ref.mailbox)
                ref.mailbox.close(_nothing)
                if not ref.mailbox.actors:
                    ref.mailbox.stopped = True  # never started (a ref from new_ref alone): nothing runs there
        deadline = None if timeout_s is None else self._now + timeout_s
        while any(not box.stopped for box in boxes) and self.step(until=deadline):
            pass
        return [box.name for box in boxes if not box.stopped]

    # ------------------------------------------------------------ simulation-only hooks

    def hang_current(self, seconds: float) -> bool:
        """The actor whose handler is running is stuck in it for ``seconds`` of
        virtual time (from the moment the handler returns). Ignored (False) in a
        claimed call (that runs on the claimer's thread, which would be the one
        stuck) and in a colocated guest."""
        if not self._current:
            return False
        box, actor, claimed = self._current[-1]
        if claimed or actor is not box.actors[0]:
            return False
        box.frozen = True
        heapq.heappush(self._timers, (self._now + max(seconds, 0.0), next(self._timer_seq), _Thaw(box), None))
        return True

    def expect_by(self, future: Reply[Any] | Future[Any], within_s: float, label: str) -> None:
        """Record in :attr:`late` if ``future`` is not done by ``within_s`` from now,
        where time had to advance to get it (see the module docstring)."""
        self._expected.append(_Expected(future, label, self._now, within_s))

    @contextlib.contextmanager
    def expecting(self, within_s: float, label: str) -> Iterator[None]:
        """On a client thread: every wait inside is expected by ``within_s`` (:meth:`expect_by`)."""
        client = self._client_of[self._carrier.current()]
        client.expect = (within_s, label)
        try:
            yield
        finally:
            client.expect = None

    def defer(self, label: str, task: Callable[[], None]) -> None:
        """Run ``task`` at a later step chosen by the scheduler (work of another thread)."""
        self._tasks.append((label, task))

    def spawn_client(self, name: str, client: Callable[[], object]) -> None:
        """Run ``client()`` as a client of its own, interleaved with everything else
        (:mod:`kvactors.testing.clients`). From a client, the new one first runs once
        this one waits or pauses."""
        self._clients.append(self._carrier(name, client))

    def preempt_claimer(self) -> None:
        """Run between a claim and its handler.

        On a client thread, as the seed says, it lets the scheduler run others first
        (the claimer's thread preempted there).
        Elsewhere it does nothing.
        """
        if self._client_of and self.rng.random() < CHECKPOINT_CHANCE:
            self.checkpoint()

    def checkpoint(self) -> None:
        """On a client thread, let the scheduler run others before this one goes on (a thread being preempted).

        Elsewhere do nothing.
        """
        client = self._client_of.get(self._carrier.current()) if self._client_of else None
        if client is not None:
            client.pause()

    def close(self) -> None:
        """End the client threads still parked (a run given up).

        They raise nothing here.
        """
        for client in list(self._clients):
            self._resume_client(client, cancel=True)

    def ref(self, name: str) -> SimActorRef:
        """The ref of the actor started as ``name`` (colocated ones included)."""
        for ref in self._refs:
            if ref.name == name:
                return ref
        raise KeyError(name)

    @property
    def pending_work(self) -> int:
        """Messages, tasks and unfinished clients waiting (timers not counted)."""
        return sum(len(box.pending) for box in self._boxes) + len(self._tasks) + len(self._clients)

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until nothing is left to do (timers included).

        Returns the steps taken.
        Raises ``SimulationStuck`` if a client still waits then, as on threads it would wait for ever.
        """
        start = self.steps
        while self.steps - start < max_steps:
            if not self.step():
                if self._clients:
                    names = ", ".join(client.name for client in self._clients)
                    raise SimulationStuck(f"seed {self.seed}: clients {names} wait for ever "
                                          f"(nothing left to run after {self.steps} steps)")
                break
        return self.steps - start

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass.

        Run everything due until then, timers included, and leave the clock there.
        That is a test of deadlines, where time passes while nothing else happens.
        Raises ``ValueError`` unless ``seconds`` is a finite number >= 0.
        """
        check_timeout(seconds, "seconds", allow_none=False)
        until = self._now + seconds
        while True:
            while self.step(until=until):
                pass
            if self._now >= until:
                return
            self._jump_time(until, forced=True)

    # ------------------------------------------------------------ the scheduler

    def step(self, until: float | None = None) -> bool:
        """Do one thing.

        Returns ``False`` if there was nothing to do.
        Timers fire only when time advances.
        With ``until``, time never advances past it.
        A client's wait with a bound ends when time reaches it.
        Time does so only once nothing else can run, and then it is the next thing that happens, as on threads.
        It never does so by a jump chosen at random, as such a jump moves the bound with it.
        """
        options: list[object] = []  # a mailbox (its thread's step), a client, _TASKS or a _Stop
        for box in self._boxes:
            if box.frozen:
                continue
            if box.owner == THREAD:
                options.append(box)
            elif box.closed and not box.stopped and box.owner == IDLE:
                options.append(_Stop(box))
        if self._tasks:
            options.append(_TASKS)
        now = self._now
        wake = None
        for client in self._clients:
            waiting, deadline = client.waiting, client.deadline
            if client.running or client.finished:
                continue
            if waiting is None or waiting.done() or (deadline is not None and now >= deadline):
                options.append(client)  # runnable (as client.runnable says, inlined: the hot loop)
            elif deadline is not None and (wake is None or deadline < wake):
                wake = deadline
        head = self._timers[0][0] if self._timers else None
        can_jump = head is not None and (until is None or head <= until) and (wake is None or head <= wake)
        if can_jump and (not options or self.rng.random() < self.time_jump_chance):
            self._jump_time(head, forced=not options)  # type: ignore[arg-type]
        elif options:
            option = options[self.rng.randrange(len(options))]
            if type(option) is SimMailbox:
                self._deliver(option)
            else:
                self._take(option)
        elif wake is not None and (until is None or wake <= until):
            self._jump_time(wake, forced=True)  # a client's bounded wait runs out
        else:
            return False
        self.steps += 1
        return True

    def _take(self, option: object) -> None:
        if option is _TASKS:
            self._run_task()
        elif type(option) is _Stop:
            self._stop_box(option.box)
        else:
            self._resume_client(option)  # type: ignore[arg-type]

    def _deliver(self, box: SimMailbox) -> None:
        item = box.take_one()
        if item is None:
            return  # went idle
        self.run_handler(box, item[0], item[1], claimed=False)
        if not box.pending and self.rng.random() >= SEPARATE_IDLE_CHANCE:
            box.take_one()  # goes idle within this step (else in a step of its own, later)

    def run_handler(self, box: SimMailbox, actor: Actor, message: object, *, claimed: bool) -> None:
        """Run ``actor``'s handler of ``message`` within this step: a mailbox's thread
        delivering it, or (``claimed``) a claimer running it on its own thread."""
        if self.trace is not None:
            self.trace.append(f"{self.steps} {_name_of(actor)} <- {type(message).__name__}"
                              f"{' (claimed)' if claimed else ''}")
        self._current.append((box, actor, claimed))
        try:
            actor.deliver(message)
        finally:
            self._current.pop()

    def _stop_box(self, box: SimMailbox) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.steps} {box.name} stops")
        box.stopped = True
        with box.turn:
            for actor in box.actors:
                actor.on_stop()

    def _run_task(self) -> None:
        label, task = self._tasks.pop(self.rng.randrange(len(self._tasks)))
        if self.trace is not None:
            self.trace.append(f"{self.steps} task {label}")
        task()

    def _resume_client(self, client: clients.Client, *, cancel: bool = False) -> None:
        if self.trace is not None and not cancel:
            self.trace.append(f"{self.steps} client {client.name}")
        if not client.started and not cancel:
            client.key = client.start()
            self._client_of[client.key] = client
        if cancel:
            client.cancel()
        else:
            client.resume()
        if client.finished:
            self._client_of.pop(client.key, None)
            self._clients.remove(client)
            if client.error is not None and not cancel:
                raise client.error

    def _jump_time(self, when: float, *, forced: bool) -> None:
        if self._expected:
            self._check_expected(when, forced)
        if not forced and when > self._now:
            # A slow machine (a jump the seed chose while work was pending): the bounded
            # waits (the clients' and :meth:`wait`'s own) restart their clocks, as expected
            # replies do; only waits the runtime could not avoid count toward a bound.
            self._stalled_s += when - self._now
            for client in self._clients:
                if client.deadline is not None and client.credit > 0.0:
                    # At most the wait's own bound in all: a wait still ends if stalls never stop.
                    stall = min(when - self._now, client.credit)
                    client.deadline += stall
                    client.credit -= stall
        self._now = max(self._now, when)
        if self.trace is not None:
            self.trace.append(f"{self.steps} time -> {self._now:.3f}")
        while self._timers and self._timers[0][0] <= self._now:
            _, _, ref, message = heapq.heappop(self._timers)
            with contextlib.suppress(ActorStoppedError):  # a timer outliving its actor
                ref.tell(message)

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


def _nothing() -> None:
    return None


def _name_of(actor: Actor) -> str:
    ref = getattr(actor, "ref", None)
    return ref.name if ref is not None else actor.name
