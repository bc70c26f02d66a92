"""``kvactors stress``: real threads, checked; hangs are reported, not waited on."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvactors.actors.primary import PrimaryTier
from kvactors.commands import stress
from kvactors.commands.check_log import check_file

ROOT = Path(__file__).resolve().parents[1]


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args(["--no-progress"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.mark.timeout(120)
def test_short_stress_run_is_clean_and_its_log_checks(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    # A generous hang bound: with a 10 µs switch interval a loaded machine can be slow, and a
    # slow call is not what this test is about (test_a_hang_is_reported_with_every_stack is).
    summary = stress.run_stress(_args(threads=4, requests=40, seed=7, event_log=str(log), switch_interval=1e-5,
                                      hang_after=60.0))
    assert summary["violation_list"] == []
    assert (summary["violations"], summary["leaks"], summary["pins"], summary["jobs"], summary["hangs"]) == (0,) * 5
    assert summary["requests"] == 160 and summary["operations"] > 500
    result = check_file(str(log))
    assert result.requests >= 160 and not result.errors
    assert not result.violations, "\n".join(v.format() for v in result.violations[:5])


@pytest.mark.timeout(120)
def test_cli_json_last_line_and_exit_status(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stress.py"), "--threads", "3", "--requests", "20", "--seed", "3",
         "--json", "--seconds", "30"],
        capture_output=True, text=True, env=env, timeout=100, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("operations", "requests", "violations", "leaks", "hangs", "seed"):
        assert name in summary
    assert summary["seed"] == 3 and summary["violations"] == 0 and summary["operations"] > 0


@pytest.mark.timeout(60)
def test_a_hang_is_reported_with_every_stack(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    release = threading.Event()
    prepare_store = PrimaryTier._on_prepare_store

    def stuck(self: PrimaryTier, msg: object) -> None:
        release.wait(30)  # the primary never answers: every caller's ask hangs
        prepare_store(self, msg)

    monkeypatch.setattr(PrimaryTier, "_on_prepare_store", stuck)
    PrimaryTier._handlers = {**PrimaryTier._handlers}  # handlers are looked up by name: the patch applies
    try:
        summary = stress.run_stress(_args(threads=2, requests=5, seed=1, hang_after=1.0))
    finally:
        release.set()
    assert summary["hangs"] >= 1
    err = capsys.readouterr().err
    assert "HANG: frontend" in err and "--- thread" in err and "stuck" in err


@pytest.mark.timeout(120)
def test_the_fault_options_reach_partial_lie_and_hang_on_real_tiers(monkeypatch: pytest.MonkeyPatch,
                                                                    redis_server: Any) -> None:
    """Over the disk and Redis tiers; a hang is drawn only in a call that is not inline (Redis's lookups)."""
    from kvactors.testing import faults

    drawn: list[str] = []
    plan_report, maybe_hang = faults.plan_report, faults.FaultTier._maybe_hang

    def noted_plan(job: object, mode: str, rng: object, *args: object) -> object:
        drawn.append(mode)
        return plan_report(job, mode, rng, *args)  # type: ignore[arg-type]

    def noted_hang(self: faults.FaultTier, call: str) -> float:
        stuck = maybe_hang(self, call)
        if self.hangs > drawn.count("hang"):
            drawn.append("hang")
        return stuck

    monkeypatch.setattr(faults, "plan_report", noted_plan)
    monkeypatch.setattr(faults.FaultTier, "_maybe_hang", noted_hang)
    summary = stress.run_stress(_args(threads=2, requests=30, seed=5, tiers=["disk", "redis"], hang_after=60.0,
                                      redis=redis_server.url,
                                      faults={"partial": 0.3, "lie": 0.3, "hang": 0.2}, transfer_timeout=0.2))
    assert summary["violation_list"] == []
    assert (summary["violations"], summary["leaks"], summary["pins"], summary["jobs"], summary["hangs"]) == (0,) * 5
    assert {"partial", "lie", "hang"} <= set(drawn)
