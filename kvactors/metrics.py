"""Prometheus metrics of a :class:`~kvactors.TieringManager` (extra ``metrics``: ``prometheus-client``).

:class:`KvactorsCollector` is a ``prometheus_client`` collector to register in a registry.
Every scrape reads the manager's figures in one round trip (:meth:`TieringManager.metrics_snapshot`),
however many series.
The counters themselves are plain ints the actors keep as they work (:mod:`kvactors.core.counters`).
A scrape only copies them.

The families follow.
``tier`` is ``"cpu"`` for the primary pool, else a secondary tier's name.

* ``kvactors_lookup_keys_total{tier}`` and ``kvactors_hit_keys_total{tier}`` count the keys asked at that tier,
  and the keys it answered ``HIT``.
  At ``cpu`` a hit is a key ready in the pool.
  A secondary tier is asked only the keys the pool missed.
* ``kvactors_stored_bytes_total{tier}`` and ``kvactors_loaded_bytes_total{tier}`` count the block payload
  (``block_bytes`` per block) of successful transfers.
  At ``cpu`` these are completed stores and loads, at a tier its cascades and promotions.
* ``kvactors_jobs_total{tier,kind,outcome}`` counts ended transfers.
  ``kind`` is ``store`` or ``load`` at ``cpu`` (``prepare_*`` calls completed, or past their deadline),
  and ``cascade`` or ``promotion`` for a tier's jobs.
  ``outcome`` is ``ok``, ``failed`` or ``timed_out``.
* ``kvactors_jobs_started_total{tier,kind}`` and ``kvactors_jobs_dropped_total{tier,kind}`` count the cascades
  and promotions submitted to a tier, and those failed before they reached it (a reset, a stop).
* ``kvactors_job_duration_seconds{tier,kind}`` is a histogram of a tier's cascades and promotions,
  from submit to report (or deadline).
* ``kvactors_tier_jobs_queued{tier}`` is a tier's queue depth (jobs waiting for a slot).
  ``kvactors_tier_jobs_in_flight{tier}`` is its jobs submitted and not reported.
* ``kvactors_pool_blocks{state}`` counts the rows of the pool by exclusive state
  (``ready``, ``pinned``, ``pending``, ``detached``, ``free``), summing to ``num_blocks``.
* ``kvactors_evicted_keys_total{tier}`` counts the keys evicted to make room (``cpu``).
* ``kvactors_active_requests`` and ``kvactors_lookups_in_flight`` are gauges.
* ``kvactors_contract_violations_total``, ``kvactors_lookups_timed_out_total``,
  ``kvactors_late_reports_total``, ``kvactors_requests_finalized_total`` and
  ``kvactors_internal_errors_total`` are counters.
* ``kvactors_tiers_stuck`` and ``kvactors_tier_stuck{tier}`` show the tiers stuck inside a call
  (see :func:`stuck_tiers`).

Every series exists from the start.
Each family declares the label sets it knows (:class:`Series`).
They come from the configured tier names, the job kinds and outcomes, and the pool states.
A scrape exports each of them, at 0 until it counts something (:func:`known_series`).
So a dashboard or an alert on a tier that has not been used yet reads 0, not "no data".
The one exception is the stuck-tier gauges.
They are exported only while the runtime reports them (``stats()``'s ``tiers_stuck``).

Threading: ``collect`` may run on any thread (the HTTP server's).
It blocks for one round trip to the actors.
A stopped manager yields no samples.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("kvactors.metrics needs prometheus-client: pip install 'kvactors[metrics]'") from exc

from kvactors.core.arguments import check_int
from kvactors.core.counters import DURATION_BUCKETS, OUTCOMES, Histogram, MetricsSnapshot
from kvactors.core.errors import ManagerStoppedError
from kvactors.core.jobkinds import TIER_JOB_KINDS, JobKind, JobOutcome
from kvactors.types import PRIMARY_TIER_NAME

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from kvactors.manager import TieringManager

__all__ = ["FAMILIES", "FamilyDef", "KvactorsCollector", "Series", "known_series", "serve_metrics", "stuck_tiers"]

POOL_STATES = ("ready", "pinned", "pending", "detached", "free")


class Series(enum.Enum):
    """The label sets a family knows, given the configured secondary tiers' names
    (:meth:`label_sets`): what a scrape exports from the start, each at 0."""

    NONE = "none"                      # one series, no labels
    CPU = "cpu"                        # tier="cpu"
    TIERS = "tiers"                    # each secondary tier
    CPU_AND_TIERS = "cpu_and_tiers"    # "cpu", then each secondary tier
    TIER_JOBS = "tier_jobs"            # each secondary tier x cascade, promotion
    JOBS_ENDED = "jobs_ended"          # cpu store x outcomes, cpu load ok, tier jobs x outcomes
    POOL_STATES = "pool_states"        # each pool state

    def label_sets(self, tiers: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        """The label values of every series, in the family's label order."""
        cpu = PRIMARY_TIER_NAME
        if self is Series.NONE:
            return ((),)
        if self is Series.CPU:
            return ((cpu,),)
        if self is Series.TIERS:
            return tuple((t,) for t in tiers)
        if self is Series.CPU_AND_TIERS:
            return ((cpu,), *((t,) for t in tiers))
        if self is Series.TIER_JOBS:
            return tuple((t, k) for t in tiers for k in TIER_JOB_KINDS)
        if self is Series.JOBS_ENDED:
            # The pool's loads are counted when they complete (complete_load): "ok" only.
            return (*((cpu, JobKind.STORE, o) for o in OUTCOMES), (cpu, JobKind.LOAD, JobOutcome.OK),
                    *((t, k, o) for t in tiers for k in TIER_JOB_KINDS for o in OUTCOMES))
        return tuple((state,) for state in POOL_STATES)


