"""AsyncTieringManager: coroutines over the actors, never blocking the loop."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from kvactors import (
    AsyncTieringManager,
    LifecycleError,
    LookupResult,
    ManagerStoppedError,
    MemoryTier,
    ReqContext,
    TieringManager,
    TransferJob,
)
from kvactors.actors import messages as m
from kvactors.actors.reply import Reply
from tests.support import ControlledTier, RecordingTier, keys, settled, wait_for


class SlowTier(RecordingTier):
    """A RecordingTier whose ``submit_store`` blocks for 1 ms (a disk or Redis write)."""

    inline_calls = frozenset({"lookup"})

    def submit_store(self, job: TransferJob) -> None:
        time.sleep(0.001)
        super().submit_store(job)


@contextlib.contextmanager
def primary_held(manager: TieringManager) -> Iterator[None]:
    """Hold the primary's turn (a claim): every message to it waits until the block ends."""
    primary = manager._actors[0]  # the primary tier's ref, spawned first
    assert wait_for(primary.claim, 10), "the primary did not go idle"  # a claim holds the turn once True
    try:
        yield
    finally:
        primary.run_claimed(m.FinishRequest(ReqContext("primary-held-nobody")))  # an ignored finish


def run(coro):  # one fresh loop per test
    return asyncio.run(coro)


# ------------------------------------------------------------------ 1,000 lifecycles on one loop


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.99 * (len(values) - 1))]


async def _tick(lags: list[float], done: asyncio.Event, threads_seen: set[int] | None = None) -> None:
    """Sleep 1 ms in a loop; record how late each wake-up was (the loop's lag)."""
    loop = asyncio.get_running_loop()
    while not done.is_set():
        t0 = loop.time()
        await asyncio.sleep(0.001)
        lags.append(loop.time() - t0 - 0.001)
        if threads_seen is not None:
            threads_seen.add(threading.active_count())


def _control_lag_p99(seconds: float = 0.5) -> float:
    """The machine's own floor: the same ticker with a CPU-bound Python thread beside the
    loop (as the actors' thread is under load), no kvactors at all."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    async def main() -> list[float]:
        lags: list[float] = []
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, done.set)
        await _tick(lags, done)
        return lags

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        return _p99(run(main()))
    finally:
        stop.set()
        thread.join()


def _thousand_lifecycles(claims: bool) -> tuple[float, float]:
    """1,000 concurrent lifecycles on one loop, a tier with 1 ms blocking submits; checks the
    contract; returns the loop lag's p50 and p99 (seconds)."""
    tier = SlowTier(name="slow")
    shared = keys(*(f"prefix-{i}" for i in range(8)))
    with TieringManager.start(num_blocks=8192, block_bytes=64, secondary_tiers=[tier]) as manager:
        amgr = AsyncTieringManager(manager, claims=claims)
        lags: list[float] = []
        threads_seen: set[int] = set()
        threads_before = threading.active_count()
        outcomes: dict[str, int] = {"hits": 0, "stored": 0}

        async def lifecycle(n: int) -> None:
            ctx = ReqContext(f"r{n}")
            fresh = keys(*(f"r{n}-{j}" for j in range(4)))
            await amgr.on_new_request(ctx)
            results = await amgr.lookup(shared + fresh, ctx)
            ready = [key for key, result in zip(shared, results, strict=False) if result is LookupResult.HIT]
            if ready:
                spec = await amgr.prepare_load(ready, ctx)
                assert len(spec.block_ids) == len(ready)
                await asyncio.sleep(0)  # the "copy"
                amgr.complete_load(ready, ctx)
                outcomes["hits"] += len(ready)
            want = [k for k, r in zip(shared + fresh, results, strict=True) if r is LookupResult.MISS]
            out = await amgr.prepare_store(want, ctx)
            if out is not None and out.keys_to_store:
                await asyncio.sleep(0)
                amgr.complete_store(out.keys_to_store, ctx)
                outcomes["stored"] += len(out.keys_to_store)
            amgr.on_request_finished(ctx)

        async def main() -> dict[str, int | float]:
            warm = ReqContext("warm")  # the shared prefix is in the pool: every request hits it
            await amgr.on_new_request(warm)
            out = await amgr.prepare_store(shared, warm)
            amgr.complete_store(out.keys_to_store, warm)
            amgr.on_request_finished(warm)
            done = asyncio.Event()
            tick = asyncio.create_task(_tick(lags, done, threads_seen))
            await asyncio.gather(*(lifecycle(n) for n in range(1000)))
            assert await amgr.wait_idle(60)
            done.set()
            await tick
            return await amgr.stats()

        stats = run(main())
    assert stats["contract_violations"] == 0 and stats["internal_errors"] == 0
    assert stats["active_requests"] == 0 and stats["blocks_pinned"] == 0 and stats["blocks_pending"] == 0
    assert tier.violations == []
    assert tier.count("on_request_finished") == 1001
    assert outcomes["hits"] == 8000 and outcomes["stored"] == 4000
    assert max(threads_seen) <= threads_before, "no thread per call or per waiting coroutine"
    return statistics.median(lags), _p99(lags)


