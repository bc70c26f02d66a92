#!/usr/bin/env python3
"""check-log's speed and memory on a big log: events/s and peak RSS.

The log is made from a real run's event patterns (the explorer's and a real-thread
run's managers, repeated with fresh manager numbers, req_ids and job_ids, 8 managers
interleaved in the file): ``--events`` of them (default 10 million; ``--quick``: 200k),
written to a temporary file, then checked in a fresh process (so its peak RSS is the
checker's alone). ``--json``: only JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvactors.logcheck.samples import big_log, read_log, sim_log, thread_log  # noqa: E402

_CHILD = """
import json, resource, sys, time
from kvactors.logcheck import check_file
start = time.perf_counter()
result = check_file(sys.argv[1])
seconds = time.perf_counter() - start
print(json.dumps({"verdict": result.verdict.name, "events": result.events, "seconds": seconds,
                  "events_per_second": result.events / seconds, "managers": result.managers,
                  "requests": result.requests, "violations": result.violation_count,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000, help="events in the log")
    parser.add_argument("--quick", action="store_true", help="200,000 events")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    parser.add_argument("--keep", metavar="PATH", help="write the log here and keep it")
    args = parser.parse_args(argv)
    if args.quick:
        args.events = 200_000
    with tempfile.TemporaryDirectory() as tmp:
        template = read_log(sim_log(Path(tmp) / "sim.jsonl", range(20)))
        template += read_log(thread_log(Path(tmp) / "threads.jsonl", threads=3, requests=20))
        path = Path(args.keep) if args.keep else Path(tmp) / "big.jsonl"
        start = time.perf_counter()
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(big_log(template, args.events, interleave=8))
        written = time.perf_counter() - start
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        child = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env,
                               check=False)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        figures = json.loads(child.stdout)
        figures.update(file_mib=round(path.stat().st_size / 2**20, 1), write_seconds=round(written, 1),
                       generator_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"{figures['verdict']}: {figures['events']:,} events ({figures['managers']} managers, "
              f"{figures['file_mib']} MiB) checked in {figures['seconds']:.1f} s = "
              f"{figures['events_per_second']:,.0f} events/s; peak RSS {figures['peak_rss_mib']:.0f} MiB")
    return 0 if figures["verdict"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
