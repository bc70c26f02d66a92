"""Admission and back-pressure, the plain classes: kvactors.core.admission, kvactors.core.backpressure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors.core.admission import (
    SEEN_TABLE_MAX,
    SEEN_TABLE_MIN,
    WRITE_BACK,
    WRITE_THROUGH,
    Admission,
    SeenTable,
    parse_admission,
    seen_table_size,
)
from kvactors.core.backpressure import MIN_DEFAULT_QUEUED_BYTES, Backpressure, default_max_queued_bytes

# --------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("value", "expected"), [
    ("write_through", WRITE_THROUGH),
    ("write_back", WRITE_BACK),
    ({"min_seen": 2}, Admission("min_seen", 2)),
    ({"min_seen": 1}, WRITE_THROUGH),  # seen once: every stored block
    (Admission("min_seen", 5), Admission("min_seen", 5)),
])
def test_admission_values_parse(value: Any, expected: Admission) -> None:
    assert parse_admission(value) == expected
    assert parse_admission(parse_admission(value).config()) == expected  # config() round-trips


@pytest.mark.parametrize(("value", "error", "names"), [
    ("write-back", ValueError, "unknown admission"),
    ("", ValueError, "unknown admission"),
    ({"min_seen": 0}, ValueError, "tiers[0].admission.min_seen"),
    ({"min_seen": -3}, ValueError, "tiers[0].admission.min_seen"),
    ({"min_seen": True}, TypeError, "tiers[0].admission.min_seen"),
    ({"min_seen": 2.0}, TypeError, "tiers[0].admission.min_seen"),
    ({"min_seen": 2, "x": 1}, ValueError, "exactly one key"),
    ({}, ValueError, "exactly one key"),
    (None, TypeError, "tiers[0].admission"),
    (2, TypeError, "tiers[0].admission"),
    (["write_back"], TypeError, "tiers[0].admission"),
])
def test_bad_admission_values_name_where(value: Any, error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=names.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_admission(value, "tiers[0].admission")


def test_admission_values_are_checked() -> None:
    with pytest.raises(ValueError):
        Admission("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Admission("min_seen", 0)
    assert WRITE_BACK.on_store is False and WRITE_THROUGH.on_store and Admission("min_seen", 2).on_store


@given(st.integers(min_value=1, max_value=10**7))
def test_seen_table_size_is_four_per_block_clamped(num_blocks: int) -> None:
    size = seen_table_size(num_blocks)
    assert SEEN_TABLE_MIN <= size <= SEEN_TABLE_MAX
    assert size == 4 * num_blocks or size in (SEEN_TABLE_MIN, SEEN_TABLE_MAX)


# --------------------------------------------------------------------- the seen table

_keys = st.binary(min_size=1, max_size=2)
_lookups = st.lists(st.tuples(st.lists(_keys, max_size=6), st.sampled_from(["a", "b", "c", "d", "e"])), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_lookups, st.integers(1, 8), st.integers(1, 4))
def test_seen_table_counts_distinct_requests_of_the_latest_keys(lookups: list[tuple[list[bytes], str]],
                                                                 size: int, cap: int) -> None:
    table = SeenTable(size, cap)
    model: dict[bytes, set[str]] = {}  # insertion order = recency
    for keys, req_id in lookups:
        counts = table.see(keys, req_id)
        assert [key for key, _ in counts] == list(dict.fromkeys(keys))
        for key in dict.fromkeys(keys):
            seen = model.pop(key, set())
            if len(seen) < cap:
                seen.add(req_id)
            model[key] = seen
            while len(model) > size:
                del model[next(iter(model))]
        for key, count in counts:
            assert key not in model or count == len(model[key])  # or evicted by a later key of the lookup
        assert len(table) <= size
    for key in {k for keys, _ in lookups for k in keys}:
        assert table.count(key) == len(model.get(key, ()))
        assert table.count(key) <= cap


def test_seen_table_marks_what_was_sent_while_the_entry_lives() -> None:
    table = SeenTable(2, 3)
    table.see([b"a"], "r1")
    table.see([b"a"], "r1")  # the same request (another attempt) counts once
    assert table.count(b"a") == 1
    table.mark(b"a", "disk")
    assert table.sent(b"a", "disk") and not table.sent(b"a", "redis")
    table.mark(b"zz", "disk")  # not in the table: nothing remembered
    assert not table.sent(b"zz", "disk") and len(table) == 1
    table.see([b"b", b"c"], "r2")  # a falls out
    assert table.count(b"a") == 0 and not table.sent(b"a", "disk")
    table.clear()
    assert len(table) == 0
    with pytest.raises(ValueError):
        SeenTable(0, 1)


# --------------------------------------------------------------------- back-pressure


def test_default_bound_is_half_the_pool_at_least_256_mib() -> None:
    assert default_max_queued_bytes(1 << 20) == MIN_DEFAULT_QUEUED_BYTES == 256 << 20
    assert default_max_queued_bytes(8 << 30) == 4 << 30


_ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(["disk", "redis"]), st.integers(1, 40)),
    st.tuples(st.just("end"), st.integers(0, 30), st.just(0)),
), max_size=80)


@settings(max_examples=200, deadline=None)
@given(_ops, st.integers(0, 100), st.integers(0, 100))
def test_backpressure_bounds_queued_bytes_and_reports_each_episode_once(
        ops: list[tuple[str, Any, int]], disk_limit: int, redis_limit: int) -> None:
    limits = {"disk": disk_limit, "redis": redis_limit}
    bp = Backpressure(limits)
    queued = {"disk": 0, "redis": 0}
    live: dict[int, tuple[str, int]] = {}
    dropped = {"disk": 0, "redis": 0}
    dropping = {"disk": False, "redis": False}
    job_id = 0
    for op, arg, nbytes in ops:
        if op == "admit":
            tier = arg
            job_id += 1
            verdict = bp.admit(tier, job_id, nbytes, 1)
            fits = queued[tier] + nbytes <= limits[tier]
            assert verdict.accepted == fits
            if fits:
                queued[tier] += nbytes
                live[job_id] = (tier, nbytes)
                assert verdict.resumed == dropping[tier] and not verdict.started
                dropping[tier] = False
            else:
                dropped[tier] += 1
                assert verdict.started == (not dropping[tier]) and not verdict.resumed
                dropping[tier] = True
        else:
            ended = live.pop(arg, None)
            assert bp.ended(arg) == (ended is not None)
            if ended is not None:
                queued[ended[0]] -= ended[1]
        for tier in limits:
            assert bp.queued(tier) == queued[tier] <= limits[tier]
            assert bp.dropped(tier) == dropped[tier] and bp.dropping(tier) == dropping[tier]
    figures = bp.figures(limits)
    assert sum(tier.dropped for tier in figures.values()) == sum(dropped.values())
    assert figures["disk"].bytes_queued == queued["disk"]
    assert bp.jobs() == len(live)


def test_zero_drops_every_cascade_and_a_bad_bound_is_refused() -> None:
    bp = Backpressure({"disk": 0})
    assert not bp.admit("disk", 1, 1, 1).accepted
    assert not bp.would_accept("disk", 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="disk"):
            Backpressure({"disk": bad})  # type: ignore[dict-item]


# --------------------------------------------------------------------- the pool's eviction candidates

_pool_ops = st.lists(st.tuples(st.sampled_from(["store", "touch", "pin"]),
                               st.lists(st.integers(0, 24), min_size=1, max_size=5)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_pool_ops, st.lists(st.integers(0, 30), min_size=1, max_size=6))
def test_eviction_candidates_are_what_the_next_store_evicts(ops: list[tuple[str, list[int]]],
                                                            last: list[int]) -> None:
    from kvactors.core.policies import make_policy
    from kvactors.core.pool import BlockPool

    pool = BlockPool(8, make_policy("lru", 8))
    assert pool.peeks_victims
    writer = ("w", 0)
    job = 0
    for op, numbers in ops:
        keys = [bytes([n + 1]) for n in numbers]
        if op == "store":
            plan = pool.prepare_store(keys, writer)
            if plan is not None and plan.keys:
                pool.complete_store(plan.keys, writer, True)
        elif op == "touch":
            pool.touch(keys)
        else:
            ready = [k for k in dict.fromkeys(keys) if pool.is_ready(k)]
            if ready:
                job += 1
                pool.pin_for_job(job, ready)  # pinned for good: never evictable
    keys = [bytes([n + 1]) for n in last]
    candidates = pool.eviction_candidates(keys)
    plan = pool.prepare_store(keys, writer)
    if plan is not None:
        assert list(plan.evicted) == candidates
    assert make_policy("arc", 8) is not None and BlockPool(8, make_policy("arc", 8)).eviction_candidates(keys) == []