@dataclass(frozen=True)
class FamilyDef:
    """One family the collector yields: its name (a counter's without ``_total``), Prometheus type,
    help text, label names and the label sets it knows (:class:`Series`). Exporters that declare
    their metrics ahead (vLLM's ``OffloadingSpec.build_metric_definitions``) read :data:`FAMILIES`."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    labels: tuple[str, ...] = ()
    series: Series = Series.NONE


def _defs(kind: str, labels: tuple[str, ...], series: Series, *pairs: tuple[str, str]) -> tuple[FamilyDef, ...]:
    return tuple(FamilyDef(name, kind, doc, labels, series) for name, doc in pairs)


#: Every family :meth:`KvactorsCollector.collect` may yield (``tests/test_metrics.py`` checks the match).
FAMILIES: tuple[FamilyDef, ...] = (
    *_defs("counter", ("tier",), Series.CPU_AND_TIERS,
           ("kvactors_lookup_keys", "Keys asked at a tier (a secondary tier: keys the pool missed)."),
           ("kvactors_hit_keys", "Keys a tier answered HIT (cpu: ready in the pool)."),
           ("kvactors_stored_bytes", "Block payload stored at a tier by successful transfers."),
           ("kvactors_loaded_bytes", "Block payload loaded from a tier by successful transfers.")),
    FamilyDef("kvactors_evicted_keys", "counter", "Keys evicted to make room.", ("tier",), Series.CPU),
    FamilyDef("kvactors_jobs", "counter", "Transfers ended, by tier, kind and outcome.", ("tier", "kind", "outcome"),
              Series.JOBS_ENDED),
    *_defs("counter", ("tier", "kind"), Series.TIER_JOBS,
           ("kvactors_jobs_started", "Cascades and promotions submitted to a tier."),
           ("kvactors_jobs_dropped", "Cascades and promotions failed before reaching their tier (reset, stop).")),
    FamilyDef("kvactors_job_duration_seconds", "histogram",
              "A tier's cascades and promotions, submit to report (or deadline).", ("tier", "kind"), Series.TIER_JOBS),
    *_defs("gauge", ("tier",), Series.TIERS,
           ("kvactors_tier_jobs_queued", "Jobs waiting for a slot of their tier (queue depth)."),
           ("kvactors_tier_jobs_in_flight", "Jobs submitted to a tier and not reported yet.")),
    FamilyDef("kvactors_pool_blocks", "gauge", "Rows of the primary pool by state (they sum to num_blocks).",
              ("state",), Series.POOL_STATES),
    *_defs("gauge", (), Series.NONE,
           ("kvactors_active_requests", "Request attempts from on_new_request until finalized."),
           ("kvactors_lookups_in_flight", "Lookups waiting for the secondary tiers.")),
    *_defs("counter", (), Series.NONE,
           ("kvactors_contract_violations", "Misuse found in non-blocking calls (logged, state unchanged)."),
           ("kvactors_lookups_timed_out", "Lookups that gave up waiting for a tier (lookup_timeout_s)."),
           ("kvactors_late_reports", "Job reports that came after their deadline."),
           ("kvactors_requests_finalized", "Request attempts finalized at every tier."),
           ("kvactors_internal_errors", "Handler failures inside the runtime (should stay 0).")),
    FamilyDef("kvactors_tiers_stuck", "gauge", "Secondary tiers stuck inside a call."),
    FamilyDef("kvactors_tier_stuck", "gauge", "1 while a tier is stuck inside a call.", ("tier",), Series.TIERS),
    FamilyDef("kvactors_cascades_dropped", "counter",
              "Cascades to a tier dropped by back-pressure (max_queued_bytes); the blocks stayed in the pool.",
              ("tier",), Series.TIERS),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def known_series(tiers: Sequence[str]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Every family's known label sets (:class:`Series`), given the secondary tiers' names in
    order: what :class:`KvactorsCollector` exports from the start, at 0 until counted."""
    return {f.name: f.series.label_sets(tuple(tiers)) for f in FAMILIES}


