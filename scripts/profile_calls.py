"""Where the microseconds of one ``lookup`` and one ``prepare_store`` go, end to end.

    PYTHONPATH=. python scripts/profile_calls.py [--against REV] [--calls 3000] [--json]

One frontend thread (not the main one), ``bench_lifecycle``'s workload (two instant tiers, a pool
of 8192 rows kept full, 512 hot keys): per request ``on_new_request``, a
``lookup`` of 16 keys (8 resident, 8 new: those go to both tiers),
``prepare_store`` of the 8 new keys, ``complete_store``, ``on_request_finished``.
Each handler the runtime runs is timed (its own time: the handlers it runs
inside it, a tier's inline call say, are counted as theirs), on whichever
thread runs it; a call's time as its caller sees it, less the time of the
handlers it caused, is the facade and the mailbox: argument checks, message
and reply, the gate, the claim and its end, the wait for another thread and
the hand-off back. Printed per call: p50 of the whole, the handlers by
message, and the rest, in µs.

``--against REV``: the same in the same process for the package at git
revision ``REV`` (``bench_lifecycle.import_base``), rounds interleaved.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from typing import Any

from bench_lifecycle import BLOCK_BYTES, HOT_KEYS, NUM_BLOCKS, import_base

import kvactors

TIMED_CALLS = ("lookup", "prepare_store")


class HandlerClock:
    """Own time of each handler, by message type, on every thread; reset per call measured."""

    def __init__(self, actor_type: Any) -> None:
        self.own: collections.Counter[str] = collections.Counter()
        self._local = threading.local()
        original = actor_type.deliver
        clock = time.perf_counter
        local, own = self._local, self.own

        def deliver(actor: Any, message: object) -> None:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(0.0)
            started = clock()
            try:
                original(actor, message)
            finally:
                took = clock() - started
                inner = stack.pop()
                own[type(message).__name__] += took - inner
                if stack:
                    stack[-1] += took

        actor_type.deliver = deliver


def profile(pkg: Any, calls: int) -> dict[str, dict[str, float]]:
    """Per timed call: ``total`` and each handler's own time (p50 over ``calls`` requests, µs), and
    ``rest`` (the median of total less the handlers, per call). The calls are made on a thread of
    their own, as a serving frontend's (a claim on the main thread runs its own handler only)."""
    out: list[dict[str, dict[str, float]]] = []
    errors: list[BaseException] = []

    def frontend() -> None:
        try:
            out.append(_profile(pkg, calls))
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=frontend, name="frontend")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _profile(pkg: Any, calls: int) -> dict[str, dict[str, float]]:
    import importlib

    runtime_module = importlib.import_module(pkg.__name__ + ".actors.runtime")
    clock_of = HandlerClock(runtime_module.Actor)  # every handler, on a claimer's thread or an actor's

    class Tier(pkg.SecondaryTier):
        inline_calls = frozenset({"lookup", "submit_load", "on_request_finished", "submit_store"})

        def lookup(self, keys: Any, ctx: Any) -> list[Any]:
            return [pkg.LookupResult.MISS] * len(keys)

        def submit_store(self, job: Any) -> None:
            self.report(pkg.JobResult(job.job_id, True))

        def submit_load(self, job: Any) -> None:
            self.report(pkg.JobResult(job.job_id, False, "holds nothing"))

        def on_request_finished(self, ctx: Any) -> None:
            pass

    manager = pkg.TieringManager.start(num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES,
                                       secondary_tiers=[Tier(name="t0"), Tier(name="t1")])
    hot = [f"hot-{i:08d}".encode().ljust(32, b".") for i in range(HOT_KEYS)]
    warm = pkg.ReqContext("warm")
    manager.on_new_request(warm)
    for start in range(0, HOT_KEYS, 64):
        out = manager.prepare_store(hot[start:start + 64], warm)
        manager.complete_store(out.keys_to_store, warm)
    manager.on_request_finished(warm)
    assert manager.wait_idle(30)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in TIMED_CALLS}
    clock = time.perf_counter
    hot_at = 0
    try:
        for i in range(-500, calls):  # the first 500: warm-up, not kept
            ctx = pkg.ReqContext(f"r{i}")
            fresh = [f"new-{i}-{j}".encode().ljust(32, b".") for j in range(8)]
            keys = [hot[(hot_at + j * 61) % HOT_KEYS] for j in range(8)] + fresh
            hot_at += 13
            manager.on_new_request(ctx)
            assert manager.wait_idle(10)  # the finalize of the request before, and this one's start, are done
            for name in TIMED_CALLS:
                clock_of.own.clear()
                started = clock()
                answer = manager.lookup(keys, ctx) if name == "lookup" else manager.prepare_store(fresh, ctx)
                took = clock() - started
                own = dict(clock_of.own)  # the handlers that ran before the answer, on any thread
                if i >= 0:
                    sample = {f"handler {k}": v * 1e6 for k, v in own.items()}
                    sample["total"] = took * 1e6
                    sample["rest"] = (took - sum(own.values())) * 1e6
                    samples[name].append(sample)
                if name == "prepare_store":
                    out = answer
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
    finally:
        manager.stop()
    result: dict[str, dict[str, float]] = {}
    for name, rows in samples.items():
        parts = sorted({part for row in rows for part in row})
        result[name] = {part: statistics.median(row.get(part, 0.0) for row in rows) for part in parts}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", metavar="REV", default=None)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    packages = {"this tree": kvactors}
    if args.against:
        packages = {args.against: import_base(args.against), **packages}
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in packages}
    for r in range(args.rounds):
        order = list(packages.items()) if r % 2 == 0 else list(reversed(packages.items()))
        for label, pkg in order:
            rounds[label].append(profile(pkg, args.calls))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label, runs in rounds.items():
        summary[label] = {}
        for name in TIMED_CALLS:
            parts = sorted({part for run in runs for part in run[name]})
            summary[label][name] = {part: statistics.median(run[name].get(part, 0.0) for run in runs)
                                    for part in parts}
    print(f"# p50 µs per call (median of {args.rounds} rounds of {args.calls} calls); a handler's own time, "
          "the rest: facade, mailbox, hand-offs", file=sys.stderr if args.json else sys.stdout)
    for name in TIMED_CALLS:
        parts = sorted({part for label in summary for part in summary[label][name]},
                       key=lambda p: (p != "total", p == "rest", p))
        head = f"{name:<32}" + "".join(f"{label:>14}" for label in summary)
        print(head, file=sys.stderr if args.json else sys.stdout)
        for part in parts:
            line = f"  {part:<30}" + "".join(f"{summary[label][name].get(part, 0.0):14.1f}" for label in summary)
            print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
