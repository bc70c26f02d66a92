"""``kvactors simulate``: a multi-threaded serving frontend on the real tiers, end to end.

Frontend threads serve multi-turn conversations that share long prefixes
through a real ``TieringManager`` (the CPU pool, a ``DiskTier``, a
``RedisTier`` with ``--redis``) and a ``TransferEngine`` (a CPU "device"
cache, or the CUDA device when one is present), check every onboarded block
byte for byte, and report hit rates, throughput, finalize latency, and the
three numbers that must be zero: contract violations, byte mismatches, leaked
states. The workload is described in :mod:`kvactors.simulation.runner`.

Exit status: 0 for a clean run, 1 if a violation, mismatch, leak, frontend
error or a failed ``check-log`` was found, 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any

HELP = "Run a multi-threaded serving frontend on the real tiers and check the lifecycle contract end to end."

DEFAULTS: dict[str, Any] = {"threads": 4, "requests": 2000, "block_bytes": 64 * 1024, "cpu_blocks": 256,
                            "disk_bytes": 256 * 1024 * 1024}
QUICK: dict[str, Any] = {"threads": 4, "requests": 1500, "block_bytes": 16 * 1024, "cpu_blocks": 128,
                         "disk_bytes": 64 * 1024 * 1024}
MIN_BLOCK_BYTES = 64
MIN_CPU_BLOCKS = 16
PROG = "kvactors simulate"

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


class OptionError(Exception):
    """A bad option found after parsing (exit status 2)."""


def parse_size(text: str) -> int:
    """``4096``, ``256KiB``, ``1GiB``, ``1.5MB`` -> bytes (an int > 0). For argparse ``type=``."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 4096, 256KiB, 64MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes > 0, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--threads", type=positive_int, help=f"frontend threads (default {DEFAULTS['threads']})")
    g.add_argument("--requests", type=positive_int,
                   help=f"requests (conversation turns) to serve; a preempted turn counts once "
                        f"(default {DEFAULTS['requests']}; with --seconds alone: no limit)")
    g.add_argument("--seconds", type=positive_float, help="stop starting requests after this many seconds")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the block contents (default 0)")
    g.add_argument("--quick", action="store_true",
                   help=f"a short run (~10 s): {QUICK['requests']} requests, blocks of 16KiB, "
                        f"{QUICK['cpu_blocks']} CPU blocks, 64MiB of disk; explicit options still apply")
    t = parser.add_argument_group("tiers")
    t.add_argument("--block-bytes", type=parse_size, help="bytes per KV block (default 64KiB)")
    t.add_argument("--cpu-blocks", type=positive_int,
                   help=f"blocks in the primary CPU pool (default {DEFAULTS['cpu_blocks']})")
    t.add_argument("--disk-dir", help="directory of the DiskTier (default: a temporary directory, removed after)")
    t.add_argument("--disk-bytes", type=parse_size, help="capacity of the DiskTier (default 256MiB)")
    t.add_argument("--redis", metavar="URL", help="add a RedisTier on this server (e.g. redis://localhost:6379/0)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the device cache lives (default: cuda when present, else cpu)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    o.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while it runs (0: any free port)")
    o.add_argument("--plot", metavar="FILE.png", help="plot hit rate and throughput over time (needs matplotlib)")
    o.add_argument("--event-log", metavar="PATH",
                   help="the JSON-lines lifecycle log (default: events.jsonl in the run's directory)")


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else DEFAULTS)[name]


