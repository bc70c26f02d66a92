"""``kvactors stress``: the random workload on real threads, checked against the contract.

N frontend threads each run the workload of :mod:`kvactors.testing.workload`
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
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvactors.commands import options as opt

HELP = "Run the random workload on real threads and check the lifecycle contract."

LEAK_STATS = ("active_requests", "primary_requests", "supervisor_requests", "lookups_in_flight")
PIN_STATS = ("blocks_pinned", "jobs_pinning", "blocks_pending")
JOB_STATS = ("jobs_in_flight", "jobs_queued")


DEFAULT_FAULTS = "fail=0.05,raise=0.01,stall=0.001,slow=0.05,lookup_raise=0.01"
TIERS = ("memory", "disk", "redis")
PROG = "kvactors stress"
EPILOG = f"""syntax:
  {opt.SIZE_SYNTAX}
  {opt.FAULT_SYNTAX}

exit status: 0 clean; 1 a violation, leak, pin, job left or hang; 2 bad options;
3 nothing could be checked (the workload itself crashed, or no request ran); 130 Ctrl-C."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--threads", type=opt.integer(1, 256), default=4, metavar="N", help="frontend threads (default 4)")
    w.add_argument("--requests", type=opt.integer(1, 10**9), default=None, metavar="N",
                   help="requests per thread (default 200; with --seconds alone: no limit)")
    w.add_argument("--seconds", type=opt.number(0, 7 * 86400, low_open=True), default=None, metavar="S",
                   help="stop starting requests after S seconds (with --requests: whichever comes first; "
                        "default: no time limit)")
    w.add_argument("--seed", type=opt.integer(0, 2**63 - 1), default=None, metavar="N",
                   help="workload seed (default: random, printed)")
    w.add_argument("--keys", type=opt.integer(1, 10**9), default=1024, metavar="N",
                   help="size of the shared key space (default 1024)")
    w.add_argument("--never-complete", type=opt.probability, default=0.0, metavar="P",
                   help="fraction of stores never completed (each keeps its row for good; default 0)")
    w.add_argument("--switch-interval", type=opt.number(0, 1, low_open=True), default=None, metavar="S",
                   help="sys.setswitchinterval for the run, e.g. 1e-6 shakes the GIL (default: Python's, 0.005)")
    w.add_argument("--workers", type=opt.integer(1, 64), default=2, metavar="N",
                   help="copy/completion worker threads (default 2)")
    t = parser.add_argument_group("tiers")
    t.add_argument("--tiers", type=opt.tier_list(TIERS), default="memory", metavar="LIST",
                   help="comma-separated secondary tiers, each once: memory, disk, redis (default memory; "
                        "--disk-dir, --disk-bytes and --redis add theirs)")
    t.add_argument("--block-bytes", type=opt.parse_size, default=64, metavar="SIZE",
                   help="bytes per block (default 64)")
    t.add_argument("--cpu-blocks", type=opt.integer(1, 2**31), default=64, metavar="N",
                   help="blocks in the primary CPU pool (default 64)")
    t.add_argument("--num-blocks", type=opt.integer(1, 2**31), dest="cpu_blocks", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name
    t.add_argument("--disk-dir", type=opt.directory, default=None, metavar="DIR",
                   help="directory of the disk tier (default: a temporary one, removed at exit)")
    t.add_argument("--disk-bytes", type=opt.parse_size, default=None, metavar="SIZE",
                   help="capacity of the disk tier (default 64 x --cpu-blocks x --block-bytes)")
    t.add_argument("--redis", type=opt.redis_url, default=None, metavar="URL",
                   help="Redis server of the redis tier, answering PING within 1 s (default: none; its keys go "
                        "under a namespace of the run, deleted at exit)")
    t.add_argument("--redis-bytes", type=opt.parse_size, default=None, metavar="SIZE",
                   help="capacity of the redis tier's namespace (default: the server's maxmemory)")
    t.add_argument("--faults", type=opt.fault_spec, default=DEFAULT_FAULTS, metavar="SPEC",
                   help=f"per-job fault probabilities of every tier (default {DEFAULT_FAULTS.replace(',', ', ')}; "
                        "SPEC below)")
    t.add_argument("--transfer-timeout", type=opt.number(0, 3600, low_open=True), default=0.5, metavar="S",
                   help="transfer deadline in seconds (default 0.5)")
    t.add_argument("--hang-after", type=opt.number(0, 86400, low_open=True), default=None, metavar="S",
                   help="a call not returning after S seconds is a hang; more than --transfer-timeout "
                        "(default max(10, 3 x --transfer-timeout))")
    o = parser.add_argument_group("output")
    o.add_argument("--event-log", type=opt.output_file, default=None, metavar="FILE",
                   help="write the lifecycle events here, JSON lines (default: none); an existing file "
                        "is refused unless --append-log")
    o.add_argument("--append-log", action="store_true", help="append to an existing --event-log file")
    o.add_argument("--json", action="store_true",
                   help="print only a JSON summary on stdout (the table goes to stderr)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")


@dataclass(frozen=True)
class Plan:
    """The run the options describe, once their combinations are checked."""

    tiers: tuple[str, ...]
    requests: int
    hang_after: float
    disk_bytes: int
    redis_bytes: int | None


def plan(args: argparse.Namespace) -> Plan:
    """Check the combinations of options (raises :class:`~kvactors.commands.options.OptionError`); nothing starts."""
    tiers = list(args.tiers)
    if (args.disk_dir is not None or args.disk_bytes is not None) and "disk" not in tiers:
        tiers.append("disk")
    if args.redis is not None and "redis" not in tiers:
        tiers.append("redis")
    if "redis" in tiers and args.redis is None:
        raise opt.OptionError("the redis tier needs --redis URL")
    if args.redis_bytes is not None and args.redis is None:
        raise opt.OptionError("--redis-bytes needs --redis URL")
    requests = args.requests
    if requests is None:
        requests = 200 if args.seconds is None else 10**12  # --seconds alone: only the time bounds the run
    timeout = args.transfer_timeout
    hang_after = args.hang_after if args.hang_after is not None else max(10.0, 3 * timeout)
    if hang_after <= timeout:
        raise opt.OptionError(f"--hang-after {hang_after:g} must be more than --transfer-timeout {timeout:g} "
                              "(a call may wait that long)")
    block = args.block_bytes
    disk_bytes = args.disk_bytes if args.disk_bytes is not None else 64 * args.cpu_blocks * block
    for name, capacity in (("disk", disk_bytes if "disk" in tiers else None), ("redis", args.redis_bytes)):
        if capacity is not None and capacity < 4 * (block + 256):
            raise opt.OptionError(f"--{name}-bytes {capacity} holds fewer than 4 blocks of {block} bytes")
    if "disk" in tiers and args.disk_bytes is not None:
        free = opt.free_disk(args.disk_dir or tempfile.gettempdir())
        if disk_bytes > free:
            raise opt.OptionError(f"--disk-bytes {opt.format_bytes(disk_bytes)} is more than the "
                                  f"{opt.format_bytes(free)} free on the disk tier's file system")
    if args.event_log is not None and os.path.exists(args.event_log) and not args.append_log:
        raise opt.OptionError(f"--event-log {args.event_log}: the file exists (add --append-log to append to it)")
    try:
        opt.check_memory([("the CPU pool (--cpu-blocks x --block-bytes)", args.cpu_blocks * block),
                          ("block patterns (--keys x --block-bytes)", min(args.keys, 100_001) * block)])
    except opt.OptionError as exc:
        raise opt.OptionError(f"--cpu-blocks {args.cpu_blocks} --block-bytes {block}: {exc}") from None
    return Plan(tiers=tuple(tiers), requests=requests, hang_after=hang_after, disk_bytes=disk_bytes,
                redis_bytes=args.redis_bytes)


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


def _make_tiers(args: argparse.Namespace, plan: Plan, deferrer: Any, faults: Any, seed: int,
                disk_root: str, namespace: str) -> list[Any]:
    from kvactors.testing.tiers import FaultTier, RecordingTier
    from kvactors.tiers.base import INLINE_CALLS, SecondaryTier
    from kvactors.tiers.disk import DiskTier
    from kvactors.tiers.redis import RedisTier

    tiers: list[Any] = []
    for name in plan.tiers:
        if name == "memory":
            tiers.append(RecordingTier(name="memory", capacity_blocks=max(4 * args.cpu_blocks, 16),
                                       deferrer=deferrer, faults=faults, seed=seed, inline_calls=INLINE_CALLS))
        elif name == "disk":
            inner: SecondaryTier = DiskTier(disk_root, capacity_bytes=plan.disk_bytes)
            tiers.append(FaultTier(inner, deferrer=deferrer, faults=faults, seed=seed))
        else:
            inner = RedisTier(args.redis, namespace=namespace, capacity_bytes=plan.redis_bytes)
            tiers.append(FaultTier(inner, deferrer=deferrer, faults=faults, seed=seed))
    return tiers


def _runtime_frame(tb: Any) -> bool:
    """Whether a traceback passes through the runtime (not only the workload and the standard library)."""
    runtime = [os.path.join(ROOT, part) for part in ("manager.py", "actors", "core", "tiers", "transfer")]
    return any(frame.filename.startswith(tuple(runtime)) for frame in traceback.extract_tb(tb))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_redis_namespace(url: str, namespace: str) -> None:
    """Delete the keys under ``namespace:`` (best effort, bounded by the client's timeouts)."""
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)
        batch = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for i in range(0, len(batch), 1000):
            client.delete(*batch[i:i + 1000])
        client.close()
    except Exception:  # best effort: the keys are under a namespace of this run only
        pass


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


