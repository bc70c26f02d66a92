"""The lifecycle table alone: the finalize decision and its counters."""

from __future__ import annotations

import pytest

from kvactors import LifecycleError, ReqContext
from kvactors.core.lifecycle import COUNTERS, InvariantError, LifecycleTable, Pending

CTX = ReqContext("r")


def test_finished_request_with_nothing_pending_finalizes_once():
    table = LifecycleTable()
    table.start(CTX)
    assert table.maybe_finalize(CTX) is None  # not finished
    table.finish(CTX)
    state = table.maybe_finalize(CTX)
    assert state is not None and state.req_context == CTX
    assert CTX not in table
    assert table.maybe_finalize(CTX) is None  # once


@pytest.mark.parametrize("counter", COUNTERS)
def test_each_counter_holds_finalize(counter):
    table = LifecycleTable()
    table.start(CTX)
    table.add(CTX, counter, 2)
    table.finish(CTX)
    assert table.maybe_finalize(CTX) is None
    table.add(CTX, counter, -1)
    assert table.maybe_finalize(CTX) is None
    table.add(CTX, counter, -1)
    assert table.maybe_finalize(CTX) is not None


def test_counter_below_zero_is_an_invariant_error_and_changes_nothing():
    table = LifecycleTable()
    table.start(CTX)
    table.add(CTX, "pending_primary_stores", 1)
    with pytest.raises(InvariantError):
        table.add(CTX, "pending_primary_stores", -2)
    assert table.get(CTX).pending[Pending.PRIMARY_STORES] == 1


def test_attempts_are_separate_identities():
    table = LifecycleTable()
    table.start(CTX)
    retry = ReqContext("r", attempt=1)
    table.start(retry)
    table.add(CTX, "pending_primary_stores", 1)
    table.finish(retry)
    assert table.maybe_finalize(retry) is not None
    assert table.get(CTX).pending[Pending.PRIMARY_STORES] == 1


def test_duplicate_start_is_a_lifecycle_error():
    table = LifecycleTable()
    table.start(CTX)
    with pytest.raises(LifecycleError):
        table.start(ReqContext("r", 0, params={"other": 1}))
    assert len(table) == 1


def test_reset_zeroes_counts_finalizes_finished_and_keeps_active():
    table = LifecycleTable()
    active, done = ReqContext("active"), ReqContext("done")
    for ctx in (active, done):
        table.start(ctx)
        table.add(ctx, "pending_primary_stores", 3)
        table.add(ctx, "unsent_promotions", 1)
    table.finish(done)
    finalized = table.reset()
    assert [s.req_context for s in finalized] == [done]
    assert done not in table
    assert table.get(active).counts() == dict.fromkeys(COUNTERS, 0)
    assert not table.get(active).is_finished


def test_unknown_requests_are_ignored():
    table = LifecycleTable()
    assert table.finish(CTX) is None
    assert table.add(CTX, "pending_lookups", 1) is None
    assert table.maybe_finalize(CTX) is None
