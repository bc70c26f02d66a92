"""The worker side: vLLM's ``OffloadingWorker`` copying between its KV caches and the kvactors pool.

vLLM hands the worker its live KV cache as ``CanonicalKVCaches``: one int8
tensor ``(num_blocks, page_size_bytes)`` per layer (or group of layers). A
kvactors block is one vLLM offload chunk: ``blocks_per_chunk`` vLLM blocks,
their page in every tensor of their KV cache group. One pool row holds, for
each worker rank ``r`` (at ``r * per_worker_bytes``), for each tensor of the
group in order, ``blocks_per_chunk`` pages
(:class:`~kvactors.transfer.layouts.PageLayout`).

The copies are the transfer layer's (:mod:`kvactors.transfer`), through its
``Copier`` protocol: on the CPU the native copy loop where it is built and the
tensors allow it (:class:`~kvactors.transfer.native.NativeCopier`), torch's
copy thread otherwise (:class:`~kvactors.transfer.cpu.CpuCopier`); on a GPU
one CUDA stream per direction with an event per job
(:class:`~kvactors.transfer.cuda.CudaCopier`), the shared pool registered with
CUDA from the worker's start until its :meth:`~KvactorsOffloadingWorker.shutdown`,
which unregisters it before the pool is unmapped. The copier is chosen as the
engine's is (:func:`~kvactors.transfer.choice.host_copier`). Each job has the
deadline ``transfer_timeout_s`` from its submit. ``get_finished`` reports each
job once with its size and time. ``wait`` blocks until the given jobs ended, at
most ``transfer_timeout_s``.

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

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvactors.integrations.vllm.shm import STORE_FAILED, STORE_OK, SharedPool
from kvactors.logs import component_logger
from kvactors.transfer.choice import check_copier, host_copier, native_threads
from kvactors.transfer.cpu import CpuCopier
from kvactors.transfer.jobs import OFFLOAD, ONBOARD, Copier, CopyJob, Direction
from kvactors.transfer.layouts import PageLayout
from kvactors.transfer.native import NativeCopier
from kvactors.transfer.runs import Run, copy_runs

if TYPE_CHECKING:
    from kvactors.transfer.cuda import HostRegistration

# Live workers of this process (tests reach the worker vLLM built through it).
WORKERS: weakref.WeakSet[KvactorsOffloadingWorker] = weakref.WeakSet()

_KIND: dict[Direction, str] = {OFFLOAD: "store", ONBOARD: "load"}  # the log's names for the two directions


WorkerFault = Callable[[Direction, int, tuple[int, ...]], None]
"""The worker's testing hook: ``(direction, job_id, rows)``, vLLM's job id and its pool rows."""


@dataclass(eq=False, slots=True)
class WorkerJob(CopyJob):
    """One vLLM transfer job: a :class:`~kvactors.transfer.jobs.CopyJob` and the pool rows it
    copies to or from (a worker sees block ids and rows, never keys)."""

    rows: tuple[int, ...]
    submitted: float
    """When vLLM submitted it (``time.monotonic``), for the time its result reports."""


class KvactorsOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between vLLM's ``CanonicalKVCaches`` and the shared kvactors pool.

    ``copier``: ``"auto"`` (native where it can run, else torch; CUDA on a GPU),
    ``"native"`` (``ValueError`` where it cannot run) or ``"torch"``; CPU caches only
    for the last two. ``owns_shared``: close and remove the pool at :meth:`shutdown`;
    otherwise its owner closes it, and must do so only after :meth:`shutdown`.

    ``fault_injector``: a **testing hook** (:data:`WorkerFault`),
    ``(direction, job_id, rows)`` with ``direction`` ``"offload"`` (a store) or
    ``"onboard"`` (a load), vLLM's job id and the job's pool rows. It is called
    on vLLM's thread just before a job goes to the copier. If it raises, the job
    fails as a failed copy would.

    Threading: vLLM calls every method from its one worker thread; the copier's
    threads report each job once, and the results are handed over under a
    condition. :meth:`wait` may also be called from another thread.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, shared: SharedPool, *, rank: int, per_worker_bytes: int,
                 blocks_per_chunk: int, transfer_timeout_s: float, owns_shared: bool = False,
                 copier: str = "auto") -> None:
        check_copier(copier)
        self._log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema
        self.shared = shared
        self.pool = shared.pool
        self.rank = rank
        self.bpc = blocks_per_chunk
        self.transfer_timeout_s = transfer_timeout_s
        self._owns_shared = owns_shared
        self.fault_injector: WorkerFault | None = None
        self.load_failures = 0
        self.store_failures = 0
        # Bytes copied by jobs that succeeded, per direction (for operators and benchmarks).
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.layout = PageLayout(self._planes(kv_caches, rank, per_worker_bytes), self.pool, blocks_per_chunk)
        self.device = self.layout.device
        self._cond = threading.Condition()
        self._finished: list[TransferResult] = []
        self._open: set[int] = set()
        self._closed = False
        self._registration: HostRegistration | None = None
        self._copier = self._make_copier(copier)
        WORKERS.add(self)

    def _planes(self, kv_caches: CanonicalKVCaches, rank: int,
                per_worker_bytes: int) -> list[list[tuple[torch.Tensor, int]]]:
        """Per group: each tensor as ``uint8`` rows and its byte offset in a pool row. Every group
        starts at the rank's part of the row (a row holds a chunk of one group)."""
        tensors = [t.tensor for t in kv_caches.tensors]
        base = rank * per_worker_bytes
        groups = []
        for refs in kv_caches.group_data_refs:
            offset = base
            planes = []
            for t_idx in dict.fromkeys(ref.tensor_idx for ref in refs):
                dev = tensors[t_idx]
                dev = dev.view(torch.uint8) if dev.dtype != torch.uint8 else dev
                dev = dev.reshape(dev.shape[0], -1)
                width = self.bpc * int(dev.shape[1])
                if offset + width > base + per_worker_bytes:
                    raise ValueError(f"kvactors: the KV cache pages ({offset + width - base} bytes a chunk) do not fit "
                                     f"the {per_worker_bytes} bytes a worker has in a pool row")
                planes.append((dev, offset))
                offset += width
            groups.append(planes)
        return groups

    def _make_copier(self, choice: str) -> Copier[WorkerJob]:
        """The transfer layer's copier for this layout; sets :attr:`copier` to its name."""
        if self.device.type == "cuda":
            if choice != "auto":
                raise ValueError(f"copier={choice!r} copies between host tensors; this KV cache is on {self.device}")
            from kvactors.transfer.cuda import CudaCopier, HostRegistration

            # Paired with its release in shutdown(), which runs before the pool is unmapped.
            self._registration = HostRegistration(self.pool)
            try:
                cuda_copier: Copier[WorkerJob] = CudaCopier(layout=self.layout, device=self.device,
                                                            done=self._copied, fault_injector=None)
            except BaseException:
                self._registration.release()
                raise
            self.copier = "cuda"
            return cuda_copier
        self.copier, host = host_copier(
            choice, blocked=None if self.layout.native() else "the KV cache rows are not contiguous", log=self._log,
            native=lambda: NativeCopier(layout=self.layout, threads=native_threads(1), done=self._copied),
            torch_copier=lambda: CpuCopier(layout=self.layout, workers=1, done=self._copied, fault_injector=None))
        return host

    # ------------------------------------------------------------ planning

    def _plan(self, direction: Direction, gpu: GPULoadStoreSpec, rows: tuple[int, ...]) -> tuple[list[Run], int]:
        """The job's runs (device ids and pool slots of :attr:`layout`) and its bytes.

        vLLM's spec: ``group_sizes[g]`` device blocks of group ``g`` in turn; group ``g``'s
        first block is block ``block_indices[g]`` of its request, so it starts at slot
        ``block_indices[g] % blocks_per_chunk`` of its first row. ``ValueError`` for a
        spec that does not fit the layout."""
        layout, bpc = self.layout, self.bpc
        dev_ids = [int(b) for b in gpu.block_ids]
        sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(dev_ids)]
        indices = list(gpu.block_indices) if gpu.block_indices is not None else [0] * len(sizes)
        dev_side: list[int] = []
        pool_side: list[int] = []
        nbytes = dev_off = row_off = 0
        for g, (size, first) in enumerate(zip(sizes, indices, strict=True)):
            if size == 0:
                continue
            skip = int(first) % bpc
            n_rows = -(-(size + skip) // bpc)
            g_rows = rows[row_off:row_off + n_rows]
            g_dev = dev_ids[dev_off:dev_off + size]
            if len(g_rows) < n_rows or len(g_dev) < size:
                raise ValueError(f"group {g}: {size} blocks need {n_rows} pool rows and {size} device blocks; "
                                 f"the spec has {len(g_rows)} and {len(g_dev)} left")
            for j, block in enumerate(g_dev):
                dev_side.append(layout.device_id(g, block))
                pool_side.append(layout.slot_id(g_rows[(skip + j) // bpc], (skip + j) % bpc))
            nbytes += size * layout.slot_bytes[g]
            dev_off += size
            row_off += n_rows
        runs = copy_runs(dev_side, pool_side) if direction == OFFLOAD else copy_runs(pool_side, dev_side)
        return runs, nbytes

    # ------------------------------------------------------------ vLLM's calls

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:  # type: ignore[override, unused-ignore]
        return self._submit(OFFLOAD, job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec,  # type: ignore[override, unused-ignore]
                    expedited: bool = False) -> bool:
        return self._submit(ONBOARD, job_id, dst_spec, src_spec)

    def _submit(self, direction: Direction, job_id: int, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> bool:
        rows = tuple(int(r) for r in cpu.block_ids)
        submitted = time.monotonic()
        with self._cond:
            closed = self._closed
            self._open.add(job_id)
        runs: list[Run] = []
        nbytes = 0
        error: Exception | None = None
        if closed:  # vLLM's own misuse: the job fails (logged with its result), nothing is copied
            error = RuntimeError("the kvactors worker is shut down")
        else:
            try:
                runs, nbytes = self._plan(direction, gpu, rows)
            except Exception as exc:  # a spec we cannot map: fail the job, never the engine
                self._log.error("transfer_plan_failed", job_id=job_id, kind=_KIND[direction], error=repr(exc))
                error = exc
        job = WorkerJob(job_id=job_id, direction=direction, runs=tuple(runs), nbytes=nbytes, blocks=len(rows),
                        deadline=submitted + self.transfer_timeout_s, timeout_s=self.transfer_timeout_s, rows=rows,
                        submitted=submitted)
        if error is None and self.fault_injector is not None:
            try:
                self.fault_injector(direction, job_id, rows)
            except Exception as exc:
                error = exc
        if error is not None:
            self._copied(job, error)
        elif not job.runs:  # nothing to copy (every group empty): done, whichever copier would run it
            self._copied(job, None)
        else:
            self._copier.submit(job)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        self._wait(job_ids)

    def _wait(self, job_ids: set[int]) -> bool:
        """Whether the jobs of ``job_ids`` ended within ``transfer_timeout_s``.

        Each job has that deadline from its submit, and its copier fails it there.
        So a job still open after the wait is one whose copy hangs inside a run.
        That is logged as ``transfer_wait_timed_out``.
        """
        deadline = time.monotonic() + self.transfer_timeout_s
        with self._cond:
            while True:
                left = [j for j in job_ids if j in self._open]
                if not left:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._log.error("transfer_wait_timed_out", jobs=len(left), timeout_s=self.transfer_timeout_s)
                    return False
                self._cond.wait(remaining)

    def shutdown(self) -> None:
        """Stop the worker once its jobs in flight ended; safe to call twice.

        It waits for the jobs in flight, ``transfer_timeout_s`` at most.
        Then it stops the copier, unregisters the pool from CUDA, and closes the pool if this worker owns it.
        A job still open after the wait may still write into the pool.
        The ``Copier`` protocol allows no shutdown then, so the copier and the pool are left to the process's exit.
        ``RuntimeError`` on one of the copier's threads, which would wait for itself (as ``TransferEngine.close``).
        """
        if self._copier.owns_current_thread():
            raise RuntimeError("KvactorsOffloadingWorker.shutdown() called from one of its copier's threads")
        with self._cond:
            if self._closed:
                return
            self._closed = True
            open_jobs = set(self._open)
        WORKERS.discard(self)
        if not self._wait(open_jobs):
            return
        try:
            self._copier.shutdown()
        finally:
            try:
                if self._registration is not None:
                    self._registration.release()
            finally:
                if self._owns_shared:
                    self.shared.close(unlink=True)

    # ------------------------------------------------------------ completions

    def _copied(self, job: WorkerJob, error: BaseException | None) -> None:
        """A job ended (the copier's :data:`~kvactors.transfer.jobs.JobDone`): the status bytes first,
        then the result vLLM polls. On a copier thread, or vLLM's for a job that never reached
        the copier; never raises."""
        try:
            if job.direction == OFFLOAD:
                self.shared.mark(job.rows, self.rank, STORE_OK if error is None else STORE_FAILED)
        except Exception as exc:  # the pool closed under the job: it failed
            error = error or exc
        if error is not None:
            self._log.warning("transfer_failed", job_id=job.job_id, kind=_KIND[job.direction], error=repr(error))
        result = TransferResult(job.job_id, True, job.nbytes, time.monotonic() - job.submitted)
        with self._cond:
            if error is not None:
                if job.direction == OFFLOAD:
                    self.store_failures += 1
                else:
                    self.load_failures += 1
            elif job.direction == OFFLOAD:
                self.bytes_stored += job.nbytes
            else:
                self.bytes_loaded += job.nbytes
            self._open.discard(job.job_id)
            self._finished.append(result)
            self._cond.notify_all()
