"""Admission, back-pressure and per-request tier choice through TieringManager (docs/controls.md)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvactors import LookupResult, MemoryTier, ReqContext, TieringManager
from kvactors.commands.check_log import check_events
from kvactors.testing.explore import explore, explore_one
from kvactors.tiers.base import SecondaryTier
from kvactors.types import JobResult, OffloadKey, TransferJob

BB = 64  # block bytes


class LogTier(SecondaryTier):
    """Records every call in order (``calls``: ``(what, req_id, keys)``); keeps the bytes it stored.
    ``hold``: store jobs wait for :meth:`release` instead of being reported at once."""

    def __init__(self, name: str, *, hold: bool = False, medium: str = "STORAGE", locality: str = "LOCAL") -> None:
        super().__init__(name=name)
        self.medium = medium  # type: ignore[misc]
        self.locality = locality  # type: ignore[misc]
        self.hold = hold
        self.lock = threading.Condition()
        self.calls: list[tuple[str, str, tuple[OffloadKey, ...]]] = []
        self.data: dict[OffloadKey, bytes] = {}
        self.held: list[TransferJob] = []

    def _note(self, what: str, ctx: ReqContext, keys: Sequence[OffloadKey] = ()) -> None:
        with self.lock:
            self.calls.append((what, ctx.req_id, tuple(keys)))
            self.lock.notify_all()

    def wait_stores(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` store jobs reached this tier."""
        with self.lock:
            return self.lock.wait_for(lambda: sum(1 for c in self.calls if c[0] == "store") >= count, timeout)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        self._note("lookup", ctx, keys)
        return [LookupResult.HIT if key in self.data else LookupResult.MISS for key in keys]

    def submit_store(self, job: TransferJob) -> None:
        assert self.pool is not None
        for key, row in zip(job.keys, job.block_ids, strict=True):
            self.data[key] = bytes(self.pool[row].numpy())
        with self.lock:  # noted and held together: a waiter woken by the note can release the job
            self.calls.append(("store", job.req_context.req_id, tuple(job.keys)))
            if self.hold:
                self.held.append(job)
            self.lock.notify_all()
        if not self.hold:
            self.report(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        self._note("load", job.req_context, job.keys)
        assert self.pool is not None
        import torch

        for key, row in zip(job.keys, job.block_ids, strict=True):
            self.pool[row] = torch.frombuffer(bytearray(self.data[key]), dtype=torch.uint8)
        self.report(JobResult(job.job_id, True))

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._note("finished", ctx)

    def release(self) -> int:
        with self.lock:
            held, self.held = self.held, []
        for job in held:
            self.report(JobResult(job.job_id, True))
        return len(held)

    def stored(self, what: str = "store") -> list[tuple[str, tuple[OffloadKey, ...]]]:
        with self.lock:
            return [(req, keys) for kind, req, keys in self.calls if kind == what]


def key(n: int, prefix: bytes = b"k") -> OffloadKey:
    return prefix + n.to_bytes(2, "big")


def run_request(mgr: TieringManager, req_id: str, keys: list[OffloadKey], *, lookup: bool = True,
                params: dict[str, Any] | None = None, fill: int | None = None,
                idle: bool = True) -> list[LookupResult] | None:
    """One request: lookup, store what is missing (rows filled with ``fill``), finish; waits idle
    (``idle=False``: only until the primary processed it, while a tier holds jobs)."""
    ctx = ReqContext(req_id, params=params)
    mgr.on_new_request(ctx)
    results = mgr.lookup(keys, ctx) if lookup else None
    out = mgr.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        for row in out.store_spec.block_ids:
            mgr.pool[row].fill_(fill if fill is not None else (sum(req_id.encode()) % 251))
        mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    if idle:
        assert mgr.wait_idle(10)
    else:
        mgr.stats()  # a blocking call: every call before it took effect
    return results


def start(tiers: Sequence[SecondaryTier], num_blocks: int = 16, **kwargs: Any) -> TieringManager:
    return TieringManager.start(num_blocks=num_blocks, block_bytes=BB, secondary_tiers=tiers, **kwargs)


def events(path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name]


# --------------------------------------------------------------------- start arguments


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"admission": {"nope": "write_back"}}, ValueError, "no secondary tier named 'nope'"),
    ({"admission": {"t": "lazy"}}, ValueError, r"admission\['t'\]: unknown admission"),
    ({"admission": {"t": {"min_seen": 0}}}, ValueError, r"admission\['t'\]\.min_seen"),
    ({"admission": {"t": "write_back"}, "eviction": "arc"}, ValueError, "needs eviction='lru'"),
    ({"admission": ["write_back"]}, TypeError, "admission must be a mapping"),
    ({"max_queued_bytes": {"t": -1}}, ValueError, r"max_queued_bytes\['t'\] must be >= 0"),
    ({"max_queued_bytes": {"t": 1.5}}, TypeError, r"max_queued_bytes\['t'\] must be an int"),
    ({"max_queued_bytes": {"x": 1}}, ValueError, "no secondary tier named 'x'"),
])
def test_bad_controls_are_start_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        start([LogTier("t")], **kwargs)


