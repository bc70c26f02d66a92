"""One ``kvactors stress`` run, once its options were checked: the tiers, the frontends, the settling, the summary.

See :mod:`kvactors.commands.stress` for what is checked. Every wait has a bound
(:class:`~kvactors.commands.watch.Watch`); everything started is stopped by the
caller's exit stack.
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
from typing import Any

from kvactors.commands import options as opt
from kvactors.commands.scratch import drop_redis_namespace, run_namespace
from kvactors.commands.stress_plan import PROG, Plan
from kvactors.commands.watch import Watch

LEAK_STATS = ("active_requests", "primary_requests", "supervisor_requests", "lookups_in_flight")
PIN_STATS = ("blocks_pinned", "jobs_pinning", "blocks_pending")
JOB_STATS = ("jobs_in_flight", "jobs_queued")


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


def _settle(env: Any, manager: Any, watch: Watch, timeout_s: float,
            stalled: Callable[[], int]) -> dict[str, Any] | None:
    """Let copies, late reports and store deadlines run out; then the stats."""
    deadline = time.monotonic() + timeout_s
    while (env.outstanding_copies or env.deferrer.pending()) and time.monotonic() < deadline:
        time.sleep(0.01)  # copies and slow reports run on the worker pool: nothing to wait on but their count
    while time.monotonic() < deadline:
        ok, stats = watch.call("stats()", manager.stats)
        if not ok:
            return None
        if (not stats["active_requests"] and not stats["jobs_in_flight"] and not stats["lookups_in_flight"]
                and stats["jobs_awaiting_late_report"] == stalled()):
            break
        time.sleep(0.02)  # store deadlines fire on the runtime's timer
    ok, idle = watch.call("wait_idle()", lambda: manager.wait_idle(timeout_s))
    if not ok:
        return None
    if not idle:
        watch.hang("wait_idle() (returned False)")
    ok, stats = watch.call("stats()", manager.stats)
    return stats if ok else None


def run_planned(args: argparse.Namespace, plan: Plan, cleanup: contextlib.ExitStack,
                state: dict[str, Any]) -> dict[str, Any]:
    from kvactors.manager import TieringManager
    from kvactors.testing.explore import check_stats, check_tiers
    from kvactors.testing.tiers import Faults, ThreadDeferrer
    from kvactors.testing.workload import Env, Hang, WorkloadConfig, drive, make_clients

    created: list[str] = []
    cleanup.callback(opt.remove_created, created)  # only what is still empty: never the user's data
    disk_root = ""
    if "disk" in plan.tiers:
        if args.disk_dir is None:
            disk_root = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvactors-stress-",
                                                                          ignore_cleanup_errors=True))
        else:
            opt.prepare_dir(args.disk_dir, "--disk-dir", created)
            disk_root = args.disk_dir
    if plan.event_log is not None:
        opt.prepare_dir(os.path.dirname(plan.event_log), plan.event_log_source, created)
    namespace = run_namespace("stress")
    if args.redis is not None:
        cleanup.callback(drop_redis_namespace, args.redis, namespace)

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    old_interval = sys.getswitchinterval()
    cleanup.callback(sys.setswitchinterval, old_interval)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    timeout = args.transfer_timeout
    watch = Watch(plan.hang_after)
    # A slow report comes about a deadline late; a hang outlasts three deadlines (the runtime must notice it).
    faults = Faults(slow_s=timeout, hang_s=3 * timeout,
                    **{("raise_" if k == "raise" else k): v for k, v in args.faults.items()})
    deferrer = ThreadDeferrer(args.workers, name="stress-copy")
    cleanup.callback(deferrer.close)
    tiers = _make_tiers(args, plan, deferrer, faults, seed, disk_root, namespace)
    try:
        manager = TieringManager.start(num_blocks=args.cpu_blocks, block_bytes=args.block_bytes,
                                       secondary_tiers=tiers, transfer_timeout_s=timeout,
                                       lookup_timeout_s=timeout, event_log=plan.event_log)
    except Exception as exc:
        if opt.is_allocation_error(exc):
            raise opt.OptionError(f"--cpu-blocks {args.cpu_blocks} --block-bytes {args.block_bytes}: "
                                  f"cannot allocate the pool ({str(exc).splitlines()[0]})") from None
        raise
    stopped: list[bool] = []
    abort = threading.Event()
    threads: list[threading.Thread] = []

    def shutdown() -> bool:
        """Stop the frontends and the manager, each within the hang bound; whether the manager stopped."""
        if stopped:
            return stopped[0]
        abort.set()
        deadline = time.monotonic() + watch.bound_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        ok, _ = watch.call("stop()", lambda: manager.stop(timeout=watch.bound_s))
        stopped.append(ok)
        if not ok or any(thread.is_alive() for thread in threads):
            state["hung"] = True
        return ok

    cleanup.callback(shutdown)
    # A store never completed keeps its row forever (its writer might still write): over a long run such
    # rows would fill the pool, so stores here complete late instead, unless --never-complete asks otherwise.
    rest = 1.0 - args.never_complete
    config = WorkloadConfig(clients=args.threads, requests=plan.requests, keys=args.keys, p_reset=0.002,
                            store_outcomes=(0.8 * rest, 0.1 * rest, 0.1 * rest, args.never_complete),
                            transfer_timeout_s=timeout)
    started = time.monotonic()
    stop_at = None if args.seconds is None else started + args.seconds
    env = Env(manager=manager, deferrer=deferrer, config=config, seed=seed,
              should_stop=lambda: abort.is_set() or (stop_at is not None and time.monotonic() >= stop_at))
    errors: list[str] = []
    crashes: list[str] = []

    def frontend(client: Any, index: int) -> None:
        try:
            drive(client, watch.bound_s)
        except Hang as exc:
            watch.hang(f"frontend {index}: {exc}")
            abort.set()
        except Exception as exc:
            text = f"frontend {index} raised {exc!r}\n{traceback.format_exc()}"
            (errors if _runtime_frame(exc.__traceback__) else crashes).append(text)
            abort.set()

    threads.extend(threading.Thread(target=frontend, args=(client, i), name=f"stress-frontend-{i}", daemon=True)
                   for i, client in enumerate(make_clients(env)))
    where = f" (disk tier in {disk_root})" if disk_root else ""
    bound = " and ".join(filter(None, (f"{args.requests} requests per thread" if args.requests else
                                       ("" if args.seconds else f"{plan.requests} requests per thread"),
                                       f"{args.seconds:g} s" if args.seconds else "")))
    print(f"{PROG}: started: seed {seed}, {args.threads} threads, tiers {','.join(plan.tiers)}{where}, "
          f"{bound}", file=sys.stderr, flush=True)
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
            total = args.seconds if by_time else args.threads * plan.requests
            task = progress.add_task("stress", total=total, ops="")
        for thread in threads:
            thread.start()
        while True:
            alive = [thread for thread in threads if thread.is_alive()]
            if not alive:
                break
            alive[0].join(0.2)
            if task is not None:
                done = min(time.monotonic() - started, args.seconds) if by_time else env.requests
                progress.update(task, completed=done, ops=f"{env.operations} ops, {env.requests} requests")
            if watch.hangs:
                break
    elapsed = time.monotonic() - started
    violations = list(errors)
    stats = None
    if not watch.hangs and not crashes:  # after a crash, the requests it left open are its, not leaks
        stats = _settle(env, manager, watch, 4 * timeout + 5,
                        lambda: sum(len(getattr(t, "stalled", ())) for t in tiers))
    if stats is not None:
        violations.extend(check_stats(env, stats, tiers))
    ok = shutdown()
    deferrer.close()
    if not crashes:
        violations.extend(env.violations)
        if ok and not watch.hangs:
            violations.extend(check_tiers(env, tiers))
        violations.extend(deferrer.errors)
    if watch.hangs:
        state["hung"] = True
    stats = stats or {}
    leaks = sum(int(stats.get(name, 0)) for name in LEAK_STATS)
    pins = sum(int(stats.get(name, 0)) for name in PIN_STATS)
    stalled = sum(len(getattr(t, "stalled", ())) for t in tiers)
    jobs = sum(int(stats.get(name, 0)) for name in JOB_STATS) + abs(int(stats.get("jobs_held", stalled)) - stalled)
    summary = {
        "operations": env.operations,
        "requests": env.requests,
        "violations": len(violations),
        "leaks": leaks,
        "pins": pins,
        "jobs": jobs,
        "hangs": len(watch.hangs),
        "workload_errors": len(crashes),
        "seed": seed,
        "seconds": round(elapsed, 2),
        "ops_per_s": round(env.operations / elapsed, 1) if elapsed else 0.0,
        "threads": args.threads,
        "tiers": ",".join(plan.tiers),
        "expected_misuse": env.expected_misuse,
        "jobs_submitted": int(stats.get("jobs_submitted", 0)),
        "jobs_timed_out": int(stats.get("jobs_timed_out", 0)),
        "stores_timed_out": int(stats.get("stores_timed_out", 0)),
        "blocks_ready": int(stats.get("blocks_ready", 0)),
        "blocks_unusable": int(stats.get("blocks_detached", 0)) + int(stats.get("jobs_held", 0)),
        "violation_list": violations[:20],
        "workload_error_list": crashes[:5],
    }
    for hang in watch.hangs:
        print(hang, file=sys.stderr)
    return summary
