"""Watching the tiers from outside the runtime: each tier recorded, and the run's checks on the record.

Every tier of a run is wrapped in a :class:`~kvactors.testing.recorder.RecordedTier`.
They share one :class:`~kvactors.testing.recorder.TierRecord`.
The wrapper is transparent, as the runtime takes the paths it takes with the bare tiers.
It records, per tier and request attempt:

* when ``on_request_finished`` first ran, which gives the finalize latency;
* whether it ran twice, a contract violation;
* every submit after it, a contract violation too;
* which tier promoted each key last, which gives the per-tier hit attribution.

The runtime is not changed, as the wrapper is an ordinary tier plugin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvactors.testing.recorder import RecordedTier, TierRecord
from kvactors.tiers.base import SecondaryTier
from kvactors.types import ReqContext


def observe(tiers: Iterable[SecondaryTier], record: TierRecord) -> list[SecondaryTier]:
    """``tiers``, each recorded into ``record``."""
    return [RecordedTier(tier, record=record) for tier in tiers]


def unfinalized(record: TierRecord, frontend_done: Iterable[Any], tiers: Sequence[str]) -> int:
    """(request attempt, tier) pairs never told ``on_request_finished``.

    The attempts checked are every attempt the frontend finished, at every tier,
    and every attempt a tier saw, in any call.
    """
    done = {ctx.identity for ctx in frontend_done if isinstance(ctx, ReqContext)}
    missing = sum(1 for identity in done for tier in tiers if (tier, identity) not in record.finished_at)
    return missing + sum(1 for pair in set(record.seen) if pair not in record.finished_at and pair[1] not in done)


def finalize_latencies(record: TierRecord, frontend_done: Mapping[Any, float],
                       tiers: Sequence[str]) -> list[float]:
    """Per finished attempt, ms from the frontend being done with it to its last tier's ``on_request_finished``."""
    out = []
    for ctx, done in frontend_done.items():
        assert isinstance(ctx, ReqContext)
        last = record.finalized_time(ctx, tiers)
        if last is not None:
            out.append(max(0.0, last - done) * 1000.0)
    return out
