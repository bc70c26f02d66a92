"""vLLM 0.33: kvactors' get_stats payloads (kvactors.integrations.vllm.stats) off the scheduler's thread."""

from __future__ import annotations

import logging
import time

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33"):
    pytest.skip("runs on vllm 0.33", allow_module_level=True)

from kvactors import ReqContext, TieringManager  # noqa: E402
from kvactors.integrations.vllm.stats import StatsReporter  # noqa: E402


def _until(take, deadline_s: float = 10.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = take()
        if out is not None:
            return out
        time.sleep(0.01)  # a scheduler step's pace: take() is polled, never waited on
    return None


@pytest.mark.timeout(60)
def test_a_payload_carries_the_counters_increase_and_a_stopped_runtime_ends_the_reporter():
    tm = TieringManager.start(num_blocks=8, block_bytes=16)
    reporter = StatsReporter(tm, interval_s=0.0)
    try:
        ctx = ReqContext("r")
        tm.on_new_request(ctx)
        tm.lookup([b"k"], ctx)
        out = _until(reporter.take)
        assert out is not None and not out.is_empty()
    finally:
        tm.stop()
    assert _until(reporter.take, 2.0) is None  # the snapshot fails: closed, nothing raised
    assert reporter._closed
    reporter.close()


@pytest.mark.timeout(60)
def test_a_failing_snapshot_is_logged_once_and_never_raises(caplog):
    tm = TieringManager.start(num_blocks=8, block_bytes=16)
    reporter = StatsReporter(tm, interval_s=0.0)

    def broken():
        raise RuntimeError("boom")

    tm.metrics_snapshot = broken  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.ERROR, logger="kvactors"):
            end = time.monotonic() + 5
            while time.monotonic() < end and len([r for r in caplog.records if "stats_failed" in r.getMessage()]) < 1:
                assert reporter.take() is None
                time.sleep(0.01)
            for _ in range(20):
                assert reporter.take() is None
                time.sleep(0.01)
        assert len([r for r in caplog.records if "stats_failed" in r.getMessage()]) == 1
    finally:
        reporter.close()
        tm.stop()
