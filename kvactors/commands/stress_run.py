"""One ``kvactors stress`` run, once its options were checked: the tiers, the frontends, the settling, the summary.

See :mod:`kvactors.commands.stress` for what is checked.
Every wait has a bound (:class:`~kvactors.commands.watch.Watch`).
Everything started is stopped by the caller's exit stack.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvactors.commands import options as opt
from kvactors.commands.scratch import drop_redis_namespace, run_namespace
from kvactors.commands.stress_plan import PROG, Plan
from kvactors.commands.watch import Watch
from kvactors.core.snapshot import StatsSnapshot


def _make_tiers(args: argparse.Namespace, plan: Plan, deferrer: Any, faults: Any, seed: int,
                disk_root: str, namespace: str) -> list[Any]:
    """Each tier with faults injected and what reached it recorded (``RecordedTier(FaultTier(tier))``)."""
    from kvactors.testing.tiers import FaultTier, RecordedTier, RecordingTier, rows_hold
    from kvactors.tiers.base import INLINE_CALLS, SecondaryTier
    from kvactors.tiers.disk import DiskTier
    from kvactors.tiers.redis import RedisTier

    tiers: list[Any] = []
    for name in plan.tiers:
        if name == "memory":
            tiers.append(RecordingTier(name="memory", capacity_blocks=max(4 * args.cpu_blocks, 16),
                                       deferrer=deferrer, faults=faults, seed=seed, inline_calls=INLINE_CALLS))
            continue
        inner: SecondaryTier = (DiskTier(disk_root, capacity_bytes=plan.disk_bytes) if name == "disk" else
                                RedisTier(args.redis, namespace=namespace, capacity_bytes=plan.redis_bytes))
        tiers.append(RecordedTier(FaultTier(inner, deferrer=deferrer, faults=faults, seed=seed),
                                  rows_check=rows_hold))
    return tiers


def _runtime_frame(tb: Any) -> bool:
    """Whether a traceback passes through the runtime (not only the workload and the standard library)."""
    runtime = [os.path.join(ROOT, part) for part in ("manager.py", "actors", "core", "tiers", "transfer")]
    return any(frame.filename.startswith(tuple(runtime)) for frame in traceback.extract_tb(tb))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _figures(manager: Any) -> StatsSnapshot:
    """What ``stats()`` shows, typed."""
    figures: StatsSnapshot = manager.metrics_snapshot().figures
    return figures


def _settle(env: Any, manager: Any, watch: Watch, timeout_s: float,
            stalled: Callable[[], int]) -> StatsSnapshot | None:
    """Let copies, late reports and store deadlines run out, then read the stats."""
    deadline = time.monotonic() + timeout_s
    while (env.outstanding_copies or env.deferrer.pending()) and time.monotonic() < deadline:
        time.sleep(0.01)  # copies and slow reports run on the worker pool: nothing to wait on but their count
    while time.monotonic() < deadline:
        ok, stats = watch.call("stats()", lambda: _figures(manager))
        if not ok:
            return None
        if (not stats.active_requests and not stats.jobs_in_flight and not stats.lookups_in_flight
                and stats.jobs_awaiting_late_report == stalled()):
            break
        time.sleep(0.02)  # store deadlines fire on the runtime's timer
    ok, idle = watch.call("wait_idle()", lambda: manager.wait_idle(timeout_s))
    if not ok:
        return None
    if not idle:
        watch.hang("wait_idle() (returned False)")
    ok, stats = watch.call("stats()", lambda: _figures(manager))
    return stats if ok else None


@dataclass
class _Run:
    """What the steps of one run share: set up by the first ones, read by the later ones.

    Only the run's own thread reads or writes it, except ``errors``, ``crashes`` and
    ``abort``, which the frontend threads append to and set.
    """

    args: argparse.Namespace
    plan: Plan
    state: dict[str, Any]
    watch: Watch
    seed: int = 0
    disk_root: str = ""
    namespace: str = ""
    deferrer: Any = None
    tiers: list[Any] = field(default_factory=list)
    manager: Any = None
    env: Any = None
    started: float = 0.0
    abort: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)

    def stalled(self) -> int:
        """Jobs the fault tiers stalled on purpose (never reported: held until their deadline)."""
        return sum(len(getattr(t, "stalled", ())) for t in self.tiers)

    def shutdown(self) -> bool:
        """Stop the frontends and the manager, each within the hang bound.

        Returns whether the manager stopped.
        """
        if self.stopped:
            return self.stopped[0]
        self.abort.set()
        deadline = time.monotonic() + self.watch.bound_s
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        ok, _ = self.watch.call("stop()", lambda: self.manager.stop(timeout=self.watch.bound_s))
        self.stopped.append(ok)
        if not ok or any(thread.is_alive() for thread in self.threads):
            self.state["hung"] = True
        return ok


def run_planned(args: argparse.Namespace, plan: Plan, cleanup: contextlib.ExitStack,
                state: dict[str, Any]) -> dict[str, Any]:
    """One run, step by step, returning the summary :mod:`kvactors.commands.stress` prints.

    Everything a step starts is stopped by ``cleanup``.
    """
    run = _Run(args=args, plan=plan, state=state, watch=Watch(plan.hang_after))
    _prepare_scratch(run, cleanup)
    _seed_and_switch_interval(run, cleanup)
    _start_tiers_and_manager(run, cleanup)
    _make_frontends(run)
    _announce(run)
    _drive_frontends(run)
    elapsed = time.monotonic() - run.started
    violations, stats = _check(run)
    return _summary(run, violations, stats, elapsed)


def _prepare_scratch(run: _Run, cleanup: contextlib.ExitStack) -> None:
    """The disk tier's directory, the event log's directory, and the Redis namespace of the run."""
    args, plan = run.args, run.plan
    created: list[str] = []
    cleanup.callback(opt.remove_created, created)  # only what is still empty: never the user's data
    if "disk" in plan.tiers:
        if args.disk_dir is None:
            run.disk_root = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvactors-stress-",
                                                                              ignore_cleanup_errors=True))
        else:
            opt.prepare_dir(args.disk_dir, "--disk-dir", created)
            run.disk_root = args.disk_dir
    if plan.event_log is not None:
        opt.prepare_dir(os.path.dirname(plan.event_log), plan.event_log_source, created)
    run.namespace = run_namespace("stress")
    if args.redis is not None:
        cleanup.callback(drop_redis_namespace, args.redis, run.namespace)


def _seed_and_switch_interval(run: _Run, cleanup: contextlib.ExitStack) -> None:
    """The run's seed (``--seed``, or a random one), and ``--switch-interval`` until the run ends."""
    args = run.args
    run.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cleanup.callback(sys.setswitchinterval, sys.getswitchinterval())
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)


