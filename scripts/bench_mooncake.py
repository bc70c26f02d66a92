#!/usr/bin/env python
"""MooncakeTier throughput against Mooncake's own zero-copy batch calls, same store, same sizes.

Starts a ``mooncake_master`` and one holder process (the data lives in the holder's segment,
as on a fleet where another client holds it; this process contributes none), then measures,
in one run, phases interleaved, best of ``--repeat``:

* ``store``/``load``: ``MooncakeTier.submit_store``/``submit_load`` of ``--blocks`` blocks of
  ``--block-bytes``, jobs of ``--job-blocks``, ``--inflight`` outstanding, from the first
  submit to the last report (records carry the codec's header and XXH3 checksum; loads are
  staged, verified and copied into the pool);
* ``raw_put``/``raw_get``: ``batch_put_from``/``batch_get_into`` of the bare payloads from and
  into a registered buffer, batches of ``--job-blocks``, on 1 thread and on ``--io-workers``
  threads (the better is the baseline).

``store_ratio = store_gbps / raw_put_gbps``, ``load_ratio = load_gbps / raw_get_gbps``. When a
``redis-server`` is installed, ``RedisTier``'s store and load on the same blocks are measured
beside it (``redis_store_gbps``, ``redis_load_gbps``). ``--json`` prints one JSON object as
the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvactors.tiers.base import SecondaryTier
from kvactors.types import JobResult, ReqContext, TransferJob
from tests.mooncake_store import Holder, MooncakeMaster

GB = 1e9


def run_jobs(tier: SecondaryTier, results: queue.Queue[JobResult], jobs: list[TransferJob], inflight: int,
             promotion: bool) -> float:
    """Submit ``jobs`` keeping ``inflight`` outstanding; seconds from the first submit to the last report."""
    submit = tier.submit_load if promotion else tier.submit_store
    pending = iter(jobs)
    outstanding = failed = 0
    first_error = None
    start = time.perf_counter()
    for job in pending:
        submit(job)
        outstanding += 1
        if outstanding >= inflight:
            break
    while outstanding:
        res = results.get(timeout=60)
        outstanding -= 1
        failed += not res.success
        first_error = first_error or res.error
        job = next(pending, None)
        if job is not None:
            submit(job)
            outstanding += 1
    elapsed = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{failed} jobs failed, the first: {first_error}")
    return elapsed


def raw_phase(store: Any, names: list[str], buf: np.ndarray, batch: int, threads: int, op: str) -> float:
    n, bb = buf.shape
    base = buf.ctypes.data
    batches = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]

    def one(idx: list[int]) -> None:
        keys = [names[i] for i in idx]
        ptrs = [base + i * bb for i in idx]
        if op == "put":
            codes = store.batch_put_from(keys, ptrs, [bb] * len(idx))
            bad = [c for c in codes if c != 0]
        else:
            codes = store.batch_get_into(keys, ptrs, [bb] * len(idx))
            bad = [c for c in codes if c != bb]
        if bad:
            raise RuntimeError(f"raw {op} failed: codes {sorted(set(bad))}")

    start = time.perf_counter()
    if threads == 1:
        for b in batches:
            one(b)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, batches))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-bytes", type=int, default=256 * 1024)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--job-blocks", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--io-workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (well under 30 s)")
    ap.add_argument("--json", action="store_true", help="last line of stdout: one JSON object")
    ap.add_argument("--no-redis", action="store_true", help="skip RedisTier beside it")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks = min(args.blocks, 256)
        args.repeat = min(args.repeat, 3)
    n, bb = args.blocks, args.block_bytes
    # The holder keeps the tier's records and the raw objects, with room to spare (no eviction).
    segment = max(64 << 20, 3 * n * (bb + 4096))
    with MooncakeMaster(lease_ttl_ms=10000) as master, Holder(master.address, segment_bytes=segment):
        out = _bench(args, master.address)
    if not args.no_redis:
        out.update(_redis_beside(args))
    _print(args, out)
    return 0


def _jobs(keys: list[bytes], n: int, jb: int, promotion: bool, ids: Any) -> list[TransferJob]:
    ctx = ReqContext("bench")
    return [TransferJob(next(ids), tuple(keys[i:i + jb]), tuple(range(i, min(i + jb, n))), ctx, promotion)
            for i in range(0, n, jb)]


def _bench(args: argparse.Namespace, master: str) -> dict[str, Any]:
    from kvactors.tiers.mooncake import MooncakeTier

    n, bb, jb = args.blocks, args.block_bytes, args.job_blocks
    pool = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    reference = pool.clone()
    results: queue.Queue[JobResult] = queue.Queue()
    tier = MooncakeTier(master, name="bench", namespace="kvactors-bench", io_workers=args.io_workers,
                        timeout_s=10.0)
    tier.attach(pool, results.put)
    keys = [f"blk-{i}".encode() for i in range(n)]
    ids = iter(range(1, 1 << 62))
    conn = tier._connection(wait=10.0)
    if conn is None:
        raise RuntimeError("MooncakeTier did not connect")
    raw = reference.numpy().copy()
    if conn.store.register_buffer(raw.ctypes.data, raw.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    raw_names = [f"kvactors-bench-raw:{i}" for i in range(n)]
    threads = sorted({1, args.io_workers})
    store_s = load_s = float("inf")
    put_s = dict.fromkeys(threads, float("inf"))
    get_s = dict.fromkeys(threads, float("inf"))
    try:
        # Warm-up, two rounds of each: the holder's segment pages are touched (faulted in) by
        # the first writes to them, the staging buffers are registered.
        for _ in range(2):
            conn.store.remove_all(True)
            run_jobs(tier, results, _jobs(keys, n, jb, False, ids), args.inflight, False)
            raw_phase(conn.store, raw_names, raw, jb, 1, "put")
            run_jobs(tier, results, _jobs(keys, n, jb, True, ids), args.inflight, True)
        for _ in range(args.repeat):
            # A put of a key already held keeps the old value without copying: remove first,
            # so that every round moves the bytes, for the tier and the baseline alike.
            conn.store.remove_all(True)
            store_s = min(store_s, run_jobs(tier, results, _jobs(keys, n, jb, False, ids), args.inflight, False))
            for t in threads:
                conn.store.batch_remove(raw_names, True)
                put_s[t] = min(put_s[t], raw_phase(conn.store, raw_names, raw, jb, t, "put"))
            pool.zero_()
            load_s = min(load_s, run_jobs(tier, results, _jobs(keys, n, jb, True, ids), args.inflight, True))
            if not torch.equal(pool, reference):
                raise RuntimeError("loaded blocks differ from the stored ones")
            for t in threads:
                get_s[t] = min(get_s[t], raw_phase(conn.store, raw_names, raw, jb, t, "get"))
    finally:
        tier.drain(10.0)
        tier.shutdown()
    total = n * bb
    out: dict[str, Any] = {
        "block_bytes": bb, "blocks": n, "job_blocks": jb, "inflight": args.inflight, "io_workers": args.io_workers,
        "store_gbps": total / store_s / GB, "load_gbps": total / load_s / GB,
        "raw_put_gbps": max(total / s / GB for s in put_s.values()),
        "raw_get_gbps": max(total / s / GB for s in get_s.values()),
    }
    for t in threads:
        out[f"raw_put_gbps_t{t}"] = total / put_s[t] / GB
        out[f"raw_get_gbps_t{t}"] = total / get_s[t] / GB
    out["store_ratio"] = out["store_gbps"] / out["raw_put_gbps"]
    out["load_ratio"] = out["load_gbps"] / out["raw_get_gbps"]
    return out


def _redis_beside(args: argparse.Namespace) -> dict[str, Any]:
    from kvactors.tiers.redis import RedisTier
    from tests.redis_server import RedisServer, find_redis_server

    if find_redis_server() is None:
        return {}
    n, bb, jb = args.blocks, args.block_bytes, args.job_blocks
    pool = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    results: queue.Queue[JobResult] = queue.Queue()
    keys = [f"blk-{i}".encode() for i in range(n)]
    ids = iter(range(1, 1 << 62))
    with RedisServer(maxmemory=str(max(4 * n * (bb + 1024), 256 << 20))) as server:
        tier = RedisTier(server.url, name="bench-redis", io_workers=args.io_workers)
        tier.attach(pool, results.put)
        try:
            run_jobs(tier, results, _jobs(keys, n, jb, False, ids), args.inflight, False)
            store_s = load_s = float("inf")
            for _ in range(args.repeat):
                store_s = min(store_s, run_jobs(tier, results, _jobs(keys, n, jb, False, ids), args.inflight, False))
                load_s = min(load_s, run_jobs(tier, results, _jobs(keys, n, jb, True, ids), args.inflight, True))
        finally:
            tier.shutdown()
    return {"redis_store_gbps": n * bb / store_s / GB, "redis_load_gbps": n * bb / load_s / GB}


def _print(args: argparse.Namespace, out: dict[str, Any]) -> None:
    n, bb = out["blocks"], out["block_bytes"]
    print(f"MooncakeTier vs raw batch_put_from/batch_get_into: {n} blocks x {bb // 1024} KiB = "
          f"{n * bb / 2**20:.0f} MiB, jobs/batches of {out['job_blocks']}, best of {args.repeat}")
    print(f"{'path':<40}{'GB/s':>8}")
    print(f"{'MooncakeTier store':<40}{out['store_gbps']:>8.2f}")
    print(f"{'MooncakeTier load (verified)':<40}{out['load_gbps']:>8.2f}")
    for key, label in (("put", "batch_put_from"), ("get", "batch_get_into")):
        for t in sorted({1, args.io_workers}):
            print(f"{f'raw {label}, {t} thread(s)':<40}{out[f'raw_{key}_gbps_t{t}']:>8.2f}")
    if "redis_store_gbps" in out:
        print(f"{'RedisTier store (beside)':<40}{out['redis_store_gbps']:>8.2f}")
        print(f"{'RedisTier load (beside)':<40}{out['redis_load_gbps']:>8.2f}")
    print(f"store_ratio {out['store_ratio']:.2f}  load_ratio {out['load_ratio']:.2f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
