"""Before/after: run benchmarks on an old commit (A) and this tree (B), interleaved, in one run.

    python scripts/ab_compare.py --old a677005 [--rounds 3] [--quick]

The old commit is exported with ``git archive`` into a temporary folder. Each
round runs every benchmark once on A, then once on B (the order alternates
per round, so a load that grows or fades hits both alike); each benchmark is
a script of *this* tree's ``scripts/`` run with ``PYTHONPATH`` pointing at one
tree, so both run the same workload and only the package differs. A
benchmark prints a JSON object as its last line (``--json``); the figures
named below are read from it. Printed per figure: every run, the medians, and
B/A of the medians (for a latency, above 1 is worse; for a rate, below 1).

Benchmarks: ``bench_lifecycle.py --quick`` (``throughput_ratio``,
``single_thread_ratio``, ``lookup_p50_us_single``, ``prepare_store_p50_us``,
``finalize_p99_ms``, ``slow_throughput_ratio``, ``slow_tier_p99_ratio``; the
ratios against the lock measured in the same run) and ``bench_explore.py`` (the seed
explorer's ``seeds_per_s``, ``operations_per_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

BENCHMARKS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "lifecycle": (["bench_lifecycle.py", "--quick", "--json"],
                  ("throughput_ratio", "single_thread_ratio", "lookup_p50_us_single", "prepare_store_p50_us",
                   "finalize_p99_ms", "slow_throughput_ratio", "slow_tier_p99_ratio")),
    "explore": (["bench_explore.py", "--seeds", "400", "--json"], ("seeds_per_s", "operations_per_s")),
}


def export(rev: str, into: str) -> str:
    """The tree of ``rev`` (this repository's) under ``into``."""
    archive = os.path.join(into, "old.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev], check=True)
    tree = os.path.join(into, "old")
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run_once(tree: str, argv: list[str], timeout_s: float) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"ab_compare: error: {argv[0]} on {tree} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit to compare against (A)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", help="run only these benchmarks")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one benchmark run may take")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = args.only or sorted(BENCHMARKS)
    with tempfile.TemporaryDirectory(prefix="kvactors-ab-") as tmp:
        trees = {"A": export(args.old, tmp), "B": ROOT}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {"A": [], "B": []} for n in names}
        for round_index in range(args.rounds):
            order = ("A", "B") if round_index % 2 == 0 else ("B", "A")
            for name in names:
                for side in order:
                    result = run_once(trees[side], BENCHMARKS[name][0], args.timeout)
                    runs[name][side].append(result)
                    figures = ", ".join(f"{k}={result[k]:.3g}" for k in BENCHMARKS[name][1])
                    print(f"round {round_index + 1} {name} {side}: {figures}", flush=True)
    print(f"# A = {args.old}, B = this tree; {args.rounds} rounds, interleaved; load: {os.getloadavg()[0]:.1f}")
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        for key in BENCHMARKS[name][1]:
            a = statistics.median(r[key] for r in runs[name]["A"])
            b = statistics.median(r[key] for r in runs[name]["B"])
            summary[f"{name}.{key}"] = {"A": a, "B": b, "B/A": b / a if a else float("nan")}
            print(f"{name:9} {key:22} A {a:10.4g}  B {b:10.4g}  B/A {b / a if a else float('nan'):6.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