def test_a_tier_must_declare_a_known_medium_and_locality() -> None:
    with pytest.raises(ValueError, match="medium must be one of"):
        start([LogTier("t", medium="GPU")])
    with pytest.raises(ValueError, match="locality"):
        start([LogTier("t", locality="SOMEWHERE")])


def test_builtin_tiers_declare_their_medium_and_locality() -> None:
    from kvactors import DiskTier, RedisTier

    assert (MemoryTier.medium, MemoryTier.locality) == ("CPU", "LOCAL")
    assert (DiskTier.medium, DiskTier.locality) == ("STORAGE", "LOCAL")
    assert (RedisTier.medium, RedisTier.locality) == ("STORAGE", "REMOTE")
    assert (SecondaryTier.medium, SecondaryTier.locality) == ("STORAGE", "LOCAL")  # a custom tier's default


# --------------------------------------------------------------------- admission


def test_write_through_is_the_default() -> None:
    tier = LogTier("t")
    with start([tier]) as mgr:
        run_request(mgr, "a", [key(0), key(1)])
        run_request(mgr, "b", [key(2)])
        assert tier.stored() == [("a", (key(0), key(1))), ("b", (key(2),))]


def test_min_seen_sends_a_block_once_enough_distinct_requests_asked_for_it() -> None:
    tier, other = LogTier("t"), LogTier("u")
    with start([tier, other], admission={"t": {"min_seen": 3}}) as mgr:
        keys = [key(0), key(1)]
        run_request(mgr, "a", keys)  # asked once, stored: not yet
        ctx = ReqContext("a", attempt=1)  # another attempt of a: counts once
        mgr.on_new_request(ctx)
        mgr.lookup(keys, ctx)
        mgr.on_request_finished(ctx)
        run_request(mgr, "b", keys)
        assert mgr.wait_idle(10)
        assert tier.stored() == []
        run_request(mgr, "c", keys)  # the third distinct request: sent, on its behalf
        run_request(mgr, "d", keys)  # sent once only
        assert tier.stored() == [("c", tuple(keys))]
        assert other.stored() == [("a", tuple(keys))]  # write-through, unaffected
        assert mgr.stats()["seen_keys"] == 2
        # A key seen enough before it is stored goes when its store completes.
        for req in ("e", "f", "g"):
            ctx = ReqContext(req)
            mgr.on_new_request(ctx)
            mgr.lookup([key(9)], ctx)
            mgr.on_request_finished(ctx)
        run_request(mgr, "h", [key(9)], lookup=False)
        assert tier.stored()[-1] == ("h", (key(9),))
    # the contract at the tier: each request's finish after its submits
    for req, keys_ in tier.stored():
        assert tier.calls.index(("finished", req, ())) > tier.calls.index(("store", req, keys_))


