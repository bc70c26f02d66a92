"""Combining the secondary tiers' answers to one lookup: which keys to promote, what to answer.

A plain function, with no threads.
The supervisor calls it once every tier answered.
It also calls it when the lookup's deadline passed, or when a reset or a stop cut the lookup short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvactors.types import LookupResult, OffloadKey


def resolve_lookup(
    keys: Sequence[OffloadKey],
    missing: Sequence[int],
    results: Sequence[LookupResult],
    asked: Sequence[OffloadKey],
    tier_order: Sequence[str],
    answers: Mapping[str, Sequence[LookupResult] | None],
    *,
    promote: bool = True,
) -> tuple[list[LookupResult], dict[str, list[OffloadKey]]]:
    """The answer to a lookup, and the promotions it starts.

    ``results``
        The primary's answer, with ``MISS`` at the ``missing`` positions.
    ``asked``
        The missing keys, de-duplicated, as the tiers were asked.
    ``answers``
        Per tier, one result per asked key, or ``None`` if the tier failed or is stuck.
        A tier absent from ``answers`` did not answer in time.

    Per key, the first tier in ``tier_order`` that answers ``HIT`` promotes it, when ``promote``.
    The key stays at the primary's answer until the promotion is allocated.
    Without a hit, the key is ``RETRY`` if some tier did not answer in time or said ``RETRY``.
    Otherwise it is ``MISS``.
    A failed tier's answer is a miss, because asking again would wait on it for every request, for nothing.
    A hit that is not promoted is a ``RETRY``.
    Returns the results (a new list) and the plan, tier -> keys, in key order.
    """
    out = list(results)
    if len(answers) == len(tier_order) and all(
        answer is None or (LookupResult.HIT not in answer and LookupResult.RETRY not in answer)
        for answer in answers.values()
    ):
        return out, {}  # every tier answered MISS for every key: the primary's answer stands
    position = {key: n for n, key in enumerate(asked)}
    plan: dict[str, list[OffloadKey]] = {}
    for i in missing:
        key = keys[i]
        verdict, source = LookupResult.MISS, None
        for tier in tier_order:
            if tier not in answers:
                result = LookupResult.RETRY  # not answered in time
            else:
                answer = answers[tier]
                result = LookupResult.MISS if answer is None else answer[position[key]]
            if result is LookupResult.HIT:
                verdict, source = result, tier
                break
            if result is LookupResult.RETRY:
                verdict = result
        if source is not None and promote:
            plan.setdefault(source, []).append(key)
        else:
            out[i] = LookupResult.RETRY if verdict is LookupResult.HIT else verdict
    return out, plan
