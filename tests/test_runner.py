"""The shared job runner of the secondary tiers (kvactors/tiers/runner.py)."""

from __future__ import annotations

import queue
import threading

import pytest
import structlog

from kvactors.tiers.runner import JobRunner, Outcome, RunningJob
from kvactors.types import JobResult, OffloadingEvent, ReqContext, TransferJob

WAIT = 10.0
CTX = ReqContext("r", 0)


def job(job_id: int, n: int, promotion: bool = False) -> TransferJob:
    return TransferJob(job_id, tuple(b"k%d" % i for i in range(n)), tuple(range(n)), CTX, promotion)


def runner(workers: int = 2, **kwargs: object) -> tuple[JobRunner, queue.Queue[JobResult]]:
    reports: queue.Queue[JobResult] = queue.Queue()
    r = JobRunner(name="t", workers=workers, thread_name="kvactors-test-t", report=reports.put,
                  log=structlog.get_logger("test"), **kwargs)  # type: ignore[arg-type]
    return r, reports


def test_chunks_merge_into_one_report_naming_the_keys_that_succeeded() -> None:
    r, reports = runner()
    seen: list[tuple[int, int]] = []
    released: list[tuple[int, int]] = []

    def work(running: RunningJob, lo: int, hi: int) -> Outcome:
        seen.append((lo, hi))
        return Outcome({i: "boom" for i in range(lo, hi) if i == 3})

    assert r.submit(job(1, 8), work, chunks=3, release=lambda lo, hi: released.append((lo, hi)))
    got = reports.get(timeout=WAIT)
    keys = job(1, 8).keys
    assert got == JobResult(1, False, "1 of 8 blocks failed: boom", successful_keys=keys[:3] + keys[4:])
    assert sorted(seen) == sorted(released) == [(0, 2), (2, 5), (5, 8)]
    r.shutdown(WAIT)
    assert reports.empty()


def test_settle_runs_once_after_every_chunk_and_may_fail_keys_or_the_job() -> None:
    r, reports = runner()
    ended: list[tuple[int, int]] = []
    settled: list[list[tuple[int, int]]] = []

    def work(running: RunningJob, lo: int, hi: int) -> Outcome:
        ended.append((lo, hi))
        return Outcome()

    def settle(failed: dict[int, str]) -> None:
        settled.append(sorted(ended))
        failed[0] = "evicted by another chunk"

    assert r.submit(job(1, 4), work, chunks=2, settle=settle)
    keys = job(1, 4).keys
    assert reports.get(timeout=WAIT) == JobResult(1, False, "1 of 4 blocks failed: evicted by another chunk",
                                                  successful_keys=keys[1:])
    assert settled == [[(0, 2), (2, 4)]]  # once, after both chunks

    def broken(failed: dict[int, str]) -> None:
        raise RuntimeError("planted")

    assert r.submit(job(2, 2), work, chunks=2, settle=broken)
    assert reports.get(timeout=WAIT) == JobResult(2, False, "settling the job failed: RuntimeError: planted")
    r.shutdown(WAIT)
    assert reports.empty()


def test_a_raising_one_chunk_job_fails_whole_and_on_error_sees_it() -> None:
    errors: list[BaseException] = []
    r, reports = runner(on_error=errors.append)

    def work(running: RunningJob, lo: int, hi: int) -> Outcome:
        raise ConnectionError("down")

    assert r.submit(job(2, 3), work)
    assert reports.get(timeout=WAIT) == JobResult(2, False, "ConnectionError: down")
    assert [type(e) for e in errors] == [ConnectionError]
    r.shutdown(WAIT)


def test_commit_and_events_only_when_reported_and_a_failed_commit_fails_the_job() -> None:
    recorded: list[OffloadingEvent] = []
    r, reports = runner(emit=recorded.extend)
    event = OffloadingEvent((b"k0",), "t", False)

    def bad_commit() -> None:
        raise RuntimeError("no")

    assert r.submit(job(3, 1), lambda running, lo, hi: Outcome(events=[event], commit=lambda: None))
    assert reports.get(timeout=WAIT) == JobResult(3, True)
    assert r.submit(job(4, 1, promotion=True), lambda running, lo, hi: Outcome(events=[event], commit=bad_commit))
    assert reports.get(timeout=WAIT) == JobResult(4, False, "copy into pool failed: RuntimeError('no')")
    assert recorded == [event]  # a promotion whose copy failed stored nothing
    r.shutdown(WAIT)


def test_shutdown_abandons_a_running_job_once_and_drops_its_late_outcome() -> None:
    r, reports = runner(workers=1)
    entered, release = threading.Event(), threading.Event()
    committed: list[int] = []

    def blocked(running: RunningJob, lo: int, hi: int) -> Outcome:
        entered.set()
        assert release.wait(WAIT)
        return Outcome(commit=lambda: committed.append(1))

    assert r.submit(job(5, 2), blocked)
    assert r.submit(job(6, 2), blocked)  # queued behind it
    assert entered.wait(WAIT)
    closer = threading.Thread(target=r.shutdown, args=(0.05,), kwargs={"abandon": "gone", "interrupt": release.set})
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive()
    got = sorted([reports.get(timeout=WAIT), reports.get(timeout=WAIT)], key=lambda res: res.job_id)
    assert got == [JobResult(5, False, "gone"), JobResult(6, False, "gone")]
    assert committed == [] and reports.empty()
    assert not r.submit(job(7, 1), blocked)  # refused once shut down
    r.shutdown(WAIT)  # idempotent


def test_shutdown_without_abandon_cancels_queued_chunks_and_lets_running_ones_finish() -> None:
    r, reports = runner(workers=1)
    entered, release = threading.Event(), threading.Event()

    def work(running: RunningJob, lo: int, hi: int) -> Outcome:
        entered.set()
        assert release.wait(WAIT)
        return Outcome()

    assert r.submit(job(8, 1), work)
    for i in range(9, 14):
        assert r.submit(job(i, 1), work)
    assert entered.wait(WAIT)
    closer = threading.Thread(target=r.shutdown, args=(0.0,))
    closer.start()
    cancelled = [reports.get(timeout=WAIT) for _ in range(5)]
    release.set()
    closer.join(WAIT)
    assert reports.get(timeout=WAIT) == JobResult(8, True)
    assert sorted(c.job_id for c in cancelled) == list(range(9, 14))
    assert all(not c.success and "shut down" in (c.error or "") for c in cancelled)
    assert reports.empty()


@pytest.mark.timeout(30)
def test_drain_waits_for_spawned_tasks() -> None:
    r, _ = runner()
    gate, done = threading.Event(), threading.Event()

    def task() -> None:
        assert gate.wait(WAIT)
        done.set()

    assert r.spawn(task)
    r.drain(0.01)
    assert not done.is_set()
    gate.set()
    r.drain(WAIT)
    assert done.is_set()
    r.shutdown(WAIT)
