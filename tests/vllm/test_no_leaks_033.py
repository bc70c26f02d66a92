"""vLLM 0.33: the kvactors connector keeps nothing per finished request ("nothing left behind").

vLLM's real Scheduler with both OffloadingConnector roles in one process (sched_harness), made-up
model outputs. 1,400 requests (shared prefixes, so lookups hit and blocks promote back from the
tiers; a small device cache, so requests are preempted; aborts of waiting and running requests;
stores whose copy fails; cache resets with jobs in flight) run through the adapter. Once the
engine is idle, nothing the adapter or the worker keeps may have grown with the number of
requests served: its own books (requests by id, attempt numbers, answers, stale jobs, the
worker's open jobs) are empty, the objects reachable from the manager and the worker are as many
as before, and so are the process's objects by type (as tests/test_deadlines.py counts them for
the core manager).
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import os
import random
import sys
import types
import weakref

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33"):
    pytest.skip("the scheduler suite runs on vllm 0.33", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from sched_harness import BLOCK, LAYERS, Harness, Run, fill  # noqa: E402

# Served before the first count (so every cache, pool and tier is full), then between the counts.
WARMUP, SERVED = 200, 1200
# Growth allowed between the counts. In the process: well under one object per request served (the
# core's deadline queues keep up to COMPACT_SLACK dead entries each, a few hundred objects in all,
# however many requests ran). Reachable from the adapter (the core and the metric books excluded):
# a few.
PROCESS_SLACK = SERVED // 5
REACHABLE_SLACK = 16

_NOT_STATE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
              types.FrameType, types.MethodDescriptorType, types.WrapperDescriptorType, logging.Logger,
              logging.Manager)


# The checks below look at type(obj), never isinstance: some objects are lazy proxies whose
# __class__ imports a package (openai's client: 1,500 modules, counted as growth).


def _abc_cache_entry(obj: object) -> bool:
    """An entry of an ABC's isinstance cache (a weak reference to a class, with a ``_destroy``
    callback): one per (ABC, class) pair ever checked, however many requests ran."""
    if type(obj) is weakref.ReferenceType:
        obj = obj.__callback__
    return type(obj) is types.BuiltinFunctionType and obj.__name__ == "_destroy"


def _census() -> collections.Counter[str]:
    """The process's (gc-tracked) objects by type (the ABC caches' entries left out)."""
    gc.collect()
    return collections.Counter(type(obj).__name__ for obj in gc.get_objects() if not _abc_cache_entry(obj))


def _reachable(roots: list[object], stop: tuple[type, ...]) -> collections.Counter[str]:
    """Every object reachable from ``roots`` by type, strings, bytes and numbers too (which the gc
    census does not see: a dict of req_id -> attempt number is one object there). Modules,
    classes, functions and loggers (the process's, shared by every module) are not followed, nor
    objects of the types ``stop`` (not counted)."""
    gc.collect()
    seen: set[int] = set()
    stack = list(roots)
    counts: collections.Counter[str] = collections.Counter()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if issubclass(type(obj), _NOT_STATE + stop):
            continue
        counts[type(obj).__name__] += 1
        stack.extend(gc.get_referents(obj))
        if issubclass(type(obj), dict):
            stack.extend(list(obj))  # a dict whose keys are all strings does not report them as referents
    return counts


def _grew(before: collections.Counter[str], after: collections.Counter[str], slack: int) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if after[name] - before[name] > slack}


def _books(mgr, worker) -> dict[str, int]:
    """The adapter's and the worker's per-request and per-job books, by size."""
    reqs = mgr._requests
    return {"requests": len(reqs.by_id), "attempts": len(reqs.attempts), "with_answers": len(reqs.with_answers),
            "stale_batches": len(mgr._stale._batches), "lookups_in_flight": mgr._jobs_in_flight,
            "worker_open": len(worker._open), "worker_finished": len(worker._finished)}


@pytest.mark.timeout(600)
def test_the_connector_keeps_nothing_per_finished_request(tmp_path):
    from vllm.v1.request import RequestStatus

    from kvactors import TieringManager
    from kvactors.integrations.vllm.stats import StatsReporter
    from kvactors.integrations.vllm.worker import WORKERS

    page_bytes = 2 * BLOCK * 8 * 2  # K and V, 1 head of 8, float16
    tiers = [{"type": "memory", "capacity_blocks": 40},
             {"type": "disk", "root": str(tmp_path / "disk"), "capacity_bytes": 128 * page_bytes * LAYERS}]
    cfg = {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
           "cpu_bytes_to_use": 24 * page_bytes * LAYERS, "tiers": tiers, "transfer_timeout_s": 10.0,
           "lookup_timeout_s": 2.0}
    earlier = set(WORKERS)  # an earlier test's, not shut down, may still be alive
    h = Harness(str(tmp_path), cfg, num_gpu_blocks=32, max_num_seqs=8, max_batched=192)
    run = Run(h)
    mgr = h.manager
    (worker,) = set(WORKERS) - earlier
    stores = itertools.count()
    # The core (tests/test_deadlines.py counts it), and the metric books (one entry per series, a
    # new one whenever a label value is first seen).
    not_adapter_state = (TieringManager, StatsReporter)

    def fail_some_stores(direction, job_id, rows):  # the adapter completes them with success=False
        if direction == "offload" and next(stores) % 9 == 4:
            raise OSError("planted store failure")

    worker.fault_injector = fail_some_stores
    sched = h.scheduler
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 500) for _ in range(BLOCK * rng.choice((2, 3, 4)))] for _ in range(6)]
    served = [0]
    tally = collections.Counter()

    def serve(n: int, resets: tuple[int, ...]) -> None:
        added = 0
        while added < n or sched.has_requests():
            while added < n and len(sched.requests) < 12:
                tokens = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 3 * BLOCK))]
                run.add(f"r{served[0]}", tokens, max_tokens=rng.randrange(4, 40))
                served[0] += 1
                added += 1
                if added in resets:  # with stores and loads in flight
                    sched.reset_prefix_cache(reset_connector=True)
                    tally["resets"] += 1
            if rng.random() < 0.04 and sched.requests:
                victim = sched.requests[rng.choice(list(sched.requests))]
                tally["aborted_" + ("waiting" if victim.status != RequestStatus.RUNNING else "running")] += 1
                sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            run.step()
            assert run.steps < 40 * served[0] + 1000, "the run does not end"
        # Idle: the last completions in, the reset fences passed, the runtime idle.
        for _ in range(200):
            run.step()
            if not h.connector.connector_scheduler.has_pending_push_work() and mgr.tm.wait_idle(0.05):
                break
        for _ in range(3):
            run.step()
        assert mgr.tm.wait_idle(30.0)
        fill.__defaults__[0].clear()  # the harness's cache of made-up block bytes, one per hash seen

    # pytest keeps every log record of a test for its report: the planted failures' warnings would
    # count as growth. Errors are still logged.
    quiet = logging.getLogger("kvactors")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        serve(WARMUP, resets=(60,))
        books_before = _books(mgr, worker)
        reach_before = _reachable([mgr, worker], stop=not_adapter_state)
        before = _census()
        serve(SERVED, resets=(200, 501, 800))
        books_after = _books(mgr, worker)
        reach_after = _reachable([mgr, worker], stop=not_adapter_state)
        after = _census()
        stats = mgr.stats()
    finally:
        quiet.setLevel(level)
        mgr.shutdown()
        worker.shutdown()
    print(f"\n{served[0]} requests, {run.steps} steps, {dict(tally)}, preemptions "
          f"{stats.get('vllm_preemptions', 0)}, keys loaded {stats.get('vllm_keys_loaded', 0)}, promoted answers "
          f"{stats.get('vllm_pending_answers', 0)}, failed stores {stats.get('vllm_stores_failed', 0)}; books "
          f"{books_before} -> {books_after}; reachable from the adapter {sum(reach_before.values())} -> "
          f"{sum(reach_after.values())} objects (grew {_grew(reach_before, reach_after, 0)}); process "
          f"{sum(before.values())} -> {sum(after.values())} objects (grew {_grew(before, after, 20)})")
    # The workload did what it is for.
    assert stats.get("vllm_preemptions", 0) > 0 and tally["resets"] == 4
    assert tally["aborted_waiting"] > 0 and tally["aborted_running"] > 0
    assert stats["vllm_keys_loaded"] > 0 and stats.get("vllm_pending_answers", 0) > 0
    assert stats.get("vllm_stores_failed", 0) > 0
    assert stats["contract_violations"] == 0
    assert stats["blocks_pinned"] == 0 and stats["blocks_pending"] == 0 and stats["jobs_in_flight"] == 0, stats
    # Nothing left behind.
    assert books_after == dict.fromkeys(books_after, 0), books_after
    assert not _grew(reach_before, reach_after, REACHABLE_SLACK), _grew(reach_before, reach_after, 0)
    assert not _grew(before, after, PROCESS_SLACK), _grew(before, after, PROCESS_SLACK // 4)
