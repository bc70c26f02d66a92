"""The CPU copier: a small, fixed pool of copy threads fed by one FIFO queue.

Used when the device cache lives in host memory. Each worker takes the oldest
job, calls the fault injector, copies the job's coalesced runs with slice
``copy_`` calls (torch releases the GIL while copying, so copies overlap with
the frontend's Python work and with each other), and hands the job to one
completer thread, which reports it (the engine then posts the completion to
the manager and resolves the future). The workers never do that control work
themselves: the next copy starts while the last one is being completed.
Jobs start in submission order; with several workers they may end out of order;
the completer reports them in the order their copies ended. The copier's
layout (:mod:`kvactors.transfer.layouts`) turns runs into copies: slice copies
of whole rows for the engine, a ``_foreach_copy_`` of pages for the vLLM worker.

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
from typing import Generic

import torch

from kvactors.transfer.jobs import Direction, J, JobDone, JobFault
from kvactors.transfer.layouts import Layout, resolve

_copier_ids = itertools.count()

# A worker takes the queued jobs behind the one it waited for, up to these bounds. The
# bytes bound is small on purpose: past a few MiB a merged copy runs no faster, and jobs
# left in the queue let the copy thread go straight on to its next batch while the
# completer and the caller do the control work of the jobs around it (taking the whole
# queue at once made copies and control take turns: docs/performance.md).
_MAX_BATCH_JOBS = 32
_MAX_BATCH_BYTES = 16 << 20


class CpuCopier(Generic[J]):
    """``workers`` threads copying between ``device_cache`` and ``pool`` (both on the CPU), or
    in a ``layout`` (:mod:`kvactors.transfer.layouts`) instead of those two."""

    def __init__(
        self,
        *,
        device_cache: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
        workers: int,
        done: JobDone[J],
        fault_injector: JobFault[J] | None,
        layout: Layout | None = None,
    ) -> None:
        self._layout = resolve(device_cache, pool, layout)
        self._done = done
        self._inject = fault_injector
        self._queue: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[J, BaseException | None] | None] = queue.SimpleQueue()
        copier_id = next(_copier_ids)
        self._workers = [
            threading.Thread(target=self._work, name=f"kvactors-copy-{copier_id}.{i}", daemon=True)
            for i in range(workers)
        ]
        self._completer = threading.Thread(target=self._complete, name=f"kvactors-copy-{copier_id}.done",
                                           daemon=True)
        self._threads = [*self._workers, self._completer]
        for thread in self._threads:
            thread.start()

    def submit(self, job: J) -> None:
        self._queue.put(job)

    def owns_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def shutdown(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        current = threading.current_thread()
        for thread in self._workers:
            if thread is not current:
                thread.join()
        # Every worker has stopped: nothing more reaches the completer after this.
        self._finished.put(None)
        if self._completer is not current:
            self._completer.join()

    def _complete(self) -> None:
        """The completer thread: reports finished jobs, in the order their copies ended."""
        while True:
            item = self._finished.get()
            if item is None:
                return
            self._done(*item)

    def _copy_alone(self, job: J) -> None:
        """One job with a deadline: checked before the copy and between its runs."""
        job.check_deadline()
        if self._inject is not None:
            self._inject(job)
        self._layout.check(job.direction, job.runs)  # as a whole: it is copied a run at a time
        for run in job.runs:
            self._layout.copy(job.direction, (run,))
            job.check_deadline()

    def _copy_batch(self, direction: Direction, jobs: list[J]) -> list[tuple[J, BaseException | None]]:
        """Jobs without a deadline, copied together: runs that continue each other across jobs merge.
        Each job is checked on its own first: one the layout refuses fails alone."""
        outcome: list[tuple[J, BaseException | None]] = []
        runs: list[list[int]] = []
        for job in jobs:
            try:
                if self._inject is not None:
                    self._inject(job)
                self._layout.check(direction, job.runs)
            except Exception as exc:
                outcome.append((job, exc))
                continue
            outcome.append((job, None))
            for s, d, n in job.runs:
                if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                    runs[-1][2] += n
                else:
                    runs.append([s, d, n])
        try:
            self._layout.copy(direction, [(s, d, n) for s, d, n in runs])
        except ValueError:
            # Every job passed alone, so two of them name the same place (the caller's contract,
            # not the job's): copied one after another instead, in queue order, as they came.
            return [(job, error if error is not None else self._copy_checked(direction, job))
                    for job, error in outcome]
        except Exception as exc:  # which job's rows failed is unknown: fail them all
            return [(job, error or exc) for job, error in outcome]
        return outcome

    def _copy_checked(self, direction: Direction, job: J) -> BaseException | None:
        try:
            self._layout.copy(direction, job.runs)
        except Exception as exc:
            return exc
        return None

    def _take_batch(self, first: J) -> tuple[list[J], bool]:
        """``first`` and the jobs queued behind it (up to a bound); whether a stop sentinel was taken."""
        batch = [first]
        nbytes = first.nbytes
        while len(batch) < _MAX_BATCH_JOBS and nbytes < _MAX_BATCH_BYTES:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return batch, True
            batch.append(job)
            nbytes += job.nbytes
        return batch, False

    def _work(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = self._take_batch(first)
            # In queue order; consecutive jobs without a deadline, of one direction, copy together.
            i = 0
            while i < len(batch):
                job = batch[i]
                if job.deadline is not None:
                    error: BaseException | None = None
                    try:
                        self._copy_alone(job)
                    except Exception as exc:
                        error = exc
                    self._finished.put((job, error))
                    i += 1
                    continue
                j = i + 1
                while j < len(batch) and batch[j].deadline is None and batch[j].direction == job.direction:
                    j += 1
                for outcome in self._copy_batch(job.direction, batch[i:j]):
                    self._finished.put(outcome)
                i = j
