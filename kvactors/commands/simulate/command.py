"""``kvactors simulate``: a multi-threaded serving frontend on the real tiers, end to end.

Frontend threads serve multi-turn conversations that share long prefixes.
They go through a real ``TieringManager`` and a ``TransferEngine``.
The manager has the CPU pool, a ``DiskTier``, and a ``RedisTier`` with ``--redis``.
The engine copies to a CPU "device" cache, or to the CUDA device when one is present.
Every onboarded block is checked byte for byte.
The run reports hit rates, throughput and finalize latency.
It also reports the three numbers that must be zero: contract violations, byte mismatches and leaked states.
The workload is described in :mod:`kvactors.commands.simulate.runner`.

Exit status:

* 0 for a clean run.
* 1 if a violation, mismatch, leak, frontend error or a failed ``check-log`` was found.
* 2 for bad options.
* 3 if no request ran.
* 130 after Ctrl-C, once the run stopped, the manager stopped and temporary files were removed.
* 143 after SIGTERM, the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from kvactors.commands import options as opt
from kvactors.commands.simulate.config import DEFAULTS as SIM_DEFAULTS
from kvactors.types import PRIMARY_TIER_NAME

HELP = "Run a multi-threaded serving frontend on the real tiers and check the lifecycle contract end to end."

# The defaults are SimConfig's (the one place they are written); --quick overrides some of them.
DEFAULTS: dict[str, Any] = {name: SIM_DEFAULTS[name] for name in
                            ("threads", "requests", "seed", "block_bytes", "cpu_blocks", "disk_bytes", "redis_bytes",
                             "transfer_timeout_s")}
QUICK: dict[str, Any] = {**DEFAULTS, "requests": 1500, "block_bytes": 16 * 1024, "cpu_blocks": 128,
                         "disk_bytes": 64 * 1024 * 1024, "redis_bytes": 64 * 1024 * 1024}
MIN_BLOCK_BYTES = 64
MIN_CPU_BLOCKS = 16
PROG = "kvactors simulate"
EPILOG = f"""syntax:
  {opt.SIZE_SYNTAX}