def snapshot_tiers(snap: MetricsSnapshot) -> tuple[str, ...]:
    """The secondary tiers' names of ``snap``, in order (the runtime keys its per-tier
    counters by every configured tier from its start)."""
    return tuple(t for t in snap.lookup_keys if t != PRIMARY_TIER_NAME)
_TYPES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def _family(name: str, **value: float) -> Any:
    """An empty family ``name`` as :data:`FAMILIES` declares it (type, help, labels).

    A label-less one may be given its ``value`` at once.
    """
    d = _BY_NAME[name]
    if value:
        return _TYPES[d.kind](name, d.doc, **value)
    return _TYPES[d.kind](name, d.doc, labels=list(d.labels))


def stuck_tiers(stats: dict[str, int | float]) -> tuple[int | None, dict[str, int]]:
    """How many tiers ``stats()`` reports stuck, and which.

    Reads ``stats["tiers_stuck"]`` (a count) and ``stats["tier_stuck.NAME"]`` (1 while tier NAME is stuck).
    Returns ``(None, {})`` when they are absent.
    Nothing is exported then, rather than a made-up 0.
    """
    count = stats.get("tiers_stuck")
    per_tier = {key.split(".", 1)[1]: int(value) for key, value in stats.items() if key.startswith("tier_stuck.")}
    return (None if count is None else int(count)), per_tier


