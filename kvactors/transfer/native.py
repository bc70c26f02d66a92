"""The native CPU copier: copy threads that never take the GIL, fed by one FIFO queue.

Used when the device cache lives in host memory and the optional extension
``kvactors.transfer._streamcopy`` was built (``pip install`` builds it where a C
compiler is present; see :func:`native_copy_available`). Its threads cut each
job's coalesced runs into pieces and claim them one at a time, so the copy of a
job spreads over every core that is free, and a core taken by the frontend's
Python holds back one piece, not half of every copy (torch's intra-op split is
static). Large pieces are written with non-temporal stores on x86-64
(``docs/performance.md`` has the figures). Finished jobs join a list in the
native copier, which one completer thread takes with a blocking call (the GIL
released) and reports (the engine then posts the completion and resolves the
future), in the order the copies ended. No file descriptor is used, and nothing
but the copier's mutex ever blocks a native thread: a slow completion delays
reports, never copies.

After ``os.fork`` the child has none of the parent's threads: an inherited
copier fails every job submitted there at once, on the submitting thread (the
engine itself refuses calls in a child first), and its ``shutdown`` returns
without touching the native state. So does a second ``shutdown``; a job
submitted after it fails on the submitting thread too.

Deadlines are checked by the native threads before each piece and once the last
piece is copied; a late job ends, like the torch copier's, only once nothing
touches its rows any more. There is no fault injector: the engine copies with
the torch copier (:mod:`kvactors.transfer.cpu`) when one is given.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import itertools
import math
import os
import threading
from functools import cache
from typing import Generic

import torch

from kvactors.logs import component_logger
from kvactors.transfer.jobs import CopyTimeoutError, J, JobDone
from kvactors.transfer.layouts import Layout, resolve

_copier_ids = itertools.count()

PIECE_BYTES = 2 << 20
"""What one native thread copies before it claims the next piece (measured: 1-4 MiB
were alike; smaller pieces cost more claims, larger ones balance worse)."""

MAX_THREADS = 64

_STATUS_OK = 0
_STATUS_DEADLINE = 1
_STATUS_NOT_QUEUED = 2  # posted by submit itself when the native side refused the job
_STATUS_MOVED = 3  # posted by submit itself: a tensor's storage moved since the copier started
_STATUS_FORKED = 4  # a copier inherited by a forked child
_STATUS_INVALID = 5  # posted by submit itself: the layout refused the job's runs (the error in _invalid)
_BATCH = 256  # finished jobs taken per wait


@cache
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("kvactors.transfer._streamcopy")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    lib.kvc_start.restype = ctypes.c_void_p
    lib.kvc_start.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    lib.kvc_streams.restype = ctypes.c_int
    lib.kvc_streams.argtypes = [ctypes.c_void_p]
    lib.kvc_submit.restype = ctypes.c_int
    lib.kvc_submit.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double]
    lib.kvc_wait.restype = ctypes.c_int
    lib.kvc_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    for name in ("kvc_wake", "kvc_stop", "kvc_free"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    return lib


def native_copy_available() -> bool:
    """Whether the native copy loop was built and loads (a C compiler at install time, on a POSIX system)."""
    return _library() is not None


def supports(device_cache: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the native copier can copy between these two tensors: both on the CPU and
    contiguous (a run of rows is then one range of bytes on each side)."""
    return (device_cache.device.type == "cpu" and pool.device.type == "cpu"
            and device_cache.is_contiguous() and pool.is_contiguous())


