"""``TransferEngine`` against a real ``TieringManager`` (CPU device cache; CUDA tests skip without a GPU)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvactors import (
    LifecycleError,
    LookupResult,
    ManagerStoppedError,
    MemoryTier,
    OffloadKey,
    ReqContext,
    TieringManager,
    TransferEngine,
    TransferError,
)
from kvactors.transfer.cpu import CpuCopier
from kvactors.transfer.jobs import CopyJob, CopyTimeoutError
from kvactors.transfer.native import native_copy_available

BLOCK_BYTES = 4096
POOL_BLOCKS = 512
DEVICE_BLOCKS = 160
TIMEOUT = 10.0


def make_keys(prefix: str, n: int) -> list[OffloadKey]:
    return [f"{prefix}:{i}".encode() for i in range(n)]


def random_cache(rows: int = DEVICE_BLOCKS) -> torch.Tensor:
    return torch.randint(0, 256, (rows, BLOCK_BYTES), dtype=torch.uint8)


@pytest.fixture
def manager() -> Iterator[TieringManager]:
    mgr = TieringManager.start(
        num_blocks=POOL_BLOCKS, block_bytes=BLOCK_BYTES, secondary_tiers=[MemoryTier(capacity_blocks=POOL_BLOCKS)]
    )
    try:
        yield mgr
    finally:
        mgr.stop()


@pytest.fixture
def device_cache() -> torch.Tensor:
    return random_cache()


# Both CPU copiers run the tests that give no fault injector (one with an injector always copies with torch).
CPU_COPIERS = [
    "torch",
    pytest.param("native", marks=pytest.mark.skipif(not native_copy_available(), reason="native copier not built")),
]


@pytest.fixture(params=CPU_COPIERS)
def copier(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(manager: TieringManager, device_cache: torch.Tensor, copier: str) -> Iterator[TransferEngine]:
    eng = TransferEngine(manager, device_cache, copier=copier)
    assert eng.copier == copier
    try:
        yield eng
    finally:
        eng.close()


def new_request(manager: TieringManager, req_id: str, attempt: int = 0) -> ReqContext:
    ctx = ReqContext(req_id, attempt)
    manager.on_new_request(ctx)
    return ctx


def assert_quiet(manager: TieringManager) -> None:
    assert manager.wait_idle(TIMEOUT)
    stats = manager.stats()
    assert stats["blocks_pending"] == 0
    assert stats["blocks_pinned"] == 0
    assert stats["contract_violations"] == 0


# ---------------------------------------------------------------- round trips


def test_offload_onboard_round_trip(manager: TieringManager, engine: TransferEngine,
                                    device_cache: torch.Tensor) -> None:
    ctx = new_request(manager, "r1")
    keys = make_keys("rt", 16)
    rows = [3, 4, 5, 6, 20, 21, 40, 7, 8, 9, 10, 11, 12, 100, 101, 0]  # several runs
    original = device_cache[rows].clone()

    stored = engine.offload(ctx, keys, rows).result(TIMEOUT)
    assert stored == keys
    assert manager.lookup(keys, ctx) == [LookupResult.HIT] * len(keys)
    spec = manager.prepare_load(keys, ctx)
    assert torch.equal(manager.pool[list(spec.block_ids)], original)
    manager.complete_load(keys, ctx)

    device_cache[rows] = 0
    assert engine.onboard(ctx, keys, rows).result(TIMEOUT) is None
    assert torch.equal(device_cache[rows], original)
    # Onboard into other rows too.
    other = list(range(140, 156))
    engine.onboard(ctx, keys, other).result(TIMEOUT)
    assert torch.equal(device_cache[other], original)
    assert_quiet(manager)


def test_offload_of_present_keys_copies_nothing(manager: TieringManager, device_cache: torch.Tensor) -> None:
    calls: list[tuple[str, int]] = []

    def count(direction: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        calls.append((direction, len(keys)))

    with TransferEngine(manager, device_cache, fault_injector=count) as engine:
        ctx = new_request(manager, "r1")
        keys = make_keys("present", 4)
        assert engine.offload(ctx, keys, [0, 1, 2, 3]).result(TIMEOUT) == keys
        assert engine.offload(ctx, keys, [4, 5, 6, 7]).result(TIMEOUT) == []
        # Partly present: only the new key is copied, from its own row.
        more = [*keys[:2], b"present:new"]
        assert engine.offload(ctx, more, [8, 9, 10]).result(TIMEOUT) == [b"present:new"]
        assert engine.offload(ctx, [], []).result(TIMEOUT) == []
        assert calls == [("offload", 4), ("offload", 1)]
        spec = manager.prepare_load([b"present:new"], ctx)
        assert torch.equal(manager.pool[spec.block_ids[0]], device_cache[10])
        manager.complete_load([b"present:new"], ctx)
    assert_quiet(manager)


def test_reset_cache_then_promotion_then_onboard(manager: TieringManager, engine: TransferEngine,
                                                 device_cache: torch.Tensor) -> None:
    ctx = new_request(manager, "r1")
    keys = make_keys("promo", 12)
    rows = list(range(30, 42))
    original = device_cache[rows].clone()
    assert engine.offload(ctx, keys, rows).result(TIMEOUT) == keys

    manager.reset_cache()  # pool cleared, the MemoryTier keeps the cascaded blocks
    assert manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * len(keys)
    assert manager.wait_idle(TIMEOUT)
    assert manager.lookup(keys, ctx) == [LookupResult.HIT] * len(keys)

    device_cache[rows] = 0
    engine.onboard(ctx, keys, rows).result(TIMEOUT)
    assert torch.equal(device_cache[rows], original)
    assert_quiet(manager)


def test_concurrent_offloads_and_onboards(manager: TieringManager, device_cache: torch.Tensor, copier: str) -> None:
    """8 threads, each with its own request and device rows; per round 8 private and 8 shared keys."""
    threads_n, private_n, shared_n, rounds = 8, 8, 8, 3
    rows_per_thread = private_n + shared_n
    truth: dict[OffloadKey, torch.Tensor] = {}
    for r in range(rounds):
        for key in make_keys(f"shared{r}", shared_n):
            truth[key] = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8)
        for t in range(threads_n):
            for key in make_keys(f"private{r}.{t}", private_n):
                truth[key] = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8)
    barrier = threading.Barrier(threads_n, timeout=TIMEOUT)
    stored_by_round: list[list[OffloadKey]] = [[] for _ in range(rounds)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(t: int, engine: TransferEngine) -> None:
        try:
            ctx = new_request(manager, f"thread{t}")
            base = t * rows_per_thread
            for r in range(rounds):
                keys = make_keys(f"private{r}.{t}", private_n) + make_keys(f"shared{r}", shared_n)
                # Interleave private and shared keys; reversed rows on odd threads: fewer runs.
                rows = list(range(base, base + rows_per_thread))
                if t % 2:
                    rows.reverse()
                for key, row in zip(keys, rows, strict=True):
                    device_cache[row] = truth[key]
                stored = engine.offload(ctx, keys, rows).result(TIMEOUT)
                with lock:
                    stored_by_round[r].extend(stored)
                barrier.wait()  # every store of the round is complete (and queued before any onboard)
                device_cache[base : base + rows_per_thread] = 0
                engine.onboard(ctx, keys, rows).result(TIMEOUT)
                for key, row in zip(keys, rows, strict=True):
                    assert torch.equal(device_cache[row], truth[key]), f"thread {t} round {r} key {key!r}"
                barrier.wait()
            manager.on_request_finished(ctx)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    with TransferEngine(manager, device_cache, copy_workers=3, copier=copier) as engine:
        threads = [threading.Thread(target=worker, args=(t, engine)) for t in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT * 3)
    assert not errors, errors
    for r in range(rounds):
        expected = {*make_keys(f"shared{r}", shared_n)}
        for t in range(threads_n):
            expected.update(make_keys(f"private{r}.{t}", private_n))
        # Each key stored exactly once, by whichever thread prepared it first.
        assert sorted(stored_by_round[r]) == sorted(expected)
    assert_quiet(manager)


# ---------------------------------------------------------------- failures


def failing_for(req_id: str, direction: str) -> Callable[[str, ReqContext, Sequence[OffloadKey]], None]:
    def inject(d: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        if d == direction and ctx.req_id == req_id:
            raise OSError("injected copy failure")

    return inject


def test_failed_offload(manager: TieringManager, device_cache: torch.Tensor,
                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvactors.transfer")
    with TransferEngine(manager, device_cache, fault_injector=failing_for("bad", "offload")) as engine:
        bad = new_request(manager, "bad", attempt=2)
        good = new_request(manager, "good")
        keys = make_keys("fail", 4)
        future = engine.offload(bad, keys, [0, 1, 2, 3])
        with pytest.raises(TransferError) as info:
            future.result(TIMEOUT)
        assert isinstance(info.value.__cause__, OSError)
        # The engine goes on serving other requests.
        assert engine.offload(good, make_keys("ok", 2), [4, 5]).result(TIMEOUT) == make_keys("ok", 2)
        assert_quiet(manager)
        assert manager.lookup(keys, good) == [LookupResult.MISS] * len(keys)
        # The same keys can be stored again once the failure released them.
        assert engine.offload(good, keys, [0, 1, 2, 3]).result(TIMEOUT) == keys
    logged = [getattr(r, "kvactors_event", {}) for r in caplog.records]
    events = [e for e in logged if e.get("event") == "copy_failed"]
    assert len(events) == 1
    event = events[0]
    assert (event["req_id"], event["attempt"], event["keys"], event["direction"]) == ("bad", 2, 4, "offload")
    assert "injected copy failure" in event["error"]
    assert_quiet(manager)


def test_failed_onboard_unpins(manager: TieringManager, device_cache: torch.Tensor) -> None:
    with TransferEngine(manager, device_cache, fault_injector=failing_for("bad", "onboard")) as engine:
        bad = new_request(manager, "bad")
        keys = make_keys("onb", 3)
        assert engine.offload(bad, keys, [0, 1, 2]).result(TIMEOUT) == keys
        with pytest.raises(TransferError):
            engine.onboard(bad, keys, [10, 11, 12]).result(TIMEOUT)
        assert_quiet(manager)
        assert manager.lookup(keys, bad) == [LookupResult.HIT] * 3  # the blocks are intact


def test_copy_timeout(manager: TieringManager, device_cache: torch.Tensor) -> None:
    def stall(direction: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        if ctx.req_id == "slow":
            threading.Event().wait(0.3)  # the injected fault: a stalled copy

    with TransferEngine(manager, device_cache, copy_timeout_s=0.05, fault_injector=stall) as engine:
        slow = new_request(manager, "slow")
        keys = make_keys("late", 2)
        with pytest.raises(TransferError) as info:
            engine.offload(slow, keys, [0, 1]).result(TIMEOUT)
        assert isinstance(info.value.__cause__, CopyTimeoutError)
        assert_quiet(manager)
        assert manager.lookup(keys, slow) == [LookupResult.MISS] * 2
        fast = new_request(manager, "fast")
        assert engine.offload(fast, keys, [0, 1]).result(TIMEOUT) == keys


def test_onboard_of_a_key_not_ready_raises_at_once(manager: TieringManager, engine: TransferEngine) -> None:
    ctx = new_request(manager, "r1")
    with pytest.raises(LifecycleError):
        engine.onboard(ctx, [b"nowhere"], [0])
    # Prepared but not completed: not ready either.
    assert manager.prepare_store([b"pending"], ctx) is not None
    with pytest.raises(LifecycleError):
        engine.onboard(ctx, [b"pending"], [0])
    manager.complete_store([b"pending"], ctx, success=False)
    assert_quiet(manager)


def test_submit_errors_are_raised_to_the_caller(manager: TieringManager, engine: TransferEngine) -> None:
    ctx = new_request(manager, "r1")
    with pytest.raises(ValueError):
        engine.offload(ctx, make_keys("v", 2), [0])
    with pytest.raises(ValueError):
        engine.offload(ctx, make_keys("v", 1), [DEVICE_BLOCKS])
    with pytest.raises(ValueError):
        engine.offload(ctx, make_keys("v", 1), [-1])
    with pytest.raises(ValueError):
        engine.offload(ctx, b"one-key", [0])
    engine.offload(ctx, make_keys("v", 2), [0, 1]).result(TIMEOUT)
    with pytest.raises(ValueError):
        engine.onboard(ctx, make_keys("v", 2), [5, 5])
    with pytest.raises(LifecycleError):
        engine.offload(ReqContext("unknown"), make_keys("v", 1), [0])
    manager.on_request_finished(ctx)
    with pytest.raises(LifecycleError):
        engine.offload(ctx, make_keys("w", 1), [0])
    assert_quiet(manager)


def test_no_room_resolves_to_empty(device_cache: torch.Tensor) -> None:
    with TieringManager.start(num_blocks=4, block_bytes=BLOCK_BYTES) as manager, \
            TransferEngine(manager, device_cache) as engine:
        ctx = new_request(manager, "r1")
        held = make_keys("held", 4)
        assert manager.prepare_store(held, ctx) is not None  # every row pending: nothing evictable
        assert engine.offload(ctx, make_keys("more", 2), [0, 1]).result(TIMEOUT) == []
        manager.complete_store(held, ctx, success=False)
        assert_quiet(manager)


def test_constructor_checks(manager: TieringManager) -> None:
    with pytest.raises(ValueError):
        TransferEngine(manager, torch.zeros((4, BLOCK_BYTES * 2), dtype=torch.uint8))
    with pytest.raises(ValueError):
        TransferEngine(manager, torch.zeros((4, BLOCK_BYTES), dtype=torch.float32))
    with pytest.raises(ValueError):
        TransferEngine(manager, torch.zeros((4, BLOCK_BYTES), dtype=torch.uint8), copy_workers=0)
    with pytest.raises(ValueError):
        TransferEngine(manager, torch.zeros((4, BLOCK_BYTES), dtype=torch.uint8), copy_timeout_s=0)


# ---------------------------------------------------------------- close and stop


def test_close_twice_and_use_after_close(manager: TieringManager, device_cache: torch.Tensor) -> None:
    engine = TransferEngine(manager, device_cache)
    ctx = new_request(manager, "r1")
    engine.offload(ctx, make_keys("c", 1), [0]).result(TIMEOUT)
    engine.close()
    engine.close()
    assert engine.closed
    with pytest.raises(ManagerStoppedError):
        engine.offload(ctx, make_keys("c2", 1), [0])
    with pytest.raises(ManagerStoppedError):
        engine.onboard(ctx, make_keys("c", 1), [0])
    assert_quiet(manager)


def test_close_waits_for_copies_in_flight(manager: TieringManager, device_cache: torch.Tensor) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def hold(direction: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        entered.set()
        assert gate.wait(TIMEOUT)

    engine = TransferEngine(manager, device_cache, fault_injector=hold)
    ctx = new_request(manager, "r1")
    future = engine.offload(ctx, make_keys("w", 3), [0, 1, 2])
    assert entered.wait(TIMEOUT)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned with a copy in flight"
    assert not future.done()
    gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert future.done()
    assert future.result() == make_keys("w", 3)
    assert_quiet(manager)


def test_manager_stopped_before_the_completion(device_cache: torch.Tensor) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def hold(direction: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        entered.set()
        assert gate.wait(TIMEOUT)

    manager = TieringManager.start(num_blocks=16, block_bytes=BLOCK_BYTES, transfer_timeout_s=1.0)
    engine = TransferEngine(manager, device_cache, fault_injector=hold)
    try:
        ctx = new_request(manager, "r1")
        future = engine.offload(ctx, make_keys("s", 2), [0, 1])
        assert entered.wait(TIMEOUT)
        manager.stop(timeout=TIMEOUT)
        gate.set()
        with pytest.raises(TransferError) as info:
            future.result(TIMEOUT)
        assert isinstance(info.value.__cause__, ManagerStoppedError)
        with pytest.raises(ManagerStoppedError):
            engine.offload(ctx, make_keys("s2", 1), [0])  # prepare_store on a stopped manager
    finally:
        gate.set()
        engine.close()
        manager.stop()


# ---------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_cuda_round_trip_and_promotion(manager: TieringManager) -> None:
    device_cache = torch.randint(0, 256, (DEVICE_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    with TransferEngine(manager, device_cache) as engine:
        ctx = new_request(manager, "r1")
        keys = make_keys("gpu", 24)
        rows = [*range(0, 8), *range(50, 58), *range(100, 108)]
        original = device_cache[rows].clone()
        assert engine.offload(ctx, keys, rows).result(TIMEOUT) == keys
        device_cache[rows] = 0
        engine.onboard(ctx, keys, rows).result(TIMEOUT)
        assert torch.equal(device_cache[rows], original)
        manager.reset_cache()
        assert manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * len(keys)
        assert manager.wait_idle(TIMEOUT)
        device_cache[rows] = 0
        engine.onboard(ctx, keys, rows).result(TIMEOUT)
        assert torch.equal(device_cache[rows], original)
    assert_quiet(manager)


@cuda
@pytest.mark.cuda
def test_cuda_failed_copy(manager: TieringManager) -> None:
    device_cache = torch.zeros((8, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    with TransferEngine(manager, device_cache, fault_injector=failing_for("bad", "offload")) as engine:
        bad = new_request(manager, "bad")
        with pytest.raises(TransferError):
            engine.offload(bad, make_keys("g", 2), [0, 1]).result(TIMEOUT)
    assert_quiet(manager)
    assert manager.lookup(make_keys("g", 2), bad) == [LookupResult.MISS] * 2


def test_cpu_copy_thread_copies_on_while_a_completion_is_slow(manager: TieringManager,
                                                              device_cache: torch.Tensor) -> None:
    """The completion (manager call, future, its callbacks) runs off the copy thread: while one
    job's completion is held up on the completer, the next job's copy still starts. On a copier
    that completes on its copy thread, the second copy waits for the first completion."""
    copying: dict[bytes, threading.Event] = {}

    def note(direction: str, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
        copying.setdefault(keys[0], threading.Event()).set()

    in_completion, release = threading.Event(), threading.Event()

    with TransferEngine(manager, device_cache, fault_injector=note) as engine:
        copier = engine._copier
        assert isinstance(copier, CpuCopier)
        done = copier._done

        def held_done(job: CopyJob, error: BaseException | None) -> None:
            if job.keys[0] == first[0]:
                in_completion.set()
                release.wait(TIMEOUT)  # bounded; the test releases it
            done(job, error)

        copier._done = held_done
        ctx = new_request(manager, "slow-completion")
        first, second = make_keys("first", 2), make_keys("second", 2)
        copying[second[0]] = threading.Event()
        engine.offload(ctx, first, [0, 1])
        try:
            assert in_completion.wait(TIMEOUT)
            later = engine.offload(ctx, second, [2, 3])
            assert copying[second[0]].wait(2.0), "the second copy waited for the first job's completion"
        finally:
            release.set()
        assert later.result(TIMEOUT) == second
    assert_quiet(manager)