def _start_tiers_and_manager(run: _Run, cleanup: contextlib.ExitStack) -> None:
    """The copy workers, the tiers with their faults, and the manager.

    A pool the memory cannot hold is an :class:`~kvactors.commands.options.OptionError`.
    """
    from kvactors.manager import TieringManager
    from kvactors.testing.tiers import Faults, ThreadDeferrer

    args, plan = run.args, run.plan
    timeout = args.transfer_timeout
    # A slow report comes about a deadline late; a hang outlasts three deadlines (the runtime must notice it).
    faults = Faults(slow_s=timeout, hang_s=3 * timeout,
                    **{("raise_" if k == "raise" else k): v for k, v in args.faults.items()})
    run.deferrer = ThreadDeferrer(args.workers, name="stress-copy")
    cleanup.callback(run.deferrer.close)
    run.tiers = _make_tiers(args, plan, run.deferrer, faults, run.seed, run.disk_root, run.namespace)
    try:
        run.manager = TieringManager.start(num_blocks=args.cpu_blocks, block_bytes=args.block_bytes,
                                           secondary_tiers=run.tiers, transfer_timeout_s=timeout,
                                           lookup_timeout_s=timeout, event_log=plan.event_log)
    except Exception as exc:
        if opt.is_allocation_error(exc):
            raise opt.OptionError(f"--cpu-blocks {args.cpu_blocks} --block-bytes {args.block_bytes}: "
                                  f"cannot allocate the pool ({str(exc).splitlines()[0]})") from None
        raise
    cleanup.callback(run.shutdown)


def _make_frontends(run: _Run) -> None:
    """The workload and one frontend thread per client, not started yet."""
    from kvactors.testing.workload import Env, Hang, WorkloadConfig, drive, make_clients

    args = run.args
    # A store never completed keeps its row forever (its writer might still write): over a long run such
    # rows would fill the pool, so stores here complete late instead, unless --never-complete asks otherwise.
    rest = 1.0 - args.never_complete
    config = WorkloadConfig(clients=args.threads, requests=run.plan.requests, keys=args.keys, p_reset=0.002,
                            store_outcomes=(0.8 * rest, 0.1 * rest, 0.1 * rest, args.never_complete),
                            transfer_timeout_s=args.transfer_timeout)
    run.started = time.monotonic()
    stop_at = None if args.seconds is None else run.started + args.seconds
    run.env = Env(manager=run.manager, deferrer=run.deferrer, config=config, seed=run.seed,
                  should_stop=lambda: run.abort.is_set() or (stop_at is not None and time.monotonic() >= stop_at))

    def frontend(client: Any, index: int) -> None:
        try:
            drive(client, run.watch.bound_s)
        except Hang as exc:
            run.watch.hang(f"frontend {index}: {exc}")
            run.abort.set()
        except Exception as exc:
            text = f"frontend {index} raised {exc!r}\n{traceback.format_exc()}"
            (run.errors if _runtime_frame(exc.__traceback__) else run.crashes).append(text)
            run.abort.set()

    run.threads.extend(threading.Thread(target=frontend, args=(client, i), name=f"stress-frontend-{i}", daemon=True)
                       for i, client in enumerate(make_clients(run.env)))


