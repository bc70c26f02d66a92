"""Recording what reached a tier: :class:`RecordedTier`, over any tier, into a :class:`TierRecord`.

:class:`RecordedTier` wraps a tier: the in-memory test tier, a ``DiskTier``, a ``RedisTier``, or one of yours.
A :class:`~kvactors.testing.faults.FaultTier` goes under it when faults are wanted.
It forwards every call unchanged.
On the way it notes, per tier and request attempt, what a tier can see of the contract.

* At most one ``on_request_finished`` comes per ``(req_id, attempt)``.
  When the first came gives the finalize latency.
* No ``submit_store`` or ``submit_load`` comes after it.
* With ``rows_check`` (e.g. :func:`~kvactors.testing.blocks.rows_hold`), the pool rows of a store
  hold the block's bytes both when the job is submitted and when its report passes.
  The report is the last moment the tier may read them.
  A row reused while a tier reads it shows up as a mismatch.
* Which tier promoted (``submit_load``) each key last, and when, gives the per-tier hit attribution.
  The blocks cascaded to each tier are noted too.
* Every request attempt it saw, in any call that names one, is noted.

Violations are strings, per tier, in :attr:`RecordedTier.violations`.
A shared record holds all of its tiers' violations in :attr:`TierRecord.violations`.
The wrapper is transparent, as a :class:`~kvactors.tiers.wrapper.DelegatingTier`.
The runtime takes the same paths with it as with the bare inner tier.
So it records only the hooks the inner tier has.
Threading is the inner tier's.
The record is thread-safe, because tier actors and their I/O threads call it concurrently.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, LookupResult, OffloadKey, ReqContext, TransferJob

Identity = tuple[str, int]
RowsCheck = Callable[[torch.Tensor, Sequence[OffloadKey], Sequence[int]], list[int]]
"""``rows_check(pool, keys, rows)``: the positions whose row does not hold its key's bytes."""


class TierRecord:
    """What the recorded tiers saw. Thread-safe.

    One record may be shared by several tiers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished: dict[str, dict[Identity, int]] = {}
        self._violations: dict[str, list[str]] = {}
        self.finished_at: dict[tuple[str, Identity], float] = {}
        self.seen: set[tuple[str, Identity]] = set()
        self.promoted: dict[OffloadKey, tuple[str, float]] = {}
        self.promotions: Counter[str] = Counter()
        self.cascaded_blocks: Counter[str] = Counter()

    def finished(self, tier: str) -> dict[Identity, int]:
        """``on_request_finished`` calls per request attempt at ``tier``.

        The value is live, so read it once the run settled.
        """
        with self._lock:
            return self._finished.setdefault(tier, {})

    def violations_of(self, tier: str) -> list[str]:
        """The violations found at ``tier`` (live)."""
        with self._lock:
            return self._violations.setdefault(tier, [])

    @property
    def violations(self) -> list[str]:
        """Every tier's violations (a copy)."""
        with self._lock:
            return [text for texts in self._violations.values() for text in texts]

    def violation(self, tier: str, text: str) -> None:
        with self._lock:
            self._violations.setdefault(tier, []).append(f"tier {tier}: {text}")

    def saw(self, tier: str, ctx: ReqContext) -> None:
        self.seen.add((tier, ctx.identity))  # a set add is atomic under the GIL

    def finish(self, tier: str, ctx: ReqContext) -> None:
        now = time.monotonic()
        with self._lock:
            counts = self._finished.setdefault(tier, {})
            count = counts[ctx.identity] = counts.get(ctx.identity, 0) + 1
            self.finished_at.setdefault((tier, ctx.identity), now)
            self.seen.add((tier, ctx.identity))
        if count > 1:
            self.violation(tier, f"on_request_finished for {ctx} {count} times")

    def submit(self, tier: str, call: str, job: TransferJob) -> None:
        ctx = job.req_context
        now = time.monotonic()
        with self._lock:
            after_finish = ctx.identity in self._finished.get(tier, ())
            self.seen.add((tier, ctx.identity))
            if job.is_promotion:
                self.promotions[tier] += len(job.keys)
                for key in job.keys:
                    self.promoted[key] = (tier, now)
            else:
                self.cascaded_blocks[tier] += len(job.keys)
        if after_finish:
            self.violation(tier, f"{call} of job {job.job_id} for {ctx} after on_request_finished")

    def promotion_of(self, key: OffloadKey) -> tuple[str, float] | None:
        """The tier that promoted ``key`` last, and when (``time.monotonic()``)."""
        with self._lock:
            return self.promoted.get(key)

    def finalized_time(self, ctx: ReqContext, tiers: Sequence[str]) -> float | None:
        """When the last of ``tiers`` was first told ``ctx`` finished (None if one was not)."""
        with self._lock:
            times = [self.finished_at.get((tier, ctx.identity)) for tier in tiers]
        if any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)


