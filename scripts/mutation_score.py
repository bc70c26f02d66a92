#!/usr/bin/env python3
"""The check-log mutation score: every contract event of real logs deleted, duplicated or moved in turn.

Logs: the seed explorer's runs (``--seeds``) and a real-thread ``TieringManager`` run
(``--threads`` x ``--requests``). Prints the share caught, the mutations not caught
by kind, and the classes excluded as uncatchable with their reason (see
``kvactors.logcheck.mutations``). ``--quick``: a small version; ``--json``: only JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvactors.logcheck.mutations import UNCATCHABLE, score
from kvactors.logcheck.samples import by_manager, read_log, sim_log, thread_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, default=40, help="explorer seeds")
    parser.add_argument("--threads", type=int, default=4, help="frontend threads of the real-thread run")
    parser.add_argument("--requests", type=int, default=30, help="requests per thread")
    parser.add_argument("--quick", action="store_true", help="8 seeds, 2 threads x 10 requests")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.threads, args.requests = 8, 2, 10
    with tempfile.TemporaryDirectory() as tmp:
        sim = by_manager(read_log(sim_log(Path(tmp) / "sim.jsonl", range(args.seeds))))
        threads = by_manager(read_log(thread_log(Path(tmp) / "threads.jsonl", threads=args.threads,
                                                 requests=args.requests)))
    out = {}
    for name, managers in (("sim", sim), ("threads", threads), ("all", sim + threads)):
        out[name] = score(managers, raw_every=50 if name == "all" else 0).to_json()
    if args.json:
        print(json.dumps(out))
        return 0
    for name in ("sim", "threads", "all"):
        s = out[name]
        print(f"{name:8} {s['caught']}/{s['tried']} caught = {s['score']:.2%} ({s['caught_as_violation']} as "
              f"VIOLATION); by kind (caught, tried): {s['by_kind']}")
    total = out["all"]
    print(f"seq kept (not renumbered): {total['raw_seq']['caught']}/{total['raw_seq']['tried']} caught")
    print("not caught:")
    for label, count in total["uncaught"].items():
        print(f"  {count:5} {label}")
    print("excluded as uncatchable:")
    for label, count in total["excluded"].items():
        print(f"  {count:5} {label}")
    print("reasons:")
    for key, why in UNCATCHABLE.items():
        print(f"  {' '.join(filter(None, key))}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
