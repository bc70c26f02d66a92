"""The lifecycle contract through the actors on real threads: one test per rule,
and one per row of the contract's table of holes found in the anchors."""

from __future__ import annotations

import threading

import pytest

from kvactors import LifecycleError, LookupResult, ManagerStoppedError, MemoryTier, ReqContext, TieringManager
from kvactors.tiers.base import HOOKS
from tests.support import ControlledTier, RecordingTier, keys, settled, wait_for

BLOCK = 32


def start(*tiers, num_blocks: int = 16, **kwargs) -> TieringManager:
    return TieringManager.start(num_blocks=num_blocks, block_bytes=BLOCK, secondary_tiers=list(tiers), **kwargs)


@pytest.fixture
def rec():
    return RecordingTier()


def store(manager: TieringManager, ctx: ReqContext, names, *, complete: bool = True, success: bool = True):
    out = manager.prepare_store(keys(*names), ctx)
    assert out is not None
    for n, row in enumerate(out.store_spec.block_ids):
        manager.pool[row] = n + 1
    if complete:
        manager.complete_store(out.keys_to_store, ctx, success)
    return out


def in_tiers_only(manager: TieringManager, names) -> None:
    """Blocks ``names`` stored (and cascaded) by a finished request, then gone from the pool: only
    the secondary tiers have them."""
    seeder = ReqContext("seed")
    manager.on_new_request(seeder)
    store(manager, seeder, names)
    manager.on_request_finished(seeder)
    settled(manager)
    manager.reset_cache()


# ----------------------------------------------------------------------------- rule 1


def test_rule1_finish_once_and_no_submit_after_it(rec):
    ctx = ReqContext("r1")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1, 2])
        manager.on_request_finished(ctx)
        manager.on_request_finished(ctx)  # idempotent
        settled(manager)
        for call in (manager.lookup, manager.prepare_store, manager.prepare_load):
            with pytest.raises(LifecycleError):
                call(keys(1), ctx)
        stats = settled(manager)
        assert stats["contract_violations"] == 0 and stats["active_requests"] == 0
    assert rec.count("on_request_finished", ctx) == 1
    assert rec.count("submit_store", ctx) == 1
    assert rec.violations == []


# ----------------------------------------------------------------------------- rules 2-4


def test_rule2_secondary_finish_waits_for_pending_store(rec):
    """vLLM's test_on_request_finished_delays_secondary_until_store_submitted."""
    ctx = ReqContext("r")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        out = store(manager, ctx, [1, 2], complete=False)
        manager.on_request_finished(ctx)
        settled(manager)
        assert rec.count("on_request_finished", ctx) == 0  # a store is still pending
        assert manager.stats()["active_requests"] == 1
        manager.complete_store(out.keys_to_store, ctx)
        settled(manager)
        assert rec.count("on_request_finished", ctx) == 1
    assert rec.calls_of(ctx) == ["on_new_request", "submit_store", "on_request_finished"]


def test_rule3_primary_is_told_at_once(rec):
    ctx = ReqContext("r")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        pending = store(manager, ctx, [1], complete=False)  # holds the tiers' finish
        manager.on_request_finished(ctx)
        # The very next call of this thread sees the finish, though tiers do not yet.
        with pytest.raises(LifecycleError, match="finished"):
            manager.prepare_store(keys(2), ctx)
        assert manager.wait_idle(5)
        assert rec.count("on_request_finished", ctx) == 0
        manager.complete_store(pending.keys_to_store, ctx)
        settled(manager)
        assert rec.count("on_request_finished", ctx) == 1


def test_rule4_queued_promotion_holds_the_finish():
    """PR #49022: a queued (unsent) promotion must count in the finalize gate."""
    tier = ControlledTier(max_inflight=1)
    seeder = ReqContext("seed")
    with start(tier) as manager:
        # Put two blocks in the tier, then clear the pool so lookups promote.
        manager.on_new_request(seeder)
        store(manager, seeder, [1])
        store(manager, seeder, [2])
        tier.wait_held(1)
        tier.release_all()
        tier.wait_held(1)
        tier.release_all()
        manager.on_request_finished(seeder)
        settled(manager)
        manager.reset_cache()

        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1), ctx) == [LookupResult.HIT_PENDING]
        tier.wait_held(1)  # promotion 1 holds the tier's only slot
        assert manager.lookup(keys(2), ctx) == [LookupResult.HIT_PENDING]  # promotion 2 is queued
        manager.on_request_finished(ctx)
        assert not manager.wait_idle(0.2)
        assert tier.count("on_request_finished", ctx) == 0
        assert manager.stats()["jobs_queued"] == 1
        tier.release_all()  # frees the slot: promotion 2 is submitted, then the finish
        tier.wait_held(1)
        tier.release_all()
        settled(manager)
    calls = tier.calls_of(ctx)
    assert calls == ["on_new_request", "submit_load", "submit_load", "on_request_finished"]
    assert tier.violations == []


