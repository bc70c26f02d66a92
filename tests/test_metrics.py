"""kvactors.metrics: a running manager scraped over HTTP, figures checked against what the test did."""

from __future__ import annotations

import urllib.request

import pytest

from kvactors import LookupResult, MemoryTier, ReqContext, TieringManager
from tests.support import ControlledTier, keys, settled

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvactors.metrics import KvactorsCollector, serve_metrics  # noqa: E402

BB = 32


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse it: sample name and sorted labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def served():
    servers = []

    def serve(manager):
        server, thread, _ = serve_metrics(manager, 0)
        servers.append((server, thread))
        return server.server_port

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_scrape_counts_what_the_workload_did(served):
    memory = MemoryTier(name="memory", capacity_blocks=64)
    failing = ControlledTier(name="ctl")  # the test fails its cascades by hand
    with TieringManager.start(num_blocks=16, block_bytes=BB, secondary_tiers=[memory, failing]) as manager:
        port = served(manager)
        a = ReqContext("a")
        manager.on_new_request(a)
        assert manager.lookup(keys(1, 2, 3), a) == [LookupResult.MISS] * 3     # cpu 3 asked, tiers 3 each
        out = manager.prepare_store(keys(1, 2, 3), a)
        manager.complete_store(out.keys_to_store, a)                          # 3 blocks stored at cpu
        bad = manager.prepare_store(keys(4), a)
        manager.complete_store(bad.keys_to_store, a, success=False)           # a failed store
        spec = manager.prepare_load(keys(1, 2), a)                            # 2 pinned now
        failing.wait_held(1)
        failing.release_all(success=False)                                    # ctl's cascade fails
        assert manager.wait_idle(10)

        samples = scrape(port)
        assert value(samples, "kvactors_pool_blocks", state="pinned") == 2
        assert sum(value(samples, "kvactors_pool_blocks", state=s)
                   for s in ("ready", "pinned", "pending", "detached", "free")) == 16
        manager.complete_load(keys(1, 2), a)
        assert len(spec.block_ids) == 2
        assert manager.lookup(keys(1, 5), a) == [LookupResult.HIT, LookupResult.MISS]  # cpu +2 asked, 1 hit
        manager.on_request_finished(a)
        settled(manager)

        # A promotion: clear the pool, look key 2 up again, memory has it.
        manager.reset_cache()
        b = ReqContext("b")
        manager.on_new_request(b)
        assert manager.lookup(keys(2), b) == [LookupResult.HIT_PENDING]
        assert manager.wait_idle(10)
        manager.on_request_finished(b)
        settled(manager)

        samples = scrape(port)
        assert value(samples, "kvactors_lookup_keys_total", tier="cpu") == 3 + 2 + 1
        assert value(samples, "kvactors_hit_keys_total", tier="cpu") == 1
        assert value(samples, "kvactors_lookup_keys_total", tier="memory") == 3 + 1 + 1
        assert value(samples, "kvactors_hit_keys_total", tier="memory") == 1
        assert value(samples, "kvactors_stored_bytes_total", tier="cpu") == 3 * BB
        assert value(samples, "kvactors_stored_bytes_total", tier="memory") == 3 * BB
        assert value(samples, "kvactors_stored_bytes_total", tier="ctl") == 0       # failed: no bytes
        assert value(samples, "kvactors_loaded_bytes_total", tier="cpu") == 2 * BB
        assert value(samples, "kvactors_loaded_bytes_total", tier="memory") == 1 * BB  # the promotion
        assert value(samples, "kvactors_jobs_total", tier="cpu", kind="store", outcome="ok") == 1
        assert value(samples, "kvactors_jobs_total", tier="cpu", kind="store", outcome="failed") == 1
        assert value(samples, "kvactors_jobs_total", tier="cpu", kind="load", outcome="ok") == 1
        assert value(samples, "kvactors_jobs_total", tier="memory", kind="cascade", outcome="ok") == 1
        assert value(samples, "kvactors_jobs_total", tier="ctl", kind="cascade", outcome="failed") == 1
        assert value(samples, "kvactors_jobs_total", tier="memory", kind="promotion", outcome="ok") == 1
        assert value(samples, "kvactors_jobs_started_total", tier="ctl", kind="cascade") == 1
        assert value(samples, "kvactors_job_duration_seconds_count", tier="memory", kind="cascade") == 1
        assert value(samples, "kvactors_job_duration_seconds_bucket", tier="ctl", kind="cascade", le="+Inf") == 1
        assert value(samples, "kvactors_pool_blocks", state="ready") == 1      # the promoted key
        assert sum(value(samples, "kvactors_pool_blocks", state=s)
                   for s in ("ready", "pinned", "pending", "detached", "free")) == 16
        assert value(samples, "kvactors_active_requests") == 0
        assert value(samples, "kvactors_contract_violations_total") == 0
        assert value(samples, "kvactors_tier_jobs_queued", tier="ctl") == 0
        assert value(samples, "kvactors_requests_finalized_total") == 2


