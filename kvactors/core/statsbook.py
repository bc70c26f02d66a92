"""Stats assembly: the supervisor's books and the primary's figures, read into one snapshot.

:class:`StatsBook` holds the supervisor's books by reference and reads them
when asked. It writes nothing. Like the books, it is used on the
supervisor's thread only, inside its handlers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvactors.core.counters import MetricsSnapshot, PrimaryFigures, SupervisorCounters, snapshot
from kvactors.core.jobbook import JobBook
from kvactors.core.lifecycle import LifecycleTable
from kvactors.core.lookupbook import LookupBook
from kvactors.core.quarantine import PromotionQuarantine
from kvactors.core.snapshot import StatsSnapshot, TierFigures
from kvactors.core.tierwatch import TierWatch


@dataclass(frozen=True, slots=True)
class StatsBook:
    """The books ``stats()`` reads, in the supervisor's tier order."""

    tier_order: Sequence[str]
    table: LifecycleTable
    jobs: JobBook
    lookups: LookupBook[Any]
    quarantine: PromotionQuarantine
    watch: TierWatch
    counters: SupervisorCounters

    def stats(self, primary: PrimaryFigures, internal_errors: int, now: float) -> StatsSnapshot:
        """``stats()`` now, from ``primary``'s figures and the books'.

        ``internal_errors`` is the supervisor's count.
        """
        counts = primary.counters
        totals = self.counters.totals()
        stuck = self.watch.stuck()
        return StatsSnapshot(
            pool=primary.pool,
            # The primary's records: from on_new_request to finalize (the supervisor's
            # table holds a request only from its first fact that needs it).
            active_requests=primary.requests,
            stores_timed_out=counts.store_keys_timed_out,
            blocks_reserved=primary.blocks_reserved,
            promotions_refused=counts.promotions_refused,
            event_keys_dropped=primary.event_keys_dropped,
            totals=totals,
            supervisor_requests=len(self.table),
            requests_finished_pending=sum(1 for state in self.table.states() if state.is_finished),
            jobs_in_flight=self.jobs.in_flight(),
            jobs_queued=self.jobs.queued(),
            jobs_awaiting_late_report=len(self.jobs.held()),
            promotions_quarantined=len(self.quarantine),
            lookups_in_flight=len(self.lookups),
            contract_violations=counts.contract_violations + totals.guard_violations,
            tiers_found_stuck=self.watch.found_stuck,
            tiers_recovered=self.watch.recovered,
            tiers={tier: TierFigures(tier in stuck, round(self.watch.silent_for(tier, now), 6))
                   for tier in self.tier_order},
            internal_errors=primary.internal_errors + internal_errors,
            controls=primary.controls,
        )

    def metrics(self, primary: PrimaryFigures, internal_errors: int, now: float) -> MetricsSnapshot:
        """The metrics' snapshot now: :meth:`stats` and every per-tier counter."""
        return snapshot(primary, self.counters, self.stats(primary, internal_errors, now),
                        self.jobs.queued_by_tier(), self.jobs.in_flight_by_tier())
