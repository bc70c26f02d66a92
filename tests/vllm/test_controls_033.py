"""vLLM 0.33's real Scheduler: the controls of docs/controls.md, set as a router sets them.

Per-request ``kv_transfer_params`` (``kv_load_tiers``, ``max_load_tokens``, ``max_offload_tokens``,
bad values), each tier's ``admission`` and ``max_queued_bytes``, and a tier far slower than the
traffic (the manager's memory and the scheduler's step time stay bounded)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33"):
    pytest.skip("runs on vllm 0.33", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import control_tiers  # noqa: E402
from sched_harness import BLOCK, LAYERS, Harness, Run  # noqa: E402

PAGE_BYTES = 2 * BLOCK * 8 * 2  # K and V, 1 head of 8, float16
BLOCK_BYTES = PAGE_BYTES * LAYERS  # one offloaded block: its page in every layer


def extra(tmp, *, pool_blocks, tiers, **more):
    return {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "cpu_bytes_to_use": pool_blocks * BLOCK_BYTES, "tiers": tiers, "transfer_timeout_s": 30.0,
            "lookup_timeout_s": 2.0, "event_log": os.path.join(tmp, "events.kvlog"), **more}


def add(run: Run, req_id: str, tokens: list[int], max_tokens: int, params: dict | None = None) -> None:
    """A request as a router sends it: its kv_transfer_params in the sampling params' extra_args."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    request = Request(req_id, tokens, sp, None, block_hasher=run.hasher)
    assert request.kv_transfer_params == params
    run.h.scheduler.add_request(request)


def finish(run: Run, req_id: str, limit: int = 2000) -> None:
    for _ in range(limit):
        if req_id not in run.h.scheduler.requests:
            return
        run.step()
    raise AssertionError(f"{req_id} did not finish")


def settle(h: Harness) -> None:
    assert h.manager.tm.wait_idle(60.0)


def steps_until(run: Run, done, limit: int = 400) -> None:
    """Step (the worker's transfers complete over the next steps) until ``done()``."""
    for _ in range(limit):
        if done():
            return
        run.step()
        run.h.manager.tm.wait_idle(10.0)
    assert done()


def tier_stats(h: Harness) -> dict:
    return h.manager.tm.stats()


