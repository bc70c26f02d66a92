"""The scheduler side: vLLM's ``OffloadingManager`` over a :class:`~kvactors.TieringManager`.

vLLM calls this manager from its scheduler thread, one key per ``lookup``,
chunk after chunk, every step. The manager

* looks up a request's remaining prefix in ONE kvactors call (vLLM's
  ``ReqContext`` carries the positions of the request's offload keys) and
  answers the following keys from that answer for the rest of the step;
* runs every kvactors call that may wait for a secondary tier (lookups,
  ``take_events``) on a helper thread; the scheduler thread waits for a
  lookup's answer briefly (:attr:`KvactorsOffloadingManager.lookup_wait_s`,
  at most :attr:`~KvactorsOffloadingManager.step_wait_s` per step in all),
  never for a tier: a key not answered by then is ``RETRY`` and vLLM asks
  again on the next step, which finds the answer (kept, unread, for one step
  end);
* pins the leading ``HIT`` keys of an answer (``prepare_load``) before it
  answers ``HIT``, so that nothing (another request's store or promotion)
  can evict a block between vLLM's lookup and its ``prepare_load``; pins not
  used by the end of the step are released (``complete_load``);
* maps vLLM's ``req_id`` to kvactors' ``ReqContext`` with an attempt: a
  preempted or re-announced request finishes its attempt and starts the next
  one, and each store or load remembers the attempt that prepared it, so a
  completion arriving late (even after ``on_request_finished``) completes the
  right attempt;
* learns whether a store's copy succeeded from the worker's status byte of
  each row in the shared pool (vLLM itself asserts that every transfer
  succeeded): a failed copy is ``complete_store(..., success=False)``, so the
  block never becomes ready and the next request recomputes it.

Threading: vLLM calls it from one thread; the helper threads only run
kvactors calls and post their answers under the manager's own lock, so the
manager is safe without vLLM's ``lock`` (which it leaves a no-op). The lock is
never held across a call that waits for the TieringManager (``lookup``,
``prepare_load``, ``prepare_store``, ``reset_cache``, ``take_events``): a
``prepare_*`` call takes what it needs from the request under the lock, asks
the TieringManager without it (the lookup thread may post answers and pins
meanwhile), and records the outcome under it again; the request is not
forgotten in between (:meth:`~.requests.Requests.kept`).

The pieces, one idea each: :mod:`.requests` (req_ids as attempts, their
answers, pins and owed completions), :mod:`.lookups` (one batch lookup per
request, its leading HITs pinned), :mod:`.events` (``take_events`` off the
scheduler's thread), :mod:`.stale` (the jobs a reset dropped).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import LookupResult as VLookup
from vllm.v1.kv_offload.base import OffloadingEvent as VEvent
from vllm.v1.kv_offload.base import (
    OffloadingManager,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import PrepareStoreOutput as VPrepareStoreOutput
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvactors.core.request_params import parse_request_params
from kvactors.integrations.vllm import compat, lookups, stops
from kvactors.integrations.vllm.events import EventPump
from kvactors.integrations.vllm.requests import LookupJob, Request, Requests
from kvactors.integrations.vllm.shm import SharedPool
from kvactors.integrations.vllm.stale import StaleJobs, take_owed
from kvactors.integrations.vllm.stats import StatsReporter
from kvactors.logs import component_logger
from kvactors.manager import TieringManager
from kvactors.types import LookupResult, OffloadKey, ReqContext

_TO_VLLM = {
    LookupResult.MISS: VLookup.MISS,
    LookupResult.HIT: VLookup.HIT,
    LookupResult.HIT_PENDING: VLookup.HIT_PENDING,
    LookupResult.RETRY: VLookup.RETRY,
}


class KvactorsOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side offloading manager, backed by a ``TieringManager``.

    ``shared`` is the pool the worker copies into (see
    :mod:`kvactors.integrations.vllm.shm`); ``owns_shared``: close and remove it
    at :meth:`shutdown`. ``hit_source``: the ``CacheHitSource`` of a block
    promoted from a secondary tier.
    """

    # Longest wait for one lookup answer on the scheduler thread, and per step in all. A short wait
    # lets the helper threads (which need the GIL the scheduler's loop holds) answer in the same
    # step; not waiting cost a step or more per lookup, up to thousands of empty steps under pool
    # pressure (docs/performance.md, "vLLM engine sweep"). 0: never wait.
    lookup_wait_s: float = 0.002
    step_wait_s: float = 0.005
    # The most scheduler steps a request waits for keys that are not final (HIT_PENDING, RETRY) before
    # they are a MISS and it computes them, once lookup_wait_min_s has passed: bounded in steps as well
    # as in seconds (lookup_timeout_s). The floor in seconds is for an engine that spins through empty
    # steps (nothing else to run) while a promotion is on its way: those steps cost nobody anything.
    lookup_wait_steps: int = 32
    lookup_wait_min_s: float = 0.25
    tm_stop_timeout_s: float = 30.0

    def __init__(self, tm: TieringManager, shared: SharedPool | None, *, events_enabled: bool,
                 tier_kinds: dict[str, str], hit_source: CacheHitSource, owns_shared: bool = True,
                 config_info: dict[str, Any] | None = None, lookup_timeout_s: float = 5.0) -> None:
        self._log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema
        self.tm = tm
        self.lookup_timeout_s = lookup_timeout_s
        self.shared = shared
        self._owns_shared = owns_shared
        self._hit_source = hit_source
        self._config_info = dict(config_info or {})
        self._lock = threading.Lock()
        self.counters: dict[str, int] = defaultdict(int)
        self._requests = Requests(tm, self.counters, self._lock)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvactors-vllm-lookup")
        self._events = EventPump(tm, enabled=events_enabled, tier_kinds=tier_kinds, log=self._log)
        self._stale = StaleJobs(tm, has_reset_fence=compat.HAS_RESET_FENCE, flush_steps=compat.RESET_FLUSH_STEPS)
        self._jobs_in_flight = 0
        self._step_waited = 0.0
        self._step = 0  # scheduler steps ended
        self._closed = False
        self._stats_reporter = StatsReporter(tm)  # get_stats: kvactors' families in vLLM's /metrics

    # ------------------------------------------------------------ vLLM 0.33's extras

    # The manager keeps its invariants itself (HITs are pinned): vLLM's lock stays a no-op.

    def config_info(self) -> Sequence[dict[str, Any]]:
        return [dict(self._config_info)]

    # ------------------------------------------------------------ requests and attempts

    def _request(self, rc: VReqContext) -> Request:
        return self._requests.current(rc.req_id, rc.kv_transfer_params)

    def on_new_request(self, req_context: VReqContext) -> RequestOffloadingContext:
        with self._lock:
            old = self._requests.get(req_context.req_id)
            if old is not None and not old.finished:
                self.counters["reannounced_requests"] += 1
                self._requests.finish_attempt(old)
            self._requests.start_attempt(req_context.req_id, req_context.kv_transfer_params)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is None:
                return
            self._requests.finish_attempt(req)
            self._requests.forget_if_done(req)

    # ------------------------------------------------------------ lookups

    def _run_lookup(self, job: LookupJob) -> None:
        """On the lookup thread: one kvactors lookup, its leading HITs pinned, posted to the request."""
        lookups.answer(self.tm, job, self._log)
        with self._lock:
            self._jobs_in_flight -= 1
            job.done.set()
            release = lookups.post(self._requests, job)
        if release:
            self.tm.complete_load(release, job.ctx)

    def _start_lookup(self, req: Request, key: OffloadKey, req_context: VReqContext) -> LookupJob:
        """Ask kvactors, off the scheduler's thread, for ``key`` and the request's keys after it
        (one round trip for the rest of the prefix). The caller holds ``self._lock``."""
        max_load = parse_request_params(req.ctx.params).max_load_tokens if req.ctx.params else None
        job = LookupJob(lookups.remaining_keys(key, compat.offload_key_positions(req_context), max_load), req.ctx)
        req.begin_lookup(job)
        self._jobs_in_flight += 1
        self.counters["lookup_calls"] += 1
        self.counters["lookup_keys"] += len(job.keys)
        self._lookups.submit(self._run_lookup, job)
        return job

    def lookup(self, key: OffloadKey, req_context: VReqContext) -> VLookup:
        """One key's answer, from the request's current batch answer (see the module docstring).

        A key that stays ``HIT_PENDING`` / ``RETRY`` for longer than
        ``lookup_timeout_s`` across steps, or for more than :attr:`lookup_wait_steps`
        steps (and :attr:`lookup_wait_min_s`), is a ``MISS``: vLLM stops waiting and
        recomputes it."""
        key = bytes(key)
        result = self._lookup(key, req_context)
        if result in (VLookup.HIT, VLookup.MISS):
            return result
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is None:
                return result
            waited = req.unsure_for(time.monotonic(), self._step)
            if waited is not None:
                seconds, steps = waited
                if seconds > self.lookup_timeout_s or (steps > self.lookup_wait_steps
                                                       and seconds > self.lookup_wait_min_s):
                    self.counters["lookups_given_up"] += 1
                    return VLookup.MISS
        return result

    def _lookup(self, key: OffloadKey, req_context: VReqContext) -> VLookup:
        with self._lock:
            req = self._request(req_context)
            req.mark_read()
            answer = req.answer(key)
            if answer is not None:
                return self._answered(req, answer)
            job = req.job if req.job is not None else self._start_lookup(req, key, req_context)
            budget = min(self.lookup_wait_s, self.step_wait_s - self._step_waited)
        if budget > 0 and not job.done.is_set():
            started = time.monotonic()
            job.done.wait(budget)
            with self._lock:
                self._step_waited += time.monotonic() - started
        with self._lock:
            answer = req.answer(key)
            if answer is not None:
                return self._answered(req, answer)
            if job.done.is_set() and req.job is None and not req.finished:
                # Answered, but not for this key (another group, a partial tail): ask for it next.
                self._start_lookup(req, key, req_context)
            self.counters["lookup_retries"] += 1
            return VLookup.RETRY

    @staticmethod
    def _answered(req: Request, answer: LookupResult) -> VLookup:
        """vLLM's answer for a key the core answered (caller holds the lock). A final one (HIT,
        MISS) ends the wait ``lookup_timeout_s`` bounds: a request asked again on a later step
        (its answers are dropped at each step's end, e.g. while it waits for device blocks) starts
        a new one, instead of losing its hits once the first wait would have run out."""
        result = _TO_VLLM[answer]
        if result is VLookup.HIT or result is VLookup.MISS:
            req.sure()
        return result

    def get_load_source(self, key: OffloadKey, req_context: VReqContext) -> CacheHitSource:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is not None and req.was_promoted(bytes(key)):
                return self._hit_source
        return CacheHitSource.HOST

    # ------------------------------------------------------------ loads

    def prepare_load(self, keys: Collection[OffloadKey], req_context: VReqContext) -> CPULoadStoreSpec:
        """The pool rows of ``keys``: the pins this manager took when it answered them ``HIT``,
        and for keys it did not answer so this step (vLLM's own bookkeeping), pins taken now
        from the TieringManager, outside the lock. ``ValueError`` if a key is given twice; the
        TieringManager's ``LifecycleError`` if a key is not ready (nothing is pinned for the
        call then)."""
        keys = [bytes(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("prepare_load: a key is given twice")
        with self._lock:
            req = self._request(req_context)
            # Taken from the request now, so that nothing (a step's end) releases them meanwhile.
            taken = req.take_pins(keys)
            with self._requests.kept(req):  # not forgotten meanwhile: its loads are recorded after
                fresh = self._pin_missing(req, [k for k in keys if k not in taken], taken)
                rows = [taken[k] if k in taken else fresh[k] for k in keys]
                req.loading(keys)
                self.counters["keys_loaded"] += len(keys)
        return CPULoadStoreSpec(rows)

    def _pin_missing(self, req: Request, missing: list[OffloadKey], taken: dict[OffloadKey, int]
                     ) -> dict[OffloadKey, int]:
        """Pin ``missing`` (primary only) for ``req``; the caller holds the lock, which is released
        for the TieringManager's call. The lookup thread may post answers and pins for the request
        meanwhile (a pin it posts for one of these keys stays the request's, an unused pin
        released at the step's end). If the TieringManager refuses, the ``taken`` pins go back to
        the request (or are released) and the error is raised."""
        if not missing:
            return {}
        try:
            with self._requests.unlocked():
                spec = self.tm.prepare_load(missing, req.ctx)
        except BaseException:
            release = self._requests.restore_pins(req, taken)
            if release:
                self.tm.complete_load(release, req.ctx)  # a message to the actors: it never waits
            raise
        return dict(zip(missing, spec.block_ids, strict=True))

    def complete_load(self, keys: Collection[OffloadKey], req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is None:
                self.counters["unknown_completions"] += len(keys)
                return
            by_ctx: dict[ReqContext, list[OffloadKey]] = defaultdict(list)
            for k in map(bytes, keys):
                ctx = req.take_load(k)
                if ctx is None:
                    self.counters["unknown_completions"] += 1
                    continue
                by_ctx[ctx].append(k)
            for ctx, ks in by_ctx.items():
                self.tm.complete_load(ks, ctx)
            self._requests.forget_if_done(req)

    def touch(self, keys: Collection[OffloadKey], req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            ctx = req.ctx if req is not None and not req.finished else None
        if ctx is not None:
            self.tm.touch([bytes(k) for k in keys], ctx)

    # ------------------------------------------------------------ stores

    def prepare_store(self, keys: Collection[OffloadKey], req_context: VReqContext) -> VPrepareStoreOutput | None:
        """Rows for the keys not in the pool yet, from the TieringManager, asked outside the lock
        (the lookup thread goes on meanwhile). The rows are marked pending in the shared status
        table, and recorded for the attempt that prepared them, before vLLM sees them."""
        keys = [bytes(k) for k in keys]
        with self._lock:
            req = self._request(req_context)
            ctx = req.ctx
            with self._requests.kept(req):  # not forgotten meanwhile: its stores are recorded after
                with self._requests.unlocked():
                    out = self.tm.prepare_store(keys, ctx)
                    rows = [] if out is None else list(out.store_spec.block_ids)
                    if rows and self.shared is not None:
                        self.shared.mark_pending(rows)  # before vLLM submits the store (one writer: no lock)
                if out is None:
                    self.counters["stores_refused"] += 1
                    return None
                req.storing(ctx, dict(zip(out.keys_to_store, rows, strict=True)))
                self.counters["keys_stored"] += len(rows)
        return VPrepareStoreOutput(keys_to_store=list(out.keys_to_store), store_spec=CPULoadStoreSpec(rows),
                                   evicted_keys=list(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: VReqContext, success: bool = True) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            groups: dict[tuple[ReqContext, bool], list[OffloadKey]] = defaultdict(list)
            # Two attempts may owe a store of one key: the report is for the one whose copy ended.
            copy_ended = None if self.shared is None else self.shared.copy_ended
            for k in map(bytes, keys):
                entry = req.take_store(k, copy_ended) if req is not None else None
                if entry is None:
                    continue  # already present when prepared, or stale after a reset
                ctx, row = entry
                ok = bool(success) and (self.shared is None or self.shared.stored_ok(row))
                if not ok:
                    self.counters["stores_failed"] += 1
                groups[(ctx, ok)].append(k)
            for (ctx, ok), ks in groups.items():
                self.tm.complete_store(ks, ctx, ok)
            if req is not None:
                self._requests.forget_if_done(req)

    # ------------------------------------------------------------ steps, events, reset

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        with self._lock:
            self._step_waited = 0.0
            self._step += 1
            for req_id in list(context.preempted_req_ids):
                req = self._requests.get(req_id)
                if req is None or req.finished:
                    continue
                # vLLM restarts a preempted request from token 0 under the same id: a new attempt.
                self.counters["preemptions"] += 1
                self._requests.finish_attempt(req)
                self._requests.start_attempt(req_id, req.ctx.params)
            self._requests.end_step(time.monotonic(), self.lookup_timeout_s)
            self._stale.end_step()
            closed = self._closed
        if not closed:
            self._events.kick()

    def take_events(self) -> Iterable[VEvent]:
        return self._events.take()

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._jobs_in_flight > 0 or self._stale.waiting

    def reset_cache(self) -> None:
        with self._lock:
            stale = []
            for req in list(self._requests.by_id.values()):
                self._requests.drop_answers(req)
                req.forget_lookups()
                # vLLM drops the jobs in flight: their completions never come. The rows stay
                # reserved inside kvactors until the workers are done with them.
                stale += take_owed(req)
                self._requests.forget_if_done(req)
            self._stale.add("reset", stale)
        self.tm.reset_cache()

    def on_reset_flushed(self) -> None:
        with self._lock:
            self._stale.release()

    def get_stats(self) -> Any:
        """kvactors' metric families for the server's ``/metrics`` (an ``OffloadingConnectorStats``
        or None; see :mod:`kvactors.integrations.vllm.stats`). Never waits for the actors."""
        return self._stats_reporter.take()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outstanding = []
            for req in self._requests.by_id.values():
                self._requests.drop_answers(req)
                if not req.finished:
                    self._requests.finish_attempt(req)
                # Completions vLLM will never send now: end them (a store never made ready).
                outstanding += take_owed(req)
            self._requests.by_id.clear()
            self._stale.add("shutdown", outstanding)
            self._stale.release()
        # After SIGTERM/SIGINT vLLM kills this process soon (its --shutdown-timeout): a short
        # budget, and no wait for a lookup in flight (stops.py).
        signalled = stops.signalled()
        self._stats_reporter.close()
        self._lookups.shutdown(wait=not signalled, cancel_futures=signalled)
        self._events.close()
        try:
            self.tm.stop(timeout=stops.stop_budget(self.tm_stop_timeout_s))
        finally:
            if self.shared is not None and self._owns_shared:
                self.shared.close(unlink=True)

    # ------------------------------------------------------------ for tests and operators

    def stats(self) -> dict[str, Any]:
        """kvactors' counters plus this adapter's (round trips, retries, preemptions, ...)."""
        out: dict[str, Any] = dict(self.tm.stats())
        with self._lock:
            out.update({f"vllm_{k}": v for k, v in self.counters.items()})
            out["vllm_tracked_requests"] = len(self._requests.by_id)
        return out