class NativeCopier(Generic[J]):
    """``threads`` native threads copying between ``device_cache`` and ``pool`` (both on the CPU,
    contiguous: :func:`supports`), or in a ``layout`` (:mod:`kvactors.transfer.layouts`) instead
    of those two, one whose :meth:`~kvactors.transfer.layouts.Layout.native` is true.
    ``RuntimeError`` if the library is missing or cannot start them, or the tensors do not suit."""

    def __init__(
        self,
        *,
        device_cache: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
        threads: int,
        done: JobDone[J],
        piece_bytes: int = PIECE_BYTES,
        stream: bool = True,
        layout: Layout | None = None,
    ) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the native copy loop (kvactors.transfer._streamcopy) is not built")
        self._map = resolve(device_cache, pool, layout)
        if not self._map.native():
            raise RuntimeError("the native copier needs CPU tensors whose rows are contiguous"
                               if layout is not None else "the native copier needs two contiguous CPU tensors")
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
        self._lib = lib
        # The tensors stay referenced here (the layout holds them): the native threads write
        # through their addresses.
        self._tensors = self._map.tensors
        self._layout = self._layout_of()
        self._done = done
        self._log = component_logger("transfer")
        self._jobs: dict[int, J] = {}
        self._ids = itertools.count(1)
        self._posted: collections.deque[tuple[int, int]] = collections.deque()  # jobs submit ended itself
        self._invalid: dict[J, BaseException] = {}  # why the layout refused a job's runs
        self._stopped = False
        self._pid = os.getpid()
        handle = lib.kvc_start(threads, piece_bytes, int(stream))
        if not handle:
            raise RuntimeError(f"the native copier could not start {threads} threads")
        self._handle: int = handle
        self.streams = bool(lib.kvc_streams(handle))
        self._completer = threading.Thread(target=self._complete, daemon=True,
                                           name=f"kvactors-copy-{next(_copier_ids)}.done")
        try:
            self._completer.start()
        except BaseException:
            lib.kvc_stop(handle)
            lib.kvc_free(handle)
            raise

    def _layout_of(self) -> tuple[tuple[int, torch.Size, bool], ...]:
        return tuple((t.data_ptr(), t.shape, t.is_contiguous()) for t in self._tensors)

    def submit(self, job: J) -> None:
        if self._stopped or os.getpid() != self._pid:
            # Not the engine's use (it never submits after shutdown, nor in a forked child): no
            # thread of ours is left to report the job, so it fails here.
            self._report(job, _STATUS_NOT_QUEUED if self._stopped else _STATUS_FORKED)
            return
        job_id = next(self._ids)
        self._jobs[job_id] = job
        if self._layout_of() != self._layout:
            # The caller resized or re-pointed a tensor (resize_, set_): the native threads would
            # write through stale addresses. The torch copier would slice the new storage instead.
            self._post(job_id, _STATUS_MOVED)
            return
        try:
            src_base, dst_base, runs = self._map.byte_runs(job.direction, job.runs)
        except Exception as exc:  # runs outside the layout: never handed to the native threads
            self._invalid[job] = exc
            self._post(job_id, _STATUS_INVALID)
            return
        deadline = math.nan if job.deadline is None else job.deadline
        if not runs or self._lib.kvc_submit(self._handle, job_id, src_base, dst_base, runs.buffer_info()[0],
                                            len(runs) // 3, deadline) != 0:
            # Reported by the completer like any other job: never from the submitting thread.
            self._post(job_id, _STATUS_NOT_QUEUED)

    def owns_current_thread(self) -> bool:
        # The native threads never run Python: only the completer can call back into the engine.
        return threading.current_thread() is self._completer

    def shutdown(self) -> None:
        if self._stopped or os.getpid() != self._pid:
            return  # twice; or a forked child, where the native threads are the parent's, not ours to touch
        self._stopped = True
        self._lib.kvc_stop(self._handle)  # joins the native threads; nothing is queued by now
        if threading.current_thread() is not self._completer:
            self._completer.join()  # its last wait returns once every finished job is reported

    def _post(self, job_id: int, status: int) -> None:
        """End a job here without queueing it; the completer reports it (kvc_wake allocates nothing)."""
        self._posted.append((job_id, status))
        self._lib.kvc_wake(self._handle)

    def _complete(self) -> None:
        """The completer thread: reports finished jobs, in the order the native threads ended them,
        then frees the native copier once ``shutdown`` has stopped it."""
        records = (ctypes.c_uint64 * (2 * _BATCH))()
        handle = self._handle
        while True:
            n = self._lib.kvc_wait(handle, records, _BATCH)
            for i in range(0, 2 * max(n, 0), 2):
                self._report_safely(records[i], records[i + 1])
            while self._posted:
                self._report_safely(*self._posted.popleft())
            if n < 0:
                break
        self._lib.kvc_free(handle)

    def _report_safely(self, job_id: int, status: int) -> None:
        try:
            self._report(self._jobs.pop(job_id), status)
        except Exception as exc:  # JobDone never raises: a job id we never gave (a bug); log it, report the others
            self._log.warning("report_failed", job_id=job_id, error=f"{type(exc).__name__}: {exc}")

    def _report(self, job: J, status: int) -> None:
        error: BaseException | None = None
        if status == _STATUS_DEADLINE:
            error = CopyTimeoutError(f"{job.direction} copy of {job.blocks} blocks exceeded "
                                     f"copy_timeout_s={job.timeout_s}")
        elif status == _STATUS_FORKED:
            error = RuntimeError("this TransferEngine was inherited through os.fork: its copy threads are the "
                                 "parent's (make a new engine in the child)")
        elif status == _STATUS_INVALID:
            error = self._invalid.pop(job, None) or RuntimeError("the layout refused the job's runs")
        elif status == _STATUS_MOVED:
            error = RuntimeError("the device cache or the pool was resized or re-pointed since the engine started "
                                 "(the engine copies between the tensors it was given, in place)")
        elif status != _STATUS_OK:
            error = RuntimeError(f"the native copier refused a {job.direction} of {job.blocks} blocks "
                                 "(out of memory, or no bytes to copy)")
        self._done(job, error)