def test_rule4_lookup_in_progress_holds_the_finish():
    """A lookup still waiting on a tier may promote: it holds the finish too."""
    tier = ControlledTier(hold=False)
    ctx = ReqContext("r")
    with start(tier) as manager:
        in_tiers_only(manager, [1])
        manager.on_new_request(ctx)
        tier.lookup_gate = threading.Event()
        answer: list[list[LookupResult]] = []
        looker = threading.Thread(target=lambda: answer.append(manager.lookup(keys(1), ctx)))
        looker.start()
        assert wait_for(lambda: manager.stats()["lookups_in_flight"] == 1)
        manager.on_request_finished(ctx)
        assert not manager.wait_idle(0.2)
        tier.lookup_gate.set()
        looker.join(10)
        assert answer == [[LookupResult.HIT_PENDING]]
        settled(manager)
    calls = tier.calls_of(ctx)
    assert calls == ["on_new_request", "submit_load", "on_request_finished"]


def test_rule4_parked_cascade_holds_the_finish():
    tier = ControlledTier(max_inflight=1)
    ctx = ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1])
        store(manager, ctx, [2])
        tier.wait_held(1)
        manager.on_request_finished(ctx)
        assert wait_for(lambda: manager.stats()["jobs_queued"] == 1)
        assert tier.count("on_request_finished", ctx) == 0
        tier.release_all()
        tier.wait_held(1)
        tier.release_all()
        settled(manager)
    calls = tier.calls_of(ctx)
    assert calls == ["on_new_request", "submit_store", "submit_store", "on_request_finished"]


# ----------------------------------------------------------------------------- rules 5-8


def test_rule5_failed_store_counts_as_completed(rec):
    ctx = ReqContext("r")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        out = store(manager, ctx, [1], complete=False)
        manager.on_request_finished(ctx)
        manager.complete_store(out.keys_to_store, ctx, success=False)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["blocks_pending"] == 0 and stats["blocks_ready"] == 0
        other = ReqContext("o")
        manager.on_new_request(other)
        assert manager.lookup(keys(1), other) == [LookupResult.MISS]
    assert rec.count("submit_store") == 0
    assert rec.count("on_request_finished", ctx) == 1


def test_rule6_request_without_stores_finalizes_at_once(rec):
    ctx = ReqContext("r")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0
    assert rec.count("on_request_finished", ctx) == 1


def test_rule7_reset_finalizes_finished_keeps_active_and_keeps_tier_data(rec):
    done, active = ReqContext("done"), ReqContext("active")
    with start(rec) as manager:
        for ctx in (done, active):
            manager.on_new_request(ctx)
        store(manager, done, [1])  # cascaded to the tier
        settled(manager)
        done_pending = store(manager, done, [2], complete=False)
        active_pending = store(manager, active, [3], complete=False)
        manager.on_request_finished(done)
        manager.reset_cache()
        assert rec.count("on_request_finished", done) == 1  # finalized by the reset
        assert rec.count("on_request_finished", active) == 0
        stats = manager.stats()
        assert stats["active_requests"] == 1 and stats["blocks_ready"] == stats["blocks_pending"] == 0
        # Late completions of voided stores are accounted for without error.
        manager.complete_store(done_pending.keys_to_store, done)
        manager.complete_store(active_pending.keys_to_store, active)
        # The active request goes on; the tier kept block 1, so it is promoted back.
        assert manager.lookup(keys(1), active) == [LookupResult.HIT_PENDING]
        settled(manager)
        assert manager.lookup(keys(1), active) == [LookupResult.HIT]
        store(manager, active, [4])
        manager.on_request_finished(active)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["contract_violations"] == 0
        assert stats["blocks_detached"] == 0 and stats["blocks_pinned"] == 0
    assert rec.count("on_request_finished", done) == 1
    assert rec.count("on_request_finished", active) == 1
    assert rec.violations == []


