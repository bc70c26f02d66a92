"""``TransferEngine``: moves KV bytes between the server's device cache and the pool.

The engine drives a :class:`~kvactors.TieringManager`: the manager decides
where the bytes go (``prepare_store`` / ``prepare_load``), the engine moves
them off the caller's thread, and posts the completion back to the actors
(``complete_store`` / ``complete_load``). See :class:`TransferEngine`.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.arguments import check_int, check_request, check_timeout
from kvactors.core.errors import ManagerStoppedError, TransferError
from kvactors.logs import component_logger
from kvactors.transfer.choice import COPIERS as COPIERS  # re-exported: the scripts import it from here
from kvactors.transfer.choice import check_copier, host_copier, native_threads
from kvactors.transfer.cpu import CpuCopier
from kvactors.transfer.jobs import OFFLOAD, ONBOARD, Copier, Direction, FaultInjector, JobFault, RequestCopy
from kvactors.transfer.native import NativeCopier, supports
from kvactors.transfer.runs import copy_runs
from kvactors.types import OffloadKey, ReqContext

if TYPE_CHECKING:
    from kvactors.manager import TieringManager

_engine_ids = itertools.count()

MAX_COPY_WORKERS = 64


def _resolved(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    future.set_result(value)
    return future


def _job_fault(fault_injector: FaultInjector | None) -> JobFault[RequestCopy] | None:
    """The copiers' hook for the engine's ``fault_injector``: called with the job, it calls
    ``fault_injector(direction, ctx, keys)``."""
    if fault_injector is None:
        return None
    inject = fault_injector

    def on_job(job: RequestCopy) -> None:
        inject(job.direction, job.ctx, job.keys)

    return on_job


class TransferEngine:
    """Copies KV blocks between a device cache and a manager's primary pool.

    ``device_cache`` is the server's KV cache as ``uint8`` rows
    ``(num_device_blocks, block_bytes)``, on a CUDA device or on the CPU;
    ``block_bytes`` must equal the pool's (else ``ValueError``). The engine
    never copies the device cache: it reads and writes its rows in place.

    Copies run off the caller's thread:

    * CPU device cache, ``copier="auto"`` (the default) or ``"native"``: the
      native copier (:mod:`kvactors.transfer.native`, built at install where a C
      compiler is present), :func:`native_threads` (``copy_workers`` x
      ``min(torch.get_num_threads(), 8)``, at most 64) native threads that take
      the jobs from one FIFO queue and copy them in pieces without the GIL, and
      one completer thread that posts each finished job's completion and
      resolves its future (so no copy waits on the manager).
      ``"auto"`` takes the torch copier where a ``fault_injector`` is given.
      It falls back to the torch copier where the native one is not built or
      the device cache is not contiguous, and logs ``native_copier_unavailable``.
      ``"native"`` raises ``ValueError`` in each of these cases instead.
      The choice is :func:`~kvactors.transfer.choice.host_copier`'s.
    * CPU device cache, ``copier="torch"``: ``copy_workers`` copy threads (a
      fixed, small pool; never a thread per request) copying with torch's
      ``copy_`` (on its intra-op threads), the same FIFO queue and completer.
      One worker is the default: a second mostly competes with the first for the
      same cores (``docs/performance.md``).
    * CUDA device cache: one copy stream per direction, copies launched with
      ``non_blocking=True`` behind the caller's current stream, one event per
      job, and one poller thread that completes the jobs in submission order
      per direction. The pool must be pinned for the copies to be asynchronous
      (the manager pins it when CUDA is available).

    Each request's rows are coalesced into runs of consecutive rows on both
    sides (:func:`~kvactors.transfer.runs.copy_runs`), each run one slice copy.

    Threading: any number of threads may call :meth:`offload`, :meth:`onboard`
    and :meth:`close` at once. The manager's submit call (``prepare_store`` /
    ``prepare_load``) runs on the caller's thread, so its errors are raised to
    the caller at once; the copy and the completion run on the engine's
    threads. A returned future is never cancellable (it is already running);
    its callbacks run on an engine thread, so they must be short and must not
    call :meth:`close`; one that raises (even ``SystemExit``) is logged, not
    fatal to the engine.

    Lifetime: call :meth:`close` (or use the engine as a context manager). Its
    threads hold it, so an engine dropped without it is never collected. After
    ``os.fork`` the child has none of the engine's threads: there its calls
    raise :class:`~kvactors.ManagerStoppedError` and :meth:`close` returns at
    once (the jobs in flight at the fork are the parent's).

    Failures: a copy that raises, or runs past ``copy_timeout_s``, fails its
    request only. The rows are released (a store completed with
    ``success=False``, a load unpinned) once nothing touches them any more, and
    the future raises :class:`~kvactors.TransferError` with the cause chained.
    Nothing stays pending or pinned. If the manager was stopped before a
    completion could be posted, the future raises ``TransferError`` too.

    ``copy_timeout_s``: deadline of each copy, counted from its submission
    (default ``None``: only the manager's ``transfer_timeout_s`` applies, which
    detaches a store not completed in time). A copy in progress is never
    abandoned halfway on a stream or between rows it is writing: a late job
    fails when it stops touching its rows (on the CPU, between two runs, or
    two pieces of the native copier).

    ``fault_injector``: a **testing hook**, ``(direction, ctx, keys) -> None``
    with ``direction`` ``"offload"`` or ``"onboard"``, called just before a
    job's copy (on the copy thread on the CPU, on the issuing thread on CUDA);
    if it raises, that copy fails as a real copy failure would. Not for
    production use.
    """

    def __init__(
        self,
        manager: TieringManager,
        device_cache: torch.Tensor,
        *,
        copy_workers: int = 1,
        copy_timeout_s: float | None = None,
        fault_injector: FaultInjector | None = None,
        copier: str = "auto",
    ) -> None:
        from kvactors.manager import TieringManager  # here: the manager's module need not import the engine's

        if not isinstance(manager, TieringManager):
            raise ValueError(f"manager must be a TieringManager, got {type(manager).__name__}")
        pool = manager.pool
        if not isinstance(device_cache, torch.Tensor):
            raise ValueError(f"device_cache must be a torch.Tensor, got {type(device_cache).__name__}")
        if device_cache.dtype != torch.uint8 or device_cache.dim() != 2:
            raise ValueError(f"device_cache must be uint8 rows (num_device_blocks, block_bytes), got "
                             f"{device_cache.dtype} of shape {tuple(device_cache.shape)}")
        if device_cache.shape[1] != pool.shape[1]:
            raise ValueError(f"device_cache rows have {device_cache.shape[1]} bytes, the pool's have {pool.shape[1]}")
        if device_cache.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device_cache must be on the CPU or a CUDA device, not {device_cache.device}")
        check_int(copy_workers, "copy_workers", maximum=MAX_COPY_WORKERS)
        check_timeout(copy_timeout_s, "copy_timeout_s", allow_zero=False)
        if fault_injector is not None and not callable(fault_injector):
            raise ValueError("fault_injector must be callable or None")
        check_copier(copier)
        if copier == "native" and device_cache.is_cuda:
            raise ValueError("copier='native' copies between host tensors; this device cache is on CUDA")

        self._manager = manager
        self._device_cache = device_cache
        self._num_device_blocks = int(device_cache.shape[0])
        self._block_bytes = int(pool.shape[1])
        self._copy_timeout_s = None if copy_timeout_s is None else float(copy_timeout_s)
        engine_id = next(_engine_ids)
        self._log = component_logger("transfer", engine=engine_id)
        self._job_ids = itertools.count(1)
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._closed = False
        self._in_flight = 0
        self._shut = threading.Event()
        self._copier: Copier[RequestCopy]
        if device_cache.is_cuda:
            from kvactors.transfer.cuda import CudaCopier

            if not pool.is_pinned():
                self._log.warning("pool_not_pinned", detail="host copies will block the issuing thread")
            self._copier = CudaCopier(device_cache=device_cache, pool=pool, done=self._job_done,
                                      fault_injector=_job_fault(fault_injector))
        else:
            self._copier = self._cpu_copier(copier, pool, copy_workers, fault_injector)

    # ------------------------------------------------------------ the API

    @property
    def device_cache(self) -> torch.Tensor:
        """The device cache this engine copies from and to."""
        return self._device_cache

    @property
    def copier(self) -> str:
        """Which copier moves the bytes: ``"native"``, ``"torch"`` or ``"cuda"``."""
        if isinstance(self._copier, NativeCopier):
            return "native"
        return "torch" if isinstance(self._copier, CpuCopier) else "cuda"

    def offload(
        self, ctx: ReqContext, keys: Sequence[OffloadKey], device_block_ids: Sequence[int]
    ) -> Future[list[OffloadKey]]:
        """Store the device rows ``device_block_ids`` under ``keys`` in the pool.

        On the caller's thread: checks the arguments (``ValueError`` if the two
        sequences differ in length or an id is out of range) and calls
        ``manager.prepare_store(keys, ctx)``, whose ``LifecycleError`` or
        ``ValueError`` is raised here, at once. Then the rows of the keys to
        store are copied off-thread and ``complete_store`` is posted.

        The future resolves to the keys newly stored (``keys_to_store``, in
        their order) once ``complete_store`` is queued: any thread that has seen
        it resolve, and then calls ``lookup``, finds them ready (the manager
        processes its calls in the order they were queued). It resolves to
        ``[]`` at once, copying nothing, when every key is present already, and
        also when the pool has no room (``prepare_store`` returned ``None``).
        A failed copy completes the store with ``success=False`` and the
        future raises :class:`~kvactors.TransferError`.

        The caller must not overwrite the device rows until the future has
        resolved (on CUDA the copy is asynchronous; the resolution marks its
        end). ``ManagerStoppedError`` after :meth:`close`.
        """
        keys_t, ids = self._check_args(ctx, keys, device_block_ids, unique_ids=False)
        self._begin()
        handed_off = False
        try:
            if not keys_t:
                return _resolved([])
            out = self._manager.prepare_store(keys_t, ctx)
            if out is None or not out.keys_to_store:
                return _resolved([])
            if len(out.keys_to_store) == len(keys_t) and tuple(out.keys_to_store) == keys_t:
                src = ids  # every key is new, in the order given (the common case)
            else:
                row_of: dict[OffloadKey, int] = {}
                for key, row in zip(keys_t, ids, strict=True):
                    row_of.setdefault(key, row)
                src = [row_of[key] for key in out.keys_to_store]
            job = self._make_job(OFFLOAD, ctx, tuple(out.keys_to_store), src, out.store_spec.block_ids)
            handed_off = True
            self._copier.submit(job)
            return job.future
        finally:
            if not handed_off:
                self._end()

    def onboard(self, ctx: ReqContext, keys: Sequence[OffloadKey], device_block_ids: Sequence[int]) -> Future[None]:
        """Load the ready blocks ``keys`` into the device rows ``device_block_ids``.

        On the caller's thread: checks the arguments (``ValueError`` if the two
        sequences differ in length, an id is out of range, or a device row is
        named twice) and calls ``manager.prepare_load(keys, ctx)``, which pins
        the blocks and raises ``LifecycleError`` here, at once, if a key is not
        ready (nothing pinned then). Then the pool rows are copied into the
        device rows off-thread and ``complete_load`` is posted, always, also
        after a failed copy.

        The future resolves to ``None`` once the device rows hold the bytes and
        ``complete_load`` is queued; after a failed copy it raises
        :class:`~kvactors.TransferError` (the device rows' content is then
        undefined). ``ManagerStoppedError`` after :meth:`close`.
        """
        keys_t, ids = self._check_args(ctx, keys, device_block_ids, unique_ids=True)
        self._begin()
        handed_off = False
        try:
            if not keys_t:
                return _resolved(None)
            spec = self._manager.prepare_load(keys_t, ctx)
            job = self._make_job(ONBOARD, ctx, keys_t, spec.block_ids, ids)
            handed_off = True
            self._copier.submit(job)
            return job.future
        finally:
            if not handed_off:
                self._end()

    def close(self) -> None:
        """Refuse new work, wait for every copy in flight to complete, stop the threads.

        Safe to call twice and from several threads (every call returns once
        the engine is shut). Later :meth:`offload` / :meth:`onboard` calls raise
        :class:`~kvactors.ManagerStoppedError`. The manager is not stopped.
        Must not be called from an engine thread (a future's callback):
        ``RuntimeError``.
        """
        if self._copier.owns_current_thread():
            raise RuntimeError("TransferEngine.close() called from one of its own threads (a future callback?)")
        with self._cond:
            first = not self._closed
            self._closed = True
            if os.getpid() != self._pid:
                return  # a forked child: the jobs in flight and the threads are the parent's, never ours
            if first:
                while self._in_flight:
                    self._cond.wait()
        if not first:
            self._shut.wait()
            return
        try:
            self._copier.shutdown()
        finally:
            self._shut.set()
            self._log.debug("engine_closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"TransferEngine({self.copier}, device_blocks={self._num_device_blocks}, {state})"

    # ------------------------------------------------------------ internals

    def _cpu_copier(self, copier: str, pool: torch.Tensor, copy_workers: int,
                    fault_injector: FaultInjector | None) -> Copier[RequestCopy]:
        """The copier :func:`~kvactors.transfer.choice.host_copier` chooses for a device cache on the CPU.

        A fault injector runs on the torch copier's threads only.
        So with one, ``"auto"`` means the torch copier, and ``"native"`` is refused.
        """
        device_cache = self._device_cache
        if fault_injector is not None and copier == "auto":
            copier = "torch"
        blocked = ("a fault injector runs on the torch copier's threads" if fault_injector is not None
                   else "the device cache is not contiguous" if not supports(device_cache, pool) else None)
        _, chosen = host_copier(
            copier, blocked=blocked, log=self._log,
            native=lambda: NativeCopier(device_cache=device_cache, pool=pool, threads=native_threads(copy_workers),
                                        done=self._job_done),
            torch_copier=lambda: CpuCopier(device_cache=device_cache, pool=pool, workers=copy_workers,
                                           done=self._job_done, fault_injector=_job_fault(fault_injector)))
        return chosen

    def _check_args(
        self, ctx: object, keys: Iterable[OffloadKey], device_block_ids: Iterable[int], *, unique_ids: bool
    ) -> tuple[tuple[OffloadKey, ...], list[int]]:
        """Every argument, before anything is asked of the manager (also when there is nothing to copy)."""
        keys_t, _ = check_request(keys, ctx)
        if isinstance(device_block_ids, bytes | bytearray | str):
            raise ValueError("device_block_ids must be a sequence of ints")
        if type(device_block_ids) is list or type(device_block_ids) is tuple:
            # Fast path (every request pays for it): plain ints in range, checked at C speed.
            # Anything else (bools, numpy ints, a bad id) takes the full checks below.
            ids = list(device_block_ids)
            if (len(ids) == len(keys_t) and all(type(i) is int for i in ids)
                    and (not ids or (min(ids) >= 0 and max(ids) < self._num_device_blocks))
                    and (not unique_ids or len(set(ids)) == len(ids))):
                return keys_t, ids
        try:
            raw = list(device_block_ids)
            ids = [operator.index(i) for i in raw]
        except TypeError as exc:
            raise ValueError(f"device_block_ids must be ints: {exc}") from None
        if any(isinstance(i, bool) for i in raw):
            raise ValueError("device_block_ids must be ints, not bools")
        if len(keys_t) != len(ids):
            raise ValueError(f"{len(keys_t)} keys but {len(ids)} device_block_ids")
        for i in ids:
            if not 0 <= i < self._num_device_blocks:
                raise ValueError(f"device block id {i} out of range [0, {self._num_device_blocks})")
        if unique_ids and len(set(ids)) != len(ids):
            raise ValueError("a device block id is given twice")
        return keys_t, ids

    def _begin(self) -> None:
        with self._cond:
            if self._closed:
                raise ManagerStoppedError("the TransferEngine is closed")
            if os.getpid() != self._pid:
                raise ManagerStoppedError("this TransferEngine was inherited through os.fork: its threads are "
                                          "the parent's (make a new TieringManager and engine in the child)")
            self._in_flight += 1

    def _end(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if not self._in_flight:
                self._cond.notify_all()

    def _make_job(
        self, direction: Direction, ctx: ReqContext, keys: tuple[OffloadKey, ...],
        src_ids: Sequence[int], dst_ids: Sequence[int],
    ) -> RequestCopy:
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()  # not cancellable: the manager holds rows for it
        timeout = self._copy_timeout_s
        return RequestCopy(
            job_id=next(self._job_ids),
            direction=direction,
            ctx=ctx,
            keys=keys,
            runs=tuple(copy_runs(src_ids, dst_ids)),
            nbytes=len(keys) * self._block_bytes,
            blocks=len(keys),
            future=future,
            deadline=None if timeout is None else time.monotonic() + timeout,
            timeout_s=timeout,
        )

    def _job_done(self, job: RequestCopy, error: BaseException | None) -> None:
        """Post the completion, then resolve the future.

        Runs on an engine thread and never raises.
        """
        try:
            try:
                failure = self._post_completion(job, error)
            except Exception as exc:  # the engine's own failure: the future raises it
                self._log_completion_failed(job, exc)
                failure = TransferError(f"internal error completing a {job.direction}: {exc}")
            self._resolve(job, failure)
        finally:
            self._end()

    def _post_completion(self, job: RequestCopy, error: BaseException | None) -> TransferError | None:
        """Post ``complete_store`` or ``complete_load``, and return what the future must raise, if anything."""
        if error is not None:
            self._log.warning(
                "copy_failed", direction=job.direction, req_id=job.ctx.req_id, attempt=job.ctx.attempt,
                keys=len(job.keys), job_id=job.job_id, error=f"{type(error).__name__}: {error}",
            )
        completion_error: Exception | None = None
        try:
            if job.direction == OFFLOAD:
                self._manager.complete_store(job.keys, job.ctx, success=error is None)
            else:
                self._manager.complete_load(job.keys, job.ctx)
        except Exception as exc:  # ManagerStoppedError: the manager was stopped first
            completion_error = exc
            self._log_completion_failed(job, exc)
        failure = None
        if error is not None:
            failure = TransferError(f"{job.direction} of {len(job.keys)} blocks for request {job.ctx} failed: "
                                    f"{type(error).__name__}: {error}")
            failure.__cause__ = error
        elif completion_error is not None:
            failure = TransferError(f"{job.direction} of {len(job.keys)} blocks for request {job.ctx}: the "
                                    f"completion could not be posted: {completion_error}")
            failure.__cause__ = completion_error
        return failure

    def _resolve(self, job: RequestCopy, failure: TransferError | None) -> None:
        """Resolve the job's future, which runs its callbacks on this thread.

        A callback is foreign code.
        Under the failure policy of :mod:`kvactors.actors.runtime`, anything it raises is its own failure.
        ``concurrent.futures`` logs a callback's ``Exception``.
        This logs the rest (``SystemExit``, say) as ``completion_failed``, and the engine thread goes on.
        """
        try:
            if failure is not None:
                job.future.set_exception(failure)
            else:
                job.future.set_result(list(job.keys) if job.direction == OFFLOAD else None)
        except BaseException as exc:  # a callback's: foreign code, contained here (the policy above)
            self._log_completion_failed(job, exc)

    def _log_completion_failed(self, job: RequestCopy, exc: BaseException) -> None:
        self._log.warning("completion_failed", direction=job.direction, req_id=job.ctx.req_id,
                          attempt=job.ctx.attempt, keys=len(job.keys), job_id=job.job_id,
                          error=f"{type(exc).__name__}: {exc}")
