#!/usr/bin/env python
"""Transfer bandwidth: TransferEngine vs one plain copy, DiskTier vs plain files.

Measured in one run, on the same bytes:

* offload (device cache -> pool) and onboard (pool -> device cache) GB/s
  through :class:`kvactors.TransferEngine` with a CPU device cache: many
  requests of ``--blocks-per-request`` blocks of ``--block-kib`` KiB, at most
  ``--window`` in flight, timed from the first submit until the last future
  resolved (so ``prepare_*``, the copies and ``complete_*`` are all counted);
* the baseline: one contiguous ``copy_`` of the same total size between the
  same two tensors (device cache and pool), in each direction;
* the bare pipeline (``bare_pipeline_*``, device -> pool): the torch copier's threads and
  batches with no control work at all (:class:`BarePipeline`), the ceiling of
  the torch copier's ``offload_ratio`` on the machine at hand;
* the engine's copier is ``--copier`` (default ``auto``: the native copier where it
  is built; ``config.copier`` says which ran). When it is not the torch copier, the
  torch copier's engine runs too, in the same trials (``torch_*_gbps``,
  ``torch_*_ratio``: the figures before the native copier);
* with the native copier built: one job of every row through a bare native copier
  (``native_copy_*``: the machine's plain parallel copy with streaming stores, its
  ratio to ``copy_``), and the engine's ratio to it (``*_vs_native_ratio``): how near
  the engine comes to the fastest plain copy here, not only to ``copy_``;
* if ``kvactors.tiers.disk.DiskTier`` is importable: its store/load GB/s,
  driven through the ``SecondaryTier`` interface with jobs of the same size,
  vs writing/reading the same bytes as plain files, one file per block. The
  ratios ``disk_write_ratio``/``disk_read_ratio`` are against the fastest
  plain way: raw descriptors, each file written from and read (``readv``,
  i.e. readinto) into its own place in one preallocated buffer of every
  block, as a load must. ``one_buffer_disk_*_ratio`` are against the same
  calls with one block-sized buffer that every block overwrites (it stays in
  the CPU cache: the page cache's copy alone, not a load), ``old_disk_*_ratio``
  against the first baseline (buffered file objects, reads into the pool
  rows), ``disk_read_rows_ratio`` against raw reads into the pool rows. If
  DiskTier is not importable, the disk figures and ratios are ``null``;
* with vLLM importable (a vLLM venv's python): the vLLM worker's copies in
  its per-layer layout (``--layers`` KV tensors), against one ``copy_`` per
  layer of every block (``vllm_*``; ``null`` without vLLM).

Every figure is the median of ``--trials`` trials; every engine trial is
checked byte-exact. ``--json`` makes the last line of stdout one JSON object.
``--quick`` finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from kvactors import ReqContext, TieringManager, TransferEngine
from kvactors.transfer.engine import COPIERS, native_threads
from kvactors.transfer.jobs import CopyJob
from kvactors.transfer.native import NativeCopier, native_copy_available
from kvactors.transfer.runs import copy_runs
from kvactors.types import JobResult, TransferJob

GB = 1e9


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def baseline_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def engine_trial(manager: TieringManager, engine: TransferEngine, device: torch.Tensor, reference: torch.Tensor,
                 trial: int, requests: int, per_request: int, window: int) -> tuple[float, float, float]:
    """One offload pass and one onboard pass over every request; returns (t_offload, t_onboard, blocks/run)."""
    ctx = ReqContext(f"bench-{trial}")
    manager.on_new_request(ctx)
    keys = [[f"t{trial}.r{i}.b{j}".encode() for j in range(per_request)] for i in range(requests)]
    rows = [list(range(i * per_request, (i + 1) * per_request)) for i in range(requests)]

    inflight: deque[Future[Any]] = deque()
    stored = 0
    start = time.perf_counter()
    for i in range(requests):
        if len(inflight) >= window:
            stored += len(inflight.popleft().result(60))
        inflight.append(engine.offload(ctx, keys[i], rows[i]))
    while inflight:
        stored += len(inflight.popleft().result(60))
    t_offload = time.perf_counter() - start
    if stored != requests * per_request:
        raise SystemExit(f"offload stored {stored} of {requests * per_request} blocks (pool too small?)")

    # How well did the rows coalesce? (pool rows as the manager handed them out)
    runs = 0
    for i in range(requests):
        spec = manager.prepare_load(keys[i], ctx)
        runs += len(copy_runs(rows[i], spec.block_ids))
        manager.complete_load(keys[i], ctx)

    used = requests * per_request
    device[:used].zero_()
    start = time.perf_counter()
    for i in range(requests):
        if len(inflight) >= window:
            inflight.popleft().result(60)
        inflight.append(engine.onboard(ctx, keys[i], rows[i]))
    while inflight:
        inflight.popleft().result(60)
    t_onboard = time.perf_counter() - start
    if not torch.equal(device[:used], reference[:used]):
        raise SystemExit(f"trial {trial}: the onboarded bytes differ from the offloaded ones")
    manager.on_request_finished(ctx)
    manager.reset_cache()
    return t_offload, t_onboard, requests * per_request / runs


class BarePipeline:
    """The engine's thread shape with no control work: the ceiling of a pipelined copy here.

    A caller thread submits requests (a future each, at most ``window`` in flight), one copy
    thread takes them in batches of up to 16 MiB and copies each batch's rows as one slice
    (torch's threads, as the engine), one completer thread resolves the futures. No manager,
    no checks, no keys: what this reaches is what the engine could reach if its control work
    cost nothing.
    """

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, per_request: int) -> None:
        self._dst, self._src, self._per = dst, src, per_request
        self._jobs: queue.SimpleQueue[tuple[int, Future[None]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Future[None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._copy, daemon=True),
                         threading.Thread(target=self._complete, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _copy(self) -> None:
        limit = max(1, (16 << 20) // (self._per * self._src.shape[1]))
        while (job := self._jobs.get()) is not None:
            batch = [job]
            while len(batch) < limit:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                batch.append(more)
            first, last = batch[0][0], batch[-1][0] + self._per
            if last - first == len(batch) * self._per:
                self._dst[first:last].copy_(self._src[first:last])
            else:
                for row, _ in batch:
                    self._dst[row : row + self._per].copy_(self._src[row : row + self._per])
            for _, future in batch:
                self._done.put(future)
        self._done.put(None)

    def _complete(self) -> None:
        while (future := self._done.get()) is not None:
            future.set_result(None)

    def trial(self, requests: int, window: int) -> float:
        inflight: deque[Future[None]] = deque()
        start = time.perf_counter()
        for i in range(requests):
            if len(inflight) >= window:
                inflight.popleft().result(60)
            future: Future[None] = Future()
            future.set_running_or_notify_cancel()
            self._jobs.put((i * self._per, future))
            inflight.append(future)
        while inflight:
            inflight.popleft().result(60)
        return time.perf_counter() - start

    def close(self) -> None:
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(60)


def native_copy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> float:
    """One job of every row through a bare :class:`NativeCopier` (no engine, no manager): the
    machine's plain parallel copy with streaming stores. Seconds from submit to report."""
    done = threading.Event()
    copier = NativeCopier(device_cache=src, pool=dst, threads=threads, done=lambda job, error: done.set())
    try:
        job = CopyJob(job_id=1, direction="offload", runs=((0, 0, int(src.shape[0])),), nbytes=src.numel(),
                      blocks=int(src.shape[0]), deadline=None, timeout_s=None)
        start = time.perf_counter()
        copier.submit(job)
        if not done.wait(60):
            raise SystemExit("the native baseline copy did not end in 60 s")
        return time.perf_counter() - start
    finally:
        copier.shutdown()


# ---------------------------------------------------------------- disk


def _settle_writeback() -> None:
    """Flush dirty pages before a timed phase (untimed): otherwise the kernel's writeback
    of one phase's files (throttling, flusher threads) is charged to the next phase."""
    if hasattr(os, "sync"):
        os.sync()


def _raw_files(root: str, name: str, blocks: int) -> list[str]:
    folder = os.path.join(root, name)
    os.makedirs(folder)
    return [os.path.join(folder, f"{b}.blk") for b in range(blocks)]


def _block_views(flat: memoryview, blocks: int, block_bytes: int) -> list[memoryview]:
    flat = flat.cast("B")
    return [flat[b * block_bytes:(b + 1) * block_bytes] for b in range(blocks)]


def _raw_write(names: list[str], sources: list[memoryview]) -> float:
    """Write each file from its source with one ``os.write``; the seconds it took."""
    start = time.perf_counter()
    for name, src in zip(names, sources, strict=True):
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, src) != src.nbytes:
                raise SystemExit("short write")
        finally:
            os.close(fd)
    return time.perf_counter() - start


