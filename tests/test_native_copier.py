"""The native CPU copier (``kvactors.transfer.native``), alone and under the engine.

Skipped where the extension is not built (no C compiler at install time)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors import LookupResult, ReqContext, TieringManager, TransferEngine
from kvactors.transfer.jobs import CopyJob, CopyTimeoutError, RequestCopy
from kvactors.transfer.native import NativeCopier, native_copy_available, supports
from kvactors.transfer.runs import Run, copy_runs

pytestmark = pytest.mark.skipif(not native_copy_available(), reason="the native copy loop is not built")

TIMEOUT = 10.0


class Reports:
    """The copier's ``done`` callback: every report, and a wait for a number of them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[CopyJob, BaseException | None, str]] = []

    def __call__(self, job: CopyJob, error: BaseException | None) -> None:
        with self.cond:
            self.items.append((job, error, threading.current_thread().name))
            self.cond.notify_all()

    def wait_for(self, n: int) -> list[tuple[CopyJob, BaseException | None, str]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, TIMEOUT), f"{len(self.items)} of {n} reported"
            return list(self.items)


def make_job(job_id: int, direction: str, runs: list[Run], row_bytes: int, deadline: float | None = None) -> CopyJob:
    return CopyJob(job_id=job_id, direction=direction, runs=tuple(runs), nbytes=sum(n for _, _, n in runs) * row_bytes,
                   blocks=max(1, len(runs)), deadline=deadline, timeout_s=None if deadline is None else 0.0)


@pytest.fixture
def reports() -> Reports:
    return Reports()


def copier_for(device: torch.Tensor, pool: torch.Tensor, done: Reports, **kwargs: Any) -> NativeCopier:
    return NativeCopier(device_cache=device, pool=pool, threads=kwargs.pop("threads", 2), done=done, **kwargs)


def hold_report(engine: TransferEngine, first_key: bytes, release: threading.Event) -> threading.Event:
    """Hold, on the completer, the report of the engine's job whose first key is ``first_key``
    until ``release`` is set (bounded by ``TIMEOUT``); the event returned is set once it is held.
    Either CPU copier: the native one reports through ``_report``, the torch one through ``_done``."""
    copier = engine._copier
    attribute = "_report" if isinstance(copier, NativeCopier) else "_done"
    report = getattr(copier, attribute)
    held = threading.Event()

    def held_report(job: RequestCopy, outcome: Any) -> None:
        if job.keys[0] == first_key:
            held.set()
            release.wait(TIMEOUT)
        report(job, outcome)

    setattr(copier, attribute, held_report)
    return held


@pytest.fixture
def pair() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield torch.randint(0, 256, (64, 1000), dtype=torch.uint8), torch.zeros((48, 1000), dtype=torch.uint8)


# ---------------------------------------------------------------- bytes


@settings(max_examples=40, deadline=None)
@given(
    row_bytes=st.integers(1, 3000),
    pairs=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 29)), min_size=1, max_size=24,
                   unique_by=lambda p: p[1]),
    piece=st.sampled_from([1, 7, 512, 4096, 1 << 20]),
    threads=st.integers(1, 4),
)
def test_runs_copy_exactly_what_torch_copies(row_bytes: int, pairs: list[tuple[int, int]], piece: int,
                                             threads: int) -> None:
    """Any rows, any row size (odd ones make every address unaligned), any piece size: the bytes
    the native threads write are those a row-by-row torch copy writes, and nothing else moves."""
    device = torch.randint(0, 256, (40, row_bytes), dtype=torch.uint8)
    pool = torch.randint(0, 256, (30, row_bytes), dtype=torch.uint8)
    expected = pool.clone()
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    expected[dst] = device[src]
    reports = Reports()
    copier = copier_for(device, pool, reports, threads=threads, piece_bytes=piece)
    try:
        copier.submit(make_job(1, "offload", copy_runs(src, dst), row_bytes))
        [(_, error, _)] = reports.wait_for(1)
    finally:
        copier.shutdown()
    assert error is None
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("stream", [True, False])
def test_large_unaligned_runs_stream_byte_exact(stream: bool, reports: Reports) -> None:
    """Rows of 300,001 bytes: runs of MiB at every alignment, through the streaming stores (and
    without them), both directions."""
    row = 300_001
    device = torch.randint(0, 256, (24, row), dtype=torch.uint8)
    pool = torch.zeros((24, row), dtype=torch.uint8)
    copier = copier_for(device, pool, reports, stream=stream, piece_bytes=1 << 20)
    try:
        copier.submit(make_job(1, "offload", [(0, 3, 7), (9, 12, 11), (20, 0, 1)], row))
        reports.wait_for(1)
        assert torch.equal(pool[3:10], device[0:7]) and torch.equal(pool[12:23], device[9:20])
        assert torch.equal(pool[0], device[20])
        back = device.clone()
        device.zero_()
        copier.submit(make_job(2, "onboard", [(3, 0, 7), (12, 9, 11), (0, 20, 1)], row))
        reports.wait_for(2)
        assert torch.equal(device[0:7], back[0:7]) and torch.equal(device[9:20], back[9:20])
        assert torch.equal(device[20], back[20])
        assert not device[7:9].any() and not device[21:].any()
    finally:
        copier.shutdown()


