"""Combining the tiers' lookup answers: :func:`kvactors.core.lookups.resolve_lookup`."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.lookups import resolve_lookup
from kvactors.types import LookupResult

H, M, R = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def test_first_tier_in_order_with_a_hit_promotes_and_a_tier_not_answering_in_time_makes_retry():
    keys = (b"a", b"b", b"c", b"d", b"a")
    results = [M, H, M, M, M]
    missing = (0, 2, 3, 4)
    asked = (b"a", b"c", b"d")
    answers = {"t0": (M, R, M), "t1": (H, H, M)}  # t2 missing: it did not answer in time
    out, plan = resolve_lookup(keys, missing, results, asked, ("t0", "t1", "t2"), answers)
    assert plan == {"t1": [b"a", b"c", b"a"]}
    assert out == [M, H, M, R, M]  # promoted keys keep the primary's answer until allocated; d: t2 timed out
    out, plan = resolve_lookup(keys, missing, results, asked, ("t0", "t1"), answers, promote=False)
    assert plan == {} and out == [R, H, R, M, R]  # a hit not promoted is a RETRY
    assert results == [M, H, M, M, M]  # the input is not changed


@given(st.lists(st.sampled_from([H, M, R, None]), min_size=2, max_size=2), st.booleans())
def test_a_key_is_promoted_or_answered_never_both(answers, promote):
    tiers = ("t0", "t1")
    given_answers = {t: (None if a is None else (a,)) for t, a in zip(tiers, answers, strict=True)}
    out, plan = resolve_lookup((b"k",), (0,), [M], (b"k",), tiers, given_answers, promote=promote)
    promoted = [t for t, keys in plan.items() if b"k" in keys]
    if promoted:
        assert promote and out == [M] and promoted == [tiers[answers.index(H)]]
    else:
        # A failed tier (None) is a miss; only a tier's own RETRY makes the key RETRY.
        assert out[0] in (M, R) and (out[0] is M) == all(a in (M, None) for a in answers)
