"""A request's controls from its kv_transfer_params (kvactors.core.request_params), parsed as vLLM 0.33 does.

tests/vllm/test_controls_033.py checks the same parse against vLLM's own ``_parse_tier_filter``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors.core.request_params import (
    NO_CONTROLS,
    RequestControls,
    TierMatcher,
    parse_load_tiers,
    parse_request_params,
)

KINDS = [("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE"), ("CPU", "REMOTE")]


def allowed(params: Any) -> list[tuple[str, str]]:
    controls = parse_request_params(params)
    return [kind for kind in KINDS if controls.allows(*kind)]


def test_no_params_no_controls() -> None:
    assert parse_request_params(None) is NO_CONTROLS
    assert parse_request_params({}) is NO_CONTROLS
    assert parse_request_params({"do_remote_decode": True}) is NO_CONTROLS
    assert allowed(None) == KINDS


def test_load_tiers_match_medium_and_locality() -> None:
    assert allowed({"kv_load_tiers": [{"medium": "CPU"}]}) == [("CPU", "LOCAL"), ("CPU", "REMOTE")]
    assert allowed({"kv_load_tiers": [{"locality": "remote"}]}) == [("STORAGE", "REMOTE"), ("CPU", "REMOTE")]
    assert allowed({"kv_load_tiers": [{"medium": "storage", "locality": "LOCAL"}, {"medium": "CPU"}]}) == [
        ("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("CPU", "REMOTE")]
    assert allowed({"kv_load_tiers": [{}]}) == KINDS  # an empty matcher matches every tier
    assert allowed({"kv_load_tiers": []}) == []  # no secondary tier (the pool always takes part)


@pytest.mark.parametrize(("raw", "reason"), [
    ("CPU", "expected a list"),
    ({"medium": "CPU"}, "expected a list"),
    ([{"medium": "GPU"}], "unknown medium"),
    ([{"locality": "MOON"}], "unknown locality"),
    (["CPU"], "not a mapping"),
    ([{"medium": 3}], "unknown medium"),
])
def test_a_bad_load_tiers_value_is_ignored_with_its_reason(raw: Any, reason: str) -> None:
    controls = parse_request_params({"kv_load_tiers": raw})
    assert controls.load_tiers is None  # every tier, as vLLM
    assert any(reason in why for _, why in controls.ignored), controls.ignored
    assert all(param.startswith("kv_load_tiers") for param, _ in controls.ignored)


def test_a_bad_entry_is_skipped_and_the_good_ones_stay() -> None:
    matchers, ignored = parse_load_tiers([{"medium": "GPU"}, {"medium": "CPU"}])
    assert matchers == (TierMatcher("CPU", None),)
    assert ignored == [("kv_load_tiers[0].medium", "unknown medium 'GPU'; entry skipped")]


@pytest.mark.parametrize("value", [-1, 1.5, "10", True, False, [3], None])
def test_token_limits_must_be_non_negative_ints(value: Any) -> None:
    controls = parse_request_params({"max_load_tokens": value, "max_offload_tokens": value})
    assert controls.max_load_tokens is None and controls.max_offload_tokens is None
    if value is not None:
        assert [param for param, _ in controls.ignored] == ["max_load_tokens", "max_offload_tokens"]


def test_token_limits() -> None:
    controls = parse_request_params({"max_load_tokens": 0, "max_offload_tokens": 256})
    assert controls == RequestControls(None, 0, 256, ())


# A model of vLLM 0.33's _parse_tier_filter and TierFilter.allows (its source, restated):
def vllm_allows(raw: Any, medium: str, locality: str) -> bool:
    if not isinstance(raw, list):
        return True
    matchers = []
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        m, loc = entry.get("medium"), entry.get("locality")
        try:
            m = None if m is None else {"CPU": "CPU", "STORAGE": "STORAGE"}[m.upper()]
            loc = None if loc is None else {"LOCAL": "LOCAL", "REMOTE": "REMOTE"}[loc.upper()]
        except (KeyError, AttributeError):
            continue
        matchers.append((m, loc))
    if not matchers:
        return bool(raw)  # [] is TierFilter(()): nothing; all entries skipped: TierFilter.ALL
    return any((m is None or m == medium) and (loc is None or loc == locality) for m, loc in matchers)


_word = st.sampled_from(["CPU", "cpu", "Storage", "STORAGE", "LOCAL", "remote", "REMOTE", "GPU", "", 3, None])
_entry = st.one_of(st.fixed_dictionaries({}, optional={"medium": _word, "locality": _word}), st.integers(),
                   st.text(max_size=3))
_raw = st.one_of(st.lists(_entry, max_size=4), st.none(), st.integers(), st.text(max_size=4),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(_raw)
def test_load_tiers_mean_what_they_mean_to_vllm(raw: Any) -> None:
    controls = parse_request_params({"kv_load_tiers": raw})
    for medium, locality in KINDS:
        if raw is None:
            assert controls.allows(medium, locality)
        else:
            assert controls.allows(medium, locality) == vllm_allows(raw, medium, locality), (raw, medium, locality)
