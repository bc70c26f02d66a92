"""The CUDA copier: one copy stream per direction, events, one poller thread.

Issue (on the calling thread, so that "the caller's current stream" means
something): under the direction's issue lock, the copy stream waits on the
caller's current stream (work the caller already queued on the device rows
comes first), the job's coalesced runs are queued on the copy stream with
``non_blocking=True`` slice copies, and an event is recorded after them. The
job then goes to the back of the direction's queue; the issue lock keeps that
queue in the stream's order. Launching is asynchronous: the caller's thread
never waits for the copy.

Completion (on the poller thread): the poller looks at the oldest job of each
direction and completes it once its event has passed (``Event.query`` with a
short backoff; the hot path has no ``torch.cuda.synchronize``), so jobs are
completed in submission order per direction.

The fault injector runs at issue time, on the issuing thread, just before the
copies are queued; if it raises, no copy is queued for the job and the job
fails when it reaches the head of its queue. A deadline is checked when the
event has passed: a copy on a stream cannot be abandoned halfway, so a late
copy fails only once its rows are quiet.

The pool should be pinned (``TieringManager`` allocates it pinned when CUDA is
available); a pageable pool still works, with copies that block the issuing
thread.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque

import torch

from kvactors.transfer.jobs import OFFLOAD, ONBOARD, CopyJob, Direction, FaultInjector, JobDone

_copier_ids = itertools.count()

_BACKOFF_MIN_S = 20e-6
_BACKOFF_MAX_S = 1e-3

_Entry = tuple[CopyJob, "torch.cuda.Event | None", BaseException | None]


class CudaCopier:
    """Copies between a CUDA ``device_cache`` and the (pinned) host ``pool``."""

    def __init__(
        self,
        *,
        device_cache: torch.Tensor,
        pool: torch.Tensor,
        done: JobDone,
        fault_injector: FaultInjector | None,
    ) -> None:
        self._device = device_cache.device
        self._tensors: dict[Direction, tuple[torch.Tensor, torch.Tensor]] = {
            OFFLOAD: (device_cache, pool),
            ONBOARD: (pool, device_cache),
        }
        self._streams: dict[Direction, torch.cuda.Stream] = {
            OFFLOAD: torch.cuda.Stream(device=self._device),
            ONBOARD: torch.cuda.Stream(device=self._device),
        }
        self._issue_locks: dict[Direction, threading.Lock] = {OFFLOAD: threading.Lock(), ONBOARD: threading.Lock()}
        self._pending: dict[Direction, deque[_Entry]] = {OFFLOAD: deque(), ONBOARD: deque()}
        self._cond = threading.Condition()
        self._stopping = False
        self._done = done
        self._inject = fault_injector
        self._poller = threading.Thread(target=self._poll, name=f"kvactors-cuda-poller-{next(_copier_ids)}",
                                        daemon=True)
        self._poller.start()

    # ------------------------------------------------------------ issue (caller's thread)

    def submit(self, job: CopyJob) -> None:
        direction = job.direction
        stream = self._streams[direction]
        src, dst = self._tensors[direction]
        with self._issue_locks[direction]:
            error: BaseException | None = None
            event: torch.cuda.Event | None = None
            try:
                if self._inject is not None:
                    self._inject(direction, job.ctx, job.keys)
                stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(stream):
                    for s, d, n in job.runs:
                        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            except Exception as exc:
                error = exc
            try:
                # Always: the event covers whatever was queued, even after an error.
                event = torch.cuda.Event()
                event.record(stream)
            except Exception as exc:
                error = error or exc
                event = None
                # Error path only: make sure nothing queued still runs (the job fails anyway).
                with contextlib.suppress(Exception):
                    stream.synchronize()
            with self._cond:
                self._pending[direction].append((job, event, error))
                self._cond.notify()

    # ------------------------------------------------------------ completion (poller thread)

    def _complete_ready(self, direction: Direction) -> bool:
        pending = self._pending[direction]
        progressed = False
        while pending:
            job, event, error = pending[0]
            if event is not None:
                try:
                    if not event.query():
                        break
                except Exception as exc:  # a failed copy surfaces here
                    error = error or exc
            pending.popleft()  # only this thread pops; appends happen under the condition
            if error is None:
                try:
                    job.check_deadline()
                except Exception as exc:
                    error = exc
            self._done(job, error)
            progressed = True
        return progressed

    def _poll(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            progressed = self._complete_ready(OFFLOAD)
            progressed = self._complete_ready(ONBOARD) or progressed
            if progressed:
                backoff = _BACKOFF_MIN_S
                continue
            with self._cond:
                if not self._pending[OFFLOAD] and not self._pending[ONBOARD]:
                    if self._stopping:
                        return
                    self._cond.wait()
                    backoff = _BACKOFF_MIN_S
                    continue
            time.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # ------------------------------------------------------------ lifecycle

    def owns_current_thread(self) -> bool:
        return threading.current_thread() is self._poller

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is not self._poller:
            self._poller.join()
