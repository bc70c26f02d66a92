"""Test tiers that check the contract from below, and where their work runs.

:class:`RecordingTier` is a :class:`~kvactors.tiers.base.SecondaryTier` whose
job completions happen *later, elsewhere* (a :class:`Deferrer`): on a
:class:`~kvactors.testing.SimRuntime` they are deferred tasks the scheduler runs at
random steps; on threads a small fixed pool of worker threads runs them (never
a thread per job). Faults are drawn per job from a seeded RNG: a job may fail,
``submit_*`` may raise, a job may stall (never reported: its deadline fires),
or be slow (reported after a delay, possibly after its deadline); it may end
per key (``partial``: some keys succeed, the others fail, named in
``JobResult.successful_keys``), or its report may be one a sloppy tier makes
(``lie``: a key of another job named, a list for a tuple, a key named twice,
``success=True`` naming only some keys, the report sent twice, a report for
a job that does not exist). Every row of a key that must not become ready
(failed, or under a report the runtime must reject) is filled with junk
first, so serving it shows up as wrong bytes. With ``Faults.hang``, a call
(any that is not inline) may leave the tier's actor *stuck in it* for ``hang_s``: on threads the call blocks; on a
:class:`~kvactors.testing.SimRuntime` the actor handles nothing more until virtual
time reaches its thaw.

It asserts, per request attempt, what a tier can see of the contract:

* at most one ``on_request_finished`` per ``(req_id, attempt)``;
* no ``submit_store``/``submit_load`` after it;
* the pool rows of a cascade hold the block's bytes both when the job is
  submitted and when the tier reads them later (a row reused while a tier
  reads it shows up as a mismatch; every ready block's bytes are
  :func:`pattern` of its key, written by the workload's copies).

Violations are collected as strings in :attr:`RecordingTier.violations`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvactors.actors import runtime as rt
from kvactors.tiers.base import SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

# --------------------------------------------------------------------- block bytes

_patterns: dict[tuple[OffloadKey, int], torch.Tensor] = {}
_patterns_lock = threading.Lock()


def pattern(key: OffloadKey, block_bytes: int) -> torch.Tensor:
    """The bytes a block of ``key`` holds (deterministic, distinct per key)."""
    cached = _patterns.get((key, block_bytes))
    if cached is not None:
        return cached
    digest = hashlib.blake2b(key, digest_size=32).digest()
    raw = (digest * (block_bytes // len(digest) + 1))[:block_bytes]
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with _patterns_lock:
        if len(_patterns) > 100_000:
            _patterns.clear()
        _patterns[(key, block_bytes)] = tensor
    return tensor


def rows_hold(pool: torch.Tensor, keys: Sequence[OffloadKey], rows: Sequence[int]) -> list[int]:
    """Positions where ``pool[row]`` does not hold ``pattern(key)``."""
    block_bytes = int(pool.shape[1])
    return [i for i, (key, row) in enumerate(zip(keys, rows, strict=True))
            if not torch.equal(pool[row], pattern(key, block_bytes))]


# --------------------------------------------------------------------- where later work runs


class Deferrer(Protocol):
    """Runs work "on another thread", now-ish or after a delay."""

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None: ...

    def hang(self, seconds: float) -> float:
        """Leave the calling tier call stuck for ``seconds``. Returns the delay still
        to add to the work the call schedules (0 where the call really blocked)."""
        ...


@dataclass(frozen=True, slots=True)
class _RunTask:
    label: str
    task: Callable[[], None]


class _TaskActor(rt.Actor):
    name = "sim-tasks"

    @rt.handles(_RunTask)
    def _on_run(self, msg: _RunTask) -> None:
        self.runtime.defer(msg.label, msg.task)  # type: ignore[attr-defined]


class SimDeferrer:
    """Deferred tasks of a :class:`~kvactors.testing.SimRuntime`; delays are virtual time."""

    def __init__(self, runtime: object) -> None:
        self.runtime = runtime
        self._ref = runtime.spawn(_TaskActor(), "sim-tasks")  # type: ignore[attr-defined]

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None:
        if delay_s <= 0:
            self.runtime.defer(label, task)  # type: ignore[attr-defined]
        else:
            self.runtime.call_later(delay_s, self._ref, _RunTask(label, task))  # type: ignore[attr-defined]

    def hang(self, seconds: float) -> float:
        """The actor is stuck from the moment the call returns; what the call started happens after the thaw."""
        return seconds if self.runtime.hang_current(seconds) else 0.0  # type: ignore[attr-defined]


class ThreadDeferrer:
    """A fixed pool of worker threads running tasks, each at or after its time."""

    def __init__(self, workers: int = 2, name: str = "kvactors-deferred") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._running = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None:
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + max(delay_s, 0.0), next(self._seq), task))
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(self._heap[0][0] - time.monotonic(), 0.0))
                if self._closed:
                    return
                _, _, task = heapq.heappop(self._heap)
                self._running += 1
            try:
                task()
            except Exception as exc:  # a task's failure is a finding, not a crash
                self.errors.append(f"deferred task raised {exc!r}")
            finally:
                with self._cond:
                    self._running -= 1

    def hang(self, seconds: float) -> float:
        """Block the calling thread for ``seconds`` (or until :meth:`close`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed, seconds)
        return 0.0

    def pending(self) -> int:
        """Tasks waiting or running."""
        with self._cond:
            return len(self._heap) + self._running

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)


