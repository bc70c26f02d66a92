"""The actor that owns one :class:`~kvactors.tiers.base.SecondaryTier` plugin.

It calls the plugin's methods one at a time on its own thread. It turns
everything the plugin does wrong into that tier's failure.

* An exception in ``submit_*`` is a failed job.
* An exception in ``lookup`` is a failed answer (a miss).
* An exception in a hook is logged and counted.

Nothing a plugin raises reaches the supervisor or the other tiers.

The only sender of messages to this actor is the supervisor, through a
:class:`TierLink` (:mod:`kvactors.actors.supervisor` says why that matters).
The actor takes the supervisor's ref in its constructor. The supervisor takes
the actor's :class:`TierAddress` in its own and makes the link from it.

Lookups take a fast lane. A tier whose ``submit_*`` blocks (a call to a slow
disk or server on the submit path) would otherwise make every lookup wait
behind the submits queued before it, and the frontend's ``lookup`` with it.
The supervisor also puts each lookup in the link's lane, and the actor serves
the lane before each submit it runs. A lookup may overtake submits (it never
submits anything, so the contract is unaffected) but never the
``on_new_request`` of its request.

A tier's *inline* calls are the methods that never block
(:attr:`~kvactors.tiers.base.SecondaryTier.inline_calls`). They skip the
hand-off when the tier's actor is idle. The supervisor then claims the actor
and runs the call on its own thread, which is the primary's or that of a
caller that claimed the primary. The call still runs alone and after
everything sent before it. Never blocking there is the tier's promise.
It is the one place where a tier can stall the primary and that thread,
since nothing can interrupt a call running there. A call that breaks the
promise is caught afterwards. One that took longer than :data:`INLINE_LIMIT_S`
is never run inline again (``inline_call_demoted``). It can therefore stall the
primary once, not on every call.

A plugin stuck inside any call (inline or not, on this actor's thread) never
holds up the supervisor beyond a deadline. "Nothing here waits for a tier
without a deadline" in :mod:`kvactors.actors.supervisor` says how. This actor's
answers to a supervisor that is gone (a stuck call that returned after
``stop()``) are dropped, not raised.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvactors.actors import messages as m
from kvactors.actors.runtime import Actor, ActorRef, ActorStoppedError, alone, handles
from kvactors.core.gathers import GatherKind
from kvactors.logs import EventLogger
from kvactors.tiers.base import InlineCall, SecondaryTier, hooks_of, inline_calls_of
from kvactors.types import JobResult, LookupResult, OffloadKey, ReqContext


class LookupLane:
    """Lookups waiting for one tier actor, shared by their sender and that actor.

    Thread-safe, with one lock around every operation. A bare ``deque`` is not
    enough. ``deque.remove`` compares with ``==``, which runs Python code, and
    an append from the other thread meanwhile makes it raise.
    """

    __slots__ = ("_items", "_lock")

    def __init__(self) -> None:
        self._items: deque[m.TierLookup] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, lookup: m.TierLookup) -> None:
        with self._lock:
            self._items.append(lookup)

    def take(self, lookup: m.TierLookup) -> bool:
        """Remove ``lookup`` (by identity). ``False`` if it was served already."""
        with self._lock:
            for index, item in enumerate(self._items):
                if item is lookup:
                    del self._items[index]
                    return True
            return False

    def take_leading(self, ready: Callable[[m.TierLookup], bool] | None = None) -> list[m.TierLookup]:
        """Remove and return the lookups at the front for which ``ready`` holds (all, without it), in order."""
        with self._lock:
            taken = []
            while self._items and (ready is None or ready(self._items[0])):
                taken.append(self._items.popleft())
            return taken


INLINE_LIMIT_S = 0.25
"""An inline call that took longer than this on the sender's thread is demoted.