def test_rule8_no_state_after_finalize_and_late_completion_is_harmless(rec):
    ctx = ReqContext("r")
    with start(rec, transfer_timeout_s=0.2) as manager:
        manager.on_new_request(ctx)
        out = store(manager, ctx, [1], complete=False)
        manager.on_request_finished(ctx)
        assert wait_for(lambda: manager.stats()["active_requests"] == 0)  # the store's deadline passed
        stats = manager.stats()
        assert stats["primary_requests"] == 0 and stats["stores_timed_out"] == 1
        manager.complete_store(out.keys_to_store, ctx)  # late: accounted for, no error
        stats = settled(manager)
        assert stats["contract_violations"] == 0 and stats["blocks_detached"] == 0
        assert stats["blocks_free"] == 16
    assert rec.count("on_request_finished", ctx) == 1 and rec.count("submit_store") == 0


# ----------------------------------------------------------------------------- the holes table


def test_submit_after_finish_is_an_error_to_that_caller_only(rec):
    """vLLM #49635 / #49671: a KeyError killed the engine. Here: LifecycleError, and the runtime serves on."""
    ctx, other = ReqContext("r"), ReqContext("o")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        manager.on_request_finished(ctx)
        settled(manager)
        before = manager.stats()
        with pytest.raises(LifecycleError):
            manager.prepare_store(keys(1), ctx)
        with pytest.raises(LifecycleError, match="unknown"):
            manager.lookup(keys(1), ReqContext("never-started"))
        manager.on_new_request(other)
        with pytest.raises(LifecycleError, match="already active"):
            manager.on_new_request(other)
        after = manager.stats()
        assert {k: after[k] for k in ("blocks_ready", "blocks_pending", "contract_violations")} == {
            k: before[k] for k in ("blocks_ready", "blocks_pending", "contract_violations")}
        store(manager, other, [1])
        manager.on_request_finished(other)
        assert settled(manager)["blocks_ready"] == 1


def test_attempts_have_separate_state():
    """vLLM #51637: late completions of attempt 0 must not decrement attempt 1's counter."""
    rec = RecordingTier()
    old, new = ReqContext("r", 0), ReqContext("r", 1)
    with start(rec) as manager:
        manager.on_new_request(old)
        old_out = store(manager, old, [1], complete=False)
        manager.on_request_finished(old)  # preempted
        manager.on_new_request(new)
        new_out = store(manager, new, [2], complete=False)
        manager.on_request_finished(new)
        manager.complete_store(old_out.keys_to_store, old)  # the old attempt's late completion
        settled(manager)
        assert rec.count("on_request_finished", old) == 1
        assert rec.count("on_request_finished", new) == 0  # still has its own pending store
        with pytest.raises(LifecycleError):
            manager.prepare_store(keys(3), old)
        manager.complete_store(new_out.keys_to_store, new)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["contract_violations"] == 0
    assert rec.count("on_request_finished", new) == 1


def test_complete_with_the_wrong_attempt_is_a_counted_violation():
    old, new = ReqContext("r", 0), ReqContext("r", 1)
    with start() as manager:
        manager.on_new_request(old)
        manager.on_new_request(new)
        out = store(manager, old, [1], complete=False)
        manager.complete_store(out.keys_to_store, new)  # not new's store
        stats = settled(manager)
        assert stats["contract_violations"] == 1 and stats["blocks_pending"] == 1
        manager.complete_store(out.keys_to_store, old)
        assert settled(manager)["blocks_ready"] == 1


def test_stalled_tier_job_times_out_and_releases_the_request():
    """vLLM #49829 / Mooncake #974: in-progress work has an owner and a deadline."""
    tier = ControlledTier()
    ctx = ReqContext("r")
    with start(tier, transfer_timeout_s=1.0) as manager:  # the store completes before it, loaded or not
        manager.on_new_request(ctx)
        store(manager, ctx, [1])
        (job,) = tier.wait_held(1)
        manager.on_request_finished(ctx)
        assert wait_for(lambda: manager.stats()["jobs_timed_out"] == 1)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["jobs_in_flight"] == 0
        assert stats["jobs_held"] == 1  # the tier may still read the row: held, not reused
        assert tier.count("on_request_finished", ctx) == 1
        tier.release(job.job_id)  # the late report
        stats = settled(manager)
        assert stats["late_reports"] == 1 and stats["jobs_held"] == 0 and stats["blocks_pinned"] == 0


def test_stalled_tier_lookup_answers_retry():
    tier = ControlledTier(hold=False)
    tier.lookup_gate = threading.Event()
    ctx = ReqContext("r")
    with start(tier, lookup_timeout_s=0.2) as manager:
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1), ctx) == [LookupResult.RETRY]
        tier.lookup_gate.set()
        manager.on_request_finished(ctx)
        stats = settled(manager)
        assert stats["lookups_timed_out"] == 1 and stats["active_requests"] == 0