def test_write_back_goes_when_the_pool_evicts_on_behalf_of_the_evicting_request() -> None:
    tier = LogTier("t")
    with start([tier], num_blocks=8, admission={"t": "write_back"}) as mgr:
        run_request(mgr, "a", [key(0), key(1)], fill=7)
        run_request(mgr, "b", [key(2), key(3)], fill=8)
        run_request(mgr, "c", [key(4), key(5), key(6), key(7)], fill=9)
        assert tier.stored() == []  # nothing evicted yet: nothing written
        assert mgr.stats()["blocks_unwritten"] == 8
        run_request(mgr, "d", [key(8), key(9)], fill=10)  # would evict a's blocks: written back for d
        # a's blocks pinned by their write-back, the store would evict b's: written back too, up to
        # half the pool pinned by write-backs; then c's oldest two are evicted unwritten.
        assert tier.stored() == [("d", (key(0), key(1))), ("d", (key(2), key(3)))]
        assert mgr.stats()["write_back_blocks_dropped"] == 2
        assert tier.data[key(0)] == bytes([7]) * BB  # the block's bytes, not the evicting store's
        stats = mgr.stats()
        assert stats["write_back_jobs"] == 2 and stats["write_backs_pending"] == 0
        # d's on_request_finished at the tier comes after the write-back submitted on its behalf
        assert tier.calls.index(("finished", "d", ())) > tier.calls.index(("store", "d", (key(0), key(1))))
        # the written-back block comes back from the tier with its bytes
        mgr.reset_cache()
        ctx = ReqContext("e")
        mgr.on_new_request(ctx)
        results = mgr.lookup([key(0)], ctx)
        assert results[0] in (LookupResult.HIT_PENDING, LookupResult.HIT)
        assert mgr.wait_idle(10)
        assert mgr.lookup([key(0)], ctx) == [LookupResult.HIT]
        spec = mgr.prepare_load([key(0)], ctx)
        assert bytes(mgr.pool[spec.block_ids[0]].numpy()) == bytes([7]) * BB
        mgr.complete_load([key(0)], ctx)
        mgr.on_request_finished(ctx)
        assert mgr.wait_idle(10)


def test_a_stop_writes_nothing_back() -> None:
    tier = LogTier("t")
    with start([tier], num_blocks=4, admission={"t": "write_back"}) as mgr:
        run_request(mgr, "a", [key(0), key(1)])
    assert tier.stored() == []


# --------------------------------------------------------------------- back-pressure


