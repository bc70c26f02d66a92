"""Explore seeds: one random workload per seed on a :class:`SimRuntime`, checked after each.

``explore_one(seed)`` runs one seed and returns what it found.
Replay a failing seed with ``trace=True`` to see every scheduling choice.
``explore(seeds)`` runs many and returns the failures.
The check after each run (:func:`check_after_run` and :func:`check_internals`) is the contract.
It checks these things.

* What the recording tiers saw is right: no submit after finish, one finish, rows unchanged while read.
* What the clients saw is right: no unexpected error, no bytes served that were not the block's,
  no misuse left unrejected.
* Once everything settled, no request state is left (``active_requests``, the primary's records).
  No block is pending or pinned, no job is in flight or queued, and no lookup is pending.
  Contract violations equal the misuse the clients committed on purpose, and there is no internal error.
* Every request attempt the clients finished was finalized exactly once at every tier.
* (Simulation only.) The actors' internals hold nothing but what the workload left on purpose,
  that is stores never completed and jobs stalled at a tier.
  Every ready row of the pool holds its block's bytes.
  A promotion's failed key made ready shows up there even if no client loads it.
* Some seeds let a tier get stuck in a call (``Faults.hang``).
  In those, a *poller* calls ``take_events``, ``stats`` and now and then ``reset_cache`` between steps.
  Each of its calls is answered by its deadline in virtual time (:meth:`~kvactors.testing.SimRuntime.expect_by`).
  Every stuck tier has recovered once the run settled.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvactors.actors import messages as m
from kvactors.actors.primary import PrimaryTier
from kvactors.actors.reply import Reply
from kvactors.core.snapshot import StatsSnapshot
from kvactors.manager import TieringManager
from kvactors.testing.scheduler import SimRuntime, SimulationStuck
from kvactors.testing.tiers import Faults, RecordingTier, SimDeferrer, rows_hold
from kvactors.testing.workload import Env, WorkloadConfig, make_clients
from kvactors.tiers.base import HOOKS, INLINE_CALLS
from kvactors.types import OffloadKey


@dataclass(frozen=True)
class TierParams:
    """One recording, fault-injecting test tier of a seed (:class:`~kvactors.testing.tiers.RecordingTier`'s
    arguments)."""

    name: str
    capacity_blocks: int
    faults: Faults
    max_inflight_jobs: int


@dataclass(frozen=True)
class SeedParams:
    """The manager, tiers and workload of one seed (:func:`draw_params`)."""

    config: WorkloadConfig
    num_blocks: int
    block_bytes: int
    eviction: str
    tiers: tuple[TierParams, ...]
    time_jump_chance: float
    tier_hooks: bool
    """Whether the tiers have the request hooks; without them the primary never announces a
    start, and the supervisor opens a request's state lazily."""
    claim_chance: float
    """How often a frontend call runs the idle primary itself (0: never, as with claims off)."""
    inline_calls: bool
    """Every call of every tier inline (run by the supervisor when the tier's actor is idle), or none."""
    report_faults: tuple[tuple[float, float], ...]
    """Per tier, ``(partial, lie)``: how often a job ends per key, and how often a report is
    sloppy (the runtime must apply the one, reject the other)."""
    poller: bool
    """A scheduler polls between steps (:func:`poller`): drawn with a tier that may get stuck."""
    admission: tuple[tuple[str, Any], ...] = ()
    """Per tier (by name), its admission (``controls=True`` only; docs/controls.md)."""
    max_queued_bytes: tuple[tuple[str, int], ...] = ()
    """Per tier, its back-pressure bound (``controls=True`` only)."""


@dataclass
class RunResult:
    seed: int
    violations: list[str]
    steps: int = 0
    operations: int = 0
    requests: int = 0
    params: SeedParams | None = None
    trace: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def describe(self) -> str:
        head = f"seed {self.seed}: {len(self.violations)} violation(s); replay: explore_one({self.seed}, trace=True)"
        return "\n  ".join([head, *self.violations[:20]])


@dataclass
class ExploreReport:
    runs: int
    seconds: float
    failures: list[RunResult]
    operations: int = 0

    @property
    def seeds_per_second(self) -> float:
        return self.runs / self.seconds if self.seconds else 0.0


def check_after_run(env: Env, stats: StatsSnapshot, tiers: list[RecordingTier]) -> list[str]:
    """The contract, from the stats and the recording tiers, once the runtime settled."""
    return [*env.violations, *check_stats(env, stats, tiers), *check_tiers(env, tiers)]


