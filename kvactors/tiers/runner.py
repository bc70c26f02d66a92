"""``JobRunner``: the I/O workers of a secondary tier and the reporting of its jobs.

A tier hands each ``TransferJob`` to the runner with a *work* function.
The runner splits the job's keys into contiguous chunks.
It runs each chunk's work on one of its worker threads.
It merges what the chunks say into one ``JobResult``, with the keys that succeeded in ``successful_keys``.
It reports that result through the tier's ``report`` exactly once.
:class:`~kvactors.tiers.disk.DiskTier` and :class:`~kvactors.tiers.redis.RedisTier` use it.
A tier of your own may too.

Threading: ``submit``, ``fail``, ``spawn``, ``drain`` and ``shutdown`` may be called from any thread.
A tier calls them from its actor's thread, or from the thread an inline call runs on.
Work functions, and the ``release`` and ``emit`` callbacks, run on the worker threads.
For a chunk cancelled by ``shutdown`` they run on the thread that shuts the runner down.
A job is reported from the thread that ends its last chunk, or from the caller of ``fail``/``shutdown``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvactors.tiers.base import ReportFn
from kvactors.types import JobResult, OffloadingEvent, TransferJob

if TYPE_CHECKING:
    from kvactors.logs import EventLogger


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one chunk of a job did.

    ``failed``
        The positions in ``job.keys`` (within the chunk) that failed, and why.
    ``error``
        The report's error when a key failed.
        The default is ``"N of M blocks failed: <first reason>"``.
    ``events``
        Recorded only if the job is reported by this run, not abandoned by ``shutdown``.
    ``commit``
        Runs under the job's lock just before the job is reported, only if it has not been reported yet.
        A load's copy into the pool goes here, so that the rows are never touched after a report.
        If it raises, the whole job fails.
    """

    failed: Mapping[int, str] = field(default_factory=dict)
    error: str | None = None
    events: Sequence[OffloadingEvent] = ()
    commit: Callable[[], None] | None = None


class RunningJob:
    """A job between submission and report.

    ``lock`` guards ``reported``.
    For the tier, it also guards every access to the job's pool rows.
    Hold it and check ``reported`` first, and the rows are never touched after the job was reported.
    """

    __slots__ = ("error", "events", "failed", "fatal", "job", "lock", "remaining", "reported", "settle")

    def __init__(self, job: TransferJob, chunks: int,
                 settle: Callable[[dict[int, str]], None] | None = None) -> None:
        self.job = job
        self.settle = settle
        self.lock = threading.Lock()
        self.reported = False
        self.remaining = chunks
        self.failed: dict[int, str] = {}
        self.events: list[OffloadingEvent] = []
        self.error: str | None = None  # the first chunk's own message
        self.fatal: str | None = None  # fails every key: a one-chunk job's work raised, or a commit failed

    def result(self) -> JobResult:
        """The report of a job whose chunks all ended."""
        job = self.job
        if self.fatal is not None:
            return JobResult(job.job_id, False, self.fatal)
        if not self.failed:
            return JobResult(job.job_id, True)
        keys = job.keys
        bad = {keys[i] for i in self.failed}
        ok = tuple(key for key in dict.fromkeys(keys) if key not in bad)
        error = self.error or f"{len(bad)} of {len(set(keys))} blocks failed: {self.failed[min(self.failed)]}"
        return JobResult(job.job_id, False, error, successful_keys=ok)


Work = Callable[[RunningJob, int, int], Outcome]
"""Does keys ``lo:hi`` of a running job on a worker thread; what it raises fails those keys."""


