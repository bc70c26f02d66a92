"""Many frontend threads, random call orders, failures: the contract holds and nothing leaks."""

from __future__ import annotations

import queue
import random
import threading

import pytest

from kvactors import LifecycleError, LookupResult, ReqContext, TieringManager
from tests.support import FlakyTier, RecordingTier, settled

THREADS = 8
REQUESTS_PER_THREAD = 250
KEY_SPACE = 400


def frontend(manager: TieringManager, seed: int, completions: queue.Queue, errors: list, started: list) -> None:
    rng = random.Random(seed)
    for n in range(REQUESTS_PER_THREAD):
        ctx = ReqContext(f"t{seed}-r{n}", attempt=0)
        try:
            attempts = 2 if rng.random() < 0.1 else 1  # some requests are preempted once
            for attempt in range(attempts):
                ctx = ReqContext(ctx.req_id, attempt)
                manager.on_new_request(ctx)
                started.append(ctx)
                wanted = [f"k{rng.randrange(KEY_SPACE)}".encode() for _ in range(rng.randint(1, 8))]
                results = manager.lookup(wanted, ctx)
                hits = [k for k, r in zip(wanted, results, strict=True) if r is LookupResult.HIT]
                if hits:
                    try:
                        manager.prepare_load(hits, ctx)
                        manager.complete_load(hits, ctx)
                    except LifecycleError:
                        pass  # evicted between lookup and load: a legitimate race
                out = manager.prepare_store(wanted, ctx)
                finish_early = rng.random() < 0.5
                if finish_early:
                    manager.on_request_finished(ctx)
                if out is not None and out.keys_to_store:
                    success = rng.random() > 0.1
                    if rng.random() < 0.5:
                        completions.put((out.keys_to_store, ctx, success))  # from another thread
                    else:
                        manager.complete_store(out.keys_to_store, ctx, success)
                if rng.random() < 0.05:
                    manager.touch(wanted, ctx)
                if not finish_early:
                    manager.on_request_finished(ctx)
                if rng.random() < 0.05:
                    with pytest.raises(LifecycleError):
                        manager.prepare_store(wanted, ctx)  # misuse: submit after finish
        except BaseException as exc:
            errors.append(exc)
            return


@pytest.mark.timeout(180)
def test_eight_frontend_threads_keep_the_contract():
    rec = RecordingTier(name="rec", capacity_blocks=300)
    flaky = FlakyTier(name="flaky", seed=7, capacity_blocks=300)
    completions: queue.Queue = queue.Queue()
    errors: list[BaseException] = []
    started: list[ReqContext] = []
    with TieringManager.start(num_blocks=256, block_bytes=64, secondary_tiers=[rec, flaky],
                              eviction="arc") as manager:

        def completer() -> None:
            while (item := completions.get()) is not None:
                manager.complete_store(*item)

        completers = [threading.Thread(target=completer) for _ in range(2)]
        threads = [threading.Thread(target=frontend, args=(manager, seed, completions, errors, started))
                   for seed in range(THREADS)]
        for thread in completers + threads:
            thread.start()
        for thread in threads:
            thread.join(150)
        for _ in completers:
            completions.put(None)
        for thread in completers:
            thread.join(30)
        assert not errors, errors[:3]
        stats = settled(manager, timeout=60)
    assert stats["active_requests"] == 0
    assert stats["blocks_pending"] == 0 and stats["blocks_pinned"] == 0 and stats["blocks_detached"] == 0
    assert stats["jobs_in_flight"] == 0 and stats["jobs_queued"] == 0
    assert stats["contract_violations"] == 0 and stats["internal_errors"] == 0
    assert stats["jobs_failed"] > 0 and stats["jobs_succeeded"] > 0  # failures did happen
    identities = {ctx.identity for ctx in started}
    assert len(identities) == len(started) >= THREADS * REQUESTS_PER_THREAD
    for tier in (rec, flaky):
        assert tier.violations == []
        assert set(tier.finished) == identities
        assert set(tier.finished.values()) == {1}
