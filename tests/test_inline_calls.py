"""Inline calls: an idle tier answers a lookup on the asking thread, never beside another call."""

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


def test_a_failing_inline_lookup_answers_retry_and_is_the_tiers_failure():
    tier = ThreadNotingTier(inline=True, fail_lookups=True)
    ctx = ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        assert manager.lookup(keys(1, 2), ctx) == [LookupResult.RETRY, LookupResult.RETRY]
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
