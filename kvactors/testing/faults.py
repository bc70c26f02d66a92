"""Fault injection as one layer over any tier: :class:`FaultTier`.

:class:`FaultTier` wraps a tier: the in-memory test tier, a ``DiskTier``, a ``RedisTier``, or one of yours.
Per job, it draws from a seeded RNG what happens to the job (:class:`Faults`).

* The job may fail, reported ``success=False``.
* ``submit_*`` may raise.
* The job may stall, never reported, so that its deadline fires.
* The job may be slow, reported after a delay, possibly after its deadline.
* The job may end per key (``partial``).
  Some keys succeed, and the others fail, named in ``JobResult.successful_keys``.
* The report may be one a sloppy tier makes (``lie``).
  It may name a key of another job, give a list for a tuple, or name a key twice.
  It may be ``success=True`` naming only some keys, be sent twice, or be a report for a job that does not exist.

Every row of a promotion's key that must not become ready is filled with
:data:`~kvactors.testing.blocks.JUNK` first.
So serving it shows up as wrong bytes.
A store's report is made per key or sloppy only when the inner tier can forget the keys it leaves out.
That takes a ``discard(keys)`` method, as :class:`~kvactors.testing.tiers.DeferredMemoryTier` has.
A store's report must say what the tier holds.
With ``Faults.hang``, a call that is not inline may leave the tier's actor *stuck in it* for ``hang_s``
(see :meth:`~kvactors.testing.deferrers.Deferrer.hang`).
The report of a job submitted by a stuck call comes after the thaw.
With ``lookup_raise``, a lookup raises, and the runtime answers ``RETRY``.

The layer is transparent, as a :class:`~kvactors.tiers.wrapper.DelegatingTier`.
The runtime takes the same paths with it as with the bare inner tier.
Threading is the inner tier's.
The layer's own state is under one lock, because reports come from any thread.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvactors.actors import runtime as rt
from kvactors.testing.blocks import JUNK
from kvactors.testing.deferrers import Deferrer
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-job fault probabilities of a :class:`FaultTier`."""

    fail: float = 0.0  # reported with success=False
    raise_: float = 0.0  # submit_* raises
    stall: float = 0.0  # never reported (the deadline fires; rows stay held)
    slow: float = 0.0  # reported after slow_s (virtual seconds in a simulation)
    slow_s: float = 1.0
    lookup_raise: float = 0.0  # lookup raises (the runtime answers RETRY)
    partial: float = 0.0  # the job ends per key: some keys succeed, the others fail
    lie: float = 0.0  # a sloppy report (see the module docstring)
    hang: float = 0.0  # a call that is not inline leaves the actor stuck in it for hang_s (its own draw)
    hang_s: float = 10.0

    @classmethod
    def parse(cls, text: str, slow_s: float = 1.0) -> Faults:
        """``"fail=0.05,raise=0.01,stall=0.01,slow=0.05"`` -> Faults."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            name = {"raise": "raise_"}.get(name.strip(), name.strip())
            if name not in cls.__dataclass_fields__ or name == "slow_s":
                raise ValueError(f"unknown fault {name!r}")
            values[name] = float(value)
        return cls(slow_s=slow_s, **values)


LIES = ("stranger", "list", "duplicate", "success_some", "twice", "unknown_job")
"""The sloppy reports of the ``lie`` fault."""


@dataclass(frozen=True, slots=True)
class ReportPlan:
    """How a job of a fault tier is reported.

    ``results`` are sent in order.
    ``ready`` holds the keys the runtime may make ready (or count as stored) from them.
    """

    results: tuple[JobResult, ...]
    ready: frozenset[OffloadKey]
    extra: int = 0  # reports the runtime must count as unexpected


def plan_report(job: TransferJob, mode: str, rng: random.Random, error: str = "planted failure") -> ReportPlan:
    """The report(s) of ``job`` under fault ``mode`` (``ok``, ``fail``, ``partial`` or ``lie``)."""
    keys = tuple(dict.fromkeys(job.keys))
    job_id = job.job_id
    if mode == "ok":
        return ReportPlan((JobResult(job_id, True),), frozenset(keys))
    if mode == "partial":
        ok = tuple(key for key in keys if rng.random() < 0.5)
        return ReportPlan((JobResult(job_id, False, "planted partial failure", successful_keys=ok),), frozenset(ok))
    if mode != "lie":
        return ReportPlan((JobResult(job_id, False, error),), frozenset())
    lie = rng.choice(LIES)
    some = tuple(key for key in keys if rng.random() < 0.5)
    if lie == "stranger":  # names a key of no job of its: nothing may become ready
        return ReportPlan((JobResult(job_id, True, None, (*keys, b"stranger-key")),), frozenset())
    if lie == "list":  # not a tuple: nothing may become ready
        return ReportPlan((JobResult(job_id, True, None, list(keys)),), frozenset())  # type: ignore[arg-type]
    if lie == "duplicate":  # a key named twice counts once
        return ReportPlan((JobResult(job_id, False, "planted", (*some, *some)),), frozenset(some))
    if lie == "success_some":  # success=True, yet the keys not named failed
        return ReportPlan((JobResult(job_id, True, None, some),), frozenset(some))
    if lie == "twice":  # the second report is not the job's any more
        result = JobResult(job_id, True)
        return ReportPlan((result, result), frozenset(keys), extra=1)
    return ReportPlan((JobResult(job_id, True), JobResult(-job_id - 1, True)), frozenset(keys), extra=1)


def draw_mode(faults: Faults, rng: random.Random) -> str:
    """What happens to the next job: ``fail``, ``raise``, ``stall``, ``slow``, ``partial``, ``lie`` or ``ok``."""
    x = rng.random()
    for mode, p in (("fail", faults.fail), ("raise", faults.raise_), ("stall", faults.stall), ("slow", faults.slow),
                    ("partial", faults.partial), ("lie", faults.lie)):
        if x < p:
            return mode
        x -= p
    return "ok"



@dataclass(frozen=True, slots=True)
class _Planned:
    """A job's fate, drawn at its submit.

    For ``partial`` and ``lie``, ``plan`` replaces a successful report.
    """

    mode: str
    job: TransferJob
    plan: ReportPlan | None
    delay_s: float


class FaultTier(DelegatingTier):
    """``inner`` with faults injected (see the module docstring).

    It draws from ``Random(f"{seed}/{name}")``.
    These say what it did:

    * ``stalled``, the ids of jobs never reported;
    * ``extra_reports``, reports the runtime must count as unexpected;
    * ``jobs`` and ``hangs``.
    """

    def __init__(self, inner: SecondaryTier, *, deferrer: Deferrer, faults: Faults = Faults(), seed: int = 0,
                 max_inflight_jobs: int | None = None) -> None:
        super().__init__(inner, max_inflight_jobs=max_inflight_jobs)
        self.deferrer = deferrer
        self.faults = faults
        self.rng = random.Random(f"{seed}/{inner.name}")
        self._hang_rng = random.Random(f"{seed}/{inner.name}/hang")  # its own: the other faults draw as without it
        self._lock = threading.Lock()
        self._planned: dict[int, _Planned] = {}
        self._stalled: set[int] = set()
        self.extra_reports = 0
        self.jobs = 0
        self.hangs = 0

    @property
    def stalled(self) -> set[int]:
        """The jobs this layer will never report (a copy)."""
        with self._lock:
            return set(self._stalled)

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        SecondaryTier.attach(self, pool, report)  # the inner tier reports to this layer, not to the runtime
        self.inner.attach(pool, self._inner_report)

    # ------------------------------------------------------------ calls

    def _maybe_hang(self, call: str) -> float:
        """Perhaps get stuck in ``call``.

        It never gets stuck in an inline call, so that promise is kept.
        """
        if not self.faults.hang or call in self.inline_calls or self._hang_rng.random() >= self.faults.hang:
            return 0.0
        with self._lock:
            self.hangs += 1
        return self.deferrer.hang(self.faults.hang_s)

    def _submit(self, call: str, job: TransferJob) -> None:
        stuck_for = self._maybe_hang(call)
        mode = draw_mode(self.faults, self.rng)
        if mode == "raise":
            raise RuntimeError(f"planted submit failure in tier {self.name}")
        delay = self.faults.slow_s * (0.5 + self.rng.random()) if mode == "slow" else 0.0
        plan = plan_report(job, mode, self.rng) if mode in ("partial", "lie") else None
        with self._lock:
            self.jobs += 1
            self._planned[job.job_id] = _Planned(mode, job, plan, delay + stuck_for)
            if mode == "stall":
                self._stalled.add(job.job_id)
        try:
            getattr(self.inner, call)(job)  # it may report at once: the plan is in place
        except BaseException:
            with self._lock:  # the runtime reports the job failed itself
                self._planned.pop(job.job_id, None)
                self._stalled.discard(job.job_id)
            raise

    def submit_store(self, job: TransferJob) -> None:
        self._submit("submit_store", job)

    def submit_load(self, job: TransferJob) -> None:
        self._submit("submit_load", job)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        if self.faults.lookup_raise and self.rng.random() < self.faults.lookup_raise:
            raise RuntimeError(f"planted lookup failure in tier {self.name}")
        self._maybe_hang("lookup")
        return self.inner.lookup(keys, ctx)

    def on_new_request(self, ctx: ReqContext) -> None:
        self._maybe_hang("on_new_request")
        self.inner.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._maybe_hang("on_request_finished")
        self.inner.on_request_finished(ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._maybe_hang("touch")
        self.inner.touch(keys, ctx)

    def take_events(self) -> list[OffloadingEvent]:
        self._maybe_hang("take_events")
        return self.inner.take_events()

    def drain(self, timeout: float | None) -> None:
        self._maybe_hang("drain")
        self.inner.drain(timeout)

    # ------------------------------------------------------------ reports

    def _inner_report(self, result: JobResult) -> None:
        """The inner tier's report, from any thread.

        The planned fate of its job is applied to it.
        """
        with self._lock:
            planned = self._planned.pop(result.job_id, None) if isinstance(result, JobResult) else None
        if planned is None:  # not a job of ours (the inner tier's own sloppiness): the runtime judges it
            self._send((result,), None, None)
            return
        if planned.mode == "stall":
            return
        job = planned.job
        results: tuple[JobResult, ...] = (result,)
        ready: frozenset[OffloadKey] | None = None  # None: the inner tier's verdict stands, rows as it left them
        extra = 0
        forget = getattr(self.inner, "discard", None)
        if planned.mode == "fail" and (job.is_promotion or forget is not None):
            results, ready = (JobResult(job.job_id, False, "planted failure"),), frozenset()
        elif planned.mode == "fail":
            results = (JobResult(job.job_id, False, "planted failure"),)
        elif planned.plan is not None and result.success and (job.is_promotion or forget is not None):
            results, ready, extra = planned.plan.results, planned.plan.ready, planned.plan.extra
        if ready is not None and not job.is_promotion and forget is not None:
            forget([key for key in job.keys if key not in ready])  # the tier holds what its report says
        def send() -> None:
            self._send(results, job if job.is_promotion else None, ready, extra)

        if planned.delay_s > 0:
            self.deferrer.defer(f"{self.name} late report of job {job.job_id}", send, planned.delay_s)
        else:
            send()

    def _send(self, results: tuple[JobResult, ...], job: TransferJob | None, ready: frozenset[OffloadKey] | None,
              extra: int = 0) -> None:
        if job is not None and ready is not None:
            assert self.pool is not None
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if key not in ready:
                    self.pool[row].fill_(JUNK)  # a torn read: must never be served
        with self._lock:
            self.extra_reports += extra
        for result in results:
            with contextlib.suppress(rt.ActorStoppedError):
                self.report(result)
