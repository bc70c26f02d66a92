"""The primary pool's control cost per request: microseconds per 16-key call.

    PYTHONPATH=. python scripts/bench_pool.py [--quick] [--json] [--no-gc] [--only pool|manager] [--against REV]

Two workloads, each a loop of requests of ``--keys`` (16) new keys:

* ``pool``: a :class:`~kvactors.core.pool.BlockPool` of 1024 rows with the LRU
  policy alone: ``prepare_store`` (in steady state it evicts as many keys as it
  stores), ``complete_store``, ``lookup``, ``touch``, ``pin_for_load``,
  ``unpin_load``; the keys are unique, each pinned once by its owner.
* ``manager``: the same calls through a :class:`~kvactors.TieringManager` (no
  secondary tier, 64-byte blocks, one calling thread, so every call is claimed:
  the handler runs on the calling thread), plus ``on_new_request`` and
  ``on_request_finished`` per request; between requests (untimed) ``wait_idle``
  lets the finalize that runs on the primary's own thread end first (else the
  next calls find the primary busy, queue, and measure thread hand-offs).

Each figure is the median over rounds of the mean per call in a round (the
garbage collector runs as in production, or not at all with ``--no-gc``; a
collection is forced between rounds). ``--only pool|manager``: one workload.
``--against REV`` also imports the tree at git revision ``REV`` as
``kvactors_base`` (see ``import_base`` in ``scripts/bench_lifecycle.py``) and
runs its rounds interleaved with this tree's, printing both and the ratio
``base / this`` (above 1: this tree is faster).

``--json``: the last line is a JSON object ``{"pool": {op: us}, "manager": {...}}``
(and ``"base"`` and ``"speedup"`` of the same shape with ``--against``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_lifecycle import import_base

import kvactors

NUM_BLOCKS = 1024
BLOCK_BYTES = 64
POOL_OPS = ("prepare_store", "complete_store", "lookup", "touch", "pin_for_load", "unpin_load")
MANAGER_OPS = ("on_new_request", "lookup", "prepare_store", "complete_store", "prepare_load",
               "complete_load", "on_request_finished")

Round = Callable[[int], dict[str, float]]


def pool_round(pkg: Any, keys_per_call: int, requests: int) -> Round:
    """A round runner over one pool of ``pkg`` (kvactors or its base), warmed to steady state."""
    from importlib import import_module

    pool_mod = import_module(f"{pkg.__name__}.core.pool")
    lru = import_module(f"{pkg.__name__}.core.policies.lru")
    pool = pool_mod.BlockPool(NUM_BLOCKS, lru.LRUPolicy())
    clock = time.perf_counter_ns

    def run(seed: int) -> dict[str, float]:
        total = dict.fromkeys(POOL_OPS, 0)
        writer = ("w", seed)
        owner = ("o", seed)
        for i in range(requests):
            keys = [f"{seed}.{i}.{j}".encode() for j in range(keys_per_call)]
            t0 = clock()
            pool.prepare_store(keys, writer)
            t1 = clock()
            pool.complete_store(keys, writer, True)
            t2 = clock()
            pool.lookup(keys)
            t3 = clock()
            pool.touch(keys)
            t4 = clock()
            pool.pin_for_load(keys, owner)
            t5 = clock()
            pool.unpin_load(keys, owner)
            t6 = clock()
            for op, dt in zip(POOL_OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
                total[op] += dt
            if i % 64 == 63:
                pool.take_events()
        return {op: ns / requests / 1000 for op, ns in total.items()}

    for seed in range(-1 - 2 * NUM_BLOCKS // (keys_per_call * requests), 0):
        run(seed)  # fill the pool: every later store evicts
    return run


def manager_round(pkg: Any, keys_per_call: int, requests: int) -> tuple[Round, Callable[[], None]]:
    """A round runner over one ``TieringManager`` of ``pkg``, and its stop."""
    manager = pkg.TieringManager.start(num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES)
    primary = getattr(manager, "_primary", None) or manager._actors[0]  # older revisions kept the ref by name
    pool_type = type(primary._actor.pool)
    if not pool_type.__module__.startswith(pkg.__name__ + "."):
        manager.stop()
        raise RuntimeError(f"the {pkg.__name__} manager runs {pool_type.__module__}'s pool")
    ctx_type = pkg.ReqContext
    clock = time.perf_counter_ns

    def run(seed: int) -> dict[str, float]:
        total = dict.fromkeys(MANAGER_OPS, 0)
        for i in range(requests):
            keys = [f"{seed}.{i}.{j}".encode() for j in range(keys_per_call)]
            ctx = ctx_type(f"r{seed}.{i}")
            t0 = clock()
            manager.on_new_request(ctx)
            t1 = clock()
            manager.lookup(keys, ctx)
            t2 = clock()
            manager.prepare_store(keys, ctx)
            t3 = clock()
            manager.complete_store(keys, ctx, True)
            t4 = clock()
            manager.prepare_load(keys, ctx)
            t5 = clock()
            manager.complete_load(keys, ctx)
            t6 = clock()
            manager.on_request_finished(ctx)
            t7 = clock()
            # Untimed: the request's finalize (the supervisor, then the primary's thread) ends
            # before the next request, so each timed call finds the primary idle and claims it.
            if not manager.wait_idle(timeout=30):
                raise RuntimeError("the manager did not go idle")
            for op, dt in zip(MANAGER_OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6),
                              strict=True):
                total[op] += dt
            if i % 64 == 63:
                manager.take_events()
        if not manager.wait_idle(timeout=30):
            raise RuntimeError("the manager did not go idle")
        return {op: ns / requests / 1000 for op, ns in total.items()}

    for seed in range(-1 - 2 * NUM_BLOCKS // (keys_per_call * requests), 0):
        run(seed)
    return run, manager.stop


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {op: round(statistics.median(s[op] for s in samples), 2) for op in samples[0]}


def measure(packages: dict[str, Any], keys_per_call: int, requests: int, rounds: int,
            only: str | None = None) -> dict[str, dict[str, Any]]:
    """``{label: {"pool": {op: us}, "manager": {op: us}}}``, the labels' rounds interleaved."""
    out: dict[str, dict[str, Any]] = {label: {} for label in packages}
    if only != "manager":
        _measure_pool(out, packages, keys_per_call, requests, rounds)
    if only != "pool":
        _measure_manager(out, packages, keys_per_call, requests, rounds)
    return out