# ---------------------------------------------------------------- reports


def test_every_job_is_reported_once_from_the_completer(pair: tuple[torch.Tensor, torch.Tensor],
                                                       reports: Reports) -> None:
    """Six threads submitting 50 jobs each: 300 reports, one per job, all from the completer thread,
    none failed, and the bytes of each job in place."""
    device, pool = pair
    copier = copier_for(device, pool, reports, threads=3, piece_bytes=300)
    submitted: list[CopyJob] = []
    lock = threading.Lock()

    def submitter(t: int) -> None:
        for i in range(50):
            row = (t * 50 + i) % 48
            job = make_job(t * 1000 + i, "offload", [(row, row, 1)], 1000)
            with lock:
                submitted.append(job)
            copier.submit(job)

    try:
        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        items = reports.wait_for(300)
        assert not copier.owns_current_thread()
    finally:
        copier.shutdown()
    assert sorted(id(job) for job, _, _ in items) == sorted(id(job) for job in submitted)
    assert all(error is None for _, error, _ in items)
    assert {name for _, _, name in items} == {copier._completer.name}
    assert torch.equal(pool, device[:48])


def test_a_job_past_its_deadline_fails_without_copying(pair: tuple[torch.Tensor, torch.Tensor],
                                                       reports: Reports) -> None:
    device, pool = pair
    copier = copier_for(device, pool, reports)
    try:
        copier.submit(make_job(1, "offload", [(0, 0, 8)], 1000, deadline=time.monotonic() - 1))
        copier.submit(make_job(2, "offload", [(8, 8, 8)], 1000, deadline=time.monotonic() + 60))
        items = reports.wait_for(2)
    finally:
        copier.shutdown()
    errors = {job.job_id: error for job, error, _ in items}
    assert isinstance(errors[1], CopyTimeoutError)
    assert errors[2] is None
    assert not pool[0:8].any()
    assert torch.equal(pool[8:16], device[8:16])


def test_a_job_the_native_side_refuses_is_reported_failed(pair: tuple[torch.Tensor, torch.Tensor],
                                                          reports: Reports) -> None:
    """A job with no bytes to copy is refused by the native side: reported failed, from the completer."""
    device, pool = pair
    copier = copier_for(device, pool, reports)
    try:
        copier.submit(make_job(1, "offload", [], 1000))
        [(_, error, name)] = reports.wait_for(1)
    finally:
        copier.shutdown()
    assert isinstance(error, RuntimeError)
    assert name == copier._completer.name


def test_constructor_refuses_what_it_cannot_copy(reports: Reports) -> None:
    pool = torch.zeros((8, 64), dtype=torch.uint8)
    strided = torch.zeros((8, 128), dtype=torch.uint8)[:, :64]
    assert not supports(strided, pool)
    with pytest.raises(RuntimeError):
        copier_for(strided, pool, reports)
    for threads in (0, -1, 65):
        with pytest.raises(ValueError):
            copier_for(pool.clone(), pool, reports, threads=threads)


