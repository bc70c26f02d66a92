"""The scheduler side: vLLM's ``OffloadingManager`` over a :class:`~kvactors.TieringManager`.

vLLM calls this manager from its scheduler thread, one key per ``lookup``,
chunk after chunk, every step. The manager

* looks up a request's remaining prefix in ONE kvactors call (vLLM's
  ``ReqContext`` carries the positions of the request's offload keys) and
  answers the following keys from that answer for the rest of the step;
* runs every kvactors call that may wait for a secondary tier (lookups,
  ``take_events``) on a helper thread; by default the scheduler thread does
  not wait for it (:attr:`KvactorsOffloadingManager.lookup_wait_s` = 0, at
  most :attr:`~KvactorsOffloadingManager.step_wait_s` per step in all when
  set): a key not answered yet is ``RETRY`` and vLLM asks again on the next
  step, which finds the answer (kept, unread, for one step end);
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
manager is safe without vLLM's ``lock`` (which it leaves a no-op).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingManager,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import LookupResult as VLookup
from vllm.v1.kv_offload.base import OffloadingEvent as VEvent
from vllm.v1.kv_offload.base import PrepareStoreOutput as VPrepareStoreOutput
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvactors.core.errors import LifecycleError, ManagerStoppedError
from kvactors.integrations.vllm import compat
from kvactors.integrations.vllm.shm import SharedPool
from kvactors.logs import component_logger
from kvactors.manager import TieringManager
from kvactors.types import PRIMARY_TIER_NAME, LookupResult, OffloadingEvent, OffloadKey, ReqContext

_TO_VLLM = {
    LookupResult.MISS: VLookup.MISS,
    LookupResult.HIT: VLookup.HIT,
    LookupResult.HIT_PENDING: VLookup.HIT_PENDING,
    LookupResult.RETRY: VLookup.RETRY,
}

_MAX_ATTEMPT_BUMPS = 64


@dataclass
class _LookupJob:
    keys: tuple[OffloadKey, ...]
    ctx: ReqContext
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    pinned: dict[OffloadKey, int] = field(default_factory=dict)
    stale: bool = False


@dataclass
class _Request:
    req_id: str
    ctx: ReqContext
    finished: bool = False
    answers: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    pinned: dict[OffloadKey, int] = field(default_factory=dict)  # for ctx, not yet handed to vLLM
    job: _LookupJob | None = None
    read: bool = False  # answers were read this step
    age: int = 0  # step ends since the answers arrived unread
    promoted: set[OffloadKey] = field(default_factory=set)  # keys that were HIT_PENDING for it
    unsure_since: float | None = None  # first not-final answer (HIT_PENDING / RETRY) since the last final one
    stores: dict[OffloadKey, tuple[ReqContext, int]] = field(default_factory=dict)  # key -> (attempt, row)
    loads: dict[OffloadKey, list[ReqContext]] = field(default_factory=dict)


class KvactorsOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side offloading manager, backed by a ``TieringManager``.

    ``shared`` is the pool the worker copies into (see
    :mod:`kvactors.integrations.vllm.shm`); ``owns_shared``: close and remove it
    at :meth:`shutdown`. ``hit_source``: the ``CacheHitSource`` of a block
    promoted from a secondary tier.
    """

    # Longest wait for one lookup answer on the scheduler thread, and per step in all. 0: never
    # wait (scripts/bench_vllm.py: waiting 1-5 ms made a step's scheduler-side time p50 20x
    # vLLM's own tiering and won no hits; the answer is there one step later).
    lookup_wait_s: float = 0.0
    step_wait_s: float = 0.02

    def __init__(self, tm: TieringManager, shared: SharedPool | None, *, events_enabled: bool,
                 tier_kinds: dict[str, str], hit_source: CacheHitSource, owns_shared: bool = True,
                 config_info: dict[str, Any] | None = None, lookup_timeout_s: float = 5.0) -> None:
        self._log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema
        self.tm = tm
        self.lookup_timeout_s = lookup_timeout_s
        self.shared = shared
        self._owns_shared = owns_shared
        self._events_enabled = events_enabled
        self._tier_kinds = dict(tier_kinds)
        self._hit_source = hit_source
        self._config_info = dict(config_info or {})
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._attempts: dict[str, int] = {}
        self._with_answers: set[str] = set()
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvactors-vllm-lookup")
        self._pump = ThreadPoolExecutor(1, thread_name_prefix="kvactors-vllm-events")
        self._events: list[VEvent] = []
        self._pump_busy = False
        self._jobs_in_flight = 0
        self._step_waited = 0.0
        self._stale: list[tuple[str, list[tuple[str, OffloadKey, ReqContext, int]]]] = []
        self._stale_steps: int | None = None
        self._closed = False
        self.counters: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------ vLLM 0.33's extras

    # The manager keeps its invariants itself (HITs are pinned): vLLM's lock stays a no-op.

    def config_info(self) -> Sequence[dict[str, Any]]:
        return [dict(self._config_info)]

    # ------------------------------------------------------------ requests and attempts

    def _start_attempt(self, req_id: str, params: Any) -> _Request:
        """Register the next attempt of ``req_id`` with kvactors (lock held)."""
        attempt = self._attempts.get(req_id, -1) + 1
        for _ in range(_MAX_ATTEMPT_BUMPS):
            ctx = ReqContext(req_id, attempt, params if isinstance(params, dict) else None)
            try:
                self.tm.on_new_request(ctx)
                break
            except LifecycleError:
                attempt += 1  # that identity is still finishing inside kvactors
        else:
            raise LifecycleError(f"could not start a new attempt of request {req_id!r}")
        self._attempts[req_id] = attempt
        old = self._requests.get(req_id)
        req = _Request(req_id, ctx)
        if old is not None:  # completions still owed to the old attempt stay with it
            req.stores, req.loads = old.stores, old.loads
        self._requests[req_id] = req
        return req

    def _finish_attempt(self, req: _Request) -> None:
        """vLLM will submit nothing more for this attempt (lock held)."""
        if req.finished:
            return
        req.finished = True
        self._drop_answers(req)
        if req.job is not None:
            req.job.stale = True
            req.job = None
        self.tm.on_request_finished(req.ctx)

    def _request(self, rc: VReqContext) -> _Request:
        req = self._requests.get(rc.req_id)
        if req is None or req.finished:
            # A request vLLM never announced (or one used again after its finish).
            self.counters["untracked_requests"] += 1
            req = self._start_attempt(rc.req_id, rc.kv_transfer_params)
        return req

    def _forget_if_done(self, req: _Request) -> None:
        if req.finished and not req.stores and not req.loads and self._requests.get(req.req_id) is req:
            del self._requests[req.req_id]
            self._attempts.pop(req.req_id, None)

    def on_new_request(self, req_context: VReqContext) -> RequestOffloadingContext:
        with self._lock:
            old = self._requests.get(req_context.req_id)
            if old is not None and not old.finished:
                self.counters["reannounced_requests"] += 1
                self._finish_attempt(old)
            self._start_attempt(req_context.req_id, req_context.kv_transfer_params)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is None:
                return
            self._finish_attempt(req)
            self._forget_if_done(req)

    # ------------------------------------------------------------ lookups

    @staticmethod
    def _remaining_keys(key: OffloadKey, rc: VReqContext) -> tuple[OffloadKey, ...]:
        """``key`` and the request's later keys of the same group, in prefix order."""
        positions: dict[OffloadKey, int] = getattr(rc, "_offload_key_positions", None) or {}
        start = positions.get(key)
        if start is None:
            return (key,)
        group = key[-4:]
        later = sorted((pos, k) for k, pos in positions.items() if pos > start and k[-4:] == group)
        return (key, *(k for _, k in later))

    def _run_lookup(self, job: _LookupJob) -> None:
        """On the lookup thread: one kvactors lookup, then pin the leading HITs."""
        try:
            try:
                results = self.tm.lookup(job.keys, job.ctx)
            except (LifecycleError, ManagerStoppedError):
                results = [LookupResult.MISS] * len(job.keys)
            answers = dict(zip(job.keys, results, strict=True))
            # vLLM loads the leading keys only when all of them up to the first MISS are HITs.
            lead: list[OffloadKey] = []
            for k, r in zip(job.keys, results, strict=True):
                if r is LookupResult.MISS:
                    break
                if r is not LookupResult.HIT:
                    lead = []
                    break
                lead.append(k)
            lead = list(dict.fromkeys(lead))
            if lead:
                try:
                    spec = self.tm.prepare_load(lead, job.ctx)
                    job.pinned = dict(zip(lead, spec.block_ids, strict=True))
                except (LifecycleError, ManagerStoppedError):
                    for k in lead:  # evicted or finished in between: ask again later
                        answers[k] = LookupResult.RETRY
            # A HIT never leaves here unpinned.
            for k, r in answers.items():
                if r is LookupResult.HIT and k not in job.pinned:
                    answers[k] = LookupResult.RETRY
            job.answers = answers
        except Exception:
            self._log.exception("lookup_failed", req_id=job.ctx.req_id, attempt=job.ctx.attempt)
            job.answers = dict.fromkeys(job.keys, LookupResult.RETRY)
        with self._lock:
            self._jobs_in_flight -= 1
            job.done.set()
            req = self._requests.get(job.ctx.req_id)
            if job.stale or req is None or req.job is not job:
                release = list(job.pinned)
            else:
                release = []
                req.job = None
                for k, r in job.answers.items():
                    if r is LookupResult.HIT_PENDING:
                        req.promoted.add(k)
                        self.counters["pending_answers"] += 1
                req.answers.update(job.answers)
                # A key pinned for the request already keeps that pin: the new one is released.
                release = [k for k in job.pinned if k in req.pinned]
                req.pinned.update((k, row) for k, row in job.pinned.items() if k not in req.pinned)
                # Fresh answers are unread, even if vLLM asked (and got RETRY) earlier this step:
                # otherwise this step's end would drop them and the request would ask again forever.
                req.read = False
                req.age = 0
                self._with_answers.add(req.req_id)
        if release:
            self.tm.complete_load(release, job.ctx)

    def _drop_answers(self, req: _Request) -> None:
        """Release the request's unused pins and forget its answers (lock held)."""
        if req.pinned:
            self.tm.complete_load(list(req.pinned), req.ctx)
            req.pinned = {}
        req.answers = {}
        req.read = False
        req.age = 0
        self._with_answers.discard(req.req_id)

    def _start_lookup(self, req: _Request, key: OffloadKey, req_context: VReqContext) -> _LookupJob:
        """Ask kvactors, off the scheduler's thread, for ``key`` and the request's keys after it
        (one round trip for the rest of the prefix). The caller holds ``self._lock``."""
        job = _LookupJob(self._remaining_keys(key, req_context), req.ctx)
        req.job = job
        self._jobs_in_flight += 1
        self.counters["lookup_calls"] += 1
        self.counters["lookup_keys"] += len(job.keys)
        self._lookups.submit(self._run_lookup, job)
        return job

    def lookup(self, key: OffloadKey, req_context: VReqContext) -> VLookup:
        """One key's answer, from the request's current batch answer (see the module docstring).

        A key that stays ``HIT_PENDING`` / ``RETRY`` for longer than
        ``lookup_timeout_s`` across steps is a ``MISS``: vLLM stops waiting and
        recomputes it."""
        key = bytes(key)
        result = self._lookup(key, req_context)
        if result in (VLookup.HIT, VLookup.MISS):
            return result
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is None:
                return result
            now = time.monotonic()
            if req.unsure_since is None:
                req.unsure_since = now
            elif now - req.unsure_since > self.lookup_timeout_s:
                self.counters["lookups_given_up"] += 1
                return VLookup.MISS
        return result

    def _lookup(self, key: OffloadKey, req_context: VReqContext) -> VLookup:
        with self._lock:
            req = self._request(req_context)
            req.read = True
            answer = req.answers.get(key)
            if answer is not None:
                return _TO_VLLM[answer]
            job = req.job if req.job is not None else self._start_lookup(req, key, req_context)
            budget = min(self.lookup_wait_s, self.step_wait_s - self._step_waited)
        if budget > 0 and not job.done.is_set():
            started = time.monotonic()
            job.done.wait(budget)
            with self._lock:
                self._step_waited += time.monotonic() - started
        with self._lock:
            answer = req.answers.get(key)
            if answer is not None:
                return _TO_VLLM[answer]
            if job.done.is_set() and req.job is None and not req.finished:
                # Answered, but not for this key (another group, a partial tail): ask for it next.
                self._start_lookup(req, key, req_context)
            self.counters["lookup_retries"] += 1
            return VLookup.RETRY

    def get_load_source(self, key: OffloadKey, req_context: VReqContext) -> CacheHitSource:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            if req is not None and bytes(key) in req.promoted:
                return self._hit_source
        return CacheHitSource.HOST

    # ------------------------------------------------------------ loads

    def prepare_load(self, keys: Collection[OffloadKey], req_context: VReqContext) -> CPULoadStoreSpec:
        keys = [bytes(k) for k in keys]
        with self._lock:
            req = self._request(req_context)
            rows: list[int] = []
            missing = [k for k in keys if k not in req.pinned]
            if missing:
                # Not answered HIT by us this step (vLLM's own bookkeeping): pin now, primary only.
                spec = self.tm.prepare_load(missing, req.ctx)
                req.pinned.update(zip(missing, spec.block_ids, strict=True))
            for k in keys:
                rows.append(req.pinned.pop(k))
                req.loads.setdefault(k, []).append(req.ctx)
                req.answers.pop(k, None)
            self.counters["keys_loaded"] += len(keys)
            req.unsure_since = None
        return CPULoadStoreSpec(rows)

    def complete_load(self, keys: Collection[OffloadKey], req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            by_ctx: dict[ReqContext, list[OffloadKey]] = defaultdict(list)
            for k in map(bytes, keys):
                ctxs = req.loads.get(k) if req is not None else None
                if not ctxs:
                    self.counters["unknown_completions"] += 1
                    continue
                by_ctx[ctxs.pop(0)].append(k)
                if not ctxs:
                    del req.loads[k]  # type: ignore[union-attr]
            for ctx, ks in by_ctx.items():
                self.tm.complete_load(ks, ctx)
            if req is not None:
                self._forget_if_done(req)

    def touch(self, keys: Collection[OffloadKey], req_context: VReqContext) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            ctx = req.ctx if req is not None and not req.finished else None
        if ctx is not None:
            self.tm.touch([bytes(k) for k in keys], ctx)

    # ------------------------------------------------------------ stores

    def prepare_store(self, keys: Collection[OffloadKey], req_context: VReqContext) -> VPrepareStoreOutput | None:
        keys = [bytes(k) for k in keys]
        with self._lock:
            req = self._request(req_context)
            out = self.tm.prepare_store(keys, req.ctx)
            if out is None:
                self.counters["stores_refused"] += 1
                return None
            rows = list(out.store_spec.block_ids)
            if self.shared is not None:
                self.shared.mark_pending(rows)
            for k, row in zip(out.keys_to_store, rows, strict=True):
                req.stores[k] = (req.ctx, row)
            self.counters["keys_stored"] += len(rows)
        return VPrepareStoreOutput(keys_to_store=list(out.keys_to_store), store_spec=CPULoadStoreSpec(rows),
                                   evicted_keys=list(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: VReqContext, success: bool = True) -> None:
        with self._lock:
            req = self._requests.get(req_context.req_id)
            groups: dict[tuple[ReqContext, bool], list[OffloadKey]] = defaultdict(list)
            for k in map(bytes, keys):
                entry = req.stores.pop(k, None) if req is not None else None
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
                self._forget_if_done(req)

    # ------------------------------------------------------------ steps, events, reset

    def _pump_events(self) -> None:
        try:
            events = self.tm.take_events()
        except ManagerStoppedError:
            events = []
        except Exception:
            self._log.exception("take_events_failed")
            events = []
        converted = [self._convert(e) for e in events] if self._events_enabled else []
        with self._lock:
            self._events.extend(converted)
            self._pump_busy = False

    def _convert(self, event: OffloadingEvent) -> VEvent:
        if event.tier == PRIMARY_TIER_NAME:
            return VEvent(keys=list(event.keys), medium=Medium.CPU, removed=event.removed, locality=Locality.LOCAL)
        locality = Locality.REMOTE if self._tier_kinds.get(event.tier) == "redis" else Locality.LOCAL
        return VEvent(keys=list(event.keys), medium=Medium.STORAGE, removed=event.removed, locality=locality,
                      ownership=event.tier)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        with self._lock:
            self._step_waited = 0.0
            for req_id in list(context.preempted_req_ids):
                req = self._requests.get(req_id)
                if req is None or req.finished:
                    continue
                # vLLM restarts a preempted request from token 0 under the same id: a new attempt.
                self.counters["preemptions"] += 1
                self._finish_attempt(req)
                self._start_attempt(req_id, req.ctx.params)
            for req_id in list(self._with_answers):
                req = self._requests.get(req_id)
                if req is None:
                    self._with_answers.discard(req_id)
                    continue
                if req.read or req.age >= 1:
                    self._drop_answers(req)
                else:
                    req.age += 1  # arrived after this step's lookups: kept for the next step
                req.read = False
            if self._stale_steps is not None:
                self._stale_steps += 1
                if not compat.HAS_RESET_FENCE and self._stale_steps >= compat.RESET_FLUSH_STEPS:
                    self._release_stale()
            start_pump = not self._pump_busy and not self._closed
            if start_pump:
                self._pump_busy = True
        if start_pump:
            self._pump.submit(self._pump_events)

    def take_events(self) -> Iterable[VEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._jobs_in_flight > 0 or self._stale_steps is not None

    def reset_cache(self) -> None:
        with self._lock:
            stale: list[tuple[str, OffloadKey, ReqContext, int]] = []
            for req in list(self._requests.values()):
                self._drop_answers(req)
                if req.job is not None:
                    req.job.stale = True
                    req.job = None
                req.promoted.clear()
                # vLLM drops the jobs in flight: their completions never come. The rows stay
                # reserved inside kvactors until the workers are done with them.
                for k, (ctx, row) in req.stores.items():
                    stale.append(("store", k, ctx, row))
                for k, ctxs in req.loads.items():
                    stale.extend(("load", k, ctx, -1) for ctx in ctxs)
                req.stores, req.loads = {}, {}
                self._forget_if_done(req)
            self._stale.append(("reset", stale))
            self._stale_steps = 0
        self.tm.reset_cache()

    def on_reset_flushed(self) -> None:
        with self._lock:
            self._release_stale()

    def _release_stale(self) -> None:
        """The workers are done with the jobs a reset dropped: end them inside kvactors (lock held)."""
        for _, entries in self._stale:
            stores: dict[ReqContext, list[OffloadKey]] = defaultdict(list)
            loads: dict[ReqContext, list[OffloadKey]] = defaultdict(list)
            for kind, k, ctx, _row in entries:
                (stores if kind == "store" else loads)[ctx].append(k)
            for ctx, ks in stores.items():
                self.tm.complete_store(ks, ctx, False)  # never known to be complete: not made ready
            for ctx, ks in loads.items():
                self.tm.complete_load(ks, ctx)
        self._stale = []
        self._stale_steps = None

    def get_stats(self) -> None:
        return None

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outstanding: list[tuple[str, OffloadKey, ReqContext, int]] = []
            for req in self._requests.values():
                self._drop_answers(req)
                if not req.finished:
                    self._finish_attempt(req)
                # Completions vLLM will never send now: end them (a store never made ready).
                outstanding += [("store", k, ctx, row) for k, (ctx, row) in req.stores.items()]
                outstanding += [("load", k, ctx, -1) for k, ctxs in req.loads.items() for ctx in ctxs]
                req.stores, req.loads = {}, {}
            self._requests.clear()
            self._stale.append(("shutdown", outstanding))
            self._release_stale()
        self._lookups.shutdown(wait=True)
        self._pump.shutdown(wait=True)
        try:
            self.tm.stop(timeout=self.tm_stop_timeout_s)
        finally:
            if self.shared is not None and self._owns_shared:
                self.shared.close(unlink=True)

    tm_stop_timeout_s: float = 30.0

    # ------------------------------------------------------------ for tests and operators

    def stats(self) -> dict[str, Any]:
        """kvactors' counters plus this adapter's (round trips, retries, preemptions, ...)."""
        out: dict[str, Any] = dict(self.tm.stats())
        with self._lock:
            out.update({f"vllm_{k}": v for k, v in self.counters.items()})
            out["vllm_tracked_requests"] = len(self._requests)
        return out
