"""kvactors' metric families in the vLLM server's own ``/metrics``, through vLLM's connector metrics path.

vLLM's ``OffloadingConnector`` declares a spec's Prometheus metrics in the frontend process.
It does so with ``OffloadingSpec.build_metric_definitions``, a classmethod (:func:`metric_definitions`).
Each step that has model output, it polls the scheduler side's manager for an ``OffloadingConnectorStats``
(``OffloadingManager.get_stats``).
It ships that to the frontend with the step's stats, and applies it there.
Counters are increased by the values sent, and gauges are set.
Histograms observe each value sent.
The labels are vLLM's own (``model_name``, ``engine``), then the family's (``tier``, ``kind``, ``outcome``, ``state``).

:class:`StatsReporter` turns
:meth:`TieringManager.metrics_snapshot <kvactors.TieringManager.metrics_snapshot>` into such payloads.
The families are the same as :class:`kvactors.metrics.KvactorsCollector`'s (:data:`kvactors.metrics.FAMILIES`).

* Counters are sent as the increase since the last payload.
* Gauges are sent when they changed.
* The duration histogram is sent as one observation per job ended since.
  Each observation lies inside its bucket, at the bucket's mean where that lies in it.
  So the buckets are exact and the sum is close.

The first payload names every series each family knows (:func:`kvactors.metrics.known_series`), at 0.
A histogram series then has no observation.
So each series is in ``/metrics`` from the engine's first step with model output.
vLLM sends connector stats only with steps.

The snapshot is taken and turned into a payload off the scheduler's thread.
One helper thread does that, with at most one round trip every ``interval_s``.
A step sends the payload that was ready then.
So ``/metrics`` lags the runtime by about ``interval_s`` plus a step.
An idle engine (no steps) sends nothing until its next request.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvactors.core.counters import DURATION_BUCKETS, MetricsSnapshot
from kvactors.core.errors import ManagerStoppedError
from kvactors.logs import component_logger
from kvactors.manager import TieringManager
from kvactors.metrics import FAMILIES, KvactorsCollector

_BY_NAME = {f.name: f for f in FAMILIES}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """vLLM's declarations of kvactors' families.

    No vLLM config is needed, as the frontend calls it.
    """
    out: dict[str, OffloadingMetricMetadata] = {}
    for family in FAMILIES:
        if family.kind == "counter":
            out[family.name] = OffloadingCounterMetadata(documentation=family.doc, labelnames=family.labels)
        elif family.kind == "gauge":
            out[family.name] = OffloadingGaugeMetadata(documentation=family.doc, labelnames=family.labels)
        else:
            out[family.name] = OffloadingHistogramMetadata(documentation=family.doc, labelnames=family.labels,
                                                          buckets=DURATION_BUCKETS)
    return out


def _declare_histogram(stats: OffloadingConnectorStats, name: str, labels: tuple[str, ...]) -> None:
    """Put series ``labels`` of histogram ``name`` on ``stats``, with no observation.

    vLLM's frontend makes the series, with its buckets at 0, and observes nothing (``OffloadPromMetrics.observe``).
    It goes through ``metric_sections()``, vLLM 0.33's way for a manager to reach its own payload's data.
    vLLM 0.32 has no such method.
    There, ``data`` has the same two sections, ``types`` and ``data``.
    """
    sections = getattr(stats, "metric_sections", None)
    types, values = sections() if sections is not None else (stats.data["types"], stats.data["data"])
    types.setdefault(name, "histogram")
    values.setdefault(name, {}).setdefault(labels, [])


def _observations(counts: list[int], total_s: float) -> list[float]:
    """One value per job of per-bucket ``counts`` (``DURATION_BUCKETS`` then +Inf), each inside its
    bucket, at the jobs' mean duration where that lies in the bucket."""
    n = sum(counts)
    if n <= 0:
        return []
    mean = max(total_s, 0.0) / n
    out: list[float] = []
    lower = 0.0
    for i, count in enumerate(counts):
        upper = DURATION_BUCKETS[i] if i < len(DURATION_BUCKETS) else math.inf
        if count > 0:
            value = min(max(mean, math.nextafter(lower, math.inf) if i else 0.0), upper)
            if math.isinf(value):
                value = lower * 2
            out.extend([value] * count)
        lower = upper
    return out