LEAKS = r"""
import os, time, torch
from kvactors.transfer.native import NativeCopier
device, pool = torch.randint(0, 256, (8, 1000), dtype=torch.uint8), torch.zeros((8, 1000), dtype=torch.uint8)
import sys; sys.path.insert(0, os.environ["TESTS"])
from test_native_copier import Reports, make_job
def count(what):
    return len(os.listdir(f"/proc/self/{what}"))
def settled(what, limit):
    # A joined thread may stay listed in /proc/self/task for a moment (measured: up to ~1 ms); one
    # that leaked stays for good. Wait, bounded, for the count to come down to the limit.
    deadline = time.monotonic() + 5.0
    while count(what) > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return count(what)
first = None
for i in range(21):
    reports = Reports()
    copier = NativeCopier(device_cache=device, pool=pool, threads=3, done=reports)
    copier.submit(make_job(1, "offload", [(0, 0, 4)], 1000))
    reports.wait_for(1)
    copier.shutdown()
    assert not copier._completer.is_alive()
    if first is None:
        first = count("fd"), count("task")  # after one round: torch's own threads exist by now
print("fds", first[0], settled("fd", first[0]), "tasks", first[1], settled("task", first[1]))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd and /proc/self/task")
def test_copiers_open_no_descriptor_and_leave_no_thread() -> None:
    """20 copiers started and shut down, in a process of its own (other tests' threads would be
    counted here): as many descriptors and threads after as after the first."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LEAKS], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TESTS": os.path.dirname(__file__)})
    words = out.stdout.split()
    assert len(words) == 6, (out.stdout, out.stderr[-2000:])
    # Not more after than after the first (a thread of the first round may still have been exiting
    # when counted; one that leaked from each round would be 20 more).
    assert int(words[2]) <= int(words[1]) and int(words[5]) <= int(words[4]), out.stdout


