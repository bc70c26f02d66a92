"""The CPU copier: a small, fixed pool of copy threads fed by one FIFO queue.

Used when the device cache lives in host memory. Each worker takes the oldest
job, calls the fault injector, copies the job's coalesced runs with slice
``copy_`` calls (torch releases the GIL while copying, so copies overlap with
the frontend's Python work and with each other), and reports the job. Jobs
start in submission order; with several workers they may end out of order.

A copy in progress is never abandoned: with a deadline, a job not started by
its deadline fails without copying, one that passes it fails between two runs
(after the rows written so far) or right after its last run. Either way the
job is reported only once nothing touches its rows any more, so the rows are
released (``complete_store``/``complete_load``) only when they are quiet.
"""

from __future__ import annotations

import itertools
import queue
import threading

import torch

from kvactors.transfer.jobs import CopyJob, Direction, FaultInjector, JobDone

_copier_ids = itertools.count()


class CpuCopier:
    """``workers`` threads copying between ``device_cache`` and ``pool`` (both on the CPU)."""

    def __init__(
        self,
        *,
        device_cache: torch.Tensor,
        pool: torch.Tensor,
        workers: int,
        done: JobDone,
        fault_injector: FaultInjector | None,
    ) -> None:
        self._tensors: dict[Direction, tuple[torch.Tensor, torch.Tensor]] = {
            "offload": (device_cache, pool),
            "onboard": (pool, device_cache),
        }
        self._done = done
        self._inject = fault_injector
        self._queue: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        copier_id = next(_copier_ids)
        self._threads = [
            threading.Thread(target=self._work, name=f"kvactors-copy-{copier_id}.{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: CopyJob) -> None:
        self._queue.put(job)

    def owns_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()

    def _copy(self, job: CopyJob) -> None:
        job.check_deadline()
        if self._inject is not None:
            self._inject(job.direction, job.ctx, job.keys)
        src, dst = self._tensors[job.direction]
        timed = job.deadline is not None
        for s, d, n in job.runs:
            dst[d : d + n].copy_(src[s : s + n])
            if timed:
                job.check_deadline()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                self._copy(job)
            except Exception as exc:
                error = exc
            self._done(job, error)