class StatsReporter:
    """``get_stats`` payloads of one manager (see the module docstring).

    Threading: :meth:`take` is called from vLLM's scheduler thread only.
    The snapshot is taken and :meth:`payload` runs on one helper thread.
    That thread is the only caller of :meth:`payload`, so the books of what was sent have one writer.
    """

    def __init__(self, tm: TieringManager, *, interval_s: float = 1.0) -> None:
        self._tm = tm
        self._collector = KvactorsCollector(tm)
        self.interval_s = interval_s
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[OffloadingConnectorStats | None] | None = None
        self._asked = -math.inf
        self._closed = False
        self._failed = False
        self._log = component_logger("vllm")
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self._buckets: dict[tuple[str, tuple[str, ...]], tuple[list[float], float]] = {}

    def take(self) -> OffloadingConnectorStats | None:
        """The payload of the snapshot ready now, or None if none is or nothing changed.

        It asks for the next snapshot when ``interval_s`` has passed since the last.
        """
        if self._closed:
            return None
        out = None
        if self._future is not None and self._future.done():
            future, self._future = self._future, None
            try:
                out = future.result()
            except ManagerStoppedError:
                self._closed = True  # the runtime is gone: nothing more to ask
                return None
            except Exception as exc:  # a missed payload, never the engine's failure; said once
                if not self._failed:
                    self._failed = True
                    self._log.error("stats_failed", error=f"{type(exc).__name__}: {exc}")
        now = time.monotonic()
        if self._future is None and now - self._asked >= self.interval_s:
            self._asked = now
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvactors-vllm-metrics")
            self._future = self._executor.submit(self._next_payload)
        return out

    def _next_payload(self) -> OffloadingConnectorStats | None:
        return self.payload(self._tm.metrics_snapshot())

    def payload(self, snap: MetricsSnapshot) -> OffloadingConnectorStats | None:
        """The changes since the last payload, as vLLM's stats, or None when nothing changed."""
        stats = OffloadingConnectorStats()
        for metric in self._collector.families(snap):
            family = _BY_NAME.get(metric.name)
            if family is None:
                continue
            if family.kind == "histogram":
                self._histogram(stats, family.name, family.labels, metric.samples)
                continue
            sample_name = family.name + "_total" if family.kind == "counter" else family.name
            for sample in metric.samples:
                if sample.name != sample_name:
                    continue
                labels = tuple(str(sample.labels.get(k, "")) for k in family.labels)
                key = (family.name, labels)
                value = float(sample.value)
                if family.kind == "counter":
                    first = key not in self._counters
                    delta = value - self._counters.get(key, 0.0)
                    self._counters[key] = value
                    if delta > 0 or first:  # the first payload names every series, at 0 if so
                        stats.increase_counter(family.name, max(delta, 0.0), labels)
                elif self._gauges.get(key) != value:
                    self._gauges[key] = value
                    stats.set_gauge(family.name, value, labels)
        return None if stats.is_empty() else stats

    def _histogram(self, stats: OffloadingConnectorStats, name: str, label_names: tuple[str, ...],
                   samples: list[Any]) -> None:
        series: dict[tuple[str, ...], tuple[list[float], float]] = {}
        for sample in samples:
            labels = tuple(str(sample.labels.get(k, "")) for k in label_names)
            cumulative, total = series.setdefault(labels, ([], 0.0))
            if sample.name == name + "_bucket":
                cumulative.append(float(sample.value))
            elif sample.name == name + "_sum":
                series[labels] = (cumulative, float(sample.value))
        for labels, (cumulative, total) in series.items():
            key = (name, labels)
            if key not in self._buckets:  # the first payload names every series, empty if so
                _declare_histogram(stats, name, labels)
            before, before_total = self._buckets.get(key, ([0.0] * len(cumulative), 0.0))
            self._buckets[key] = (cumulative, total)
            if len(before) != len(cumulative):
                continue
            per_bucket = [int(c - (cumulative[i - 1] if i else 0)) - int(b - (before[i - 1] if i else 0))
                          for i, (c, b) in enumerate(zip(cumulative, before, strict=True))]
            if any(d < 0 for d in per_bucket):
                continue
            for value in _observations(per_bucket, total - before_total):
                stats.observe_histogram(name, value, labels)

    def close(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