def test_failed_promotion_is_never_served():
    """Dynamo #8057: a failure is never a success."""
    tier = ControlledTier()
    seeder, ctx = ReqContext("seed"), ReqContext("r")
    with start(tier) as manager:
        manager.on_new_request(seeder)
        store(manager, seeder, [1])
        tier.wait_held(1)
        tier.release_all()
        manager.on_request_finished(seeder)
        settled(manager)
        manager.reset_cache()
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1), ctx) == [LookupResult.HIT_PENDING]
        tier.wait_held(1)
        tier.release_all(success=False)
        settled(manager)
        stats = manager.stats()
        assert stats["blocks_ready"] == 0 and stats["jobs_failed"] == 1
        with pytest.raises(LifecycleError, match="not ready"):
            manager.prepare_load(keys(1), ctx)
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0


def test_a_key_the_pool_has_no_room_to_promote_is_a_miss_and_so_are_the_keys_after_it():
    """Under pool pressure the fallback is to compute, never to wait (docs/guide.md, "Deadlines, reset, stop"): a
    promotion the pool cannot hold now is not started, and its key and the keys after it are a MISS.
    Once there is room, the same lookup promotes."""
    ctx = ReqContext("r")
    with start(MemoryTier(capacity_blocks=8), num_blocks=2) as manager:
        in_tiers_only(manager, [1, 4])
        manager.on_new_request(ctx)
        pending = store(manager, ctx, [2, 3], complete=False)  # every row pending: nothing to evict
        assert manager.lookup(keys(1, 4), ctx) == [LookupResult.MISS, LookupResult.MISS]
        stats = manager.stats()
        assert stats["blocks_pending"] == 2 and stats["promotions_refused"] == 1 and stats["jobs_in_flight"] == 0
        manager.complete_store(pending.keys_to_store, ctx)
        assert manager.wait_idle(10)  # the cascades of 2 and 3 hold their rows until they end
        assert manager.lookup(keys(1), ctx) == [LookupResult.HIT_PENDING]
        assert wait_for(lambda: manager.lookup(keys(1), ctx) == [LookupResult.HIT])
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0


def test_a_promotion_that_fits_in_part_starts_its_prefix_and_the_rest_is_a_miss():
    """Two rows free for three keys on the tier: the first two are promoted, the third is a MISS."""
    ctx = ReqContext("r")
    with start(MemoryTier(capacity_blocks=8), num_blocks=3) as manager:
        in_tiers_only(manager, [1, 2, 3])
        manager.on_new_request(ctx)
        pending = store(manager, ctx, [9], complete=False)
        assert manager.lookup(keys(1, 2, 3), ctx) == [LookupResult.HIT_PENDING] * 2 + [LookupResult.MISS]
        manager.complete_store(pending.keys_to_store, ctx, success=False)
        assert wait_for(lambda: manager.lookup(keys(1, 2), ctx) == [LookupResult.HIT] * 2)
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0


def test_promoted_blocks_are_kept_for_their_request_until_it_loads_them():
    """The thrash of issue 26: blocks promoted for a request were evicted by other requests'
    promotions and stores before it could load them. They are reserved for it (with the ready
    blocks before them) until its prepare_load takes them over, its finish, or the lookup deadline."""
    a, b = ReqContext("a"), ReqContext("b")
    with start(MemoryTier(capacity_blocks=8), num_blocks=3) as manager:
        in_tiers_only(manager, [1, 2, 3])
        manager.on_new_request(a)
        store(manager, a, [1])  # ready in the pool again: a HIT before the promoted key
        assert manager.lookup(keys(1, 2), a) == [LookupResult.HIT, LookupResult.HIT_PENDING]
        assert wait_for(lambda: manager.lookup(keys(2), a) == [LookupResult.HIT])
        assert manager.wait_idle(10)
        assert manager.stats()["blocks_reserved"] == 2
        manager.on_new_request(b)  # another request: it can use the one row left, not a's two
        assert manager.prepare_store(keys(7, 8), b) is None
        out = manager.prepare_store(keys(7), b)
        assert out is not None and out.evicted_keys == []
        # The one row left is being written (not evictable): no room, b computes key 3.
        assert manager.lookup(keys(3), b) == [LookupResult.MISS]
        spec = manager.prepare_load(keys(1, 2), a)  # a's load pins take over
        stats = manager.stats()
        assert stats["blocks_reserved"] == 0 and stats["blocks_pinned"] == 2 and stats["blocks_pending"] == 1
        manager.complete_store(out.keys_to_store, b)
        manager.complete_load(keys(1, 2), a)
        for ctx in (a, b):
            manager.on_request_finished(ctx)
        stats = settled(manager)
        assert len(spec.block_ids) == 2 and stats["blocks_pinned"] == 0 and stats["active_requests"] == 0