@pytest.mark.timeout(180)
def test_thousand_concurrent_lifecycles_keep_the_contract_and_the_loop_responsive():
    """The contract holds every time; the loop's lag p99 is under 5 ms in one of three runs.

    A loop sharing its process with busy Python threads waits for the GIL (5 ms switch
    interval) and, on a loaded machine, for a core: if the machine's own floor (the same
    ticker beside a spinning thread, no kvactors) is over 5 ms, the bound cannot be
    measured here and the test says so (xfail) instead of passing or failing on noise.
    """
    runs = []
    for _ in range(3):
        p50, p99 = _thousand_lifecycles(claims=True)
        runs.append((p50, p99))
        print(f"loop lag: p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms")
        if p99 < 0.005:
            return
    floor = _control_lag_p99()
    if floor >= 0.005:
        pytest.xfail(f"machine too loaded to measure a 5 ms bound: its own floor is p99 {floor * 1e3:.1f} ms; "
                     f"runs: {[f'{p99 * 1e3:.1f} ms' for _, p99 in runs]}")
    raise AssertionError(f"loop lag p99 over 5 ms in 3 runs {[round(p99 * 1e3, 2) for _, p99 in runs]} "
                         f"(machine floor {floor * 1e3:.2f} ms)")


def test_a_slow_tier_never_blocks_the_loop():
    """A tier whose lookup waits (on its own thread) leaves the loop running."""
    tier = ControlledTier(name="ctl")
    tier.lookup_gate = threading.Event()
    with TieringManager.start(num_blocks=16, block_bytes=16, secondary_tiers=[tier]) as manager:
        amgr = AsyncTieringManager(manager)

        async def main() -> list[LookupResult]:
            ctx = ReqContext("a")
            await amgr.on_new_request(ctx)
            lookup = asyncio.create_task(amgr.lookup(keys(1), ctx))
            for _ in range(20):  # the loop keeps turning while the tier is stuck
                await asyncio.sleep(0.001)
            assert not lookup.done()
            tier.lookup_gate.set()
            result = await asyncio.wait_for(lookup, 10)
            amgr.on_request_finished(ctx)
            return result

        assert run(main()) == [LookupResult.MISS]
        assert settled(manager)["active_requests"] == 0


# ------------------------------------------------------------------ ordering


@pytest.mark.parametrize("claims", [True, False], ids=["claims", "queued"])
def test_calls_from_one_task_take_effect_in_order(claims):
    with TieringManager.start(num_blocks=16, block_bytes=16) as manager:
        amgr = AsyncTieringManager(manager, claims=claims)

        async def main() -> None:
            ctx = ReqContext("a")
            await amgr.on_new_request(ctx)
            out = await amgr.prepare_store(keys(1, 2), ctx)
            assert out is not None
            amgr.complete_store(out.keys_to_store, ctx)  # queued, not awaited: the lookup sees it
            assert await amgr.lookup(keys(1, 2), ctx) == [LookupResult.HIT] * 2
            amgr.on_request_finished(ctx)
            with pytest.raises(LifecycleError):  # the finish took effect before it
                await amgr.prepare_store(keys(3), ctx)
            assert await amgr.wait_idle(10)
            assert (await amgr.stats())["active_requests"] == 0

        run(main())


# ------------------------------------------------------------------ the same errors


def _error(call):
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("no error")


async def _aerror(coro):
    try:
        await coro
    except Exception as exc:
        return exc
    raise AssertionError("no error")


