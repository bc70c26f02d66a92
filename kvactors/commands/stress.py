"""``kvactors stress``: the random workload on real threads, checked against the contract.

N frontend threads each run the workload of :mod:`kvactors.testing.workload`.
It has random call orders, preemption, resets, misuse, and stores failed, late or never completed.
The threads run against one :class:`~kvactors.TieringManager` on pykka threads.
Its tiers fail, raise, stall, are slow, end jobs per key, report sloppily or get stuck (``--faults``).
Each tier is recorded and fault-injected by the transparent :mod:`kvactors.testing.tiers` wrappers.

Every wait has a bound.
A reply that does not come is a *hang*, reported with the stacks of every thread, never waited on forever.
At the end the runtime must settle to no state, no pin and no job.
The contract must hold, under the same checks as the deterministic exploration.
Exit status 1 on any violation, leak or hang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from kvactors.commands import options as opt
from kvactors.commands.scratch import drop_redis_namespace
from kvactors.commands.stress_plan import PROG, Plan, plan
from kvactors.commands.watch import Watch, all_stacks

__all__ = ["HELP", "PROG", "Plan", "Watch", "add_arguments", "all_stacks", "drop_redis_namespace", "plan", "run",
           "run_stress", "verdict"]

HELP = "Run the random workload on real threads and check the lifecycle contract."


DEFAULT_FAULTS = "fail=0.05,raise=0.01,stall=0.001,slow=0.05,lookup_raise=0.01"
TIERS = ("memory", "disk", "redis")
EPILOG = f"""syntax:
  {opt.SIZE_SYNTAX}
  {opt.FAULT_SYNTAX}

exit status: 0 clean; 1 a violation, leak, pin, job left or hang; 2 bad options;
3 nothing could be checked (the workload itself crashed, or no request ran); 130 Ctrl-C,
143 SIGTERM."""


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
    blocks = t.add_mutually_exclusive_group()  # one name or the other: both would silently keep the last
    blocks.add_argument("--cpu-blocks", type=opt.integer(1, 2**31), default=64, metavar="N",
                        help="blocks in the primary CPU pool (default 64)")
    blocks.add_argument("--num-blocks", type=opt.integer(1, 2**31), dest="cpu_blocks", default=argparse.SUPPRESS,
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
                   help="write the lifecycle events here, JSON lines (default: $KVACTORS_EVENT_LOG, if set, "
                        "else none); an existing file is refused unless --append-log")
    o.add_argument("--append-log", action="store_true", help="append to an existing --event-log file")
    o.add_argument("--json", action="store_true",
                   help="print only a JSON summary on stdout (the table goes to stderr)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")


def run_stress(args: argparse.Namespace, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run. Returns the summary.

    Raises ``OptionError`` for bad combinations, before anything starts.
    Everything it starts is stopped, and every temporary directory removed, when it returns or raises
    (``KeyboardInterrupt`` included).
    ``state["hung"]`` is set when a thread may still be stuck.
    The caller should then not wait for it at exit.
    """
    from kvactors.commands.stress_run import run_planned

    the_plan = plan(args)
    state = {} if state is None else state
    with contextlib.ExitStack() as cleanup:
        return run_planned(args, the_plan, cleanup, state)


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
            os._exit(opt.TERMINATION.status())  # a hung thread cannot be joined: leave without waiting
        return opt.TERMINATION.status()
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