def test_a_requests_promotions_never_evict_its_own_ready_blocks():
    """Found in review: the rows for a lookup's promotions were taken by evicting any ready block,
    the lookup's own HITs included, so a request could evict the prefix it was about to load."""
    a = ReqContext("a")
    with start(MemoryTier(capacity_blocks=8), num_blocks=3) as manager:
        in_tiers_only(manager, [1, 2, 3])
        in_tiers_only(manager, [4])
        manager.on_new_request(a)
        store(manager, a, [1, 2])  # ready again: two HITs, one free row
        assert manager.wait_idle(10)  # their cascades ended: evictable
        assert manager.lookup(keys(1, 2, 3, 4), a) == [LookupResult.HIT] * 2 + [LookupResult.HIT_PENDING,
                                                                               LookupResult.MISS]
        assert wait_for(lambda: manager.lookup(keys(1, 2, 3), a) == [LookupResult.HIT] * 3)
        spec = manager.prepare_load(keys(1, 2, 3), a)
        manager.complete_load(keys(1, 2, 3), a)
        manager.on_request_finished(a)
        stats = settled(manager)
        assert len(spec.block_ids) == 3 and stats["blocks_pinned"] == 0 and stats["blocks_reserved"] == 0


@pytest.mark.parametrize("end", ["finish", "deadline", "reset"])
def test_a_reservation_ends_with_the_finish_the_lookup_deadline_or_a_reset(end):
    ctx = ReqContext("r")
    with start(MemoryTier(capacity_blocks=8), num_blocks=4, lookup_timeout_s=0.2 if end == "deadline" else 30.0) \
            as manager:
        in_tiers_only(manager, [1, 2])
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1, 2), ctx) == [LookupResult.HIT_PENDING] * 2
        assert manager.wait_idle(10)
        if end != "deadline":
            assert manager.stats()["blocks_reserved"] == 2
        if end == "finish":
            manager.on_request_finished(ctx)
        elif end == "reset":
            manager.reset_cache()
        assert wait_for(lambda: manager.stats()["blocks_reserved"] == 0 and manager.stats()["blocks_pinned"] == 0)
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0


def test_a_key_stored_again_after_a_reset_is_stored_and_the_finish_waits_for_both_writes(rec):
    """Found in review: the second prepare_store left the key out although it was MISS, so it was
    never stored. Now it is written again; the request is finalized (the tier told) only after its
    last completion, and the block cascades once, after both writes ended."""
    ctx = ReqContext("r")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1], complete=False)
        manager.reset_cache()
        assert manager.lookup(keys(1), ctx) == [LookupResult.MISS]
        again = store(manager, ctx, [1], complete=False)
        assert again.keys_to_store == keys(1)
        manager.complete_store(keys(1), ctx)  # one of the two writes ended: which one is unknown
        assert manager.lookup(keys(1), ctx) == [LookupResult.HIT_PENDING]
        manager.on_request_finished(ctx)
        assert manager.wait_idle(5) and rec.count("on_request_finished", ctx) == 0  # a store is pending
        manager.complete_store(keys(1), ctx)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["blocks_detached"] == 0 and stats["blocks_ready"] == 1
        assert stats["contract_violations"] == 0 and not rec.violations
        calls = rec.calls_of(ctx)
        assert calls.count("submit_store") == 1 and calls.count("on_request_finished") == 1
        assert calls.index("submit_store") < calls.index("on_request_finished")


def test_a_key_stored_again_after_its_deadline_is_stored():
    ctx = ReqContext("r")
    with start(transfer_timeout_s=0.3) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1], complete=False)
        assert wait_for(lambda: manager.stats()["stores_timed_out"] == 1)
        assert manager.lookup(keys(1), ctx) == [LookupResult.MISS]
        again = store(manager, ctx, [1], complete=False)
        assert again.keys_to_store == keys(1)
        manager.complete_store(keys(1), ctx)
        manager.complete_store(keys(1), ctx)  # both writes ended (unless the second timed out too)
        manager.on_request_finished(ctx)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["blocks_detached"] == 0 and stats["contract_violations"] == 0
        assert stats["blocks_ready"] + stats["stores_timed_out"] == 2  # ready, or its deadline passed first