def _announce(run: _Run) -> None:
    """The ``started`` line on stderr: seed, threads, tiers, and the run's bound."""
    args, plan = run.args, run.plan
    where = f" (disk tier in {run.disk_root})" if run.disk_root else ""
    bound = " and ".join(filter(None, (f"{args.requests} requests per thread" if args.requests else
                                       ("" if args.seconds else f"{plan.requests} requests per thread"),
                                       f"{args.seconds:g} s" if args.seconds else "")))
    print(f"{PROG}: started: seed {run.seed}, {args.threads} threads, tiers {','.join(plan.tiers)}{where}, "
          f"{bound}", file=sys.stderr, flush=True)


def _drive_frontends(run: _Run) -> None:
    """Start the frontends and wait until they end or one hangs, with a progress bar on a terminal."""
    args, env = run.args, run.env
    by_time = args.seconds is not None and args.requests is None
    progress: Any = contextlib.nullcontext()
    show = not args.no_progress and sys.stderr.isatty()
    if show:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("stress"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[ops]}"),
                            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
    with progress:
        task = None
        if show:
            total = args.seconds if by_time else args.threads * run.plan.requests
            task = progress.add_task("stress", total=total, ops="")
        for thread in run.threads:
            thread.start()
        while True:
            alive = [thread for thread in run.threads if thread.is_alive()]
            if not alive:
                break
            alive[0].join(0.2)
            if task is not None:
                done = min(time.monotonic() - run.started, args.seconds) if by_time else env.requests
                progress.update(task, completed=done, ops=f"{env.operations} ops, {env.requests} requests")
            if run.watch.hangs:
                break


def _check(run: _Run) -> tuple[list[str], StatsSnapshot | None]:
    """Settle, stop, and check: the violations found, and the last stats (``None`` if none could be read)."""
    from kvactors.testing.explore import check_stats, check_tiers

    env, watch = run.env, run.watch
    violations = list(run.errors)
    stats = None
    if not watch.hangs and not run.crashes:  # after a crash, the requests it left open are its, not leaks
        stats = _settle(env, run.manager, watch, 4 * run.args.transfer_timeout + 5, run.stalled)
    if stats is not None:
        violations.extend(check_stats(env, stats, run.tiers))
    ok = run.shutdown()
    run.deferrer.close()
    if not run.crashes:
        violations.extend(env.violations)
        if ok and not watch.hangs:
            violations.extend(check_tiers(env, run.tiers))
        violations.extend(run.deferrer.errors)
    if watch.hangs:
        run.state["hung"] = True
    return violations, stats


def _summary(run: _Run, violations: list[str], stats: StatsSnapshot | None, elapsed: float) -> dict[str, Any]:
    """The run's figures, as ``--json`` prints them (0 where the stats could not be read).

    The hangs go to stderr.
    """
    args, env, watch = run.args, run.env, run.watch
    stalled = run.stalled()
    leaks = pins = jobs = submitted = jobs_timed_out = stores_timed_out = ready = unusable = 0
    if stats is not None:
        pool = stats.pool
        # active_requests counts twice, as the stats() keys active_requests and primary_requests always did.
        leaks = 2 * stats.active_requests + stats.supervisor_requests + stats.lookups_in_flight
        pins = pool.blocks_pinned + pool.jobs_pinning + pool.blocks_pending
        jobs = stats.jobs_in_flight + stats.jobs_queued + abs(pool.jobs_held - stalled)
        submitted, jobs_timed_out = stats.totals.jobs_submitted, stats.totals.jobs_timed_out
        stores_timed_out, ready = stats.stores_timed_out, pool.blocks_ready
        unusable = pool.blocks_detached + pool.jobs_held
    summary = {
        "operations": env.operations,
        "requests": env.requests,
        "violations": len(violations),
        "leaks": leaks,
        "pins": pins,
        "jobs": jobs,
        "hangs": len(watch.hangs),
        "workload_errors": len(run.crashes),
        "seed": run.seed,
        "seconds": round(elapsed, 2),
        "ops_per_s": round(env.operations / elapsed, 1) if elapsed else 0.0,
        "threads": args.threads,
        "tiers": ",".join(run.plan.tiers),
        "expected_misuse": env.expected_misuse,
        "jobs_submitted": submitted,
        "jobs_timed_out": jobs_timed_out,
        "stores_timed_out": stores_timed_out,
        "blocks_ready": ready,
        "blocks_unusable": unusable,
        "violation_list": violations[:20],
        "workload_error_list": run.crashes[:5],
    }
    for hang in watch.hangs:
        print(hang, file=sys.stderr)
    return summary
