"""The supervisor's rounds through the tiers, and its whole-runtime operations.

:class:`SupervisorRounds` is the base of
:class:`~kvactors.actors.supervisor.LifecycleSupervisor` (one actor, one
thread: no locks): the gathers (a round through every tier: events, barrier,
shutdown; their book is :class:`~kvactors.core.gathers.GatherBook`),
``wait_idle``'s barriers, ``reset_cache``, ``stats``/``metrics``, ``stop``,
and what a stuck tier means. The routing of facts, jobs and lookups is the
supervisor's.

Nothing here waits for a tier without a deadline
------------------------------------------------
A tier's actor may be stuck inside one of its plugin's calls for minutes. Every
round through the tiers (a *gather*: events, barrier, shutdown) and every
lookup therefore has a deadline, and a :class:`~kvactors.core.tierwatch.TierWatch`
keeps the books of what each tier owes: a tier that owes an answer and has
given none for ``transfer_timeout_s`` is *stuck* (``tier_stuck`` in the log,
``tiers_stuck`` and ``tier_stuck.<name>`` in the stats). A stuck tier is left
out of what waits on it: open gathers and lookups go on without it, later
ones do not wait for it at all (a caller polling ``take_events`` every step
pays nothing for it), its lookups are ``RETRY``, its queued jobs and new jobs
fail at once without being sent (no row is held for it), and the jobs it was
given time out as any other. Its hooks and finishes are still sent: the
contract holds at that tier too once it moves again. Its first answer is
``tier_unstuck``; its late answers are accounted for (events a late gather
brings are handed out by the next ``take_events``; late reports release
their rows as before).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvactors.actors import messages as m
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, handles
from kvactors.actors.secondary import TierLink
from kvactors.core import counters
from kvactors.core.gathers import Gather, GatherBook, GatherKind
from kvactors.core.jobbook import BookedJob, JobBook, Step
from kvactors.core.lifecycle import LifecycleTable, RequestState
from kvactors.core.lookupbook import LookupBook, PendingLookup
from kvactors.core.quarantine import PromotionQuarantine
from kvactors.core.tierwatch import TierWatch
from kvactors.types import LookupResult, OffloadingEvent, ReqContext

GatherDone = Callable[[dict[str, tuple[Any, ...]], frozenset[str]], None]
"""Called once a gather ends: the tiers' payloads, and the tiers that did not answer in time."""


@dataclass(slots=True)
class _ResetWait:
    """A ``reset_cache`` waiting for the jobs in flight at its start and one round through the tiers."""

    jobs: set[int]
    reply: Reply[None]
    gathered: bool = False


@dataclass(slots=True)
class _Shutdown:
    reply: Reply[None]
    deadline: float  # jobs still in flight then are timed out; the tiers' drain gets what is left
    gathering: bool = False
    expired: bool = False  # the deadline passed: nothing more is waited for before the tiers' round


SHUTDOWN_GRACE_S = 0.25
"""How long past the stop's deadline the tiers' shutdown round may take (a tier's
``shutdown()`` after a ``drain`` that used the whole budget)."""