def check_stats(env: Env, stats: StatsSnapshot, tiers: list[Any]) -> list[str]:
    """Check that, once settled, no request state, pin, job or lookup is left.

    Only the deliberate misuse may be counted.
    ``stats`` is the runtime's figures
    (:attr:`MetricsSnapshot.figures <kvactors.core.counters.MetricsSnapshot.figures>`).
    Each finding names its ``stats()`` key.
    """
    stalled = sum(len(tier.stalled) for tier in tiers)
    pool, totals = stats.pool, stats.totals
    # (stats() key, value, expected); primary_requests is active_requests under another name.
    expect: tuple[tuple[str, int, int], ...] = (
        ("active_requests", stats.active_requests, 0),
        ("supervisor_requests", stats.supervisor_requests, 0),
        ("blocks_pending", pool.blocks_pending, 0),
        ("blocks_pinned", pool.blocks_pinned, 0),
        ("jobs_in_flight", stats.jobs_in_flight, 0),
        ("jobs_queued", stats.jobs_queued, 0),
        ("jobs_pinning", pool.jobs_pinning, 0),
        ("lookups_in_flight", stats.lookups_in_flight, 0),
        ("internal_errors", stats.internal_errors, 0),
        ("unexpected_reports", totals.unexpected_reports, sum(getattr(tier, "extra_reports", 0) for tier in tiers)),
        ("guard_violations", totals.guard_violations, 0),
        ("contract_violations", stats.contract_violations, env.expected_misuse),
        ("jobs_held", pool.jobs_held, stalled),
        ("jobs_awaiting_late_report", stats.jobs_awaiting_late_report, stalled),
        ("tiers_stuck", stats.tiers_stuck, 0),  # a tier stuck in a call has moved again, and said so
    )
    return [f"stats[{name!r}] is {value!r}, expected {expected!r}" for name, value, expected in expect
            if value != expected]


def check_tiers(env: Env, tiers: list[Any]) -> list[str]:
    """What the tiers saw: their own findings, and one finish per finished request attempt."""
    out = []
    for tier in tiers:
        out.extend(tier.violations)
    for tier in tiers:
        for identity in sorted(env.finished):
            count = tier.finished.get(identity, 0)
            if count != 1:
                out.append(f"tier {tier.name}: request {identity[0]}#{identity[1]} finalized {count} times, not once")
        for identity in sorted(set(tier.finished) - env.finished):
            out.append(f"tier {tier.name}: request {identity[0]}#{identity[1]} finalized but never finished")
    return out


def check_internals(runtime: SimRuntime, manager: TieringManager, env: Env, tiers: list[RecordingTier]) -> list[str]:
    """Simulation only: what the actors still hold is only what the workload left on purpose.

    The actors come from the scheduler (:meth:`SimRuntime.ref`).
    The stats already checked the counts (:func:`check_stats`).
    This looks at which keys and jobs are held, which only the actors' state says.
    """
    out = []
    primary = _primary(runtime)
    supervisor: Any = runtime.ref("supervisor").actor
    holdings = primary.pool.holdings()
    pending = set(holdings.pending_writes)
    if pending != env.never_completed:
        extra = pending - env.never_completed
        out.append(f"pool: {len(extra)} pending writes nobody completes (leak), e.g. {sorted(extra)[:3]}")
    for label, held in (("load pins", holdings.load_pins), ("job pins", holdings.job_pins),
                        ("promotions", holdings.promotions), ("primary requests", primary.request_identities()),
                        ("supervisor jobs", [job.job_id for job in supervisor.jobs.jobs()]),
                        ("supervisor lookups", [lookup.lookup_id for lookup in supervisor.lookups.open_lookups()]),
                        ("supervisor allocations", supervisor.lookups.allocating())):
        if held:
            out.append(f"{label} left: {list(held)[:5]}")
    ready = list(holdings.ready.items())
    bad = rows_hold(manager.pool, [key for key, _ in ready], [row for _, row in ready])
    if bad:
        out.append(f"pool: ready rows {[ready[i][1] for i in bad][:5]} do not hold their blocks "
                   f"(keys {[ready[i][0] for i in bad][:3]})")
    stalled = set().union(*(tier.stalled for tier in tiers)) if tiers else set()
    held = {job.job_id for job in supervisor.jobs.held()}
    if held != stalled:
        out.append(f"jobs awaiting a late report {sorted(held)} != stalled {sorted(stalled)}")
    if len(supervisor.table):
        out.append(f"lifecycle states left: {[s.req_context for s in supervisor.table.states()][:5]}")
    return out