class RecordedTier(DelegatingTier):
    """``inner``, recorded into ``record`` (see the module docstring).

    A new record is made if none is given.
    With ``keep_calls``, each call is also kept as a line in :attr:`calls`, a trace.
    """

    def __init__(self, inner: SecondaryTier, *, record: TierRecord | None = None,
                 rows_check: RowsCheck | None = None, keep_calls: bool = False,
                 max_inflight_jobs: int | None = None) -> None:
        super().__init__(inner, max_inflight_jobs=max_inflight_jobs)
        self.record = record if record is not None else TierRecord()
        self.rows_check = rows_check
        self.calls: list[str] | None = [] if keep_calls else None
        self._lock = threading.Lock()
        self._reading: dict[int, TransferJob] = {}  # stores whose rows the tier may still read

    # ------------------------------------------------------------ what the checks read

    @property
    def finished(self) -> dict[Identity, int]:
        return self.record.finished(self.name)

    @property
    def violations(self) -> list[str]:
        return self.record.violations_of(self.name)

    @property
    def stalled(self) -> set[int]:
        """Jobs a fault layer under this one will never report."""
        return set().union(*(getattr(layer, "stalled", ()) for layer in self.layers()[1:]))

    @property
    def extra_reports(self) -> int:
        """Reports a fault layer under this one made for jobs that do not exist (any more)."""
        return sum(int(getattr(layer, "extra_reports", 0)) for layer in self.layers()[1:])

    # ------------------------------------------------------------ calls

    def _note(self, text: str) -> None:
        if self.calls is not None:
            self.calls.append(text)

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        SecondaryTier.attach(self, pool, report)
        self.inner.attach(pool, self._inner_report if self.rows_check is not None else report)

    def on_new_request(self, ctx: ReqContext) -> None:
        self._note(f"on_new_request {ctx}")
        self.record.saw(self.name, ctx)
        self.inner.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._note(f"on_request_finished {ctx}")
        self.record.finish(self.name, ctx)
        self.inner.on_request_finished(ctx)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        self.record.saw(self.name, ctx)
        return self.inner.lookup(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.record.saw(self.name, ctx)
        self.inner.touch(keys, ctx)

    def _rows_changed(self, job: TransferJob) -> list[int]:
        assert self.rows_check is not None and self.pool is not None
        return [job.block_ids[i] for i in self.rows_check(self.pool, job.keys, job.block_ids)]

    def submit_store(self, job: TransferJob) -> None:
        self._note(f"submit_store job={job.job_id} {job.req_context}")
        self.record.submit(self.name, "submit_store", job)
        if self.rows_check is not None:
            bad = self._rows_changed(job)
            if bad:
                self.record.violation(self.name, f"job {job.job_id} ({job.req_context}): rows {bad} "
                                                 "do not hold their blocks at submit_store")
            with self._lock:
                self._reading[job.job_id] = job
        try:
            self.inner.submit_store(job)
        except BaseException:
            with self._lock:
                self._reading.pop(job.job_id, None)
            raise

    def submit_load(self, job: TransferJob) -> None:
        self._note(f"submit_load job={job.job_id} {job.req_context}")
        self.record.submit(self.name, "submit_load", job)
        self.inner.submit_load(job)

    def _inner_report(self, result: JobResult) -> None:
        """A report on its way to the runtime, from any thread.

        The store's rows must still hold their blocks.
        """
        with self._lock:
            job = self._reading.pop(result.job_id, None) if isinstance(result, JobResult) else None
        if job is not None:
            changed = self._rows_changed(job)
            if changed:
                self.record.violation(self.name, f"job {job.job_id} ({job.req_context}): rows {changed} "
                                                 "changed while the tier read them")
        self.report(result)