def _check_dir_writable(path: str, option: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise OptionError(f"{option} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OptionError(f"{option} {path}: not writable ({exc.strerror or exc})") from None


def _check_redis(url: str) -> None:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
    except ValueError as exc:
        raise OptionError(f"--redis {url}: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise OptionError(f"--redis {url}: the server does not answer ({exc})") from None
    finally:
        client.close()


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda: no CUDA device is available")
    return choice


def _check_log(path: str) -> tuple[str, bool]:
    """Run ``kvactors check-log`` on ``path`` if that command exists: (a one-line result, ok)."""
    name = "kvactors.commands.check_log"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return "check-log not available", True
    parser = argparse.ArgumentParser(prog="kvactors check-log")
    module.add_arguments(parser)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = int(module.run(parser.parse_args([path])))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    if rc == 0:
        return f"ok{': ' + last if last else ''}", True
    return f"FAILED (exit {rc}){': ' + last if last else ''}", False


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except OptionError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvactors.simulation.runner import SimConfig, Simulation

    block_bytes = _pick(args, "block_bytes")
    cpu_blocks = _pick(args, "cpu_blocks")
    disk_bytes = _pick(args, "disk_bytes")
    if block_bytes < MIN_BLOCK_BYTES:
        raise OptionError(f"--block-bytes must be at least {MIN_BLOCK_BYTES}, got {block_bytes}")
    if cpu_blocks < MIN_CPU_BLOCKS:
        raise OptionError(f"--cpu-blocks must be at least {MIN_CPU_BLOCKS}, got {cpu_blocks}")
    if disk_bytes < 4 * (block_bytes + 256):
        raise OptionError(f"--disk-bytes {disk_bytes} holds fewer than 4 blocks of {block_bytes} bytes")
    requests = _pick(args, "requests") if args.requests is not None or args.seconds is None else None
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise OptionError("--plot needs matplotlib: pip install matplotlib "
                              "(or pip install 'kvactors[plot]')") from None
        _check_dir_writable(os.path.dirname(os.path.abspath(args.plot)), "--plot")
    device = _device(args.device)
    if args.metrics_port is not None:
        _check_metrics_port(args.metrics_port)

    own_disk = args.disk_dir is None
    # The run's directory holds what the user did not place: the disk tier (removed after) and the log (kept).
    run_dir = tempfile.mkdtemp(prefix="kvactors-simulate-") if own_disk or not args.event_log else ""
    disk_dir = os.path.join(run_dir, "disk") if own_disk else os.path.abspath(args.disk_dir)
    event_log = os.path.abspath(args.event_log) if args.event_log else os.path.join(run_dir, "events.jsonl")
    try:
        _check_dir_writable(disk_dir, "--disk-dir")
        _check_dir_writable(os.path.dirname(event_log), "--event-log")
        if args.redis:
            _check_redis(args.redis)
    except OptionError:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise

    config = SimConfig(threads=_pick(args, "threads"), requests=requests, seconds=args.seconds, seed=args.seed,
                       block_bytes=block_bytes, cpu_blocks=cpu_blocks, disk_dir=disk_dir, disk_bytes=disk_bytes,
                       redis_url=args.redis, event_log=event_log, device=device)
    result = _simulate(Simulation(config), args.metrics_port)
    if own_disk:
        shutil.rmtree(disk_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # kept when it holds the log
            os.rmdir(run_dir)

    from kvactors.simulation.report import DEFINITIONS, notes, plot, summary_table

    check, check_ok = _check_log(event_log)
    console = Console(highlight=False)
    console.print(summary_table(result, event_log=event_log, check_log=check))
    for line in DEFINITIONS:
        console.print(line, style="dim", markup=False)
    for line in notes(result):
        console.print(line, markup=False)
    if args.plot:
        plot(result, args.plot)
        console.print(f"plot: {os.path.abspath(args.plot)}", markup=False)
    if args.json:
        out = result.to_json()
        out.update(event_log=event_log, check_log=check, device=device, tiers=["cpu", *result.tiers])
        console.file.flush()
        print(json.dumps(out), flush=True)
    return 0 if result.ok and check_ok else 1


def _check_metrics_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise OptionError(f"--metrics-port must be 0-65535, got {port}")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise OptionError("--metrics-port needs prometheus-client: pip install 'kvactors[metrics]'") from None


def _simulate(sim: Any, metrics_port: int | None = None) -> Any:
    """Run with a progress bar on stderr (when it is a terminal); with ``metrics_port``,
    serve the manager's metrics from its start to the end of the run."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = sim.config
    console = Console(stderr=True)
    by_time = cfg.requests is None
    columns = [TextColumn("[bold]simulate[/bold]"), BarColumn(),
               TextColumn("{task.fields[done]}"), TimeElapsedColumn(), TextColumn("{task.fields[hits]}")]
    with Progress(*columns, console=console, disable=not console.is_terminal, transient=False) as progress:
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