def test_the_same_errors_as_the_blocking_api():
    with TieringManager.start(num_blocks=16, block_bytes=16) as manager:
        amgr = AsyncTieringManager(manager)
        ctx, unknown = ReqContext("a"), ReqContext("nobody")
        manager.on_new_request(ctx)
        cases = [
            ("on_new_request", (ctx,)),                   # duplicate
            ("on_new_request", ("not a ctx",)),
            ("lookup", (keys(1), unknown)),
            ("lookup", (b"one-key", ctx)),                # a single key, not a sequence
            ("lookup", ([b"k", "str-key"], ctx)),
            ("prepare_load", (keys(1), ctx)),             # not ready
            ("prepare_load", (keys(1), unknown)),
            ("prepare_store", (keys(1), unknown)),
            ("prepare_store", (keys(1), "not a ctx")),
            ("wait_idle", (-1,)),
            ("wait_idle", (float("nan"),)),
        ]

        async def main() -> None:
            for name, args in cases:
                expected = _error(lambda name=name, args=args: getattr(manager, name)(*args))
                got = await _aerror(getattr(amgr, name)(*args))
                assert type(got) is type(expected) and str(got) == str(expected), (name, got, expected)
            for name, args in [("complete_load", ("x", ctx)), ("touch", (keys(1), 3)), ("on_request_finished", (1,))]:
                expected = _error(lambda name=name, args=args: getattr(manager, name)(*args))
                got = _error(lambda name=name, args=args: getattr(amgr, name)(*args))
                assert type(got) is type(expected) and str(got) == str(expected), (name, got, expected)
            amgr.on_request_finished(ctx)
            finished = _error(lambda: manager.prepare_store(keys(1), ctx))
            got = await _aerror(amgr.prepare_store(keys(1), ctx))
            # finished, or finalized meanwhile (then "unknown"): a LifecycleError either way
            assert type(got) is LifecycleError is type(finished) and str(got).startswith("prepare_store: request a#0")
            await amgr.stop()
            assert manager.stopped
            assert isinstance(await _aerror(amgr.lookup(keys(1), ctx)), ManagerStoppedError)
            assert isinstance(await _aerror(amgr.stats()), ManagerStoppedError)
            assert isinstance(_error(lambda: amgr.on_request_finished(ctx)), ManagerStoppedError)
            await amgr.stop()  # safe twice

        run(main())
    with pytest.raises(ValueError):
        AsyncTieringManager("not a manager")  # type: ignore[arg-type]


def test_concurrent_stops_share_one_thread_and_each_keeps_its_bound(monkeypatch: pytest.MonkeyPatch):
    """No thread per call: ten stops at once start one stop thread; a later one returns at once."""
    gate = threading.Event()
    started_names: list[str] = []
    start_thread = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        started_names.append(thread.name)
        start_thread(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)

    class StuckLookup(ControlledTier):
        def lookup(self, keys_, ctx):
            gate.wait(30)
            return super().lookup(keys_, ctx)

    manager = TieringManager.start(num_blocks=4, block_bytes=32, secondary_tiers=[StuckLookup(hold=False)],
                                   transfer_timeout_s=0.5, lookup_timeout_s=0.2)
    amgr = AsyncTieringManager(manager)
    ctx = ReqContext("a")
    try:
        async def main() -> None:
            await amgr.on_new_request(ctx)
            assert await amgr.lookup(keys(1), ctx) == [LookupResult.RETRY]  # the tier is stuck in it
            started = time.monotonic()
            await asyncio.gather(*(amgr.stop(0.2) for _ in range(10)))
            took = time.monotonic() - started
            assert started_names.count("kvactors-async-stop") == 1, started_names
            assert took < 0.2 + 2 * 0.5 + 1.0, took  # each within timeout + 2 * STOP_GRACE_S (and slack)
            assert manager.stopped
            started = time.monotonic()
            await amgr.stop()
            assert time.monotonic() - started < 0.5  # stopped: returns at once
            assert started_names.count("kvactors-async-stop") == 1, started_names
            with pytest.raises(ValueError):
                await amgr.stop(-1)

        run(main())
    finally:
        gate.set()
        manager.stop(1)


# ------------------------------------------------------------------ cancellation


def test_a_cancelled_prepare_load_releases_its_pins_and_the_request_can_finish():
    with TieringManager.start(num_blocks=16, block_bytes=16) as manager:
        amgr = AsyncTieringManager(manager)
        ctx = ReqContext("a")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys(1, 2), ctx)
        manager.complete_store(out.keys_to_store, ctx)

        async def main() -> None:
            with primary_held(manager):
                task = asyncio.create_task(amgr.prepare_load(keys(1, 2), ctx))
                await asyncio.sleep(0)  # the call is made: its message waits behind the hold
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert await amgr.wait_idle(10)

        run(main())
        stats = manager.stats()
        assert stats["blocks_pinned"] == 0 and stats["contract_violations"] == 0
        spec = manager.prepare_load(keys(1, 2), ctx)  # the request goes on
        manager.complete_load(keys(1, 2), ctx)
        assert len(spec.block_ids) == 2
        manager.on_request_finished(ctx)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["blocks_pinned"] == 0 and stats["contract_violations"] == 0


