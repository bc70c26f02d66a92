"""A reference for benchmarks, not the product.

``LockedManager`` runs kvactors' functional core (:class:`BlockPool` and
:class:`LifecycleTable`) behind one ``threading.RLock``, called directly on the
caller's thread, the way vLLM's offloading manager does: every secondary-tier
call (``lookup``, ``submit_store``, ``submit_load``, the per-request hooks) is
made synchronously while the lock is held. It keeps the finalize rule (a tier
is told ``on_request_finished`` once nothing can still submit for the request)
but none of the rest of the runtime: no deadlines, no per-tier job limits, no
event log, no ``reset_cache``, no isolation of tier failures. It exists so that
``scripts/bench_lifecycle.py`` can compare the actors against a lock; do not
use it to serve.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from kvactors.core.errors import LifecycleError
from kvactors.core.lifecycle import LifecycleTable
from kvactors.core.policies import make_policy
from kvactors.core.pool import BlockPool, PoolError
from kvactors.tiers.base import SecondaryTier
from kvactors.types import (
    JobResult,
    LoadStoreSpec,
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferJob,
)

__all__ = ["LockedManager"]


class LockedManager:
    """The functional core behind one lock; tier calls inside it. See the module docstring."""

    def __init__(self, *, num_blocks: int, pool: object, secondary_tiers: Sequence[SecondaryTier] = (),
                 eviction: str = "lru") -> None:
        self._lock = threading.RLock()
        self._pool = BlockPool(num_blocks, make_policy(eviction, num_blocks))
        self._table = LifecycleTable()
        self._tiers = list(secondary_tiers)
        self._job_ids = itertools.count(1)
        self._promotions: dict[int, ReqContext] = {}
        for tier in self._tiers:
            tier.attach(pool, self._report)  # type: ignore[arg-type]

    # ------------------------------------------------------------ internals (lock held)

    def _report(self, result: JobResult) -> None:
        with self._lock:
            ctx = self._promotions.pop(result.job_id, None)
            if ctx is None:
                self._pool.end_job(result.job_id, hold=False)
            else:
                self._pool.end_promotion(result.job_id, success=result.success)

    def _require_active(self, ctx: ReqContext, call: str) -> None:
        state = self._table.get(ctx)
        if state is None or state.is_finished:
            raise LifecycleError(f"{call}: request {ctx} is unknown or finished")

    def _maybe_finalize(self, ctx: ReqContext) -> None:
        if self._table.maybe_finalize(ctx) is not None:
            for tier in self._tiers:
                tier.on_request_finished(ctx)

    # ------------------------------------------------------------ the API subset the benchmark uses

    def on_new_request(self, ctx: ReqContext) -> None:
        with self._lock:
            self._table.start(ctx)
            for tier in self._tiers:
                tier.on_new_request(ctx)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        with self._lock:
            self._require_active(ctx, "lookup")
            keys = tuple(keys)
            results = self._pool.lookup(keys)
            missing = [i for i, r in enumerate(results) if r is LookupResult.MISS]
            if not missing or not self._tiers:
                return results
            asked = tuple(dict.fromkeys(keys[i] for i in missing))
            found: dict[OffloadKey, SecondaryTier] = {}
            for tier in self._tiers:
                for key, answer in zip(asked, tier.lookup(asked, ctx), strict=True):
                    if answer is LookupResult.HIT and key not in found:
                        found[key] = tier
            by_tier: dict[SecondaryTier, list[OffloadKey]] = {}
            for key, tier in found.items():
                by_tier.setdefault(tier, []).append(key)
            pending: set[OffloadKey] = set()
            for tier, tier_keys in by_tier.items():
                job_id = next(self._job_ids)
                rows = self._pool.allocate_promotion(job_id, tier_keys)
                if rows is None:
                    continue
                self._promotions[job_id] = ctx
                pending.update(tier_keys)
                tier.submit_load(TransferJob(job_id, tuple(tier_keys), rows, ctx, True))
            for i in missing:
                if keys[i] in pending:
                    results[i] = LookupResult.HIT_PENDING
            return results

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        with self._lock:
            self._require_active(ctx, "prepare_store")
            plan = self._pool.prepare_store(tuple(keys), ctx.identity)
            if plan is None:
                return None
            if plan.keys:
                self._table.add(ctx, "pending_primary_stores", len(plan.keys))
            return PrepareStoreOutput(list(plan.keys), LoadStoreSpec(plan.rows), list(plan.evicted))

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        with self._lock:
            try:
                outcome = self._pool.complete_store(tuple(keys), ctx.identity, success)
            except PoolError:
                return
            if outcome.live:
                self._table.add(ctx, "pending_primary_stores", -outcome.live)
            if outcome.stored:
                for tier in self._tiers:
                    job_id = next(self._job_ids)
                    rows = self._pool.pin_for_job(job_id, outcome.stored)
                    tier.submit_store(TransferJob(job_id, outcome.stored, rows, ctx, False))
            self._maybe_finalize(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        with self._lock:
            if self._table.finish(ctx) is not None:
                self._maybe_finalize(ctx)

    def stats(self) -> dict[str, int]:
        with self._lock:
            stats = dict(self._pool.stats())
            stats["active_requests"] = len(self._table)
            return stats