def _raw_read(names: list[str], destinations: list[memoryview]) -> float:
    """Read each file into its destination with one ``os.readv`` (readinto); the seconds it took."""
    start = time.perf_counter()
    for name, dst in zip(names, destinations, strict=True):
        fd = os.open(name, os.O_RDONLY)
        try:
            if os.readv(fd, [dst]) != dst.nbytes:
                raise SystemExit("short read")
        finally:
            os.close(fd)
    return time.perf_counter() - start


def print_disk(disk: dict[str, Any]) -> None:
    """The disk rows of the table: each baseline, and DiskTier with its ratios against them."""
    if not disk.get("disk_tier_available"):
        print(f"disk: {disk['disk_note']}")
        return
    print(f"{'':<43}{'ratio to: new':>13}{'one buffer':>11}{'old':>9}")
    rows = [("plain files write (old: file obj)", "old_file_write_gbps", None),
            ("plain files write (one buffer)", "one_buffer_file_write_gbps", None),
            ("plain files write (raw fd, buffer)", "file_write_gbps", None),
            ("DiskTier store", "disk_store_gbps", "write"),
            ("plain files read (old: file obj)", "old_file_read_gbps", None),
            ("plain files read (one buffer)", "one_buffer_file_read_gbps", None),
            ("plain files read (readinto buffer)", "file_read_gbps", None),
            ("plain files read into pool rows", "file_read_rows_gbps", None),
            ("DiskTier load", "disk_load_gbps", "read")]
    for label, name, kind in rows:
        line = f"{label:<34}{disk[name]:9.2f}"
        if kind is not None:
            line += "".join(f"{disk[ratio]:{width}.2f}" for ratio, width in (
                (f"disk_{kind}_ratio", 13), (f"one_buffer_disk_{kind}_ratio", 11), (f"old_disk_{kind}_ratio", 9)))
        print(line)


