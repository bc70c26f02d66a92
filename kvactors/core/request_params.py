"""A request's own controls, read from its ``params`` (vLLM's ``kv_transfer_params``).

They are parsed as vLLM 0.33 parses them, so that a router's setting means the same
with kvactors as with vLLM's own tiering.
vLLM's parsing is in ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``,
in ``_parse_tier_filter`` and ``RequestOffloadState.__post_init__``.

* ``kv_load_tiers`` is a list of ``{"medium": "CPU" | "STORAGE", "locality": "LOCAL" | "REMOTE"}``.

  - Either key may be left out, and it then matches any tier.
  - Matching is case-insensitive.
  - The request loads only from tiers that some entry matches.
    The primary pool always takes part.
  - A value that is not a list is ignored, which means every tier.
  - An entry that is not a mapping, or names an unknown medium or locality, is skipped.
  - If every entry was skipped, the value is ignored, which means every tier.
  - ``[]`` means no secondary tier.

* ``max_load_tokens`` and ``max_offload_tokens`` take an ``int >= 0``, not a ``bool``.
  Anything else is ignored.

A value ignored, or an entry skipped, is reported with its reason (:attr:`RequestControls.ignored`).
The caller logs ``request_param_ignored``.
Nothing here raises for a request's values, because a bad value is never an engine failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MEDIA = ("CPU", "STORAGE")
LOCALITIES = ("LOCAL", "REMOTE")

KV_LOAD_TIERS = "kv_load_tiers"


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """One ``kv_load_tiers`` entry.

    ``None`` matches any medium, or any locality.
    """

    medium: str | None = None
    locality: str | None = None

    def matches(self, medium: str, locality: str) -> bool:
        return (self.medium is None or self.medium == medium) and (self.locality is None or self.locality == locality)


@dataclass(frozen=True, slots=True)
class RequestControls:
    """What a request's params ask for.

    ``load_tiers`` is ``None`` for every tier, else the matchers.
    Empty matchers mean no secondary tier.
    ``ignored`` holds ``(param, reason)`` for each value ignored or skipped.
    """

    load_tiers: tuple[TierMatcher, ...] | None = None
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    ignored: tuple[tuple[str, str], ...] = ()

    def allows(self, medium: str, locality: str) -> bool:
        """Whether the request may load from a tier of this medium and locality."""
        return self.load_tiers is None or any(m.matches(medium, locality) for m in self.load_tiers)


NO_CONTROLS = RequestControls()


def _upper(value: Any, allowed: Sequence[str]) -> str | None:
    if not isinstance(value, str) or value.upper() not in allowed:
        raise ValueError(value)
    return value.upper()


def parse_load_tiers(raw: Any) -> tuple[tuple[TierMatcher, ...] | None, list[tuple[str, str]]]:
    """``kv_load_tiers`` as vLLM parses it.

    Returns the matchers (``None`` for every tier) and what was ignored.
    """
    ignored: list[tuple[str, str]] = []
    if raw is None:
        return None, ignored
    if not isinstance(raw, list):
        ignored.append((KV_LOAD_TIERS, f"expected a list, got {type(raw).__name__}"))
        return None, ignored
    matchers = []
    for n, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            ignored.append((f"{KV_LOAD_TIERS}[{n}]", "entry is not a mapping; skipped"))
            continue
        fields: dict[str, str | None] = {}
        for name, allowed in (("medium", MEDIA), ("locality", LOCALITIES)):
            value = entry.get(name)
            try:
                fields[name] = None if value is None else _upper(value, allowed)
            except ValueError:
                ignored.append((f"{KV_LOAD_TIERS}[{n}].{name}", f"unknown {name} {value!r}; entry skipped"))
                break
        else:
            matchers.append(TierMatcher(fields["medium"], fields["locality"]))
    if not matchers and raw:
        ignored.append((KV_LOAD_TIERS, "every entry was skipped; loading from every tier"))
        return None, ignored
    return tuple(matchers), ignored


def _tokens(params: Mapping[str, Any], name: str, ignored: list[tuple[str, str]]) -> int | None:
    raw = params.get(name)
    if type(raw) is int and raw >= 0:  # exactly vLLM's test: a bool is not an int here
        return raw
    if raw is not None:
        ignored.append((name, f"must be a non-negative int, got {raw!r}"))
    return None


def parse_request_params(params: Mapping[str, Any] | None) -> RequestControls:
    """A request's controls from its params.

    ``None``, or a mapping that does not name them, gives no controls.
    Never raises for the values inside.
    """
    if not params or not isinstance(params, Mapping):
        return NO_CONTROLS
    load_tiers, ignored = parse_load_tiers(params.get(KV_LOAD_TIERS))
    max_load = _tokens(params, "max_load_tokens", ignored)
    max_offload = _tokens(params, "max_offload_tokens", ignored)
    if load_tiers is None and max_load is None and max_offload is None and not ignored:
        return NO_CONTROLS
    return RequestControls(load_tiers, max_load, max_offload, tuple(ignored))
