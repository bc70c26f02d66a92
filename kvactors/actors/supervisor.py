"""The lifecycle supervisor keeps every request's counts, every job and every tier call.

Why no submit can overtake a finish at any tier
-----------------------------------------------
pykka orders messages per sender only. Two actors telling a third may be
interleaved in any order. kvactors therefore never lets two actors talk to a
secondary tier.

1. The supervisor is the **only sender** to every tier actor. Submits
   (``submit_store`` for cascades, ``submit_load`` for promotions), hooks and
   ``on_request_finished`` all leave from this one actor. Each tier therefore
   receives them in exactly the order the supervisor sent them.
2. The supervisor sends ``on_request_finished(ctx)`` only from
   :meth:`LifecycleSupervisor._maybe_finalize_request`. It does so when
   :meth:`~kvactors.core.lifecycle.LifecycleTable.maybe_finalize` finds the
   request finished and nothing counted that could still produce a submit.
   That means no pending primary store (each may cascade when it completes)
   and no secondary lookup in progress (each may promote). It also means no
   promotion allocated or queued but unsent, and no cascade parked for a tier
   slot. After that the request's state is gone. The job book refuses any job
   whose request has no state (:attr:`~kvactors.core.jobbook.Step.REFUSED`).
3. Those counts are fed by the primary, which is also a single sender. Its
   "request finished" carries the number of the request's stores still
   pending at that moment. Afterwards it reports every completion or deadline
   that ends one of them. The primary rejects every submit call after a
   finish, so no new pending store can appear once the finish is sent. Before
   the finish nothing can finalize, so the count is not needed sooner.
   A request's state opens with the primary's first fact about it, flagged
   ``opens``. A separate "request started" is sent only when a tier wants that
   hook. A fact without the flag for a request with no state is therefore about
   a request already finalized, and the job book still refuses its jobs.

The supervisor runs colocated with the primary, on one thread and mailbox (see
:mod:`kvactors.actors.runtime`). That orders the two actors' messages further
and removes interleavings. The argument above needs none of them.

Hence at every tier, for every request attempt, every submit is processed
before the one ``on_request_finished``, and none after it. State is keyed by
``(req_id, attempt)``, so a late completion of a preempted attempt never
touches the next attempt's counts (vLLM #51637).

Everything else here serves the same contract. Deadlines fail jobs that are
not reported in time. Their rows stay held until the late report, since the
tier may still be touching them. Per-tier queues bound the jobs in flight.
``reset_cache`` zeroes the counts and finalizes finished requests while
in-flight jobs drain.

The books are plain classes in ``kvactors/core/``. This actor routes facts to
them and performs the steps they return.

* :mod:`~kvactors.core.jobbook` keeps the queues, slots, deadlines, held jobs and report routing.
* :mod:`~kvactors.core.lookupbook` keeps a lookup's fan-out and answers.
* :mod:`~kvactors.core.gathers` keeps the rounds through every tier (events, barrier, shutdown).
* :mod:`~kvactors.core.tierwatch` keeps what each tier owes.
* :mod:`~kvactors.core.barriers` keeps the ``wait_idle`` barriers until no work holds them.
* :mod:`~kvactors.core.resets` keeps the ``reset_cache`` calls until their jobs and round are over.
* :mod:`~kvactors.core.shutdown` keeps the stop's phases (drain, the tiers' round, the reply).
* :mod:`~kvactors.core.alarm` keeps the next tick, armed for the soonest deadline of all the books.

What any handler may bring about is acted on in one place,
:meth:`LifecycleSupervisor.settle`, which the runtime calls after every
message. It starts the barriers now due, begins the stop's shutdown round once
nothing is waited for, and arms the next tick after one fired. A handler
therefore never checks them itself, and a new one cannot forget to.

Nothing here waits for a tier without a deadline
------------------------------------------------
A tier's actor may be stuck inside one of its plugin's calls for minutes. Every
round through the tiers (a *gather* of events, a barrier or the shutdown) and
every lookup therefore has a deadline. A :class:`~kvactors.core.tierwatch.TierWatch`
keeps the books of what each tier owes. A tier that owes an answer and has
given none for ``transfer_timeout_s`` is *stuck*. The log says ``tier_stuck``,
and the stats count it in ``tiers_stuck`` and ``tier_stuck.<name>``.

A stuck tier is left out of what waits on it.

* Open gathers and lookups go on without it.
* Later ones do not wait for it at all, so a caller polling ``take_events``
  every step pays nothing for it.
* Its lookups are ``RETRY``.
* Its queued jobs and new jobs fail at once without being sent, so no row is
  held for it.
* The jobs it was given time out as any other.

Its hooks and finishes are still sent, so the contract holds at that tier too
once it moves again. Its first answer is logged as ``tier_unstuck``. Its late
answers are accounted for. Events a late gather brings are handed out by the
next ``take_events``, and late reports release their rows as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvactors.actors import messages as m
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, handles
from kvactors.actors.secondary import TierAddress, TierLink
from kvactors.core import counters
from kvactors.core.alarm import Alarm
from kvactors.core.barriers import BarrierBook
from kvactors.core.errors import LifecycleError
from kvactors.core.gathers import Gather, GatherBook, GatherKind
from kvactors.core.jobbook import BookedJob, JobBook, Route, Step
from kvactors.core.jobkinds import DropReason, JobOutcome
from kvactors.core.lifecycle import InvariantError, LifecycleTable, Pending, RequestState
from kvactors.core.lookupbook import LookupBook, PendingLookup
from kvactors.core.quarantine import PromotionQuarantine
from kvactors.core.request_params import parse_request_params
from kvactors.core.resets import ResetBook, ResetWait
from kvactors.core.shutdown import Shutdown, ShutdownPhase
from kvactors.core.statsbook import StatsBook
from kvactors.core.tierwatch import TierWatch
from kvactors.log_schema import JOB_COMPLETED, JOB_SUBMITTED
from kvactors.logs import EventLogger
from kvactors.tiers.base import InlineCall
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

GatherDone = Callable[[dict[str, tuple[Any, ...]], frozenset[str]], None]
"""Called once a gather ends, with the tiers' payloads and the tiers that did not answer in time."""


