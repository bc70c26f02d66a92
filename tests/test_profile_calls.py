"""``scripts/profile_calls.py`` runs and accounts for a call's time (a smoke test, not a timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import profile_calls

import kvactors


@pytest.mark.timeout(120)
def test_each_call_is_split_into_its_handlers_and_the_rest():
    result = profile_calls.profile(kvactors, 40)
    lookup, store = result["lookup"], result["prepare_store"]
    # The lookup's misses went to the supervisor and both tiers, all before the answer.
    assert {"handler Lookup", "handler SecondaryLookup", "handler TierLookup"} <= set(lookup)
    # A timer's Tick told meanwhile may run in the call's claim too (a slow machine, past a timeout).
    assert set(store) - {"handler Tick"} == {"total", "rest", "handler PrepareStore"}
    for figures in (lookup, store):
        handlers = sum(v for k, v in figures.items() if k.startswith("handler "))
        assert 0 < handlers < figures["total"]