def disk_only(args: argparse.Namespace, requests: int, per_request: int, block_bytes: int, trials: int) -> int:
    """``--disk-only``: :func:`disk_bench` alone, on a plain tensor of random rows; prints the disk
    rows of the table, and with ``--json`` the same JSON names as a whole run (the others null)."""
    blocks = requests * per_request
    pool = torch.randint(0, 256, (64, block_bytes), dtype=torch.uint8).repeat((blocks + 63) // 64, 1)[:blocks]
    pool = (pool + torch.arange(blocks).to(torch.uint8)[:, None]).contiguous()  # rows differ
    disk = disk_bench(pool, requests, per_request, trials)
    engine_names = ("offload_gbps", "onboard_gbps", "baseline_copy_gbps", "baseline_offload_dir_gbps",
                    "baseline_onboard_dir_gbps", "offload_ratio", "onboard_ratio", "bare_pipeline_gbps",
                    "bare_pipeline_ratio")
    result: dict[str, Any] = {**dict.fromkeys(engine_names), **torch_figures([], [], None, None, 0),
                              **native_figures([], [], None, None, None, None, 0),
                              "disk_write_ratio": None, "disk_read_ratio": None,
                              **disk, "blocks_per_copy_run": None,
                              "config": {"requests": requests, "blocks_per_request": per_request,
                                         "block_bytes": block_bytes, "total_bytes": blocks * block_bytes,
                                         "trials": trials, "disk_only": True, "cpus": os.cpu_count()}}
    print(f"DiskTier bench: {requests} jobs x {per_request} blocks x {block_bytes >> 10} KiB, median of {trials}")
    print_disk(disk)
    if args.json:
        print(json.dumps(result))
    return 0


def disk_bench(pool: torch.Tensor, requests: int, per_request: int, trials: int) -> dict[str, Any]:
    try:
        from kvactors.tiers.disk import DiskTier  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        return {"disk_tier_available": False, "disk_note": f"DiskTier not importable ({exc}); disk ratios are null"}

    block_bytes = int(pool.shape[1])
    total_blocks = requests * per_request
    nbytes = total_blocks * block_bytes
    store_t, load_t, write_t, read_t, old_write_t, old_read_t, rows_read_t = [], [], [], [], [], [], []
    one_write_t: list[float] = []
    one_read_t: list[float] = []
    for trial in range(trials):
        root = tempfile.mkdtemp(prefix="kvactors-bench-")
        try:
            tier = DiskTier(os.path.join(root, "tier"), capacity_bytes=4 * nbytes + (64 << 20))
            pending: dict[int, threading.Event] = {}
            results: dict[int, JobResult] = {}
            lock = threading.Lock()

            def report(result: JobResult, pending: dict[int, threading.Event] = pending,
                       results: dict[int, JobResult] = results, lock: threading.Lock = lock) -> None:
                with lock:
                    results[result.job_id] = result
                    pending[result.job_id].set()

            tier.attach(pool, report)
            ctx = ReqContext(f"disk-{trial}")
            tier.on_new_request(ctx)
            keys = [[f"d{trial}.r{i}.b{j}".encode() for j in range(per_request)] for i in range(requests)]

            def run_jobs(promotion: bool, first_id: int, tier: Any = tier, keys: list[list[bytes]] = keys,
                         pending: dict[int, threading.Event] = pending, ctx: ReqContext = ctx) -> float:
                start = time.perf_counter()
                for i in range(requests):
                    job_id = first_id + i
                    pending[job_id] = threading.Event()
                    block_ids = tuple(range(i * per_request, (i + 1) * per_request))
                    job = TransferJob(job_id, tuple(keys[i]), block_ids, ctx, promotion)
                    (tier.submit_load if promotion else tier.submit_store)(job)
                for i in range(requests):
                    if not pending[first_id + i].wait(120):
                        raise SystemExit("DiskTier job not reported in 120 s")
                return time.perf_counter() - start

            reference = pool[:total_blocks].clone()
            _settle_writeback()
            store_t.append(run_jobs(False, 1))
            pool[:total_blocks].zero_()
            _settle_writeback()
            load_t.append(run_jobs(True, 1 + requests))
            failed = [r for r in results.values() if not r.success]
            if failed:
                raise SystemExit(f"DiskTier jobs failed: {failed[:3]}")
            if not torch.equal(pool[:total_blocks], reference):
                raise SystemExit("DiskTier load returned different bytes")
            tier.on_request_finished(ctx)
            tier.drain(10.0)
            tier.shutdown()

            # Plain files: one per block, same bytes, same block size, no fsync.
            # Old baseline: buffered file objects ("wb" write, "rb" readinto into the row).
            plain = os.path.join(root, "plain")
            os.makedirs(plain)
            arr = pool.numpy()
            _settle_writeback()
            start = time.perf_counter()
            for b in range(total_blocks):
                with open(os.path.join(plain, f"{b}.blk"), "wb") as f:
                    f.write(memoryview(arr[b]))
            old_write_t.append(time.perf_counter() - start)
            pool[:total_blocks].zero_()
            _settle_writeback()
            start = time.perf_counter()
            for b in range(total_blocks):
                with open(os.path.join(plain, f"{b}.blk"), "rb", buffering=0) as f:
                    f.readinto(memoryview(arr[b]))
            old_read_t.append(time.perf_counter() - start)
            if not torch.equal(pool[:total_blocks], reference):
                raise SystemExit("plain file read returned different bytes")
            # New baseline, the fastest plain way: raw descriptors, each block written from and read
            # (readv, i.e. readinto) into its own place in one preallocated buffer of every block, as
            # a load must put each block somewhere of its own (no file objects, no allocation per block).
            flat = memoryview(arr.reshape(-1))
            whole = torch.empty(nbytes, dtype=torch.uint8)
            whole.copy_(pool[:total_blocks].reshape(-1))  # touched before any timing
            whole_views = _block_views(memoryview(whole.numpy()), total_blocks, block_bytes)
            names = _raw_files(root, "raw", total_blocks)
            _settle_writeback()
            write_t.append(_raw_write(names, whole_views))
            whole.zero_()
            _settle_writeback()
            read_t.append(_raw_read(names, whole_views))
            if not torch.equal(whole, pool[:total_blocks].reshape(-1)):
                raise SystemExit("raw file read returned different bytes")
            # For scale, the baseline of the first data-plane issue: the same reads into one
            # block-sized buffer that every block overwrites (it stays in the CPU cache, so it
            # measures the page cache's copy, not a load), and writes from it.
            buf = memoryview(bytearray(flat[:block_bytes]))
            _settle_writeback()
            one_read_t.append(_raw_read(names, [buf] * total_blocks))
            if buf != flat[(total_blocks - 1) * block_bytes:total_blocks * block_bytes]:  # the last block
                raise SystemExit("raw file read returned different bytes")
            _settle_writeback()
            one_write_t.append(_raw_write(_raw_files(root, "raw-one", total_blocks), [buf] * total_blocks))
            # For scale, not a ratio target: the same raw reads into the pool rows (where a
            # tier must put them: cold memory, not one cache-resident buffer), no checksum.
            pool[:total_blocks].zero_()
            _settle_writeback()
            rows_read_t.append(_raw_read(names, _block_views(flat, total_blocks, block_bytes)))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    store, load = gbps(nbytes, statistics.median(store_t)), gbps(nbytes, statistics.median(load_t))
    write, read = gbps(nbytes, statistics.median(write_t)), gbps(nbytes, statistics.median(read_t))
    old_write = gbps(nbytes, statistics.median(old_write_t))
    old_read = gbps(nbytes, statistics.median(old_read_t))
    rows_read = gbps(nbytes, statistics.median(rows_read_t))
    one_write = gbps(nbytes, statistics.median(one_write_t))
    one_read = gbps(nbytes, statistics.median(one_read_t))
    return {"disk_tier_available": True, "disk_store_gbps": store, "disk_load_gbps": load,
            "file_write_gbps": write, "file_read_gbps": read,
            "disk_write_ratio": store / write, "disk_read_ratio": load / read,
            "old_file_write_gbps": old_write, "old_file_read_gbps": old_read,
            "old_disk_write_ratio": store / old_write, "old_disk_read_ratio": load / old_read,
            "file_read_rows_gbps": rows_read, "disk_read_rows_ratio": load / rows_read,
            "one_buffer_file_write_gbps": one_write, "one_buffer_file_read_gbps": one_read,
            "one_buffer_disk_write_ratio": store / one_write, "one_buffer_disk_read_ratio": load / one_read}


# ---------------------------------------------------------------- the vLLM worker's layout


def vllm_layout_bench(requests: int, per_request: int, block_bytes: int, layers: int, window: int,
                      trials: int) -> dict[str, Any]:
    """The vLLM worker's copies (``KvactorsOffloadingWorker``, CPU): one KV tensor per layer,
    ``(num_blocks, page)`` with ``page = block_bytes / layers``; a pool row holds the block's
    page of every layer, so each job is one copy per layer (``_foreach_copy_``).

    Baseline: the same bytes in the same layout with the fewest copies, one ``copy_`` per layer
    of every block at once (``vllm_*_ratio``). Needs vLLM (run with a vLLM venv's python);
    without it the figures are ``null``.
    """
    try:
        from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found,unused-ignore]
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
        )
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-not-found,unused-ignore]

        from kvactors.integrations.vllm.shm import SHM_DIR, SharedPool
        from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker
    except ImportError as exc:
        return {"vllm_layout_available": False,
                "vllm_layout_note": f"vLLM not importable ({type(exc).__name__}); run with a vLLM venv's python"}
    if block_bytes % layers:
        raise SystemExit(f"--layers {layers} does not divide the block size {block_bytes}")
    page = block_bytes // layers
    total = requests * per_request
    nbytes = total * block_bytes
    caches = [torch.randint(-128, 128, (total, page), dtype=torch.int8) for _ in range(layers)]
    reference = [c.clone() for c in caches]
    kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=c, page_size_bytes=page) for c in caches],
                           group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
                                             for i in range(layers)]])
    # Where the vLLM integration puts its pool (a file on disk would add writeback to every copy).
    root = tempfile.mkdtemp(prefix="kvactors-bench-vllm-", dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
    shared = SharedPool(os.path.join(root, "pool"), num_blocks=total, block_bytes=block_bytes)
    worker = KvactorsOffloadingWorker(kv, shared, rank=0, per_worker_bytes=block_bytes, blocks_per_chunk=1,
                                      transfer_timeout_s=60.0)
    views = [shared.pool.view(total, layers, page)[:, i] for i in range(layers)]
    job_ids = itertools.count(1)

    def run(store: bool) -> float:
        open_jobs: deque[int] = deque()
        done: set[int] = set()

        def wait_oldest() -> None:
            oldest = open_jobs.popleft()
            deadline = time.monotonic() + 60
            while oldest not in done:
                if time.monotonic() > deadline:
                    raise SystemExit("vLLM worker job not finished in 60 s")
                worker.wait({oldest})
                done.update(r.job_id for r in worker.get_finished())

        start = time.perf_counter()
        for i in range(requests):
            if len(open_jobs) >= window:
                wait_oldest()
            ids = list(range(i * per_request, (i + 1) * per_request))
            job_id = next(job_ids)
            gpu, cpu = GPULoadStoreSpec(ids, group_sizes=(len(ids),), block_indices=(0,)), CPULoadStoreSpec(ids)
            if store:
                worker.submit_store(job_id, gpu, cpu)
            else:
                worker.submit_load(job_id, cpu, gpu)
            open_jobs.append(job_id)
        while open_jobs:
            wait_oldest()
        return time.perf_counter() - start

    def baseline(store: bool) -> float:
        start = time.perf_counter()
        for cache, view in zip(caches, views, strict=True):
            (view.copy_(cache.view(torch.uint8)) if store else cache.view(torch.uint8).copy_(view))
        return time.perf_counter() - start

    store_t, load_t, base_store_t, base_load_t = [], [], [], []
    try:
        run(True)  # warm
        for _ in range(trials):
            base_store_t.append(baseline(True))
            base_load_t.append(baseline(False))
            shared.pool.zero_()
            store_t.append(run(True))
            for cache in caches:
                cache.zero_()
            load_t.append(run(False))
            if not all(torch.equal(c, r) for c, r in zip(caches, reference, strict=True)):
                raise SystemExit("vLLM worker: the loaded bytes differ from the stored ones")
        if worker.store_failures or worker.load_failures:
            raise SystemExit(f"vLLM worker: {worker.store_failures} stores, {worker.load_failures} loads failed")
    finally:
        worker.shutdown()
        shared.close(unlink=True)
        shutil.rmtree(root, ignore_errors=True)
    store, load = gbps(nbytes, statistics.median(store_t)), gbps(nbytes, statistics.median(load_t))
    base_store = gbps(nbytes, statistics.median(base_store_t))
    base_load = gbps(nbytes, statistics.median(base_load_t))
    return {"vllm_layout_available": True, "vllm_layers": layers, "vllm_page_bytes": page,
            "vllm_store_gbps": store, "vllm_load_gbps": load,
            "vllm_baseline_store_gbps": base_store, "vllm_baseline_load_gbps": base_load,
            "vllm_store_ratio": store / base_store, "vllm_load_ratio": load / base_load}


# ---------------------------------------------------------------- main


def _median_gbps(times: list[float], nbytes: int) -> float | None:
    return gbps(nbytes, statistics.median(times)) if times else None


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def torch_figures(off_t: list[float], on_t: list[float], base_off: float | None, base_on: float | None,
                  nbytes: int) -> dict[str, float | None]:
    """The torch copier's engine figures (``*_ratio`` to ``copy_``, as the main ones); ``None``
    where not measured."""
    off, on = _median_gbps(off_t, nbytes), _median_gbps(on_t, nbytes)
    return {"torch_offload_gbps": off, "torch_onboard_gbps": on,
            "torch_offload_ratio": _over(off, base_off), "torch_onboard_ratio": _over(on, base_on)}


def native_figures(off_t: list[float], on_t: list[float], offload: float | None, onboard: float | None,
                   base_off: float | None, base_on: float | None, nbytes: int) -> dict[str, float | None]:
    """The bare native copy (``*_ratio`` to ``copy_``) and the engine's ratios to it
    (``*_vs_native_ratio``); ``None`` where not measured."""
    off, on = _median_gbps(off_t, nbytes), _median_gbps(on_t, nbytes)
    return {"native_copy_offload_gbps": off, "native_copy_onboard_gbps": on,
            "native_copy_offload_ratio": _over(off, base_off), "native_copy_onboard_ratio": _over(on, base_on),
            "offload_vs_native_ratio": _over(offload, off), "onboard_vs_native_ratio": _over(onboard, on)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", action="store_true", help="last line of stdout: one JSON object")
    parser.add_argument("--requests", type=int, default=None, help="requests per pass (default 256, quick 64)")
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--disk-only", action="store_true",
                        help="only the disk part (DiskTier vs plain files); the other figures are null")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--window", type=int, default=8, help="requests in flight")
    parser.add_argument("--copy-workers", type=int, default=1)
    parser.add_argument("--copier", choices=COPIERS, default="auto",
                        help="the engine's CPU copier (default auto: native where built)")
    parser.add_argument("--trials", type=int, default=None, help="default 7, quick 5")
    parser.add_argument("--disk-requests", type=int, default=None, help="default 64, quick 16")
    parser.add_argument("--layers", type=int, default=32,
                        help="KV tensors of the vLLM worker's layout (needs vLLM; default 32)")
    args = parser.parse_args(argv)
    for name in ("requests", "blocks_per_request", "block_kib", "window", "copy_workers", "trials",
                 "disk_requests", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    if args.copier == "native" and not args.disk_only and not native_copy_available():
        parser.error("--copier native: the native copy loop is not built (no C compiler at install?)")

    requests = args.requests or (64 if args.quick else 256)
    trials = args.trials or (5 if args.quick else 7)
    disk_requests = args.disk_requests or (16 if args.quick else 64)
    per_request = args.blocks_per_request
    block_bytes = args.block_kib * 1024
    total_blocks = requests * per_request
    nbytes = total_blocks * block_bytes
    if args.disk_only:
        return disk_only(args, min(disk_requests, requests), per_request, block_bytes, trials)

    # Random bytes, cheaply: 64 random rows, repeated, each row shifted by its index (so rows differ).
    seed_rows = torch.randint(0, 256, (64, block_bytes), dtype=torch.uint8)
    device = seed_rows.repeat((total_blocks + 63) // 64, 1)[:total_blocks].contiguous()
    device += torch.arange(total_blocks).to(torch.uint8)[:, None]
    reference = device.clone()
    offload_t, onboard_t, base_off_t, base_on_t, per_run, bare_t = [], [], [], [], [], []
    torch_off_t, torch_on_t, native_off_t, native_on_t = [], [], [], []
    threads = native_threads(args.copy_workers)
    with TieringManager.start(num_blocks=total_blocks, block_bytes=block_bytes) as manager:
        pool = manager.pool
        bare = BarePipeline(pool, device, per_request)
        with TransferEngine(manager, device, copy_workers=args.copy_workers, copier=args.copier) as engine, \
                TransferEngine(manager, device, copy_workers=args.copy_workers, copier="torch") as torch_engine:
            copier = engine.copier
            # The torch copier's figures in the same run, when the engine runs another copier.
            engines = [(engine, offload_t, onboard_t)]
            if copier != "torch":
                engines.append((torch_engine, torch_off_t, torch_on_t))
            try:
                for eng, _, _ in engines:
                    engine_trial(manager, eng, device, reference, -1, min(requests, 8), per_request, args.window)
                bare.trial(min(requests, 8), args.window)  # all warm
                for trial in range(trials):
                    base_off_t.append(baseline_copy(pool, device))
                    base_on_t.append(baseline_copy(device, pool))
                    bare_t.append(bare.trial(requests, args.window))
                    if native_copy_available():
                        native_off_t.append(native_copy(pool, device, threads))
                        native_on_t.append(native_copy(device, pool, threads))
                    for k, (eng, off_t, on_t) in enumerate(engines):
                        t_off, t_on, blocks_per_run = engine_trial(
                            manager, eng, device, reference, trial * len(engines) + k, requests, per_request,
                            args.window)
                        off_t.append(t_off)
                        on_t.append(t_on)
                        if eng is engine:
                            per_run.append(blocks_per_run)
            finally:
                bare.close()
        disk = disk_bench(pool, min(disk_requests, requests), per_request, trials)
    layout = vllm_layout_bench(requests, per_request, block_bytes, args.layers, args.window, trials)

    offload = gbps(nbytes, statistics.median(offload_t))
    onboard = gbps(nbytes, statistics.median(onboard_t))
    base_off = gbps(nbytes, statistics.median(base_off_t))
    base_on = gbps(nbytes, statistics.median(base_on_t))
    baseline = (base_off + base_on) / 2
    result: dict[str, Any] = {
        "offload_gbps": offload,
        "onboard_gbps": onboard,
        "baseline_copy_gbps": baseline,
        "baseline_offload_dir_gbps": base_off,
        "baseline_onboard_dir_gbps": base_on,
        "offload_ratio": offload / base_off,
        "onboard_ratio": onboard / base_on,
        "bare_pipeline_gbps": gbps(nbytes, statistics.median(bare_t)),
        "bare_pipeline_ratio": gbps(nbytes, statistics.median(bare_t)) / base_off,
        **torch_figures(torch_off_t, torch_on_t, base_off, base_on, nbytes),
        **native_figures(native_off_t, native_on_t, offload, onboard, base_off, base_on, nbytes),
        "disk_write_ratio": None,
        "disk_read_ratio": None,
        **disk,
        **layout,
        "blocks_per_copy_run": statistics.median(per_run),
        "config": {"requests": requests, "blocks_per_request": per_request, "block_bytes": block_bytes,
                   "total_bytes": nbytes, "window": args.window, "copy_workers": args.copy_workers,
                   "copier": copier, "native_threads": threads if native_copy_available() else None,
                   "trials": trials, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()},
    }

    def fmt(value: Any) -> str:
        return "null" if value is None else f"{value:7.2f}"

    print(f"TransferEngine bench: {requests} requests x {per_request} blocks x {args.block_kib} KiB "
          f"= {nbytes / 2**20:.0f} MiB per pass, window {args.window}, {copier} copier, "
          f"{args.copy_workers} copy workers, "
          f"median of {trials}")
    print(f"{'path':<34}{'GB/s':>9}{'ratio':>9}")
    print(f"{'baseline copy_ device->pool':<34}{fmt(base_off):>9}")
    print(f"{'baseline copy_ pool->device':<34}{fmt(base_on):>9}")
    print(f"{'engine offload':<34}{fmt(offload):>9}{fmt(result['offload_ratio']):>9}")
    print(f"{'engine onboard':<34}{fmt(onboard):>9}{fmt(result['onboard_ratio']):>9}")
    print(f"{'bare pipeline (no control work)':<34}{fmt(result['bare_pipeline_gbps']):>9}"
          f"{fmt(result['bare_pipeline_ratio']):>9}")
    if result["torch_offload_gbps"] is not None:
        print(f"{'engine offload, torch copier':<34}{fmt(result['torch_offload_gbps']):>9}"
              f"{fmt(result['torch_offload_ratio']):>9}")
        print(f"{'engine onboard, torch copier':<34}{fmt(result['torch_onboard_gbps']):>9}"
              f"{fmt(result['torch_onboard_ratio']):>9}")
    if result["native_copy_offload_gbps"] is not None:
        print(f"{'bare native copy device->pool':<34}{fmt(result['native_copy_offload_gbps']):>9}"
              f"{fmt(result['native_copy_offload_ratio']):>9}")
        print(f"{'bare native copy pool->device':<34}{fmt(result['native_copy_onboard_gbps']):>9}"
              f"{fmt(result['native_copy_onboard_ratio']):>9}")
        print(f"{'engine / bare native copy':<34}{'':>9}{fmt(result['offload_vs_native_ratio']):>9}"
              f"{fmt(result['onboard_vs_native_ratio']):>9}")
    print(f"{'blocks per coalesced copy':<34}{fmt(result['blocks_per_copy_run']):>9}")
    print_disk(disk)
    if layout.get("vllm_layout_available"):
        print(f"{'vLLM layout, per layer ' + str(layout['vllm_page_bytes']) + ' B':<34}")
        print(f"{'  baseline copy_ per layer, store':<34}{fmt(layout['vllm_baseline_store_gbps']):>9}")
        print(f"{'  baseline copy_ per layer, load':<34}{fmt(layout['vllm_baseline_load_gbps']):>9}")
        print(f"{'  worker store':<34}{fmt(layout['vllm_store_gbps']):>9}{fmt(layout['vllm_store_ratio']):>9}")
        print(f"{'  worker load':<34}{fmt(layout['vllm_load_gbps']):>9}{fmt(layout['vllm_load_ratio']):>9}")
    else:
        print(f"vLLM layout: {layout['vllm_layout_note']}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
