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


@pytest.mark.timeout(60)
def test_the_first_payload_puts_every_known_series_in_vllms_metrics_at_zero():
    """Issue 34 item 2: through vLLM's own frontend (OffloadPromMetrics), the first payload makes
    every series each family knows (each tier, kind, outcome, state), at 0, before anything
    counted; a later payload with nothing new sends nothing."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

    from kvactors import MemoryTier
    from kvactors.metrics import FAMILIES, known_series

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    extra = {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
             "cpu_bytes_to_use": 1 << 20}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = OffloadPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})

    tm = TieringManager.start(num_blocks=8, block_bytes=16, secondary_tiers=[MemoryTier(name="disk",
                                                                                        capacity_blocks=8)])
    reporter = StatsReporter(tm, interval_s=0.0)
    try:
        payload = reporter.payload(tm.metrics_snapshot())
        assert payload is not None
        prom.observe(payload.data, 0)
        assert reporter.payload(tm.metrics_snapshot()) is None  # nothing changed since
    finally:
        reporter.close()
        tm.stop()
    label_names = {f.name: f.labels for f in FAMILIES}
    seen: dict[str, set[tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            names = label_names.get(family.name, ())
            seen.setdefault(sample.name, set()).add(tuple(sample.labels[k] for k in names))
            if sample.name.startswith("kvactors_") and not sample.name.startswith("kvactors_pool_blocks") \
                    and not sample.name.endswith("_created"):
                assert sample.value == 0, sample
    known = known_series(["disk"])
    for family in FAMILIES:
        name = family.name + {"counter": "_total", "gauge": "", "histogram": "_count"}[family.kind]
        assert seen.get(name) == set(known[family.name]), family.name
    assert ("disk",) in seen["kvactors_hit_keys_total"]
