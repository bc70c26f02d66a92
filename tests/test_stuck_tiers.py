"""A tier stuck inside one of its calls for minutes: every blocking call still answers by its deadline.

The stuck tier blocks on a ``threading.Event`` (set at the end of each test, so
its thread exits). Each blocking call runs on a helper thread joined with its
bound, so a call that hangs (as each did before the tier watch) fails the test
with a message instead of hanging the run.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvactors import (
    LookupResult,
    ManagerStoppedError,
    MemoryTier,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    TieringManager,
    TransferJob,
)
from tests.support import RecordingTier, keys, wait_for, within

T = 1.0  # transfer_timeout_s: the deadline of gathers, and how long a tier may owe an answer
LOOKUP_T = 0.5
SLACK = 2.0  # scheduling on a loaded 2-core machine; the bounds are still far below "minutes"
QUICK = 0.5  # "well under T": a call that does not wait for a tier already known stuck

STUCK_CALLS = ("submit_store", "submit_load", "lookup", "on_new_request", "on_request_finished", "touch",
               "take_events")


class StuckTier(MemoryTier):
    """A MemoryTier whose first call of ``stuck_in`` blocks until ``release`` is set.

    Declares nothing inline (it may block anywhere), so every call runs on its actor's thread."""

    inline_calls = frozenset()

    def __init__(self, stuck_in: str, release: threading.Event, *, name: str = "stuck") -> None:
        super().__init__(name=name, capacity_blocks=64)
        self.stuck_in = stuck_in
        self.release = release
        self.entered = threading.Event()
        self._armed = True
        self.submitted: list[tuple[str, int]] = []  # the request of every submit_* it received

    def count_submits(self, ctx: ReqContext) -> int:
        return self.submitted.count(ctx.identity)

    def _maybe_block(self, call: str) -> None:
        if call == self.stuck_in and self._armed:
            self._armed = False
            self.entered.set()
            self.release.wait(300)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        self._maybe_block("lookup")
        return super().lookup(keys, ctx)

    def submit_store(self, job: TransferJob) -> None:
        self.submitted.append(job.req_context.identity)
        self._maybe_block("submit_store")
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.submitted.append(job.req_context.identity)
        self._maybe_block("submit_load")
        super().submit_load(job)

    def on_new_request(self, ctx: ReqContext) -> None:
        self._maybe_block("on_new_request")

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._maybe_block("on_request_finished")

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._maybe_block("touch")
        super().touch(keys, ctx)

    def take_events(self) -> list[OffloadingEvent]:
        self._maybe_block("take_events")
        return super().take_events()

    def drain(self, timeout: float | None) -> None:
        self._maybe_block("drain")

    def shutdown(self) -> None:
        self._maybe_block("shutdown")


