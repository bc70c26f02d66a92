"""The vLLM adapter's vLLM-free pieces, directly (the adapter itself: tests/vllm/, in vLLM's venvs)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest

from kvactors import LookupResult, ReqContext, TieringManager
from kvactors.integrations.vllm import lookups
from kvactors.integrations.vllm.requests import LookupJob, Requests
from kvactors.integrations.vllm.stale import StaleJobs, take_owed

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


@pytest.fixture
def tm() -> Iterator[TieringManager]:
    with TieringManager.start(num_blocks=8, block_bytes=8) as manager:
        yield manager


def _ready(tm: TieringManager, *keys: bytes) -> None:
    ctx = ReqContext("writer")
    tm.on_new_request(ctx)
    tm.prepare_store(list(keys), ctx)
    tm.complete_store(list(keys), ctx)
    tm.on_request_finished(ctx)


def test_remaining_keys_are_the_later_keys_of_the_same_group_in_prefix_order():
    # A key's group is its last 4 bytes.
    positions = {b"a-gr1": 0, b"c-gr1": 2, b"b-gr1": 1, b"x-gr2": 3, b"d-gr1": 4}
    assert lookups.remaining_keys(b"b-gr1", positions) == (b"b-gr1", b"c-gr1", b"d-gr1")
    assert lookups.remaining_keys(b"zz", positions) == (b"zz",)
    assert lookups.remaining_keys(b"zz", None) == (b"zz",)


@pytest.mark.parametrize(("results", "lead"), [
    ([HIT, HIT, MISS, HIT], [b"k0", b"k1"]), ([HIT, PENDING, HIT, HIT], []), ([MISS, HIT, HIT, HIT], []),
    ([HIT, HIT, HIT, HIT], [b"k0", b"k1", b"k2", b"k3"]),
])
def test_leading_hits_only_when_every_key_up_to_the_first_miss_is_a_hit(results, lead):
    assert lookups.leading_hits([b"k0", b"k1", b"k2", b"k3"], results) == lead


def test_an_answer_pins_its_leading_hits_and_post_hands_them_to_the_request(tm):
    _ready(tm, b"k0", b"k1")
    requests = Requests(tm, Counter())
    req = requests.start_attempt("r", None)
    job = LookupJob((b"k0", b"k1", b"k2"), req.ctx)
    req.begin_lookup(job)
    lookups.answer(tm, job, log=None)
    assert job.answers == {b"k0": HIT, b"k1": HIT, b"k2": MISS} and set(job.pinned) == {b"k0", b"k1"}
    assert lookups.post(requests, job) == [] and set(req.pinned) == {b"k0", b"k1"} and req.job is None
    assert "r" in requests.with_answers
    requests.finish_attempt(req)  # drops the unused pins
    assert tm.wait_idle(10) and tm.stats()["blocks_pinned"] == 0


def test_pins_outlive_the_steps_answers_for_hold_s_then_go_back(tm):
    """A request vLLM could not schedule this step (no device blocks yet) keeps its pinned blocks
    into the next steps, so other requests' stores cannot evict them; for hold_s at most."""
    _ready(tm, b"k0", b"k1")
    requests = Requests(tm, Counter())
    req = requests.start_attempt("r", None)
    job = LookupJob((b"k0", b"k1"), req.ctx)
    req.begin_lookup(job)
    lookups.answer(tm, job, log=None)
    lookups.post(requests, job)
    req.mark_read()
    now = req.pinned_since
    requests.end_step(now + 1.0, hold_s=5.0)
    assert req.answers == {} and set(req.pinned) == {b"k0", b"k1"}  # answers dropped, pins kept
    assert tm.wait_idle(10) and tm.stats()["blocks_pinned"] == 2
    requests.end_step(now + 6.0, hold_s=5.0)
    assert req.pinned == {} and "r" not in requests.with_answers
    assert tm.wait_idle(10) and tm.stats()["blocks_pinned"] == 0
    requests.finish_attempt(req)


def test_a_stale_job_gives_all_its_pins_back(tm):
    _ready(tm, b"k0")
    requests = Requests(tm, Counter())
    req = requests.start_attempt("r", None)
    job = LookupJob((b"k0",), req.ctx)
    req.begin_lookup(job)
    lookups.answer(tm, job, log=None)
    job.stale = True
    assert lookups.post(requests, job) == [b"k0"] and not req.pinned


def test_a_new_attempt_keeps_the_completions_the_old_one_owes(tm):
    requests = Requests(tm, Counter())
    first = requests.start_attempt("r", None)
    first.storing(first.ctx, {b"k": 3})
    requests.finish_attempt(first)
    second = requests.start_attempt("r", None)
    assert second.ctx.attempt == first.ctx.attempt + 1 and second.stores == {b"k": [(first.ctx, 3)]}
    assert requests.current("r", None) is second and requests.counters["untracked_requests"] == 0


