"""Eviction policies: LRU order, ARC adaptivity, and the interface's invariants (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.policies import ARCPolicy, LRUPolicy, make_policy


def test_lru_evicts_least_recently_used():
    policy = LRUPolicy()
    for key in (b"a", b"b", b"c"):
        policy.add(key)
    policy.access(b"a")
    assert policy.victim() == b"b"
    assert policy.victim() == b"c"
    assert policy.victim() == b"a"
    assert policy.victim() is None


def test_discarded_keys_are_never_victims():
    for policy in (LRUPolicy(), ARCPolicy(8)):
        policy.add(b"a")
        policy.add(b"b")
        policy.discard(b"a")
        assert b"a" not in policy
        assert policy.victim() == b"b"
        assert policy.victim() is None


def test_arc_keeps_frequent_keys_over_a_scan():
    policy = ARCPolicy(4)
    for key in (b"hot1", b"hot2"):
        policy.add(key)
        policy.access(key)  # used twice: T2
    for n in range(3):
        policy.add(f"scan{n}".encode())  # used once: T1
    # A scan of once-used keys is evicted before the frequent ones.
    assert policy.victim().startswith(b"scan")
    assert policy.victim().startswith(b"scan")


def test_arc_ghost_hit_adapts_target():
    policy = ARCPolicy(4)
    policy.add(b"x")
    policy.add(b"y")
    assert policy.victim() == b"x"  # x goes to ghost list B1
    before = policy.target_recent
    policy.add(b"x")  # comes back: a B1 hit grows the recency target
    assert policy.target_recent > before
    assert b"x" in policy


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo", 4)
    with pytest.raises(ValueError):
        ARCPolicy(0)


operations = st.lists(
    st.tuples(st.sampled_from(["add", "access", "discard", "victim"]), st.integers(0, 12)), max_size=200
)


@pytest.mark.parametrize("name", ["lru", "arc"])
@given(ops=operations)
def test_policy_tracks_exactly_the_evictable_keys(name, ops):
    policy = make_policy(name, 6)
    model: set[bytes] = set()
    for op, n in ops:
        key = bytes([n])
        if op == "add" and key not in model:
            policy.add(key)
            model.add(key)
        elif op == "access":
            policy.access(key)
        elif op == "discard":
            policy.discard(key)
            model.discard(key)
        elif op == "victim":
            victim = policy.victim()
            if model:
                assert victim in model
                model.discard(victim)
            else:
                assert victim is None
        assert len(policy) == len(model)
        assert all(key in policy for key in model)
