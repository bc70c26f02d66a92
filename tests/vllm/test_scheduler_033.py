"""vLLM 0.33: the real Scheduler with both OffloadingConnector roles in one process, made-up model outputs."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33"):
    pytest.skip("the scheduler suite runs on vllm 0.33", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from sched_harness import BLOCK, LAYERS, Harness, Run  # noqa: E402


def extra(tmp, *, pool_blocks, tiers):
    page_bytes = 2 * BLOCK * 8 * 2  # K and V, 1 head of 8, float16
    return {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "cpu_bytes_to_use": pool_blocks * page_bytes * LAYERS, "tiers": tiers, "transfer_timeout_s": 10.0,
            "lookup_timeout_s": 2.0, "event_log": os.path.join(tmp, "events.kvlog")}


@pytest.mark.timeout(300)
def test_hundreds_of_requests_preemptions_aborts_reset(tmp_path):
    from vllm.v1.request import RequestStatus

    tiers = [{"type": "memory", "capacity_blocks": 40},
             {"type": "disk", "root": str(tmp_path / "disk"), "capacity_bytes": 8 << 20}]
    h = Harness(str(tmp_path), extra(str(tmp_path), pool_blocks=24, tiers=tiers), num_gpu_blocks=40,
                max_num_seqs=8, max_batched=192)
    run = Run(h)
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 500) for _ in range(BLOCK * rng.choice((2, 4, 6)))] for _ in range(6)]
    n_requests, added, aborted = 240, 0, 0

    while added < n_requests or h.scheduler.has_requests():
        while added < n_requests and len(h.scheduler.requests) < 16:
            tokens = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 3 * BLOCK))]
            run.add(f"r{added}", tokens, max_tokens=rng.randrange(8, 64))
            added += 1
        if rng.random() < 0.03 and h.scheduler.requests:
            victim = rng.choice(list(h.scheduler.requests))
            h.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted += 1
        if added == n_requests // 2 and run.steps and not getattr(run, "did_reset", False):
            run.did_reset = True
            h.scheduler.reset_prefix_cache(reset_connector=True)
        run.step()
        assert run.steps < 20000, "the run does not end"
    # Let the last completions arrive, then stop the connector (as the engine does at shutdown).
    for _ in range(10):
        run.step()
    mgr = h.manager
    assert mgr.tm.wait_idle(30.0)
    stats = mgr.stats()
    print("\nsteps", run.steps, "loaded blocks checked", run.checked_loaded, "aborted", aborted, "preemptions",
          stats.get("vllm_preemptions", 0), "lookup calls", stats.get("vllm_lookup_calls"),
          "lookup keys", stats.get("vllm_lookup_keys"), "retries", stats.get("vllm_lookup_retries", 0),
          "stats", {k: v for k, v in stats.items() if k.startswith("blocks") or k.startswith("vllm")})
    assert stats["contract_violations"] == 0
    assert stats["blocks_pinned"] == 0 and stats["blocks_pending"] == 0 and stats["jobs_in_flight"] == 0, stats
    assert run.checked_loaded > 0
    assert stats["vllm_keys_loaded"] > 0
    assert stats.get("vllm_preemptions", 0) > 0, "the run never preempted: make the device cache smaller"
    h.connector.shutdown() if hasattr(h.connector, "shutdown") else mgr.shutdown()
    h.worker.shutdown()
    assert not os.path.exists(mgr.shared.path)
    check = subprocess.run([sys.executable, "-m", "kvactors.cli", "check-log", str(tmp_path / "events.kvlog")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("b_tokens", [40, 41])
def test_a_request_waiting_for_device_blocks_keeps_its_hits_past_the_lookup_timeout(tmp_path, b_tokens):
    """Found in review: a request answered HIT on one step and asked again on the next (its answers
    are dropped at each step's end) while it waits for device blocks lost its hits once
    lookup_timeout_s had passed since its first RETRY, and recomputed its prefix. C's prefix is in
    the pool; B holds nearly all device blocks for about 40 steps of 20 ms (0.8 s > 0.3 s)."""
    import time

    cfg = extra(str(tmp_path), pool_blocks=64, tiers=[])
    cfg["lookup_timeout_s"] = 0.3
    h = Harness(str(tmp_path), cfg, num_gpu_blocks=24, max_num_seqs=4, max_batched=512)
    run = Run(h)

    def steps_until(done, limit=600):
        for _ in range(limit):
            if done():
                return True
            run.step()
            time.sleep(0.02)  # a model step's time: what lookup_timeout_s is measured against
        return done()

    prefix = [(i * 7) % 400 + 3 for i in range(4 * BLOCK)]
    run.add("A", prefix + [11] * 5, max_tokens=2)
    assert steps_until(lambda: "A" not in h.scheduler.requests)
    stats = h.manager.tm.stats
    assert steps_until(lambda: stats()["blocks_pending"] == 0 and stats()["blocks_ready"] >= 4, limit=100)
    h.scheduler.reset_prefix_cache()  # the engine's own cache only: C's prefix must come from kvactors
    run.add("B", [13 + i % 300 for i in range(20 * BLOCK)], max_tokens=b_tokens)
    for _ in range(4):  # B admitted, prefilled, decoding
        run.step()
    run.add("C", prefix + [17] * 5, max_tokens=2)
    loaded_before = h.manager.counters["keys_loaded"]
    assert steps_until(lambda: "C" not in h.scheduler.requests)
    loaded = h.manager.counters["keys_loaded"] - loaded_before
    assert loaded >= 4, (loaded, h.manager.counters["lookups_given_up"])


def _pressure_run(tmp, backend: str, pool_blocks: int) -> dict:
    """12 conversations x 3 turns of 5-7 blocks each through a pool of ``pool_blocks`` rows and a disk
    tier (a working set about nine times the pool at 8), the engine's own prefix cache dropped between
    turns, a model step of 5 ms (the helper threads run while the model computes, as in an engine).
    Per request: the scheduler steps from its arrival to its end."""
    import time

    page_bytes = 2 * BLOCK * 8 * 2
    disk = os.path.join(tmp, "disk")
    if backend == "kvactors":
        cfg = extra(tmp, pool_blocks=pool_blocks, tiers=[{"type": "disk", "root": disk, "capacity_bytes": 64 << 20}])
    else:
        cfg = {"spec_name": "VllmTieringCpuWorkerSpec", "spec_module_path": "vllm_tiering_cpu",
               "cpu_bytes_to_use": pool_blocks * page_bytes * LAYERS,
               "secondary_tiers": [{"type": "fs", "root_dir": disk}]}
    h = Harness(tmp, cfg, num_gpu_blocks=64, max_num_seqs=8, max_batched=256)
    run = Run(h)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(BLOCK * 5)] for _ in range(12)]
    arrived: dict[str, int] = {}
    took: dict[str, int] = {}
    for turn in range(3):
        for i, p in enumerate(prompts):
            arrived[f"t{turn}c{i}"] = run.steps
            run.add(f"t{turn}c{i}", p, max_tokens=4)
        while h.scheduler.has_requests():
            run.step()
            time.sleep(0.005)
            for req_id in [r for r in arrived if r not in took and r not in h.scheduler.requests]:
                took[req_id] = run.steps - arrived[req_id]
            assert run.steps < 3000, f"{backend}: the run does not end ({run.steps} steps)"
        for _ in range(3):
            run.step()
        h.scheduler.reset_prefix_cache()
        prompts = [p + [rng.randrange(3, 500) for _ in range(BLOCK)] for p in prompts]
    out = {"steps": run.steps, "took": took, "loaded": run.checked_loaded}
    if backend == "kvactors":
        mgr = h.manager
        assert mgr.tm.wait_idle(30.0)
        out["stats"] = mgr.stats()
        mgr.shutdown()
    h.worker.shutdown()
    return out


@pytest.mark.timeout(300)
def test_under_pool_pressure_every_request_ends_within_the_steps_vllms_own_tiering_takes(tmp_path):
    """Issue 26: with a pool much smaller than the working set, promotions thrashed (each promoted
    block evicted before its request loaded it) and requests waited for room (RETRY until the lookup
    deadline): a real engine served 1% of vLLM's requests/s. Now a promotion the pool cannot hold is a
    MISS (the request computes), and a promoted block is kept for its request until it loads it."""
    sys.path.insert(0, os.path.dirname(__file__))
    ours = _pressure_run(str(tmp_path / "kvactors"), "kvactors", 8)
    theirs = _pressure_run(str(tmp_path / "vllm"), "vllm", 8)
    st = ours["stats"]
    print(f"\nsteps: kvactors {ours['steps']}, vLLM {theirs['steps']}; slowest request: kvactors "
          f"{max(ours['took'].values())}, vLLM {max(theirs['took'].values())}; blocks loaded and checked: "
          f"kvactors {ours['loaded']}, vLLM {theirs['loaded']}; promotions refused {st.get('promotions_refused')}")
    assert len(ours["took"]) == len(theirs["took"]) == 36
    assert ours["steps"] <= 1.5 * theirs["steps"], (ours["steps"], theirs["steps"])
    assert max(ours["took"].values()) <= 1.5 * max(theirs["took"].values()) + 6, (ours["took"], theirs["took"])
    assert ours["loaded"] >= theirs["loaded"]
    assert st["contract_violations"] == 0
    assert st["blocks_pinned"] == 0 and st["blocks_pending"] == 0 and st["jobs_in_flight"] == 0, st


@pytest.mark.timeout(300)
def test_a_tier_stuck_in_its_lookup_costs_the_scheduler_at_most_the_step_wait(tmp_path):
    """The scheduler thread waits for a lookup's answer briefly (lookup_wait_s, at most step_wait_s a
    step in all), never for a tier: with a tier that hangs in every lookup, every request still ends
    (its keys RETRY, then MISS at the step bound) and no step spends more than step_wait_s (plus
    slack for a loaded machine) inside the connector's lookups."""
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    cfg = extra(str(tmp_path), pool_blocks=16,
                tiers=[{"type": "custom", "class": "fault_tiers:HangingLookupTier"}])
    cfg["lookup_timeout_s"] = 1.0
    h = Harness(str(tmp_path), cfg, num_gpu_blocks=64, max_num_seqs=4, max_batched=256)
    run = Run(h)
    mgr = h.manager
    spent = [0.0]
    lookup = mgr.lookup

    def timed(key, rc):
        t0 = time.perf_counter()
        try:
            return lookup(key, rc)
        finally:
            spent[0] += time.perf_counter() - t0

    mgr.lookup = timed
    per_step = []
    rng = random.Random(7)
    for i in range(6):
        run.add(f"r{i}", [rng.randrange(3, 500) for _ in range(BLOCK * 4)], max_tokens=2)
    while h.scheduler.has_requests():
        spent[0] = 0.0
        run.step()
        per_step.append(spent[0])
        time.sleep(0.005)
        assert run.steps < 2000, "the run does not end"
    # The slack covers a loaded machine (a collection or a descheduled thread inside a step); a
    # step that waited for the tier would spend lookup_timeout_s, four times the bound.
    assert max(per_step) <= mgr.step_wait_s + 0.25 < cfg["lookup_timeout_s"], sorted(per_step)[-5:]
    assert mgr.counters["lookups_given_up"] > 0
    h.connector.shutdown() if hasattr(h.connector, "shutdown") else mgr.shutdown()
    h.worker.shutdown()


