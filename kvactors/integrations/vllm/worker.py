"""The worker side: vLLM's ``OffloadingWorker`` copying between its KV caches and the kvactors pool.

vLLM hands the worker its live KV cache as ``CanonicalKVCaches``: one int8
tensor ``(num_blocks, page_size_bytes)`` per layer (or group of layers). A
kvactors block is one vLLM offload chunk: ``blocks_per_chunk`` vLLM blocks,
their page in every tensor of their KV cache group. One pool row holds, for
each worker rank ``r`` (at ``r * per_worker_bytes``), for each tensor of the
group in order, ``blocks_per_chunk`` pages.

Copies run off vLLM's step thread: one copy thread on the CPU (a FIFO of
jobs, each copy a slice ``copy_`` over consecutive blocks), or CUDA streams
(one per direction, ordered after the caller's current stream) with one event
per job on a GPU. ``get_finished`` reports each job once with its size and
time; ``wait`` blocks until the given jobs ended, at most
``transfer_timeout_s``.

Failures: vLLM asserts that every transfer succeeded, so the worker always
reports ``success=True`` to vLLM. A store whose copy failed instead marks its
rows :data:`~kvactors.integrations.vllm.shm.STORE_FAILED` in the shared
status table before it is reported; the scheduler side reads that byte and
completes the store with ``success=False`` inside kvactors, so the block is
never made ready (the next request recomputes it). A failed load is logged
and counted (``load_failures``); vLLM offers an offloading worker no way to
make the request recompute it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvactors.integrations.vllm.shm import STORE_FAILED, STORE_OK, SharedPool
from kvactors.logs import component_logger
from kvactors.transfer.runs import copy_runs
from kvactors.transfer.views import copy_all, widest_views

STORE = "store"
LOAD = "load"

# Live workers of this process (tests reach the worker vLLM built through it).
WORKERS: weakref.WeakSet[KvactorsOffloadingWorker] = weakref.WeakSet()

FaultInjector = Callable[[str, int], None]
"""Testing hook ``(direction, job_id)``, called before a job's copies; raising fails that copy."""


@dataclass(eq=False)
class _Copy:
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(eq=False)
class _Job:
    job_id: int
    direction: str
    copies: list[_Copy]
    rows: tuple[int, ...]
    nbytes: int
    submitted: float = field(default_factory=time.monotonic)
    event: torch.cuda.Event | None = None
    error: BaseException | None = None


class KvactorsOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between vLLM's ``CanonicalKVCaches`` and the shared kvactors pool.

    Threading: vLLM calls it from its worker thread; the copy thread (CPU) or
    the CUDA streams do the copies; results are handed over under a condition.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, shared: SharedPool, *, rank: int, per_worker_bytes: int,
                 blocks_per_chunk: int, transfer_timeout_s: float, owns_shared: bool = False) -> None:
        self._log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema
        self.shared = shared
        self.pool = shared.pool
        self.rank = rank
        self.bpc = blocks_per_chunk
        self.transfer_timeout_s = transfer_timeout_s
        self._owns_shared = owns_shared
        self.fault_injector: FaultInjector | None = None
        self.load_failures = 0
        self.store_failures = 0
        # Bytes copied by jobs that succeeded, per direction (for operators and benchmarks).
        self.bytes_stored = 0
        self.bytes_loaded = 0
        # Per group: [(device tensor as rows, pool view (rows, page) or (rows, bpc, page))], both
        # of the widest integer type their layout allows (widest_views).
        self._layout: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        tensors = [t.tensor for t in kv_caches.tensors]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        base = rank * per_worker_bytes
        for refs in kv_caches.group_data_refs:
            offset = base
            group = []
            for t_idx in dict.fromkeys(ref.tensor_idx for ref in refs):
                dev = tensors[t_idx]
                dev = dev.view(torch.uint8) if dev.dtype != torch.uint8 else dev
                dev = dev.reshape(dev.shape[0], -1)
                page = int(dev.shape[1])
                width = self.bpc * page
                if offset + width > base + per_worker_bytes:
                    raise ValueError(f"kvactors: the KV cache pages ({offset + width - base} bytes a chunk) do not fit "
                                     f"the {per_worker_bytes} bytes a worker has in a pool row")
                view = self.pool[:, offset:offset + width]
                # (rows, page) when a chunk is one block (one index less per copy), else (rows, bpc, page).
                view = view if self.bpc == 1 else view.unflatten(1, (self.bpc, page))
                dev, view = widest_views(dev, view)
                group.append((dev, view))
                offset += width
            self._layout.append(group)
        self._cond = threading.Condition()
        self._finished: list[TransferResult] = []
        self._done_ids: set[int] = set()
        self._open: set[int] = set()
        self._closed = False
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._streams = {STORE: torch.cuda.Stream(self.device), LOAD: torch.cuda.Stream(self.device)}
            self._inflight: list[_Job] = []
            self._register_host_memory()
        else:
            self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._copy_loop, name="kvactors-vllm-copy", daemon=True)
            self._thread.start()
        WORKERS.add(self)

    # ------------------------------------------------------------ planning

    def _plan(self, direction: str, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec, job_id: int) -> _Job:
        rows = [int(r) for r in cpu.block_ids]
        dev_ids = [int(b) for b in gpu.block_ids]
        sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(dev_ids)]
        indices = list(gpu.block_indices) if gpu.block_indices is not None else [0] * len(sizes)
        copies: list[_Copy] = []
        nbytes = 0
        dev_off = row_off = 0
        bpc, store = self.bpc, direction == STORE
        for g, (size, first) in enumerate(zip(sizes, indices, strict=True)):
            if size == 0:
                continue
            skip = int(first) % bpc
            n_rows = -(-(size + skip) // bpc)
            g_rows = rows[row_off:row_off + n_rows]
            g_dev = dev_ids[dev_off:dev_off + size]
            # Flattened pool slot of each device block: row * bpc + slot.
            flat = [g_rows[(skip + j) // bpc] * bpc + (skip + j) % bpc for j in range(size)]
            # The same pieces for every tensor of the group: runs split at row boundaries
            # (a row holds bpc slots), found once per group, not once per layer.
            pieces: list[tuple[int, int, int, int]] = []  # (device block, row, slot, blocks)
            for d0, f0, n in copy_runs(g_dev, flat):
                done = 0
                while done < n:
                    row, slot = divmod(f0 + done, bpc)
                    take = min(n - done, bpc - slot) if bpc > 1 else n - done
                    pieces.append((d0 + done, row, slot, take))
                    done += take
            for dev, view in self._layout[g]:
                page = dev.shape[1] * dev.element_size()
                for d, row, slot, take in pieces:
                    pool_part = view[row:row + take] if bpc == 1 else view[row, slot:slot + take]
                    dev_part = dev[d:d + take]
                    copies.append(_Copy(dev_part, pool_part) if store else _Copy(pool_part, dev_part))
                    nbytes += take * page
            dev_off += size
            row_off += n_rows
        return _Job(job_id, direction, copies, tuple(rows), nbytes)

    # ------------------------------------------------------------ vLLM's calls

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:  # type: ignore[override, unused-ignore]
        return self._submit(STORE, job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec,  # type: ignore[override, unused-ignore]
                    expedited: bool = False) -> bool:
        return self._submit(LOAD, job_id, dst_spec, src_spec)

    def _submit(self, direction: str, job_id: int, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> bool:
        try:
            job = self._plan(direction, gpu, cpu, job_id)
        except Exception as exc:  # a spec we cannot map: fail the job, never the engine
            self._log.error("transfer_plan_failed", job_id=job_id, kind=direction, error=repr(exc))
            job = _Job(job_id, direction, [], tuple(int(r) for r in cpu.block_ids), 0, error=exc)
        with self._cond:
            self._open.add(job_id)
        if job.error is not None:
            self._finish(job)
        elif self._cuda:
            self._issue_cuda(job)
        else:
            self._queue.put(job)
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._cuda:
            self._poll_cuda(block=False)
        with self._cond:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        deadline = time.monotonic() + self.transfer_timeout_s
        if self._cuda:
            self._poll_cuda(block=True, only=set(job_ids))
        with self._cond:
            while True:
                left = [j for j in job_ids if j in self._open]
                if not left:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._log.error("transfer_wait_timed_out", jobs=len(left), timeout_s=self.transfer_timeout_s)
                    return
                self._cond.wait(remaining)

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._cuda:
            self._poll_cuda(block=True)
        else:
            self._queue.put(None)
            self._thread.join(self.transfer_timeout_s)
        WORKERS.discard(self)
        if self._owns_shared:
            self.shared.close(unlink=True)

    # ------------------------------------------------------------ the copies

    def _run_copies(self, job: _Job, *, non_blocking: bool = False) -> None:
        if self.fault_injector is not None:
            self.fault_injector(job.direction, job.job_id)
        copy_all([c.dst for c in job.copies], [c.src for c in job.copies], non_blocking=non_blocking)

    def _copy_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run_copies(job)
            except Exception as exc:
                job.error = exc
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Record a job's outcome: the status bytes first, then the result vLLM polls."""
        if job.direction == STORE:
            self.shared.mark(job.rows, self.rank, STORE_OK if job.error is None else STORE_FAILED)
        if job.error is not None:
            if job.direction == STORE:
                self.store_failures += 1
            else:
                self.load_failures += 1
            self._log.warning("transfer_failed", job_id=job.job_id, kind=job.direction, error=repr(job.error))
        elif job.direction == STORE:
            self.bytes_stored += job.nbytes
        else:
            self.bytes_loaded += job.nbytes
        result = TransferResult(job.job_id, True, job.nbytes, time.monotonic() - job.submitted)
        with self._cond:
            self._open.discard(job.job_id)
            self._finished.append(result)
            self._cond.notify_all()

    # CUDA: streams and events, polled from vLLM's own calls (no extra thread).

    def _register_host_memory(self) -> None:
        """Pin the shared pool for asynchronous copies (best effort)."""
        with contextlib.suppress(Exception):
            cudart = torch.cuda.cudart()
            cudart.cudaHostRegister(self.pool.data_ptr(), self.pool.numel(), 0)

    def _issue_cuda(self, job: _Job) -> None:
        stream = self._streams[job.direction]
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._run_copies(job, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            job.event = event
        except Exception as exc:
            job.error = exc
            with contextlib.suppress(Exception):
                stream.synchronize()
        with self._cond:
            self._inflight.append(job)

    def _poll_cuda(self, *, block: bool, only: set[int] | None = None) -> None:
        with self._cond:
            jobs = list(self._inflight)
        done: list[_Job] = []
        for job in jobs:
            event = job.event
            if event is not None:
                try:
                    if block and (only is None or job.job_id in only):
                        event.synchronize()
                    elif not event.query():
                        continue
                except Exception as exc:
                    job.error = job.error or exc
            done.append(job)
        if done:
            with self._cond:
                self._inflight = [j for j in self._inflight if j not in done]
            for job in done:
                self._finish(job)


def pages_per_group(kv_caches: CanonicalKVCaches) -> Sequence[int]:
    """Bytes of one vLLM block of each KV cache group (all its tensors' pages)."""
    out = []
    for refs in kv_caches.group_data_refs:
        idx = dict.fromkeys(ref.tensor_idx for ref in refs)
        out.append(sum(kv_caches.tensors[i].tensor[0].numel() * kv_caches.tensors[i].tensor.element_size()
                       for i in idx))
    return out