It is sent to the tier's thread from then on. A call that keeps its promise takes
microseconds, and the margin is for a loaded machine's scheduling.
"""


@dataclass(frozen=True, slots=True)
class TierAddress:
    """Where the supervisor reaches one tier actor, and what the tier declares. Immutable.

    ``tier`` is the tier's name. ``ref`` is the actor's ref, made before the actor started.
    ``lane`` is the actor's lookup lane.
    ``wants_new_request`` and ``wants_touch`` say whether the plugin declares those optional hooks
    (:attr:`~kvactors.tiers.base.SecondaryTier.hooks`).
    ``inline`` holds the plugin's methods that may run on the sender's thread
    (:func:`~kvactors.tiers.base.inline_calls_of`).
    ``max_inflight_jobs`` bounds the jobs the tier is sent and has not reported.
    ``medium`` and ``locality`` are the tier's kind, which a request's ``kv_load_tiers`` selects by.
    """

    tier: str
    ref: ActorRef
    lane: LookupLane
    wants_new_request: bool
    wants_touch: bool
    inline: frozenset[InlineCall]
    max_inflight_jobs: int
    medium: str
    locality: str


InlineCallBlocked = Callable[[str, str, float], None]
"""Told ``(tier, call, seconds)`` when an inline call overran :data:`INLINE_LIMIT_S`."""


class TierLink:
    """How the supervisor reaches one tier actor. Used by the supervisor's thread only.

    The supervisor makes it from the tier's :class:`TierAddress`.
    ``wants_new_request`` and ``wants_touch`` say whether a hook message is worth
    sending, which it is only if the plugin declares the hook.
    ``on_request_finished`` is always sent, since the actor logs its arrival for ``check-log``.
    ``inline`` holds the plugin's methods that run on the sender's thread when the actor is idle.
    One that overruns :data:`INLINE_LIMIT_S` there leaves the set, and ``on_blocked``
    is told.
    """

    __slots__ = ("inline", "lane", "on_blocked", "ref", "tier", "wants_new_request", "wants_touch")

    def __init__(self, address: TierAddress, on_blocked: InlineCallBlocked) -> None:
        self.tier = address.tier
        self.ref = address.ref
        self.lane = address.lane
        self.wants_new_request = address.wants_new_request
        self.wants_touch = address.wants_touch
        self.inline: frozenset[InlineCall] = address.inline
        self.on_blocked = on_blocked

    def _run_inline(self, message: object, call: InlineCall) -> None:
        started = time.perf_counter()
        self.ref.run_claimed(message, alone)  # this call alone: what is told meanwhile is the tier thread's
        took = time.perf_counter() - started
        if took > INLINE_LIMIT_S and call in self.inline:
            self.inline = self.inline - {call}
            self.on_blocked(self.tier, call, took)

    def send(self, message: object, call: InlineCall) -> None:
        """Send a hook or a submit, which the plugin's method ``call`` handles.

        If that method is inline and the actor idle, it runs here instead. That is a
        claim, so it runs alone and after everything sent to the tier before.
        """
        if call in self.inline and self.ref.claim():
            self._run_inline(message, call)
        else:
            self.ref.tell(message)

    def lookup(self, lookup_id: int, keys: tuple[OffloadKey, ...],
               ctx: ReqContext) -> tuple[bool, tuple[LookupResult, ...] | None]:
        """Ask the tier about ``keys``.

        A tier whose lookup is inline and whose actor is idle answers here, on the
        caller's thread. That is a claim, so it runs alone and after everything sent
        to the tier before. It returns ``(True, answer)``, the answer ``None`` if the
        tier failed. Otherwise the lookup is sent, and ``(False, None)`` is returned.
        The answer then comes back as a :class:`~kvactors.actors.messages.TierLookupAnswered`.
        """
        if "lookup" in self.inline and self.ref.claim():
            answer: list[tuple[LookupResult, ...] | None] = []
            self._run_inline(m.TierLookup(lookup_id, keys, ctx, answer), "lookup")
            return True, answer[0] if answer else None  # none: the handler itself failed
        message = m.TierLookup(lookup_id, keys, ctx)
        self.lane.push(message)
        self.ref.tell(message)
        return False, None


class SecondaryTierActor(Actor):
    """Runs one tier plugin, one call at a time (see the module docstring)."""

    def __init__(self, tier: SecondaryTier, *, supervisor: ActorRef, pool: torch.Tensor,
                 log: EventLogger | None = None) -> None:
        """Attach the plugin to ``pool``. Its reports go to ``supervisor``.

        The plugin is attached here, before the actor starts, so it gets no message before.
        ``ValueError`` if the plugin's ``inline_calls`` or ``hooks`` name a method it lacks.
        """
        if log is not None:
            self.log = log
        self.tier = tier
        self.name = f"tier-{tier.name}"
        self.supervisor = supervisor
        self.tier_errors = 0
        self._lane = LookupLane()
        self.hooks = hooks_of(tier)
        self.wants_new_request = "on_new_request" in self.hooks
        self.inline = inline_calls_of(tier)  # ValueError here, at the manager's start, if it names a stranger
        # Requests whose on_new_request the plugin has seen: their lookups may take the lane.
        self._open: set[tuple[str, int]] = set()
        self.tier.attach(pool, self._report)

    def address(self, ref: ActorRef) -> TierAddress:
        """This actor's address for the supervisor, reached at ``ref`` (its own, from the runtime)."""
        tier = self.tier
        return TierAddress(tier=tier.name, ref=ref, lane=self._lane, wants_new_request=self.wants_new_request,
                           wants_touch="touch" in self.hooks, inline=self.inline,
                           max_inflight_jobs=tier.max_inflight_jobs, medium=tier.medium, locality=tier.locality)

    def _report(self, result: JobResult) -> None:
        """The plugin's ``report``. Thread-safe, called from any thread."""
        if not isinstance(result, JobResult):
            self.log.error("job_report_invalid", tier=self.tier.name, value=repr(result))
            return
        try:
            self.supervisor.tell(m.JobReported(self.tier.name, result))
        except ActorStoppedError:
            # stop() already counted this job as failed; the report has nowhere to go.
            self.log.info("report_after_stop", tier=self.tier.name, job_id=result.job_id)

    def _answer(self, message: object) -> None:
        """Tell the supervisor. After ``stop()`` (a call stuck past it) there is nobody to tell."""
        with contextlib.suppress(ActorStoppedError):
            self.supervisor.tell(message)

    def _failed(self, call: str, exc: BaseException, **context: object) -> None:
        """Anything a plugin call raises is this tier's failure ("Failures" in :mod:`kvactors.actors.runtime`)."""
        self.tier_errors += 1
        self.log.warning("tier_call_failed", tier=self.tier.name, call=call, error=repr(exc), **context)

    @handles(m.TierNewRequest)
    def _on_new_request(self, msg: m.TierNewRequest) -> None:
        self._open.add(msg.ctx.identity)
        try:
            self.tier.on_new_request(msg.ctx)
        except BaseException as exc:
            self._failed("on_new_request", exc, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)

    @handles(m.TierFinished)
    def _on_finished(self, msg: m.TierFinished) -> None:
        self._open.discard(msg.ctx.identity)
        if self.tracing:
            self.log.debug("tier_finish_received", tier=self.tier.name, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)
        try:
            self.tier.on_request_finished(msg.ctx)
        except BaseException as exc:
            self._failed("on_request_finished", exc, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)

    @handles(m.TierTouch)
    def _on_touch(self, msg: m.TierTouch) -> None:
        try:
            self.tier.touch(msg.keys, msg.ctx)
        except BaseException as exc:
            self._failed("touch", exc)

    @handles(m.TierSubmit)
    def _on_submit(self, msg: m.TierSubmit) -> None:
        self._serve_lane()
        job = msg.job
        ctx = job.req_context
        if self.tracing:
            self.log.debug("tier_submit_received", tier=self.tier.name, job_id=job.job_id, promotion=job.is_promotion,
                           req_id=ctx.req_id, attempt=ctx.attempt)
        try:
            if job.is_promotion:
                self.tier.submit_load(job)
            else:
                self.tier.submit_store(job)
        except BaseException as exc:
            self._failed("submit_load" if job.is_promotion else "submit_store", exc, job_id=job.job_id)
            self._report(JobResult(job.job_id, False, f"{type(exc).__name__}: {exc}"))

    def _serve_lane(self) -> None:
        """Answer the lookups waiting behind this submit, in order, while their requests are open here."""
        is_open = (lambda lookup: lookup.ctx.identity in self._open) if self.wants_new_request else None
        for lookup in self._lane.take_leading(is_open):
            self._lookup(lookup)

    @handles(m.TierLookup)
    def _on_lookup(self, msg: m.TierLookup) -> None:
        if msg.inline_answer is not None or self._lane.take(msg):  # else answered from the lane already
            self._lookup(msg)

    def _lookup(self, msg: m.TierLookup) -> None:
        results: tuple[LookupResult, ...] | None
        try:
            answer = self.tier.lookup(msg.keys, msg.ctx)
            results = tuple(answer)
            if len(results) != len(msg.keys):
                raise TypeError(f"lookup returned {len(results)} values for {len(msg.keys)} keys")
            for result in results:
                if type(result) is not LookupResult:
                    raise TypeError(f"lookup returned {result!r}, not a LookupResult")
        except BaseException as exc:
            self._failed("lookup", exc)
            results = None
        if msg.inline_answer is not None:
            msg.inline_answer.append(results)
        else:
            self._answer(m.TierLookupAnswered(msg.lookup_id, self.tier.name, results))

    @handles(m.TierGather)
    def _on_gather(self, msg: m.TierGather) -> None:
        payload: tuple[object, ...] = ()
        try:
            if msg.what == GatherKind.EVENTS:
                payload = tuple(self.tier.take_events())
            elif msg.what == GatherKind.SHUTDOWN:
                try:
                    self.tier.drain(msg.timeout_s)
                finally:
                    self.tier.shutdown()
        except BaseException as exc:
            self._failed(msg.what, exc)
        self._answer(m.TierGathered(msg.gather_id, self.tier.name, payload))