def _measure_pool(out: dict[str, dict[str, Any]], packages: dict[str, Any], keys_per_call: int, requests: int,
                  rounds: int) -> None:
    runners = {label: pool_round(pkg, keys_per_call, requests) for label, pkg in packages.items()}
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in packages}
    for r in range(rounds):
        for label, run in runners.items():
            gc.collect()
            samples[label].append(run(r))
    for label in packages:
        out[label]["pool"] = medians(samples[label])


def _measure_manager(out: dict[str, dict[str, Any]], packages: dict[str, Any], keys_per_call: int, requests: int,
                     rounds: int) -> None:
    stops = []
    try:
        mruns = {}
        for label, pkg in packages.items():
            run, stop = manager_round(pkg, keys_per_call, requests)
            mruns[label] = run
            stops.append(stop)
        samples = {label: [] for label in packages}
        for r in range(rounds):
            for label, run in mruns.items():
                gc.collect()
                samples[label].append(run(r))
    finally:
        for stop in stops:
            stop()
    for label in packages:
        out[label]["manager"] = medians(samples[label])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--json", action="store_true", help="a JSON object as the last line")
    parser.add_argument("--against", metavar="REV", help="also run the tree at git revision REV, interleaved")
    parser.add_argument("--keys", type=int, default=16, help="keys per call (default 16)")
    parser.add_argument("--no-gc", action="store_true", help="the garbage collector off while rounds run")
    parser.add_argument("--only", choices=("pool", "manager"), help="one workload only")
    args = parser.parse_args(argv)
    rounds, requests = (5, 200) if args.quick else (15, 500)
    packages: dict[str, Any] = {"this": kvactors}
    if args.against:
        packages["base"] = import_base(args.against)
    if args.no_gc:
        gc.disable()
    result = measure(packages, args.keys, requests, rounds, args.only)
    print(f"us per {args.keys}-key call (median of {rounds} rounds of {requests} requests; "
          f"gc {'off' if args.no_gc else 'on'})")
    parts = [part for part in ("pool", "manager") if part in result["this"]]
    summary: dict[str, Any] = {part: result["this"][part] for part in parts}
    if "base" in result:
        summary["base"] = result["base"]
        summary["speedup"] = {
            part: {op: round(us / result["this"][part][op], 2) for op, us in result["base"][part].items()}
            for part in parts}
    for part in parts:
        print(f"{part}:")
        header = f"  {'call':<22}{'this':>9}" + (f"{'base':>9}{'base/this':>11}" if "base" in result else "")
        print(header)
        for op, us in result["this"][part].items():
            line = f"  {op:<22}{us:>9.2f}"
            if "base" in result:
                line += f"{result['base'][part][op]:>9.2f}{summary['speedup'][part][op]:>11.2f}"
            print(line)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
