"""Counters, kept where the work happens: plain ints on one actor's state.

Each actor has one counter object, which it updates inside its handlers.
The primary's is :class:`PrimaryCounters`, the supervisor's
:class:`SupervisorCounters`. ``stats()`` and a :class:`MetricsSnapshot`
(:mod:`kvactors.metrics`, one round trip per scrape) both derive from those
two, copied on the actors' thread. :class:`PrimaryFigures` carries the
primary's part to the supervisor, where :mod:`kvactors.core.statsbook`
reads both into a :class:`~kvactors.core.snapshot.StatsSnapshot`. Each event
is counted once. A total that is the sum of finer counts is derived from
them when asked. An update is a few attribute or dict increments, with no
logging and no allocation beyond a tuple key. No locks and no threads.
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvactors.core.jobkinds import TIER_JOB_KINDS, JobKind, JobOutcome
from kvactors.core.snapshot import ControlFigures, PoolFigures, StatsSnapshot, SupervisorTotals
from kvactors.types import PRIMARY_TIER_NAME, LookupResult

DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
"""Upper bounds (seconds) of the job duration histogram's buckets; one more bucket, +Inf, follows."""

OUTCOMES: tuple[JobOutcome, ...] = tuple(JobOutcome)


class PrimaryCounters:
    """The primary tier's counters (tier ``"cpu"``), owned by its actor.

    ``store_*`` count the ``prepare_store`` calls whose keys were completed, or passed their deadline.
    ``ok`` is ``complete_store(success=True)`` and ``failed`` is ``success=False``.
    ``timed_out`` is a store with at least one key still pending at its deadline.
    ``store_keys_timed_out`` counts those keys.
    ``load_ok`` counts ``complete_load`` calls.
    ``*_blocks`` count the blocks stored (made ready) and loaded (unpinned after a load).
    ``contract_violations`` counts misuse found in its non-blocking calls.
    ``promotions_refused`` counts the lookups whose promotions the pool could not hold (all or some).
    """

    __slots__ = ("contract_violations", "hit_keys", "load_ok", "loaded_blocks", "lookup_keys", "promotions_refused",
                 "store_failed", "store_keys_timed_out", "store_ok", "store_timed_out", "stored_blocks")

    def __init__(self) -> None:
        self.lookup_keys = 0
        self.hit_keys = 0
        self.store_ok = 0
        self.store_failed = 0
        self.store_timed_out = 0
        self.store_keys_timed_out = 0
        self.stored_blocks = 0
        self.load_ok = 0
        self.loaded_blocks = 0
        self.contract_violations = 0
        self.promotions_refused = 0

    def copy(self) -> PrimaryCounters:
        """A copy of every count now (the figures carry it to the supervisor's handler)."""
        return copy.copy(self)

    def lookup(self, results: list[LookupResult]) -> None:
        self.lookup_keys += len(results)
        self.hit_keys += results.count(LookupResult.HIT)


@dataclass(frozen=True, slots=True)
class PrimaryFigures:
    """The primary's part of ``stats()`` and of a metrics snapshot, copied on its thread.

    ``pool`` is :meth:`~kvactors.core.pool.BlockPool.figures`.
    ``pool_blocks`` is its rows by state (:meth:`~kvactors.core.pool.BlockPool.state_counts`).
    """

    counters: PrimaryCounters
    pool: PoolFigures
    pool_blocks: dict[str, int]
    evicted_keys: int
    event_keys_dropped: int
    requests: int
    blocks_reserved: int
    internal_errors: int
    controls: ControlFigures  # admission and back-pressure


class SupervisorCounters:
    """The supervisor's counters, owned by its actor: the secondary tiers' lookups and jobs,
    by tier and kind (``cascade``, ``promotion``), and the events of its own books.

    The totals ``stats()`` shows for jobs (``jobs_submitted``, ``jobs_succeeded``,
    ``jobs_failed``, ``jobs_timed_out``, ``jobs_dropped``) are sums of the per-tier
    counts (:meth:`totals`), never counted twice. The counts of single events
    are int attributes, each named as its ``stats()`` key."""

    def __init__(self, tiers: Iterable[str]) -> None:
        tiers = tuple(tiers)
        self.lookup_keys: dict[str, int] = dict.fromkeys(tiers, 0)
        self.hit_keys: dict[str, int] = dict.fromkeys(tiers, 0)
        self.started: Counter[tuple[str, JobKind]] = Counter()
        self.dropped: Counter[tuple[str, JobKind]] = Counter()
        self.ended: Counter[tuple[str, JobKind, JobOutcome]] = Counter()
        self.blocks: Counter[tuple[str, JobKind]] = Counter()  # blocks of successful jobs
        self.buckets: dict[tuple[str, JobKind], list[int]] = {}
        self.duration_sum: dict[tuple[str, JobKind], float] = {}
        self.late_reports = 0
        self.unexpected_reports = 0
        self.invalid_reports = 0
        self.jobs_partial = 0
        self.job_keys_failed = 0
        self.promotion_hits_ignored = 0
        self.lookups_timed_out = 0
        self.requests_finalized = 0
        self.guard_violations = 0
        self.gathers_incomplete = 0
        self.inline_calls_demoted = 0

    def totals(self) -> SupervisorTotals:
        """Every count of this actor that ``stats()`` shows."""
        ended: Counter[JobOutcome] = Counter()
        for (_, _, outcome), count in self.ended.items():
            ended[outcome] += count
        return SupervisorTotals(
            jobs_submitted=sum(self.started.values()),
            jobs_succeeded=ended[JobOutcome.OK],
            jobs_failed=ended[JobOutcome.FAILED],
            jobs_timed_out=ended[JobOutcome.TIMED_OUT],
            jobs_dropped=sum(self.dropped.values()),
            late_reports=self.late_reports,
            unexpected_reports=self.unexpected_reports,
            invalid_reports=self.invalid_reports,
            jobs_partial=self.jobs_partial,
            job_keys_failed=self.job_keys_failed,
            promotion_hits_ignored=self.promotion_hits_ignored,
            lookups_timed_out=self.lookups_timed_out,
            requests_finalized=self.requests_finalized,
            guard_violations=self.guard_violations,
            gathers_incomplete=self.gathers_incomplete,
            inline_calls_demoted=self.inline_calls_demoted,
        )

    def asked(self, tier: str, keys: int) -> None:
        self.lookup_keys[tier] += keys

    def answered(self, answers: Mapping[str, Sequence[LookupResult] | None]) -> None:
        hit = LookupResult.HIT
        for tier, answer in answers.items():
            if answer:
                self.hit_keys[tier] += answer.count(hit)

    def job_started(self, tier: str, kind: JobKind) -> None:
        self.started[(tier, kind)] += 1

    def job_dropped(self, tier: str, kind: JobKind) -> None:
        """A job that never reached its tier (a reset, a stop, its request gone)."""
        self.dropped[(tier, kind)] += 1

    def job_ended(self, tier: str, kind: JobKind, outcome: JobOutcome, blocks: int, duration_s: float) -> None:
        key = (tier, kind)
        self.ended[(tier, kind, outcome)] += 1
        if blocks:
            self.blocks[key] += blocks
        counts = self.buckets.get(key)
        if counts is None:
            counts = self.buckets[key] = [0] * (len(DURATION_BUCKETS) + 1)
        counts[bisect_left(DURATION_BUCKETS, duration_s)] += 1
        self.duration_sum[key] = self.duration_sum.get(key, 0.0) + duration_s


