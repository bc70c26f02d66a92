"""vLLM's requests as kvactors attempts: each ``req_id``'s current :class:`ReqContext`, its answers and pins.

Plain code over a :class:`~kvactors.TieringManager`, with no vLLM import.
A preempted or re-announced request finishes its attempt and starts the next one.
Each store or load remembers the attempt that prepared it.
So a completion that arrives late, even after the finish, completes the right one.

A :class:`Request` changes only through its own methods, which keep its invariants.
:class:`Requests` holds the live ones and makes the TieringManager calls their changes need.

Threading: none of its own.
Every method is called with the adapter's lock held
(:class:`~kvactors.integrations.vllm.manager.KvactorsOffloadingManager`).
The exception is the body of :meth:`Requests.unlocked`, which releases that lock for one call to the TieringManager.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvactors.core.errors import LifecycleError
from kvactors.manager import TieringManager
from kvactors.types import LookupResult, OffloadKey, ReqContext

MAX_ATTEMPT_BUMPS = 64
"""How many identities a new attempt may skip that are still finishing inside kvactors."""

Pins = dict[OffloadKey, int]
"""Pinned pool rows by key: loads prepared inside kvactors that vLLM has not taken yet."""

OwedStore = tuple[ReqContext, int]
"""A store vLLM has yet to complete: the attempt that prepared it and its pool row."""


@dataclass
class LookupJob:
    """One batch lookup on the helper thread.

    It holds the keys asked, then its answers and the rows it pinned.
    """

    keys: tuple[OffloadKey, ...]
    ctx: ReqContext
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    pinned: Pins = field(default_factory=dict)
    stale: bool = False


@dataclass
class OwedCompletions:
    """The stores and loads vLLM has yet to complete, by key, with the attempt that prepared each.

    One object is shared by all attempts of a ``req_id``, so a late completion finds its entry
    whichever attempt is current.
    A key may be owed by two attempts at once, oldest first.
    That happens when an attempt's store passed kvactors' deadline and the next attempt stored the key again.
    """

    stores: dict[OffloadKey, list[OwedStore]] = field(default_factory=dict)
    loads: dict[OffloadKey, list[ReqContext]] = field(default_factory=dict)


class Request:
    """One vLLM request: its current attempt and what that attempt (or an earlier one) still owes.

    Its invariants, kept by its methods:

    * A finished request has no lookup job; a job detached from it is marked stale.
    * ``pinned`` holds pins of this attempt not yet handed to vLLM. ``pinned_since`` is when
      the oldest of them was taken.
    * Answers are unread when they arrive. They age by one step end at most before they are
      dropped, unless the request still holds pins.
    * The wait for keys that are not final starts with the first such answer and ends with
      the next final one (``HIT``, ``MISS``) or a load.
    * It is not forgotten while a call for it runs outside the adapter's lock
      (:meth:`Requests.kept`).

    Threading: none. Called with the adapter's lock held.
    """

    __slots__ = ("_age", "_answers", "_calls", "_finished", "_job", "_owed", "_pinned", "_pinned_since",
                 "_promoted", "_read", "_unsure_since", "_unsure_step", "ctx", "req_id")

    def __init__(self, req_id: str, ctx: ReqContext, owed: OwedCompletions | None = None) -> None:
        self.req_id = req_id
        self.ctx = ctx
        self._owed = owed if owed is not None else OwedCompletions()
        self._finished = False
        self._job: LookupJob | None = None
        self._answers: dict[OffloadKey, LookupResult] = {}
        self._pinned: Pins = {}
        self._pinned_since = 0.0
        self._read = False  # the answers were read this step
        self._age = 0  # step ends since the answers arrived unread
        self._promoted: set[OffloadKey] = set()  # keys that were HIT_PENDING for it
        self._unsure_since: float | None = None  # first not-final answer since the last final one
        self._unsure_step = 0  # the scheduler step of _unsure_since
        self._calls = 0  # calls for it in the TieringManager outside the adapter's lock

    def successor(self, ctx: ReqContext) -> Request:
        """The next attempt, ``ctx``; the completions still owed stay with it."""
        return Request(self.req_id, ctx, self._owed)

    # ------------------------------------------------------------ what it is

    @property
    def finished(self) -> bool:
        """Whether vLLM will submit nothing more for this attempt."""
        return self._finished

    @property
    def job(self) -> LookupJob | None:
        """The lookup in flight for it, if any."""
        return self._job

    @property
    def answers(self) -> Mapping[OffloadKey, LookupResult]:
        """The answers of its last lookups, by key, until they are dropped."""
        return self._answers

    @property
    def pinned(self) -> Mapping[OffloadKey, int]:
        """Its pinned rows not yet handed to vLLM, by key."""
        return self._pinned

    @property
    def pinned_since(self) -> float:
        """When the oldest of its pins was taken (``time.monotonic``)."""
        return self._pinned_since

    @property
    def stores(self) -> Mapping[OffloadKey, list[OwedStore]]:
        """The stores it owes a completion for: key -> (attempt, row) of each, oldest first."""
        return self._owed.stores

    @property
    def loads(self) -> Mapping[OffloadKey, list[ReqContext]]:
        """The loads it owes a completion for: key -> the attempts, oldest first."""
        return self._owed.loads

    def done(self) -> bool:
        """Whether it may be forgotten: finished, owing nothing, and no call for it outside the lock."""
        return self._finished and not self._owed.stores and not self._owed.loads and not self._calls

    def was_promoted(self, key: OffloadKey) -> bool:
        """Whether ``key`` was answered ``HIT_PENDING`` for it (promoted from a secondary tier)."""
        return key in self._promoted

    # ------------------------------------------------------------ lifecycle

    def finish(self) -> bool:
        """Mark the attempt finished and detach its lookup; whether it was not finished before.

        The caller drops its answers and pins (:meth:`Requests.finish_attempt`)."""
        if self._finished:
            return False
        self._finished = True
        self.detach_job()
        return True

    def forget_lookups(self) -> None:
        """A reset: its lookup in flight is detached and its promotions forgotten."""
        self.detach_job()
        self._promoted.clear()

    # ------------------------------------------------------------ lookups and answers

    def begin_lookup(self, job: LookupJob) -> None:
        """``job`` is its lookup in flight now."""
        self._job = job

    def detach_job(self) -> None:
        """Its lookup in flight, if any, no longer posts to it (its pins go back)."""
        if self._job is not None:
            self._job.stale = True
            self._job = None

    def accept(self, job: LookupJob, now: float) -> tuple[list[OffloadKey], int] | None:
        """Take ``job``'s answers and pins; None if ``job`` is not its lookup in flight (stale or replaced).

        Returns the keys whose pins to release (a key pinned already keeps its first pin) and the
        number of ``HIT_PENDING`` answers. The answers are unread, even if vLLM asked (and got
        ``RETRY``) earlier this step. Otherwise this step's end would drop them and the request
        would ask again forever."""
        if job.stale or self._job is not job:
            return None
        self._job = None
        pending = 0
        for k, r in job.answers.items():
            if r is LookupResult.HIT_PENDING:
                self._promoted.add(k)
                pending += 1
        self._answers.update(job.answers)
        release = [k for k in job.pinned if k in self._pinned]
        if job.pinned and not self._pinned:
            self._pinned_since = now
        self._pinned.update((k, row) for k, row in job.pinned.items() if k not in self._pinned)
        self._read = False
        self._age = 0
        return release, pending

    def mark_read(self) -> None:
        """vLLM asked for one of its answers this step."""
        self._read = True

    def answer(self, key: OffloadKey) -> LookupResult | None:
        """The answer kept for ``key``, if any."""
        return self._answers.get(key)

    def drop_answers(self) -> Pins:
        """Forget its answers; its pins are taken from it, for the caller to release."""
        pins, self._pinned = self._pinned, {}
        self._answers = {}
        self._read = False
        self._age = 0
        return pins

    def end_step(self, now: float, hold_s: float) -> bool:
        """A step ended; whether its answers and pins are to be dropped now (:meth:`drop_answers`).

        Answers read this step, or kept unread for one step already, are dropped. Its pins are
        kept for ``hold_s`` at most. A request that vLLM could not schedule this step (no device
        blocks yet) still finds its blocks in the pool on the next one, instead of losing them to
        other requests' stores and promoting them again. Answers that arrived after this step's
        lookups are kept for the next step."""
        if self._pinned and now - self._pinned_since > hold_s:
            return True
        if self._read or self._age >= 1:
            if not self._pinned:
                return True
            self._answers = {}
            self._age = 0
        else:
            self._age += 1
        self._read = False
        return False

    # ------------------------------------------------------------ the wait for keys not final

    def unsure_for(self, now: float, step: int) -> tuple[float, int] | None:
        """A key's answer is not final: the seconds and steps waited so far, or None if the wait starts now."""
        if self._unsure_since is None:
            self._unsure_since, self._unsure_step = now, step
            return None
        return now - self._unsure_since, step - self._unsure_step

    def sure(self) -> None:
        """A final answer (or a load) ends the wait :meth:`unsure_for` measures."""
        self._unsure_since = None

    # ------------------------------------------------------------ pins, loads and stores

    def take_pins(self, keys: Iterable[OffloadKey]) -> Pins:
        """The pins it holds of ``keys``, taken from it (so that a step's end does not release them)."""
        return {k: self._pinned.pop(k) for k in keys if k in self._pinned}

    def give_back_pins(self, pins: Mapping[OffloadKey, int]) -> list[OffloadKey]:
        """Keep ``pins`` again; the keys whose pins to release instead (pinned again meanwhile)."""
        release = [k for k in pins if k in self._pinned]
        self._pinned.update((k, row) for k, row in pins.items() if k not in self._pinned)
        return release

    def loading(self, keys: Iterable[OffloadKey]) -> None:
        """vLLM loads ``keys`` for this attempt: each owes a completion, and the wait for keys ends."""
        for k in keys:
            self._owed.loads.setdefault(k, []).append(self.ctx)
            self._answers.pop(k, None)
        self.sure()

    def storing(self, ctx: ReqContext, rows: Mapping[OffloadKey, int]) -> None:
        """vLLM stores ``rows`` (key -> pool row) for attempt ``ctx``: each owes a completion.

        A store still owed for a key by an earlier attempt stays owed: each is completed by its own report."""
        for k, row in rows.items():
            self._owed.stores.setdefault(k, []).append((ctx, row))

    def take_store(self, key: OffloadKey, copy_ended: Callable[[int], bool] | None = None) -> OwedStore | None:
        """The attempt and row of the store of ``key`` that vLLM completes now; None if none is owed.

        vLLM's report names only the key.
        When two attempts owe a store of it, the report is for the one whose row's copy ended
        (``copy_ended(row)``, from the worker's status in shared memory), else for the oldest.
        """
        owed = self._owed.stores.get(key)
        if not owed:
            return None
        i = 0
        if len(owed) > 1 and copy_ended is not None:
            i = next((j for j, (_, row) in enumerate(owed) if copy_ended(row)), 0)
        store = owed.pop(i)
        if not owed:
            del self._owed.stores[key]
        return store

    def take_load(self, key: OffloadKey) -> ReqContext | None:
        """The attempt of ``key``'s oldest load, which is completed now; None if none is owed."""
        ctxs = self._owed.loads.get(key)
        if not ctxs:
            return None
        ctx = ctxs.pop(0)
        if not ctxs:
            del self._owed.loads[key]
        return ctx

    def take_owed(self) -> OwedCompletions:
        """Every completion still owed, taken from it (it owes nothing after)."""
        owed = OwedCompletions({k: list(v) for k, v in self._owed.stores.items()},
                               {k: list(v) for k, v in self._owed.loads.items()})
        self._owed.stores.clear()
        self._owed.loads.clear()
        return owed

    @contextmanager
    def calling(self) -> Iterator[None]:
        """Counts a call for it in the TieringManager, for as long as the body runs (:meth:`done`)."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1


class Requests:
    """The live requests by ``req_id``, and the attempt numbers of those still owing completions.

    ``lock`` is the adapter's lock, which callers hold. :meth:`unlocked` releases it for a call.
    """

    def __init__(self, tm: TieringManager, counters: MutableMapping[str, int],
                 lock: threading.Lock | None = None) -> None:
        self.tm = tm
        self.counters = counters
        self.lock = lock if lock is not None else threading.Lock()
        self.by_id: dict[str, Request] = {}
        self.attempts: dict[str, int] = {}
        self.with_answers: set[str] = set()  # req_ids whose answers wait for the step's end

    def get(self, req_id: str) -> Request | None:
        return self.by_id.get(req_id)

    def start_attempt(self, req_id: str, params: Any) -> Request:
        """Register the next attempt of ``req_id`` with kvactors."""
        attempt = self.attempts.get(req_id, -1) + 1
        for _ in range(MAX_ATTEMPT_BUMPS):
            ctx = ReqContext(req_id, attempt, params if isinstance(params, dict) else None)
            try:
                self.tm.on_new_request(ctx)
                break
            except LifecycleError:
                attempt += 1  # that identity is still finishing inside kvactors
        else:
            raise LifecycleError(f"could not start a new attempt of request {req_id!r}")
        self.attempts[req_id] = attempt
        old = self.by_id.get(req_id)
        # Completions still owed to the old attempt stay with it.
        req = Request(req_id, ctx) if old is None else old.successor(ctx)
        self.by_id[req_id] = req
        return req

    def current(self, req_id: str, params: Any) -> Request:
        """The live attempt of ``req_id``, started now for a request vLLM never announced
        (or one used again after its finish)."""
        req = self.by_id.get(req_id)
        if req is None or req.finished:
            self.counters["untracked_requests"] += 1
            req = self.start_attempt(req_id, params)
        return req

    def finish_attempt(self, req: Request) -> None:
        """vLLM will submit nothing more for this attempt."""
        if req.finish():
            self.drop_answers(req)
            self.tm.on_request_finished(req.ctx)

    def forget_if_done(self, req: Request) -> None:
        """Forget a finished request that owes nothing (its attempt number too), unless a call
        for it runs outside the lock (it records what it owes after)."""
        if req.done() and self.by_id.get(req.req_id) is req:
            del self.by_id[req.req_id]
            self.attempts.pop(req.req_id, None)

    @contextmanager
    def kept(self, req: Request) -> Iterator[None]:
        """Keep ``req`` while the body runs.

        This holds even where the body releases the lock (:meth:`unlocked`) for a call whose outcome it records after.
        After the body, even one that raised, a finished ``req`` that owes nothing is forgotten.
        The lock is held at entry and at exit.
        """
        try:
            with req.calling():
                yield
        finally:
            self.forget_if_done(req)

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Run the body without :attr:`lock`, which the caller holds, and hold it again after.

        The lookup thread may post answers and pins meanwhile.
        A request the body's call is for is kept by :meth:`kept` around it.
        """
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def restore_pins(self, req: Request, pins: Mapping[OffloadKey, int]) -> list[OffloadKey]:
        """Give ``req`` back the pins taken from it for a ``prepare_load`` that failed.

        Returns the keys whose pins to release instead.
        A pin is released instead when ``req`` finished or was replaced meanwhile.
        It is also released when the lookup thread posted a pin of the same key meanwhile.
        """
        if req.finished or self.by_id.get(req.req_id) is not req:
            return list(pins)
        release = req.give_back_pins(pins)
        if len(release) < len(pins):
            self.with_answers.add(req.req_id)  # its pins are looked at again at the step's end
        return release

    def drop_answers(self, req: Request) -> None:
        """Release the request's unused pins and forget its answers."""
        pins = req.drop_answers()
        if pins:
            self.tm.complete_load(list(pins), req.ctx)
        self.with_answers.discard(req.req_id)

    def end_step(self, now: float, hold_s: float) -> None:
        """Drop the answers read this step, at the step's end.

        Answers kept unread for one step already are dropped too.
        Their pins are kept, for ``hold_s`` at most (:meth:`Request.end_step`).
        A request that vLLM could not schedule this step (no device blocks yet) still finds its blocks
        in the pool on the next one.
        """
        for req_id in list(self.with_answers):
            req = self.by_id.get(req_id)
            if req is None:
                self.with_answers.discard(req_id)
            elif req.end_step(now, hold_s):
                self.drop_answers(req)