def check_log(tmp) -> None:
    h_log = os.path.join(tmp, "events.kvlog")
    check = subprocess.run([sys.executable, "-m", "kvactors.cli", "check-log", h_log],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def shut(h: Harness) -> None:
    h.connector.shutdown() if hasattr(h.connector, "shutdown") else h.manager.shutdown()
    h.worker.shutdown()


def events(tmp, name: str) -> list[dict]:
    with open(os.path.join(tmp, "events.kvlog")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == name]


def prefix(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(blocks * BLOCK)]


# --------------------------------------------------------------------- per-request controls


@pytest.mark.timeout(300)
def test_kv_load_tiers_max_load_and_max_offload_tokens_per_request(tmp_path):
    tmp = str(tmp_path)
    tiers = [{"type": "memory", "capacity_blocks": 64},  # CPU / LOCAL
             {"type": "custom", "class": "control_tiers:RemoteMemoryTier"}]  # STORAGE / REMOTE
    h = Harness(tmp, extra(tmp, pool_blocks=64, tiers=tiers), num_gpu_blocks=64, max_num_seqs=4, max_batched=512)
    run = Run(h)
    tm = h.manager.tm
    p = prefix(1, 6)
    add(run, "A", [*p, 5, 6, 7], max_tokens=2)
    finish(run, "A")
    steps_until(run, lambda: tier_stats(h)["blocks_ready"] >= 6 and tier_stats(h)["blocks_pending"] == 0)

    # max_load_tokens: from the pool, at most 2 blocks for this request.
    h.scheduler.reset_prefix_cache()  # the engine's own cache: the prefix must come from kvactors
    loaded = h.manager.counters["keys_loaded"]
    add(run, "B", [*p, 8, 9], max_tokens=2, params={"max_load_tokens": 2 * BLOCK})
    finish(run, "B")
    assert h.manager.counters["keys_loaded"] - loaded == 2

    # kv_load_tiers: the pool emptied, the blocks only in the tiers; a request that may load from
    # remote storage only is promoted from it, never asks the local memory tier.
    def promotions() -> dict:
        snap = tm.metrics_snapshot()
        return {tier: snap.jobs_started.get((tier, "promotion"), 0) for tier in tm.tier_names[1:]}

    for n, (params, expect) in enumerate([
        ({"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]}, {"remote"}),
        ({"kv_load_tiers": [{"medium": "CPU"}]}, {"memory"}),
        ({"kv_load_tiers": []}, set()),
    ]):
        h.scheduler.reset_prefix_cache(reset_connector=True)
        settle(h)
        assert tier_stats(h)["blocks_ready"] == 0
        before, loaded = promotions(), h.manager.counters["keys_loaded"]
        add(run, f"C{n}", [*p, 10 + n], max_tokens=2, params=params)
        finish(run, f"C{n}")
        settle(h)
        after = promotions()
        promoted = {tier for tier in after if after[tier] > before[tier]}
        assert promoted == expect, (params, before, after)
        assert (h.manager.counters["keys_loaded"] > loaded) == bool(expect)

    # max_load_tokens bounds promotions too: no more is promoted than the request may load.
    h.scheduler.reset_prefix_cache(reset_connector=True)
    settle(h)
    snap = tm.metrics_snapshot()
    loaded_blocks = sum(v for (tier, kind), v in snap.jobs_started.items() if kind == "promotion")
    before_keys = sum(snap.loaded_blocks.get(t, 0) for t in tm.tier_names[1:])
    add(run, "D", [*p, 30], max_tokens=2, params={"max_load_tokens": 3 * BLOCK})
    finish(run, "D")
    settle(h)
    snap = tm.metrics_snapshot()
    assert sum(v for (tier, kind), v in snap.jobs_started.items() if kind == "promotion") > loaded_blocks
    assert sum(snap.loaded_blocks.get(t, 0) for t in tm.tier_names[1:]) - before_keys <= 3

    # max_offload_tokens: a long prompt stores at most 2 blocks.
    stored = h.manager.counters["keys_stored"]
    add(run, "E", prefix(2, 8), max_tokens=2, params={"max_offload_tokens": 2 * BLOCK})
    finish(run, "E")
    for _ in range(20):
        run.step()
    settle(h)
    assert 0 < h.manager.counters["keys_stored"] - stored <= 2

    assert run.checked_loaded > 0  # the loaded blocks held their bytes (Run checks each)
    assert tier_stats(h)["contract_violations"] == 0
    shut(h)
    check_log(tmp)


@pytest.mark.timeout(300)
def test_bad_kv_transfer_params_are_ignored_and_logged_never_an_engine_failure(tmp_path):
    tmp = str(tmp_path)
    h = Harness(tmp, extra(tmp, pool_blocks=32, tiers=[{"type": "memory", "capacity_blocks": 32}]),
                num_gpu_blocks=64)
    run = Run(h)
    bad = {"kv_load_tiers": "everywhere", "max_load_tokens": -1, "max_offload_tokens": "lots"}
    add(run, "bad", [*prefix(3, 3), 1], max_tokens=4, params=bad)
    add(run, "worse", [*prefix(4, 3), 1], max_tokens=4, params={"kv_load_tiers": [{"medium": "GPU"}, 7]})
    finish(run, "bad")
    finish(run, "worse")
    settle(h)
    assert tier_stats(h)["contract_violations"] == 0
    shut(h)
    ignored = {(e["req_id"], e["param"]) for e in events(tmp, "request_param_ignored")}
    assert {("bad", "kv_load_tiers"), ("bad", "max_load_tokens"), ("bad", "max_offload_tokens"),
            ("worse", "kv_load_tiers[0].medium"), ("worse", "kv_load_tiers[1]")} <= ignored
    check_log(tmp)


def test_kv_load_tiers_parse_as_vllm_parses_them():
    """kvactors' parse against vLLM's own _parse_tier_filter and TierFilter.allows."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _parse_tier_filter
    from vllm.v1.kv_offload.base import Locality, Medium

    from kvactors.core.request_params import parse_request_params

    values = [None, [], [{}], "CPU", 3, {"medium": "CPU"}, [{"medium": "cpu"}], [{"locality": "remote"}],
              [{"medium": "GPU"}], [{"medium": "GPU"}, {"medium": "STORAGE"}], ["x"], [{"medium": 5}],
              [{"medium": "Storage", "locality": "LOCAL"}, {"locality": "REMOTE"}], [{"locality": "moon"}, {}]]
    for raw in values:
        ours = parse_request_params({"kv_load_tiers": raw})
        theirs = None if raw is None else _parse_tier_filter(raw)
        for medium in Medium:
            for locality in Locality:
                expected = True if theirs is None else theirs.allows(medium, locality)
                assert ours.allows(medium.value, locality.value) == expected, (raw, medium, locality)


# --------------------------------------------------------------------- admission and back-pressure


@pytest.mark.timeout(600)
def test_admission_per_tier_under_pool_pressure(tmp_path):
    """write_back and min_seen tiers beside a write-through one, a pool a fraction of the working set,
    preemptions and aborts: the contract holds (check-log), loaded bytes are right, and the
    write-back tier received blocks only as the pool evicted them."""
    from vllm.v1.request import RequestStatus

    tmp = str(tmp_path)
    tiers = [{"type": "memory", "name": "wb", "capacity_blocks": 256, "admission": "write_back"},
             {"type": "disk", "root": str(tmp_path / "disk"), "capacity_bytes": 8 << 20,
              "admission": {"min_seen": 2}},
             {"type": "memory", "name": "wt", "capacity_blocks": 256}]
    h = Harness(tmp, extra(tmp, pool_blocks=24, tiers=tiers), num_gpu_blocks=40, max_num_seqs=8, max_batched=192)
    run = Run(h)
    rng = random.Random(7)
    prefixes = [prefix(100 + i, rng.choice((2, 4, 6))) for i in range(8)]
    n_requests, added = 160, 0
    while added < n_requests or h.scheduler.has_requests():
        while added < n_requests and len(h.scheduler.requests) < 12:
            tokens = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 3 * BLOCK))]
            add(run, f"r{added}", tokens, max_tokens=rng.randrange(8, 48))
            added += 1
        if rng.random() < 0.03 and h.scheduler.requests:
            h.scheduler.finish_requests(rng.choice(list(h.scheduler.requests)), RequestStatus.FINISHED_ABORTED)
        if added % 40 == 0:
            h.scheduler.reset_prefix_cache()  # the engine's own cache only: hits come from kvactors
        run.step()
        assert run.steps < 20000
    for _ in range(10):
        run.step()
    settle(h)
    stats = tier_stats(h)
    snap = h.manager.tm.metrics_snapshot()
    started = {tier: snap.jobs_started.get((tier, "cascade"), 0) for tier in ("wb", "disk", "wt")}
    print("\nstats", {k: v for k, v in stats.items() if "cascade" in k or "write" in k or "seen" in k}, started)
    assert stats["contract_violations"] == 0 and stats["internal_errors"] == 0
    assert stats["blocks_pinned"] == 0 and stats["jobs_in_flight"] == 0
    assert stats["write_back_jobs"] > 0 and started["wb"] == stats["write_back_jobs"]
    assert started["disk"] > 0 and started["wt"] > 0
    assert stats["seen_keys"] > 0
    assert run.checked_loaded > 0
    shut(h)
    check_log(tmp)


@pytest.mark.timeout(600)
def test_a_tier_100x_slower_than_the_traffic_keeps_memory_and_step_time_bounded(tmp_path):
    tmp = str(tmp_path)
    bound = 4 * BLOCK_BYTES
    tiers = [{"type": "custom", "class": "control_tiers:TrackedSlowTier", "kwargs": {"delay_s": 3.0},
              "max_queued_bytes": bound},
             {"type": "memory", "capacity_blocks": 128}]
    control_tiers.SLOW.clear()
    h = Harness(tmp, extra(tmp, pool_blocks=48, tiers=tiers), num_gpu_blocks=64, max_num_seqs=8, max_batched=256)
    slow = control_tiers.SLOW[-1]
    run = Run(h)
    tm = h.manager.tm
    rng = random.Random(11)
    n_requests, added, worst_step, worst_queued, worst_pinned = 120, 0, 0.0, 0, 0
    started = time.monotonic()
    while added < n_requests or h.scheduler.has_requests():
        while added < n_requests and len(h.scheduler.requests) < 8:
            add(run, f"r{added}", [*prefix(1000 + added, rng.choice((1, 2, 3))), 1, 2], max_tokens=4)
            added += 1
        t0 = time.perf_counter()
        run.step()
        worst_step = max(worst_step, time.perf_counter() - t0)
        if run.steps % 10 == 0:
            stats = tm.stats()
            worst_queued = max(worst_queued, stats["cascade_bytes_queued.slow"])
            worst_pinned = max(worst_pinned, stats["blocks_pinned"])
        assert run.steps < 20000
    traffic_s = time.monotonic() - started
    stats = tm.stats()
    stored_fast = tm.metrics_snapshot().stored_blocks.get("memory", 0)
    print(f"\n{run.steps} steps in {traffic_s:.1f} s, worst step {worst_step * 1000:.0f} ms, slow tier stored "
          f"{slow.stored} blocks (the memory tier {stored_fast}), dropped {stats['cascades_dropped.slow']} cascades, "
          f"worst queued {worst_queued} B, worst pinned {worst_pinned}, tier's most jobs at once {slow.max_held}")
    # The tier is far slower than the traffic: most cascades to it were dropped, counted, the blocks kept.
    assert stored_fast >= 100 * max(slow.stored, 1) or stats["cascades_dropped.slow"] > 0
    assert stats["cascades_dropped.slow"] > 0 and stats["cascades_dropped.memory"] == 0
    # Bounded: the bytes queued for it, hence the rows its jobs pin and the jobs it holds.
    assert worst_queued <= bound and slow.max_held <= 4
    assert worst_pinned <= 4 + 8 * 6  # its pins, plus a step's stores and loads at most
    # The scheduler never waits for the tier: a step takes far less than one of its stores.
    assert worst_step < slow.delay_s / 2, worst_step
    assert len(events(tmp, "cascades_dropped")) >= 1
    settle(h)
    assert tm.stats()["cascade_bytes_queued.slow"] == 0
    shut(h)
    check_log(tmp)
