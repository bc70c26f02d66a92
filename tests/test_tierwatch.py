"""TierWatch: which tiers owe an answer, and when one is stuck (plain class, no threads)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.tierwatch import TierWatch


def test_a_tier_that_owes_and_stays_silent_is_stuck_once_then_recovers_with_any_answer():
    watch = TierWatch(["a", "b"], stuck_after_s=1.0)
    watch.asked("a", "g1", now=10.0)
    assert watch.next_deadline() == 11.0
    assert watch.due(10.99) == []
    assert watch.due(11.0) == ["a"]
    assert watch.due(50.0) == []  # once per spell
    assert watch.is_stuck("a") and watch.stuck() == ["a"] and not watch.is_stuck("b")
    assert watch.next_deadline() is None  # nothing else can become stuck
    assert watch.silent_for("a", 12.5) == 2.5
    assert watch.answered("a", "g1", now=13.0) == 3.0  # the spell's length
    assert not watch.is_stuck("a") and watch.owed("a") == 0 and watch.silent_for("a", 14.0) == 0.0
    assert (watch.found_stuck, watch.recovered) == (1, 1)


def test_progress_restarts_the_clock_and_a_tier_that_owes_nothing_is_never_stuck():
    watch = TierWatch(["a"], stuck_after_s=1.0)
    assert watch.due(100.0) == []  # silent, but owes nothing
    watch.asked("a", "g1", now=0.0)
    watch.asked("a", "g2", now=0.5)
    assert watch.answered("a", "g1", now=0.75) is None  # busy, moving: not stuck
    assert watch.next_deadline() == 1.75
    assert watch.due(1.5) == []
    assert watch.due(1.75) == ["a"]
    watch.answered("a", "unknown", now=2.0)  # any answer is progress, owed or not
    assert not watch.is_stuck("a") and watch.owed("a") == 1  # g2 is still owed, its clock restarted
    assert watch.due(2.99) == [] and watch.due(3.0) == ["a"]


def test_a_probe_asked_while_stuck_does_not_restart_the_clock():
    watch = TierWatch(["a"], stuck_after_s=1.0)
    watch.asked("a", 1, now=0.0)
    assert watch.due(1.0) == ["a"]
    watch.asked("a", 2, now=5.0)
    assert watch.silent_for("a", 6.0) == 6.0


def test_bad_threshold_is_a_value_error():
    with pytest.raises(ValueError, match="stuck_after_s"):
        TierWatch(["a"], stuck_after_s=0)


ops = st.lists(st.tuples(st.sampled_from(["ask", "answer", "due"]), st.sampled_from(["a", "b"]),
                         st.integers(0, 5), st.floats(0, 3)), max_size=60)


@given(ops)
def test_stuck_means_owing_and_silent_for_the_threshold(steps):
    """Against a model: stuck exactly when something is owed and no answer came for stuck_after_s."""
    watch = TierWatch(["a", "b"], stuck_after_s=1.0)
    now = 0.0
    owed: dict[str, set[int]] = {"a": set(), "b": set()}
    stuck = {"a": False, "b": False}
    since = {"a": 0.0, "b": 0.0}
    for op, tier, probe, dt in steps:
        now += dt
        if op == "ask":
            if not owed[tier] and not stuck[tier]:
                since[tier] = now
            owed[tier].add(probe)
            watch.asked(tier, probe, now)
        elif op == "answer":
            spell = watch.answered(tier, probe, now)
            assert (spell is not None) == stuck[tier]
            owed[tier].discard(probe)
            stuck[tier] = False
            since[tier] = now
        else:
            found = watch.due(now)
            for name in ("a", "b"):
                newly = bool(owed[name]) and not stuck[name] and now >= since[name] + 1.0
                assert (name in found) == newly
                stuck[name] = stuck[name] or newly
        for name in ("a", "b"):
            assert watch.is_stuck(name) == stuck[name]
            assert watch.owed(name) == len(owed[name])
        deadline = watch.next_deadline()
        expected = [since[n] + 1.0 for n in ("a", "b") if owed[n] and not stuck[n]]
        assert deadline == (min(expected) if expected else None)


def test_a_tick_at_the_next_deadline_finds_the_tier_due_whatever_the_rounding():
    watch = TierWatch(["a"], stuck_after_s=0.1)
    watch.asked("a", 1, now=0.7)  # 0.7 + 0.1 - 0.7 < 0.1 in floats: a tick loop if the two disagree
    deadline = watch.next_deadline()
    assert deadline is not None and watch.due(deadline) == ["a"]