def describe(exc: BaseException) -> str:
    """``"Type: message"`` (or the type alone) for a report or a log."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class JobRunner:
    """``workers`` threads named ``<thread_name>-N`` running the jobs of one tier.

    ``report`` is the tier's report function.
    ``log`` gets ``job_failed`` (and ``report_failed``) events.
    ``emit(events)`` records the events of the chunks of a job when it is reported.
    ``on_error(exc)`` sees every exception a work function raised, before the job's keys fail with it.
    A tier classifies it there, e.g. to back off.
    """

    def __init__(
        self,
        *,
        name: str,
        workers: int,
        thread_name: str,
        report: ReportFn,
        log: EventLogger,
        emit: Callable[[Sequence[OffloadingEvent]], None] | None = None,
        on_error: Callable[[BaseException], object] | None = None,
    ) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.name = name
        self._report = report
        self._log = log
        self._emit = emit
        self._on_error = on_error
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: set[RunningJob] = set()  # submitted, not reported
        self._busy = 0  # chunks and tasks submitted to the executor and not ended
        self._closed = False
        thread_ids = itertools.count()

        def name_thread() -> None:
            threading.current_thread().name = f"{thread_name}-{next(thread_ids)}"

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=thread_name, initializer=name_thread
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` began. New jobs are then refused."""
        return self._closed

    # ------------------------------------------------------------ submitting

    def submit(self, job: TransferJob, work: Work, *, chunks: int = 1,
               release: Callable[[int, int], None] | None = None,
               settle: Callable[[dict[int, str]], None] | None = None) -> bool:
        """Run ``job`` as ``chunks`` contiguous chunks of its keys (1 to ``len(job.keys)``).

        ``release(lo, hi)`` runs once per chunk when it ends (ran or cancelled), before the report.
        ``settle(failed)`` runs once, after the last chunk ended and before the report,
        unless the whole job failed.
        It runs under the job's lock, on the worker that ran the last chunk.
        It may add failed positions to ``failed``, for what one chunk cannot see alone
        (e.g. a key another chunk evicted).
        If it raises, the job fails.
        Returns ``False``, having done nothing, once the runner is shut down.
        The caller then reports the job, e.g. with :meth:`fail`.
        """
        n = len(job.keys)
        chunks = max(1, min(chunks, n))
        running = RunningJob(job, chunks, settle)
        with self._lock:
            if self._closed:
                return False
            self._jobs.add(running)
        bounds = [(n * i) // chunks for i in range(chunks + 1)]
        for lo, hi in itertools.pairwise(bounds):
            with self._lock:
                self._busy += 1
            try:
                fut = self._executor.submit(self._run_chunk, running, work, lo, hi, release)
            except RuntimeError as exc:  # the executor shut down under us
                self._cancel(running, lo, hi, release, f"tier {self.name!r} is shut down: {exc}")
                self._task_ended()
                continue
            fut.add_done_callback(self._when_cancelled(running, lo, hi, release))
        return True

    def spawn(self, task: Callable[[], None]) -> bool:
        """Run ``task`` on a worker. :meth:`drain` waits for it.

        ``task`` is best effort work that reports nothing.
        Returns ``False`` if it was not accepted because the runner is shut down.
        """
        with self._lock:
            if self._closed:
                return False
            self._busy += 1
        try:
            fut = self._executor.submit(self._run_task, task)
        except RuntimeError:
            self._task_ended()
            return False
        fut.add_done_callback(lambda f: self._task_ended() if f.cancelled() else None)
        return True

    def fail(self, job: TransferJob, error: str) -> None:
        """Report a job that never reached the workers as failed."""
        self._finish(job, JobResult(job.job_id, False, error))

    def finish(self, result: JobResult, job: TransferJob) -> None:
        """Report a job that needs no work (e.g. one without keys) with ``result``."""
        self._finish(job, result)

    # ------------------------------------------------------------ waiting, stopping

    def drain(self, timeout: float | None) -> None:
        """Return once every chunk and task submitted has ended, or after ``timeout`` seconds."""
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout)

    def shutdown(self, timeout: float | None, *, abandon: str | None = None,
                 interrupt: Callable[[], None] | None = None) -> None:
        """Refuse new jobs, drain for up to ``timeout`` seconds, then stop the workers.

        Queued chunks are cancelled, and their keys fail, from this thread.
        With ``abandon``, jobs still running are reported failed with that error at once.
        Their work's results are dropped.
        A tier that passes ``abandon`` must guard its rows with :attr:`RunningJob.lock`.
        Without ``abandon``, jobs still running finish and are reported.
        ``interrupt()`` runs before joining the workers, e.g. to close sockets they block on.
        When this returns, no worker runs and every job has been reported.
        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drain(timeout)
        if abandon is not None:
            with self._lock:
                leftover = list(self._jobs)
            for running in leftover:
                with running.lock:
                    if running.reported:
                        continue
                    running.reported = True
                self._finish(running.job, JobResult(running.job.job_id, False, abandon), running)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if interrupt is not None:
            try:
                interrupt()
            except Exception as exc:  # best effort: the join below still ends once the work returns
                self._log.warning("interrupt_failed", error=describe(exc))
        self._executor.shutdown(wait=True)
        with self._idle:
            self._busy = 0
            self._idle.notify_all()

    # ------------------------------------------------------------ workers

    def _run_chunk(self, running: RunningJob, work: Work, lo: int, hi: int,
                   release: Callable[[int, int], None] | None) -> None:
        try:
            outcome: Outcome | None = None
            raised: BaseException | None = None
            try:
                if not running.reported:
                    outcome = work(running, lo, hi)
            except BaseException as exc:
                raised = exc
                if self._on_error is not None:
                    self._on_error(exc)
            if raised is not None:
                why = describe(raised)
                self._chunk_done(running, lo, hi, release, Outcome(dict.fromkeys(range(lo, hi), why)), why)
                if not isinstance(raised, Exception):
                    raise raised
            else:
                self._chunk_done(running, lo, hi, release, outcome or Outcome())
        finally:
            self._task_ended()

    def _run_task(self, task: Callable[[], None]) -> None:
        try:
            task()
        finally:
            self._task_ended()

    def _when_cancelled(
        self, running: RunningJob, lo: int, hi: int, release: Callable[[int, int], None] | None
    ) -> Callable[[concurrent.futures.Future[None]], None]:
        def callback(fut: concurrent.futures.Future[None]) -> None:
            # A cancelled chunk never ran, so _run_chunk will not end it.
            if fut.cancelled():
                try:
                    self._cancel(running, lo, hi, release, f"cancelled: tier {self.name!r} shut down")
                finally:
                    self._task_ended()

        return callback

    def _cancel(self, running: RunningJob, lo: int, hi: int,
                release: Callable[[int, int], None] | None, error: str) -> None:
        self._chunk_done(running, lo, hi, release, Outcome(dict.fromkeys(range(lo, hi), error)))

    def _task_ended(self) -> None:
        with self._idle:
            self._busy -= 1
            if self._busy <= 0:
                self._busy = 0
                self._idle.notify_all()

    # ------------------------------------------------------------ reporting

    def _chunk_done(self, running: RunningJob, lo: int, hi: int, release: Callable[[int, int], None] | None,
                    outcome: Outcome, raised: str | None = None) -> None:
        try:
            if release is not None:
                release(lo, hi)
        finally:
            self._merge(running, lo, hi, outcome, raised)

    def _merge(self, running: RunningJob, lo: int, hi: int, outcome: Outcome, raised: str | None) -> None:
        """Add a chunk's outcome to its job. The last chunk reports it."""
        with running.lock:
            if running.reported:
                return
            running.failed.update(outcome.failed)
            running.events.extend(outcome.events)
            running.error = running.error or outcome.error
            if raised is not None and lo == 0 and hi == len(running.job.keys):
                running.fatal = running.fatal or raised
            if outcome.commit is not None:
                self._commit(running, outcome.commit)
            running.remaining -= 1
            if running.remaining > 0:
                return
            if running.settle is not None and running.fatal is None:
                try:
                    running.settle(running.failed)
                except Exception as exc:
                    running.fatal = f"settling the job failed: {describe(exc)}"
            running.reported = True
            result = running.result()
        if running.events and self._emit is not None:
            self._emit(running.events)
        self._finish(running.job, result, running)

    def _commit(self, running: RunningJob, commit: Callable[[], None]) -> None:
        """Run a chunk's commit. The caller holds ``running.lock``.

        A failure fails the job.
        """
        try:
            commit()
        except Exception as exc:
            running.fatal = f"copy into pool failed: {exc!r}"
            if running.job.is_promotion:  # nothing was loaded: only removals happened
                running.events = [e for e in running.events if e.removed]

    def _finish(self, job: TransferJob, result: JobResult, running: RunningJob | None = None) -> None:
        try:
            if not result.success:
                failed = len(job.keys) - len(result.successful_keys or ())
                self._log.warning("job_failed", job_id=job.job_id, kind="load" if job.is_promotion else "store",
                                  req_id=job.req_context.req_id, keys=len(job.keys), failed_keys=failed,
                                  error=result.error)
            try:
                self._report(result)
            except Exception as exc:
                self._log.warning("report_failed", job_id=job.job_id, error=describe(exc))
        finally:
            if running is not None:
                with self._lock:
                    self._jobs.discard(running)
