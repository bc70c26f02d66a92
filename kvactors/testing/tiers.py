"""Test tiers that check the contract from below, and where their work runs.

The toolkit is three pieces that stack over any tier.

* :class:`~kvactors.testing.recorder.RecordedTier` records what reached the tier and checks it,
  into a :class:`~kvactors.testing.recorder.TierRecord`.
  It checks for no submit after finish, one finish and rows unchanged while read.
  It records per-tier hit attribution and finalize times.
* :class:`~kvactors.testing.faults.FaultTier` injects faults drawn per job from a seeded RNG
  (:class:`~kvactors.testing.faults.Faults`).
* :class:`DeferredMemoryTier` is an in-memory tier whose job completions happen *later, elsewhere*,
  on a :class:`~kvactors.testing.deferrers.Deferrer`.
  On a :class:`~kvactors.testing.SimRuntime` they are deferred tasks the scheduler runs at random steps.
  On threads they run on a small fixed pool of worker threads.

Both wrappers are transparent.
The runtime takes the same paths with them as with the bare tier under them.
``RecordedTier(FaultTier(DiskTier(...), ...), rows_check=rows_hold)`` is what ``kvactors stress --tiers disk`` runs.
:class:`RecordingTier` is that stack over a :class:`DeferredMemoryTier`, the explorer's and stress's memory tier.
Its ``hooks`` argument chooses the hooks the memory tier declares.
So the explorer takes the paths with and without ``on_new_request``.
Violations are collected as strings in ``violations``.

The names the workloads use (``pattern``, ``rows_hold``, the deferrers, ``Faults``) are importable from here too.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvactors.actors import runtime as rt
from kvactors.testing.blocks import JUNK, pattern, rows_hold
from kvactors.testing.deferrers import Deferrer, SimDeferrer, ThreadDeferrer
from kvactors.testing.faults import LIES, Faults, FaultTier, ReportPlan, draw_mode, plan_report
from kvactors.testing.recorder import RecordedTier, TierRecord
from kvactors.tiers.base import HOOKS, SecondaryTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

__all__ = [
    "JUNK",
    "LIES",
    "DeferredMemoryTier",
    "Deferrer",
    "FaultTier",
    "Faults",
    "RecordedTier",
    "RecordingTier",
    "ReportPlan",
    "SimDeferrer",
    "ThreadDeferrer",
    "TierRecord",
    "draw_mode",
    "pattern",
    "plan_report",
    "rows_hold",
]


class DeferredMemoryTier(SecondaryTier):
    """An in-memory LRU tier of ``capacity_blocks`` keys.

    Every job ends on ``deferrer``, reported ok.
    A store holds its keys once its job ended.
    The bytes are not kept, as a load writes :func:`~kvactors.testing.blocks.pattern` of each key.
    A load of a key the tier no longer holds fails, and its rows are filled with junk.
    ``discard(keys)`` lets a :class:`~kvactors.testing.faults.FaultTier` above make a store's report per key.
    The tier declares the ``hooks`` it is given, every hook by default.
    A hook declared is inline only where ``inline_calls`` names it.

    Threading: calls come on the tier's actor, or inline.
    Jobs end on the deferrer's threads.
    One lock guards the key set.
    """

    def __init__(self, *, name: str, capacity_blocks: int, deferrer: Deferrer, max_inflight_jobs: int = 16,
                 inline_calls: Collection[str] = (), hooks: Collection[str] = HOOKS) -> None:
        super().__init__(name=name)
        self.capacity_blocks = capacity_blocks
        self.max_inflight_jobs = max_inflight_jobs  # type: ignore[misc]
        self.inline_calls = frozenset(inline_calls)  # type: ignore[misc]
        self.hooks = frozenset(hooks)  # type: ignore[misc]
        self.deferrer = deferrer
        self._lock = threading.Lock()
        self._blocks: OrderedDict[OffloadKey, None] = OrderedDict()

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        with self._lock:
            return [LookupResult.HIT if key in self._blocks else LookupResult.MISS for key in keys]

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def take_events(self) -> list[OffloadingEvent]:
        return []

    def _label(self, job: TransferJob) -> str:
        return f"{self.name} {'load' if job.is_promotion else 'store'} job {job.job_id}"

    def _report_ok(self, job: TransferJob, ok: bool) -> None:
        with contextlib.suppress(rt.ActorStoppedError):
            self.report(JobResult(job.job_id, ok, None if ok else "keys missing"))

    def submit_store(self, job: TransferJob) -> None:
        def finish() -> None:
            with self._lock:
                for key in job.keys:
                    self._blocks[key] = None
                    self._blocks.move_to_end(key)
                while len(self._blocks) > self.capacity_blocks:
                    self._blocks.popitem(last=False)
            self._report_ok(job, True)

        self.deferrer.defer(self._label(job), finish)

    def submit_load(self, job: TransferJob) -> None:
        assert self.pool is not None
        pool = self.pool
        block_bytes = int(pool.shape[1])

        def finish() -> None:
            with self._lock:
                present = all(key in self._blocks for key in job.keys)
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if present:
                    pool[row].copy_(pattern(key, block_bytes))
                else:
                    pool[row].fill_(JUNK)  # a torn read: must never be served
            self._report_ok(job, present)

        self.deferrer.defer(self._label(job), finish)

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """Forget ``keys`` (a store's report that leaves them out says so)."""
        with self._lock:
            for key in keys:
                self._blocks.pop(key, None)

    def stored_keys(self) -> list[OffloadKey]:
        with self._lock:
            return list(self._blocks)


class RecordingTier(RecordedTier):
    """A recorded, fault-injected :class:`DeferredMemoryTier`: ``RecordedTier(FaultTier(memory), rows_hold)``.

    ``faults`` and ``seed`` are the :class:`~kvactors.testing.faults.FaultTier`'s.
    The rest are the memory tier's, ``hooks`` included.
    ``keep_calls`` is the recorder's.
    """

    def __init__(self, *, name: str, capacity_blocks: int, deferrer: Deferrer, faults: Faults | None = None,
                 seed: int = 0, max_inflight_jobs: int = 16, keep_calls: bool = False,
                 inline_calls: Collection[str] = (), hooks: Collection[str] = HOOKS) -> None:
        self.memory = DeferredMemoryTier(name=name, capacity_blocks=capacity_blocks, deferrer=deferrer,
                                         max_inflight_jobs=max_inflight_jobs, inline_calls=inline_calls,
                                         hooks=hooks)
        self.fault_layer = FaultTier(self.memory, deferrer=deferrer, faults=faults or Faults(), seed=seed)
        super().__init__(self.fault_layer, rows_check=rows_hold, keep_calls=keep_calls)

    @property
    def faults(self) -> Faults:
        return self.fault_layer.faults

    @property
    def hangs(self) -> int:
        return self.fault_layer.hangs

    def stored_keys(self) -> list[OffloadKey]:
        return self.memory.stored_keys()
