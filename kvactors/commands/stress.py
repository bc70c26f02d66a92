"""``kvactors stress``: the random workload on real threads, checked against the contract.

N frontend threads each run the workload of :mod:`kvactors.sim.workload`
(random call orders, preemption, resets, misuse, stores failed, late or never
completed) against one :class:`~kvactors.TieringManager` on pykka threads,
with tiers that fail, raise, stall and are slow. Every wait has a bound: a
reply that does not come is a *hang*, reported with the stacks of every
thread, never waited on forever. At the end the runtime must settle to no
state, no pin, no job, and the contract must hold (the same checks as the
deterministic exploration). Exit status 1 on any violation, leak or hang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

HELP = "Run the random workload on real threads and check the lifecycle contract."

LEAK_STATS = ("active_requests", "primary_requests", "supervisor_requests", "lookups_in_flight")
PIN_STATS = ("blocks_pinned", "jobs_pinning", "blocks_pending")
JOB_STATS = ("jobs_in_flight", "jobs_queued")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=4, help="frontend threads (default 4)")
    parser.add_argument("--requests", type=int, default=200,
                        help="requests per thread (default 200; 0: until --seconds)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop starting requests after this long (whichever bound first)")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: random, printed)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run (e.g. 1e-6 shakes the GIL)")
    parser.add_argument("--tiers", default="memory", help="comma-separated: memory, disk, redis (default memory)")
    parser.add_argument("--disk-dir", default=None, help="directory of the disk tier (default: a temporary one)")
    parser.add_argument("--redis", default=None, metavar="URL", help="Redis URL for the redis tier")
    parser.add_argument("--faults", default="fail=0.05,raise=0.01,stall=0.001,slow=0.05,lookup_raise=0.01",
                        help="per-job fault probabilities of every tier")
    parser.add_argument("--never-complete", type=float, default=0.0,
                        help="fraction of stores never completed (each keeps its row for good; default 0)")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=64)
    parser.add_argument("--keys", type=int, default=1024, help="size of the shared key space")
    parser.add_argument("--transfer-timeout", type=float, default=0.5, help="transfer deadline in seconds")
    parser.add_argument("--workers", type=int, default=2, help="copy/completion worker threads")
    parser.add_argument("--hang-after", type=float, default=None,
                        help="a call not returning after this many seconds is a hang (default max(10, 3 x timeout))")
    parser.add_argument("--event-log", default=None, help="write the lifecycle events here (JSON lines)")
    parser.add_argument("--json", action="store_true", help="make the last line of stdout a JSON summary")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def all_stacks() -> str:
    """Every thread's stack, for a hang report."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watch:
    """Runs calls with a bound; a call that does not return in time is a hang."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.hangs: list[str] = []
        self.lock = threading.Lock()

    def hang(self, what: str) -> None:
        with self.lock:
            self.hangs.append(f"HANG: {what} did not return within {self.bound_s:.1f} s\n{all_stacks()}")

    def call(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"stress-{what}", daemon=True)
        thread.start()
        thread.join(self.bound_s)
        if thread.is_alive():
            self.hang(what)
            return False, None
        if "error" in box:
            raise box["error"]
        return True, box.get("value")


def _make_tiers(args: argparse.Namespace, deferrer: Any, faults: Any, seed: int) -> list[Any]:
    from kvactors.sim.tiers import FaultTier, RecordingTier
    from kvactors.tiers.base import INLINE_CALLS, SecondaryTier
    from kvactors.tiers.disk import DiskTier
    from kvactors.tiers.redis import RedisTier

    tiers: list[Any] = []
    for name in filter(None, (n.strip() for n in args.tiers.split(","))):
        if name == "memory":
            tiers.append(RecordingTier(name="memory", capacity_blocks=max(4 * args.num_blocks, 16),
                                       deferrer=deferrer, faults=faults, seed=seed, inline_calls=INLINE_CALLS))
        elif name == "disk":
            root = args.disk_dir or tempfile.mkdtemp(prefix="kvactors-stress-")
            inner: SecondaryTier = DiskTier(root, capacity_bytes=64 * args.num_blocks * args.block_bytes)
            tiers.append(FaultTier(inner, deferrer=deferrer, faults=faults, seed=seed))
        elif name == "redis":
            if not args.redis:
                raise SystemExit("stress: the redis tier needs --redis URL")
            inner = RedisTier(args.redis, namespace=f"kvactors-stress-{seed}")
            tiers.append(FaultTier(inner, deferrer=deferrer, faults=faults, seed=seed))
        else:
            raise SystemExit(f"stress: unknown tier {name!r} (memory, disk, redis)")
    return tiers


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


def run_stress(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, Any]:
    from kvactors.manager import TieringManager
    from kvactors.sim.explore import check_stats, check_tiers
    from kvactors.sim.tiers import Faults, ThreadDeferrer
    from kvactors.sim.workload import Env, Hang, WorkloadConfig, drive, make_clients

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    old_interval = sys.getswitchinterval()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    timeout = args.transfer_timeout
    watch = Watch(args.hang_after or max(10.0, 3 * timeout))
    faults = Faults.parse(args.faults, slow_s=timeout)
    deferrer = ThreadDeferrer(args.workers, name="stress-copy")
    tiers = _make_tiers(args, deferrer, faults, seed)
    manager = TieringManager.start(num_blocks=args.num_blocks, block_bytes=args.block_bytes, secondary_tiers=tiers,
                                   transfer_timeout_s=timeout, lookup_timeout_s=timeout, event_log=args.event_log)
    requests = args.requests or 10**12  # 0: unbounded (with --seconds)
    # A store never completed keeps its row forever (its writer might still write): over a long run such
    # rows would fill the pool, so stores here complete late instead, unless --never-complete asks otherwise.
    config = WorkloadConfig(clients=args.threads, requests=requests, keys=args.keys, p_reset=0.002,
                            store_outcomes=(0.8, 0.1, 0.1 - args.never_complete, args.never_complete),
                            transfer_timeout_s=timeout)
    started = time.monotonic()
    stop_at = None if args.seconds is None else started + args.seconds
    abort = threading.Event()
    env = Env(manager=manager, deferrer=deferrer, config=config, seed=seed,
              should_stop=lambda: abort.is_set() or (stop_at is not None and time.monotonic() >= stop_at))
    errors: list[str] = []

    def frontend(client: Any, index: int) -> None:
        try:
            drive(client, watch.bound_s)
        except Hang as exc:
            watch.hang(f"frontend {index}: {exc}")
            abort.set()
        except Exception as exc:
            errors.append(f"frontend {index} raised {exc!r}\n{traceback.format_exc()}")
            abort.set()

    threads = [threading.Thread(target=frontend, args=(client, i), name=f"stress-frontend-{i}", daemon=True)
               for i, client in enumerate(make_clients(env))]
    progress: Any = contextlib.nullcontext()
    if not args.no_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("stress"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[ops]}"),
                            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
    with progress:
        task = None
        by_time = args.seconds is not None and not args.requests
        if not args.no_progress:
            total = int(args.seconds) if by_time else args.threads * args.requests
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
    stats = None if watch.hangs else _settle(env, manager, watch, 4 * timeout + 5,
                                             lambda: sum(len(getattr(t, "stalled", ())) for t in tiers))
    if stats is not None:
        violations.extend(check_stats(env, stats, tiers))
    ok, _ = watch.call("stop()", lambda: manager.stop(timeout=watch.bound_s))
    deferrer.close()
    violations.extend(env.violations)
    if ok and not watch.hangs:
        violations.extend(check_tiers(env, tiers))
    violations.extend(deferrer.errors)
    sys.setswitchinterval(old_interval)
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
        "seed": seed,
        "seconds": round(elapsed, 2),
        "ops_per_s": round(env.operations / elapsed, 1) if elapsed else 0.0,
        "threads": args.threads,
        "tiers": args.tiers,
        "expected_misuse": env.expected_misuse,
        "jobs_submitted": int(stats.get("jobs_submitted", 0)),
        "jobs_timed_out": int(stats.get("jobs_timed_out", 0)),
        "stores_timed_out": int(stats.get("stores_timed_out", 0)),
        "blocks_ready": int(stats.get("blocks_ready", 0)),
        "blocks_unusable": int(stats.get("blocks_detached", 0)) + int(stats.get("jobs_held", 0)),
        "violation_list": violations[:20],
    }
    for hang in watch.hangs:
        print(hang, file=sys.stderr)
    return summary


def _table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvactors stress (seed {summary['seed']})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name in ("operations", "requests", "violations", "leaks", "pins", "jobs", "hangs", "seconds", "ops_per_s",
                 "jobs_submitted", "jobs_timed_out", "stores_timed_out", "expected_misuse", "seed"):
        table.add_row(name, str(summary[name]))
    console = Console(file=sys.stdout)
    console.print(table)
    for violation in summary["violation_list"]:
        console.print(f"[red]violation[/red]: {violation}", markup=True, highlight=False)


def run(args: argparse.Namespace) -> int:
    summary = run_stress(args)
    _table(summary)
    print(f"seed {summary['seed']} (replay the workload with --seed {summary['seed']})")
    if args.json:
        sys.stdout.flush()
        print(json.dumps(summary))
    sys.stdout.flush()
    bad = summary["violations"] or summary["leaks"] or summary["pins"] or summary["jobs"] or summary["hangs"]
    if summary["hangs"]:
        os._exit(1)  # a hung thread cannot be joined: leave without waiting for it
    return 1 if bad else 0
