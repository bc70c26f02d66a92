"""The primary tier actor owns the CPU block pool and is the frontend's door.

Every public call of :class:`~kvactors.TieringManager` arrives here first, in
the order each frontend thread made it. The primary owns the
:class:`~kvactors.core.pool.BlockPool` and a small record per live request
attempt. That is enough to enforce the contract at this layer.

* A submit call (``lookup``, ``prepare_load``, ``prepare_store``) for an
  unknown or finished request raises :class:`LifecycleError` to its caller and
  changes nothing. It is never a ``KeyError`` deep in the runtime (vLLM #49635).
* ``on_request_finished`` takes effect here at once (rule 3).
* Completions may arrive after it and are always accounted for.

The primary tells the supervisor, as facts, what the secondary tiers must learn.
It tells them in the order it processed them.

* A request started.
* Stores completed, with the cascade jobs whose rows it pinned.
* The request finished, with the number of its stores still pending.
* After the finish, every completion or deadline that ends one of those.

The supervisor decides everything else.

"A request started" is a message of its own only when some tier wants the
``on_new_request`` hook. Otherwise the supervisor first hears of a request
with its first other fact (a secondary lookup, completed stores or the
finish), flagged ``opens``. A request that never needs the supervisor before
its finish therefore costs it no message.

The primary's deadlines (its stores' and its reservations') wake it by a tick
that :class:`~kvactors.core.alarm.Alarm` arms. After each tick, :meth:`PrimaryTier.settle`
arms the next one.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeAlias

from kvactors.actors import messages as m
from kvactors.actors.runtime import Actor, ActorRef, handles
from kvactors.core.admission import WRITE_THROUGH, Admission, SeenTable, seen_table_size
from kvactors.core.alarm import Alarm
from kvactors.core.backpressure import Backpressure
from kvactors.core.counters import PrimaryCounters, PrimaryFigures
from kvactors.core.deadlines import DeadlineQueue
from kvactors.core.errors import LifecycleError
from kvactors.core.events import EventBuffer, warn_on_overflow
from kvactors.core.policies import make_policy
from kvactors.core.pool import BlockPool, PoolError
from kvactors.core.request_params import parse_request_params
from kvactors.core.reservations import Reservations, reservation_owner
from kvactors.core.snapshot import ControlFigures
from kvactors.logs import EventLogger
from kvactors.types import (
    PRIMARY_TIER_NAME,
    LoadStoreSpec,
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferJob,
)

StoreDeadline: TypeAlias = tuple[ReqContext, tuple[OffloadKey, ...], int]
"""A store's entry in the deadline queue: its request, its keys, its store id."""


class _RequestRecord:
    """What the primary keeps per request attempt, until the supervisor finalizes it.

    ``pending_stores`` counts the keys the request prepared whose write is still
    live (not completed, not past its deadline, not voided by a reset).
    ``store_of`` maps each of those keys to the id of the store that prepared it.
    A store's deadline therefore only ever times out that store's own writes.
    ``store_deadlines`` holds the deadline entries of this request's stores, by
    store id. They are withdrawn once no write of the request is pending. They
    would time out nothing then, and held they would keep every store's keys for
    the whole timeout.
    """

    __slots__ = ("announced", "ctx", "finished", "pending_stores", "store_deadlines", "store_of")

    def __init__(self, ctx: ReqContext) -> None:
        self.ctx = ctx
        self.finished = False
        self.pending_stores = 0
        self.store_of: dict[OffloadKey, int] = {}
        self.store_deadlines: dict[int, StoreDeadline] = {}
        self.announced = False  # the supervisor has heard of this request

    def opens(self) -> bool:
        """Whether the next fact about this request is the supervisor's first."""
        if self.announced:
            return False
        self.announced = True
        return True