@dataclass(frozen=True, slots=True)
class Histogram:
    """One duration histogram.

    ``counts`` are per bucket (not cumulative), the last one +Inf.
    ``sum_s`` is the sum in seconds.
    """

    counts: tuple[int, ...]
    sum_s: float

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ending with ``+Inf``."""
        out, total = [], 0
        for bound, count in zip((*map(repr, DURATION_BUCKETS), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Every figure the metrics show, copied in one pass on the actors' thread.

    ``figures`` is what ``stats()`` shows, typed (:attr:`stats` is its dict).
    The rest is keyed by tier name (``"cpu"`` for the primary).
    Jobs are also keyed by kind and outcome (``ok``, ``failed``, ``timed_out``).
    The kinds are ``store`` and ``load`` at ``cpu``, and ``cascade`` and ``promotion`` at a secondary tier.
    The figures are block counts, not bytes.
    The reader multiplies by the pool's ``block_bytes``.
    """

    figures: StatsSnapshot
    pool_blocks: dict[str, int]
    lookup_keys: dict[str, int]
    hit_keys: dict[str, int]
    stored_blocks: dict[str, int]
    loaded_blocks: dict[str, int]
    evicted_keys: dict[str, int]
    jobs: dict[tuple[str, JobKind, JobOutcome], int]
    jobs_started: dict[tuple[str, JobKind], int]
    jobs_dropped: dict[tuple[str, JobKind], int]
    durations: dict[tuple[str, JobKind], Histogram]
    jobs_queued: dict[str, int]
    jobs_in_flight: dict[str, int]

    @property
    def stats(self) -> dict[str, int | float]:
        """The ``stats()`` dict of :attr:`figures`."""
        return self.figures.as_dict()


def snapshot(figures: PrimaryFigures, jobs: SupervisorCounters, stats: StatsSnapshot,
             queued: Mapping[str, int], in_flight: Mapping[str, int]) -> MetricsSnapshot:
    """Combine the primary's part with the supervisor's."""
    primary = figures.counters
    cpu = PRIMARY_TIER_NAME
    tiers = tuple(jobs.lookup_keys)
    stored = {cpu: primary.stored_blocks, **dict.fromkeys(tiers, 0)}
    loaded = {cpu: primary.loaded_blocks, **dict.fromkeys(tiers, 0)}
    for (tier, kind), blocks in jobs.blocks.items():
        (stored if kind is JobKind.CASCADE else loaded)[tier] += blocks
    ended: dict[tuple[str, JobKind, JobOutcome], int] = {
        (cpu, JobKind.STORE, JobOutcome.OK): primary.store_ok,
        (cpu, JobKind.STORE, JobOutcome.FAILED): primary.store_failed,
        (cpu, JobKind.STORE, JobOutcome.TIMED_OUT): primary.store_timed_out,
        (cpu, JobKind.LOAD, JobOutcome.OK): primary.load_ok,
    }
    keys = [(tier, kind) for tier in tiers for kind in TIER_JOB_KINDS]
    for tier, kind in keys:
        for outcome in OUTCOMES:
            ended[(tier, kind, outcome)] = jobs.ended[(tier, kind, outcome)]
    empty = [0] * (len(DURATION_BUCKETS) + 1)
    return MetricsSnapshot(
        figures=stats,
        pool_blocks=figures.pool_blocks,
        lookup_keys={cpu: primary.lookup_keys, **jobs.lookup_keys},
        hit_keys={cpu: primary.hit_keys, **jobs.hit_keys},
        stored_blocks=stored,
        loaded_blocks=loaded,
        evicted_keys={cpu: figures.evicted_keys},
        jobs=ended,
        jobs_started={key: jobs.started[key] for key in keys},
        jobs_dropped={key: jobs.dropped[key] for key in keys},
        durations={key: Histogram(tuple(jobs.buckets.get(key, empty)), jobs.duration_sum.get(key, 0.0))
                   for key in keys},
        jobs_queued=dict(queued),
        jobs_in_flight=dict(in_flight),
    )
