"""A random workload of frontend clients, for the simulation and for real threads.

A client stands for one frontend thread.
It drives a :class:`~kvactors.TieringManager` through its public methods only, blocking ones included.
So the manager's registry of live requests and its argument checks are on the path.
The same client therefore runs in two places.

* On a :class:`~kvactors.testing.SimRuntime` (``runtime.spawn_client(name, client.run)``),
  it is a thread that runs only while the scheduler lets it.
  The manager's waits go through the runtime, which hands the baton back until the reply is there.
  The seed decides when the client goes on.
* On a real thread (:func:`drive`), a client that makes no progress for a bound is a *hang*.
  That is a call that does not return.

Copies between the "device" and the pool are work of other threads.
A :class:`~kvactors.testing.tiers.Deferrer` runs them later.
A store's copy writes ``pattern(key)`` into its rows and completes the store.
It may instead fail it, complete it after its deadline, or never complete it.
A load's copy checks that the pinned rows still hold ``pattern(key)``, and then unpins.

Everything the workload sees that breaks the contract is appended to :attr:`Env.violations`.
Deliberate misuse, which the runtime must reject and count, is counted in :attr:`Env.expected_misuse`.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvactors.actors.reply import Reply
from kvactors.core.errors import LifecycleError, ManagerStoppedError
from kvactors.testing.tiers import Deferrer, pattern, rows_hold
from kvactors.types import LookupResult, OffloadKey, PrepareStoreOutput, ReqContext


@dataclass(frozen=True)
class WorkloadConfig:
    """The shape of a workload. :meth:`draw` picks one per seed."""

    clients: int = 4
    requests: int = 4  # per client
    ops: int = 8  # at most, per request attempt
    keys: int = 24  # size of the shared key space
    keys_per_op: int = 3
    p_preempt: float = 0.08
    p_reset: float = 0.02
    p_misuse: float = 0.05
    p_finish_concurrent: float = 0.1  # finish while a lookup or the last stores are in flight
    # After a load, with its copy still running (slow), load the same keys again, after storing them
    # anew and, half the time, a reset: a key's old and new rows pinned by one request.
    p_reload: float = 0.25
    # store copy outcomes: weights of success, failure, completed after the deadline, never completed
    store_outcomes: tuple[float, float, float, float] = (0.8, 0.1, 0.05, 0.05)
    transfer_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        # A bad shape would crash the clients mid-run (randrange(0), negative weights), which
        # reads as the runtime's failure: refuse it here, before anything runs.
        for name in ("clients", "requests", "ops", "keys", "keys_per_op"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WorkloadConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("p_preempt", "p_reset", "p_misuse", "p_finish_concurrent"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"WorkloadConfig.{name} must be a probability in [0, 1], got {value!r}")
        weights = self.store_outcomes
        if len(weights) != 4 or not all(w >= 0 for w in weights) or not sum(weights) > 0:
            raise ValueError(f"WorkloadConfig.store_outcomes must be 4 weights >= 0 with a sum > 0, got {weights!r}")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"WorkloadConfig.transfer_timeout_s must be > 0, got {self.transfer_timeout_s!r}")

    def draw(self, rng: random.Random) -> WorkloadConfig:
        """A variation of this config (sizes and rates), drawn from ``rng``."""
        return WorkloadConfig(
            clients=rng.randint(1, self.clients),
            requests=rng.randint(1, self.requests),
            ops=rng.randint(1, self.ops),
            keys=rng.randint(max(4, self.keys // 3), self.keys),
            keys_per_op=rng.randint(1, self.keys_per_op),
            p_preempt=self.p_preempt * rng.random() * 2,
            p_reset=self.p_reset * rng.random() * 2,
            p_misuse=self.p_misuse,
            p_finish_concurrent=self.p_finish_concurrent * rng.random() * 2,
            p_reload=self.p_reload,  # no draw: every earlier seed keeps its scenario up to its first reload
            store_outcomes=self.store_outcomes,
            transfer_timeout_s=self.transfer_timeout_s,
        )


@dataclass
class Env:
    """What every client of one run shares."""

    manager: Any
    deferrer: Deferrer
    config: WorkloadConfig
    seed: int
    should_stop: Callable[[], bool] = lambda: False
    spawn: Callable[[str, Callable[[], object]], None] = field(default=lambda name, fn: _start_thread(name, fn))
    """Run ``fn`` on another frontend thread (a finish while a lookup is in flight)."""
    spawn_ordered: bool = False
    """Whether what :attr:`spawn` starts runs only once its spawner waits (the scheduler's clients)."""
    wait: Callable[[Reply[Any], float | None], bool] = lambda reply, timeout: reply.wait(timeout)
    """Wait for a reply of the workload's own (the scheduler's ``wait`` on a :class:`SimRuntime`)."""
    pause: Callable[[], None] = lambda: None
    """A scheduling point: let the other clients run (the scheduler's ``checkpoint``)."""
    violations: list[str] = field(default_factory=list)
    expected_misuse: int = 0
    operations: int = 0
    requests: int = 0
    finished: set[tuple[str, int]] = field(default_factory=set)
    never_completed: set[tuple[tuple[str, int], OffloadKey]] = field(default_factory=set)
    outstanding_copies: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)

    def count(self, ops: int = 1, *, requests: int = 0, misuse: int = 0) -> None:
        with self.lock:
            self.operations += ops
            self.requests += requests
            self.expected_misuse += misuse

    def copies(self, delta: int) -> None:
        with self.lock:
            self.outstanding_copies += delta