class PrimaryTier(Actor):
    """The primary tier's logic. It runs on one actor, one handler at a time (see the module docstring)."""

    name = "primary"

    def __init__(
        self,
        *,
        supervisor: ActorRef,
        num_blocks: int,
        eviction: str,
        tier_names: Sequence[str],
        transfer_timeout_s: float,
        work_ids: itertools.count[int],
        forget: Callable[[tuple[str, int]], None] | None = None,
        announce_starts: bool = True,
        reserve_s: float = 5.0,
        log: EventLogger | None = None,
        block_bytes: int = 1,
        admission: Mapping[str, Admission] | None = None,
        max_queued_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """``supervisor`` is where the facts go.

        ``forget(identity)`` is called by a handler once a request's record is gone.
        It runs on whatever thread runs that handler.
        """
        if log is not None:
            self.log = log
        self.pool = BlockPool(num_blocks, make_policy(eviction, num_blocks), on_events_dropped=self._events_dropped)
        self.tier_names = tuple(tier_names)
        self.announce_starts = announce_starts
        self.transfer_timeout_s = transfer_timeout_s
        self.work_ids = work_ids
        self.supervisor = supervisor
        self.counters = PrimaryCounters()  # stats() and metrics derive from these
        self._requests: dict[tuple[str, int], _RequestRecord] = {}
        # One deadline per prepare_store call: its keys that are still pending when it passes expire.
        # (request, keys, store id): a store's keys and the id it was prepared under.
        self._store_deadlines: DeadlineQueue[StoreDeadline] = DeadlineQueue()
        self._store_ids = itertools.count(1)
        # Blocks kept for the request that waits for them (kvactors.core.reservations), for reserve_s
        # (the lookup deadline) at most; and the request each promotion in flight was started for.
        self.reserve_s = reserve_s
        self._reservations = Reservations()
        self._promoting: dict[int, tuple[str, int]] = {}
        self.alarm = Alarm(self._wake_at)
        self._forget = forget
        # Admission and back-pressure (kvactors.core.admission, kvactors.core.backpressure; docs/controls.md).
        self.block_bytes = block_bytes
        admission = dict(admission or {})
        self.admission = {tier: admission.get(tier, WRITE_THROUGH) for tier in self.tier_names}
        limits = dict(max_queued_bytes or {})
        self.backpressure = Backpressure({tier: limits.get(tier, 1 << 62) for tier in self.tier_names})
        cap = max((a.min_seen for a in self.admission.values() if a.mode == "min_seen"), default=0)
        self._seen = SeenTable(seen_table_size(num_blocks), cap) if cap else None
        self._min_seen = tuple((tier, a.min_seen) for tier, a in self.admission.items() if a.mode == "min_seen")
        self._through = tuple(tier for tier, a in self.admission.items() if a.mode == "write_through")
        # Per write-back tier: ready blocks stored here and not yet sent to it (a subset of the pool's
        # keys, pruned to them when it grows past twice the pool).
        self._unwritten: dict[str, set[OffloadKey]] = {
            tier: set() for tier, a in self.admission.items() if a.mode == "write_back"}
        self._write_backs = 0
        self._write_backs_dropped = 0  # blocks evicted unwritten: their write-back was dropped
        self._write_back_rows: dict[int, int] = {}  # write-back job id -> its blocks, until it ends
        self._write_back_cap = max(num_blocks // 2, 1)  # blocks pinned by write-backs, at most

    # ------------------------------------------------------------ helpers

    def _require_active(self, ctx: ReqContext, call: str) -> _RequestRecord:
        record = self._requests.get(ctx.identity)
        if record is None:
            self.log.info("call_rejected", call=call, req_id=ctx.req_id, attempt=ctx.attempt, reason="unknown")
            raise LifecycleError(f"{call}: request {ctx} is unknown (never started, or already finalized)")
        if record.finished:
            self.log.info("call_rejected", call=call, req_id=ctx.req_id, attempt=ctx.attempt, reason="finished")
            raise LifecycleError(f"{call}: request {ctx} is finished; no submit call may follow on_request_finished")
        return record

    def _violation(self, call: str, ctx: ReqContext, reason: str) -> None:
        """Misuse in a call that cannot raise to its caller is logged and counted, and changes nothing."""
        self.counters.contract_violations += 1
        self.log.warning(
            "contract_violation", call=call, req_id=ctx.req_id, attempt=ctx.attempt, reason=reason,
            tier=PRIMARY_TIER_NAME
        )

    def _wake_at(self, deadline: float) -> None:
        """The alarm's wake-up, a tick to this actor at ``deadline``."""
        self.runtime.call_later(deadline - self.runtime.now(), self.ref, m.Tick())

    def settle(self) -> None:
        """After a tick, once its consequences are in the books, the alarm is armed for the next deadline."""
        if self.alarm.fired:
            self.alarm.rearm((self._store_deadlines.next_deadline(), self._reservations.next_deadline()))

    # ------------------------------------------------------------ request lifecycle

    @handles(m.NewRequest)
    def _on_new_request(self, msg: m.NewRequest) -> None:
        ctx = msg.ctx
        record = self._requests.get(ctx.identity)
        if record is not None:
            # The facade refuses duplicates before they are sent: its registry is out of step.
            state = "finishing" if record.finished else "active"
            self.internal_errors += 1
            self.log.error("invariant_broken", req_id=ctx.req_id, attempt=ctx.attempt,
                           error=f"on_new_request for a request already {state}")
            return
        record = self._requests[ctx.identity] = _RequestRecord(ctx)
        if ctx.params:
            for param, reason in parse_request_params(ctx.params).ignored:
                self.log.warning("request_param_ignored", req_id=ctx.req_id, attempt=ctx.attempt, param=param,
                                 reason=reason)
        if self.tracing:
            self.log.debug("request_started", req_id=ctx.req_id, attempt=ctx.attempt)
        if self.announce_starts:
            record.announced = True
            self.supervisor.tell(m.RequestStarted(ctx))

    @handles(m.FinishRequest)
    def _on_finish_request(self, msg: m.FinishRequest) -> None:
        ctx = msg.ctx
        record = self._requests.get(ctx.identity)
        if record is None or record.finished:
            # Idempotent: a repeated finish, or one for a request already finalized.
            if self.tracing:
                self.log.debug("finish_ignored", req_id=ctx.req_id, attempt=ctx.attempt, known=record is not None)
            return
        record.finished = True
        self._end_reservations(ctx.identity, self._reservations.release_all(ctx.identity))
        # Logged before the tell: the supervisor's finalize events must come after it in the log.
        if self.tracing:
            self.log.debug("request_finished", req_id=ctx.req_id, attempt=ctx.attempt, tier=PRIMARY_TIER_NAME,
                           pending_stores=record.pending_stores)
        self.supervisor.tell(m.RequestFinished(ctx, record.pending_stores, record.opens()))

    @handles(m.RequestFinalized)
    def _on_request_finalized(self, msg: m.RequestFinalized) -> None:
        identity = msg.ctx.identity
        # The record goes first: a new lifetime the facade admits next must find none.
        if self._requests.pop(identity, None) is not None and self._forget is not None:
            self._forget(identity)

    # ------------------------------------------------------------ lookups and loads

    @handles(m.Lookup)
    def _on_lookup(self, msg: m.Lookup) -> None:
        record = self._require_active(msg.ctx, "lookup")
        results = self.pool.lookup(msg.keys)
        self.counters.lookup(results)
        if self._seen is not None:
            self._admit_seen(msg.ctx, record, msg.keys)
        miss = LookupResult.MISS
        missing = tuple([i for i, result in enumerate(results) if result is miss])
        if missing and self.tier_names:
            lookup_id = next(self.work_ids)
            self.supervisor.tell(m.SecondaryLookup(lookup_id, msg.ctx, msg.keys, missing, tuple(results), msg.reply,
                                                   record.opens()))
            return
        msg.reply.set_result(results)

    @handles(m.PrepareLoad)
    def _on_prepare_load(self, msg: m.PrepareLoad) -> None:
        ctx = msg.ctx
        self._require_active(ctx, "prepare_load")
        try:
            rows = self.pool.pin_for_load(msg.keys, ctx.identity)
        except PoolError as exc:
            raise LifecycleError(f"prepare_load: {exc}") from None
        if self._reservations:  # the load pins protect the keys now
            self._end_reservations(ctx.identity, self._reservations.release(ctx.identity, msg.keys))
        if self.tracing:
            self.log.debug("load_prepared", req_id=ctx.req_id, attempt=ctx.attempt, keys=len(rows),
                           tier=PRIMARY_TIER_NAME)
        msg.reply.set_result(LoadStoreSpec(rows))

    @handles(m.CompleteLoad)
    def _on_complete_load(self, msg: m.CompleteLoad) -> None:
        ctx = msg.ctx
        try:
            self.pool.unpin_load(msg.keys, ctx.identity)
        except PoolError as exc:
            self._violation("complete_load", ctx, str(exc))
            return
        self.counters.load_ok += 1
        self.counters.loaded_blocks += len(msg.keys)
        if self.tracing:
            self.log.debug("load_completed", req_id=ctx.req_id, attempt=ctx.attempt, keys=len(msg.keys),
                           tier=PRIMARY_TIER_NAME)

    @handles(m.Touch)
    def _on_touch(self, msg: m.Touch) -> None:
        self.pool.touch(msg.keys)
        if self.tier_names:
            self.supervisor.tell(m.TouchTiers(msg.keys, msg.ctx))

    # ------------------------------------------------------------ stores

    @handles(m.PrepareStore)
    def _on_prepare_store(self, msg: m.PrepareStore) -> None:
        ctx = msg.ctx
        record = self._require_active(ctx, "prepare_store")
        if self._unwritten:
            self._write_back(ctx, record, msg.keys)
        plan = self.pool.prepare_store(msg.keys, ctx.identity)
        if plan is None:
            if self.tracing:
                self.log.debug("store_rejected", req_id=ctx.req_id, attempt=ctx.attempt, keys=len(msg.keys),
                               tier=PRIMARY_TIER_NAME)
            msg.reply.set_result(None)
            return
        if self.tracing:
            self.log.debug("store_prepared", req_id=ctx.req_id, attempt=ctx.attempt, keys=len(plan.keys),
                           evicted=len(plan.evicted), tier=PRIMARY_TIER_NAME)
        if plan.keys:
            # The supervisor learns the count with the finish: before it, nothing can finalize.
            record.pending_stores += len(plan.keys)
            store_id = next(self._store_ids)
            record.store_of.update(dict.fromkeys(plan.keys, store_id))
            deadline = self.runtime.now() + self.transfer_timeout_s
            entry = record.store_deadlines[store_id] = (ctx, plan.keys, store_id)
            self._store_deadlines.add(entry, deadline)
            self.alarm.arm(deadline)
        msg.reply.set_result(PrepareStoreOutput(list(plan.keys), LoadStoreSpec(plan.rows), list(plan.evicted)))

    @handles(m.CompleteStore)
    def _on_complete_store(self, msg: m.CompleteStore) -> None:
        ctx = msg.ctx
        identity = ctx.identity
        try:
            outcome = self.pool.complete_store(msg.keys, identity, msg.success)
        except PoolError as exc:
            self._violation("complete_store", ctx, str(exc))
            return
        if self.tracing:
            self.log.debug(
                "store_completed",
                req_id=ctx.req_id,
                attempt=ctx.attempt,
                keys=len(msg.keys),
                live=outcome.live,
                stale=outcome.stale,
                success=msg.success,
                stored=len(outcome.stored),
                tier=PRIMARY_TIER_NAME,
            )
        if outcome.live == 0:
            return  # only late completions of detached writes: nothing left to count
        if msg.success:
            self.counters.store_ok += 1
            self.counters.stored_blocks += len(outcome.stored)
        else:
            self.counters.store_failed += 1
        record = self._requests.get(identity)
        if record is not None:
            record.pending_stores -= outcome.live
            pop = record.store_of.pop
            if not self.pool.rewriting(identity):
                for key in msg.keys:  # the writer's one pending write of each key ended
                    pop(key, None)
            else:  # a key written again may still have its live write pending: its deadline stays
                writing = self.pool.has_pending_write
                for key in msg.keys:
                    if not writing(identity, key):
                        pop(key, None)
            if not record.store_of and record.store_deadlines:
                self._withdraw_store_deadlines(record)
        cascades = self._cascades_on_store(ctx, outcome.stored) if outcome.stored else []
        if cascades or (record is not None and record.finished):
            opens = record is not None and record.opens()
            self.supervisor.tell(m.StoresCompleted(ctx, outcome.live, tuple(cascades), opens))

    def _withdraw_store_deadlines(self, record: _RequestRecord) -> None:
        """Drop the deadlines of ``record``'s stores, since no write of its request is pending.

        They would time out nothing.
        """
        discard = self._store_deadlines.discard
        for entry in record.store_deadlines.values():
            discard(entry)
        record.store_deadlines.clear()

    # ------------------------------------------------------------ admission and back-pressure

    def _cascade(self, tier: str, keys: tuple[OffloadKey, ...], ctx: ReqContext,
                 admitted: str | None = None) -> m.CascadeJob | None:
        """A cascade of the ready ``keys`` to ``tier`` on behalf of ``ctx``, with its rows pinned.

        ``None`` when back-pressure drops it. The blocks then stay in the pool, and nothing is pinned.
        ``admitted`` says why a cascade that no store of ``ctx`` owes is sent (``min_seen``,
        ``write_back``). ``None`` means it is its completed store's cascade. Such a cascade is
        traced as ``cascade_skipped`` when dropped, for ``kvactors check-log``.
        """
        job_id = next(self.work_ids)
        verdict = self.backpressure.admit(tier, job_id, len(keys) * self.block_bytes, len(keys))
        if verdict.started:
            self.log.warning("cascades_dropped", tier=tier, queued_bytes=self.backpressure.queued(tier),
                             max_queued_bytes=self.backpressure.limits[tier], req_id=ctx.req_id, attempt=ctx.attempt)
        elif verdict.resumed:
            self.log.info("cascades_resumed", tier=tier, dropped=verdict.episode_dropped,
                          queued_bytes=self.backpressure.queued(tier))
        if not verdict.accepted:
            if self.tracing and admitted is None:
                self.log.debug("cascade_skipped", req_id=ctx.req_id, attempt=ctx.attempt, tier=tier,
                               reason="backpressure")
            return None
        if self.tracing and admitted is not None:
            self.log.debug("cascade_admitted", req_id=ctx.req_id, attempt=ctx.attempt, tier=tier, reason=admitted,
                           job_id=job_id, keys=len(keys))
        rows = self.pool.pin_for_job(job_id, keys)
        return m.CascadeJob(tier, TransferJob(job_id, keys, rows, ctx, False))

    def _cascades_on_store(self, ctx: ReqContext, stored: tuple[OffloadKey, ...]) -> list[m.CascadeJob]:
        """The cascades a completed store starts, tier by tier, as each tier's admission says."""
        cascades = []
        for tier in self._through:
            job = self._cascade(tier, stored, ctx)
            if job is not None:
                cascades.append(job)
        if self._seen is not None:
            seen = self._seen
            for tier, n in self._min_seen:
                keys = tuple(key for key in stored if seen.count(key) >= n and not seen.sent(key, tier))
                if not keys and self.tracing:
                    self.log.debug("cascade_skipped", req_id=ctx.req_id, attempt=ctx.attempt, tier=tier,
                                   reason="admission")
                if keys:
                    for key in keys:
                        seen.mark(key, tier)
                    job = self._cascade(tier, keys, ctx)
                    if job is not None:
                        cascades.append(job)
        for tier, unwritten in self._unwritten.items():
            if self.tracing:
                self.log.debug("cascade_skipped", req_id=ctx.req_id, attempt=ctx.attempt, tier=tier,
                               reason="admission")
            unwritten.update(stored)
            if len(unwritten) > 2 * self.pool.num_blocks:  # evicted keys linger: keep the pool's only
                row_of = self.pool.row_of
                unwritten.intersection_update([key for key in unwritten if row_of(key) is not None])
        return cascades

    def _admit_seen(self, ctx: ReqContext, record: _RequestRecord, keys: Iterable[OffloadKey]) -> None:
        """Count a lookup by ``ctx``, and send the ready blocks it brought to ``min_seen`` to their tiers."""
        assert self._seen is not None
        seen = self._seen
        counts = seen.see(keys, ctx.req_id)
        cascades = []
        is_ready = self.pool.is_ready
        for tier, n in self._min_seen:
            due = tuple(key for key, count in counts if count >= n and not seen.sent(key, tier) and is_ready(key))
            if due:
                for key in due:
                    seen.mark(key, tier)
                job = self._cascade(tier, due, ctx, "min_seen")
                if job is not None:
                    cascades.append(job)
        if cascades:
            # Before the request's finish (a lookup needs it active): the supervisor counts these jobs
            # for it, so its on_request_finished at each tier comes after them.
            self.supervisor.tell(m.StoresCompleted(ctx, 0, tuple(cascades), record.opens()))

    def _write_back(self, ctx: ReqContext, record: _RequestRecord, keys: tuple[OffloadKey, ...]) -> None:
        """Send the blocks ``ctx``'s store would evict to the write-back tiers that lack them.

        This runs before the store evicts. The blocks go on behalf of ``ctx``, the evicting
        request. Their rows are pinned by the job, so the store evicts other blocks. Those may
        need writing back too, so the pool is asked again until none does. A write-back is not
        retried when back-pressure drops it, or when it would make write-backs pin more than
        half the pool. Its block is then evicted unwritten. A pool whose unwritten blocks all
        stayed would cache nothing new while its tier is slow.
        """
        cascades = []
        pinned = sum(self._write_back_rows.values())
        while True:
            candidates = self.pool.eviction_candidates(keys)
            due = {tier: tuple(key for key in candidates if key in unwritten)
                   for tier, unwritten in self._unwritten.items()}
            if not any(due.values()):
                break
            for tier, tier_keys in due.items():
                if not tier_keys:
                    continue
                self._unwritten[tier].difference_update(tier_keys)
                job = None
                if pinned + len(tier_keys) <= self._write_back_cap:
                    job = self._cascade(tier, tier_keys, ctx, "write_back")
                if job is None:
                    self._write_backs_dropped += len(tier_keys)
                    continue
                self._write_backs += 1
                self._write_back_rows[job.job.job_id] = len(tier_keys)
                pinned += len(tier_keys)
                cascades.append(job)
        if cascades:
            self.supervisor.tell(m.StoresCompleted(ctx, 0, tuple(cascades), record.opens()))

    def controls_figures(self) -> ControlFigures:
        """The figures of admission and back-pressure (their ``stats()`` keys are in docs/controls.md)."""
        row_of = self.pool.row_of
        return ControlFigures(
            cascades=self.backpressure.figures(self.tier_names),
            write_back_jobs=self._write_backs,
            write_backs_pending=len(self._write_back_rows),
            write_back_blocks_dropped=self._write_backs_dropped,
            blocks_unwritten=sum(sum(1 for key in unwritten if row_of(key) is not None)
                                 for unwritten in self._unwritten.values()),
            seen_keys=len(self._seen) if self._seen is not None else 0,
            cascade_jobs_queued=self.backpressure.jobs(),
        )

    @handles(m.Tick)
    def _on_tick(self, msg: m.Tick) -> None:
        self.alarm.fire()  # settle arms the next tick
        # An entry a book gives up here is acted on here only: one that raises must not drop the others.
        self.each_contained(self._reservations.expire(self.runtime.now()),
                            lambda expired_reservation: self._end_reservations(*expired_reservation), "Tick")
        expired: Counter[ReqContext] = Counter()
        failed = self.each_contained(self._store_deadlines.pop_expired(self.runtime.now()),
                                     lambda entry: self._expire_store(entry, expired), "Tick")
        # Its writes would stay pending for good: tried again a timeout later, each failure counted.
        for entry in failed:
            self._store_deadlines.add(entry, self.runtime.now() + self.transfer_timeout_s)
        self.each_contained(expired.items(), lambda timed_out: self._stores_timed_out(*timed_out), "Tick")

    def _expire_store(self, entry: StoreDeadline, expired: Counter[ReqContext]) -> None:
        """A store's deadline passed: its writes still pending are detached, their rows held for their writer.

        The count of keys detached is added to ``expired``.
        The detach comes first, so a failure leaves the store's books as they were, to be tried again.
        """
        ctx, keys, store_id = entry
        live = self._requests.get(ctx.identity)
        if live is not None:
            # Only this store's own writes still pending: a key it failed or completed may
            # be written again by a later store of the request, under that store's deadline.
            of = live.store_of
            keys = tuple(key for key in keys if of.get(key) == store_id)
        detached = self.pool.detach_writes(ctx.identity, keys)
        if live is not None:
            live.store_deadlines.pop(store_id, None)  # withdrawn already if popped with an earlier one
            for key in keys:
                del of[key]
            if not of and live.store_deadlines:  # its last pending writes timed out here
                self._withdraw_store_deadlines(live)
        expired[ctx] += detached
        self.counters.store_timed_out += detached > 0
        self.counters.store_keys_timed_out += detached

    def _stores_timed_out(self, ctx: ReqContext, count: int) -> None:
        """``count`` of the request's keys timed out at this tick: they no longer count as its pending stores."""
        if not count:
            return  # every key of that store completed in time
        self.log.warning(
            "job_timed_out", kind="store", req_id=ctx.req_id, attempt=ctx.attempt, keys=count,
            tier=PRIMARY_TIER_NAME
        )
        record = self._requests.get(ctx.identity)
        if record is not None:
            record.pending_stores -= count
            if record.finished:
                self.supervisor.tell(m.StoresExpired(ctx, count))

    # ------------------------------------------------------------ promotions and jobs

    @handles(m.AllocatePromotions)
    def _on_allocate_promotions(self, msg: m.AllocatePromotions) -> None:
        """Start the promotions of a lookup that fit the pool now, in key order, and answer it.

        A promotion the pool cannot hold now (every row pending, pinned, held or
        reserved) is not started. Its key and every key after it are a ``MISS``.
        The request computes them instead of waiting for room, so no request ever
        waits for part of the pool while holding another part. When promotions
        start, the request's ready keys before the first miss are reserved for it
        with them (:mod:`kvactors.core.reservations`). They are reserved before the
        rows are allocated, so the request's own promotions never evict them.
        """
        ctx = msg.ctx
        identity = ctx.identity
        first = {key: n for n, key in reversed(list(enumerate(msg.keys)))}
        # The lookup's ready keys, held while its promotions are allocated; those past the first
        # miss, or all of them if nothing is promoted, are let go at the end.
        ready = [key for key in first if self.pool.is_ready(key)]
        held = self._reserve(identity, ready)
        cut = len(msg.keys)  # the first key not served: it and the keys after it are a MISS
        answer: dict[OffloadKey, LookupResult] = {}
        jobs = []
        for tier, keys in sorted(msg.plan, key=lambda entry: first[entry[1][0]]):
            absent = tuple(dict.fromkeys(key for key in keys if first[key] < cut and self.pool.row_of(key) is None))
            present = [key for key in keys if self.pool.row_of(key) is not None]  # promoted or stored meanwhile
            for key, result in zip(present, self.pool.lookup(present), strict=True):
                answer[key] = result
            if self._unwritten and absent:  # what the promotion would evict goes to its write-back tiers first
                record = self._requests.get(identity)
                if record is not None:
                    self._write_back(ctx, record, absent)
            granted = absent[:self.pool.room()]
            if len(granted) < len(absent):
                cut = min(cut, first[absent[len(granted)]])
            if not granted:
                continue
            job_id = next(self.work_ids)
            rows = self.pool.allocate_promotion(job_id, granted)
            assert rows is not None, "room() counted the rows, and the keys are absent"
            self._promoting[job_id] = identity
            answer.update(dict.fromkeys(granted, LookupResult.HIT_PENDING))
            jobs.append(m.CascadeJob(tier, TransferJob(job_id, granted, rows, ctx, True)))
            if self.tracing:
                self.log.debug("promotion_allocated", job_id=job_id, tier=tier, keys=len(granted), epoch=msg.epoch,
                               req_id=ctx.req_id, attempt=ctx.attempt)
        let_go = [key for key in held if not jobs or first[key] >= cut]
        self._end_reservations(identity, self._reservations.release(identity, let_go))
        hit, miss = LookupResult.HIT, LookupResult.MISS
        for key, result in zip(msg.keys, msg.results, strict=True):
            if result is hit and key not in answer and not self.pool.is_ready(key):
                answer[key] = self.pool.lookup([key])[0]  # evicted since the pool answered
        results = [miss if n >= cut else answer.get(key, result)
                   for n, (key, result) in enumerate(zip(msg.keys, msg.results, strict=True))]
        if cut < len(msg.keys):
            self.counters.promotions_refused += 1
        self.supervisor.tell(m.PromotionsAllocated(msg.lookup_id, ctx, msg.epoch, tuple(jobs)))
        msg.reply.set_result(results)

    def _reserve(self, identity: tuple[str, int], keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Keep the ready ``keys`` for a live request until it loads them, finishes, or ``reserve_s`` passes.

        Returns the keys it did not hold already.
        """
        record = self._requests.get(identity)
        if record is None or record.finished:
            return []
        ready = [key for key in keys if self.pool.is_ready(key)]
        deadline = self.runtime.now() + self.reserve_s
        new = self._reservations.grant(identity, ready, deadline)
        if new:
            self.pool.pin_for_load(new, reservation_owner(identity))
            self.alarm.arm(deadline)
        return new

    def _end_reservations(self, identity: tuple[str, int], keys: Sequence[OffloadKey]) -> None:
        if keys:
            self.pool.unpin_load(keys, reservation_owner(identity))

    @handles(m.JobEnded)
    def _on_job_ended(self, msg: m.JobEnded) -> None:
        observer = self._job_observer
        promoted = self.pool.promotion_rows(msg.job_id) if observer is not None and msg.is_promotion else ()
        if msg.is_promotion:
            requester = self._promoting.pop(msg.job_id, None)
            ready = self.pool.end_promotion(msg.job_id, success=msg.success, hold=msg.hold, ok_keys=msg.ok_keys)
            if ready and requester is not None:
                self._reserve(requester, ready)
        else:
            self.pool.end_job(msg.job_id, hold=msg.hold)
            self.backpressure.ended(msg.job_id)
            self._write_back_rows.pop(msg.job_id, None)
        if observer is not None:
            observer(msg, promoted)

    @handles(m.HoldReleased)
    def _on_hold_released(self, msg: m.HoldReleased) -> None:
        self.pool.release_hold(msg.job_id)

    # ------------------------------------------------------------ whole-runtime calls

    @handles(m.ResetCache)
    def _on_reset_cache(self, msg: m.ResetCache) -> None:
        for identity, keys in self._reservations.clear():
            self._end_reservations(identity, keys)
        removed = self.pool.reset()
        for unwritten in self._unwritten.values():
            unwritten.clear()  # nothing of the pool is left to write back
        # Detached writes are stale now; their late completions only free rows.
        self._store_deadlines.clear()
        for record in self._requests.values():
            record.pending_stores = 0
            record.store_of.clear()
            record.store_deadlines.clear()
        self.log.info("cache_reset", tier=PRIMARY_TIER_NAME, keys=removed)
        self.supervisor.tell(m.SupervisorReset(msg.reply))

    @handles(m.TakeEvents)
    def _on_take_events(self, msg: m.TakeEvents) -> None:
        self.supervisor.tell(m.CollectEvents(tuple(self.pool.take_events()), msg.reply))

    @handles(m.Barrier)
    def _on_barrier(self, msg: m.Barrier) -> None:
        self.supervisor.tell(m.SupervisorBarrier(next(self.work_ids), msg.reply))

    @handles(m.BarrierFinal)
    def _on_barrier_final(self, msg: m.BarrierFinal) -> None:
        msg.reply.set_result(msg.idle)

    def _events_dropped(self, buffer: EventBuffer) -> None:
        warn_on_overflow(self.log, pool=True)(buffer)  # self.log is set after __init__

    def _figures(self) -> PrimaryFigures:
        """This actor's part of stats() and of the metrics, copied now."""
        pool = self.pool
        return PrimaryFigures(self.counters.copy(), pool.figures(), pool.state_counts(), pool.evicted_keys,
                              pool.event_keys_dropped, len(self._requests), len(self._reservations),
                              self.internal_errors, self.controls_figures())

    @handles(m.QueryStats)
    def _on_query_stats(self, msg: m.QueryStats) -> None:
        self.supervisor.tell(m.SupervisorStats(self._figures(), msg.reply))

    @handles(m.QueryMetrics)
    def _on_query_metrics(self, msg: m.QueryMetrics) -> None:
        self.supervisor.tell(m.SupervisorMetrics(self._figures(), msg.reply))

    def on_stop(self) -> None:
        # The roll call check-log needs at the stop: every request this actor still holds. Without it a
        # log whose finish events were lost would pass for one of requests the caller never finished.
        if self.tracing:
            for record in self._requests.values():
                self.log.debug("request_active_at_stop", req_id=record.ctx.req_id, attempt=record.ctx.attempt,
                               finished=record.finished, pending_stores=record.pending_stores)

    @handles(m.Shutdown)
    def _on_shutdown(self, msg: m.Shutdown) -> None:
        self.supervisor.tell(m.SupervisorShutdown(msg.reply, msg.budget_s))

    # ------------------------------------------------------------ for tests and tools

    _job_observer: Callable[[m.JobEnded, tuple[tuple[OffloadKey, int], ...]], None] | None = None

    def store_deadlines_held(self) -> int:
        """The entries this actor's store deadline queue holds (:attr:`DeadlineQueue.held`).

        There is a live one per store with a write still pending. It is withdrawn when its
        request has none left, and popped when it fires. Withdrawn ones not dropped yet
        count too, at most as many again plus ``COMPACT_SLACK``. Ask it on the actor's
        thread, or while nothing runs (a seeded scheduler between steps).
        """
        return self._store_deadlines.held

    def request_identities(self) -> tuple[tuple[str, int], ...]:
        """The ``(req_id, attempt)`` of each request attempt this actor keeps a record of (from its
        start until the supervisor finalizes it), oldest first. Ask it on the actor's thread, or
        while nothing runs (a seeded scheduler between steps)."""
        return tuple(self._requests)

    def observe_job_ended(self, observer: Callable[[m.JobEnded, tuple[tuple[OffloadKey, int], ...]], None] | None,
                          ) -> None:
        """Call ``observer(msg, promoted)`` in the handler, after each job's end is applied.

        ``msg`` is the :class:`~kvactors.actors.messages.JobEnded`. ``promoted`` holds a
        promotion's ``(key, row)`` pairs as they were before its end, and none for a
        cascade job. The observer can then see for itself which of them the end made
        ready. ``None`` removes the observer. This is for tests and tools. Unobserved,
        a job's end costs one attribute test.
        """
        self._job_observer = observer
