"""The runtime's figures at one moment, typed: what ``stats()`` shows, field by field.

:class:`StatsSnapshot` is the one record ``stats()``, the metrics
(:class:`~kvactors.core.counters.MetricsSnapshot`), the vLLM stats and the
CLI read. :meth:`StatsSnapshot.as_dict` writes it as the ``stats()`` dict,
with the key names the docs give (``docs/metrics.md`` lists them). Per-tier
figures are a mapping by tier name here.
Only the dict packs the tier into the key (``tier_stuck.<name>``). Frozen values, built on the actors' thread
(:mod:`kvactors.core.statsbook`) and safe to read from any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The primary pool's rows by state, and its jobs (:meth:`~kvactors.core.pool.BlockPool.figures`).

    Each field is a ``stats()`` key of the same name.
    The ``blocks_*`` counts overlap (a pinned row is ready too).
    ``state_counts`` gives exclusive ones.
    """

    blocks_total: int
    blocks_free: int
    blocks_ready: int
    blocks_pending: int
    blocks_pinned: int
    blocks_detached: int
    blocks_evictable: int
    jobs_pinning: int
    jobs_held: int
    """Jobs whose rows the pool holds after their deadline (a job that pinned no row is not here)."""


@dataclass(frozen=True, slots=True)
class SupervisorTotals:
    """The supervisor's counted events (:meth:`~kvactors.core.counters.SupervisorCounters.totals`).

    Each field is a ``stats()`` key of the same name. The ``jobs_*`` totals are
    sums of the per-tier, per-kind counts the metrics show."""

    jobs_submitted: int
    jobs_succeeded: int
    jobs_failed: int
    jobs_timed_out: int
    jobs_dropped: int
    late_reports: int
    unexpected_reports: int
    invalid_reports: int
    jobs_partial: int
    job_keys_failed: int
    promotion_hits_ignored: int
    lookups_timed_out: int
    requests_finalized: int
    guard_violations: int
    gathers_incomplete: int
    inline_calls_demoted: int


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One secondary tier's state as the supervisor's watch sees it."""

    stuck: bool
    """Whether it owes answers and gave none for ``transfer_timeout_s`` (``tier_stuck.<name>``)."""
    silent_s: float
    """How long it has owed an answer, rounded to microseconds (``tier_silent_s.<name>``)."""


@dataclass(frozen=True, slots=True)
class CascadeFigures:
    """One secondary tier's back-pressure (:meth:`~kvactors.core.backpressure.Backpressure.figures`)."""

    dropped: int
    """Cascades to it dropped by back-pressure, all time (``cascades_dropped.<name>``)."""
    blocks_dropped: int
    """Their blocks (``cascade_blocks_dropped.<name>``)."""
    bytes_queued: int
    """Bytes of its cascades accepted and not ended yet (``cascade_bytes_queued.<name>``)."""