def test_raising_tier_fails_its_job_and_spares_the_others():
    bad = ControlledTier(name="bad", raise_on=["submit_store", "lookup"])
    good = RecordingTier(name="good")
    ctx = ReqContext("r")
    with start(bad, good) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1])
        manager.on_request_finished(ctx)
        stats = settled(manager)
        assert stats["jobs_failed"] == 1 and stats["jobs_succeeded"] == 1 and stats["active_requests"] == 0
        manager.reset_cache()
        other = ReqContext("o")
        manager.on_new_request(other)
        assert manager.lookup(keys(1), other) == [LookupResult.HIT_PENDING]  # good tier has it
    assert bad.count("on_request_finished", ctx) == good.count("on_request_finished", ctx) == 1
    assert len(good) == 1


def test_completions_release_pins_without_memory_pressure():
    """SGLang #32455 / LMCache #2942: pins are released as completions arrive."""
    ctx = ReqContext("r")
    with start() as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1, 2])
        settled(manager)
        spec = manager.prepare_load(keys(1, 2), ctx)
        assert len(spec.block_ids) == 2 and manager.stats()["blocks_pinned"] == 2
        manager.complete_load(keys(1, 2), ctx)
        assert settled(manager)["blocks_pinned"] == 0
        manager.complete_load(keys(1), ctx)  # a double unpin is refused and counted
        stats = settled(manager)
        assert stats["contract_violations"] == 1 and stats["blocks_pinned"] == 0


def test_eviction_never_takes_pinned_or_pending_blocks():
    ctx = ReqContext("r")
    with start(num_blocks=3) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1, 2])
        settled(manager)
        manager.prepare_load(keys(1), ctx)
        pending = store(manager, ctx, [3], complete=False)
        assert manager.prepare_store(keys(4, 5), ctx) is None
        out = manager.prepare_store(keys(4), ctx)
        assert out is not None and out.evicted_keys == keys(2)
        assert manager.prepare_store(keys(5), ctx) is None
        manager.complete_load(keys(1), ctx)
        manager.complete_store(pending.keys_to_store, ctx)
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert settled(manager)["contract_violations"] == 0


def test_finish_of_aborted_request_releases_its_reservations():
    """SGLang #9874: an aborted request's reservations are released (by their deadline)."""
    ctx = ReqContext("r")
    with start(num_blocks=2, transfer_timeout_s=0.2) as manager:
        manager.on_new_request(ctx)
        store(manager, ctx, [1, 2], complete=False)  # aborted: never completed
        manager.on_request_finished(ctx)
        assert wait_for(lambda: manager.stats()["active_requests"] == 0)
        other = ReqContext("o")
        manager.on_new_request(other)
        # The rows come back only once the abandoned writes end; until then they stay reserved.
        assert manager.prepare_store(keys(3), other) is None
        manager.complete_store(keys(1, 2), ctx, success=False)
        settled(manager)
        assert manager.prepare_store(keys(3), other) is not None


def test_bad_input_is_a_value_error_that_changes_nothing():
    ctx = ReqContext("r")
    with start() as manager:
        manager.on_new_request(ctx)
        before = manager.stats()
        with pytest.raises(ValueError):
            manager.lookup([b"ok", "not-bytes"], ctx)
        with pytest.raises(ValueError):
            manager.prepare_store(b"a-single-key", ctx)
        with pytest.raises(ValueError):
            manager.complete_store(keys(1), ("r", 0))
        assert manager.stats() == before
    with pytest.raises(ValueError):
        TieringManager.start(num_blocks=0, block_bytes=8)
    with pytest.raises(ValueError):
        TieringManager.start(num_blocks=1, block_bytes=8, eviction="fifo")
    with pytest.raises(ValueError):
        TieringManager.start(num_blocks=1, block_bytes=8,
                             secondary_tiers=[MemoryTier(capacity_blocks=1), MemoryTier(capacity_blocks=1)])
    with pytest.raises(ValueError):
        ReqContext("r", attempt=-1)


def test_calls_after_stop_raise_and_stop_is_idempotent(rec):
    manager = start(rec)
    manager.stop()
    manager.stop()
    with pytest.raises(ManagerStoppedError):
        manager.on_new_request(ReqContext("r"))
    with pytest.raises(ManagerStoppedError):
        manager.complete_store(keys(1), ReqContext("r"))