def _start_thread(name: str, fn: Callable[[], object]) -> None:
    threading.Thread(target=fn, name=f"workload-{name}", daemon=True).start()


def key_of(n: int) -> OffloadKey:
    return b"k%05d" % n


class WorkloadClient:
    """One frontend thread's behaviour. :meth:`run` is its loop.

    It is thread-safe as far as :func:`drive` needs.
    The driving thread reads ``beats``, the calls made so far, under ``beat``.
    """

    def __init__(self, env: Env, index: int) -> None:
        self.env = env
        self.index = index
        self.cfg = env.config
        self.rng = random.Random(f"{env.seed}/client/{index}")
        self.manager = env.manager
        self.pool = env.manager.pool
        self.block_bytes = int(self.pool.shape[1])
        self.beat = threading.Condition()
        self.beats = 0
        self.watched = False  # by drive(), which waits for the beats
        self.finished = False

    # ------------------------------------------------------------ plumbing

    def calling(self) -> None:
        """Count one call of the manager, about to be made (progress, for :func:`drive`)."""
        self.env.count()
        if self.watched:
            with self.beat:
                self.beats += 1
                self.beat.notify_all()

    def late_call(self, method: Callable[..., None], *args: Any) -> None:
        """A completion from a copy thread.

        After ``stop()`` it has nowhere to go.
        """
        with contextlib.suppress(ManagerStoppedError):
            method(*args)
        self.env.count()

    def finish_from_elsewhere(self, ctx: ReqContext, done: Reply[None]) -> None:
        try:
            self.late_call(self.manager.on_request_finished, ctx)
        finally:
            done.set_result(None)

    def unexpected(self, call: str, ctx: ReqContext, exc: BaseException) -> None:
        self.env.violation(f"client {self.index}: {call} for {ctx} raised {exc!r}")

    def some_keys(self) -> tuple[OffloadKey, ...]:
        count = self.rng.randint(1, self.cfg.keys_per_op)
        return tuple(key_of(self.rng.randrange(self.cfg.keys)) for _ in range(count))

    # ------------------------------------------------------------ operations

    def lookup(self, ctx: ReqContext, *, then_finish: bool, keys: tuple[OffloadKey, ...] | None = None) -> None:
        again = keys is not None  # a reload: never reload again from it
        keys = self.some_keys() if keys is None else keys
        finishing: Reply[None] = Reply()
        if then_finish:
            # Finish while the lookup (and its promotions) is in flight: from another thread.
            self.env.spawn(f"finish {ctx}", functools.partial(self.finish_from_elsewhere, ctx, finishing))
        self.calling()
        try:
            results = self.manager.lookup(keys, ctx)
        except LifecycleError as exc:
            if then_finish and not self.env.spawn_ordered:
                return  # on threads the finish may overtake the lookup: a legal race
            self.unexpected("lookup", ctx, exc)
            return
        except Exception as exc:
            self.unexpected("lookup", ctx, exc)
            return
        finally:
            if then_finish and not self.env.wait(finishing, self.cfg.transfer_timeout_s * 10):
                self.env.violation(f"client {self.index}: on_request_finished of {ctx} did not return")
        hits = tuple(key for key, result in zip(keys, results, strict=True) if result is LookupResult.HIT)
        if not hits or then_finish or self.rng.random() < 0.3:
            return
        self.calling()
        try:
            rows = self.manager.prepare_load(hits, ctx).block_ids
        except LifecycleError:
            return  # evicted or reset since the lookup: a legal race
        except Exception as exc:
            self.unexpected("prepare_load", ctx, exc)
            return
        reload = not again and self.rng.random() < self.cfg.p_reload
        self.env.copies(+1)

        def copy_out() -> None:
            bad = rows_hold(self.pool, hits, rows)
            if bad:
                self.env.violation(f"client {self.index}: {ctx} loaded rows {[rows[i] for i in bad]} "
                                   "that do not hold their blocks (overwritten while pinned?)")
            self.late_call(self.manager.complete_load, hits, ctx)
            self.env.copies(-1)

        self.env.deferrer.defer(f"load {ctx}", copy_out, self.cfg.transfer_timeout_s * 0.5 if reload else 0.0)
        if reload:
            self.reload(ctx, hits)

    def store(self, ctx: ReqContext, keys: tuple[OffloadKey, ...] | None = None, *, at_once: bool = False) -> None:
        """Store ``keys``, random ones by default.

        With ``at_once``, the copy succeeds on this thread.
        """
        keys = self.some_keys() if keys is None else keys
        self.calling()
        try:
            out: PrepareStoreOutput | None = self.manager.prepare_store(keys, ctx)
        except Exception as exc:
            self.unexpected("prepare_store", ctx, exc)
            return
        if out is not None and set(out.evicted_keys) & set(keys):
            # vLLM PR #35846: the call reports its other keys present, so it must not drop them.
            self.env.violation(f"client {self.index}: prepare_store for {ctx} evicted its own keys "
                               f"{sorted(set(out.evicted_keys) & set(keys))}")
        if out is None or not out.keys_to_store:
            return
        stored = tuple(out.keys_to_store)
        rows = out.store_spec.block_ids
        outcome = "success" if at_once else \
            self.rng.choices(("success", "failure", "late", "never"), self.cfg.store_outcomes)[0]
        if outcome == "never":
            with self.env.lock:
                self.env.never_completed.update((ctx.identity, key) for key in stored)
            return
        self.env.copies(+1)

        def copy_in() -> None:
            for key, row in zip(stored, rows, strict=True):
                if outcome == "failure":
                    self.pool[row].fill_(0xEE)  # a torn copy: must never be served
                else:
                    self.pool[row].copy_(pattern(key, self.block_bytes))
            self.late_call(self.manager.complete_store, stored, ctx, outcome != "failure")
            self.env.copies(-1)

        if at_once:
            copy_in()
            return
        delay = self.cfg.transfer_timeout_s * 1.5 if outcome == "late" else 0.0
        self.env.deferrer.defer(f"store {ctx}", copy_in, delay)

    def reset(self, ctx: ReqContext) -> None:
        self.calling()
        try:
            self.manager.reset_cache()
        except Exception as exc:
            self.unexpected("reset_cache", ctx, exc)

    def reload(self, ctx: ReqContext, keys: tuple[OffloadKey, ...]) -> None:
        """Load ``keys`` again while their first load's copy runs.

        It may reset the cache first.
        It then stores them and loads them.
        """
        if self.rng.random() < 0.5:
            self.reset(ctx)
        self.store(ctx, keys, at_once=True)  # ready again before the lookup: the load can pin it
        self.lookup(ctx, then_finish=False, keys=keys)

    def misuse(self, ctx: ReqContext, finished: bool) -> None:
        kind = self.rng.randrange(3)
        if kind == 0 and finished:
            self.calling()
            try:
                got: object = self.manager.prepare_store(self.some_keys(), ctx)
            except LifecycleError:
                return
            except Exception as exc:
                got = exc
            self.env.violation(f"client {self.index}: prepare_store after finish of {ctx} was not rejected "
                               f"(got {got!r})")
        elif kind == 1:
            self.calling()
            self.manager.complete_store((b"never-prepared-%d" % self.index,), ctx, True)
            self.env.count(0, misuse=1)
        else:
            self.calling()
            self.manager.complete_load((b"never-pinned-%d" % self.index,), ctx)
            self.env.count(0, misuse=1)

    # ------------------------------------------------------------ one request

    def start(self, ctx: ReqContext) -> bool:
        self.calling()
        try:
            self.manager.on_new_request(ctx)
        except Exception as exc:
            self.unexpected("on_new_request", ctx, exc)
            return False
        return True

    def request(self, number: int) -> None:
        ctx = ReqContext(f"c{self.index}r{number}", 0)
        if not self.start(ctx):
            return
        self.env.count(0, requests=1)
        finished = False
        for _ in range(self.rng.randint(1, self.cfg.ops)):
            x = self.rng.random()
            if finished:
                self.misuse(ctx, finished)
                break
            if x < self.cfg.p_preempt:
                # Preemption: the old attempt ends (its copies may still complete late), a new one starts.
                self.finish(ctx)
                ctx = ReqContext(ctx.req_id, ctx.attempt + 1)
                if not self.start(ctx):
                    return
            elif x < self.cfg.p_preempt + self.cfg.p_reset:
                self.reset(ctx)
            elif x < self.cfg.p_preempt + self.cfg.p_reset + self.cfg.p_misuse:
                self.misuse(ctx, finished)
            elif x < 0.45:
                concurrent = self.rng.random() < self.cfg.p_finish_concurrent
                self.lookup(ctx, then_finish=concurrent)
                if concurrent:
                    with self.env.lock:
                        self.env.finished.add(ctx.identity)
                    finished = True
            elif x < 0.9:
                self.store(ctx)
            else:
                self.calling()
                self.manager.touch(self.some_keys(), ctx)
        self.finish(ctx)

    def finish(self, ctx: ReqContext) -> None:
        self.calling()
        self.manager.on_request_finished(ctx)
        with self.env.lock:
            self.env.finished.add(ctx.identity)

    def run(self) -> None:
        for number in range(self.cfg.requests):
            if self.env.should_stop():
                return
            self.request(number)
            self.env.pause()  # let others run between requests