def test_timeouts_evictions_violations_and_queue_depth(served):
    tier = ControlledTier(name="ctl", max_inflight=1)
    # 1 s: the stores complete and the scrape runs before any deadline, on a loaded machine too.
    with TieringManager.start(num_blocks=4, block_bytes=BB, secondary_tiers=[tier], transfer_timeout_s=1.0) as manager:
        port = served(manager)
        a = ReqContext("a")
        manager.on_new_request(a)
        for n in range(3):  # three cascades to a tier with one slot: one in flight, two queued
            out = manager.prepare_store(keys(n), a)
            manager.complete_store(out.keys_to_store, a)
        tier.wait_held(1)
        samples = scrape(port)
        assert value(samples, "kvactors_tier_jobs_in_flight", tier="ctl") == 1
        assert value(samples, "kvactors_tier_jobs_queued", tier="ctl") == 2
        manager.complete_load(keys(9), a)  # never pinned: a contract violation, counted
        manager.prepare_store(keys(7), a)  # never completed: its deadline passes
        assert manager.wait_idle(10)       # the three cascades time out (nobody releases them)
        samples = scrape(port)
        assert value(samples, "kvactors_jobs_total", tier="ctl", kind="cascade", outcome="timed_out") == 3
        assert value(samples, "kvactors_jobs_total", tier="cpu", kind="store", outcome="timed_out") == 1
        assert value(samples, "kvactors_contract_violations_total") == 1
        tier.release_all()
        assert manager.wait_idle(10)
        out = manager.prepare_store(keys(10, 11, 12), a)  # 4 rows, 3 ready and idle: evicts
        assert out is not None and len(out.evicted_keys) >= 2
        manager.complete_store(out.keys_to_store, a)
        manager.on_request_finished(a)
        settled(manager)
        samples = scrape(port)
        assert value(samples, "kvactors_evicted_keys_total", tier="cpu") == len(out.evicted_keys)
        assert value(samples, "kvactors_late_reports_total") == 3


def test_a_scrape_is_one_round_trip_and_a_stopped_manager_yields_nothing():
    with TieringManager.start(num_blocks=4, block_bytes=BB, secondary_tiers=[MemoryTier(capacity_blocks=4)]) as mgr:
        registry = prometheus_client.CollectorRegistry()
        collector = KvactorsCollector(mgr)
        registry.register(collector)
        calls = []
        snapshot, stats = mgr.metrics_snapshot, mgr.stats
        mgr.metrics_snapshot = lambda: calls.append("snapshot") or snapshot()  # type: ignore[method-assign]
        mgr.stats = lambda: calls.append("stats") or stats()  # type: ignore[method-assign]
        text = prometheus_client.generate_latest(registry).decode()
        assert calls == ["snapshot"]
        assert "kvactors_pool_blocks" in text and 'kvactors_lookup_keys_total{tier="memory"}' in text
    assert list(collector.collect()) == []
    prometheus_client.generate_latest(registry)  # no error


@pytest.mark.timeout(90)
def test_simulate_serves_metrics_while_it_runs(tmp_path, monkeypatch, capsys):
    import threading

    import kvactors.metrics as metrics_module
    from kvactors.cli import main
    from tests.support import wait_for

    servers = []
    real = metrics_module.serve_metrics

    def recording(manager, port, addr="127.0.0.1"):
        out = real(manager, port, addr)
        servers.append(out[0])
        return out

    monkeypatch.setattr(metrics_module, "serve_metrics", recording)
    rc: list[int] = []
    run = threading.Thread(target=lambda: rc.append(main([
        "simulate", "--quick", "--seconds", "4", "--metrics-port", "0", "--disk-dir", str(tmp_path / "disk"),
        "--event-log", str(tmp_path / "events.jsonl")])))
    run.start()
    try:
        assert wait_for(lambda: bool(servers), 30), "no metrics server started"
        assert wait_for(lambda: value(scrape(servers[0].server_port), "kvactors_lookup_keys_total", tier="cpu") > 0,
                        30)
        samples = scrape(servers[0].server_port)
        assert ("kvactors_stored_bytes_total", (("tier", "disk"),)) in samples
    finally:
        run.join(60)
    assert rc == [0]
    assert "metrics: http://127.0.0.1:" in capsys.readouterr().err


