#!/usr/bin/env python
"""CUDA check of TransferEngine: byte-exact round trips under concurrency, and bandwidth.

1. Round trip, many concurrent requests (``--threads`` threads, each its own
   request): device rows -> pool (``offload``) -> secondary tier (a DiskTier in
   a temp dir if ``kvactors.tiers.disk`` is importable, else a MemoryTier) ->
   ``reset_cache`` (pool cleared) -> ``lookup`` starts promotions
   (``HIT_PENDING``) -> ``wait_idle`` -> ``HIT`` -> ``onboard`` into zeroed
   device rows -> compared with the original bytes on the device.
2. Bandwidth: TransferEngine offload of many 16-block requests (several in
   flight) vs one plain ``copy_(..., non_blocking=True)`` of the same bytes
   from the device into pinned memory (the pool), synchronized once; and the
   same for onboard vs one host->device copy.

Without CUDA it prints "skipped: no CUDA" and exits 0 (``--device cpu`` runs
the same checks with a CPU device cache, to test the script itself). Meant to
finish well under 3 minutes; prints a summary and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from kvactors import LookupResult, MemoryTier, ReqContext, SecondaryTier, TieringManager, TransferEngine

GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_tier(root: str, capacity_bytes: int, capacity_blocks: int) -> tuple[SecondaryTier, str]:
    try:
        from kvactors.tiers.disk import DiskTier  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return MemoryTier(capacity_blocks=capacity_blocks), "memory"
    return DiskTier(root, capacity_bytes=capacity_bytes), "disk"


def round_trip(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    block_bytes = args.block_kib * 1024
    per_thread_rows = args.requests_per_thread * args.blocks_per_request
    rows_total = args.threads * per_thread_rows
    cache = torch.randint(0, 256, (rows_total, block_bytes), dtype=torch.uint8, device=device)
    original = cache.clone()
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvactors-gpu-check-") as root:
        tier, tier_kind = make_tier(root, capacity_bytes=2 * rows_total * block_bytes + (64 << 20),
                                    capacity_blocks=2 * rows_total)
        with TieringManager.start(num_blocks=rows_total + 64, block_bytes=block_bytes,
                                  secondary_tiers=[tier]) as manager, \
                TransferEngine(manager, cache) as engine:
            pinned = manager.pool.is_pinned()
            ctxs = [ReqContext(f"gpu-check-{t}") for t in range(args.threads)]
            for ctx in ctxs:
                manager.on_new_request(ctx)

            def keys_of(t: int, r: int) -> list[bytes]:
                return [f"t{t}.r{r}.b{b}".encode() for b in range(args.blocks_per_request)]

            def rows_of(t: int, r: int) -> list[int]:
                base = t * per_thread_rows + r * args.blocks_per_request
                rows = list(range(base, base + args.blocks_per_request))
                return rows[::-1] if (t + r) % 3 == 0 else rows  # some requests do not coalesce

            def run(t: int, onboard: bool) -> None:
                try:
                    futures: list[Future[Any]] = []
                    for r in range(args.requests_per_thread):
                        call = engine.onboard if onboard else engine.offload
                        futures.append(call(ctxs[t], keys_of(t, r), rows_of(t, r)))
                    for r, future in enumerate(futures):
                        got = future.result(60)
                        if not onboard and got != keys_of(t, r):
                            errors.append(f"thread {t} request {r}: stored {len(got)} keys")
                except Exception as exc:
                    errors.append(f"thread {t} ({'onboard' if onboard else 'offload'}): {exc!r}")

            def in_threads(onboard: bool) -> float:
                start = time.perf_counter()
                threads = [threading.Thread(target=run, args=(t, onboard)) for t in range(args.threads)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(120)
                return time.perf_counter() - start

            t_offload = in_threads(False)
            idle = manager.wait_idle(120)  # the cascades reached the tier
            manager.reset_cache()
            all_keys = [k for t in range(args.threads) for r in range(args.requests_per_thread) for k in keys_of(t, r)]
            first = manager.lookup(all_keys, ctxs[0])
            promoted = sum(result is LookupResult.HIT_PENDING for result in first)
            idle = manager.wait_idle(120) and idle
            second = manager.lookup(all_keys, ctxs[0])
            hits = sum(result is LookupResult.HIT for result in second)
            cache.zero_()
            sync(device)
            t_onboard = in_threads(True)
            exact = bool(torch.equal(cache, original))
            for ctx in ctxs:
                manager.on_request_finished(ctx)
            idle = manager.wait_idle(60) and idle
            stats = manager.stats()
    ok = (not errors and exact and idle and promoted == len(all_keys) and hits == len(all_keys)
          and stats["blocks_pending"] == 0 and stats["blocks_pinned"] == 0 and stats["contract_violations"] == 0)
    return {"ok": ok, "tier": tier_kind, "pool_pinned": pinned, "byte_exact": exact, "blocks": len(all_keys),
            "promoted_hit_pending": promoted, "hit_after_promotion": hits, "idle": idle, "errors": errors[:5],
            "blocks_pending": stats["blocks_pending"], "blocks_pinned": stats["blocks_pinned"],
            "contract_violations": stats["contract_violations"],
            "concurrent_offload_s": t_offload, "concurrent_onboard_s": t_onboard}


def bandwidth(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    block_bytes = args.block_kib * 1024
    per = args.blocks_per_request
    requests = args.bw_requests
    rows = requests * per
    nbytes = rows * block_bytes
    cache = torch.randint(0, 256, (rows, block_bytes), dtype=torch.uint8, device=device)
    off_t, on_t, plain_off_t, plain_on_t = [], [], [], []
    with TieringManager.start(num_blocks=rows, block_bytes=block_bytes) as manager, \
            TransferEngine(manager, cache) as engine:
        pool = manager.pool
        for trial in range(-1, args.trials):  # trial -1 warms up
            # Plain: one non_blocking copy of the same bytes into pinned memory, one synchronize.
            sync(device)
            start = time.perf_counter()
            pool.copy_(cache, non_blocking=True)
            sync(device)
            plain_off = time.perf_counter() - start
            start = time.perf_counter()
            cache.copy_(pool, non_blocking=True)
            sync(device)
            plain_on = time.perf_counter() - start

            ctx = ReqContext(f"bw-{trial}")
            manager.on_new_request(ctx)
            keys = [[f"{trial}.{i}.{j}".encode() for j in range(per)] for i in range(requests)]
            inflight: deque[Future[Any]] = deque()
            sync(device)
            start = time.perf_counter()
            for i in range(requests):
                if len(inflight) >= args.window:
                    inflight.popleft().result(60)
                inflight.append(engine.offload(ctx, keys[i], range(i * per, (i + 1) * per)))
            while inflight:
                inflight.popleft().result(60)
            t_off = time.perf_counter() - start
            start = time.perf_counter()
            for i in range(requests):
                if len(inflight) >= args.window:
                    inflight.popleft().result(60)
                inflight.append(engine.onboard(ctx, keys[i], range(i * per, (i + 1) * per)))
            while inflight:
                inflight.popleft().result(60)
            t_on = time.perf_counter() - start
            manager.on_request_finished(ctx)
            manager.reset_cache()
            if trial >= 0:
                off_t.append(t_off)
                on_t.append(t_on)
                plain_off_t.append(plain_off)
                plain_on_t.append(plain_on)
    offload = nbytes / statistics.median(off_t) / GB
    onboard = nbytes / statistics.median(on_t) / GB
    plain_off = nbytes / statistics.median(plain_off_t) / GB
    plain_on = nbytes / statistics.median(plain_on_t) / GB
    return {"bytes": nbytes, "offload_gbps": offload, "plain_d2h_gbps": plain_off, "offload_ratio": offload / plain_off,
            "onboard_gbps": onboard, "plain_h2d_gbps": plain_on, "onboard_ratio": onboard / plain_on}


def vllm_worker_check(device: torch.device) -> dict[str, Any]:
    """The vLLM worker's copy path (the transfer layer's CUDA copier into the shared pool, registered with
    CUDA until the worker's shutdown): store then load, byte-exact."""
    try:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
        )
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        from kvactors.integrations.vllm.shm import SharedPool, pool_path
        from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker
    except Exception as exc:
        return {"skipped": True, "reason": f"vLLM not importable: {exc!r}"}
    page, blocks, layers = 4096, 64, 2
    tensors = [torch.randint(-128, 127, (blocks, page), dtype=torch.int8, device=device) for _ in range(layers)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                           [[CanonicalKVCacheRef(i, page) for i in range(layers)]])
    shared = SharedPool(pool_path(f"gpucheck-{os.getpid()}"), num_blocks=32, block_bytes=page * layers)
    worker = KvactorsOffloadingWorker(kv, shared, rank=0, per_worker_bytes=page * layers, blocks_per_chunk=1,
                                      transfer_timeout_s=30.0, owns_shared=True)
    try:
        dev_ids, rows = list(range(8, 24)), list(range(4, 20))
        worker.submit_store(1, GPULoadStoreSpec(dev_ids, [len(dev_ids)], [0]), CPULoadStoreSpec(rows))
        worker.wait({1})
        stored = all(torch.equal(shared.pool[r, li * page:(li + 1) * page].view(torch.int8), tensors[li][d].cpu())
                     for d, r in zip(dev_ids, rows, strict=True) for li in range(layers))
        before = [t[dev_ids].clone() for t in tensors]
        for t in tensors:
            t[dev_ids] = 0
        worker.submit_load(2, CPULoadStoreSpec(rows), GPULoadStoreSpec(dev_ids, [len(dev_ids)], [0]))
        worker.wait({2})
        loaded = all(torch.equal(t[dev_ids], b) for t, b in zip(tensors, before, strict=True))
        results = {r.job_id: r.success for r in worker.get_finished()}
        ok = stored and loaded and results == {1: True, 2: True} and shared.stored_ok(rows[0])
        # The shared pool is registered with CUDA while the worker lives, unregistered at its shutdown.
        registration = worker._registration
        pinned = None if registration is None else registration.registered
    finally:
        worker.shutdown()
    unpinned = None if registration is None else not registration.registered
    ok = ok and pinned is not False and unpinned is not False
    return {"skipped": False, "ok": ok, "stored_exact": stored, "loaded_exact": loaded, "copier": worker.copier,
            "pool_registered": pinned, "pool_unregistered_at_shutdown": unpinned}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (to test this script)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--requests-per-thread", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--bw-requests", type=int, default=128)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA")
        print(json.dumps({"skipped": True, "reason": "no CUDA"}))
        return 0
    device = torch.device(args.device)
    started = time.perf_counter()
    trip = round_trip(device, args)
    bw = bandwidth(device, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; secondary tier: {trip['tier']}; pool pinned: {trip['pool_pinned']}")
    print(f"round trip: {trip['blocks']} blocks from {args.threads} threads: byte-exact={trip['byte_exact']} "
          f"promoted={trip['promoted_hit_pending']} hit={trip['hit_after_promotion']} "
          f"pending={trip['blocks_pending']} pinned={trip['blocks_pinned']} "
          f"violations={trip['contract_violations']} errors={trip['errors']} -> {'OK' if trip['ok'] else 'FAIL'}")
    print(f"offload: engine {bw['offload_gbps']:.2f} GB/s vs plain non_blocking copy {bw['plain_d2h_gbps']:.2f} GB/s "
          f"(ratio {bw['offload_ratio']:.2f})")
    print(f"onboard: engine {bw['onboard_gbps']:.2f} GB/s vs plain non_blocking copy {bw['plain_h2d_gbps']:.2f} GB/s "
          f"(ratio {bw['onboard_ratio']:.2f})")
    vw = vllm_worker_check(device)
    print(f"vLLM worker copy path: {vw}")
    ok = trip["ok"] and (vw.get("skipped") or vw.get("ok"))
    elapsed = time.perf_counter() - started
    print(json.dumps({"skipped": False, "ok": bool(ok), "device": name, "round_trip": trip, "bandwidth": bw,
                      "vllm_worker": vw, "elapsed_s": elapsed}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
