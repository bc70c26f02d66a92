"""AsyncTieringManager keeps nothing per finished request or per call ("nothing left behind").

Thousands of requests on one loop, many at a time, through the asyncio facade: lookups, loads of
earlier requests' blocks, stores (some completed as failed), ``take_events`` and ``wait_idle``
calls that time out or are cancelled, calls cancelled while they wait for their answer (their
answers undone), cache resets. Once the runtime is idle, the facade's own books (the inbox, the
orphaned events, the door's live requests) are empty, and the process holds no more objects of
any type than before (counted as tests/test_deadlines.py counts them for the blocking manager).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import random

import pytest

from kvactors import AsyncTieringManager, LookupResult, MemoryTier, ReqContext, TieringManager

WARMUP, SERVED = 300, 3000
SLACK = SERVED // 8  # well under one object per request served


def _census() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(obj).__name__ for obj in gc.get_objects())


def _books(amgr: AsyncTieringManager) -> dict[str, int]:
    inbox = amgr._inbox
    return {"inbox": 0 if inbox is None else len(inbox._items), "orphan_events": len(amgr._orphan_events),
            "live_requests": len(amgr.manager.door._live), "stop_waiters": len(amgr._stop_waiters)}


async def _maybe_cancelled(coro, rng: random.Random, tally: collections.Counter[str], name: str):
    """Run ``coro`` as a task; one time in four cancel it after one turn of the loop (while it
    usually waits for its answer). Its result, or None if the cancel landed."""
    task = asyncio.ensure_future(coro)
    if rng.random() < 0.25:
        await asyncio.sleep(0)
        if not task.done():
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                tally["cancelled_" + name] += 1
                return None
    return await task


@pytest.mark.timeout(300)
@pytest.mark.parametrize("claims", [True, False])  # False: every call queued, so a cancel lands mid-wait
def test_the_asyncio_facade_keeps_nothing_per_finished_request(claims: bool) -> None:
    manager = TieringManager.start(num_blocks=128, block_bytes=16,
                                   secondary_tiers=[MemoryTier(capacity_blocks=256, name="m1")])
    amgr = AsyncTieringManager(manager, claims=claims)
    rng = random.Random(3)
    tally: collections.Counter[str] = collections.Counter()
    serial = iter(range(10**9))

    async def one(n: int) -> None:
        ctx = ReqContext(f"r{n}")
        await amgr.on_new_request(ctx)
        earlier = [b"key-%d-%d" % (max(n - rng.randrange(1, 30), 0), j) for j in range(4)]
        results = await _maybe_cancelled(amgr.lookup(earlier, ctx), rng, tally, "lookup")
        hits = []
        for key, result in zip(earlier, results or (), strict=False):
            if result is not LookupResult.HIT:
                break
            hits.append(key)
        if hits:
            try:
                spec = await _maybe_cancelled(amgr.prepare_load(hits, ctx), rng, tally, "prepare_load")
            except Exception:  # evicted meanwhile: computed instead
                tally["load_refused"] += 1
                spec = None
            if spec is not None:
                await asyncio.sleep(0)
                amgr.complete_load(hits, ctx)
                tally["loads"] += 1
        keys = [b"key-%d-%d" % (n, j) for j in range(4)]
        out = await _maybe_cancelled(amgr.prepare_store(keys, ctx), rng, tally, "prepare_store")
        finished_early = rng.random() < 0.3
        if finished_early:
            amgr.on_request_finished(ctx)  # finished with its stores in flight
        await asyncio.sleep(0)
        if out is not None:
            amgr.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.85)
        if not finished_early:
            amgr.on_request_finished(ctx)

    async def background(stop: asyncio.Event) -> None:
        while not stop.is_set():
            events = await _maybe_cancelled(amgr.take_events(), rng, tally, "take_events")
            tally["events"] += len(events or ())
            if not await amgr.wait_idle(0.0005):
                tally["wait_idle_timed_out"] += 1
            await asyncio.sleep(0.001)

    async def serve(requests: int) -> None:
        stop = asyncio.Event()
        bg = asyncio.create_task(background(stop))
        running: set[asyncio.Task[None]] = set()
        for _ in range(requests):
            n = next(serial)
            if n % 251 == 250:
                await amgr.reset_cache()
                tally["resets"] += 1
            task = asyncio.create_task(one(n))
            running.add(task)
            task.add_done_callback(running.discard)
            if len(running) >= 24:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        if running:
            await asyncio.gather(*running)
        stop.set()
        await bg
        assert await amgr.wait_idle(30)
        tally["events"] += len(await amgr.take_events())  # vLLM-like callers take them every step

    async def main() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        await serve(WARMUP)
        books_before = _books(amgr)
        before = _census()
        await serve(SERVED)
        books_after = _books(amgr)
        after = _census()
        grew = {name: after[name] - before[name] for name in after if after[name] - before[name] > SLACK // 4}
        print(f"\nclaims={claims}: {WARMUP + SERVED} requests, {dict(tally)}; books {books_before} -> "
              f"{books_after}; process {sum(before.values())} -> {sum(after.values())} objects (grew {grew})")
        return books_after, {n: after[n] - before[n] for n in after if after[n] - before[n] > SLACK}, grew

    try:
        books, grew, _ = asyncio.run(main())
        stats = manager.stats()
    finally:
        manager.stop()
    for name in ("cancelled_lookup", "cancelled_prepare_store", "cancelled_take_events", "loads", "resets"):
        assert tally[name] > 0, (name, dict(tally))
    assert stats["contract_violations"] == 0 and stats["active_requests"] == 0, stats
    assert stats["blocks_pinned"] == 0 and stats["blocks_pending"] == 0, stats
    assert books == dict.fromkeys(books, 0), books
    assert not grew, grew
