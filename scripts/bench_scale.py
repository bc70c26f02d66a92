"""Scale: a million resident blocks, ten thousand active requests.

    PYTHONPATH=. python scripts/bench_scale.py [--blocks 1000000] [--requests 10000] [--json]

1. Memory per block: ``tracemalloc`` around filling a ``BlockPool`` (LRU) of
   ``--blocks`` rows with ready blocks of 32-byte keys (``prepare_store`` then
   ``complete_store``, 1,000 keys per call). Reported with the key objects
   (allocated inside the measured window, 65 bytes each: a 32-byte ``bytes``)
   and without them (the pool's own structures).
2. ``lookup`` and ``prepare_store`` time per key at that size against a pool of
   1,000 blocks (1,000 distinct keys probed, spread over the pool, at both
   sizes; every lookup hit), through the pool directly (no actors) and through a
   ``TieringManager`` (one actor round trip per call of 16 keys). Pools full:
   every ``prepare_store`` evicts (each store is completed before the next
   one, so ready blocks are always there to evict).
3. 10,000 concurrent active requests in a ``TieringManager`` with two
   ``MemoryTier`` tiers: the thread count before, during and after, and the
   memory per request state (``tracemalloc`` delta over the on_new_request calls,
   request contexts included).
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
import tracemalloc
from typing import Any

from kvactors import MemoryTier, ReqContext, TieringManager
from kvactors.core.policies import make_policy
from kvactors.core.pool import BlockPool

BATCH = 1000
PROBES = 1000  # the same number of distinct keys probed at every pool size


def key(i: int, tag: bytes = b"k") -> bytes:
    return tag + i.to_bytes(8, "little") + bytes(23)  # 32 bytes


def fill(pool: BlockPool, n: int, tag: bytes = b"k") -> None:
    writer = ("fill", 0)
    for start in range(0, n, BATCH):
        keys = [key(i, tag) for i in range(start, min(start + BATCH, n))]
        plan = pool.prepare_store(keys, writer)
        assert plan is not None and len(plan.keys) == len(keys)
        pool.complete_store(keys, writer, True)


def memory_per_block(n: int) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = BlockPool(n, make_policy("lru", n))
    fill(pool, n)
    pool.take_events()  # the events list is not per-block state
    gc.collect()
    total = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    key_bytes = n * (len(key(0)) + 33)  # sys.getsizeof(bytes of 32) == 65
    assert pool.stats()["blocks_ready"] == n
    del pool
    return {"bytes_per_block_with_keys": total / n, "bytes_per_block_without_keys": (total - key_bytes) / n}


def per_key_times(n: int, rounds: int) -> dict[str, float]:
    pool = BlockPool(n, make_policy("lru", n))
    fill(pool, n)
    keys = [key(i) for i in range(0, n, max(1, n // PROBES))][:PROBES]
    t0 = time.perf_counter()
    done = 0
    for _ in range(rounds):
        for s in range(0, len(keys), 16):
            done += len(pool.lookup(keys[s:s + 16]))
    lookup = (time.perf_counter() - t0) / done
    writer = ("w", 0)
    fresh = [key(i, b"n") for i in range(rounds * 1024)]
    t0 = time.perf_counter()
    for s in range(0, len(fresh), 16):
        batch = fresh[s:s + 16]
        pool.prepare_store(batch, writer)
        pool.complete_store(batch, writer, True)
    store = (time.perf_counter() - t0) / len(fresh)
    return {"lookup_us_per_key": lookup * 1e6, "prepare_complete_store_us_per_key": store * 1e6}


def manager_times(n: int, calls: int) -> dict[str, float]:
    with TieringManager.start(num_blocks=n, block_bytes=1) as mgr:
        ctx = ReqContext("fill")
        mgr.on_new_request(ctx)
        for start in range(0, n, BATCH):
            keys = [key(i) for i in range(start, min(start + BATCH, n))]
            mgr.prepare_store(keys, ctx)
            mgr.complete_store(keys, ctx)
        mgr.take_events()
        probe = [key(i) for i in range(0, n, max(1, n // PROBES))][:PROBES]
        t0 = time.perf_counter()
        for c in range(calls):
            s = (c * 16) % len(probe)
            mgr.lookup(probe[s:s + 16], ctx)
        lookup = (time.perf_counter() - t0) / (calls * 16)
        # Each store is completed (outside the timed call, and processed before the
        # next one: a blocking stats() call follows it), so every timed
        # prepare_store finds a full pool of ready blocks and evicts 16 of them.
        # Without that, a 1,000-block pool runs out of evictable rows after 62
        # calls and the rest are cheap "no room" answers.
        store = 0.0
        for c in range(calls):
            keys = [key(c * 16 + j, b"m") for j in range(16)]
            t0 = time.perf_counter()
            out = mgr.prepare_store(keys, ctx)
            store += time.perf_counter() - t0
            assert out is not None and len(out.keys_to_store) == 16
            mgr.complete_store(out.keys_to_store, ctx)
            mgr.stats()
        store /= calls * 16
        mgr.take_events()
    return {"mgr_lookup_us_per_key": lookup * 1e6, "mgr_prepare_store_us_per_key": store * 1e6}


def active_requests(n: int) -> dict[str, float]:
    tiers = [MemoryTier(name="m1", capacity_blocks=1024), MemoryTier(name="m2", capacity_blocks=1024)]
    threads_before = threading.active_count()
    with TieringManager.start(num_blocks=1024, block_bytes=64, secondary_tiers=tiers) as mgr:
        threads_started = threading.active_count()
        mgr.wait_idle(10)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        ctxs = [ReqContext(f"req-{i:06d}") for i in range(n)]
        for ctx in ctxs:
            mgr.on_new_request(ctx)
        mgr.wait_idle(60)
        gc.collect()
        per_request = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
        threads_active = threading.active_count()
        active = mgr.stats()["active_requests"]
        for ctx in ctxs:
            mgr.on_request_finished(ctx)
        mgr.wait_idle(60)
        left = mgr.stats()["active_requests"]
    return {"threads_before": threads_before, "threads_started": threads_started,
            "threads_with_active_requests": threads_active, "active_requests": active,
            "active_after_finish": left, "bytes_per_request_state": per_request}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {"blocks": args.blocks}
    out.update(memory_per_block(args.blocks))
    print(f"memory per block ({args.blocks:,} ready, LRU): {out['bytes_per_block_with_keys']:.0f} B with the keys, "
          f"{out['bytes_per_block_without_keys']:.0f} B without (target <= 200)")
    small = [per_key_times(args.small, args.rounds) for _ in range(3)]
    big = [per_key_times(args.blocks, args.rounds) for _ in range(1)]
    for name in ("lookup_us_per_key", "prepare_complete_store_us_per_key"):
        s, b = min(r[name] for r in small), min(r[name] for r in big)
        out[f"{name}_small"], out[f"{name}_big"], out[f"{name}_ratio"] = s, b, b / s
        print(f"pool {name}: {s:.3f} µs at {args.small:,} blocks, {b:.3f} µs at {args.blocks:,}: x{b / s:.2f}")
    ms, mb = manager_times(args.small, 2000), manager_times(args.blocks, 2000)
    for name in ("mgr_lookup_us_per_key", "mgr_prepare_store_us_per_key"):
        out[f"{name}_small"], out[f"{name}_big"], out[f"{name}_ratio"] = ms[name], mb[name], mb[name] / ms[name]
        print(f"manager {name}: {ms[name]:.2f} µs at {args.small:,} blocks, {mb[name]:.2f} µs at {args.blocks:,}: "
              f"x{mb[name] / ms[name]:.2f}")
    out.update(active_requests(args.requests))
    print(f"{args.requests:,} active requests: threads {out['threads_before']} before start, "
          f"{out['threads_started']} started, {out['threads_with_active_requests']} with them active; "
          f"{out['bytes_per_request_state']:.0f} B per request state (all actors, ctx included); "
          f"active {out['active_requests']} -> {out['active_after_finish']} after finish")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