@dataclass(frozen=True, slots=True)
class ControlFigures:
    """Admission and back-pressure (``docs/controls.md``), as the primary counts them.

    Each int field is a ``stats()`` key of the same name."""

    cascades: Mapping[str, CascadeFigures]
    """Each secondary tier's back-pressure, by name, in the configured order."""
    write_back_jobs: int
    write_backs_pending: int
    write_back_blocks_dropped: int
    blocks_unwritten: int
    seen_keys: int
    cascade_jobs_queued: int

    @property
    def cascades_dropped(self) -> int:
        """Cascades dropped by back-pressure at every tier."""
        return sum(tier.dropped for tier in self.cascades.values())

    def as_dict(self) -> dict[str, int]:
        """Their ``stats()`` keys, in the order ``stats()`` always gave them."""
        out = {"cascades_dropped": self.cascades_dropped}
        for name, tier in self.cascades.items():
            out[f"cascades_dropped.{name}"] = tier.dropped
            out[f"cascade_blocks_dropped.{name}"] = tier.blocks_dropped
            out[f"cascade_bytes_queued.{name}"] = tier.bytes_queued
        out["write_back_jobs"] = self.write_back_jobs
        out["write_backs_pending"] = self.write_backs_pending
        out["write_back_blocks_dropped"] = self.write_back_blocks_dropped
        out["blocks_unwritten"] = self.blocks_unwritten
        out["seen_keys"] = self.seen_keys
        out["cascade_jobs_queued"] = self.cascade_jobs_queued
        return out


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Every figure of ``stats()``, typed. See :meth:`as_dict` for the key of each.

    ``active_requests`` is the canonical count of request attempts the primary holds.
    ``stats()`` shows it as ``primary_requests`` too, an alias kept for readers of that name.
    """

    pool: PoolFigures
    active_requests: int
    """Request attempts from ``on_new_request`` until finalized (the primary's records)."""
    stores_timed_out: int
    """Keys of stores past their deadline (keys, as it always counted)."""
    blocks_reserved: int
    promotions_refused: int
    event_keys_dropped: int
    totals: SupervisorTotals
    supervisor_requests: int
    """Request attempts in the supervisor's lifecycle table."""
    requests_finished_pending: int
    jobs_in_flight: int
    jobs_queued: int
    jobs_awaiting_late_report: int
    """Jobs the supervisor's job book holds after their deadline, every one (see ``PoolFigures.jobs_held``)."""
    promotions_quarantined: int
    lookups_in_flight: int
    contract_violations: int
    """The primary's misuse counts plus the supervisor's guard violations."""
    tiers_found_stuck: int
    tiers_recovered: int
    tiers: Mapping[str, TierFigures]
    """Each secondary tier's state, by name, in the configured order."""
    internal_errors: int
    """Handler failures of the primary and the supervisor together."""
    controls: ControlFigures

    @property
    def tiers_stuck(self) -> int:
        """How many tiers are stuck now."""
        return sum(1 for tier in self.tiers.values() if tier.stuck)

    def stuck_tiers(self) -> tuple[str, ...]:
        """The names of the tiers stuck now, in order."""
        return tuple(name for name, tier in self.tiers.items() if tier.stuck)

    def as_dict(self) -> dict[str, int | float]:
        """The ``stats()`` dict: every key the docs name, in the order ``stats()`` always gave them."""
        out: dict[str, int | float] = flat_dict(self.pool)
        out["primary_requests"] = out["active_requests"] = self.active_requests
        out["stores_timed_out"] = self.stores_timed_out
        out["blocks_reserved"] = self.blocks_reserved
        out["promotions_refused"] = self.promotions_refused
        out["event_keys_dropped"] = self.event_keys_dropped
        out.update(flat_dict(self.totals))
        out["supervisor_requests"] = self.supervisor_requests
        out["requests_finished_pending"] = self.requests_finished_pending
        out["jobs_in_flight"] = self.jobs_in_flight
        out["jobs_queued"] = self.jobs_queued
        out["jobs_awaiting_late_report"] = self.jobs_awaiting_late_report
        out["promotions_quarantined"] = self.promotions_quarantined
        out["lookups_in_flight"] = self.lookups_in_flight
        out["contract_violations"] = self.contract_violations
        out["tiers_stuck"] = self.tiers_stuck
        out["tiers_found_stuck"] = self.tiers_found_stuck
        out["tiers_recovered"] = self.tiers_recovered
        for name, tier in self.tiers.items():
            out[f"tier_stuck.{name}"] = int(tier.stuck)
            out[f"tier_silent_s.{name}"] = tier.silent_s
        out["internal_errors"] = self.internal_errors
        out.update(self.controls.as_dict())
        return out


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def flat_dict(figures: Any) -> dict[str, Any]:
    """The fields of a dataclass of numbers, by name.

    ``dataclasses.asdict`` would deep-copy each value, which numbers do not need.
    ``stats()`` is called often enough (every step of a vLLM engine) for that to show.
    """
    cls = type(figures)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in fields(cls))
    return {name: getattr(figures, name) for name in names}