def test_back_pressure_drops_new_cascades_past_the_bound_and_counts_them(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from kvactors.metrics import KvactorsCollector

    log = tmp_path / "events.jsonl"
    slow, fast = LogTier("slow", hold=True), LogTier("fast")
    with start([slow, fast], max_queued_bytes={"slow": 2 * BB}, event_log=log) as mgr:
        for n in range(5):
            run_request(mgr, f"r{n}", [key(n)], lookup=False, idle=False)
        assert slow.wait_stores(2) and fast.wait_stores(5)
        stats = mgr.stats()
        assert len(slow.stored()) == 2 and len(fast.stored()) == 5
        assert stats["cascades_dropped.slow"] == 3 and stats["cascades_dropped.fast"] == 0
        assert stats["cascades_dropped"] == 3
        assert stats["cascade_bytes_queued.slow"] == 2 * BB
        # the dropped blocks stay in the pool
        ctx = ReqContext("x")
        mgr.on_new_request(ctx)
        assert mgr.lookup([key(n) for n in range(5)], ctx) == [LookupResult.HIT] * 5
        mgr.on_request_finished(ctx)
        registry = CollectorRegistry()
        registry.register(KvactorsCollector(mgr))
        assert registry.get_sample_value("kvactors_cascades_dropped_total", {"tier": "slow"}) == 3
        assert registry.get_sample_value("kvactors_cascades_dropped_total", {"tier": "fast"}) == 0
        assert slow.release() == 2
        assert mgr.wait_idle(10)
        assert mgr.stats()["cascade_bytes_queued.slow"] == 0
        run_request(mgr, "r9", [key(9)], lookup=False, idle=False)
        assert slow.wait_stores(3)
        assert slow.stored()[-1] == ("r9", (key(9),))
        slow.release()
        assert mgr.wait_idle(10)
    dropped, resumed = events(log, "cascades_dropped"), events(log, "cascades_resumed")
    assert [e["tier"] for e in dropped] == ["slow"]  # once per episode
    assert [(e["tier"], e["dropped"]) for e in resumed] == [("slow", 3)]


def test_zero_drops_every_cascade() -> None:
    tier = LogTier("t")
    with start([tier], max_queued_bytes={"t": 0}) as mgr:
        run_request(mgr, "a", [key(0)])
        assert tier.stored() == [] and mgr.stats()["cascades_dropped.t"] == 1


def test_a_tier_far_slower_than_the_traffic_keeps_the_manager_bounded() -> None:
    slow = LogTier("slow", hold=True)  # never reports until released: infinitely slower than the traffic
    with start([slow], num_blocks=32, max_queued_bytes={"slow": 4 * BB}) as mgr:
        for n in range(300):
            run_request(mgr, f"r{n}", [key(n), key(n + 1000)], lookup=False, idle=False)
            stats = mgr.stats()
            assert stats["cascade_bytes_queued.slow"] <= 4 * BB
            assert stats["blocks_pinned"] <= 4
            assert stats["jobs_in_flight"] + stats["jobs_queued"] <= 2
        assert stats["cascades_dropped.slow"] == 298
        slow.release()
        assert mgr.wait_idle(10)


# --------------------------------------------------------------------- per-request controls


def test_kv_load_tiers_chooses_the_tiers_a_request_loads_from(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    local, remote = LogTier("local", medium="CPU"), LogTier("remote", locality="REMOTE")
    with start([local, remote], event_log=log) as mgr:
        run_request(mgr, "w", [key(0)], lookup=False)
        mgr.reset_cache()  # the block is only in the tiers now
        cases = [
            ({"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]}, ["remote"]),
            ({"kv_load_tiers": [{"medium": "cpu"}]}, ["local"]),
            ({"kv_load_tiers": []}, []),
            ({"kv_load_tiers": "all"}, ["local", "remote"]),  # ignored, as vLLM: every tier
            (None, ["local", "remote"]),
        ]
        for n, (params, asked) in enumerate(cases):
            before = {tier.name: len(tier.stored("lookup")) for tier in (local, remote)}
            ctx = ReqContext(f"q{n}", params=params)
            mgr.on_new_request(ctx)
            results = mgr.lookup([key(0)], ctx)
            mgr.on_request_finished(ctx)
            assert mgr.wait_idle(10)
            got = [tier.name for tier in (local, remote) if len(tier.stored("lookup")) > before[tier.name]]
            assert got == asked, params
            assert results == ([LookupResult.MISS] if not asked else [LookupResult.HIT_PENDING]), params
            mgr.reset_cache()
    ignored = events(log, "request_param_ignored")
    assert [(e["req_id"], e["param"]) for e in ignored] == [("q3", "kv_load_tiers")]
    assert "expected a list" in ignored[0]["reason"]


def test_bad_request_params_are_logged_never_raised(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with start([LogTier("t")], event_log=log) as mgr:
        params = {"kv_load_tiers": [{"medium": "GPU"}], "max_load_tokens": -5, "max_offload_tokens": "x"}
        run_request(mgr, "bad", [key(0)], params=params)
        assert mgr.stats()["contract_violations"] == 0
    ignored = events(log, "request_param_ignored")
    assert sorted(e["param"] for e in ignored) == ["kv_load_tiers", "kv_load_tiers[0].medium", "max_load_tokens",
                                                   "max_offload_tokens"]


# --------------------------------------------------------------------- the contract, explored


def test_seeded_exploration_with_controls_finds_no_violation() -> None:
    report = explore(range(600), controls=True)
    assert report.runs == 600
    assert not report.failures, "\n".join(f.describe() for f in report.failures[:5])


def test_logs_of_runs_with_controls_pass_check_log(tmp_path: Path) -> None:
    path = tmp_path / "sim.jsonl"
    for seed in range(40):
        assert explore_one(seed, event_log=str(path), controls=True).ok
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    names = {e["event"] for e in lines}
    assert {"cascade_admitted", "cascade_skipped"} <= names  # write-backs and admission decisions were logged
    result = check_events(lines)
    assert result.requests > 100
    assert not result.violations, "\n".join(v.format() for v in result.violations[:5])


# --------------------------------------------------------------------- the vLLM config's tiers entries


def test_tiers_entries_take_admission_and_max_queued_bytes() -> None:
    from kvactors.integrations.vllm.config import build_tiers, parse_config, tier_controls

    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "memory", "capacity_blocks": 8, "admission": "write_back", "max_queued_bytes": 0},
        {"type": "memory", "name": "m2", "capacity_blocks": 8, "admission": {"min_seen": 2}},
        {"type": "memory", "name": "m3", "capacity_blocks": 8},
    ]})
    tiers = build_tiers(config, None)
    assert tier_controls(config, tiers) == ({"memory": "write_back", "m2": {"min_seen": 2}}, {"memory": 0})


@pytest.mark.parametrize(("entry", "eviction", "match"), [
    ({"admission": "eventually"}, "lru", r"tiers\[0\]\.admission"),
    ({"admission": {"min_seen": 0}}, "lru", r"tiers\[0\]\.admission\.min_seen"),
    ({"admission": {"min_seen": "2"}}, "lru", r"tiers\[0\]\.admission\.min_seen"),
    ({"admission": 3}, "lru", r"tiers\[0\]\.admission"),
    ({"admission": "write_back"}, "arc", r"tiers\[0\]\.admission 'write_back' needs eviction_policy 'lru'"),
    ({"max_queued_bytes": -1}, "lru", r"tiers\[0\]\.max_queued_bytes"),
    ({"max_queued_bytes": "1G"}, "lru", r"tiers\[0\]\.max_queued_bytes"),
    ({"max_queued_bytes": True}, "lru", r"tiers\[0\]\.max_queued_bytes"),
])
def test_a_bad_control_in_a_tiers_entry_is_a_start_error_naming_it(entry: dict[str, Any], eviction: str,
                                                                   match: str) -> None:
    from kvactors.integrations.vllm.config import parse_config

    with pytest.raises(ValueError, match=match):
        parse_config({"cpu_bytes_to_use": 1 << 20, "eviction_policy": eviction,
                      "tiers": [{"type": "memory", "capacity_blocks": 8, **entry}]})


def test_the_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "controls.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert examples
    monkeypatch.chdir(tmp_path)
    for source in examples:
        exec(compile(source, "docs/controls.md", "exec"), {"__name__": "__docs__"})
    for block in re.findall(r"```json\n(.*?)```", text, flags=re.DOTALL):  # the tiers entries parse
        from kvactors.integrations.vllm.config import parse_config

        parse_config({"cpu_bytes_to_use": 1 << 20, **json.loads("{" + block + "}")})


def test_the_vllm_batch_lookup_asks_only_the_keys_a_request_may_load() -> None:
    from kvactors.integrations.vllm.lookups import remaining_keys

    group = (0).to_bytes(4, "big")
    keys = [bytes([n]) * 4 + group for n in range(6)]
    positions = {k: 16 * (n + 1) for n, k in enumerate(keys)}  # each key's end token, 16 tokens a chunk
    assert remaining_keys(keys[0], positions) == tuple(keys)
    assert remaining_keys(keys[0], positions, 3 * 16) == tuple(keys[:3])
    assert remaining_keys(keys[2], positions, 2 * 16) == tuple(keys[2:4])  # from the first key asked
    assert remaining_keys(keys[2], positions, 16) == (keys[2],)
    assert remaining_keys(keys[5], positions, 0) == (keys[5],)
