"""Inline tier calls: an idle tier runs them on the sender's thread, in order, never beside another call."""

from __future__ import annotations

import threading

import pytest

from kvactors import LookupResult, ReqContext, TieringManager
from tests.support import RecordingTier, keys, settled, wait_for


class ThreadNotingTier(RecordingTier):
    """Notes the thread of every lookup, and whether a submit was running meanwhile."""

    def __init__(self, *, inline: bool, fail_lookups: bool = False, gate: threading.Event | None = None) -> None:
        super().__init__(name="mem")
        self.inline_calls = frozenset({"lookup"} if inline else ())  # type: ignore[misc]
        self.fail_lookups = fail_lookups
        self.gate = gate
        self.lookup_threads: list[str] = []
        self.in_submit = False
        self.overlaps = 0

    def lookup(self, keys, ctx):
        self.lookup_threads.append(threading.current_thread().name)
        self.overlaps += self.in_submit
        if self.fail_lookups:
            raise RuntimeError("planted lookup failure")
        return super().lookup(keys, ctx)

    def submit_store(self, job):
        self.in_submit = True
        try:
            if self.gate is not None:
                assert self.gate.wait(30)
            super().submit_store(job)
        finally:
            self.in_submit = False


def start(tier: ThreadNotingTier, **kwargs) -> TieringManager:
    return TieringManager.start(num_blocks=16, block_bytes=8, secondary_tiers=[tier], **kwargs)


@pytest.mark.parametrize("inline", [True, False])
def test_an_idle_tier_answers_on_the_asking_thread_only_when_inline(inline):
    tier = ThreadNotingTier(inline=inline)
    ctx = ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)  # the tier's actor is idle
        assert manager.lookup(keys(1), ctx) == [LookupResult.MISS]
        manager.on_request_finished(ctx)
        stats = settled(manager)
    assert len(tier.lookup_threads) == 1
    assert tier.lookup_threads[0].endswith("-tier-mem") is not inline
    assert stats["lookups_in_flight"] == 0 and stats["active_requests"] == 0


def test_a_failing_inline_lookup_answers_miss_and_is_the_tiers_failure():
    tier = ThreadNotingTier(inline=True, fail_lookups=True)
    ctx = ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        # A failed tier's answer is a miss: asking again would wait on it for every request.
        assert manager.lookup(keys(1, 2), ctx) == [LookupResult.MISS, LookupResult.MISS]
        manager.on_request_finished(ctx)
        stats = settled(manager)
    assert not tier.lookup_threads[0].endswith("-tier-mem")  # it did run inline
    assert stats["internal_errors"] == 0
    assert tier.violations == []


def test_a_busy_inline_tier_gets_its_lookup_through_its_actor_after_the_running_call():
    """The claim fails while the tier's actor runs a submit: the lookup waits its turn
    on the tier's thread, never beside the submit."""
    gate = threading.Event()
    tier = ThreadNotingTier(inline=True, gate=gate)
    writer, reader = ReqContext("writer"), ReqContext("reader")
    with start(tier, lookup_timeout_s=20) as manager:
        manager.on_new_request(writer)
        manager.on_new_request(reader)
        out = manager.prepare_store(keys(1), writer)
        assert out is not None
        manager.complete_store(out.keys_to_store, writer)
        assert wait_for(lambda: tier.in_submit)
        answer: list[list[LookupResult]] = []
        looker = threading.Thread(target=lambda: answer.append(manager.lookup(keys(1, 9), reader)))
        looker.start()
        assert wait_for(lambda: manager.stats()["lookups_in_flight"] == 1)
        assert tier.lookup_threads == []
        gate.set()
        looker.join(10)
        # Stored by the submit that ran first: a hit in the primary; key 9 is nowhere.
        assert answer == [[LookupResult.HIT, LookupResult.MISS]]
        manager.on_request_finished(writer)
        manager.on_request_finished(reader)
        settled(manager)
    assert tier.overlaps == 0
    assert tier.lookup_threads[0].endswith("-tier-mem")
    assert tier.violations == []


class InlineRecordingTier(RecordingTier):
    """Records the thread of every call; submits report at once (they never block)."""

    def __init__(self, inline_calls: frozenset[str]) -> None:
        super().__init__(name="mem")
        self.inline_calls = inline_calls  # type: ignore[misc]
        self.threads: list[tuple[str, str]] = []

    def _record(self, call, ctx, job_id=None):
        self.threads.append((call, threading.current_thread().name))
        super()._record(call, ctx, job_id)


def test_inline_submits_and_finishes_run_on_the_supervisors_thread_in_the_contracts_order():
    tier = InlineRecordingTier(frozenset({"submit_store", "on_request_finished"}))
    ctx = ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys(1, 2), ctx)
        assert out is not None
        manager.on_request_finished(ctx)
        assert manager.wait_idle(10)
        manager.complete_store(out.keys_to_store, ctx)  # the last store: cascade, then finalize
        settled(manager)
    calls = [(call, thread) for call, thread in tier.threads if call in ("submit_store", "on_request_finished")]
    assert [call for call, _ in calls] == ["submit_store", "on_request_finished"]
    assert not any(thread.endswith("-tier-mem") for _, thread in calls)
    # Not declared (and overridden): on the tier's own thread.
    assert next(thread for call, thread in tier.threads if call == "on_new_request").endswith("-tier-mem")
    assert tier.violations == []


def test_a_tier_naming_an_unknown_inline_call_is_refused_at_start():
    tier = InlineRecordingTier(frozenset({"lookup", "drain"}))
    with pytest.raises(ValueError, match="drain"):
        TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[tier])


def test_hooks_a_tier_leaves_alone_count_as_inline_and_wrappers_keep_the_inner_tiers():
    from kvactors import DiskTier, MemoryTier
    from kvactors.tiers.base import inline_calls_of
    from kvactors.tiers.wrapper import DelegatingTier

    memory = MemoryTier(capacity_blocks=4)
    assert inline_calls_of(memory) == {"lookup", "touch", "on_new_request", "on_request_finished"}
    assert inline_calls_of(DelegatingTier(memory)) == inline_calls_of(memory)
    assert "submit_store" in DiskTier.inline_calls and "submit_store" not in MemoryTier.inline_calls
    assert inline_calls_of(RecordingTier()) == {"lookup", "touch"}  # it overrides both finish hooks