def events_named(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [record.kvactors_event for record in caplog.records  # type: ignore[attr-defined]
            if getattr(record, "kvactors_event", {}).get("event") == name]


@pytest.fixture
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # the stuck call returns: its thread exits


def store(manager: TieringManager, ctx: ReqContext, names: Sequence[str | int]) -> list[OffloadKey]:
    out = manager.prepare_store(keys(*names), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def get_stuck(manager: TieringManager, tier: StuckTier, healthy: RecordingTier, call: str) -> None:
    """Make ``tier`` enter its blocking ``call`` (take_events: the caller's own call does)."""
    ctx = ReqContext(f"trigger-{call}")
    if call == "on_new_request":
        manager.on_new_request(ctx)
    elif call == "take_events":
        return
    else:
        manager.on_new_request(ctx)
        if call == "submit_store":
            store(manager, ctx, ["a"])
        elif call == "submit_load":
            store(manager, ctx, ["a"])
            assert manager.wait_idle(10)
            manager.reset_cache()  # the primary forgets "a": a lookup promotes it from the first tier, the stuck one
            assert manager.lookup(keys("a"), ctx) == [LookupResult.HIT_PENDING]
        elif call == "lookup":
            manager.lookup(keys("nowhere"), ctx)  # answers RETRY by lookup_timeout_s (the first wait)
        elif call == "touch":
            manager.touch(keys("a"), ctx)
        elif call == "on_request_finished":
            manager.on_request_finished(ctx)
    assert tier.entered.wait(10), f"the tier never entered {call}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", STUCK_CALLS)
def test_every_blocking_call_answers_by_its_deadline_while_a_tier_is_stuck(
        call: str, release: threading.Event, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvactors")
    stuck = StuckTier(call, release)
    healthy = RecordingTier(name="healthy")
    manager = TieringManager.start(num_blocks=32, block_bytes=8, secondary_tiers=[stuck, healthy],
                                   transfer_timeout_s=T, lookup_timeout_s=LOOKUP_T)
    try:
        get_stuck(manager, stuck, healthy, call)

        # The first call that needs the tier waits for it at most T, and finds it stuck.
        _, took = within(T + SLACK, manager.take_events, "take_events (first)")
        assert call != "take_events" or stuck.entered.is_set()
        stats, _ = within(SLACK, manager.stats, "stats")
        assert stats["tiers_stuck"] == 1 and stats["tier_stuck.stuck"] == 1 and stats["tier_stuck.healthy"] == 0
        assert stats["tier_silent_s.stuck"] > 0
        assert [e["tier"] for e in events_named(caplog, "tier_stuck")] == ["stuck"]

        # Known stuck: a caller polling every step is not made to wait for it again.
        for n in range(5):
            _, took = within(T + SLACK, manager.take_events, f"take_events (poll {n})")
            assert took < QUICK, f"take_events waited {took:.2f} s for a tier already known stuck"
        ctx = ReqContext("during")
        manager.on_new_request(ctx)
        results, took = within(LOOKUP_T + SLACK, lambda: manager.lookup(keys("nowhere-else"), ctx), "lookup")
        assert results == [LookupResult.MISS] and took < QUICK  # a stuck tier counts as failed: a miss
        _, took = within(T + SLACK, manager.reset_cache, "reset_cache")
        idle, took = within(0.5 + SLACK, lambda: manager.wait_idle(timeout=0.5), "wait_idle(0.5)")
        assert idle is False

        # The healthy tier goes on: it gets the cascade, and the request finalizes there.
        stored = store(manager, ctx, ["during"])
        manager.on_request_finished(ctx)
        assert wait_for(lambda: healthy.count("on_request_finished", ctx) == 1, 10)
        assert healthy.count("submit_store", ctx) == 1
        assert stuck.count_submits(ctx) == 0  # nothing was sent to the stuck tier for it

        # It moves again: recovered, and its next jobs succeed.
        release.set()
        assert wait_for(lambda: manager.stats()["tiers_stuck"] == 0, 10), "the tier never recovered"
        assert [e["tier"] for e in events_named(caplog, "tier_unstuck")] == ["stuck"]
        after = ReqContext("after")
        manager.on_new_request(after)
        stored = store(manager, after, ["after"])
        manager.on_request_finished(after)
        assert manager.wait_idle(10)
        events = manager.take_events()
        assert OffloadingEvent(tuple(stored), "stuck", False) in events
        assert manager.stats()["tier_stuck.stuck"] == 0
        assert stuck.lookup(stored, after) == [LookupResult.HIT]
    finally:
        release.set()
        manager.stop(timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["submit_store", "take_events", "drain", "shutdown"])
@pytest.mark.parametrize("timeout", [None, 0.5])
def test_stop_returns_by_its_deadline_and_names_what_it_left_behind(
        call: str, timeout: float | None, release: threading.Event, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvactors")
    stuck = StuckTier(call, release)
    healthy = RecordingTier(name="healthy")
    manager = TieringManager.start(num_blocks=32, block_bytes=8, secondary_tiers=[stuck, healthy],
                                   transfer_timeout_s=T, lookup_timeout_s=LOOKUP_T)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    if call in ("submit_store", "take_events"):
        store(manager, ctx, ["a"])
        if call == "take_events":
            waiting = threading.Thread(target=manager.take_events, daemon=True)
            waiting.start()
        assert stuck.entered.wait(10)
    budget = T if timeout is None else timeout
    within(budget + 1.0 + SLACK, lambda: manager.stop(timeout=timeout), f"stop(timeout={timeout})")
    assert manager.stopped
    abandoned = [e["actor"] for e in events_named(caplog, "actor_abandoned")]
    assert abandoned == ["tier-stuck"], abandoned
    assert events_named(caplog, "manager_stopped")[-1]["abandoned"] == "tier-stuck"
    with pytest.raises(ManagerStoppedError):
        manager.stats()
    with pytest.raises(ManagerStoppedError):
        manager.take_events()
    within(SLACK, manager.stop, "stop() again")  # safe to call twice, and bounded too
    if call == "take_events":
        waiting.join(SLACK)  # a call in flight at stop() is answered, not left waiting
        assert not waiting.is_alive()
    kvactors_threads = [t for t in threading.enumerate() if t.name.startswith(("kvactors", "tier"))]
    assert all(t.daemon for t in kvactors_threads), [t.name for t in kvactors_threads if not t.daemon]


@pytest.mark.timeout(60)
def test_a_tier_stuck_forever_does_not_hold_up_interpreter_exit() -> None:
    code = textwrap.dedent("""
        import threading, time
        from kvactors import MemoryTier, ReqContext, TieringManager

        class Forever(MemoryTier):
            inline_calls = frozenset()
            def submit_store(self, job):
                threading.Event().wait()  # never returns

        m = TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[Forever(capacity_blocks=4)],
                                 transfer_timeout_s=0.5)
        c = ReqContext("r")
        m.on_new_request(c)
        out = m.prepare_store([b"k"], c)
        m.complete_store(out.keys_to_store, c)
        m.on_request_finished(c)
        started = time.monotonic()
        m.stop()
        print(f"stopped in {time.monotonic() - started:.2f}")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 0.5 + 1.0 + SLACK


def _blocking_inline_tier(release: threading.Event) -> MemoryTier:
    class Liar(MemoryTier):
        """Declares ``touch`` inline, and blocks in it once."""

        inline_calls = frozenset(("touch",))
        blocked = False

        def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
            if not Liar.blocked:
                Liar.blocked = True
                release.wait(0.6)
            super().touch(keys, ctx)

    return Liar(name="liar", capacity_blocks=8)


@pytest.mark.timeout(60)
def test_an_inline_call_that_blocks_is_demoted_after_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    """The precondition of inline_calls broken: the primary stalls once, then never again for that call."""
    caplog.set_level(logging.INFO, logger="kvactors")
    release = threading.Event()
    manager = TieringManager.start(num_blocks=8, block_bytes=8, secondary_tiers=[_blocking_inline_tier(release)],
                                   transfer_timeout_s=5)
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)  # the tier's actor is idle: the next touch is claimed, run inline
        manager.touch(keys(1), ctx)
        assert wait_for(lambda: manager.stats()["inline_calls_demoted"] == 1, 10)
        demoted = events_named(caplog, "inline_call_demoted")
        assert [(e["tier"], e["call"]) for e in demoted] == [("liar", "touch")]
        assert demoted[0]["seconds"] >= 0.5
    finally:
        release.set()
        manager.stop(timeout=5)


@pytest.mark.timeout(60)
def test_a_stop_with_a_long_budget_goes_on_without_a_tier_stuck_in_a_call(
        release: threading.Event, caplog: pytest.LogCaptureFixture) -> None:
    """The stop's round through the tiers asks the stuck tier; it owes an answer from then, and is
    found stuck transfer_timeout_s later, not at the end of the stop's own, longer, budget (a tick
    is armed for each deadline a round adds: the tier's as well as the round's)."""
    caplog.set_level(logging.INFO, logger="kvactors")
    stuck = StuckTier("on_request_finished", release)  # a hook: it owes the supervisor no answer
    manager = TieringManager.start(num_blocks=32, block_bytes=8, secondary_tiers=[stuck],
                                   transfer_timeout_s=T, lookup_timeout_s=LOOKUP_T)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    manager.on_request_finished(ctx)
    assert stuck.entered.wait(10)
    # Nothing in flight: the round asks the tier at once; stuck after T, not at 8 T + grace.
    _, took = within(8 * T + 1.0 + SLACK, lambda: manager.stop(timeout=8 * T), "stop(timeout=8 T)")
    assert events_named(caplog, "tier_stuck"), "the tier was never found stuck"
    assert took < T + 1.0 + SLACK, f"stop took {took:.2f} s: the stuck tier was waited for"
