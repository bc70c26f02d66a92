"""Quick DiskTier throughput check against plain files of the same block size.

    PYTHONPATH=. python scripts/bench_disk_quick.py [--block-kib 256] [--blocks 256] [--dir DIR] [--keep-files]

Baseline: one file per block, written with open/write/close and read back into
a preallocated buffer, on one thread, no checksum. DiskTier: the same bytes as
one job (split over its workers) and as one job per block. Neither syncs, so
this measures the CPU cost of each path (checksum, syscalls, copies, page
cache, threads) more than the device. Reported: the
best GB/s of payload bytes over the repeats and its tier/plain ratio, and the
CPU seconds per GB with their ratio (plain/tier), which other load on a shared
machine skews less than wall time. The tier's pool is page-aligned, as vLLM's
(mapped from a file) is, so the tier writes and reads it with ``O_DIRECT``:
its files skip the page cache, and its loads come from the device. Run it with
``PYTHONPATH=.`` so that it imports this tree.
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import shutil
import tempfile
import time

import torch

from kvactors.tiers.disk import DiskTier
from kvactors.types import JobResult, ReqContext, TransferJob

Timing = tuple[float, float, float, float]
"""store wall s, load wall s, store CPU s, load CPU s (CPU: all threads of the process)."""


def timed(fn, *args) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    c0, t0 = time.process_time(), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def plain(root: str, pool: torch.Tensor, keep: bool) -> Timing:
    n, block = pool.shape
    os.makedirs(root, exist_ok=True)

    def write() -> None:
        for i in range(n):
            fd = os.open(os.path.join(root, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, pool[i].numpy().data)
            os.close(fd)

    buf = bytearray(block)

    def read() -> None:
        for i in range(n):
            with open(os.path.join(root, f"{i}.bin"), "rb", buffering=0) as f:
                f.readinto(buf)
            pool[i].copy_(torch.frombuffer(buf, dtype=torch.uint8))

    (w, cw), (r, cr) = timed(write), timed(read)
    if not keep:
        shutil.rmtree(root)
    return w, r, cw, cr


def tier_run(root: str, pool: torch.Tensor, per_job: int, workers: int, keep: bool) -> Timing:
    n, block = pool.shape
    half = n // 2
    tier = DiskTier(root, capacity_bytes=4 * n * block, io_workers=workers)
    results: queue.Queue[JobResult] = queue.Queue()
    tier.attach(pool, results.put)
    keys = [b"key-%08d" % i for i in range(half)]
    ctx = ReqContext("bench")

    def run(promotion: bool, rows_base: int) -> None:
        jobs = []
        for j in range(0, half, per_job):
            rows = tuple(range(rows_base + j, rows_base + min(j + per_job, half)))
            jobs.append(TransferJob(j, tuple(keys[j : j + per_job]), rows, ctx, promotion))
        for job in jobs:
            (tier.submit_load if promotion else tier.submit_store)(job)
        for _ in jobs:
            assert results.get(timeout=60).success

    (w, cw), (r, cr) = timed(run, False, 0), timed(run, True, half)
    assert torch.equal(pool[:half], pool[half:])
    tier.shutdown()
    if not keep:
        shutil.rmtree(root)
    return w, r, cw, cr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep-files", action="store_true",
                    help="keep every run's files to the end: each run then writes into fresh page-cache pages, "
                         "as a filling tier does, not into those the previous run's deletion freed")
    args = ap.parse_args()
    block = args.block_kib * 1024
    nbytes = args.blocks * block
    base = tempfile.mkdtemp(prefix="kvbench-", dir=args.dir)
    try:
        pool_plain = torch.randint(0, 256, (args.blocks, block), dtype=torch.uint8)
        # Page-aligned, as a pool mapped from a file (vLLM's) is: the tier writes and reads it with O_DIRECT.
        pool_map = mmap.mmap(-1, 2 * args.blocks * block)
        pool_tier = torch.frombuffer(pool_map, dtype=torch.uint8).view(2 * args.blocks, block)
        pool_tier[: args.blocks] = pool_plain
        rows: dict[str, list[Timing]] = {"plain": [], "tier 1 job": [], "tier 1 job/block": []}
        for r in range(args.repeats):
            keep = args.keep_files
            rows["plain"].append(plain(os.path.join(base, f"p{r}"), pool_plain, keep))
            one_job = tier_run(os.path.join(base, f"a{r}"), pool_tier, args.blocks, args.workers, keep)
            rows["tier 1 job"].append(one_job)
            rows["tier 1 job/block"].append(tier_run(os.path.join(base, f"b{r}"), pool_tier, 1, args.workers, keep))
        gb = nbytes / 1e9
        best = {name: [min(t[k] for t in v) for k in range(4)] for name, v in rows.items()}
        print(f"{args.blocks} blocks x {args.block_kib} KiB, {args.workers} workers, {os.cpu_count()} CPUs, "
              f"best of {args.repeats}; ratio = tier/plain (GB/s), CPU ratio = plain/tier (CPU s per GB)")
        pw, pr, pcw, pcr = best["plain"]
        for name, (w, r, cw, cr) in best.items():
            print(f"  {name:17s} store {gb / w:5.2f} GB/s x{pw / w:4.2f} (CPU {cw / gb:5.2f} s/GB x{pcw / cw:4.2f})   "
                  f"load {gb / r:5.2f} GB/s x{pr / r:4.2f} (CPU {cr / gb:5.2f} s/GB x{pcr / cr:4.2f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
