"""Issue 37 item 1: ``stats()`` is written from one typed snapshot and keeps every key it had.

:data:`RECORDED_KEYS` is the key list ``stats()`` gave before the snapshot existed (recorded
from that code, tiers ``mem`` and ``disk``); docs/metrics.md lists the same keys.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvactors import MemoryTier, ReqContext, TieringManager
from kvactors.core.jobkinds import DropReason, JobKind, JobOutcome
from kvactors.core.lifecycle import COUNTERS, LifecycleTable, Pending
from kvactors.core.snapshot import (
    CascadeFigures,
    ControlFigures,
    PoolFigures,
    StatsSnapshot,
    SupervisorTotals,
    TierFigures,
)

ROOT = Path(__file__).resolve().parents[1]

RECORDED_KEYS = (
    "blocks_total", "blocks_free", "blocks_ready", "blocks_pending", "blocks_pinned", "blocks_detached",
    "blocks_evictable", "jobs_pinning", "jobs_held", "primary_requests", "active_requests", "stores_timed_out",
    "blocks_reserved", "promotions_refused", "event_keys_dropped", "jobs_submitted", "jobs_succeeded", "jobs_failed",
    "jobs_timed_out", "jobs_dropped", "late_reports", "unexpected_reports", "invalid_reports", "jobs_partial",
    "job_keys_failed", "promotion_hits_ignored", "lookups_timed_out", "requests_finalized", "guard_violations",
    "gathers_incomplete", "inline_calls_demoted", "supervisor_requests", "requests_finished_pending",
    "jobs_in_flight", "jobs_queued", "jobs_awaiting_late_report", "promotions_quarantined", "lookups_in_flight",
    "contract_violations", "tiers_stuck", "tiers_found_stuck", "tiers_recovered", "tier_stuck.mem",
    "tier_silent_s.mem", "tier_stuck.disk", "tier_silent_s.disk", "internal_errors", "cascades_dropped",
    "cascades_dropped.mem", "cascade_blocks_dropped.mem", "cascade_bytes_queued.mem", "cascades_dropped.disk",
    "cascade_blocks_dropped.disk", "cascade_bytes_queued.disk", "write_back_jobs", "write_backs_pending",
    "write_back_blocks_dropped", "blocks_unwritten", "seen_keys", "cascade_jobs_queued",
)
TIERS = ("mem", "disk")


def _per_tier(keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` with each tier name written ``<tier>``, each templated key once."""
    out: dict[str, None] = {}
    for key in keys:
        head, dot, tier = key.partition(".")
        out[f"{head}.<tier>" if dot and tier in TIERS else key] = None
    return tuple(out)


def _documented_keys() -> tuple[str, ...]:
    """The keys docs/metrics.md's ``stats()`` table lists, in order."""
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = text.split("## `stats()` keys", 1)[1]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return tuple(name for row in rows for name in re.findall(r"`([^`]+)`", row))


def test_stats_keeps_every_recorded_key_in_order_and_equals_the_snapshot():
    tiers = [MemoryTier(name=name, capacity_blocks=8) for name in TIERS]
    with TieringManager.start(num_blocks=8, block_bytes=64, secondary_tiers=tiers,
                              max_queued_bytes={"mem": 1 << 20, "disk": 1 << 20}) as manager:
        ctx = ReqContext("a")
        manager.on_new_request(ctx)
        manager.lookup([b"k1"], ctx)
        out = manager.prepare_store([b"k1"], ctx)
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(10)
        stats = manager.stats()
        figures = manager.metrics_snapshot().figures
    assert tuple(stats) == RECORDED_KEYS
    silent = {k: v for k, v in stats.items() if k.startswith("tier_silent_s.")}
    assert figures.as_dict() | silent == stats
    assert stats["jobs_submitted"] == 2 and stats["requests_finalized"] == 1 and stats["blocks_ready"] == 1
    assert stats["primary_requests"] == stats["active_requests"] == figures.active_requests == 0


def test_the_docs_list_exactly_the_keys_of_stats():
    assert _documented_keys() == _per_tier(RECORDED_KEYS)


_counts = st.integers(0, 1 << 20)
_tier_names = st.lists(st.text("abcxyz_", min_size=1, max_size=6), unique=True, max_size=4)


@st.composite
def _snapshots(draw: st.DrawFn) -> StatsSnapshot:
    names = draw(_tier_names)

    def ints(cls: type) -> list[int]:
        return [draw(_counts) for _ in cls.__dataclass_fields__]

    silent = st.floats(0, 1e4, allow_nan=False)
    return StatsSnapshot(
        PoolFigures(*ints(PoolFigures)), *(draw(_counts) for _ in range(5)), SupervisorTotals(*ints(SupervisorTotals)),
        *(draw(_counts) for _ in range(10)),
        tiers={name: TierFigures(draw(st.booleans()), draw(silent)) for name in names},
        internal_errors=draw(_counts),
        controls=ControlFigures({name: CascadeFigures(*(draw(_counts) for _ in range(3))) for name in names},
                                *(draw(_counts) for _ in range(6))),
    )


@given(_snapshots())
def test_every_snapshot_writes_the_recorded_keys_for_its_tiers(snap: StatsSnapshot):
    out = snap.as_dict()
    names = tuple(snap.tiers)
    expected: list[str] = []
    for key in _per_tier(RECORDED_KEYS):
        if key.startswith(("tier_stuck.", "cascades_dropped.")):  # each tier's group, in tier order
            head = key.split(".")[0]
            group = (("tier_stuck", "tier_silent_s") if head == "tier_stuck" else
                     ("cascades_dropped", "cascade_blocks_dropped", "cascade_bytes_queued"))
            expected.extend(f"{h}.{name}" for name in names for h in group)
        elif ".<tier>" not in key:
            expected.append(key)
    assert list(out) == expected
    assert out["primary_requests"] == out["active_requests"] == snap.active_requests
    assert out["tiers_stuck"] == sum(out[f"tier_stuck.{name}"] for name in names) == len(snap.stuck_tiers())
    assert out["cascades_dropped"] == sum(out[f"cascades_dropped.{name}"] for name in names)
    assert out["jobs_held"] == snap.pool.jobs_held
    assert out["jobs_awaiting_late_report"] == snap.jobs_awaiting_late_report


def test_the_enums_read_as_the_strings_they_replace():
    assert [str(kind) for kind in JobKind] == ["store", "load", "cascade", "promotion"]
    assert [str(outcome) for outcome in JobOutcome] == ["ok", "failed", "timed_out"]
    assert {str(reason) for reason in DropReason} == {"tier_stuck", "no_request", "timed_out", "reset", "stopping"}
    assert tuple(COUNTERS) == ("pending_primary_stores", "pending_lookups", "unsent_promotions", "parked_cascades")


def test_lifecycle_counts_are_typed_and_log_by_name():
    table = LifecycleTable()
    ctx = ReqContext("r")
    table.start(ctx)
    state = table.add(ctx, Pending.LOOKUPS, 2)
    assert state is not None and state.pending[Pending.LOOKUPS] == 2 and state.may_submit
    assert state.counts() == {"pending_primary_stores": 0, "pending_lookups": 2, "unsent_promotions": 0,
                              "parked_cascades": 0}
    assert all(type(name) is str for name in state.counts())