def test_two_attempts_owing_a_store_of_one_key_are_matched_by_their_rows_copy_then_by_age(tm):
    requests = Requests(tm, Counter())
    first = requests.start_attempt("r", None)
    first.storing(first.ctx, {b"k": 3})  # its store passed kvactors' deadline; its row stays held
    requests.finish_attempt(first)
    second = requests.start_attempt("r", None)
    second.storing(second.ctx, {b"k": 5})
    assert second.stores == {b"k": [(first.ctx, 3), (second.ctx, 5)]}  # the first one stays owed
    assert second.take_store(b"k", lambda row: row == 5) == (second.ctx, 5)  # row 5's copy ended first
    assert second.take_store(b"k", lambda row: False) == (first.ctx, 3) and not second.stores
    second.storing(first.ctx, {b"k": 3})
    second.storing(second.ctx, {b"k": 5})
    assert second.take_store(b"k", lambda row: True) == (first.ctx, 3)  # both ended: the oldest
    assert second.take_store(b"k") == (second.ctx, 5) and not second.stores
    second.storing(first.ctx, {b"k": 3})
    second.storing(second.ctx, {b"k": 5})
    assert take_owed(second) == [("store", b"k", first.ctx, 3), ("store", b"k", second.ctx, 5)]


def test_stale_stores_end_as_failed_after_the_flush_steps_without_a_fence(tm):
    requests = Requests(tm, Counter())
    req = requests.start_attempt("r", None)
    out = tm.prepare_store([b"k"], req.ctx)
    assert out is not None
    req.storing(req.ctx, {b"k": out.store_spec.block_ids[0]})
    stale = StaleJobs(tm, has_reset_fence=False, flush_steps=2)
    stale.add("reset", take_owed(req))
    assert not req.stores and stale.waiting
    stale.end_step()
    assert stale.waiting and tm.stats()["blocks_pending"] == 1
    stale.end_step()
    assert not stale.waiting
    assert tm.lookup([b"k"], req.ctx) == [MISS]  # never made ready
    assert tm.stats()["blocks_pending"] == 0


def test_stale_stores_complete_a_key_an_attempt_wrote_twice_once_a_call():
    """An attempt whose store of a key passed the deadline may store it again: each write is completed."""
    calls: list[tuple[str, list[bytes], int]] = []

    class Recording:
        def complete_store(self, keys, ctx, success):
            calls.append(("store", list(keys), ctx.attempt))

        def complete_load(self, keys, ctx):
            calls.append(("load", list(keys), ctx.attempt))

    first, second = ReqContext("r", 0), ReqContext("r", 1)
    stale = StaleJobs(Recording(), has_reset_fence=True, flush_steps=1)  # type: ignore[arg-type]
    stale.add("reset", [("store", b"k", first, 3), ("store", b"j", first, 4), ("store", b"k", first, 5),
                        ("store", b"k", second, 6), ("load", b"j", second, -1)])
    stale.release()
    assert calls == [("store", [b"k", b"j"], 0), ("store", [b"k"], 0), ("store", [b"k"], 1), ("load", [b"j"], 1)]


def test_with_the_fence_stale_jobs_wait_for_release(tm):
    stale = StaleJobs(tm, has_reset_fence=True, flush_steps=1)
    stale.add("reset", [])
    for _ in range(5):
        stale.end_step()
    assert stale.waiting
    stale.release()
    assert not stale.waiting


def test_a_request_is_kept_through_a_call_outside_the_lock_then_forgotten(tm):
    """Issue 37 item 6: the count of calls outside the lock is a context manager, balanced even
    when the call raises, and the request is forgotten once it is done, not before."""
    requests = Requests(tm, Counter())
    for fails in (False, True):
        req = requests.start_attempt("r", None)
        with requests.lock:
            with pytest.raises(RuntimeError) if fails else contextlib.nullcontext(), requests.kept(req):
                with requests.unlocked():
                    assert not requests.lock.locked()
                    requests.finish_attempt(req)  # as if it finished meanwhile
                assert requests.lock.locked() and requests.get("r") is req and not req.done()
                if fails:
                    raise RuntimeError("the call failed")
            assert requests.get("r") is None and req.done()


def test_a_request_changes_only_through_its_methods(tm):
    requests = Requests(tm, Counter())
    req = requests.start_attempt("r", None)
    for name in ("finished", "job", "answers", "pinned", "pinned_since", "stores", "loads", "calls", "read"):
        with pytest.raises(AttributeError):
            setattr(req, name, None)
    req.storing(req.ctx, {b"k": 3})
    req.loading([b"k", b"k"])
    assert req.take_store(b"k") == (req.ctx, 3) and req.take_store(b"k") is None
    assert req.take_load(b"k") == req.ctx and req.take_load(b"k") == req.ctx and req.take_load(b"k") is None
    assert not req.stores and not req.loads


def test_a_tiers_entry_is_parsed_once_into_a_frozen_typed_spec(tmp_path):
    """Issue 37 item 6: downstream code reads a TierSpec, never the raw entry."""
    import dataclasses

    from kvactors.integrations.vllm.config import parse_config
    from kvactors.integrations.vllm.tier_spec import TierSpec, TierType

    root = str(tmp_path / "disk")
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "disk", "root": root, "capacity_bytes": 1 << 20, "admission": "write_back", "max_queued_bytes": 0},
        {"type": "memory", "capacity_blocks": 4}]})
    disk, memory = config.tiers
    assert disk == TierSpec(0, TierType.DISK, {"root": root, "capacity_bytes": 1 << 20}, "write_back", 0)
    assert disk.writes_back and disk.where == "tiers[0]"
    assert memory.type is TierType.MEMORY and memory.admission is None and memory.max_queued_bytes is None
    assert not memory.writes_back and memory.where == "tiers[1]"
    with pytest.raises(dataclasses.FrozenInstanceError):
        disk.type = TierType.MEMORY  # type: ignore[misc]
    with pytest.raises(TypeError):
        disk.options["root"] = "elsewhere"  # type: ignore[index]