# ---------------------------------------------------------------- the worker on its own (CPU copiers)


def _worker(tmp_path, *, bpc, copier, groups=((40, 256, 3), (24, 128, 2)), pool_rows=24, rank=0, ranks=1):
    """A worker of ``rank`` (of ``ranks``) over made-up KV caches: ``groups`` of (blocks, page,
    tensors); a rank's part of a pool row holds ``bpc`` slots of the larger group. Returns
    (worker, tensors per group, shared pool)."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvactors.integrations.vllm.shm import SharedPool
    from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker

    gen = torch.Generator().manual_seed(1)
    tensors, refs = [], []
    for blocks, page, n in groups:
        refs.append([CanonicalKVCacheRef(len(tensors) + i, page) for i in range(n)])
        tensors += [torch.randint(-128, 127, (blocks, page), dtype=torch.int8, generator=gen) for _ in range(n)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors], refs)
    row = bpc * max(page * n for _, page, n in groups)
    shared = SharedPool(str(tmp_path / "pool"), num_blocks=pool_rows, block_bytes=row * ranks, num_writers=ranks)
    worker = KvactorsOffloadingWorker(kv, shared, rank=rank, per_worker_bytes=row, blocks_per_chunk=bpc,
                                      transfer_timeout_s=30.0, owns_shared=True, copier=copier)
    per_group, i = [], 0
    for _, _, n in groups:
        per_group.append(tensors[i:i + n])
        i += n
    return worker, per_group, shared


def _finished(worker, job_ids):
    worker.wait(set(job_ids))
    results = {r.job_id: r for r in worker.get_finished()}
    assert set(results) == set(job_ids), (sorted(results), sorted(job_ids))
    return results


WORKER_COPIERS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not __import__("kvactors.transfer.native", fromlist=["x"]).native_copy_available(),
    reason="the native copy loop is not built"))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
def test_worker_a_job_with_nothing_to_copy_succeeds_whatever_the_copier(tmp_path, copier):
    """Every group's block count 0: a success with 0 bytes, as the torch copier always did (the
    native copier refuses a job of no runs)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    worker, _, _ = _worker(tmp_path, bpc=1, copier=copier)
    try:
        worker.submit_store(1, GPULoadStoreSpec([], [0, 0], [0, 0]), CPULoadStoreSpec([]))
        result = _finished(worker, [1])[1]
        assert result.success and result.transfer_size == 0
        assert worker.store_failures == 0  # a failed store would say so here (and in its rows' status)
    finally:
        worker.shutdown()  # the worker owns the shared pool: it closes it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
