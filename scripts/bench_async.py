"""Request lifecycles from coroutines on one event loop: AsyncTieringManager against
the blocking TieringManager called through ``asyncio.to_thread``.

    PYTHONPATH=. python scripts/bench_async.py [--quick] [--json]

Workload: ``--requests`` lifecycles, at most ``--concurrency`` in flight (an
``asyncio.Semaphore``), all coroutines on one loop: ``on_new_request``;
``lookup`` of 8 shared keys (ready in the pool: hits) and 4 new ones;
``prepare_load`` of the hits, ``complete_load``; ``prepare_store`` of the new
keys, ``complete_store``; ``on_request_finished``. One secondary tier whose
``submit_store`` blocks for 1 ms (``--tier slow``, a disk or Redis write on
its thread) or reports at once (``--tier instant``). A ticker task sleeps
1 ms in a loop; its lateness is the loop's lag.

Modes, interleaved over ``--rounds`` (medians):

* ``async``: :class:`kvactors.AsyncTieringManager` (claims: a call may run the
  idle primary's handler on the loop's thread);
* ``async-queued``: the same with ``claims=False`` (every message to the
  primary's thread);
* ``to_thread``: each blocking call of the blocking manager through
  ``asyncio.to_thread`` (the loop's default thread pool), the non-blocking
  ones called on the loop.

Reported per mode: requests/s, loop lag p50/p99/max (ms), the most threads
alive at once. ``--json``: the last line is a JSON object with every row.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

from kvactors import (
    AsyncTieringManager,
    LookupResult,
    MemoryTier,
    ReqContext,
    TieringManager,
    TransferJob,
)

MODES = ("async", "async-queued", "to_thread")
SHARED = [f"shared-{i}".encode() for i in range(8)]


class BenchTier(MemoryTier):
    """A MemoryTier whose ``submit_store`` may block for 1 ms first."""

    def __init__(self, slow: bool) -> None:
        super().__init__(name="bench", capacity_blocks=1 << 20)
        self.slow = slow
        self.inline_calls = frozenset({"lookup", "touch"} | (set() if slow else {"submit_store", "submit_load"}))  # type: ignore[misc]

    def submit_store(self, job: TransferJob) -> None:
        if self.slow:
            time.sleep(0.001)
        super().submit_store(job)


class ToThread:
    """The blocking manager's blocking calls through ``asyncio.to_thread``."""

    def __init__(self, manager: TieringManager) -> None:
        self.manager = manager

    async def on_new_request(self, ctx: ReqContext) -> None:
        await asyncio.to_thread(self.manager.on_new_request, ctx)

    async def lookup(self, keys: list[bytes], ctx: ReqContext) -> list[LookupResult]:
        return await asyncio.to_thread(self.manager.lookup, keys, ctx)

    async def prepare_load(self, keys: list[bytes], ctx: ReqContext) -> Any:
        return await asyncio.to_thread(self.manager.prepare_load, keys, ctx)

    async def prepare_store(self, keys: list[bytes], ctx: ReqContext) -> Any:
        return await asyncio.to_thread(self.manager.prepare_store, keys, ctx)

    async def wait_idle(self, timeout: float) -> bool:
        return await asyncio.to_thread(self.manager.wait_idle, timeout)

    def complete_load(self, keys: list[bytes], ctx: ReqContext) -> None:
        self.manager.complete_load(keys, ctx)

    def complete_store(self, keys: list[bytes], ctx: ReqContext) -> None:
        self.manager.complete_store(keys, ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.manager.on_request_finished(ctx)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_phase(mode: str, requests: int, concurrency: int, slow: bool, tag: int) -> dict[str, Any]:
    tier = BenchTier(slow)
    manager = TieringManager.start(num_blocks=max(4 * requests + 64, 1024), block_bytes=64, secondary_tiers=[tier])
    api: Any = ToThread(manager) if mode == "to_thread" else AsyncTieringManager(manager, claims=mode == "async")
    warm = ReqContext("warm")
    manager.on_new_request(warm)
    out = manager.prepare_store(SHARED, warm)
    manager.complete_store(out.keys_to_store, warm)
    manager.on_request_finished(warm)
    manager.wait_idle(30)
    lags: list[float] = []
    peak_threads = [threading.active_count()]

    async def lifecycle(n: int, slots: asyncio.Semaphore) -> None:
        async with slots:
            ctx = ReqContext(f"r{tag}-{n}")
            fresh = [f"new-{tag}-{n}-{j}".encode() for j in range(4)]
            await api.on_new_request(ctx)
            results = await api.lookup(SHARED + fresh, ctx)
            hits = [k for k, r in zip(SHARED, results, strict=False) if r is LookupResult.HIT]
            if hits:
                await api.prepare_load(hits, ctx)
                api.complete_load(hits, ctx)
            out = await api.prepare_store(fresh, ctx)
            if out is not None and out.keys_to_store:
                api.complete_store(out.keys_to_store, ctx)
            api.on_request_finished(ctx)

    async def main() -> float:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def ticker() -> None:
            while not done.is_set():
                t0 = loop.time()
                await asyncio.sleep(0.001)
                lags.append(loop.time() - t0 - 0.001)
                peak_threads[0] = max(peak_threads[0], threading.active_count())

        tick = asyncio.create_task(ticker())
        slots = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        await asyncio.gather(*(lifecycle(n, slots) for n in range(requests)))
        elapsed = time.perf_counter() - t0
        done.set()
        await tick
        assert await api.wait_idle(60)
        return elapsed

    gc.collect()
    elapsed = asyncio.run(main())
    stats = manager.stats()
    manager.stop()
    assert stats["contract_violations"] == 0 and stats["active_requests"] == 0, stats
    return {"mode": mode, "rps": requests / elapsed, "lag_p50_ms": _pct(lags, 0.5) * 1e3,
            "lag_p99_ms": _pct(lags, 0.99) * 1e3, "lag_max_ms": max(lags) * 1e3, "ticks": len(lags),
            "peak_threads": peak_threads[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of 1000 requests")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--requests", type=int, default=None, help="lifecycles per phase (default 2000)")
    parser.add_argument("--concurrency", type=int, default=1000, help="lifecycles in flight at once (default 1000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    parser.add_argument("--tier", choices=("slow", "instant"), default="slow")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (default 5 ms)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    requests = args.requests or (1000 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    modes = args.modes.split(",")
    raw: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    tag = 0
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            tag += 1
            raw[mode].append(run_phase(mode, requests, args.concurrency, args.tier == "slow", tag))
    rows = []
    for phases in raw.values():
        row = dict(phases[0])
        for key, value in phases[0].items():
            if isinstance(value, float):
                row[key] = statistics.median(p[key] for p in phases)
        row["peak_threads"] = max(p["peak_threads"] for p in phases)
        rows.append(row)
    print(f"# {requests} lifecycles per phase, {args.concurrency} in flight, {args.tier} tier, {rounds} round(s) "
          f"(medians), {os.cpu_count()} CPUs, switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print(f"{'mode':13} {'req/s':>8} {'lag p50 ms':>10} {'p99 ms':>8} {'max ms':>8} {'ticks':>6} {'threads':>7}")
    for row in rows:
        print(f"{row['mode']:13} {row['rps']:>8.0f} {row['lag_p50_ms']:>10.3f} {row['lag_p99_ms']:>8.3f} "
              f"{row['lag_max_ms']:>8.2f} {row['ticks']:>6} {row['peak_threads']:>7}")
    if args.json:
        print(json.dumps({"requests": requests, "concurrency": args.concurrency, "tier": args.tier,
                          "rounds": rounds, "rows": rows}))


if __name__ == "__main__":
    main()
