"""Watching the tiers from outside the runtime: a thin delegating tier wrapper.

:class:`ObservedTier` wraps any :class:`~kvactors.SecondaryTier` and forwards
every call to it unchanged, noting on the way (in a shared :class:`TierObserver`):

* when each tier's ``on_request_finished(ctx)`` ran (the finalize latency),
  and whether it ran more than once for a ctx (a contract violation);
* every submit (``submit_store`` / ``submit_load``) that reaches a tier after
  its ``on_request_finished`` for the job's ctx (a contract violation);
* which tier promoted (``submit_load``) each key last, and when (the per-tier
  hit attribution).

The runtime is not changed: the wrapper is an ordinary tier plugin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvactors.tiers.base import SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import OffloadKey, ReqContext, TransferJob


class TierObserver:
    """What the wrapped tiers saw; thread-safe (tier actors call it concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished_at: dict[tuple[ReqContext, str], float] = {}
        self.started: set[tuple[ReqContext, str]] = set()
        self.duplicate_finishes = 0
        self.submits_after_finish = 0
        self.violation_notes: list[str] = []
        self.promoted: dict[OffloadKey, tuple[str, float]] = {}
        self.promotions: dict[str, int] = {}
        self.cascaded_blocks: dict[str, int] = {}

    def _violation(self, note: str) -> None:
        if len(self.violation_notes) < 10:
            self.violation_notes.append(note)

    def new_request(self, tier: str, ctx: ReqContext) -> None:
        with self._lock:
            self.started.add((ctx, tier))

    def finished(self, tier: str, ctx: ReqContext) -> None:
        now = time.monotonic()
        with self._lock:
            if (ctx, tier) in self.finished_at:
                self.duplicate_finishes += 1
                self._violation(f"{tier}: on_request_finished({ctx}) called twice")
            else:
                self.finished_at[(ctx, tier)] = now

    def submitted(self, tier: str, job: TransferJob) -> None:
        now = time.monotonic()
        with self._lock:
            if (job.req_context, tier) in self.finished_at:
                self.submits_after_finish += 1
                kind = "submit_load" if job.is_promotion else "submit_store"
                self._violation(f"{tier}: {kind} for {job.req_context} after its on_request_finished")
            if job.is_promotion:
                self.promotions[tier] = self.promotions.get(tier, 0) + len(job.keys)
                for key in job.keys:
                    self.promoted[key] = (tier, now)
            else:
                self.cascaded_blocks[tier] = self.cascaded_blocks.get(tier, 0) + len(job.keys)

    def promotion_of(self, key: OffloadKey) -> tuple[str, float] | None:
        with self._lock:
            return self.promoted.get(key)

    @property
    def violations(self) -> int:
        with self._lock:
            return self.duplicate_finishes + self.submits_after_finish

    def finalized_time(self, ctx: ReqContext, tiers: Sequence[str]) -> float | None:
        """When the last of ``tiers`` was told ``ctx`` finished (None if one was not)."""
        with self._lock:
            times = [self.finished_at.get((ctx, tier)) for tier in tiers]
        if any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)


class ObservedTier(DelegatingTier):
    """Delegates every call to ``inner``; reports what it sees to ``observer``."""

    def __init__(self, inner: SecondaryTier, observer: TierObserver) -> None:
        super().__init__(inner)
        self.observer = observer

    def submit_store(self, job: TransferJob) -> None:
        self.observer.submitted(self.name, job)
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.observer.submitted(self.name, job)
        super().submit_load(job)

    def on_new_request(self, ctx: ReqContext) -> None:
        self.observer.new_request(self.name, ctx)
        super().on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.observer.finished(self.name, ctx)
        super().on_request_finished(ctx)
