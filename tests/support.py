"""Test tiers and helpers shared by the test modules."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvactors import JobResult, LookupResult, MemoryTier, OffloadKey, ReqContext, TieringManager, TransferJob


def keys(*names: str | int) -> list[OffloadKey]:
    return [f"key-{name}".encode() for name in names]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (a condition wait, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def settled(manager: TieringManager, timeout: float = 10.0) -> dict[str, int | float]:
    """``wait_idle`` then ``stats``; fails the test if the runtime does not settle."""
    assert manager.wait_idle(timeout), "the runtime did not settle"
    return manager.stats()


class RecordingTier(MemoryTier):
    """A MemoryTier that records every call and checks the tier-side contract.

    ``violations`` lists every breach seen: a submit for a request attempt after
    its ``on_request_finished``, a second finish, or a second start while the
    attempt is open. An identity finished and started again begins a new
    lifetime (the runtime forgets an attempt once it is finalized). Thread-safe.
    """

    def __init__(self, *, name: str = "rec", capacity_blocks: int = 1 << 20) -> None:
        super().__init__(name=name, capacity_blocks=capacity_blocks)
        self.calls: list[tuple[str, tuple[str, int] | None, int | None]] = []
        self.finished: dict[tuple[str, int], int] = {}  # finishes per identity, over all its lifetimes
        self.started: set[tuple[str, int]] = set()
        self.closed: set[tuple[str, int]] = set()  # finished in their current lifetime
        self.violations: list[str] = []
        self._record_lock = threading.Lock()

    def _record(self, call: str, ctx: ReqContext | None, job_id: int | None = None) -> None:
        with self._record_lock:
            identity = ctx.identity if ctx is not None else None
            self.calls.append((call, identity, job_id))
            if identity is None:
                return
            if call == "on_new_request":
                # An identity may be used again once finalized: a new lifetime starts.
                if identity in self.started and identity not in self.closed:
                    self.violations.append(f"{identity} started twice")
                self.started.add(identity)
                self.closed.discard(identity)
            elif call == "on_request_finished":
                if identity in self.closed:
                    self.violations.append(f"second finish of {identity}")
                self.closed.add(identity)
                self.finished[identity] = self.finished.get(identity, 0) + 1
            elif call in ("submit_store", "submit_load") and identity in self.closed:
                self.violations.append(f"{call} job {job_id} for {identity} after its finish")

    def count(self, call: str, ctx: ReqContext | None = None) -> int:
        with self._record_lock:
            return sum(1 for c, ident, _ in self.calls if c == call and (ctx is None or ident == ctx.identity))

    def calls_of(self, ctx: ReqContext) -> list[str]:
        """The calls this tier received for ``ctx``, in order."""
        with self._record_lock:
            return [call for call, identity, _ in self.calls if identity == ctx.identity]

    def on_new_request(self, ctx: ReqContext) -> None:
        self._record("on_new_request", ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._record("on_request_finished", ctx)

    def submit_store(self, job: TransferJob) -> None:
        self._record("submit_store", job.req_context, job.job_id)
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self._record("submit_load", job.req_context, job.job_id)
        super().submit_load(job)


class ControlledTier(RecordingTier):
    """A RecordingTier whose jobs the test completes by hand.

    With ``hold=True`` every submitted job waits in ``held`` until
    :meth:`release`; ``raise_on`` makes the named methods raise; ``lookup_gate``
    (an Event) blocks ``lookup`` until it is set.
    """

    inline_calls = frozenset()  # its lookup may wait on lookup_gate: never on the supervisor's thread

    def __init__(self, *, name: str = "ctl", capacity_blocks: int = 1 << 20, hold: bool = True,
                 max_inflight: int | None = None, raise_on: Sequence[str] = ()) -> None:
        super().__init__(name=name, capacity_blocks=capacity_blocks)
        self.hold = hold
        self.raise_on = set(raise_on)
        self.held: dict[int, TransferJob] = {}
        self.submitted = threading.Condition()
        self.lookup_gate: threading.Event | None = None
        if max_inflight is not None:
            self.max_inflight_jobs = max_inflight  # type: ignore[misc]

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        if "lookup" in self.raise_on:
            raise RuntimeError("planted lookup failure")
        if self.lookup_gate is not None:
            self.lookup_gate.wait(30)
        return super().lookup(keys, ctx)

    def _submit(self, job: TransferJob, run: Callable[[TransferJob], None], call: str) -> None:
        if call in self.raise_on:
            self._record(call, job.req_context, job.job_id)
            raise RuntimeError(f"planted {call} failure")
        if not self.hold:
            run(job)
            return
        self._record(call, job.req_context, job.job_id)
        with self.submitted:
            self.held[job.job_id] = job
            self.submitted.notify_all()

    def submit_store(self, job: TransferJob) -> None:
        self._submit(job, super().submit_store, "submit_store")

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, super().submit_load, "submit_load")

    def wait_held(self, count: int, timeout: float = 10.0) -> list[TransferJob]:
        with self.submitted:
            assert self.submitted.wait_for(lambda: len(self.held) >= count, timeout), (
                f"expected {count} held jobs, have {len(self.held)}"
            )
            return list(self.held.values())

    def release(self, job_id: int, success: bool = True) -> None:
        """Complete a held job from the calling thread (as an I/O worker would)."""
        with self.submitted:
            job = self.held.pop(job_id)
        if not success:
            self.report(JobResult(job_id, False, "planted failure"))
            return
        # Run the real copy, then report, exactly as MemoryTier does inline.
        MemoryTier.submit_load(self, job) if job.is_promotion else MemoryTier.submit_store(self, job)

    def release_all(self, success: bool = True) -> None:
        with self.submitted:
            ids = list(self.held)
        for job_id in ids:
            self.release(job_id, success)


class FlakyTier(RecordingTier):
    """A RecordingTier that reports from its own worker threads and fails some jobs.

    ``fail_rate`` of the jobs fail (seeded), ``raise_rate`` raise inside
    ``submit_*``. Reports come from a bounded pool of ``workers`` threads, so
    completions race with everything else, as real I/O does.
    """

    def __init__(self, *, name: str = "flaky", seed: int = 0, fail_rate: float = 0.1, raise_rate: float = 0.02,
                 workers: int = 2, capacity_blocks: int = 1 << 20) -> None:
        import random
        from concurrent.futures import ThreadPoolExecutor

        super().__init__(name=name, capacity_blocks=capacity_blocks)
        self._rng = random.Random(seed)
        self.fail_rate = fail_rate
        self.raise_rate = raise_rate
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"flaky-{name}")

    def _roll(self) -> float:
        with self._record_lock:
            return self._rng.random()

    def _async(self, job: TransferJob, run: Callable[[TransferJob], None]) -> None:
        if self._roll() < self.raise_rate:
            raise RuntimeError("planted submit failure")
        if self._roll() < self.fail_rate:
            self._executor.submit(self.report, JobResult(job.job_id, False, "planted failure"))
        else:
            self._executor.submit(run, job)

    def submit_store(self, job: TransferJob) -> None:
        self._record("submit_store", job.req_context, job.job_id)
        self._async(job, lambda j: MemoryTier.submit_store(self, j))

    def submit_load(self, job: TransferJob) -> None:
        self._record("submit_load", job.req_context, job.job_id)
        self._async(job, lambda j: MemoryTier.submit_load(self, j))

    def drain(self, timeout: float | None) -> None:
        self._executor.shutdown(wait=True)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def within(bound_s: float, call: Callable[[], Any], what: str) -> tuple[Any, float]:
    """Run ``call`` on a helper thread; fail unless it answers within ``bound_s``. Returns (result, seconds)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=run, name=f"test-{what}", daemon=True)
    thread.start()
    thread.join(bound_s)
    took = time.monotonic() - started
    if thread.is_alive():
        pytest.fail(f"{what} did not answer within {bound_s:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("result"), took