def test_a_cancelled_prepare_store_completes_its_rows_as_failed():
    tier = RecordingTier(name="rec")
    with TieringManager.start(num_blocks=16, block_bytes=16, secondary_tiers=[tier]) as manager:
        amgr = AsyncTieringManager(manager)
        ctx = ReqContext("a")

        async def main() -> None:
            await amgr.on_new_request(ctx)
            with primary_held(manager):
                task = asyncio.create_task(amgr.prepare_store(keys(1, 2), ctx))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert await amgr.wait_idle(10)
            stats = await amgr.stats()
            assert stats["blocks_pending"] == 0 and stats["blocks_ready"] == 0
            assert await amgr.lookup(keys(1, 2), ctx) == [LookupResult.MISS] * 2
            amgr.on_request_finished(ctx)  # the request finishes: nothing pending holds it
            assert await amgr.wait_idle(10)

        run(main())
        stats = manager.stats()
        assert stats["active_requests"] == 0 and stats["contract_violations"] == 0
        assert tier.count("submit_store") == 0 and tier.count("on_request_finished", ctx) == 1


def test_cancelled_take_events_hands_them_to_the_next_call():
    """A cancelled take_events hands its events to the next call, also when that call took
    the earlier orphans meanwhile (the undo must reach the one list, not a stale one)."""
    from kvactors.aio import _Inbox

    with TieringManager.start(num_blocks=16, block_bytes=16) as manager:
        amgr = AsyncTieringManager(manager)
        ctx = ReqContext("a")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys(1), ctx)
        manager.complete_store(out.keys_to_store, ctx)

        async def main() -> list[tuple[tuple[bytes, ...], bool]]:
            with primary_held(manager):  # 1. a cancelled call leaves the store event as an orphan
                first = asyncio.create_task(amgr.take_events())
                await asyncio.sleep(0)
                first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert await amgr.wait_idle(10)
            seen: list[tuple[tuple[bytes, ...], bool]] = []
            with primary_held(manager):  # 2. one call takes the orphans, a later one is cancelled
                taker = asyncio.create_task(amgr.take_events())
                await asyncio.sleep(0)
                # More answers than the inbox hands over in one turn: the taker resumes (and takes
                # the orphans) before the cancelled call's answer is undone.
                fillers = [asyncio.create_task(amgr.stats()) for _ in range(2 * _Inbox.CHUNK)]
                await asyncio.sleep(0)
                reset = asyncio.create_task(amgr.reset_cache())  # removes key 1: a removal event
                await asyncio.sleep(0)
                cancelled = asyncio.create_task(amgr.take_events())
                await asyncio.sleep(0)
                cancelled.cancel()
            seen += [(e.keys, e.removed) for e in await taker]
            await asyncio.gather(*fillers, reset)
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert await amgr.wait_idle(10)
            seen += [(e.keys, e.removed) for e in await amgr.take_events()]
            return seen

        seen = run(main())
        assert seen == [(tuple(keys(1)), False), (tuple(keys(1)), True)], seen


def test_wait_idle_times_out_without_blocking_and_a_held_job_still_ends():
    tier = ControlledTier(name="ctl")
    with TieringManager.start(num_blocks=16, block_bytes=16, secondary_tiers=[tier]) as manager:
        amgr = AsyncTieringManager(manager)

        async def main() -> None:
            ctx = ReqContext("a")
            await amgr.on_new_request(ctx)
            out = await amgr.prepare_store(keys(1), ctx)
            amgr.complete_store(out.keys_to_store, ctx)
            amgr.on_request_finished(ctx)
            assert await amgr.wait_idle(0.05) is False  # the cascade is held
            tier.wait_held(1)
            tier.release_all()
            assert await amgr.wait_idle(10) is True

        run(main())