class KvactorsCollector(Collector):
    """The metrics of one manager, read in one round trip per scrape.

    One collector per manager in a registry (the families have no manager
    label). ``registry.register(KvactorsCollector(manager))``.
    """

    def __init__(self, manager: TieringManager) -> None:
        self.manager = manager
        self.block_bytes = int(manager.pool.shape[1])
        self.num_blocks = int(manager.pool.shape[0])

    def describe(self) -> list[Metric]:
        # Registering must not cost a round trip (nor fail on a stopped manager).
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self.manager.metrics_snapshot()
        except ManagerStoppedError:
            return
        yield from self.families(snap)

    def families(self, snap: MetricsSnapshot) -> Iterator[Metric]:
        """The metric families of ``snap``, each with every series it knows (at 0 where ``snap``
        has no figure for one: :func:`known_series`)."""
        known = known_series(snapshot_tiers(snap))
        for family in (*self._traffic_families(snap), *self._job_families(snap), *self._state_families(snap)):
            yield _with_every_series(family, known[family.name])

    def _traffic_families(self, snap: MetricsSnapshot) -> Iterator[Metric]:
        """Keys asked and found, bytes moved and keys evicted, per tier."""
        bb = self.block_bytes
        for name, values, scale in (("kvactors_lookup_keys", snap.lookup_keys, 1),
                                    ("kvactors_hit_keys", snap.hit_keys, 1),
                                    ("kvactors_stored_bytes", snap.stored_blocks, bb),
                                    ("kvactors_loaded_bytes", snap.loaded_blocks, bb),
                                    ("kvactors_evicted_keys", snap.evicted_keys, 1)):
            yield _labelled(name, [((tier,), value * scale) for tier, value in values.items()])

    @staticmethod
    def _job_families(snap: MetricsSnapshot) -> Iterator[Metric]:
        """Transfers ended, started and dropped, and their durations."""
        yield _labelled("kvactors_jobs", snap.jobs.items())
        yield _labelled("kvactors_jobs_started", snap.jobs_started.items())
        yield _labelled("kvactors_jobs_dropped", snap.jobs_dropped.items())
        durations = _family("kvactors_job_duration_seconds")
        for (tier, kind), hist in snap.durations.items():
            durations.add_metric([tier, kind], hist.cumulative(), hist.sum_s)
        yield durations

    @staticmethod
    def _state_families(snap: MetricsSnapshot) -> Iterator[Metric]:
        """Gauges of the moment (queues, pool rows, requests, stuck tiers) and the runtime's counters."""
        yield _labelled("kvactors_tier_jobs_queued", [((tier,), v) for tier, v in snap.jobs_queued.items()])
        yield _labelled("kvactors_tier_jobs_in_flight", [((tier,), v) for tier, v in snap.jobs_in_flight.items()])
        yield _labelled("kvactors_pool_blocks", [((state,), snap.pool_blocks[state]) for state in POOL_STATES])
        figures = snap.figures
        totals = figures.totals
        for name, value in (("kvactors_active_requests", figures.active_requests),
                            ("kvactors_lookups_in_flight", figures.lookups_in_flight),
                            ("kvactors_contract_violations", figures.contract_violations),
                            ("kvactors_lookups_timed_out", totals.lookups_timed_out),
                            ("kvactors_late_reports", totals.late_reports),
                            ("kvactors_requests_finalized", totals.requests_finalized),
                            ("kvactors_internal_errors", figures.internal_errors)):
            yield _family(name, value=value)
        yield _family("kvactors_tiers_stuck", value=figures.tiers_stuck)
        if figures.tiers:
            yield _labelled("kvactors_tier_stuck", [((tier,), int(t.stuck)) for tier, t in figures.tiers.items()])
        yield _labelled("kvactors_cascades_dropped",
                        [((tier,), t.dropped) for tier, t in figures.controls.cascades.items()])


def _with_every_series(family: Any, label_sets: tuple[tuple[str, ...], ...]) -> Metric:
    """``family`` (one of ``_TYPES``) with a 0 sample (an empty histogram) for each of ``label_sets`` it lacks."""
    d = _BY_NAME[family.name]
    if not d.labels:
        return family
    have = {tuple(str(sample.labels.get(k, "")) for k in d.labels) for sample in family.samples}
    for labels in label_sets:
        if labels in have:
            continue
        if d.kind == "histogram":
            family.add_metric(list(labels), Histogram((0,) * (len(DURATION_BUCKETS) + 1), 0.0).cumulative(), 0.0)
        else:
            family.add_metric(list(labels), 0.0)
    return family


def _labelled(name: str, values: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    """Family ``name`` with one sample per ``(label values, value)``."""
    family = _family(name)
    for labels, value in values:
        family.add_metric(list(labels), value)
    return family


def serve_metrics(manager: TieringManager, port: int, addr: str = "127.0.0.1"
                  ) -> tuple[WSGIServer, threading.Thread, CollectorRegistry]:
    """Serve ``manager``'s metrics at ``http://addr:port/metrics`` (port 0: any free one).

    The metrics get a registry of their own with one :class:`KvactorsCollector`.
    The server runs on one daemon thread.
    Returns ``(server, thread, registry)``.
    ``server.server_port`` is the port, and ``server.shutdown()`` stops it.
    """
    check_int(port, "port", minimum=0, maximum=65535)
    registry = CollectorRegistry()
    registry.register(KvactorsCollector(manager))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return server, thread, registry
