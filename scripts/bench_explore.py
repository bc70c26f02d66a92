"""The seed explorer's throughput: seeds (and client operations) per second.

    PYTHONPATH=. python scripts/bench_explore.py [--seeds 200] [--first 0] [--json]

Runs :func:`kvactors.testing.explore.explore` over ``--seeds`` consecutive seeds
(the same seeds every run, so two trees explore the same workloads) and prints
seeds/s, operations/s and the failures found (a clean tree finds none). On a
tree from before the toolkit's rename the explorer is ``kvactors.sim.explore``:
both are found, so ``scripts/ab_compare.py`` can run this on an old commit.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    try:
        explore_module = importlib.import_module("kvactors.testing.explore")
    except ModuleNotFoundError:
        explore_module = importlib.import_module("kvactors.sim.explore")
    started = time.perf_counter()
    report = explore_module.explore(range(args.first, args.first + args.seeds))
    elapsed = time.perf_counter() - started
    summary = {"seeds": report.runs, "seconds": round(elapsed, 3), "seeds_per_s": round(report.runs / elapsed, 2),
               "operations_per_s": round(report.operations / elapsed, 1), "failures": len(report.failures)}
    print(f"{report.runs} seeds in {elapsed:.1f} s: {summary['seeds_per_s']} seeds/s, "
          f"{summary['operations_per_s']} operations/s, {len(report.failures)} failing")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