class LifecycleSupervisor(Actor):
    """The supervisor owns the lifecycle table and the job, lookup, gather, barrier, reset and stop books.

    It routes messages between them, the primary and the tiers. It runs on one actor, so one
    handler at a time touches its state. The module docstring says why it is built this way.
    """

    name = "supervisor"

    def __init__(self, *, primary: ActorRef, tiers: Sequence[TierAddress], transfer_timeout_s: float,
                 lookup_timeout_s: float, log: EventLogger | None = None) -> None:
        """Build the books for ``tiers`` and link each tier.

        ``primary`` is the primary's ref. ``tiers`` holds each tier actor's address, in the tiers' order.
        ``ValueError`` if two addresses name the same tier.
        """
        names = [address.tier for address in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"each tier must have one address, got {names}")
        if log is not None:
            self.log = log
        self.table = LifecycleTable()
        self.transfer_timeout_s = transfer_timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self._shortest_timeout = min(transfer_timeout_s, lookup_timeout_s)
        self.tier_order = tuple(names)
        # Each tier's (medium, locality), for the requests' kv_load_tiers.
        self.tier_kinds = {address.tier: (address.medium, address.locality) for address in tiers}
        self.primary = primary
        self.tiers = {address.tier: TierLink(address, self._inline_call_blocked) for address in tiers}
        self.epoch = 0
        self.jobs = JobBook([(address.tier, address.max_inflight_jobs) for address in tiers], transfer_timeout_s,
                            live=lambda ctx: ctx in self.table)
        self.lookups: LookupBook[Reply[list[LookupResult]]] = LookupBook(self.tier_order, lookup_timeout_s)
        self.gathers: GatherBook[GatherDone] = GatherBook()
        self.quarantine = PromotionQuarantine()
        self.barriers: BarrierBook[Reply[bool]] = BarrierBook()
        self.resets: ResetBook[Reply[None]] = ResetBook()
        self.shutdown: Shutdown[Reply[None]] = Shutdown()
        self._watch = TierWatch(self.tier_order, transfer_timeout_s)
        self.alarm = Alarm(self._wake_at)
        self.counters = counters.SupervisorCounters(self.tier_order)  # stats() and metrics derive from these
        self._stats = StatsBook(self.tier_order, self.table, self.jobs, self.lookups, self.quarantine, self._watch,
                                self.counters)

    def _inline_call_blocked(self, tier: str, call: str, seconds: float) -> None:
        """A call the tier declared inline took ``seconds`` on this thread, so it is not inline any more."""
        self.counters.inline_calls_demoted += 1
        self.log.warning("inline_call_demoted", tier=tier, call=call, seconds=round(seconds, 3))

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked. New lookups and jobs are not taken then."""
        return self.shutdown.stopping

    # ------------------------------------------------------------ after every message

    def settle(self) -> None:
        """What any handler may have brought about, acted on once after each message.

        Barriers now due get their round through the tiers. A stop with nothing
        left to wait for begins its shutdown round. After a tick, the alarm is
        armed for the soonest deadline of all the books. Barriers come before the
        stop, whose end answers the rest.
        """
        if self.barriers.waiting:
            self._start_due_barriers()
        if self.shutdown.awaits_round:
            self._begin_shutdown_round()
        if self.alarm.fired:
            self.alarm.rearm((self.jobs.next_deadline(), self.lookups.next_deadline(),
                              self.gathers.next_deadline(), self._watch.next_deadline(),
                              self.shutdown.timer_deadline()))

    # ------------------------------------------------------------ the finalize decision

    def _maybe_finalize_request(self, ctx: ReqContext) -> None:
        """Tell every tier that ``ctx`` is finished, once, if nothing can still submit for it."""
        state = self.table.maybe_finalize(ctx)
        if state is not None:
            self._finalize(state)

    def _finalize(self, state: RequestState) -> None:
        ctx = state.req_context
        for tier in self.tier_order:
            # Every event is logged before the tell that causes the next one: the log's order is causal.
            if self.tracing:
                self.log.debug("tier_finalized", req_id=ctx.req_id, attempt=ctx.attempt, tier=tier)
            self.tiers[tier].send(m.TierFinished(ctx), "on_request_finished")
        self.counters.requests_finalized += 1
        if self.tracing:
            self.log.debug("request_finalized", req_id=ctx.req_id, attempt=ctx.attempt)
        self.primary.tell(m.RequestFinalized(ctx))

    def _count(self, ctx: ReqContext, counter: Pending, delta: int) -> RequestState | None:
        try:
            return self.table.add(ctx, counter, delta)
        except InvariantError as exc:
            self.internal_errors += 1
            self.log.error("invariant_broken", req_id=ctx.req_id, attempt=ctx.attempt, error=str(exc))
            return self.table.get(ctx)

    # ------------------------------------------------------------ facts from the primary

    @handles(m.RequestStarted)
    def _on_request_started(self, msg: m.RequestStarted) -> None:
        self.table.start(msg.ctx)
        for tier in self.tier_order:
            if self.tiers[tier].wants_new_request:
                self.tiers[tier].send(m.TierNewRequest(msg.ctx), "on_new_request")

    def _open(self, ctx: ReqContext) -> None:
        """The primary's first fact about ``ctx`` came, and its state starts here."""
        try:
            self.table.start(ctx)
        except LifecycleError as exc:  # unreachable, since the primary announces each lifetime once
            self.internal_errors += 1
            self.log.error("invariant_broken", req_id=ctx.req_id, attempt=ctx.attempt, error=str(exc))

    @handles(m.RequestFinished)
    def _on_request_finished(self, msg: m.RequestFinished) -> None:
        if msg.opens:
            self._open(msg.ctx)
        state = self.table.finish(msg.ctx)
        if state is not None:
            self._count(msg.ctx, Pending.PRIMARY_STORES, msg.pending_stores)
            if self.tracing:
                self.log.debug("request_finish_seen", req_id=msg.ctx.req_id, attempt=msg.ctx.attempt, **state.counts())
            self._maybe_finalize_request(msg.ctx)

    @handles(m.StoresExpired)
    def _on_stores_expired(self, msg: m.StoresExpired) -> None:
        self._count(msg.ctx, Pending.PRIMARY_STORES, -msg.expired)
        self._maybe_finalize_request(msg.ctx)

    @handles(m.StoresCompleted)
    def _on_stores_completed(self, msg: m.StoresCompleted) -> None:
        if msg.opens:
            self._open(msg.ctx)
        state = self.table.get(msg.ctx)
        if state is not None and state.is_finished:
            # Before its finish a request's pending stores are not counted here (see point 3).
            state = self._count(msg.ctx, Pending.PRIMARY_STORES, -msg.live)
        for cascade in msg.cascades:
            if state is None or self.stopping:
                self._end_unsubmitted(BookedJob(cascade.tier, cascade.job, cascade.job.job_id, self.epoch),
                                      DropReason.NO_REQUEST if state is None else DropReason.STOPPING)
            else:
                self._enqueue(cascade.tier, cascade.job, cascade.job.job_id, self.epoch)
        self._maybe_finalize_request(msg.ctx)

    @handles(m.TouchTiers)
    def _on_touch_tiers(self, msg: m.TouchTiers) -> None:
        for tier in self.tier_order:
            if self.tiers[tier].wants_touch:
                self.tiers[tier].send(m.TierTouch(msg.keys, msg.ctx), "touch")

    # ------------------------------------------------------------ jobs

    def _enqueue(self, tier: str, job: TransferJob, origin: int, epoch: int) -> None:
        if self._watch.is_stuck(tier):  # sent, it would hold its rows until the tier moves
            self._end_unsubmitted(BookedJob(tier, job, origin, epoch), DropReason.TIER_STUCK)
            return
        self._take_step(*self.jobs.add(tier, job, origin, epoch, self.runtime.now()))

    def _take_steps(self, steps: Iterable[tuple[Step, BookedJob]]) -> None:
        for step, entry in steps:
            self._take_step(step, entry)

    def _take_step(self, step: Step, entry: BookedJob) -> None:
        """Do what the job book's ``step`` with ``entry`` means (:class:`~kvactors.core.jobbook.Step`)."""
        ctx = entry.job.req_context
        if step is Step.STARTED:
            self._send_job(entry)
        elif step is Step.QUEUED:
            self._count(ctx, entry.counter, +1)
            if entry.deadline is not None:
                self.alarm.arm(entry.deadline)
            if self.tracing:
                self.log.debug("job_queued", kind=entry.kind, job_id=entry.job_id, tier=entry.tier,
                               req_id=ctx.req_id, attempt=ctx.attempt)
            return
        elif step is Step.REFUSED:
            # Unreachable while the counts are right; the guard keeps the contract if they are not.
            self.counters.guard_violations += 1
            self.log.error("contract_violation", reason="submit_after_finalize", tier=entry.tier,
                           job_id=entry.job_id, req_id=ctx.req_id, attempt=ctx.attempt)
            self._end_unsubmitted(entry, DropReason.NO_REQUEST)
        elif step is Step.EXPIRED:  # a queued promotion past its deadline: it fails, never sent
            self._end_unsubmitted(entry, DropReason.TIMED_OUT)
            self._back_off(entry, entry.job.keys)
        else:
            self._time_out(entry)
            return
        if entry.waited:
            # It left the queue; a submit left before any finish can: FIFO from this actor.
            self._count(ctx, entry.counter, -1)
            self._maybe_finalize_request(ctx)

    def _send_job(self, entry: BookedJob) -> None:
        ctx = entry.job.req_context
        self.counters.job_started(entry.tier, entry.kind)
        self.alarm.arm(entry.deadline if entry.deadline is not None else entry.submitted_at + self.transfer_timeout_s)
        if self.tracing:
            self.log.debug(JOB_SUBMITTED[entry.kind], job_id=entry.job_id, tier=entry.tier, keys=len(entry.job.keys),
                           req_id=ctx.req_id, attempt=ctx.attempt)
        call: InlineCall = "submit_load" if entry.job.is_promotion else "submit_store"
        self.tiers[entry.tier].send(m.TierSubmit(entry.job), call)

    def _end_unsubmitted(self, entry: BookedJob, reason: DropReason) -> None:
        """A job that never reached its tier fails, and its rows are released at once."""
        self.counters.job_dropped(entry.tier, entry.kind)
        self.log.info("job_dropped", kind=entry.kind, job_id=entry.job_id, tier=entry.tier, reason=reason,
                      req_id=entry.job.req_context.req_id, attempt=entry.job.req_context.attempt)
        self.primary.tell(m.JobEnded(entry.job_id, entry.job.is_promotion, success=False, hold=False))

    def _drop_queued(self, reason: DropReason, tiers: Sequence[str] | None = None) -> list[ReqContext]:
        """Fail every job still waiting for a slot at ``tiers`` (all tiers by default), and return their requests."""
        touched = []
        for entry in self.jobs.drop_queued(tiers):
            self._count(entry.job.req_context, entry.counter, -1)
            self._end_unsubmitted(entry, reason)
            touched.append(entry.job.req_context)
        return touched

    def _job_over(self, job_id: int) -> None:
        """A job sent to its tier ended, reported or timed out. The resets waiting on it hear of it."""
        self._answer_resets(self.resets.job_over(job_id))

    @handles(m.JobReported)
    def _on_job_reported(self, msg: m.JobReported) -> None:
        result = msg.result
        now = self.runtime.now()
        report = self.jobs.report(msg.tier, result, now)
        entry, outcomes = report.job, report.outcomes
        if report.route is Route.LATE:
            self.counters.late_reports += 1
            self.log.warning("late_report_ignored", job_id=result.job_id, tier=msg.tier, success=result.success)
            self.primary.tell(m.HoldReleased(result.job_id))
            return
        if entry is None or outcomes is None:
            self.counters.unexpected_reports += 1
            self.log.warning("job_report_unexpected", job_id=result.job_id, tier=msg.tier)
            return
        ctx = entry.job.req_context
        if outcomes.problem is not None:
            # A report that does not fit its job is no one's word for any key: all of them failed.
            self.counters.invalid_reports += 1
            self.log.warning("job_report_invalid", job_id=result.job_id, tier=entry.tier, reason=outcomes.problem,
                             req_id=ctx.req_id, attempt=ctx.attempt)
        success = outcomes.all_ok
        self.counters.jobs_partial += outcomes.partial
        outcome = JobOutcome.OK if success else JobOutcome.FAILED
        self.counters.job_ended(entry.tier, entry.kind, outcome, len(outcomes.ok), now - entry.submitted_at)
        self.counters.job_keys_failed += len(outcomes.failed)
        if not success or self.tracing:
            log = self.log.debug if success else self.log.warning
            log(JOB_COMPLETED[entry.kind], job_id=result.job_id, tier=entry.tier, success=success,
                keys=len(entry.job.keys), failed_keys=len(outcomes.failed), error=result.error,
                req_id=ctx.req_id, attempt=ctx.attempt)
        ok_keys = None if success else frozenset(outcomes.ok)
        self.primary.tell(m.JobEnded(result.job_id, entry.job.is_promotion, success=bool(outcomes.ok), hold=False,
                                     ok_keys=ok_keys))
        if entry.job.is_promotion:
            for key in outcomes.ok:
                self.quarantine.succeeded(entry.tier, key)
            self._back_off(entry, outcomes.failed)
        self._job_over(entry.job_id)
        self._take_steps(report.steps)

    def _back_off(self, entry: BookedJob, keys: Sequence[OffloadKey]) -> None:
        """Promotions of ``keys`` from ``entry``'s tier failed, so that tier is not asked for them for a while."""
        if not keys:
            return
        now = self.runtime.now()
        backoff = max(self.quarantine.failed(entry.tier, key, now) for key in keys)
        self.log.info("promotions_backed_off", job_id=entry.job_id, tier=entry.tier, keys=len(keys),
                      backoff_s=backoff)

    def _time_out(self, entry: BookedJob) -> None:
        """A job past its deadline failed. The book holds it until its late report, and its rows stay held."""
        now = self.runtime.now()
        self.counters.job_ended(entry.tier, entry.kind, JobOutcome.TIMED_OUT, 0, now - entry.submitted_at)
        if entry.job.is_promotion:
            self._back_off(entry, entry.job.keys)
        ctx = entry.job.req_context
        self.log.warning("job_timed_out", kind=entry.kind, job_id=entry.job_id, tier=entry.tier,
                         req_id=ctx.req_id, attempt=ctx.attempt)
        self.primary.tell(m.JobEnded(entry.job_id, entry.job.is_promotion, success=False, hold=True))
        self._job_over(entry.job_id)

    # ------------------------------------------------------------ lookups and promotions

    @handles(m.SecondaryLookup)
    def _on_secondary_lookup(self, msg: m.SecondaryLookup) -> None:
        if msg.opens:
            self._open(msg.ctx)
        if self.stopping or self._count(msg.ctx, Pending.LOOKUPS, +1) is None:
            msg.reply.set_result(list(msg.results))
            return
        # A stuck tier is not asked: it counts as failed (its keys are a MISS unless another tier has them).
        skip = list(self._watch.stuck())
        if msg.ctx.params:  # kv_load_tiers: a tier the request may not load from is not asked
            skip.extend(self._excluded_tiers(msg.ctx))
        pending = self.lookups.begin(msg.lookup_id, msg.ctx, msg.keys, msg.missing, msg.results, msg.reply,
                                     skip=skip)
        now = self.runtime.now()
        keys = pending.asked
        for tier in self.tier_order:
            if tier not in pending.waiting:
                continue
            self.counters.asked(tier, len(keys))
            answered, answer = self.tiers[tier].lookup(msg.lookup_id, keys, msg.ctx)
            if answered:
                pending.answer(tier, answer)
            else:
                self._watch.asked(tier, ("lookup", msg.lookup_id), now)
        if not pending.waiting:  # every tier answered inline
            self._resolve_lookup(pending)
            return
        # The other answers are messages to this actor: they come after this handler.
        self.lookups.wait(pending, now)
        self.alarm.arm(now + self._shortest_timeout)  # the lookup's deadline, or a tier's stuck one

    def _excluded_tiers(self, ctx: ReqContext) -> tuple[str, ...]:
        """The tiers ``ctx``'s ``kv_load_tiers`` leaves out (its ignored values were logged at its start)."""
        controls = parse_request_params(ctx.params)
        if controls.load_tiers is None:
            return ()
        return tuple(tier for tier in self.tier_order if not controls.allows(*self.tier_kinds[tier]))

    @handles(m.TierLookupAnswered)
    def _on_tier_lookup_answered(self, msg: m.TierLookupAnswered) -> None:
        self._heard_from(msg.tier, ("lookup", msg.lookup_id))
        pending = self.lookups.answered(msg.lookup_id, msg.tier, msg.results)
        if pending is not None:
            self._resolve_lookup(pending)

    def _resolve_lookup(self, pending: PendingLookup[Reply[list[LookupResult]]], *, promote: bool = True) -> None:
        """Combine the tiers' answers (:meth:`~kvactors.core.lookupbook.LookupBook.resolve`).

        With promotions to start, ask the primary to allocate them. Otherwise answer the frontend.
        """
        self.counters.answered(pending.answers)
        blocked = None
        if self.quarantine:  # a tier's HIT for a key it failed to promote lately is taken as a MISS
            now = self.runtime.now()
            blocked = functools.partial(self.quarantine.blocked, now=now)
        resolution = self.lookups.resolve(pending, promote=promote, blocked=blocked)
        self.counters.promotion_hits_ignored += resolution.hits_ignored
        ctx = pending.ctx
        if resolution.plan:
            self._count(ctx, Pending.UNSENT_PROMOTIONS, +1)
            self._count(ctx, Pending.LOOKUPS, -1)
            self.primary.tell(m.AllocatePromotions(pending.lookup_id, ctx, self.epoch, tuple(resolution.plan.items()),
                                                   pending.keys, tuple(resolution.results), pending.reply))
        else:
            pending.reply.set_result(resolution.results)
            self._count(ctx, Pending.LOOKUPS, -1)
            self._maybe_finalize_request(ctx)

    @handles(m.PromotionsAllocated)
    def _on_promotions_allocated(self, msg: m.PromotionsAllocated) -> None:
        self.lookups.allocated(msg.lookup_id)
        stale = msg.epoch != self.epoch  # a reset zeroed this request's counts meanwhile
        state = self.table.get(msg.ctx)
        if not stale:
            self._count(msg.ctx, Pending.UNSENT_PROMOTIONS, -1)
        for promotion in msg.jobs:
            if stale or state is None or self.stopping:
                self._end_unsubmitted(BookedJob(promotion.tier, promotion.job, msg.lookup_id, msg.epoch),
                                      DropReason.RESET if stale else DropReason.STOPPING if self.stopping
                                      else DropReason.NO_REQUEST)
            else:
                self._enqueue(promotion.tier, promotion.job, msg.lookup_id, msg.epoch)
        self._maybe_finalize_request(msg.ctx)

    # ------------------------------------------------------------ deadlines

    def _wake_at(self, deadline: float) -> None:
        """The alarm's wake-up, a tick to this actor at ``deadline``."""
        self.runtime.call_later(deadline - self.runtime.now(), self.ref, m.Tick())

    @handles(m.Tick)
    def _on_tick(self, msg: m.Tick) -> None:
        self.alarm.fire()  # settle arms the next tick, once this one's consequences are in the books
        now = self.runtime.now()
        # An entry a book gives up here is acted on here only: one that raises must not drop the others.
        self.each_contained(self._watch.due(now), lambda tier: self._tier_stuck(tier, now), "Tick")
        self.each_contained(self.gathers.expire(now), self._gather_timed_out, "Tick")
        self.each_contained(self.jobs.expire(now), lambda step: self._take_step(*step), "Tick")
        self.each_contained(self.lookups.expire(now), self._lookup_timed_out, "Tick")
        if self.shutdown.out_of_time(now):
            # The stop's budget is spent: what is still in flight fails now, as at its own deadline,
            # and promotions the primary has not allocated yet are not waited for. Every job is timed
            # out before the stop may go on: its answer lets stop() close the mailbox these tells use.
            self.each_contained(self.jobs.time_out_all(now), lambda step: self._take_step(*step), "Tick")

    def _gather_timed_out(self, gather: Gather[GatherDone]) -> None:
        self.log.warning("gather_timed_out", what=gather.what, tiers=",".join(sorted(gather.waiting)))
        self._end_gather(gather)

    def _lookup_timed_out(self, pending: PendingLookup[Reply[list[LookupResult]]]) -> None:
        self.counters.lookups_timed_out += 1
        self.log.warning("lookup_timed_out", req_id=pending.ctx.req_id, attempt=pending.ctx.attempt,
                         tiers=",".join(sorted(pending.waiting)))
        self._resolve_lookup(pending)

    # ------------------------------------------------------------ stuck tiers

    def _tier_stuck(self, tier: str, now: float) -> None:
        """``tier`` owes answers and gave none for ``transfer_timeout_s``, so everything goes on without it."""
        self.log.warning("tier_stuck", tier=tier, silent_s=round(self._watch.silent_for(tier, now), 3),
                         owed=self._watch.owed(tier), jobs_in_flight=self.jobs.in_flight(tier))
        for gather in self.gathers.tier_stuck(tier):
            self._end_gather(gather)
        for pending in self.lookups.tier_stuck(tier):
            self._resolve_lookup(pending)
        for ctx in self._drop_queued(DropReason.TIER_STUCK, (tier,)):
            self._maybe_finalize_request(ctx)

    def _heard_from(self, tier: str, probe: tuple[str, int]) -> None:
        """An answer came from ``tier``'s actor, so it is moving."""
        now = self.runtime.now()
        silent = self._watch.answered(tier, probe, now)
        if silent is not None:
            self.log.warning("tier_unstuck", tier=tier, silent_s=round(silent, 3))
        if self._watch.owed(tier):  # its clock restarted, with a new deadline to be found stuck by
            self.alarm.arm(now + self.transfer_timeout_s)

    # ------------------------------------------------------------ whole-runtime operations

    @handles(m.SupervisorReset)
    def _on_reset(self, msg: m.SupervisorReset) -> None:
        self.epoch += 1
        for pending in self.lookups.open_lookups():
            self._resolve_lookup(pending, promote=False)
        self._drop_queued(DropReason.RESET)
        for state in self.table.reset():
            self._finalize(state)
        in_flight = self.jobs.in_flight_ids()
        self.log.info("cache_reset_draining", jobs=len(in_flight), epoch=self.epoch)
        wait = self.resets.begin(in_flight, msg.reply)
        # A round through the tiers, at once (it ends by its deadline, as the jobs do by
        # theirs): when reset_cache returns, they have processed its finishes.
        self._gather(GatherKind.BARRIER, functools.partial(self._reset_gathered, wait))

    def _reset_gathered(self, wait: ResetWait[Reply[None]], payloads: object, missing: frozenset[str]) -> None:
        self._answer_resets(self.resets.gathered(wait))

    @staticmethod
    def _answer_resets(replies: list[Reply[None]]) -> None:
        for reply in replies:
            reply.set_result(None)

    @handles(m.CollectEvents)
    def _on_collect_events(self, msg: m.CollectEvents) -> None:
        def done(payloads: dict[str, tuple[Any, ...]], missing: frozenset[str]) -> None:
            events: list[OffloadingEvent] = list(msg.events)
            for tier in self.tier_order:
                events.extend(self.gathers.take_late(tier))  # older than this answer's
                events.extend(payloads.get(tier, ()))
            msg.reply.set_result(events)

        self._gather(GatherKind.EVENTS, done)

    def _gather(self, what: GatherKind, on_done: GatherDone, *, drain_timeout_s: float | None = None,
                deadline: float | None = None, patient: bool = False) -> None:
        """One round through the tiers, ended by ``on_done``.

        The round ends once each tier answered or was found stuck, or once ``deadline``
        passed. The default deadline is ``transfer_timeout_s`` from now.
        A tier already stuck is not waited for, and it is in ``missing`` at once.
        It is sent only a shutdown, so that it shuts down if it ever moves again.
        A ``patient`` round has no deadline and waits for every tier, stuck or not.
        Its caller's own timeout bounds it (``wait_idle``).
        """
        stuck = () if patient else self._watch.stuck()
        gather = self.gathers.begin(what, on_done, waiting=(t for t in self.tier_order if t not in stuck),
                                    missing=stuck, patient=patient)
        now = self.runtime.now()
        probe = ("gather", gather.gather_id)
        for tier in self.tier_order:
            if tier in stuck and what != GatherKind.SHUTDOWN:
                continue
            self.tiers[tier].ref.tell(m.TierGather(gather.gather_id, what, drain_timeout_s))
            if tier not in stuck:
                self._watch.asked(tier, probe, now)
        if gather.waiting:  # each asked tier may be found stuck by now + transfer_timeout_s
            self.alarm.arm(now + self.transfer_timeout_s)
        if not gather.waiting:
            self._end_gather(gather)
            return
        due = None if patient else now + self.transfer_timeout_s if deadline is None else deadline
        self.gathers.wait(gather, due)
        if due is not None:
            self.alarm.arm(due)

    def _end_gather(self, gather: Gather[GatherDone]) -> None:
        if not self.gathers.end(gather):
            return  # ended already, by an earlier one's callback in the same tick (a stop's ends all)
        if gather.missing:
            self.counters.gathers_incomplete += 1
        gather.on_done(gather.payloads, frozenset(gather.missing))

    @handles(m.TierGathered)
    def _on_tier_gathered(self, msg: m.TierGathered) -> None:
        self._heard_from(msg.tier, ("gather", msg.gather_id))
        # Too late for its gather, its events go to the next take_events.
        gather = self.gathers.answered(msg.gather_id, msg.tier, msg.payload)
        if gather is not None:
            self._end_gather(gather)

    @handles(m.SupervisorBarrier)
    def _on_barrier(self, msg: m.SupervisorBarrier) -> None:
        self.barriers.add(msg.snapshot, msg.reply)

    def _start_due_barriers(self) -> None:
        """A round for each barrier that no job or lookup holds any more (:mod:`kvactors.core.barriers`)."""
        origins = [o for o in (self.jobs.oldest_origin(), self.lookups.oldest()) if o is not None]
        for reply in self.barriers.due(min(origins) if origins else None):
            # Hooks sent before now must be processed too, then the primary's
            # queue must pass the releases sent before now: a tier round, then the primary.
            # Patient: wait_idle's own timeout bounds its caller, and a tier found stuck
            # (perhaps only slow) that moves again passes the barrier and lets it say True.
            self._gather(GatherKind.BARRIER, functools.partial(self._finish_barrier, reply), patient=True)

    def _finish_barrier(self, reply: Reply[bool], payloads: object, missing: frozenset[str]) -> None:
        # A patient round misses a tier only when stop() cuts it short: not idle.
        self.primary.tell(m.BarrierFinal(reply, not missing))

    @handles(m.SupervisorStats)
    def _on_stats(self, msg: m.SupervisorStats) -> None:
        msg.reply.set_result(self._stats.stats(msg.primary, self.internal_errors, self.runtime.now()).as_dict())

    @handles(m.SupervisorMetrics)
    def _on_metrics(self, msg: m.SupervisorMetrics) -> None:
        msg.reply.set_result(self._stats.metrics(msg.primary, self.internal_errors, self.runtime.now()))

    @handles(m.SupervisorShutdown)
    def _on_shutdown(self, msg: m.SupervisorShutdown) -> None:
        deadline = self.shutdown.begin(msg.reply, self.runtime.now(), msg.budget_s)
        for pending in self.lookups.open_lookups():
            self._resolve_lookup(pending, promote=False)
        for ctx in self._drop_queued(DropReason.STOPPING):
            self._maybe_finalize_request(ctx)
        self.log.info("runtime_stopping", jobs_in_flight=self.jobs.in_flight(),
                      active_requests=len(self.table), budget_s=msg.budget_s,
                      tiers_stuck=",".join(self._watch.stuck()))
        self.alarm.arm(deadline)

    def _begin_shutdown_round(self) -> None:
        """The tiers' shutdown round, once the stop waits for nothing more (:mod:`kvactors.core.shutdown`)."""
        work_left = self.shutdown.phase is ShutdownPhase.DRAINING and bool(
            self.jobs.in_flight() or self.lookups.allocating())
        shutdown_round = self.shutdown.round_due(self.runtime.now(), work_left=work_left)
        if shutdown_round is not None:
            self._gather(GatherKind.SHUTDOWN, self._shut_down, drain_timeout_s=shutdown_round.drain_timeout_s,
                         deadline=shutdown_round.deadline)

    def _shut_down(self, payloads: object, missing: frozenset[str]) -> None:
        if missing:
            self.log.warning("tiers_not_shut_down", tiers=",".join(sorted(missing)))
        # Calls still waiting get their answer now, without the tiers that did not give it.
        for gather in self.gathers.open_gathers():
            self._end_gather(gather)
        self._answer_resets(self.resets.cut_short())
        for reply in self.barriers.cut_short():
            reply.set_result(False)
        self.shutdown.finish().set_result(None)