def make_clients(env: Env) -> list[WorkloadClient]:
    """One client per ``env.config.clients``.

    Run each with :func:`drive` or ``spawn_client(name, c.run)``.
    """
    return [WorkloadClient(env, index) for index in range(env.config.clients)]


class Hang(Exception):
    """A client made no call within the bound. The call it is in hangs."""


def drive(client: WorkloadClient, bound_s: float) -> None:
    """Run ``client`` on a thread of its own, watched from the calling one.

    Raises ``Hang`` if the client makes no call for ``bound_s``, because it is stuck in one.
    The thread is then left behind, as a daemon.
    An exception of the client is raised here, with its traceback kept.
    """
    errors: list[BaseException] = []
    client.watched = True

    def target() -> None:
        try:
            client.run()
        except BaseException as exc:
            errors.append(exc)
        finally:
            with client.beat:
                client.finished = True
                client.beat.notify_all()

    threading.Thread(target=target, name=f"{threading.current_thread().name}-calls", daemon=True).start()
    with client.beat:
        while not client.finished:
            seen = client.beats

            def moved(seen: int = seen) -> bool:
                return client.finished or client.beats != seen

            if not client.beat.wait_for(moved, bound_s):
                raise Hang(f"a call did not return within {bound_s:.1f} s")
    if errors:
        raise errors[0]
