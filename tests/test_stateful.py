"""Random sequences of every API call, misuse included, on the deterministic runtime.

Hypothesis drives a TieringManager whose actors run on a SimRuntime (no
threads): each rule is one call, tier jobs complete at scheduler-chosen later
steps, and time jumps make deadlines race with completions. After every step:
the pool's invariants hold, no tier saw a submit after its finish or a second
finish, and the supervisor's request table agrees with the primary's. A model
predicts which calls must raise LifecycleError and how many contract
violations the runtime must count, and which pool rows requests may still be
reading (their load pins, on the rows ``prepare_load`` returned, released as
``complete_load`` documents): ``prepare_store`` never hands such a row out,
and never evicts a key of its own call.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvactors import JobResult, LifecycleError, MemoryTier, ReqContext, TieringManager, TransferJob
from kvactors.testing import SimRuntime
from tests import pool_check
from tests.support import RecordingTier

KEYS = [f"k{n}".encode() for n in range(8)]
IDS = [ReqContext(f"r{n}", attempt) for n in range(3) for attempt in range(2)]


class DeferredTier(RecordingTier):
    """Jobs end at a later step the scheduler picks; some fail, some never end."""

    def __init__(self, runtime: SimRuntime, name: str, fail_every: int, stall_every: int = 0) -> None:
        super().__init__(name=name, capacity_blocks=5)
        self.runtime = runtime
        self.fail_every = fail_every
        self.stall_every = stall_every
        self.jobs = 0

    def _later(self, job: TransferJob, run) -> None:
        self.jobs += 1
        if self.stall_every and self.jobs % self.stall_every == 0:
            return  # never reported: only its deadline ends it
        if self.fail_every and self.jobs % self.fail_every == 0:
            self.runtime.defer(f"{self.name} fails {job.job_id}",
                               lambda: self.report(JobResult(job.job_id, False, "planted")))
        else:
            self.runtime.defer(f"{self.name} runs {job.job_id}", lambda: run(self, job))

    def submit_store(self, job: TransferJob) -> None:
        self._record("submit_store", job.req_context, job.job_id)
        self._later(job, MemoryTier.submit_store)

    def submit_load(self, job: TransferJob) -> None:
        self._record("submit_load", job.req_context, job.job_id)
        self._later(job, MemoryTier.submit_load)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), fail_every=st.sampled_from([0, 2, 3]),
                stall_every=st.sampled_from([0, 4]), eviction=st.sampled_from(["lru", "arc"]))
    def start(self, seed, fail_every, stall_every, eviction):
        self.runtime = SimRuntime(seed, time_jump_chance=0.05)
        self.tiers = [DeferredTier(self.runtime, "a", fail_every), DeferredTier(self.runtime, "b", 0, stall_every)]
        self.manager = TieringManager.start(num_blocks=6, block_bytes=8, secondary_tiers=self.tiers,
                                            eviction=eviction, transfer_timeout_s=5.0, lookup_timeout_s=1.0,
                                            runtime=self.runtime)
        self.primary = self.runtime.ref("primary").actor
        self.supervisor = self.runtime.ref("supervisor").actor
        self.started: set[tuple[str, int]] = set()
        self.finished: set[tuple[str, int]] = set()
        self.ever_started: set[tuple[str, int]] = set()
        self.writes: Counter[tuple[tuple[str, int], bytes]] = Counter()  # prepared, not completed
        self.pins: Counter[tuple[tuple[str, int], bytes]] = Counter()
        self.read_rows: dict[tuple[tuple[str, int], bytes], list[int]] = {}  # one entry per pin, until released
        self.released: Counter[tuple[tuple[str, int], bytes]] = Counter()
        self.expected_violations = 0
        self.restarts = 0

    def _active(self, ctx: ReqContext) -> bool:
        return ctx.identity in self.started and ctx.identity not in self.finished

    # ---------------------------------------------------------------- calls

    @rule(ctx=st.sampled_from(IDS))
    def on_new_request(self, ctx):
        try:
            self.manager.on_new_request(ctx)
        except LifecycleError:
            # Legitimate only while the identity is active, or finished but not yet finalized.
            assert ctx.identity in self.started
            return
        assert not self._active(ctx), "a duplicate request was accepted"
        if ctx.identity in self.started:
            self.restarts += 1
            event("an identity started again after its finalization")
        self.started.add(ctx.identity)
        self.ever_started.add(ctx.identity)
        self.finished.discard(ctx.identity)

    @rule(ctx=st.sampled_from(IDS))
    def on_request_finished(self, ctx):
        self.manager.on_request_finished(ctx)
        if ctx.identity in self.started:
            self.finished.add(ctx.identity)

    @rule(ctx=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def lookup(self, ctx, keys):
        try:
            results = self.manager.lookup(keys, ctx)
        except LifecycleError:
            assert not self._active(ctx), "lookup refused for an active request"
            return
        assert self._active(ctx), "lookup accepted for a finished or unknown request"
        assert len(results) == len(keys)

    @rule(ctx=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def prepare_store(self, ctx, keys):
        try:
            out = self.manager.prepare_store(keys, ctx)
        except LifecycleError:
            assert not self._active(ctx), "prepare_store refused for an active request"
            return
        assert self._active(ctx), "prepare_store accepted after finish"
        if out is not None:
            assert len(out.keys_to_store) == len(out.store_spec.block_ids)
            assert not set(out.evicted_keys) & set(keys), "prepare_store evicted a key of its own call"
            read = {row for rows in self.read_rows.values() for row in rows}
            assert not set(out.store_spec.block_ids) & read, "a row still being read was handed to a store"
            for key in out.keys_to_store:
                self.writes[(ctx.identity, key)] += 1

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        if not self.writes:
            return
        identity, key = data.draw(st.sampled_from(sorted(self.writes)))
        self.manager.complete_store([key], ReqContext(*identity), success)
        self.writes[(identity, key)] -= 1
        if not self.writes[(identity, key)]:
            del self.writes[(identity, key)]

    @rule(ctx=st.sampled_from(IDS), key=st.sampled_from(KEYS))
    def complete_store_misuse(self, ctx, key):
        if self.writes[(ctx.identity, key)]:
            return
        self.manager.complete_store([key], ctx)
        self.expected_violations += 1

    @rule(ctx=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def prepare_load(self, ctx, keys):
        try:
            spec = self.manager.prepare_load(keys, ctx)
        except LifecycleError:
            if self._active(ctx):
                assert not all(self.primary.pool.is_ready(key) for key in keys), "ready keys refused"
            return
        assert self._active(ctx)
        assert len(spec.block_ids) == len(keys)
        for key, row in zip(keys, spec.block_ids, strict=True):
            self.pins[(ctx.identity, key)] += 1
            self.read_rows.setdefault((ctx.identity, key), []).append(row)

    def _released(self, identity, key):
        """One complete_load: at once if the key's pins lie on one row, else with the key's last release."""
        entry = (identity, key)
        self.released[entry] += 1
        rows = self.read_rows[entry]
        if len(set(rows)) == 1:
            del rows[: self.released.pop(entry)]
        elif self.released[entry] == len(rows):
            rows.clear()
            del self.released[entry]
        if not rows:
            del self.read_rows[entry]

    @rule(data=st.data())
    def complete_load(self, data):
        if not self.pins:
            return
        identity, key = data.draw(st.sampled_from(sorted(self.pins)))
        self.manager.complete_load([key], ReqContext(*identity))
        self._released(identity, key)
        self.pins[(identity, key)] -= 1
        if not self.pins[(identity, key)]:
            del self.pins[(identity, key)]

    @rule(ctx=st.sampled_from(IDS), key=st.sampled_from(KEYS))
    def complete_load_misuse(self, ctx, key):
        if self.pins[(ctx.identity, key)]:
            return
        self.manager.complete_load([key], ctx)
        self.expected_violations += 1

    @rule(ctx=st.sampled_from(IDS), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def touch(self, ctx, keys):
        self.manager.touch(keys, ctx)

    @rule()
    def reset_cache(self):
        self.manager.reset_cache()

    def _store_ready(self, ctx, key) -> bool:
        out = self.manager.prepare_store([key], ctx)
        if out is None or out.keys_to_store != [key]:
            return self.primary.pool.is_ready(key)
        self.manager.complete_store([key], ctx, True)
        return True

    @rule(ctx=st.sampled_from(IDS), key=st.sampled_from(KEYS))
    def reset_and_load_again(self, ctx, key):
        """A request holds a load pin across a reset, the key is stored anew, and it loads it again."""
        if not self._active(ctx) or not self._store_ready(ctx, key):
            return
        self.prepare_load(ctx, [key])
        self.reset_cache()
        if self._store_ready(ctx, key):
            self.prepare_load(ctx, [key])
            if len(set(self.read_rows.get((ctx.identity, key), ()))) > 1:
                event("a request pinned a key's old and new rows")

    @rule(steps=st.integers(1, 30))
    def run_scheduler(self, steps):
        for _ in range(steps):
            if not self.runtime.step():
                break

    @rule()
    def wait_idle(self):
        assert self.manager.wait_idle(60.0)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        pool_check.check_invariants(self.primary.pool)
        for tier in self.tiers:
            assert tier.violations == []
        supervised = {state.req_context.identity: state for state in self.supervisor.table.states()}
        for identity, state in supervised.items():
            record = self.primary._requests.get(identity)
            assert record is not None, f"{identity} is supervised but unknown to the primary"
            if state.is_finished:
                assert record.finished

    def teardown(self):
        manager = self.manager
        for identity, key in list(self.pins.elements()):
            manager.complete_load([key], ReqContext(*identity))
        for identity, key in list(self.writes.elements()):
            manager.complete_store([key], ReqContext(*identity), True)
        for identity in self.started - self.finished:
            manager.on_request_finished(ReqContext(*identity))
        assert manager.wait_idle(60.0)
        self.runtime.run(max_steps=10_000)  # let every deadline pass
        assert manager.wait_idle(60.0)
        stats = manager.stats()
        for name in ("stores_timed_out", "jobs_timed_out", "jobs_failed", "lookups_timed_out", "late_reports"):
            if stats[name]:
                event(f"run had {name}")
        if self.expected_violations:
            event("run had misuse")
        assert stats["active_requests"] == 0 and stats["supervisor_requests"] == 0
        assert stats["blocks_pending"] == 0 and stats["blocks_pinned"] == 0
        assert stats["jobs_in_flight"] == 0 and stats["jobs_queued"] == 0
        assert stats["contract_violations"] == self.expected_violations
        assert stats["internal_errors"] == 0
        for tier in self.tiers:
            assert tier.violations == []
            assert set(tier.finished) == self.ever_started  # each attempt finished at every tier
            assert sum(tier.finished.values()) == len(self.ever_started) + self.restarts  # once per lifetime
        manager.stop()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestManagerMachine.pytestmark = [pytest.mark.timeout(300)]  # ~15 s alone; far slower on a loaded machine