def watch_promotions(runtime: SimRuntime, manager: TieringManager, violations: list[str]) -> None:
    """Simulation only: when a promotion ends, the rows it made ready must hold their blocks
    (the fault tiers fill the rows of keys that must not become ready with junk)."""
    primary = _primary(runtime)

    def checked(msg: m.JobEnded, promoted: tuple[tuple[OffloadKey, int], ...]) -> None:
        if not promoted:
            return
        # Which rows the end made ready, as the pool holds them now (not as end_promotion says).
        rows = primary.pool.holdings().ready
        ready = [(key, row) for key, row in promoted if rows.get(key) == row]
        bad = rows_hold(manager.pool, [key for key, _ in ready], [row for _, row in ready])
        if bad:
            violations.append(f"promotion job {msg.job_id}: rows {[ready[i][1] for i in bad]} made ready "
                              f"do not hold their blocks (keys {[ready[i][0] for i in bad]})")

    primary.observe_job_ended(checked)


def _primary(runtime: SimRuntime) -> PrimaryTier:
    actor = runtime.ref("primary").actor
    assert isinstance(actor, PrimaryTier), actor
    return actor


def draw_controls(seed: int, params: SeedParams) -> SeedParams:
    """``params`` with an admission and a back-pressure bound drawn for each tier (a random stream of
    their own: the rest of the seed's scenario is unchanged). ``write_back`` comes with ``lru``."""
    rng = random.Random(f"controls/{seed}")
    choices: tuple[Any, ...] = ("write_through", "write_back", "write_back", {"min_seen": 2}, {"min_seen": 3})
    admission = tuple((tier.name, rng.choice(choices)) for tier in params.tiers)
    bounds = tuple((tier.name, rng.choice((0, 1, 2, 4, 1 << 20)) * params.block_bytes) for tier in params.tiers)
    eviction = "lru" if any(a == "write_back" for _, a in admission) else params.eviction
    return dataclasses.replace(params, admission=admission, max_queued_bytes=bounds, eviction=eviction)


def draw_params(seed: int, base: WorkloadConfig | None = None) -> SeedParams:
    """The manager, tiers and workload of one seed."""
    rng = random.Random(f"params/{seed}")
    config = (base or WorkloadConfig()).draw(rng)
    tiers = []
    for n in range(rng.randint(1, 2)):
        faults = Faults(
            fail=rng.choice((0.0, 0.05, 0.2)),
            raise_=rng.choice((0.0, 0.02, 0.1)),
            stall=rng.choice((0.0, 0.0, 0.05)),
            slow=rng.choice((0.0, 0.1, 0.3)),
            slow_s=config.transfer_timeout_s * rng.choice((0.5, 1.5)),
            lookup_raise=rng.choice((0.0, 0.0, 0.05)),
        )
        tiers.append(TierParams(f"t{n}", capacity_blocks=rng.randint(4, 32), faults=faults,
                                max_inflight_jobs=rng.randint(1, 3)))
    # In this order: each seed keeps the scenario it always had (the later draws were added later).
    num_blocks = rng.randint(4, 16)
    eviction = rng.choice(("lru", "arc"))
    time_jump_chance = rng.choice((0.005, 0.02, 0.1))
    tier_hooks = rng.random() < 0.5
    claim_chance = rng.choice((0.0, 0.5, 0.9))
    inline_calls = rng.random() < 0.5
    report_faults = tuple((rng.choice((0.0, 0.1, 0.3)), rng.choice((0.0, 0.0, 0.05, 0.2))) for _ in tiers)
    poller = _draw_hangs(rng, config, tiers)
    return SeedParams(config=config, num_blocks=num_blocks, block_bytes=32, eviction=eviction, tiers=tuple(tiers),
                      time_jump_chance=time_jump_chance, tier_hooks=tier_hooks, claim_chance=claim_chance,
                      inline_calls=inline_calls, report_faults=report_faults, poller=poller)


def _draw_hangs(rng: random.Random, config: WorkloadConfig, tiers: list[TierParams]) -> bool:
    """Drawn after the rest: a tier that may get stuck in its calls (replaced in ``tiers``), and
    whether a poller notices (only then)."""
    if rng.random() >= 0.3:
        return False
    spec = rng.choice(tiers)
    tiers[tiers.index(spec)] = dataclasses.replace(
        spec, faults=dataclasses.replace(spec.faults, hang=rng.choice((0.02, 0.1, 0.3)),
                                         hang_s=config.transfer_timeout_s * rng.choice((3, 20))))
    return True


