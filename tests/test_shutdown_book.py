"""Shutdown: a stop drains within its budget, then one shutdown round, then its reply (plain class)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.shutdown import SHUTDOWN_GRACE_S, Shutdown, ShutdownPhase, ShutdownRound


def test_a_stop_whose_work_drains_in_time_gets_the_rest_of_its_budget_for_the_round():
    stop: Shutdown[str] = Shutdown()
    assert not stop.stopping and not stop.awaits_round and stop.timer_deadline() is None
    assert stop.begin("reply", now=10.0, budget_s=2.0) == 12.0
    assert stop.stopping and stop.phase is ShutdownPhase.DRAINING and stop.timer_deadline() == 12.0
    assert stop.round_due(10.5, work_left=True) is None  # jobs still in flight
    assert not stop.out_of_time(11.9)
    assert stop.round_due(11.0, work_left=False) == ShutdownRound(1.0, 12.0 + SHUTDOWN_GRACE_S)
    assert stop.phase is ShutdownPhase.ROUND and stop.timer_deadline() is None and not stop.awaits_round
    assert stop.round_due(11.5, work_left=False) is None  # one round only
    assert not stop.out_of_time(20.0)  # the round has its own deadline
    assert stop.finish() == "reply"
    assert stop.phase is ShutdownPhase.DONE and stop.stopping


def test_a_stop_out_of_time_waits_for_nothing_and_its_round_gets_only_the_grace():
    stop: Shutdown[str] = Shutdown(grace_s=0.5)
    stop.begin("reply", now=0.0, budget_s=1.0)
    assert stop.out_of_time(1.0)
    assert not stop.out_of_time(2.0)  # once
    assert stop.phase is ShutdownPhase.OUT_OF_TIME and stop.awaits_round and stop.timer_deadline() is None
    assert stop.round_due(1.25, work_left=True) == ShutdownRound(0.0, 1.5)


def test_misuse_is_a_value_error_and_changes_nothing():
    stop: Shutdown[str] = Shutdown()
    with pytest.raises(ValueError, match="no shutdown round"):
        stop.finish()
    stop.begin("reply", now=0.0, budget_s=1.0)
    with pytest.raises(ValueError, match="draining already"):
        stop.begin("again", now=0.5, budget_s=1.0)
    with pytest.raises(ValueError, match="no shutdown round"):
        stop.finish()
    assert stop.phase is ShutdownPhase.DRAINING and stop.deadline == 1.0


events = st.lists(st.tuples(st.sampled_from(["tick", "settle", "finish"]), st.floats(0, 0.5), st.booleans()),
                  max_size=30)


@given(st.floats(0, 3), events)
def test_the_phases_go_in_order_and_the_round_starts_once_when_nothing_is_waited_for(budget, steps):
    stop: Shutdown[int] = Shutdown()
    now = 0.0
    deadline = stop.begin(7, now, budget)
    order = list(ShutdownPhase)
    rounds = 0
    for op, dt, work_left in steps:
        now += dt
        before = stop.phase
        if op == "tick":
            assert stop.out_of_time(now) == (before is ShutdownPhase.DRAINING and now >= deadline)
        elif op == "settle":
            got = stop.round_due(now, work_left=work_left)
            waits = before is ShutdownPhase.DRAINING and work_left
            assert (got is not None) == (stop.phase is ShutdownPhase.ROUND and before is not ShutdownPhase.ROUND)
            if before in (ShutdownPhase.DRAINING, ShutdownPhase.OUT_OF_TIME) and not waits:
                assert got == ShutdownRound(max(deadline - now, 0.0), deadline + SHUTDOWN_GRACE_S)
                rounds += 1
            else:
                assert got is None
        elif before is ShutdownPhase.ROUND:
            assert stop.finish() == 7
        else:
            with pytest.raises(ValueError):
                stop.finish()
        assert order.index(stop.phase) >= order.index(before)  # never backwards
        assert stop.stopping
    assert rounds <= 1