def test_lookups_overtake_queued_submits_of_a_blocking_tier():
    """A tier whose submit blocks (I/O on the submit path) must not stall frontend lookups."""
    gate = threading.Event()
    order: list[str] = []

    class BlockingTier(RecordingTier):
        def submit_store(self, job):
            order.append("submit_store")
            gate.wait(30)  # the first submit blocks the tier's actor
            super().submit_store(job)

        def lookup(self, keys, ctx):
            order.append("lookup")
            return super().lookup(keys, ctx)

    tier = BlockingTier(name="blocking")
    writer, reader = ReqContext("writer"), ReqContext("reader")
    with start(tier, lookup_timeout_s=10) as manager:
        manager.on_new_request(writer)
        manager.on_new_request(reader)
        store(manager, writer, [1])
        store(manager, writer, [2])  # queued behind the blocked one
        assert wait_for(lambda: order == ["submit_store"])
        answer: list[list[LookupResult]] = []
        looker = threading.Thread(target=lambda: answer.append(manager.lookup(keys(9), reader)))
        looker.start()
        assert wait_for(lambda: len(order) == 1 and manager.stats()["lookups_in_flight"] == 1)
        gate.set()  # the blocked submit ends; the lookup is served before the queued submit
        looker.join(10)
        assert answer == [[LookupResult.MISS]]
        manager.on_request_finished(writer)
        manager.on_request_finished(reader)
        settled(manager)
    assert order == ["submit_store", "lookup", "submit_store"]
    assert tier.violations == []


# ----------------------------------------------------------------------------- the facade's request registry


def test_duplicate_new_request_is_refused_at_the_caller_from_any_thread(rec):
    """on_new_request needs no round trip: the facade refuses a live identity itself."""
    ctx = ReqContext("dup")
    with start(rec) as manager:
        manager.on_new_request(ctx)
        errors: list[BaseException] = []

        def again() -> None:
            try:
                manager.on_new_request(ctx)
            except BaseException as exc:
                errors.append(exc)

        others = [threading.Thread(target=again) for _ in range(4)]
        for thread in others:
            thread.start()
        for thread in others:
            thread.join()
        assert len(errors) == 4 and all(isinstance(e, LifecycleError) for e in errors)
        out = store(manager, ctx, [1], complete=False)  # the first registration is intact
        manager.on_request_finished(ctx)
        settled(manager)
        with pytest.raises(LifecycleError, match="already active"):
            manager.on_new_request(ctx)  # finished, not finalized (a store is pending): still refused
        manager.complete_store(out.keys_to_store, ctx)
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["internal_errors"] == 0
        manager.on_new_request(ctx)  # finalized: the identity starts a new lifetime
        manager.on_request_finished(ctx)
        assert settled(manager)["active_requests"] == 0
    assert rec.count("on_new_request", ctx) == 2
    assert rec.count("on_request_finished", ctx) == 2
    assert rec.violations == []


def test_without_the_new_request_hook_the_supervisor_opens_state_lazily():
    """A tier that does not declare on_new_request is never sent it: the supervisor opens each
    request's state with its first fact."""
    quiet = RecordingTier(name="quiet")
    quiet.hooks = HOOKS - {"on_new_request"}  # type: ignore[misc]
    idle, busy = ReqContext("idle"), ReqContext("busy")
    with start(quiet) as manager:
        manager.on_new_request(idle)
        manager.on_new_request(busy)
        stats = settled(manager)
        assert stats["active_requests"] == 2 and stats["supervisor_requests"] == 0
        assert manager.lookup(keys(9), busy) == [LookupResult.MISS]  # opens busy's state
        assert settled(manager)["supervisor_requests"] == 1
        store(manager, busy, [1, 2])
        manager.on_request_finished(busy)
        manager.on_request_finished(idle)  # the finish is idle's first fact: it opens and finalizes at once
        stats = settled(manager)
        assert stats["active_requests"] == 0 and stats["supervisor_requests"] == 0
        assert stats["internal_errors"] == 0 and stats["guard_violations"] == 0
    assert quiet.count("on_new_request") == 0
    assert quiet.count("on_request_finished", idle) == quiet.count("on_request_finished", busy) == 1
    assert quiet.count("submit_store", busy) == 1
    assert quiet.violations == []