def test_engine_futures_are_awaitable_with_wrap_future():
    import torch

    from kvactors import TransferEngine

    device = torch.arange(4 * 16, dtype=torch.uint8).reshape(4, 16)
    with TieringManager.start(num_blocks=8, block_bytes=16, secondary_tiers=[MemoryTier(capacity_blocks=8)]) as mgr, \
            TransferEngine(mgr, device) as engine:
        amgr = AsyncTieringManager(mgr)

        async def main() -> list[bytes]:
            ctx = ReqContext("a")
            await amgr.on_new_request(ctx)
            stored = await asyncio.wrap_future(engine.offload(ctx, keys(1, 2), [0, 1]))
            await asyncio.wrap_future(engine.onboard(ctx, keys(1, 2), [2, 3]))
            amgr.on_request_finished(ctx)
            return stored

        assert run(main()) == keys(1, 2)
        assert torch.equal(device[2:4], device[0:2])


def test_an_undo_that_fails_does_not_stop_the_answers_behind_it():
    """The inbox hands a burst of answers over in one turn: a cancelled call's undo that raises
    (ManagerStoppedError after a stop, or a bug) must not strand the answers after it."""
    from kvactors.aio import _Inbox

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        reported: list[object] = []
        loop.set_exception_handler(lambda loop, context: reported.append(context["exception"]))
        inbox = _Inbox(loop)
        answers = []
        for undo_error in (ManagerStoppedError("stopped"), RuntimeError("planted"), None):
            cancelled: asyncio.Future[int] = loop.create_future()
            cancelled.cancel()

            def undo(value: int, error: BaseException | None = undo_error) -> None:
                if error is not None:
                    raise error

            done: Reply[int] = Reply()
            done.set_result(1)
            inbox.post(cancelled, done, undo)
            answer: asyncio.Future[int] = loop.create_future()
            ok: Reply[int] = Reply()
            ok.set_result(2)
            inbox.post(answer, ok, None)
            answers.append(answer)
        assert await asyncio.wait_for(asyncio.gather(*answers), 10) == [2, 2, 2]
        return reported

    reported = run(main())
    assert [type(e).__name__ for e in reported] == ["RuntimeError"]  # reported; a stop's is expected


def test_the_asyncio_facade_has_every_call_of_the_blocking_one():
    """Issue 29 item 3: both facades build their calls from one table (kvactors.calls); none is missing."""
    import inspect

    blocking = {name for name, _ in inspect.getmembers(TieringManager) if not name.startswith("_")}
    asynchronous = {name for name, _ in inspect.getmembers(AsyncTieringManager) if not name.startswith("_")}
    facade_only = {"start", "pool", "stopped", "tier_names", "door"}  # building, and the runtime's own state
    assert blocking - facade_only <= asynchronous, sorted(blocking - facade_only - asynchronous)


@pytest.mark.timeout(60)
def test_metrics_snapshot_on_the_loop_equals_the_blocking_one():
    with TieringManager.start(num_blocks=8, block_bytes=8) as manager:
        wrapper = AsyncTieringManager(manager)
        ctx = ReqContext("r")

        async def go():
            await wrapper.on_new_request(ctx)
            out = await wrapper.prepare_store([b"k"], ctx)
            wrapper.complete_store(out.keys_to_store, ctx)
            assert await wrapper.wait_idle(10)
            return await wrapper.metrics_snapshot()

        on_loop = run(go())
        assert on_loop == manager.metrics_snapshot()
        assert on_loop.stats["blocks_ready"] == 1


@pytest.mark.timeout(60)
def test_the_loops_thread_runs_no_tier_call_even_when_it_claims():
    """A claim on the loop runs the primary's handler only: what it causes (the supervisor's part,
    the tiers' inline calls, here lookup and on_new_request) goes to the primary's thread."""
    ran_on: list[str] = []

    class Recording(MemoryTier):
        def lookup(self, keys_, ctx_):
            ran_on.append(threading.current_thread().name)
            return super().lookup(keys_, ctx_)

        def on_new_request(self, ctx_):
            ran_on.append(threading.current_thread().name)

    with TieringManager.start(num_blocks=8, block_bytes=8,
                              secondary_tiers=[Recording(name="m", capacity_blocks=4)]) as manager:
        wrapper = AsyncTieringManager(manager)
        ctx = ReqContext("r")

        async def go():
            assert await wrapper.wait_idle(10)  # the primary idle: the next calls claim it
            await wrapper.on_new_request(ctx)
            assert await wrapper.wait_idle(10)
            results = await wrapper.lookup(keys(1, 2), ctx)
            return threading.current_thread().name, results

        loop_thread, results = run(go())
        assert results == [LookupResult.MISS] * 2
    assert len(ran_on) == 2 and loop_thread not in ran_on, ran_on