def poller(env: Env, runtime: SimRuntime, seed: int) -> Callable[[], None]:
    """A scheduler's loop: ``take_events`` and ``stats`` between steps, ``reset_cache`` now and then.

    Each answer is expected by its deadline: ``transfer_timeout_s`` (a stuck tier
    is waited for once, never again while it is known stuck)."""
    rng = random.Random(f"{seed}/poller")
    bound = env.config.transfer_timeout_s
    manager = env.manager
    calls: dict[str, Callable[[], object]] = {"take_events": manager.take_events, "stats": manager.stats,
                                              "reset_cache": manager.reset_cache}

    def run() -> None:
        for _ in range(rng.randint(10, 60)):
            nap: Reply[None] = Reply()
            env.deferrer.defer("poller step", functools.partial(nap.set_result, None), rng.uniform(0.0, bound))
            runtime.wait(nap, None)
            x = rng.random()
            label = "take_events" if x < 0.6 else "stats" if x < 0.95 else "reset_cache"
            env.count()
            with runtime.expecting(bound, f"poller: {label} at t={runtime.now():.3f}"):
                try:
                    calls[label]()
                except Exception as exc:
                    env.violation(f"poller: {label} raised {exc!r}")

    return run


def explore_one(seed: int, *, base: WorkloadConfig | None = None, trace: bool = False,
                event_log: str | None = None, internals: bool = True, controls: bool = False) -> RunResult:
    """Run the workload of ``seed`` on a fresh :class:`SimRuntime` and check it. ``controls``: each
    tier gets an admission and a back-pressure bound too (:func:`draw_controls`)."""
    params = draw_params(seed, base)
    if controls:
        params = draw_controls(seed, params)
    config = params.config
    runtime = SimRuntime(seed, time_jump_chance=params.time_jump_chance, claim_chance=params.claim_chance,
                         trace=trace)
    deferrer = SimDeferrer(runtime)
    hooks = HOOKS if params.tier_hooks else HOOKS - {"on_new_request"}
    inline = INLINE_CALLS if params.inline_calls else frozenset()
    tiers = [RecordingTier(deferrer=deferrer, seed=seed, keep_calls=trace, inline_calls=inline, hooks=hooks,
                           name=spec.name, capacity_blocks=spec.capacity_blocks,
                           max_inflight_jobs=spec.max_inflight_jobs,
                           faults=dataclasses.replace(spec.faults, partial=partial, lie=lie))
             for spec, (partial, lie) in zip(params.tiers, params.report_faults, strict=True)]
    manager = TieringManager.start(
        num_blocks=params.num_blocks, block_bytes=params.block_bytes, secondary_tiers=tiers,
        eviction=params.eviction, transfer_timeout_s=config.transfer_timeout_s,
        lookup_timeout_s=config.transfer_timeout_s, event_log=event_log, runtime=runtime,
        admission=dict(params.admission) or None, max_queued_bytes=dict(params.max_queued_bytes) or None,
    )
    env = Env(manager=manager, deferrer=deferrer, config=config, seed=seed, spawn=runtime.spawn_client,
              spawn_ordered=True, wait=runtime.wait,
              pause=runtime.checkpoint)
    result = RunResult(seed, [], params=params)
    if internals:
        watch_promotions(runtime, manager, env.violations)
    try:
        for index, client in enumerate(make_clients(env)):
            runtime.spawn_client(f"client{index}", client.run)
        if params.poller:
            runtime.spawn_client("poller", poller(env, runtime, seed))
        runtime.run()
        result.violations.extend(runtime.late)
        if not manager.wait_idle():
            result.violations.append("wait_idle() did not return True")
        stats = manager.metrics_snapshot().figures
        result.violations.extend(check_after_run(env, stats, tiers))
        if internals:
            result.violations.extend(check_internals(runtime, manager, env, tiers))
        manager.stop()
        runtime.run()
    except SimulationStuck as exc:
        result.violations.append(f"stuck: {exc}")
    except Exception as exc:  # the runtime broke: that is a finding too
        result.violations.append(f"run raised {exc!r}")
    finally:
        runtime.close()
        if not manager.stopped:
            try:
                manager.stop(timeout=1.0)
            except Exception as exc:
                result.violations.append(f"stop raised {exc!r}")
    result.steps = runtime.steps
    result.operations = env.operations
    result.requests = env.requests
    result.trace = runtime.trace
    return result


def explore(seeds: Iterable[int], *, base: WorkloadConfig | None = None, max_failures: int | None = None,
            time_budget_s: float | None = None, controls: bool = False) -> ExploreReport:
    """Run every seed (or until ``max_failures`` failed / the time budget is spent)."""
    started = time.perf_counter()
    failures: list[RunResult] = []
    runs = operations = 0
    for seed in seeds:
        result = explore_one(seed, base=base, controls=controls)
        runs += 1
        operations += result.operations
        if not result.ok:
            failures.append(result)
            if max_failures is not None and len(failures) >= max_failures:
                break
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            break
    return ExploreReport(runs, time.perf_counter() - started, failures, operations)