def run_stress(args: argparse.Namespace, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run; the summary. Raises ``OptionError`` for bad combinations (before anything starts).

    Everything it starts is stopped and every temporary directory removed when it
    returns or raises (``KeyboardInterrupt`` included). ``state["hung"]`` is set
    when a thread may still be stuck (the caller should not wait for it at exit).
    """
    the_plan = plan(args)
    state = {} if state is None else state
    with contextlib.ExitStack() as cleanup:
        return _run_stress(args, the_plan, cleanup, state)


def _run_stress(args: argparse.Namespace, plan: Plan, cleanup: contextlib.ExitStack,
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
    if args.event_log is not None:
        opt.prepare_dir(os.path.dirname(args.event_log), "--event-log", created)
    namespace = f"kvactors-stress-{uuid.uuid4().hex[:12]}"
    if args.redis is not None:
        cleanup.callback(drop_redis_namespace, args.redis, namespace)

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    old_interval = sys.getswitchinterval()
    cleanup.callback(sys.setswitchinterval, old_interval)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    timeout = args.transfer_timeout
    watch = Watch(plan.hang_after)
    faults = Faults(slow_s=timeout, **{("raise_" if k == "raise" else k): v for k, v in args.faults.items()})
    deferrer = ThreadDeferrer(args.workers, name="stress-copy")
    cleanup.callback(deferrer.close)
    tiers = _make_tiers(args, plan, deferrer, faults, seed, disk_root, namespace)
    try:
        manager = TieringManager.start(num_blocks=args.cpu_blocks, block_bytes=args.block_bytes,
                                       secondary_tiers=tiers, transfer_timeout_s=timeout,
                                       lookup_timeout_s=timeout, event_log=args.event_log)
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


def _table(summary: dict[str, Any], file: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvactors stress (seed {summary['seed']})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name in ("operations", "requests", "violations", "leaks", "pins", "jobs", "hangs", "workload_errors",
                 "seconds", "ops_per_s", "jobs_submitted", "jobs_timed_out", "stores_timed_out", "expected_misuse",
                 "seed"):
        table.add_row(name, str(summary[name]))
    console = Console(file=file)
    console.print(table)
    for violation in summary["violation_list"]:
        console.print(f"[red]violation[/red]: {violation}", markup=True, highlight=False)


def verdict(summary: dict[str, Any]) -> tuple[int, str | None]:
    """The exit status of a run and, when nothing could be checked, why."""
    if summary["workload_errors"]:
        return 3, ("the workload itself crashed (a bug of kvactors stress, not a contract violation of the "
                   "runtime): nothing was checked")
    if summary["violations"] or summary["leaks"] or summary["pins"] or summary["jobs"] or summary["hangs"]:
        return 1, None
    if not summary["requests"]:
        return 3, "no request ran (is --seconds too short?): nothing was checked"
    return 0, None


def run(args: argparse.Namespace) -> int:
    state: dict[str, Any] = {}
    try:
        summary = run_stress(args, state)
    except opt.OptionError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (the manager was stopped{'' if not state.get('hung') else ' (a thread hung)'}"
              "; temporary files removed)", file=sys.stderr, flush=True)
        if state.get("hung"):
            sys.stdout.flush()
            os._exit(130)  # a hung thread cannot be joined: leave without waiting for it
        return 130
    report = sys.stderr if args.json else sys.stdout
    _table(summary, report)
    for crash in summary["workload_error_list"]:
        print(f"workload error: {crash}", file=sys.stderr)
    print(f"seed {summary['seed']} (replay the workload with --seed {summary['seed']})", file=report)
    status, why = verdict(summary)
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
    if args.json:
        sys.stderr.flush()
        print(json.dumps(summary))
    sys.stdout.flush()
    if state.get("hung"):
        sys.stderr.flush()
        os._exit(status)  # a hung thread cannot be joined: leave without waiting for it
    return status