@pytest.mark.parametrize("bpc", [1, 2])
def test_worker_stores_and_loads_every_group_byte_exact_where_its_rows_say(tmp_path, copier, bpc):
    """Two KV cache groups in one job, a first block that starts mid-chunk, runs that cross rows:
    each block's page of every tensor lands at its slot of its row, and comes back."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvactors.integrations.vllm.shm import STORE_OK

    worker, groups, shared = _worker(tmp_path, bpc=bpc, copier=copier)
    assert worker.copier == copier
    try:
        dev = {0: [3, 4, 5, 9, 10, 30, 31], 1: [7, 8, 2]}
        first = {0: 1, 1: 0}  # group 0's first block is block 1 of its request: slot 1 % bpc
        rows = {0: [5, 6, 7, 11, 15, 16, 17][:-(-(len(dev[0]) + first[0] % bpc) // bpc)],
                1: [12, 13, 14][:-(-len(dev[1]) // bpc)]}
        gpu = GPULoadStoreSpec(dev[0] + dev[1], [len(dev[0]), len(dev[1])], [first[0], first[1]])
        cpu = CPULoadStoreSpec(rows[0] + rows[1])
        worker.submit_store(1, gpu, cpu)
        stored = _finished(worker, [1])[1]
        page_bytes = {0: 3 * 256, 1: 2 * 128}
        assert stored.success and stored.transfer_size == sum(len(dev[g]) * page_bytes[g] for g in dev)
        for g, ts in enumerate(groups):
            skip = first[g] % bpc
            for j, block in enumerate(dev[g]):
                row, slot = rows[g][(skip + j) // bpc], (skip + j) % bpc
                for i, t in enumerate(ts):
                    page = t.shape[1]
                    at = i * bpc * page + slot * page
                    assert torch.equal(shared.pool[row, at:at + page].view(torch.int8), t[block]), (g, block, i)
        assert all(shared.status[r, 0] == STORE_OK for r in cpu.block_ids)
        before = [[t[dev[g]].clone() for t in ts] for g, ts in enumerate(groups)]
        for g, ts in enumerate(groups):
            for t in ts:
                t[dev[g]] = 0
        worker.submit_load(2, cpu, gpu)
        assert _finished(worker, [2])[2].success
        for g, ts in enumerate(groups):
            assert all(torch.equal(t[dev[g]], b) for t, b in zip(ts, before[g], strict=True))
        assert worker.bytes_stored == worker.bytes_loaded == stored.transfer_size
        assert worker.store_failures == worker.load_failures == 0
    finally:
        worker.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
def test_worker_of_rank_one_writes_its_half_of_each_row_and_its_status_column(tmp_path, copier):
    """Tensor parallelism: rank r's pages of a block lie at ``r * per_worker_bytes`` of its row."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvactors.integrations.vllm.shm import STORE_OK, STORE_PENDING

    worker, groups, shared = _worker(tmp_path, bpc=2, copier=copier, rank=1, ranks=2)
    try:
        before = shared.pool.clone()
        shared.mark_pending([3, 4])
        worker.submit_store(1, GPULoadStoreSpec([6, 7, 8], [3], [0]), CPULoadStoreSpec([3, 4]))
        _finished(worker, [1])
        half = shared.pool.shape[1] // 2
        assert torch.equal(shared.pool[:, :half], before[:, :half])  # rank 0's half untouched
        for j, block in enumerate([6, 7, 8]):
            row, slot = (3, 4)[j // 2], j % 2
            for i, t in enumerate(groups[0]):
                at = half + i * 2 * 256 + slot * 256
                assert torch.equal(shared.pool[row, at:at + 256].view(torch.int8), t[block])
        assert shared.status[3].tolist() == [STORE_PENDING, STORE_OK] and not shared.stored_ok(3)
    finally:
        worker.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
def test_worker_fault_injector_sees_the_job_id_and_rows(tmp_path, copier):
    """``(direction, job_id, rows)``: vLLM's job, no made-up request or keys (issue 37 item 7). A
    raising store is reported done to vLLM (it asserts success) and marked failed in the status
    table; nothing of it reaches the pool."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvactors.integrations.vllm.shm import STORE_FAILED

    worker, _, shared = _worker(tmp_path, bpc=1, copier=copier)
    calls = []

    def inject(direction, job_id, rows):
        calls.append((direction, job_id, rows))
        if direction == "offload":
            raise OSError("planted")

    worker.fault_injector = inject
    try:
        before = shared.pool.clone()
        worker.submit_store(7, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([3, 4]))
        worker.submit_load(8, CPULoadStoreSpec([5]), GPULoadStoreSpec([6], [1], [0]))
        results = _finished(worker, [7, 8])
        assert results[7].success and results[8].success  # vLLM asserts it; kvactors learns from the status
        assert calls == [("offload", 7, (3, 4)), ("onboard", 8, (5,))]
        assert shared.status[3, 0] == STORE_FAILED and shared.status[4, 0] == STORE_FAILED
        assert torch.equal(shared.pool, before)
        assert worker.store_failures == 1 and worker.load_failures == 0
    finally:
        worker.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
def test_worker_spec_outside_the_caches_fails_its_job_not_the_engine(tmp_path, copier):
    """A device block or a pool row out of range fails that job (counted, reported once), moves no
    byte, and the next job runs."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    worker, groups, shared = _worker(tmp_path, bpc=1, copier=copier)
    try:
        before = shared.pool.clone()
        worker.submit_store(1, GPULoadStoreSpec([39, 40], [2], [0]), CPULoadStoreSpec([0, 1]))  # block 40: none
        worker.submit_store(2, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([24]))  # row 24: none
        worker.submit_load(3, CPULoadStoreSpec([0]), GPULoadStoreSpec([1, 2], [2], [0]))  # 2 blocks, 1 row
        results = _finished(worker, [1, 2, 3])
        assert all(r.success for r in results.values())
        assert worker.store_failures == 2 and worker.load_failures == 1
        assert torch.equal(shared.pool, before)
        worker.submit_store(4, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
        _finished(worker, [4])
        assert torch.equal(shared.pool[0, :256].view(torch.int8), groups[0][0][1])
        assert worker.store_failures == 2
    finally:
        worker.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", WORKER_COPIERS)
def test_worker_spec_that_aliases_a_row_or_a_block_fails_its_job_and_moves_no_byte(tmp_path, copier):
    """The groups' slots share a pool row's bytes and the copies run in parallel: a store that
    puts two groups (or one slot twice) in a row, a load that writes a device block twice, or
    one that reads a row for two groups, fails that job alone and moves no byte."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    worker, groups, shared = _worker(tmp_path, bpc=2, copier=copier)
    try:
        before = shared.pool.clone(), [t.clone() for ts in groups for t in ts]
        worker.submit_store(1, GPULoadStoreSpec([3, 4, 7], [2, 1], [0, 0]), CPULoadStoreSpec([5, 5]))
        worker.submit_store(2, GPULoadStoreSpec([3, 4, 5], [3], [0]), CPULoadStoreSpec([5, 5]))
        worker.submit_load(3, CPULoadStoreSpec([5]), GPULoadStoreSpec([6, 6], [2], [0]))
        worker.submit_load(4, CPULoadStoreSpec([5, 5]), GPULoadStoreSpec([3, 7], [1, 1], [0, 0]))
        # Right behind them (a torch copier batches it with them): a load that is fine succeeds.
        worker.submit_load(5, CPULoadStoreSpec([9]), GPULoadStoreSpec([20], [1], [0]))
        _finished(worker, [1, 2, 3, 4, 5])
        assert worker.store_failures == 2 and worker.load_failures == 2
        assert torch.equal(shared.pool, before[0])
        expected = [t.clone() for t in before[1]]
        for i, t in enumerate(expected[:3]):  # group 0's three tensors: block 20 from row 9, slot 0
            t[20] = before[0][9, i * 2 * 256:i * 2 * 256 + 256].view(torch.int8)
        assert all(torch.equal(a, b) for a, b in zip([t for ts in groups for t in ts], expected, strict=True))
    finally:
        worker.shutdown()


@pytest.mark.timeout(120)
def test_worker_shutdown_closes_its_pool_once_and_fails_later_jobs(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvactors.integrations.vllm.worker import WORKERS

    worker, _, shared = _worker(tmp_path, bpc=1, copier="auto")
    worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
    assert worker._registration is None  # no CUDA: nothing registered, nothing to unregister
    worker.shutdown()
    assert not os.path.exists(shared.path) and worker not in WORKERS
    assert [r.job_id for r in worker.get_finished()] == [1]  # ended before the pool was closed
    worker.shutdown()  # twice: nothing more
    worker.submit_store(2, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    assert worker.store_failures == 1


@pytest.mark.timeout(120)
def test_worker_shutdown_leaves_copier_and_pool_to_a_job_that_outlives_the_wait(tmp_path):
    """Each job has the deadline ``transfer_timeout_s`` from its submit, which the copier enforces.
    A job still in flight after the shutdown's wait (a copy hung inside a run) may still write into
    the pool: the ``Copier`` protocol allows no shutdown then, so the copier runs on and the pool stays."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    worker, _, shared = _worker(tmp_path, bpc=1, copier="torch")
    copier, held, stopped = worker._copier, [], []
    worker._copier = type("HungCopier", (), {"submit": lambda self, job: held.append(job),
                                              "shutdown": lambda self: stopped.append(True),
                                              "owns_current_thread": lambda self: False})()
    worker.transfer_timeout_s = 0.2
    worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
    (job,) = held
    assert job.deadline == job.submitted + 0.2 and job.timeout_s == 0.2
    worker.shutdown()
    assert not stopped and os.path.exists(shared.path)  # nothing released under the job
    worker._copied(job, None)  # the copy ends at last
    assert [r.job_id for r in worker.get_finished()] == [1]
    copier.shutdown()
    shared.close(unlink=True)


@pytest.mark.timeout(60)
def test_worker_shutdown_on_a_copier_thread_is_refused(tmp_path):
    """The ``Copier`` protocol: shutdown never runs on the copier's own thread, which would wait for itself."""
    worker, _, shared = _worker(tmp_path, bpc=1, copier="torch")
    copier = worker._copier
    worker._copier = type("OwnThreadCopier", (), {"owns_current_thread": lambda self: True})()
    with pytest.raises(RuntimeError, match="copier's threads"):
        worker.shutdown()
    worker._copier = copier
    worker.shutdown()  # not closed by the refused call: this one stops it
    assert not os.path.exists(shared.path)


@pytest.mark.timeout(60)
def test_worker_copier_choice_is_checked(tmp_path):
    with pytest.raises(ValueError, match="copier must be one of"):
        _worker(tmp_path, bpc=1, copier="fast")


# ---------------------------------------------------------------- compat


@pytest.mark.timeout(60)
def test_offload_key_positions_are_read_from_vllms_context_and_fail_loudly_elsewhere():
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    from kvactors.integrations.vllm import compat

    compat.require_key_positions()
    rc = VReqContext("r1")
    rc.set_offload_key_position(b"key-a", 32)
    assert dict(compat.offload_key_positions(rc)) == {b"key-a": 32}
    with pytest.raises(compat.VllmCompatError, match=r"vLLM 0\.33.*_offload_key_positions"):
        compat.offload_key_positions(object())
    assert not hasattr(compat, "HAS_CONFIG_INFO")


# ---------------------------------------------------------------- the manager's lock


def _bare_manager():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvactors import TieringManager
    from kvactors.integrations.vllm.manager import KvactorsOffloadingManager

    tm = TieringManager.start(num_blocks=8, block_bytes=64)
    return KvactorsOffloadingManager(tm, None, events_enabled=False, tier_kinds={}, hit_source=CacheHitSource.HOST,
                                     owns_shared=False)


def _key(i):
    return b"key%05d" % i + b"\0\0\0\0"


def _blocked(fn, entered, release):
    """``fn`` whose first call waits for ``release`` (after setting ``entered``); later calls do not."""
    first = [True]

    def call(*args, **kwargs):
        if first[0]:
            first[0] = False
            entered.set()
            assert release.wait(30), "never released"
        return fn(*args, **kwargs)
    return call


@pytest.mark.timeout(120)
def test_prepare_store_waits_for_the_tiering_manager_without_the_lock(tmp_path):
    """While prepare_store is in the TieringManager, the lock is free (the lookup thread posts its
    answers); the store is recorded for its attempt once the call returns."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    mgr = _bare_manager()
    entered, release = threading.Event(), threading.Event()
    mgr.tm.prepare_store = _blocked(mgr.tm.prepare_store, entered, release)
    rc = VReqContext("r1")
    mgr.on_new_request(rc)
    out = []
    caller = threading.Thread(target=lambda: out.append(mgr.prepare_store([_key(1), _key(2)], rc)))
    caller.start()
    try:
        assert entered.wait(30)
        assert mgr._lock.acquire(timeout=5), "prepare_store holds the manager's lock while it waits"
        mgr._lock.release()
    finally:
        release.set()
        caller.join(30)
    assert not caller.is_alive() and out[0] is not None and list(out[0].keys_to_store) == [_key(1), _key(2)]
    mgr.complete_store([_key(1), _key(2)], rc)
    mgr.on_request_finished(rc)
    assert mgr.tm.wait_idle(30)
    stats = mgr.stats()
    assert stats["blocks_ready"] == 2 and stats["blocks_pending"] == 0 and stats["vllm_tracked_requests"] == 0
    mgr.shutdown()


@pytest.mark.timeout(120)
def test_prepare_load_outside_the_lock_keeps_a_pin_the_lookup_thread_posts_meanwhile(tmp_path):
    """prepare_load of a key vLLM found itself pins it in the TieringManager without the lock; a
    lookup answered for the same key meanwhile posts its own pin. Both pins end: nothing stays
    pinned once the load completes and the request finishes."""
    import threading

    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    mgr = _bare_manager()
    writer = VReqContext("writer")
    mgr.on_new_request(writer)
    mgr.prepare_store([_key(1)], writer)
    mgr.complete_store([_key(1)], writer)
    mgr.on_request_finished(writer)
    assert mgr.tm.wait_idle(30)

    entered, release = threading.Event(), threading.Event()
    mgr.tm.prepare_load = _blocked(mgr.tm.prepare_load, entered, release)
    rc = VReqContext("reader")
    mgr.on_new_request(rc)
    rows = []
    caller = threading.Thread(target=lambda: rows.append(mgr.prepare_load([_key(1)], rc)))
    caller.start()
    try:
        assert entered.wait(30)
        answers = []
        asker = threading.Thread(target=lambda: answers.append(mgr.lookup(_key(1), rc)))
        asker.start()
        asker.join(10)
        assert not asker.is_alive(), "lookup waited for the manager's lock held by prepare_load"
        req = mgr._requests.get("reader")
        assert req.job is None or req.job.done.wait(10)
    finally:
        release.set()
        caller.join(30)
    assert not caller.is_alive() and len(rows[0].block_ids) == 1
    assert answers[0] in (VLookup.HIT, VLookup.RETRY)
    mgr.complete_load([_key(1)], rc)
    mgr.on_request_finished(rc)
    assert mgr.tm.wait_idle(30)
    stats = mgr.stats()
    assert stats["blocks_pinned"] == 0 and stats["contract_violations"] == 0, stats
    assert stats["vllm_tracked_requests"] == 0
    mgr.shutdown()