# --------------------------------------------------------------------- the tier


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-job fault probabilities of a :class:`RecordingTier`."""

    fail: float = 0.0  # reported with success=False
    raise_: float = 0.0  # submit_* raises
    stall: float = 0.0  # never reported (the deadline fires; rows stay held)
    slow: float = 0.0  # reported after slow_s (virtual seconds in a simulation)
    slow_s: float = 1.0
    lookup_raise: float = 0.0  # lookup raises (the runtime answers RETRY)
    partial: float = 0.0  # the job ends per key: some keys succeed, the others fail
    lie: float = 0.0  # a sloppy report (see the module docstring)
    hang: float = 0.0  # a call that is not inline leaves the actor stuck in it for hang_s
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


JUNK = 0xEE
"""What a row of a key that must not become ready is filled with."""

LIES = ("stranger", "list", "duplicate", "success_some", "twice", "unknown_job")
"""The sloppy reports of the ``lie`` fault."""


@dataclass(frozen=True, slots=True)
class ReportPlan:
    """How a job of a fault tier is reported: ``results`` (sent in order) and ``ready``, the
    keys the runtime may make ready (or count as stored) from them."""

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


class RecordingTier(SecondaryTier):
    """An in-memory tier that checks the contract at its door; see the module docstring."""

    def __init__(self, *, name: str, capacity_blocks: int, deferrer: Deferrer, faults: Faults = Faults(),
                 seed: int = 0, max_inflight_jobs: int = 16, keep_calls: bool = False,
                 inline_calls: Collection[str] = ()) -> None:
        super().__init__(name=name)
        self.capacity_blocks = capacity_blocks
        self.max_inflight_jobs = max_inflight_jobs  # type: ignore[misc]
        self.inline_calls = frozenset(inline_calls)  # type: ignore[misc]
        self.deferrer = deferrer
        self.faults = faults
        self.rng = random.Random(f"{seed}/{name}")
        self._lock = threading.Lock()
        self._blocks: OrderedDict[OffloadKey, None] = OrderedDict()
        self.started: set[tuple[str, int]] = set()
        self.finished: dict[tuple[str, int], int] = {}
        self.violations: list[str] = []
        self.calls: list[str] | None = [] if keep_calls else None
        self.stalled: set[int] = set()
        self.jobs = 0
        self.reports = 0
        self.extra_reports = 0  # reports of jobs that do not exist (any more): the runtime counts them
        self.hangs = 0
        self._hang_rng = random.Random(f"{seed}/{name}/hang")  # its own: the other faults draw as before

    # ------------------------------------------------------------ recording

    def _maybe_hang(self, call: str) -> float:
        """Perhaps get stuck in ``call`` (never in an inline one: that promise is kept)."""
        if not self.faults.hang or call in self.inline_calls or self._hang_rng.random() >= self.faults.hang:
            return 0.0
        self.hangs += 1
        self._record(f"hang in {call} for {self.faults.hang_s:g} s")
        return self.deferrer.hang(self.faults.hang_s)

    def _record(self, text: str) -> None:
        if self.calls is not None:
            self.calls.append(text)

    def _violation(self, text: str) -> None:
        with self._lock:
            self.violations.append(f"tier {self.name}: {text}")

    def _check_submit(self, call: str, job: TransferJob) -> None:
        ctx = job.req_context
        self._record(f"{call} job={job.job_id} {ctx}")
        if ctx.identity in self.finished:
            self._violation(f"{call} of job {job.job_id} for {ctx} after on_request_finished")

    # ------------------------------------------------------------ hooks

    def on_new_request(self, ctx: ReqContext) -> None:
        self._record(f"on_new_request {ctx}")
        self.started.add(ctx.identity)
        self._maybe_hang("on_new_request")

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._record(f"on_request_finished {ctx}")
        self._maybe_hang("on_request_finished")
        count = self.finished.get(ctx.identity, 0) + 1
        self.finished[ctx.identity] = count
        if count > 1:
            self._violation(f"on_request_finished for {ctx} {count} times")

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        if self.faults.lookup_raise and self.rng.random() < self.faults.lookup_raise:
            raise RuntimeError(f"planted lookup failure in tier {self.name}")
        self._maybe_hang("lookup")
        with self._lock:
            return [LookupResult.HIT if key in self._blocks else LookupResult.MISS for key in keys]

    def take_events(self) -> list[OffloadingEvent]:
        self._maybe_hang("take_events")
        return []

    def drain(self, timeout: float | None) -> None:
        self._maybe_hang("drain")

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._maybe_hang("touch")
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    # ------------------------------------------------------------ jobs

    def _mode(self) -> str:
        return draw_mode(self.faults, self.rng)

    def _dispatch(self, job: TransferJob, finish: Callable[[ReportPlan], None]) -> None:
        self.jobs += 1
        stuck_for = self._maybe_hang("submit_load" if job.is_promotion else "submit_store")
        mode = self._mode()
        if mode == "raise":
            raise RuntimeError(f"planted submit failure in tier {self.name}")
        if mode == "stall":
            with self._lock:
                self.stalled.add(job.job_id)
            return
        label = f"{self.name} {'load' if job.is_promotion else 'store'} job {job.job_id}"
        delay = self.faults.slow_s * (0.5 + self.rng.random()) if mode == "slow" else 0.0
        plan = plan_report(job, "ok" if mode == "slow" else mode, self.rng)
        self.deferrer.defer(label, lambda: finish(plan), delay + stuck_for)

    def submit_store(self, job: TransferJob) -> None:
        self._check_submit("submit_store", job)
        assert self.pool is not None
        pool = self.pool
        bad = rows_hold(pool, job.keys, job.block_ids)
        if bad:
            self._violation(f"job {job.job_id} ({job.req_context}): rows {[job.block_ids[i] for i in bad]} "
                            "do not hold their blocks at submit_store")

        def finish(plan: ReportPlan) -> None:
            changed = rows_hold(pool, job.keys, job.block_ids)
            if changed:
                self._violation(f"job {job.job_id} ({job.req_context}): rows "
                                f"{[job.block_ids[i] for i in changed]} changed while the tier read them")
                plan = plan_report(job, "fail", self.rng)
            with self._lock:
                for key in job.keys:
                    if key in plan.ready:  # exactly the keys reported stored are in the tier
                        self._blocks[key] = None
                        self._blocks.move_to_end(key)
                while len(self._blocks) > self.capacity_blocks:
                    self._blocks.popitem(last=False)
            self._send_plan(plan)

        self._dispatch(job, finish)

    def submit_load(self, job: TransferJob) -> None:
        self._check_submit("submit_load", job)
        assert self.pool is not None
        pool = self.pool
        block_bytes = int(pool.shape[1])

        def finish(plan: ReportPlan) -> None:
            with self._lock:
                present = all(key in self._blocks for key in job.keys)
            if not present:
                plan = plan_report(job, "fail", self.rng)
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if key in plan.ready:
                    pool[row].copy_(pattern(key, block_bytes))
                else:
                    pool[row].fill_(JUNK)  # a torn read: must never be served
            self._send_plan(plan)

        self._dispatch(job, finish)

    def _send_plan(self, plan: ReportPlan) -> None:
        with self._lock:
            self.reports += 1
            self.extra_reports += plan.extra
        for result in plan.results:
            with contextlib.suppress(rt.ActorStoppedError):
                self.report(result)

    def stored_keys(self) -> list[OffloadKey]:
        with self._lock:
            return list(self._blocks)


class HooklessRecordingTier(RecordingTier):
    """A :class:`RecordingTier` that leaves ``on_new_request`` to the base class.

    The runtime sends no hook a tier does not override, so with these tiers the
    primary never announces a start and the supervisor opens each request's
    state with its first fact.
    """

    on_new_request = SecondaryTier.on_new_request

class FaultTier(DelegatingTier):
    """A real tier (disk, Redis, ...) with faults injected and the contract recorded at its door.

    Wraps ``inner``: ``submit_*`` may raise; a job's report may be turned into a
    failure, swallowed (a stall: its deadline fires) or delayed (slow); a
    successful promotion's report may be made per key (``partial``) or sloppy
    (``lie``), the rows of its keys that must not become ready filled with junk
    (a store's report is left alone there: it must say what the inner tier holds). Records
    finishes and submits per request attempt like :class:`RecordingTier` (no
    byte checks: the inner tier has its own).
    """

    def __init__(self, inner: SecondaryTier, *, deferrer: Deferrer, faults: Faults = Faults(), seed: int = 0,
                 max_inflight_jobs: int | None = None) -> None:
        super().__init__(inner, max_inflight_jobs=max_inflight_jobs)
        self.deferrer = deferrer
        self.faults = faults
        self.rng = random.Random(f"{seed}/{inner.name}")
        self._lock = threading.Lock()
        self._modes: dict[int, tuple[str, TransferJob]] = {}
        self.started: set[tuple[str, int]] = set()
        self.finished: dict[tuple[str, int], int] = {}
        self.violations: list[str] = []
        self.stalled: set[int] = set()
        self.extra_reports = 0

    def _mode(self) -> str:
        return draw_mode(self.faults, self.rng)

    def attach(self, pool: torch.Tensor, report: Callable[[JobResult], None]) -> None:
        SecondaryTier.attach(self, pool, report)  # the inner tier reports to us, not to the runtime
        self.inner.attach(pool, self._inner_report)

    def _inner_report(self, result: JobResult) -> None:
        with self._lock:
            mode, job = self._modes.pop(result.job_id, ("ok", None))
        if mode == "stall":
            return
        if mode == "fail":
            result = JobResult(result.job_id, False, "planted failure")
        if mode in ("partial", "lie") and job is not None and job.is_promotion and result.success:
            with self._lock:
                plan = plan_report(job, mode, self.rng)
                self.extra_reports += plan.extra
            assert self.pool is not None
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if key not in plan.ready:
                    self.pool[row].fill_(JUNK)  # a torn read: must never be served
            for planned in plan.results:
                self._send(planned)
            return
        if mode == "slow":
            delay = self.faults.slow_s * (0.5 + random.random())
            self.deferrer.defer(f"{self.name} slow report", lambda: self._send(result), delay)
        else:
            self._send(result)

    def _send(self, result: JobResult) -> None:
        with contextlib.suppress(rt.ActorStoppedError):
            self.report(result)

    def _submit(self, call: str, job: TransferJob) -> None:
        if job.req_context.identity in self.finished:
            with self._lock:
                self.violations.append(f"tier {self.name}: {call} of job {job.job_id} for {job.req_context} "
                                       "after on_request_finished")
        mode = self._mode()
        if mode == "raise":
            raise RuntimeError(f"planted submit failure in tier {self.name}")
        with self._lock:
            self._modes[job.job_id] = (mode, job)
            if mode == "stall":
                self.stalled.add(job.job_id)
        getattr(self.inner, call)(job)

    def submit_store(self, job: TransferJob) -> None:
        self._submit("submit_store", job)

    def submit_load(self, job: TransferJob) -> None:
        self._submit("submit_load", job)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        if self.faults.lookup_raise and self.rng.random() < self.faults.lookup_raise:
            raise RuntimeError(f"planted lookup failure in tier {self.name}")
        return self.inner.lookup(keys, ctx)

    def on_new_request(self, ctx: ReqContext) -> None:
        self.started.add(ctx.identity)
        super().on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        count = self.finished.get(ctx.identity, 0) + 1
        self.finished[ctx.identity] = count
        if count > 1:
            with self._lock:
                self.violations.append(f"tier {self.name}: on_request_finished for {ctx} {count} times")
        super().on_request_finished(ctx)