exit status: 0 clean; 1 a violation, mismatch, leak, frontend error or failed check-log;
2 bad options; 3 no request ran (nothing was checked); 130 Ctrl-C; 143 SIGTERM."""

parse_size = opt.parse_size


def _size(n: int) -> str:
    """``65536`` -> ``64KiB``, a default as the help shows it.

    ``--block-bytes`` reads it back.
    """
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)

OptionError = opt.OptionError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--threads", type=opt.integer(1, 256), metavar="N",
                   help=f"frontend threads (default {DEFAULTS['threads']})")
    g.add_argument("--requests", type=opt.integer(1, 10**9), metavar="N",
                   help=f"requests (conversation turns) to serve; a preempted turn counts once "
                        f"(default {DEFAULTS['requests']}, --quick {QUICK['requests']}; with --seconds alone: "
                        "no limit)")
    g.add_argument("--seconds", type=opt.number(0, 7 * 86400, low_open=True), metavar="S",
                   help="stop starting requests after S seconds (with --requests: whichever comes first; "
                        "default: no time limit)")
    g.add_argument("--seed", type=opt.integer(0, 2**63 - 1), default=DEFAULTS["seed"], metavar="N",
                   help=f"seed of the workload and the block contents (default {DEFAULTS['seed']})")
    g.add_argument("--quick", action="store_true",
                   help=f"a short run (~10 s): {QUICK['requests']} requests, blocks of {_size(QUICK['block_bytes'])}, "
                        f"{QUICK['cpu_blocks']} CPU blocks, {_size(QUICK['disk_bytes'])} of disk; "
                        "explicit options still apply")
    t = parser.add_argument_group("tiers")
    t.add_argument("--block-bytes", type=opt.parse_size, metavar="SIZE",
                   help=f"bytes per KV block, at least {MIN_BLOCK_BYTES} "
                        f"(default {_size(DEFAULTS['block_bytes'])}, --quick {_size(QUICK['block_bytes'])})")
    blocks = t.add_mutually_exclusive_group()  # one name or the other: both would silently keep the last
    blocks.add_argument("--cpu-blocks", type=opt.integer(1, 2**31), metavar="N",
                        help=f"blocks in the primary CPU pool, at least {MIN_CPU_BLOCKS} "
                             f"(default {DEFAULTS['cpu_blocks']}, --quick {QUICK['cpu_blocks']})")
    blocks.add_argument("--num-blocks", type=opt.integer(1, 2**31), dest="cpu_blocks", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # stress's old name
    t.add_argument("--disk-dir", type=opt.directory, metavar="DIR",
                   help="directory of the DiskTier (default: a temporary directory, removed at exit)")
    t.add_argument("--disk-bytes", type=opt.parse_size, metavar="SIZE",
                   help=f"capacity of the DiskTier (default {_size(DEFAULTS['disk_bytes'])}, "
                        f"--quick {_size(QUICK['disk_bytes'])})")
    t.add_argument("--redis", type=opt.redis_url, metavar="URL",
                   help="add a RedisTier on this server, answering PING within 1 s, e.g. redis://localhost:6379/0 "
                        "(default: none; its keys go under a namespace of the run, deleted at exit)")
    t.add_argument("--redis-bytes", type=opt.parse_size, metavar="SIZE",
                   help=f"capacity of the RedisTier's namespace (default {_size(DEFAULTS['redis_bytes'])}, "
                        f"--quick {_size(QUICK['redis_bytes'])})")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the device cache lives (default auto: cuda when present, else cpu)")
    t.add_argument("--transfer-timeout", type=opt.number(0, 3600, low_open=True),
                   default=DEFAULTS["transfer_timeout_s"], metavar="S",
                   help=f"transfer deadline in seconds (default {DEFAULTS['transfer_timeout_s']:g})")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print only the results as one JSON object on stdout (the table goes to stderr)")
    o.add_argument("--metrics-port", type=opt.integer(0, 65535), metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while it runs "
                        "(0: any free port; default: none)")
    o.add_argument("--plot", type=opt.plot_file, metavar="FILE.png",
                   help="plot hit rate and throughput over time (needs matplotlib; default: no plot)")
    o.add_argument("--event-log", type=opt.output_file, metavar="FILE",
                   help="the JSON-lines lifecycle log (default: events.jsonl in a temporary directory of the run, "
                        "kept); an existing file is refused unless --append-log")
    o.add_argument("--append-log", action="store_true", help="append to an existing --event-log file")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else DEFAULTS)[name]


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda: no CUDA device is available")
    return choice


@dataclass(frozen=True)
class Plan:
    """The run the options describe, once their combinations are checked."""

    threads: int
    requests: int | None
    block_bytes: int
    cpu_blocks: int
    disk_bytes: int
    redis_bytes: int
    device: str


def plan(args: argparse.Namespace) -> Plan:
    """Check the combinations of options and the memory they need. Nothing starts.

    Raises ``OptionError`` for a bad combination.
    """
    from kvactors.commands.simulate.traffic import WorkloadShape

    block_bytes = _pick(args, "block_bytes")
    cpu_blocks = _pick(args, "cpu_blocks")
    disk_bytes = _pick(args, "disk_bytes")
    redis_bytes = _pick(args, "redis_bytes")
    threads = _pick(args, "threads")
    if block_bytes < MIN_BLOCK_BYTES:
        raise OptionError(f"--block-bytes must be at least {MIN_BLOCK_BYTES}, got {block_bytes}")
    if cpu_blocks < MIN_CPU_BLOCKS:
        raise OptionError(f"--cpu-blocks must be at least {MIN_CPU_BLOCKS}, got {cpu_blocks}")
    if disk_bytes < 4 * (block_bytes + 256):
        raise OptionError(f"--disk-bytes {disk_bytes} holds fewer than 4 blocks of {block_bytes} bytes")
    if args.redis_bytes is not None and args.redis is None:
        raise OptionError("--redis-bytes needs --redis URL")
    if args.redis is not None and redis_bytes < 4 * (block_bytes + 256):
        raise OptionError(f"--redis-bytes {redis_bytes} holds fewer than 4 blocks of {block_bytes} bytes")
    if args.disk_bytes is not None:
        free = opt.free_disk(args.disk_dir or tempfile.gettempdir())
        if disk_bytes > free:
            raise OptionError(f"--disk-bytes {opt.format_bytes(disk_bytes)} is more than the "
                              f"{opt.format_bytes(free)} free on the disk tier's file system")
    opt.check_event_log(args.event_log, "--event-log", args.append_log)
    device = _device(args.device)
    pool = cpu_blocks * block_bytes
    cache = threads * WorkloadShape().max_request_blocks * block_bytes
    parts = [("the CPU pool (--cpu-blocks x --block-bytes)", pool), ("block contents", 2 * block_bytes)]
    if device == "cpu":
        parts.append(("the device cache (--threads x 64 blocks)", cache))
    else:
        import torch

        free_gpu = torch.cuda.mem_get_info()[0]
        if cache > free_gpu:
            raise OptionError(f"--threads {threads} --block-bytes {block_bytes}: the device cache needs "
                              f"{opt.format_bytes(cache)}; {opt.format_bytes(free_gpu)} free on the GPU")
    try:
        opt.check_memory(parts)
    except OptionError as exc:
        raise OptionError(f"--cpu-blocks {cpu_blocks} --block-bytes {block_bytes}: {exc}") from None
    requests = _pick(args, "requests") if args.requests is not None or args.seconds is None else None
    return Plan(threads=threads, requests=requests, block_bytes=block_bytes, cpu_blocks=cpu_blocks,
                disk_bytes=disk_bytes, redis_bytes=redis_bytes, device=device)


def _check_log(path: str) -> tuple[str, bool]:
    """Run ``kvactors check-log`` on ``path``. Returns a one-line result, and whether it is ok.

    Only an OK verdict is ok.
    """
    from kvactors.commands import check_log

    parser = argparse.ArgumentParser(prog="kvactors check-log")
    check_log.add_arguments(parser)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = int(check_log.run(parser.parse_args([path])))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    if rc == 0:
        return f"ok{': ' + last if last else ''}", True
    return f"FAILED (exit {rc}){': ' + last if last else ''}", False


def run(args: argparse.Namespace) -> int:
    try:
        with contextlib.ExitStack() as cleanup:
            return _run(args, cleanup)
    except OptionError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (the manager was stopped; temporary files removed)", file=sys.stderr, flush=True)
        return opt.TERMINATION.status()


def _run(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> int:
    from rich.console import Console

    from kvactors.commands.simulate.runner import SimConfig, Simulation

    the_plan = plan(args)
    if args.metrics_port is not None:
        _check_metrics_port()
    created: list[str] = []
    cleanup.callback(opt.remove_created, created)  # only what is still empty: never the user's data
    own_disk = args.disk_dir is None
    # The run's directory holds what the user did not place: the disk tier and the log.
    # The disk tier is removed at exit. The log is kept after a run that ends.
    # It is removed after an error or Ctrl-C, because nothing then reports where it is.
    run_dir = tempfile.mkdtemp(prefix="kvactors-simulate-") if own_disk or not args.event_log else ""
    keep_log: list[bool] = []

    def remove_run_dir() -> None:
        if not keep_log:
            shutil.rmtree(run_dir, ignore_errors=True)

    if run_dir:
        cleanup.callback(remove_run_dir)
    disk_dir = os.path.join(run_dir, "disk") if own_disk else args.disk_dir
    event_log = args.event_log if args.event_log else os.path.join(run_dir, "events.jsonl")
    opt.prepare_dir(disk_dir, "--disk-dir", created)
    if own_disk:
        cleanup.callback(shutil.rmtree, disk_dir, True)
    opt.prepare_dir(os.path.dirname(event_log), "--event-log", created)
    if args.plot:  # before the run, not after it: the plot's folder is made (and tried) as the log's is
        opt.prepare_dir(os.path.dirname(args.plot), "--plot", created)

    config = SimConfig(threads=the_plan.threads, requests=the_plan.requests, seconds=args.seconds, seed=args.seed,
                       block_bytes=the_plan.block_bytes, cpu_blocks=the_plan.cpu_blocks, disk_dir=disk_dir,
                       disk_bytes=the_plan.disk_bytes, redis_url=args.redis, redis_bytes=the_plan.redis_bytes,
                       event_log=event_log, device=the_plan.device, transfer_timeout_s=args.transfer_timeout)
    tiers = ",".join([PRIMARY_TIER_NAME, "disk", *(["redis"] if args.redis else [])])
    bound = " and ".join(filter(None, (f"{the_plan.requests} requests" if the_plan.requests else "",
                                       f"{args.seconds:g} s" if args.seconds else "")))
    print(f"{PROG}: started: seed {args.seed}, {the_plan.threads} threads, tiers {tiers}, device {the_plan.device}, "
          f"{bound}; lifecycle log {event_log}", file=sys.stderr, flush=True)
    try:
        result = _simulate(Simulation(config), args.metrics_port, show_progress=not args.no_progress)
    except Exception as exc:
        if opt.is_allocation_error(exc):
            raise OptionError(f"--cpu-blocks {the_plan.cpu_blocks} --block-bytes {the_plan.block_bytes}: "
                              f"cannot allocate ({str(exc).splitlines()[0]})") from None
        raise
    if result.interrupted:
        raise KeyboardInterrupt  # the runner stopped the run and the manager; report it as Ctrl-C
    if own_disk:
        shutil.rmtree(disk_dir, ignore_errors=True)
    keep_log.append(True)

    from kvactors.commands.simulate.report import DEFINITIONS, notes, plot, summary_table

    check, check_ok = _check_log(event_log)
    console = Console(highlight=False, file=sys.stderr if args.json else sys.stdout)
    console.print(summary_table(result, event_log=event_log, check_log=check))
    for line in DEFINITIONS:
        console.print(line, style="dim", markup=False)
    for line in notes(result):
        console.print(line, markup=False)
    if args.plot:
        plot(result, args.plot)
        console.print(f"plot: {args.plot}", markup=False)
    if args.json:
        out = result.to_json()
        out.update(event_log=event_log, check_log=check, device=the_plan.device,
                   tiers=[PRIMARY_TIER_NAME, *result.tiers])
        console.file.flush()
        print(json.dumps(out), flush=True)
    if not result.requests:
        print(f"{PROG}: no request ran (is --seconds too short?): nothing was checked", file=sys.stderr)
        return 3
    return 0 if result.ok and check_ok else 1


def _check_metrics_port() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise OptionError("--metrics-port needs prometheus-client: pip install 'kvactors[metrics]'") from None


def _simulate(sim: Any, metrics_port: int | None = None, show_progress: bool = True) -> Any:
    """Run, with a progress bar on stderr when it is a terminal and ``show_progress``.

    With ``metrics_port``, the manager's metrics are served from its start to the end of the run.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = sim.config
    console = Console(stderr=True)
    by_time = cfg.requests is None
    columns = [TextColumn("[bold]simulate[/bold]"), BarColumn(),
               TextColumn("{task.fields[done]}"), TimeElapsedColumn(), TextColumn("{task.fields[hits]}")]
    disable = not (show_progress and console.is_terminal)
    with Progress(*columns, console=console, disable=disable, transient=False) as progress:
        total = cfg.seconds if by_time else cfg.requests
        task = progress.add_task("simulate", total=total, done="", hits="")

        server: list[Any] = []

        def tick(s: Any) -> None:
            if metrics_port is not None and not server:
                from kvactors.metrics import serve_metrics

                try:
                    server.append(serve_metrics(s.manager, metrics_port)[0])
                except OSError as exc:
                    server.append(None)
                    console.print(f"{PROG}: metrics: cannot serve on port {metrics_port}: {exc}", markup=False)
                else:
                    console.print(f"metrics: http://127.0.0.1:{server[0].server_port}/metrics", markup=False)
            counts, hits = s.metrics.snapshot()
            looked = counts["keys_looked_up"]
            rate = f"hit rate {sum(hits.values()) / looked:.0%}" if looked else ""
            turns = counts["turns"]
            done = f"{turns} requests" if by_time else f"{turns}/{cfg.requests} requests"
            progress.update(task, completed=min(s.elapsed, total) if by_time else turns, done=done, hits=rate)

        try:
            result = sim.run(tick)
        finally:
            progress.update(task, completed=total)
            if server and server[0] is not None:
                server[0].shutdown()
                server[0].server_close()
    return result