@pytest.mark.parametrize("first_outcome", ["failed", "succeeded then evicted"])
def test_a_stores_deadline_never_times_out_a_later_store_of_the_same_key(first_outcome):
    """A request stores (k1, k2); that store ends; the request stores k1 again. The first
    store's deadline passing must not detach the second write, which is on time."""
    from kvactors.testing import SimRuntime

    runtime = SimRuntime(seed=3)
    ctx = ReqContext("r")
    manager = TieringManager.start(num_blocks=2, block_bytes=8, transfer_timeout_s=1.0, runtime=runtime)
    try:
        manager.on_new_request(ctx)
        first = manager.prepare_store(keys(1, 2), ctx)  # deadline at t = 1.0
        if first_outcome == "failed":
            manager.complete_store(first.keys_to_store, ctx, success=False)
        else:
            manager.complete_store(first.keys_to_store, ctx)
            other = ReqContext("other")  # evicts k1 and k2 (the pool has 2 rows)
            manager.on_new_request(other)
            manager.complete_store(manager.prepare_store(keys(3, 4), other).keys_to_store, other)
        runtime.advance(0.6)
        again = manager.prepare_store(keys(1), ctx)  # deadline at t = 1.6
        assert again is not None and list(again.keys_to_store) == keys(1)
        runtime.advance(0.6)  # t = 1.2: past the first deadline only
        assert manager.stats()["stores_timed_out"] == 0
        manager.complete_store(again.keys_to_store, ctx)
        runtime.run()
        assert manager.lookup(keys(1), ctx) == [LookupResult.HIT]
        stats = manager.stats()
        assert stats["stores_timed_out"] == 0 and stats["contract_violations"] == 0
    finally:
        manager.stop()


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), "1", None, True])
def test_sim_runtime_advance_refuses_what_is_not_a_finite_time(seconds):
    from kvactors.testing import SimRuntime

    runtime = SimRuntime(seed=0)
    with pytest.raises(ValueError, match="seconds"):
        runtime.advance(seconds)
    assert runtime.now() == 0.0


def test_a_slow_machine_jump_restarts_a_bounded_wait_made_outside_any_client():
    """A jump the seed chose while work was pending (a stalled machine) must not eat a
    blocking call's bound: the wait's clock restarts, as a client's does. Only time the
    runtime could not avoid counts (the hypothesis machine's reset_cache timed out on this)."""
    from kvactors.actors.reply import Reply
    from kvactors.actors.runtime import Actor, handles
    from kvactors.testing import SimRuntime

    class Sink(Actor):
        name = "sink"

        @handles(str)
        def _on_str(self, message: str) -> None:
            pass

    runtime = SimRuntime(seed=0, time_jump_chance=1.0)  # jump whenever a timer is due
    sink = runtime.spawn(Sink(), "sink")
    runtime.call_later(3.0, sink, "tick")
    runtime.call_later(6.0, sink, "tock")
    answered: Reply[None] = Reply()
    runtime.defer("answer", lambda: answered.set_result(None))
    assert runtime.wait(answered, 5.0), "stalls to t = 3 and t = 6 counted against a 5 s bound"
    assert runtime.now() == 6.0

    never: Reply[None] = Reply()
    runtime.call_later(4.0, sink, "forced")  # at t = 10
    assert not runtime.wait(never, 5.0)  # a jump with nothing else to run counts: still bounded
    assert runtime.now() == 10.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_bounded_wait_ends_though_work_and_timers_never_stop(seed):
    """Always something to run and a timer that re-arms: every jump is a slow-machine one.
    The stalls a wait is credited are at most its own bound, so it still ends (by 2x)."""
    from kvactors.actors.reply import Reply
    from kvactors.actors.runtime import Actor, handles
    from kvactors.testing import SimRuntime

    class Busy(Actor):
        name = "busy"
        spins = 0

        @handles(float)
        def _on_tick(self, period: float) -> None:
            self.runtime.call_later(period, self.ref, period)

        @handles(str)
        def _on_spin(self, message: str) -> None:
            self.spins += 1
            assert self.spins < 200_000, "the wait never ended"
            self.ref.tell(message)

    for in_client in (False, True):
        runtime = SimRuntime(seed, time_jump_chance=0.05)
        ref = runtime.spawn(Busy(), "busy")
        ref.tell(1.0)
        ref.tell("spin")
        if not in_client:
            assert not runtime.wait(Reply(), 5.0)
            assert 5.0 <= runtime.now() <= 11.0
            continue
        out: list[tuple[bool, float]] = []  # a frontend thread's wait: the same bound
        def frontend(runtime: SimRuntime = runtime, out: list[tuple[bool, float]] = out) -> None:
            out.append((runtime.wait(Reply(), 5.0), runtime.now()))

        runtime.spawn_client("frontend", frontend)
        while not out and runtime.step():
            pass
        assert out and out[0][0] is False and 5.0 <= out[0][1] <= 11.0
