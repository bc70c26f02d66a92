"""A request's remaining prefix looked up in one kvactors call, its leading ``HIT`` keys pinned.

vLLM asks one key at a time.
The adapter asks kvactors once for the key and the request's later keys (:func:`remaining_keys`).
It asks on a helper thread (:func:`answer`).
It answers the following keys from that answer (:func:`post`).
Plain code, with no vLLM import.

Threading: :func:`answer` runs on the lookup thread without the adapter's lock.
:func:`post` runs with that lock held.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvactors.core.errors import LifecycleError, ManagerStoppedError
from kvactors.integrations.vllm.requests import LookupJob, Requests
from kvactors.manager import TieringManager
from kvactors.types import LookupResult, OffloadKey


def remaining_keys(key: OffloadKey, positions: Mapping[OffloadKey, int] | None,
                   max_tokens: int | None = None) -> tuple[OffloadKey, ...]:
    """``key`` and the request's later keys of the same group, in prefix order.

    ``positions`` holds the request's offload keys and their positions.
    That is vLLM's ``ReqContext._offload_key_positions``, where a key's position is its end token.
    A key the request does not list is asked alone.

    ``max_tokens`` is the request's ``max_load_tokens``.
    Only the keys the request may load from the first one asked on are returned.
    vLLM asks ``key`` as the first chunk past the tokens the engine holds.
    It loads at most ``max_tokens`` tokens from there.
    So kvactors promotes no more than the request may load.
    """
    positions = positions or {}
    start = positions.get(key)
    if start is None:
        return (key,)
    group = key[-4:]
    later = sorted((pos, k) for k, pos in positions.items() if pos > start and k[-4:] == group)
    if max_tokens is not None and later:
        chunk = later[0][0] - start  # one chunk's tokens: the gap between consecutive keys
        limit = start - chunk + max_tokens
        later = [(pos, k) for pos, k in later if pos <= limit]
    return (key, *(k for _, k in later))


def leading_hits(keys: Sequence[OffloadKey], results: Sequence[LookupResult]) -> list[OffloadKey]:
    """The keys vLLM may load.

    Those are the leading keys, when all of them up to the first MISS are HITs.
    """
    lead: list[OffloadKey] = []
    for k, r in zip(keys, results, strict=True):
        if r is LookupResult.MISS:
            break
        if r is not LookupResult.HIT:
            return []
        lead.append(k)
    return list(dict.fromkeys(lead))


def answer(tm: TieringManager, job: LookupJob, log: Any) -> None:
    """Make one kvactors lookup, then pin the leading HITs, and fill ``job``. Runs on the lookup thread.

    A HIT never leaves here unpinned.
    A HIT that could not be pinned becomes RETRY.
    Never raises.
    A failed lookup answers RETRY for every key.
    """
    try:
        try:
            results = tm.lookup(job.keys, job.ctx)
        except (LifecycleError, ManagerStoppedError):
            results = [LookupResult.MISS] * len(job.keys)
        answers = dict(zip(job.keys, results, strict=True))
        lead = leading_hits(job.keys, results)
        if lead:
            try:
                spec = tm.prepare_load(lead, job.ctx)
                job.pinned = dict(zip(lead, spec.block_ids, strict=True))
            except (LifecycleError, ManagerStoppedError):
                for k in lead:  # evicted or finished in between: ask again later
                    answers[k] = LookupResult.RETRY
        for k, r in answers.items():
            if r is LookupResult.HIT and k not in job.pinned:
                answers[k] = LookupResult.RETRY
        job.answers = answers
    except Exception:
        log.exception("lookup_failed", req_id=job.ctx.req_id, attempt=job.ctx.attempt)
        job.answers = dict.fromkeys(job.keys, LookupResult.RETRY)


def post(requests: Requests, job: LookupJob) -> list[OffloadKey]:
    """Hand ``job``'s answers and pins to its request, with the lock held. Returns the keys whose pins to release.

    A job whose request finished, or that a newer job replaced, gives all its pins back.
    """
    req = requests.get(job.ctx.req_id)
    taken = None if req is None else req.accept(job, time.monotonic())
    if req is None or taken is None:
        return list(job.pinned)
    release, pending = taken
    requests.counters["pending_answers"] += pending
    requests.with_answers.add(req.req_id)
    return release