def test_a_slow_report_delays_no_copy(reports: Reports) -> None:
    """6,000 jobs while the first one's report is held up: every byte is copied meanwhile (the
    native threads never wait for the completer, however far behind it falls)."""
    n, row = 6000, 16
    device = torch.randint(1, 256, (n, row), dtype=torch.uint8)
    pool = torch.zeros((n, row), dtype=torch.uint8)
    release = threading.Event()

    def done(job: CopyJob, error: BaseException | None) -> None:
        if job.job_id == 1:
            release.wait(TIMEOUT)
        reports(job, error)

    copier = NativeCopier(device_cache=device, pool=pool, threads=2, done=done)
    try:
        for i in range(n):
            copier.submit(make_job(i + 1, "offload", [(i, i, 1)], row))
        deadline = time.monotonic() + TIMEOUT
        while int((pool[:, 0] != 0).sum()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert torch.equal(pool, device), "copies stopped while a report was held up"
        assert len(reports.items) < n  # job 1 is not reported yet (jobs that ended before it may be)
    finally:
        release.set()
    reports.wait_for(n)
    copier.shutdown()


fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@fork
def test_close_does_not_wait_for_a_forked_child() -> None:
    with TieringManager.start(num_blocks=16, block_bytes=64) as manager:
        engine = TransferEngine(manager, torch.zeros((16, 64), dtype=torch.uint8), copier="native")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child lives until the parent says so
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
        os.close(read_end)
        try:
            closer = threading.Thread(target=engine.close, daemon=True)
            closer.start()
            closer.join(TIMEOUT)
            assert not closer.is_alive(), "close() waited for the forked child"
        finally:
            os.close(write_end)
            os.waitpid(pid, 0)


CHILD = r"""
import os, sys, threading, torch
from kvactors import ManagerStoppedError, ReqContext, TieringManager, TransferEngine
copier = sys.argv[1]
release = threading.Event()
manager = TieringManager.start(num_blocks=16, block_bytes=64)
hold = (lambda *args: release.wait(10)) if copier == "torch" else None
engine = TransferEngine(manager, torch.zeros((16, 64), dtype=torch.uint8), copier=copier, fault_injector=hold)
if copier == "native":  # hold the job's report instead: the job stays in flight across the fork
    report = engine._copier._report
    engine._copier._report = lambda job, status: (release.wait(10), report(job, status))
ctx = ReqContext("parent")
manager.on_new_request(ctx)
in_flight = engine.offload(ctx, [b"held"], [0])
pid = os.fork()
if pid == 0:
    code = 3
    try:
        engine.offload(ctx, [b"child"], [1])
    except ManagerStoppedError as exc:
        code = 0 if "fork" in str(exc) else 4
    except BaseException:
        code = 5
    engine.close()  # returns at once: the job in flight is the parent's
    os._exit(code)
_, status = os.waitpid(pid, 0)
release.set()
assert in_flight.result(10) == [b"held"]  # the parent's engine is unharmed
assert engine.offload(ctx, [b"after"], [2]).result(10) == [b"after"]
engine.close()
manager.stop()
print("child", os.waitstatus_to_exitcode(status))
"""


@fork
@pytest.mark.parametrize("copier", ["native", "torch"])
def test_an_engine_inherited_through_fork_refuses_calls_and_closes_at_once(copier: str) -> None:
    """A job in flight at the fork: the child's calls raise ManagerStoppedError and its close()
    returns at once (before: it waited for the parent's job forever); the parent goes on."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHILD, copier], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "child 0", (out.stdout, out.stderr[-2000:])


def test_a_second_shutdown_and_a_late_submit_are_harmless(pair: tuple[torch.Tensor, torch.Tensor],
                                                          reports: Reports) -> None:
    device, pool = pair
    copier = copier_for(device, pool, reports)
    copier.shutdown()
    copier.shutdown()
    copier.submit(make_job(1, "offload", [(0, 0, 1)], 1000))
    [(_, error, _)] = reports.wait_for(1)
    assert isinstance(error, RuntimeError)
    assert not pool.any()


@pytest.mark.parametrize("deadline", [-1.0, 0.0, 1e-9])
def test_a_deadline_of_zero_or_less_is_past_not_none(pair: tuple[torch.Tensor, torch.Tensor], reports: Reports,
                                                     deadline: float) -> None:
    device, pool = pair
    copier = copier_for(device, pool, reports)
    try:
        copier.submit(make_job(1, "offload", [(0, 0, 1)], 1000, deadline=deadline))
        [(_, error, _)] = reports.wait_for(1)
    finally:
        copier.shutdown()
    assert isinstance(error, CopyTimeoutError)
    assert not pool.any()


@pytest.mark.parametrize("copier", ["native", "torch"])
@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, ValueError])
def test_a_future_callback_that_raises_does_not_stop_the_engine(copier: str, raised: type[BaseException]) -> None:
    device = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    with TieringManager.start(num_blocks=16, block_bytes=64) as manager, \
            TransferEngine(manager, device, copier=copier) as engine:
        ctx = ReqContext("raising-callback")
        manager.on_new_request(ctx)
        called, release = threading.Event(), threading.Event()

        def callback(_future: object) -> None:
            called.set()
            raise raised("from a callback")

        # Hold the first job's report on the completer, so that the callback is added before the
        # future resolves and runs there (not on this thread).
        hold_report(engine, b"a", release)
        first = engine.offload(ctx, [b"a"], [0])
        first.add_done_callback(callback)
        release.set()
        assert called.wait(TIMEOUT)
        assert first.result(TIMEOUT) == [b"a"]
        assert engine.offload(ctx, [b"b"], [1]).result(TIMEOUT) == [b"b"]
        manager.on_request_finished(ctx)


# ---------------------------------------------------------------- under the engine


def test_engine_picks_and_refuses_copiers() -> None:
    with TieringManager.start(num_blocks=16, block_bytes=64) as manager:
        device = torch.zeros((8, 64), dtype=torch.uint8)
        for copier, expected in (("auto", "native"), ("native", "native"), ("torch", "torch")):
            with TransferEngine(manager, device, copier=copier) as engine:
                assert engine.copier == expected
        with TransferEngine(manager, device, fault_injector=lambda *a: None) as engine:
            assert engine.copier == "torch"  # the hook runs on the torch copier's threads
        strided = torch.zeros((8, 128), dtype=torch.uint8)[:, :64]
        with TransferEngine(manager, strided) as engine:
            assert engine.copier == "torch"
        for bad in ("Native", "", None, 1, ["native"]):
            with pytest.raises(ValueError, match="copier"):
                TransferEngine(manager, device, copier=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="fault injector"):
            TransferEngine(manager, device, copier="native", fault_injector=lambda *a: None)
        with pytest.raises(ValueError, match="contiguous"):
            TransferEngine(manager, strided, copier="native")


def test_engine_copies_on_while_a_completion_is_slow() -> None:
    """The native threads never wait for the completer: while the first job's report is held up
    (on the completer thread), the next job's bytes still land in the pool."""
    device = torch.randint(1, 256, (8, 4096), dtype=torch.uint8)
    with TieringManager.start(num_blocks=16, block_bytes=4096) as manager, \
            TransferEngine(manager, device, copier="native") as engine:
        ctx = ReqContext("slow")
        manager.on_new_request(ctx)
        release = threading.Event()
        in_report = hold_report(engine, b"a", release)
        first = engine.offload(ctx, [b"a", b"b"], [0, 1])
        try:
            assert in_report.wait(TIMEOUT)
            second = engine.offload(ctx, [b"c", b"d"], [2, 3])
            deadline = time.monotonic() + TIMEOUT
            # The second job's rows are not known to the test: wait until two pool rows hold
            # device rows 2 and 3 (bounded; the test fails if they never do).
            while time.monotonic() < deadline:
                if sum(bool(torch.equal(row, device[2])) or bool(torch.equal(row, device[3]))
                       for row in manager.pool) == 2:
                    break
                time.sleep(0.001)
            else:
                pytest.fail("the second copy waited for the first job's report")
            assert not first.done() and not second.done()
        finally:
            release.set()
        assert first.result(TIMEOUT) == [b"a", b"b"]
        assert second.result(TIMEOUT) == [b"c", b"d"]
        manager.on_request_finished(ctx)


def test_reset_cache_while_a_native_store_is_in_flight_keeps_its_rows_until_it_ends() -> None:
    """The contract through a reset: a store whose copy has ended but whose completion is held,
    and a load behind it, keep their rows detached across reset_cache (nothing reuses them); once
    both complete the rows are free and nothing stays pending or pinned, and the load read the
    bytes it pinned."""
    device = torch.randint(1, 256, (8, 4096), dtype=torch.uint8)
    with TieringManager.start(num_blocks=8, block_bytes=4096) as manager, \
            TransferEngine(manager, device, copier="native") as engine:
        ctx = ReqContext("reset")
        manager.on_new_request(ctx)
        assert engine.offload(ctx, [b"loaded"], [0]).result(TIMEOUT) == [b"loaded"]
        release = threading.Event()
        held = hold_report(engine, b"stored", release)
        storing = engine.offload(ctx, [b"stored"], [1])
        try:
            assert held.wait(TIMEOUT)
            loading = engine.onboard(ctx, [b"loaded"], [5])  # pinned before the reset
            manager.reset_cache()
            stats = manager.stats()
            # Both rows (the held store's, the held load's: its report waits behind the store's)
            # are detached, not free: nothing reuses them while a copy may still touch them.
            assert stats["blocks_detached"] == 2 and stats["blocks_free"] == 6, stats
        finally:
            release.set()
        assert storing.result(TIMEOUT) == [b"stored"]
        assert loading.result(TIMEOUT) is None
        assert torch.equal(device[5], device[0])
        assert manager.wait_idle(TIMEOUT)
        stats = manager.stats()
        assert stats["blocks_pending"] == stats["blocks_pinned"] == stats["contract_violations"] == 0
        assert stats["blocks_detached"] == 0 and stats["blocks_free"] == 8
        manager.on_request_finished(ctx)


def test_stop_while_a_native_store_is_in_flight_fails_its_future() -> None:
    """The manager stopped while a native copy's completion is held: the completion cannot be
    posted, so the future raises TransferError (ManagerStoppedError as its cause), never a success."""
    from kvactors import ManagerStoppedError, TransferError

    device = torch.randint(1, 256, (8, 4096), dtype=torch.uint8)
    manager = TieringManager.start(num_blocks=8, block_bytes=4096, transfer_timeout_s=1.0)
    engine = TransferEngine(manager, device, copier="native")
    release = threading.Event()
    try:
        ctx = ReqContext("stop")
        manager.on_new_request(ctx)
        held = hold_report(engine, b"s", release)
        future = engine.offload(ctx, [b"s"], [0])
        assert held.wait(TIMEOUT)
        manager.stop(timeout=TIMEOUT)
        release.set()
        with pytest.raises(TransferError) as info:
            future.result(TIMEOUT)
        assert isinstance(info.value.__cause__, ManagerStoppedError)
    finally:
        release.set()
        engine.close()
        manager.stop()


def test_engine_close_waits_for_native_copies(reports: Reports) -> None:
    """Close right after submitting 64 MiB: every future resolved, every byte in place."""
    row = 1 << 20
    device = torch.randint(0, 256, (64, row), dtype=torch.uint8)
    with TieringManager.start(num_blocks=64, block_bytes=row) as manager:
        engine = TransferEngine(manager, device, copier="native")
        ctx = ReqContext("close")
        manager.on_new_request(ctx)
        futures = [engine.offload(ctx, [f"{i}.{j}".encode() for j in range(8)], list(range(i * 8, i * 8 + 8)))
                   for i in range(8)]
        engine.close()
        assert all(f.done() for f in futures)
        keys = [key for f in futures for key in f.result()]
        spec = manager.prepare_load(keys, ctx)
        assert torch.equal(manager.pool[list(spec.block_ids)], device)
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)