def test_simulate_metrics_port_out_of_range_is_a_clear_error(capsys):
    from kvactors.cli import main

    with pytest.raises(SystemExit) as exited:  # a bad option is refused by the parser
        main(["simulate", "--metrics-port", "70000"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvactors simulate: error: argument --metrics-port: must be at most 65535")
    assert len(err.strip().splitlines()) == 1


def test_the_declared_families_are_what_the_collector_yields():
    """FAMILIES (what vLLM's build_metric_definitions declares ahead) names every family the collector
    yields, with its type, help text and label names."""
    from kvactors.metrics import FAMILIES

    declared = {f.name: f for f in FAMILIES}
    tier = MemoryTier(name="mem", capacity_blocks=8)
    with TieringManager.start(num_blocks=8, block_bytes=BB, secondary_tiers=[tier]) as tm:
        seen = set()
        for family in KvactorsCollector(tm).collect():
            spec = declared[family.name]
            seen.add(family.name)
            assert (family.type, family.documentation) == (spec.kind, spec.doc), family.name
            for sample in family.samples:
                assert set(sample.labels) - {"le"} == set(spec.labels), (family.name, sample)
    assert seen == set(declared), set(declared) ^ seen


@pytest.mark.timeout(60)
def test_stats_totals_are_the_sums_of_the_per_tier_counts():
    """Issue 29 item 4: one set of counters per actor; stats()'s job totals derive from the per-tier counts."""
    tier = ControlledTier(name="ctl", max_inflight=1)
    tiers = [tier, MemoryTier(name="mem", capacity_blocks=8)]
    # 1 s: each store completes before its deadline, on a loaded machine too.
    with TieringManager.start(num_blocks=4, block_bytes=BB, secondary_tiers=tiers, transfer_timeout_s=1.0) as manager:
        a = ReqContext("a")
        manager.on_new_request(a)
        for n in range(3):  # cascades: "mem" succeeds, "ctl" holds one and queues two, all time out
            out = manager.prepare_store(keys(n), a)
            manager.complete_store(out.keys_to_store, a)
        manager.prepare_store(keys(7), a)  # never completed: 1 key past its deadline
        assert manager.wait_idle(10)
        tier.release_all()
        manager.on_request_finished(a)
        settled(manager)
        snap = manager.metrics_snapshot()
        stats = snap.stats
        outcomes = {outcome: sum(n for (t, _, o), n in snap.jobs.items() if o == outcome and t != "cpu")
                    for outcome in ("ok", "failed", "timed_out")}
        assert stats["jobs_submitted"] == sum(snap.jobs_started.values()) == 6
        assert (stats["jobs_succeeded"], stats["jobs_failed"], stats["jobs_timed_out"]) == (
            outcomes["ok"], outcomes["failed"], outcomes["timed_out"]) == (3, 0, 3)
        assert stats["jobs_dropped"] == sum(snap.jobs_dropped.values())
        assert stats["stores_timed_out"] == 1  # keys
        assert snap.jobs[("cpu", "store", "timed_out")] == 1  # stores
        assert stats == manager.stats() | {k: stats[k] for k in stats if k.startswith("tier_silent_s.")}


@pytest.mark.timeout(60)
def test_every_known_series_is_exported_at_zero_from_the_start(served):
    """Issue 34 item 2: each family exports every label set it knows (each tier, kind, outcome,
    state) before anything counted, at 0, and those are exactly the declared ones (known_series)."""
    from kvactors.metrics import FAMILIES, known_series

    tiers = [MemoryTier(name="mem", capacity_blocks=8), ControlledTier(name="disk")]
    with TieringManager.start(num_blocks=8, block_bytes=BB, secondary_tiers=tiers) as manager:
        samples = scrape(served(manager))
    known = known_series(["mem", "disk"])
    assert known["kvactors_hit_keys"] == (("cpu",), ("mem",), ("disk",))
    assert ("disk", "promotion", "timed_out") in known["kvactors_jobs"]
    for family in FAMILIES:
        sample = family.name + {"counter": "_total", "gauge": "", "histogram": "_count"}[family.kind]
        exported = {tuple(dict(labels)[k] for k in family.labels)
                    for (name, labels) in samples if name == sample}
        assert exported == set(known[family.name]), family.name
        for labels in known[family.name]:
            expected = 8 if family.name == "kvactors_pool_blocks" and labels == ("free",) else 0
            assert value(samples, sample, **dict(zip(family.labels, labels, strict=True))) == expected
    assert value(samples, "kvactors_hit_keys_total", tier="disk") == 0  # the example: not absent


def test_a_series_the_snapshot_lacks_is_filled_with_zero():
    """The collector fills a declared series the runtime did not report (the declaration, not the
    snapshot, decides what is exported); a histogram's is empty, every bucket at 0."""
    import dataclasses

    from kvactors.metrics import Series

    with TieringManager.start(num_blocks=8, block_bytes=BB, secondary_tiers=[MemoryTier(name="mem",
                                                                                        capacity_blocks=8)]) as tm:
        snap = tm.metrics_snapshot()
        collector = KvactorsCollector(tm)
    thin = dataclasses.replace(snap, jobs={}, durations={}, jobs_queued={})
    by_name = {f.name: f for f in collector.families(thin)}
    jobs = {tuple(s.labels[k] for k in ("tier", "kind", "outcome")): s.value for s in by_name["kvactors_jobs"].samples}
    assert set(jobs) == set(Series.JOBS_ENDED.label_sets(("mem",))) and set(jobs.values()) == {0}
    buckets = [s for s in by_name["kvactors_job_duration_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["tier"], s.labels["kind"]) for s in buckets} == {("mem", "cascade"), ("mem", "promotion")}
    assert {s.value for s in buckets} == {0}
    assert [s.labels for s in by_name["kvactors_tier_jobs_queued"].samples] == [{"tier": "mem"}]
