"""The CUDA copier: one copy stream per direction, events, one poller thread.

Issue (on the calling thread, so that "the caller's current stream" means
something): under the direction's issue lock, the copy stream waits on the
caller's current stream (work the caller already queued on the device rows
comes first), the job's coalesced runs are queued on the copy stream with
``non_blocking=True`` copies (slice copies of the copier's layout,
:mod:`kvactors.transfer.layouts`), and an event is recorded after them. The
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
available; memory CUDA did not allocate, such as the vLLM worker's shared pool,
is registered with :class:`HostRegistration`); a pageable pool still works,
with copies that block the issuing thread.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from typing import Generic

import torch

from kvactors.logs import component_logger
from kvactors.transfer.jobs import OFFLOAD, ONBOARD, Direction, J, JobDone, JobFault
from kvactors.transfer.layouts import Layout, resolve

_copier_ids = itertools.count()

_BACKOFF_MIN_S = 20e-6
_BACKOFF_MAX_S = 1e-3

_Entry = tuple[J, "torch.cuda.Event | None", BaseException | None]


class CudaCopier(Generic[J]):
    """Copies between a CUDA ``device_cache`` and the (pinned) host ``pool``, or in a
    ``layout`` (:mod:`kvactors.transfer.layouts`) instead of those two, on ``device``."""

    def __init__(
        self,
        *,
        device_cache: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
        done: JobDone[J],
        fault_injector: JobFault[J] | None,
        layout: Layout | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._layout = resolve(device_cache, pool, layout)
        if device is None:
            if device_cache is None:
                raise ValueError("a CudaCopier with a layout needs its device")
            device = device_cache.device
        self._device = device
        self._streams: dict[Direction, torch.cuda.Stream] = {
            OFFLOAD: torch.cuda.Stream(device=self._device),
            ONBOARD: torch.cuda.Stream(device=self._device),
        }
        self._issue_locks: dict[Direction, threading.Lock] = {OFFLOAD: threading.Lock(), ONBOARD: threading.Lock()}
        self._pending: dict[Direction, deque[_Entry[J]]] = {OFFLOAD: deque(), ONBOARD: deque()}
        self._cond = threading.Condition()
        self._stopping = False
        self._done = done
        self._inject = fault_injector
        self._poller = threading.Thread(target=self._poll, name=f"kvactors-cuda-poller-{next(_copier_ids)}",
                                        daemon=True)
        self._poller.start()

    # ------------------------------------------------------------ issue (caller's thread)

    def submit(self, job: J) -> None:
        direction = job.direction
        stream = self._streams[direction]
        with self._issue_locks[direction]:
            error: BaseException | None = None
            event: torch.cuda.Event | None = None
            try:
                if self._inject is not None:
                    self._inject(job)
                stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(stream):
                    self._layout.copy(direction, job.runs, non_blocking=True)
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


class HostRegistration:
    """``tensor``'s host memory registered with CUDA (``cudaHostRegister``), so that copies
    between it and a device are asynchronous, until :meth:`release` (``cudaHostUnregister``).

    For memory CUDA did not allocate (a shared mapping): :meth:`release` must run before the
    memory is unmapped. A registration that fails is logged (``pool_not_pinned``) and leaves
    :attr:`registered` false: copies still work, blocking the issuing thread.

    Threading: :meth:`release` may be called from any thread, more than once; the first call
    unregisters.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._log = component_logger("transfer")
        self._ptr = tensor.data_ptr()
        self._lock = threading.Lock()
        nbytes = tensor.numel() * tensor.element_size()
        try:
            code = int(torch.cuda.cudart().cudaHostRegister(self._ptr, nbytes, 0))
        except Exception as exc:  # no CUDA runtime to ask
            code, detail = -1, f"{type(exc).__name__}: {exc}"
        else:
            detail = f"cudaError {code}"
        self.registered = code == 0
        if not self.registered:
            self._log.warning("pool_not_pinned", detail=f"cudaHostRegister of {nbytes} bytes failed ({detail}): "
                                                        "host copies will block the issuing thread")

    def release(self) -> None:
        """Unregister the memory (once; later calls do nothing). ``RuntimeError`` if CUDA refuses."""
        with self._lock:
            registered, self.registered = self.registered, False
        if registered:
            code = int(torch.cuda.cudart().cudaHostUnregister(self._ptr))
            if code != 0:
                raise RuntimeError(f"cudaHostUnregister failed: cudaError {code}")