def test_a_tensor_resized_under_the_copier_fails_the_job_instead_of_writing_through_stale_addresses(
        reports: Reports) -> None:
    device = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    pool = torch.zeros((16, 4096), dtype=torch.uint8)
    copier = copier_for(device, pool, reports)
    try:
        device.resize_(64, 4096)  # a new, larger storage: the old addresses are freed
        copier.submit(make_job(1, "offload", [(0, 0, 16)], 4096))
        [(_, error, _)] = reports.wait_for(1)
    finally:
        copier.shutdown()
    assert isinstance(error, RuntimeError) and "resized" in str(error)
    assert not pool.any()


def test_a_raising_done_callback_does_not_stop_the_reports(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    device, pool = pair
    seen: list[int] = []
    cond = threading.Condition()

    def done(job: CopyJob, error: BaseException | None) -> None:
        with cond:
            seen.append(job.job_id)
            cond.notify_all()
        if job.job_id == 1:
            raise RuntimeError("a broken callback")

    copier = NativeCopier(device_cache=device, pool=pool, threads=2, done=done)
    try:
        for i in (1, 2, 3):
            copier.submit(make_job(i, "offload", [(i, i, 1)], 1000))
        with cond:
            assert cond.wait_for(lambda: len(seen) == 3, TIMEOUT), seen
    finally:
        copier.shutdown()
    assert sorted(seen) == [1, 2, 3]


def test_engine_copy_timeout_fails_late_copies_and_leaves_nothing_held() -> None:
    """A deadline no copy can meet: every offload and onboard fails with CopyTimeoutError as its
    cause, the stores complete with success=False (nothing stored, nothing pending), the loads
    are unpinned."""
    from kvactors import TransferError

    device = torch.randint(0, 256, (32, 1 << 16), dtype=torch.uint8)
    with TieringManager.start(num_blocks=64, block_bytes=1 << 16) as manager:
        ctx = ReqContext("late")
        manager.on_new_request(ctx)
        with TransferEngine(manager, device, copier="native") as prompt:
            stored = prompt.offload(ctx, [b"ready"], [0]).result(TIMEOUT)  # something to onboard later
        assert stored == [b"ready"]
        with TransferEngine(manager, device, copier="native", copy_timeout_s=1e-9) as engine:
            offloads = [engine.offload(ctx, [f"{i}".encode()], [i]) for i in range(1, 9)]
            onboards = [engine.onboard(ctx, [b"ready"], [16 + i]) for i in range(8)]
            for future in offloads + onboards:
                with pytest.raises(TransferError) as info:
                    future.result(TIMEOUT)
                assert isinstance(info.value.__cause__, CopyTimeoutError)
        assert manager.wait_idle(TIMEOUT)
        stats = manager.stats()
        assert stats["blocks_pending"] == stats["blocks_pinned"] == 0
        assert stats["contract_violations"] == 0
        assert manager.lookup([f"{i}".encode() for i in range(1, 9)], ctx) == [LookupResult.MISS] * 8
        manager.on_request_finished(ctx)
