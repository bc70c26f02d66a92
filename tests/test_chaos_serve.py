"""The pure parts of scripts/chaos_serve.py (the run itself: tests/vllm/test_chaos_serve_032.py)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "chaos_serve.py"

pytestmark = pytest.mark.timeout(120)


def load_script():
    spec = importlib.util.spec_from_file_location("chaos_serve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_serve"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cs = load_script()


@pytest.mark.parametrize("argv, says", [
    (["--rate", "0"], "--rate: must be positive"),
    (["--clients", "x"], "--clients: not a int"),
    (["--clients", "65"], "--clients: at most 64"),
    (["--window-s", "nan"], "--window-s: must be positive"),
    (["--max-tokens", "100"], "--max-tokens: at most 64"),
    (["--soak-requests", "-3"], "--soak-requests"),
    (["--bogus"], "unrecognized arguments"),
])
def test_a_bad_option_exits_2_with_one_line(argv, says):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chaos_serve: error: ") and says in lines[0], proc.stderr
    assert proc.stdout == ""


def test_a_non_empty_workdir_is_refused(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit) as exc:
        cs.parse_args(["--workdir", str(tmp_path)])
    assert exc.value.code == 2


def test_quick_and_full_plans_and_overrides():
    quick = cs.plan(cs.parse_args(["--quick"]))
    full = cs.plan(cs.parse_args([]))
    assert quick.soak_requests < 1000 <= 20_000 <= full.soak_requests
    assert quick.window_s < full.window_s
    mine = cs.plan(cs.parse_args(["--quick", "--rate", "3", "--soak-requests", "50"]))
    assert (mine.rate, mine.soak_requests, mine.window_s) == (3.0, 50, quick.window_s)


def test_percentile_is_nearest_rank():
    assert cs.percentile([], 99) is None
    assert cs.percentile([5.0], 99) == 5.0
    values = [float(i) for i in range(1, 101)]
    assert cs.percentile(values, 99) == 99.0
    assert cs.percentile(values, 100) == 100.0
    assert cs.percentile(values[::-1], 50) == 50.0


def rec(phase="f", ok=True, probe=None, text="", sent=0.0, end=1.0, first=0.1, error=""):
    return cs.Record(phase=phase, server="s", sent=sent, end=end, ok=ok, probe=probe,
                     first=first if ok else None, text=text, error=error)


def test_fault_figures_count_failures_wrong_probes_and_ttft():
    reference = {0: "a", 1: "b"}
    records = [
        rec(probe=0, text="a", first=0.1), rec(probe=1, text="x", first=0.2),  # one wrong probe
        rec(probe=2, text="c", first=0.3),  # a probe the reference never answered: wrong
        rec(first=0.05), rec(ok=False, error="boom"),
        rec(phase="other", ok=False), rec(phase="other", probe=0, text="zzz"),  # another phase's: not counted
    ]
    f = cs.fault_figures("f", records, reference, limit_ms=250.0)
    assert (f["requests"], f["requests_failed"], f["wrong_outputs"], f["probes"]) == (5, 1, 2, 3)
    assert f["ttft_p99_ms"] == 300.0 and f["ttft_p99_limit_ms"] == 250.0
    assert f["errors"] == ["boom"] and not f["ok"]
    good = cs.fault_figures("f", records[:1] + records[3:4], reference, limit_ms=250.0)
    assert good["ok"] and good["requests_failed"] == 0 and good["wrong_outputs"] == 0


def test_a_request_in_flight_at_a_stop_is_classified_not_failed():
    records = [rec(ok=False, sent=1.0, end=3.0), rec(ok=False, sent=4.0, end=5.0), rec(sent=0.0, first=0.1)]
    f = cs.fault_figures("f", records, {}, limit_ms=1000.0, stops=[2.0])
    assert (f["in_flight_at_stop"], f["requests_failed"]) == (1, 1)
    assert cs.fault_figures("f", records[:1] + records[2:], {}, 1000.0, stops=[2.0])["ok"]


def test_extra_wrong_outputs_and_an_empty_phase_fail_the_fault():
    assert cs.fault_figures("f", [rec()], {}, 1000.0, extra_wrong=1)["wrong_outputs"] == 1
    empty = cs.fault_figures("f", [], {}, 1000.0)
    assert empty["requests"] == 0 and empty["ttft_p99_ms"] is None and not empty["ok"]


def test_reference_answers_take_the_most_frequent_text_and_count_unstable_probes():
    records = [rec(probe=0, text="a"), rec(probe=0, text="a"), rec(probe=0, text="b"), rec(probe=1, text="c"),
               rec(probe=2, ok=False)]
    answers, unstable = cs.reference_answers(records)
    assert answers == {0: "a", 1: "c"} and unstable == 1


def test_rss_growth_is_last_over_first_after_warmup():
    samples = [(float(i), v) for i, v in enumerate([50, 100, 100, 101, 102, 110])]
    assert cs.rss_growth(samples, warmup_fraction=0.2) == pytest.approx(110 / 100)
    assert cs.rss_growth(samples[:1]) is None
    assert cs.rss_growth([(0.0, 0), (1.0, 5)], warmup_fraction=0.0) is None


def fault(name, **kw):
    out = {"name": name, "requests": 10, "requests_failed": 0, "in_flight_at_stop": 0, "wrong_outputs": 0,
           "probes": 3, "ttft_p99_ms": 100.0, "ttft_p99_limit_ms": 200.0}
    out.update(kw)
    return out


def summary(faults, **kw):
    args = {"other_failed": 0, "other_wrong": 0, "soak": {"requests": 500, "rss_growth": 1.01,
                                                          "tiers_within_capacity": True},
            "clean_stops": [{"check_log_ok": True, "shm": []}], "shm_left": [], "max_rss_growth": 1.1,
            "skipped": {}}
    args.update(kw)
    return cs.summarize(faults, **args)


def test_summary_totals_and_every_check():
    good = [fault(n) for n in cs.FAULTS]
    s = summary(good)
    assert s["ok"] and all(s["checks"].values())
    assert (s["requests_failed"], s["wrong_outputs"], s["soak_requests"], s["soak_rss_growth"]) == (0, 0, 500, 1.01)
    for k in ("faults", "requests_failed", "wrong_outputs", "soak_requests", "soak_rss_growth", "shm_left"):
        assert k in s
    bad = [fault(n, requests_failed=1, in_flight_at_stop=2) if n == "sigterm" else fault(n) for n in cs.FAULTS]
    s = summary(bad, other_wrong=2)
    assert (s["requests_failed"], s["wrong_outputs"], s["in_flight_at_stop"]) == (1, 2, 2) and not s["ok"]
    assert not summary(good[:-1])["checks"]["every_fault_ran"]
    assert not summary(good, skipped={"disk_full": "no mount"})["checks"]["every_fault_ran"]
    slow = [fault(n, ttft_p99_ms=201.0) if n == "tier_stall" else fault(n) for n in cs.FAULTS]
    assert not summary(slow)["checks"]["ttft_under_limit"]
    assert not summary(good, shm_left=["/dev/shm/kvactors_pool_x"])["checks"]["nothing_in_dev_shm"]
    assert not summary(good, clean_stops=[{"check_log_ok": False, "shm": []}])["checks"]["clean_stops_checked"]
    grown = {"requests": 500, "rss_growth": 1.5, "tiers_within_capacity": True}
    assert not summary(good, soak=grown)["checks"]["soak_rss_flat"]
    assert math.isclose(summary(good)["soak_rss_growth"], 1.01)
    assert "| tier_stall |" in cs.table(s)


def test_disk_bytes_by_writer_leave_another_live_servers_files_out(tmp_path):
    (tmp_path / "g-0000000000000001-aaaa-00000000.kvg").write_bytes(b"x" * 100)
    (tmp_path / "g-0000000000000002-bbbb-00000000.kvg").write_bytes(b"x" * 30)
    (tmp_path / ".tmp-aaaa-1").write_bytes(b"x" * 7)
    by = cs.bytes_by_writer(str(tmp_path))
    assert by == {"aaaa": 100, "bbbb": 30, "": 7}
    assert cs.own_disk_bytes([by, {"aaaa": 200, "bbbb": 30}], others={"bbbb"}) == 200
    assert cs.own_disk_bytes([], others=set()) == 0
    assert cs.newest_writers(str(tmp_path), since=0.0) == {"aaaa", "bbbb"}
