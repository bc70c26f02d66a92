"""Counters for metrics, kept where the work happens: plain ints on one actor's state.

No locks and no threads: each counter object belongs to one actor (the
supervisor's :class:`JobCounters`, the primary's :class:`PrimaryCounters`),
which updates it inside its handlers and copies it into a
:class:`MetricsSnapshot` when asked (:mod:`kvactors.metrics` reads that,
one round trip per scrape). An update is a few dict or attribute increments:
no logging, no allocation beyond a tuple key.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvactors.types import PRIMARY_TIER_NAME, LookupResult

DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
"""Upper bounds (seconds) of the job duration histogram's buckets; one more bucket, +Inf, follows."""

OUTCOMES = ("ok", "failed", "timed_out")


class PrimaryCounters:
    """The primary tier's counters (tier ``"cpu"``), owned by its actor.

    ``store_*``: ``prepare_store`` calls whose keys were completed (``ok``:
    ``complete_store(success=True)``, ``failed``: ``success=False``) or
    passed their deadline (``timed_out``); ``load_ok``: ``complete_load``
    calls; ``*_blocks``: blocks stored (made ready) and loaded (unpinned
    after a load).
    """

    __slots__ = ("hit_keys", "load_ok", "loaded_blocks", "lookup_keys", "store_failed", "store_ok",
                 "store_timed_out", "stored_blocks")

    def __init__(self) -> None:
        self.lookup_keys = 0
        self.hit_keys = 0
        self.store_ok = 0
        self.store_failed = 0
        self.store_timed_out = 0
        self.stored_blocks = 0
        self.load_ok = 0
        self.loaded_blocks = 0

    def copy(self) -> PrimaryCounters:
        out = PrimaryCounters()
        for name in self.__slots__:
            setattr(out, name, getattr(self, name))
        return out

    def lookup(self, results: list[LookupResult]) -> None:
        self.lookup_keys += len(results)
        self.hit_keys += results.count(LookupResult.HIT)


class JobCounters:
    """The supervisor's counters of the secondary tiers' lookups and jobs, by tier and kind
    (``cascade``, ``promotion``), owned by its actor."""

    def __init__(self, tiers: Iterable[str]) -> None:
        tiers = tuple(tiers)
        self.lookup_keys: dict[str, int] = dict.fromkeys(tiers, 0)
        self.hit_keys: dict[str, int] = dict.fromkeys(tiers, 0)
        self.started: Counter[tuple[str, str]] = Counter()
        self.dropped: Counter[tuple[str, str]] = Counter()
        self.ended: Counter[tuple[str, str, str]] = Counter()
        self.blocks: Counter[tuple[str, str]] = Counter()  # blocks of successful jobs
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.duration_sum: dict[tuple[str, str], float] = {}

    def asked(self, tier: str, keys: int) -> None:
        self.lookup_keys[tier] += keys

    def answered(self, answers: Mapping[str, Sequence[LookupResult] | None]) -> None:
        hit = LookupResult.HIT
        for tier, answer in answers.items():
            if answer:
                self.hit_keys[tier] += answer.count(hit)

    def job_started(self, tier: str, kind: str) -> None:
        self.started[(tier, kind)] += 1

    def job_dropped(self, tier: str, kind: str) -> None:
        """A job that never reached its tier (a reset, a stop, its request gone)."""
        self.dropped[(tier, kind)] += 1

    def job_ended(self, tier: str, kind: str, outcome: str, blocks: int, duration_s: float) -> None:
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
    """One duration histogram: per-bucket (not cumulative) counts, the last one +Inf; the sum in seconds."""

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

    Keyed by tier name (``"cpu"`` for the primary) and, for jobs, by kind
    (``store``, ``load`` at ``cpu``; ``cascade``, ``promotion`` at a secondary
    tier) and outcome (``ok``, ``failed``, ``timed_out``). Block counts, not
    bytes: the reader multiplies by the pool's ``block_bytes``.
    """

    stats: dict[str, int | float]
    pool_blocks: dict[str, int]
    lookup_keys: dict[str, int]
    hit_keys: dict[str, int]
    stored_blocks: dict[str, int]
    loaded_blocks: dict[str, int]
    evicted_keys: dict[str, int]
    jobs: dict[tuple[str, str, str], int]
    jobs_started: dict[tuple[str, str], int]
    jobs_dropped: dict[tuple[str, str], int]
    durations: dict[tuple[str, str], Histogram]
    jobs_queued: dict[str, int]
    jobs_in_flight: dict[str, int]


def snapshot(primary: PrimaryCounters, pool_blocks: dict[str, int], evicted_keys: int, jobs: JobCounters,
             stats: dict[str, int | float], queued: Mapping[str, int], in_flight: Mapping[str, int]) -> MetricsSnapshot:
    """Combine the primary's part (a copy of its counters, its pool's states) with the supervisor's."""
    cpu = PRIMARY_TIER_NAME
    tiers = tuple(jobs.lookup_keys)
    stored = {cpu: primary.stored_blocks, **dict.fromkeys(tiers, 0)}
    loaded = {cpu: primary.loaded_blocks, **dict.fromkeys(tiers, 0)}
    for (tier, kind), blocks in jobs.blocks.items():
        (stored if kind == "cascade" else loaded)[tier] += blocks
    ended: dict[tuple[str, str, str], int] = {
        (cpu, "store", "ok"): primary.store_ok,
        (cpu, "store", "failed"): primary.store_failed,
        (cpu, "store", "timed_out"): primary.store_timed_out,
        (cpu, "load", "ok"): primary.load_ok,
    }
    keys = [(tier, kind) for tier in tiers for kind in ("cascade", "promotion")]
    for tier, kind in keys:
        for outcome in OUTCOMES:
            ended[(tier, kind, outcome)] = jobs.ended[(tier, kind, outcome)]
    empty = [0] * (len(DURATION_BUCKETS) + 1)
    return MetricsSnapshot(
        stats=stats,
        pool_blocks=pool_blocks,
        lookup_keys={cpu: primary.lookup_keys, **jobs.lookup_keys},
        hit_keys={cpu: primary.hit_keys, **jobs.hit_keys},
        stored_blocks=stored,
        loaded_blocks=loaded,
        evicted_keys={cpu: evicted_keys},
        jobs=ended,
        jobs_started={key: jobs.started[key] for key in keys},
        jobs_dropped={key: jobs.dropped[key] for key in keys},
        durations={key: Histogram(tuple(jobs.buckets.get(key, empty)), jobs.duration_sum.get(key, 0.0))
                   for key in keys},
        jobs_queued=dict(queued),
        jobs_in_flight=dict(in_flight),
    )