class SupervisorRounds(Actor):
    """Rounds through the tiers and whole-runtime operations; see the module docstring.

    The state is the supervisor's (set in its ``__init__``); so are the few
    routing steps called from here, declared below."""

    tier_order: tuple[str, ...]
    tiers: dict[str, TierLink]
    primary: ActorRef
    table: LifecycleTable
    jobs: JobBook
    lookups: LookupBook[Reply[list[LookupResult]]]
    gathers: GatherBook[GatherDone]
    quarantine: PromotionQuarantine
    metrics: counters.JobCounters
    counters: dict[str, int]
    epoch: int
    stopping: bool
    transfer_timeout_s: float
    _watch: TierWatch
    _barriers: list[tuple[int, Reply[bool]]]
    _reset_waits: list[_ResetWait]
    _shutdown: _Shutdown | None
    _timer_due: float | None
    _shortest_timeout: float

    def _finalize(self, state: RequestState) -> None:
        raise NotImplementedError

    def _maybe_finalize_request(self, ctx: ReqContext) -> None:
        raise NotImplementedError

    def _drop_queued(self, reason: str, tiers: Sequence[str] | None = None) -> list[ReqContext]:
        raise NotImplementedError

    def _resolve_lookup(self, pending: PendingLookup[Reply[list[LookupResult]]], *, promote: bool = True) -> None:
        raise NotImplementedError

    def _take_steps(self, steps: Iterable[tuple[Step, BookedJob]]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ deadlines

    def _arm_timer(self, deadline: float | None = None) -> None:
        """Make sure a tick comes by every deadline in the books.

        ``deadline``: one just added to a book. Every deadline already there has a
        tick due by it, so a tick due by this one is all it needs: no book is read
        (this runs for every job sent). ``None``: after a tick, the next one is
        armed for the soonest deadline of all the books."""
        due = self._timer_due
        if deadline is not None:
            if due is not None and due <= deadline:
                return
        else:
            deadlines = [d for d in (self.jobs.next_deadline(), self.lookups.next_deadline(),
                                     self.gathers.next_deadline(), self._watch.next_deadline())
                         if d is not None]
            if self._shutdown is not None and not self._shutdown.gathering and not self._shutdown.expired:
                deadlines.append(self._shutdown.deadline)
            if not deadlines:
                return
            deadline = min(deadlines)
            if due is not None and due <= deadline:
                return
        self._timer_due = deadline
        self.runtime.call_later(deadline - self.runtime.now(), self.ref, m.Tick())

    @handles(m.Tick)
    def _on_tick(self, msg: m.Tick) -> None:
        self._timer_due = None
        now = self.runtime.now()
        for tier in self._watch.due(now):
            self._tier_stuck(tier, now)
        for gather in self.gathers.expire(now):
            self.log.warning("gather_timed_out", what=gather.what, tiers=",".join(sorted(gather.waiting)))
            self._end_gather(gather)
        steps = self.jobs.expire(now)
        if steps:
            self._take_steps(steps)
            self._check_barriers()
            self._check_shutdown()
        for pending in self.lookups.expire(now):
            self.counters["lookups_timed_out"] += 1
            self.log.warning("lookup_timed_out", req_id=pending.ctx.req_id, attempt=pending.ctx.attempt,
                             tiers=",".join(sorted(pending.waiting)))
            self._resolve_lookup(pending)
        shutdown = self._shutdown
        if shutdown is not None and not shutdown.gathering and not shutdown.expired and now >= shutdown.deadline:
            # The stop's budget is spent: what is still in flight fails now, as at its own deadline,
            # and promotions the primary has not allocated yet are not waited for. Every job is timed
            # out before the stop may go on: its answer lets stop() close the mailbox these tells use.
            self._take_steps(self.jobs.time_out_all(now))
            shutdown.expired = True
            self._check_barriers()
            self._check_shutdown()
        self._arm_timer()

    # ------------------------------------------------------------ stuck tiers

    def _tier_stuck(self, tier: str, now: float) -> None:
        """``tier`` owes answers and gave none for ``transfer_timeout_s``: go on without it."""
        self.log.warning("tier_stuck", tier=tier, silent_s=round(self._watch.silent_for(tier, now), 3),
                         owed=self._watch.owed(tier), jobs_in_flight=self.jobs.in_flight(tier))
        for gather in self.gathers.tier_stuck(tier):
            self._end_gather(gather)
        for pending in self.lookups.tier_stuck(tier):
            self._resolve_lookup(pending)
        for ctx in self._drop_queued("tier_stuck", (tier,)):
            self._maybe_finalize_request(ctx)
        self._check_barriers()
        self._check_shutdown()

    def _heard_from(self, tier: str, probe: tuple[str, int]) -> None:
        """An answer from ``tier``'s actor: it is moving."""
        silent = self._watch.answered(tier, probe, self.runtime.now())
        if silent is not None:
            self.log.warning("tier_unstuck", tier=tier, silent_s=round(silent, 3))

    # ------------------------------------------------------------ whole-runtime operations

    @handles(m.SupervisorReset)
    def _on_reset(self, msg: m.SupervisorReset) -> None:
        self.epoch += 1
        for pending in self.lookups.open_lookups():
            self._resolve_lookup(pending, promote=False)
        self._drop_queued("reset")
        for state in self.table.reset():
            self._finalize(state)
        in_flight = self.jobs.in_flight_ids()
        self.log.info("cache_reset_draining", jobs=len(in_flight), epoch=self.epoch)
        wait = _ResetWait(in_flight, msg.reply)
        self._reset_waits.append(wait)
        # A round through the tiers, at once (it ends by its deadline, as the jobs do by
        # theirs): when reset_cache returns, they have processed its finishes.
        self._gather(GatherKind.BARRIER, functools.partial(self._reset_gathered, wait))
        self._check_barriers()

    def _reset_gathered(self, wait: _ResetWait, payloads: object, missing: frozenset[str]) -> None:
        wait.gathered = True
        self._check_reset(wait)

    def _check_reset(self, wait: _ResetWait) -> None:
        if wait.gathered and not wait.jobs and wait in self._reset_waits:
            self._reset_waits.remove(wait)
            wait.reply.set_result(None)

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
        """One round through the tiers: ``on_done`` once each answered, or was found
        stuck, or ``deadline`` (default: ``transfer_timeout_s`` from now) passed.

        A tier already stuck is not waited for (it is in ``missing`` at once); it
        is sent only a shutdown (so that it shuts down if it ever moves again).
        ``patient``: no deadline, and every tier is waited for, stuck or not (a
        caller's own timeout bounds it: ``wait_idle``)."""
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
        if not gather.waiting:
            self._end_gather(gather)
            return
        due = None if patient else now + self.transfer_timeout_s if deadline is None else deadline
        self.gathers.wait(gather, due)
        if due is not None:
            self._arm_timer(due)

    def _end_gather(self, gather: Gather[GatherDone]) -> None:
        if not self.gathers.end(gather):
            return  # ended already, by an earlier one's callback in the same tick (a stop's ends all)
        if gather.missing:
            self.counters["gathers_incomplete"] += 1
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
        self._barriers.append((msg.snapshot, msg.reply))
        self._check_barriers()

    def _check_barriers(self) -> None:
        if not self._barriers:
            return
        origins = [o for o in (self.jobs.oldest_origin(), self.lookups.oldest()) if o is not None]
        oldest = min(origins) if origins else None
        ready = [b for b in self._barriers if oldest is None or oldest > b[0]]
        if not ready:
            return
        self._barriers = [b for b in self._barriers if b not in ready]
        for _, reply in ready:
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
        stats: dict[str, int | float] = dict(msg.stats)
        stats.update(self.counters)
        # The primary's records: from on_new_request to finalize (the supervisor's
        # table holds a request only from its first fact that needs it).
        stats["active_requests"] = int(stats.get("primary_requests", 0))
        stats["supervisor_requests"] = len(self.table)
        stats["requests_finished_pending"] = sum(1 for s in self.table.states() if s.is_finished)
        stats["jobs_in_flight"] = self.jobs.in_flight()
        stats["jobs_queued"] = self.jobs.queued()
        stats["jobs_awaiting_late_report"] = len(self.jobs.held())
        stats["promotions_quarantined"] = len(self.quarantine)
        stats["lookups_in_flight"] = len(self.lookups)
        stats["contract_violations"] = int(stats.pop("primary_violations", 0)) + self.counters["guard_violations"]
        stuck = self._watch.stuck()
        stats["tiers_stuck"] = len(stuck)
        stats["tiers_found_stuck"] = self._watch.found_stuck
        stats["tiers_recovered"] = self._watch.recovered
        now = self.runtime.now()
        for tier in self.tier_order:
            stats[f"tier_stuck.{tier}"] = int(tier in stuck)
            stats[f"tier_silent_s.{tier}"] = round(self._watch.silent_for(tier, now), 6)
        stats["internal_errors"] = int(stats.pop("primary_internal_errors", 0)) + self.internal_errors
        msg.reply.set_result(stats)

    @handles(m.SupervisorMetrics)
    def _on_metrics(self, msg: m.SupervisorMetrics) -> None:
        def done(stats: Reply[dict[str, int | float]]) -> None:
            error = stats.exception()
            if error is not None:
                msg.reply.set_exception(error)
            else:
                msg.reply.set_result(counters.snapshot(msg.counters, msg.pool_blocks, msg.evicted_keys, self.metrics,
                                                       stats.result(), queued, in_flight))

        queued = self.jobs.queued_by_tier()
        in_flight = self.jobs.in_flight_by_tier()
        # Answered already (stats is synchronous here); a callback keeps it right if it ever is not.
        msg.stats.add_done_callback(done)

    @handles(m.SupervisorShutdown)
    def _on_shutdown(self, msg: m.SupervisorShutdown) -> None:
        self.stopping = True
        deadline = self.runtime.now() + msg.budget_s
        self._shutdown = _Shutdown(msg.reply, deadline)
        for pending in self.lookups.open_lookups():
            self._resolve_lookup(pending, promote=False)
        for ctx in self._drop_queued("stopping"):
            self._maybe_finalize_request(ctx)
        self.log.info("runtime_stopping", jobs_in_flight=self.jobs.in_flight(),
                      active_requests=len(self.table), budget_s=msg.budget_s,
                      tiers_stuck=",".join(self._watch.stuck()))
        self._arm_timer(deadline)
        self._check_shutdown()

    def _check_shutdown(self) -> None:
        shutdown = self._shutdown
        if shutdown is None or shutdown.gathering:
            return
        if not shutdown.expired and (self.jobs.in_flight() or self.lookups.allocating()):
            return
        shutdown.gathering = True
        remaining = max(shutdown.deadline - self.runtime.now(), 0.0)
        self._gather(GatherKind.SHUTDOWN, self._shut_down, drain_timeout_s=remaining,
                     deadline=shutdown.deadline + SHUTDOWN_GRACE_S)

    def _shut_down(self, payloads: object, missing: frozenset[str]) -> None:
        assert self._shutdown is not None
        if missing:
            self.log.warning("tiers_not_shut_down", tiers=",".join(sorted(missing)))
        # Calls still waiting get their answer now, without the tiers that did not give it.
        for gather in self.gathers.open_gathers():
            self._end_gather(gather)
        for wait in list(self._reset_waits):
            wait.jobs.clear()
            self._check_reset(wait)
        for _, reply in self._barriers:
            reply.set_result(False)
        self._barriers.clear()
        self._shutdown.reply.set_result(None)
