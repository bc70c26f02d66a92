"""Request lifecycles through kvactors' actors against the same core behind one lock.

    PYTHONPATH=. python scripts/bench_lifecycle.py [--quick] [--json] [--plot docs/bench_lifecycle.png]

Reference: :class:`baseline.LockedManager` (scripts/baseline.py) (BlockPool + LifecycleTable
behind one ``threading.RLock``, tier calls made synchronously inside it, as
vLLM does). Candidate: :class:`kvactors.TieringManager` (pykka actors).

Workload, per frontend thread (K = 1, 2, 4, 8), back to back until the phase ends:
``on_new_request``; ``lookup`` of 16 keys (8 hot keys resident in the primary
pool, 8 new ones: half hits; the new ones also go to the secondary tiers);
``prepare_store`` of the 8 new keys; the store is handed to one completion
thread, which calls ``complete_store`` (as copy workers would; a frontend has
at most 2 stores handed over and not yet completed, as a copy engine of bounded
depth, and waits for a slot otherwise); then ``on_request_finished``. Two secondary tiers. Variants: ``instant`` (tiers
report at once) and ``slow`` (``submit_store`` does 1 ms of blocking work,
``time.sleep(0.001)`` standing for a disk or Redis call, then reports). Each
tier declares the calls that return at once (``SecondaryTier.inline_calls``,
as ``DiskTier`` does): every call in ``instant``, all but ``submit_store`` in
``slow``; the lock calls every tier method inline whatever it declares.

Reported per variant and thread count, for both implementations (phases
interleaved: lock, kvactors, lock, kvactors, ... so other load on the machine
hits both alike): requests/s and the ratio kvactors/lock; p50/p99 of each call
as the calling thread sees it (``complete_store`` on the completion thread);
finalize latency: from the ``complete_store`` call of a request to the moment
the last tier's ``on_request_finished`` hook ran for it. Requests whose
``prepare_store`` stored nothing (no room) have no finalize sample; the share
of stores accepted is reported.

The configurations the summary reports (the most threads) run
``--headline-repeats`` times (default 3, interleaved; medians), the others
``--repeats`` times (1 with ``--quick``).

``--json``: the last line is a JSON object with ``throughput_ratio`` (instant,
8 threads), ``single_thread_ratio`` and ``lookup_p50_us_single`` (instant, 1
thread), ``prepare_store_p50_us`` (instant, 8 threads), ``slow_tier_p99_ratio``
(slow, 8 threads, p99 of the frontend threads' calls pooled),
``finalize_p99_ms`` (instant, 8 threads), ``finalize_p99_ms_slow`` and every row.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from baseline import LockedManager

from kvactors import JobResult, LookupResult, ReqContext, SecondaryTier, TieringManager, TransferJob
from kvactors.actors.threads import ThreadRuntime

NUM_BLOCKS = 8192
BLOCK_BYTES = 64
HOT_KEYS = 512
STORES_IN_FLIGHT = 2
FRONTEND_CALLS = ("on_new_request", "lookup", "prepare_store", "on_request_finished")


class BenchTier(SecondaryTier):
    """Holds nothing (every lookup misses); records when ``on_request_finished`` ran."""

    def __init__(self, name: str, submit_cost_s: float, finalized: dict[tuple[str, int], float]) -> None:
        SecondaryTier.__init__(self, name=name)  # not super(): the class is rebuilt for --metrics-against
        self.submit_cost_s = submit_cost_s
        self.finalized = finalized
        # What returns at once, declared as a real tier would (DiskTier: all but the hooks it
        # leaves alone); the slow variant's blocking submit_store is not.
        inline = {"lookup", "submit_load", "on_request_finished"} | (set() if submit_cost_s else {"submit_store"})
        self.inline_calls = frozenset(inline)  # type: ignore[misc]

    def lookup(self, keys: Sequence[bytes], ctx: ReqContext) -> list[LookupResult]:
        return [LookupResult.MISS] * len(keys)

    def submit_store(self, job: TransferJob) -> None:
        if self.submit_cost_s:
            time.sleep(self.submit_cost_s)  # the blocking I/O of a disk or Redis write
        self.report(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        self.report(JobResult(job.job_id, False, "bench tier holds nothing"))

    def on_request_finished(self, ctx: ReqContext) -> None:
        # Dict item assignment is atomic; each tier writes its own dict.
        self.finalized[ctx.identity] = time.perf_counter()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def import_base(rev: str) -> Any:
    """The tree of git revision ``rev``'s ``kvactors`` package, imported as ``kvactors_base``
    (its absolute imports rewritten), so both can run in this process: an A/B without the
    differences between two processes. Module names in strings are rewritten too: the
    package's lazy top-level names are such strings, and unrewritten,
    ``kvactors_base.TieringManager`` would be this tree's."""
    import importlib
    import re
    import subprocess
    import tempfile

    root = tempfile.mkdtemp(prefix="kvactors-base-")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", rev, "kvactors"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    os.rename(os.path.join(root, "kvactors"), os.path.join(root, "kvactors_base"))
    pattern = re.compile(r"""(\b(?:from|import) |["'])kvactors(?=[.\s"'])""")
    for dirpath, _, files in os.walk(os.path.join(root, "kvactors_base")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(pattern.sub(r"\1kvactors_base", text))
    sys.path.insert(0, root)
    return importlib.import_module("kvactors_base")


@contextlib.contextmanager
def based(base: Any) -> Any:
    """Rebind this module's kvactors names (and the bench tier's base class) to ``base``'s."""
    try:
        from kvactors_base.actors.threads import ThreadRuntime as base_threads  # type: ignore[import-not-found]
    except ImportError:  # a base from before the thread runtime had kvactors.actors.threads
        from kvactors_base.actors.runtime import ThreadRuntime as base_threads  # type: ignore[import-not-found]

    names = {"JobResult": base.JobResult, "LookupResult": base.LookupResult, "ReqContext": base.ReqContext,
             "SecondaryTier": base.SecondaryTier, "TieringManager": base.TieringManager,
             "ThreadRuntime": base_threads}
    body = {k: v for k, v in vars(BenchTier).items() if k not in ("__dict__", "__weakref__")}
    names["BenchTier"] = type("BenchTier", (base.SecondaryTier,), body)
    saved = {name: globals()[name] for name in names}
    globals().update(names)
    try:
        yield
    finally:
        globals().update(saved)


def scraper(manager: Any, interval_s: float, stop: threading.Event) -> threading.Thread:
    """A thread scraping ``manager``'s metrics every ``interval_s`` (as a Prometheus server would)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvactors.metrics import KvactorsCollector

    registry = CollectorRegistry()
    registry.register(KvactorsCollector(manager))

    def run() -> None:
        while not stop.wait(interval_s):
            generate_latest(registry)

    thread = threading.Thread(target=run, name="scraper", daemon=True)
    thread.start()
    return thread


def run_phase(impl: str, variant: str, threads: int, duration_s: float, claims: bool = True,
              colocation: bool = True, base: Any = None, scrape_s: float | None = None) -> dict[str, Any]:
    """One phase: ``threads`` frontends for ``duration_s``; returns its figures.

    ``claims=False``: kvactors without claims (every message through the actors' threads);
    ``colocation=False``: every kvactors actor on its own thread."""
    cost = 0.001 if variant == "slow" else 0.0
    fin = [{}, {}]  # per tier: identity -> perf_counter at its on_request_finished
    tiers = [BenchTier(f"t{i}", cost, fin[i]) for i in range(2)]
    if impl == "base":  # another revision (--metrics-against): its classes, through this module's names
        with based(base):
            return run_phase("kvactors", variant, threads, duration_s, claims, colocation)
    if impl == "kvactors":
        mgr = TieringManager.start(num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, secondary_tiers=tiers,
                                   runtime=ThreadRuntime(claims=claims, colocation=colocation))
    else:
        mgr = LockedManager(num_blocks=NUM_BLOCKS, pool=torch.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8),
                            secondary_tiers=tiers)
    hot = [f"hot-{i:08d}".encode().ljust(32, b".") for i in range(HOT_KEYS)]
    warm = ReqContext("warmup")
    mgr.on_new_request(warm)
    for start in range(0, HOT_KEYS, 64):
        out = mgr.prepare_store(hot[start:start + 64], warm)
        mgr.complete_store(out.keys_to_store, warm)
    mgr.on_request_finished(warm)
    if impl != "lock":
        mgr.wait_idle(30)
    scrape_stop = threading.Event()
    if impl == "kvactors" and scrape_s:
        scraper(mgr, scrape_s, scrape_stop)

    completions: queue.SimpleQueue[tuple[ReqContext, list[bytes], threading.Semaphore] | None] = queue.SimpleQueue()
    completed_at: dict[tuple[str, int], float] = {}
    lat: dict[str, list[float]] = {name: [] for name in (*FRONTEND_CALLS, "complete_store")}
    per_thread: list[dict[str, list[float]]] = []
    counts = [0] * threads
    stored = [0] * threads
    copy_waits = [0.0] * threads
    stop = threading.Event()
    start_barrier = threading.Barrier(threads + 1)

    def completer() -> None:
        mine: list[float] = []
        clock = time.perf_counter
        while (item := completions.get()) is not None:
            ctx, keys, slots = item
            t0 = clock()
            mgr.complete_store(keys, ctx)
            mine.append(clock() - t0)
            completed_at[ctx.identity] = t0
            slots.release()
        lat["complete_store"] = mine

    def frontend(n: int) -> None:
        mine: dict[str, list[float]] = {name: [] for name in FRONTEND_CALLS}
        per_thread.append(mine)
        l_new, l_look, l_prep, l_fin = (mine[name] for name in FRONTEND_CALLS)
        clock = time.perf_counter
        waited = 0.0
        hot_at = n * 97
        slots = threading.Semaphore(STORES_IN_FLIGHT)
        start_barrier.wait()
        for i in itertools.count():
            if stop.is_set():
                break
            ctx = ReqContext(f"r{n}-{i}")
            fresh = [f"new-{n}-{i}-{j}".encode().ljust(32, b".") for j in range(8)]
            keys = [hot[(hot_at + j * 61) % HOT_KEYS] for j in range(8)] + fresh
            hot_at += 13
            t0 = clock()
            mgr.on_new_request(ctx)
            t1 = clock()
            mgr.lookup(keys, ctx)
            t2 = clock()
            out = mgr.prepare_store(fresh, ctx)
            t3 = clock()
            if out is not None and out.keys_to_store:
                t_wait = clock()
                slots.acquire()  # the copy engine's depth: at most STORES_IN_FLIGHT per frontend
                waited += clock() - t_wait
                completions.put((ctx, out.keys_to_store, slots))
                stored[n] += 1
            t4 = clock()
            mgr.on_request_finished(ctx)
            t5 = clock()
            l_new.append(t1 - t0)
            l_look.append(t2 - t1)
            l_prep.append(t3 - t2)
            l_fin.append(t5 - t4)
            counts[n] += 1
        copy_waits[n] = waited

    gc.collect()
    done_thread = threading.Thread(target=completer, name="completer")
    done_thread.start()
    workers = [threading.Thread(target=frontend, args=(n,), name=f"frontend-{n}") for n in range(threads)]
    for w in workers:
        w.start()
    start_barrier.wait()
    t_start = time.perf_counter()
    time.sleep(duration_s)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t_start
    completions.put(None)
    done_thread.join()
    scrape_stop.set()
    if impl != "lock":
        mgr.wait_idle(60)
        mgr.stop()

    for mine in per_thread:
        for name, values in mine.items():
            lat[name].extend(values)
    finalize = []
    for identity, t0 in completed_at.items():
        ends = [f.get(identity) for f in fin]
        if all(e is not None for e in ends):
            finalize.append(max(ends) - t0)  # type: ignore[type-var]
    frontend_all = [v for name in FRONTEND_CALLS for v in lat[name]]
    requests = sum(counts)
    row: dict[str, Any] = {
        "impl": impl, "variant": variant, "threads": threads,
        "requests": requests, "rps": requests / elapsed,
        "stores_accepted": sum(stored) / requests if requests else 0.0,
        "copy_wait_share": sum(copy_waits) / (threads * elapsed),
        "frontend_p50_us": _pct(frontend_all, 0.5) * 1e6, "frontend_p99_us": _pct(frontend_all, 0.99) * 1e6,
        "finalize_p50_ms": _pct(finalize, 0.5) * 1e3, "finalize_p99_ms": _pct(finalize, 0.99) * 1e3,
        "finalize_samples": len(finalize),
    }
    for name, values in lat.items():
        row[f"{name}_p50_us"] = _pct(values, 0.5) * 1e6
        row[f"{name}_p99_us"] = _pct(values, 0.99) * 1e6
    return row


def merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one configuration: median of each figure, summed request counts."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, variant in zip(axes, ("instant", "slow"), strict=True):
        for impl, style in (("lock", "o--"), ("kvactors", "s-")):
            pts = sorted((r["threads"], r["rps"]) for r in rows if r["impl"] == impl and r["variant"] == variant)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_title(f"{variant} tiers" + (" (submit_store: 1 ms blocking)" if variant == "slow" else ""))
        ax.set_xlabel("frontend threads")
        ax.set_ylabel("request lifecycles / s")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"kvactors vs one lock ({os.cpu_count()} CPUs)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def metrics_ab(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """``--metrics-against``: rounds of (base, metrics on) phases, order reversed every round."""
    base = import_base(args.metrics_against)
    duration = args.duration or (1.2 if args.quick else 2.0)
    rounds = args.repeats or (2 if args.quick else 6)
    thread_counts = [int(t) for t in args.threads.split(",")]
    rows = []
    for variant in args.variants.split(","):
        for threads in thread_counts:
            got: dict[str, list[dict[str, Any]]] = {"base": [], "metrics": []}
            for r in range(rounds):
                for impl in ("base", "metrics") if r % 2 == 0 else ("metrics", "base"):
                    got[impl].append(run_phase("base" if impl == "base" else "kvactors", variant, threads, duration,
                                               base=base, scrape_s=args.scrape_interval, **options))
            ratios = [m["rps"] / b["rps"] for b, m in zip(got["base"], got["metrics"], strict=True)]
            row = {"variant": variant, "threads": threads, "rounds": rounds,
                   "base_rps": statistics.median(x["rps"] for x in got["base"]),
                   "metrics_rps": statistics.median(x["rps"] for x in got["metrics"]),
                   "ratio": statistics.median(ratios), "ratios": ratios,
                   "base_finalize_p99_ms": statistics.median(x["finalize_p99_ms"] for x in got["base"]),
                   "metrics_finalize_p99_ms": statistics.median(x["finalize_p99_ms"] for x in got["metrics"])}
            rows.append(row)
            print(f"{variant:8} {threads:>2} threads: {args.metrics_against[:10]} {row['base_rps']:.0f} req/s, "
                  f"metrics on {row['metrics_rps']:.0f} req/s: ratio {row['ratio']:.3f} (per round "
                  + ", ".join(f"{x:.2f}" for x in ratios) + f"); finalize p99 {row['base_finalize_p99_ms']:.2f} -> "
                  f"{row['metrics_finalize_p99_ms']:.2f} ms", flush=True)
    if args.json:
        print(json.dumps({"against": args.metrics_against, "scrape_interval_s": args.scrape_interval, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases, one repeat (under a minute)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--variants", default="instant,slow")
    parser.add_argument("--duration", type=float, default=None, help="seconds per phase")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--plot", default=None, help="write a PNG of requests/s against threads here")
    parser.add_argument("--headline-repeats", type=int, default=3,
                        help="repeats (median) of the configurations the JSON summary reports: the most threads")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the whole run, both implementations (default: 5 ms)")
    parser.add_argument("--no-claims", action="store_true",
                        help="kvactors without claims: frontend calls never run the idle primary on their thread")
    parser.add_argument("--no-colocation", action="store_true",
                        help="kvactors with the supervisor on a thread of its own, not the primary's")
    parser.add_argument("--metrics-against", metavar="REV", default=None,
                        help="the cost of metrics: this tree with a scraper thread (every --scrape-interval s) "
                             "against revision REV (before the counters), imported under another name; "
                             "interleaved rounds, no lock phases")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()
    options = {"claims": not args.no_claims, "colocation": not args.no_colocation}
    if args.metrics_against:
        metrics_ab(args, options)
        return
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    duration = args.duration or (1.2 if args.quick else 3.0)
    repeats = args.repeats or (1 if args.quick else 3)
    thread_counts = [int(t) for t in args.threads.split(",")]
    variants = args.variants.split(",")

    raw: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for variant in variants:
            for threads in thread_counts:
                for impl in ("lock", "kvactors"):  # interleaved
                    row = run_phase(impl, variant, threads, duration, **options)
                    raw.setdefault((impl, variant, threads), []).append(row)
    # The summary's figures come from one configuration each: more repeats there
    # (a single 1.2 s phase swings +-25% on a shared 2-core machine).
    top = max(thread_counts)
    for _ in range(max(args.headline_repeats - repeats, 0)):
        for variant in variants:
            for impl in ("lock", "kvactors"):
                raw[(impl, variant, top)].append(run_phase(impl, variant, top, duration, **options))
    rows = [merge(v) for v in raw.values()]

    def get(impl: str, variant: str, threads: int) -> dict[str, Any]:
        return next(r for r in rows if (r["impl"], r["variant"], r["threads"]) == (impl, variant, threads))

    calls = (*FRONTEND_CALLS, "complete_store")
    print(f"# {duration:.1f} s per phase, {repeats} repeat(s) ({max(repeats, args.headline_repeats)} at {top} "
          f"threads, medians), {os.cpu_count()} CPUs; latencies in µs "
          "(p50/p99 of each call as its caller sees it), finalize in ms")
    header = (f"{'variant':8} {'thr':>3} {'impl':9} {'req/s':>8} {'ratio':>6} {'stored':>6} "
              + " ".join(f"{c[:14]:>15}" for c in calls) + f" {'frontend':>13} {'finalize ms':>13}")
    print(header)
    for variant in variants:
        for threads in thread_counts:
            base = get("lock", variant, threads)
            for impl in ("lock", "kvactors"):
                r = get(impl, variant, threads)
                ratio = r["rps"] / base["rps"]
                cells = " ".join(f"{r[f'{c}_p50_us']:>7.0f}/{r[f'{c}_p99_us']:<7.0f}" for c in calls)
                print(f"{variant:8} {threads:>3} {impl:9} {r['rps']:>8.0f} {ratio:>6.2f} {r['stores_accepted']:>6.2f} "
                      f"{cells} {r['frontend_p50_us']:>6.0f}/{r['frontend_p99_us']:<6.0f} "
                      f"{r['finalize_p50_ms']:>6.2f}/{r['finalize_p99_ms']:<6.2f}")
    summary: dict[str, Any] = {}
    if "instant" in variants:
        k, b = get("kvactors", "instant", top), get("lock", "instant", top)
        summary["throughput_ratio"] = k["rps"] / b["rps"]
        summary["finalize_p99_ms"] = k["finalize_p99_ms"]
        summary["prepare_store_p50_us"] = k["prepare_store_p50_us"]
        low = min(thread_counts)
        k1, b1 = get("kvactors", "instant", low), get("lock", "instant", low)
        summary["single_thread_ratio"] = k1["rps"] / b1["rps"]
        summary["lookup_p50_us_single"] = k1["lookup_p50_us"]
    if "slow" in variants:
        k, b = get("kvactors", "slow", top), get("lock", "slow", top)
        summary["slow_tier_p99_ratio"] = k["frontend_p99_us"] / b["frontend_p99_us"]
        summary["finalize_p99_ms_slow"] = k["finalize_p99_ms"]
        summary["slow_throughput_ratio"] = k["rps"] / b["rps"]
    summary["threads"] = top
    print("# targets: throughput_ratio >= 0.6, single_thread_ratio >= 0.5, lookup_p50_us_single <= 60, "
          "prepare_store_p50_us <= 200, finalize_p99_ms <= 1, slow_tier_p99_ratio <= 0.1: "
          + ", ".join(f"{k}={v:.3g}" for k, v in summary.items() if isinstance(v, float)))
    if args.plot:
        plot(rows, args.plot)
        print(f"# plot: {args.plot}")
    if args.json:
        summary["rows"] = rows
        print(json.dumps(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
