"""MemoryTier on its own: bounded, LRU, byte-exact, failures reported."""

from __future__ import annotations

import pytest
import torch

from kvactors import JobResult, LookupResult, MemoryTier, ReqContext, TransferJob

CTX = ReqContext("r")


def attached(capacity: int) -> tuple[MemoryTier, torch.Tensor, list[JobResult]]:
    tier = MemoryTier(capacity_blocks=capacity)
    pool = torch.arange(8 * 4, dtype=torch.uint8).reshape(8, 4)
    reports: list[JobResult] = []
    tier.attach(pool, reports.append)
    return tier, pool, reports


def job(job_id: int, keys: list[bytes], rows: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id, tuple(keys), tuple(rows), CTX, promotion)


def test_store_then_load_is_byte_exact():
    tier, pool, reports = attached(4)
    original = pool[[0, 1]].clone()
    tier.submit_store(job(1, [b"a", b"b"], [0, 1]))
    pool[[0, 1]] = 0
    assert tier.lookup([b"a", b"b", b"c"], CTX) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    tier.submit_load(job(2, [b"b", b"a"], [3, 2], promotion=True))
    assert torch.equal(pool[2], original[0]) and torch.equal(pool[3], original[1])
    assert reports == [JobResult(1, True), JobResult(2, True)]


def test_capacity_evicts_least_recently_used_and_reports_events():
    tier, _, reports = attached(2)
    tier.submit_store(job(1, [b"a"], [0]))
    tier.submit_store(job(2, [b"b"], [1]))
    tier.lookup([b"a"], CTX)  # a is now more recent than b
    tier.submit_store(job(3, [b"c"], [2]))
    assert b"a" in tier and b"c" in tier and b"b" not in tier
    events = tier.take_events()
    assert [(e.keys, e.removed, e.tier) for e in events] == [
        ((b"a",), False, "memory"), ((b"b",), False, "memory"), ((b"c",), False, "memory"), ((b"b",), True, "memory")]
    assert all(r.success for r in reports)


def test_a_job_larger_than_capacity_fails_instead_of_losing_blocks_silently():
    tier, _, reports = attached(1)
    tier.submit_store(job(1, [b"a", b"b"], [0, 1]))
    assert reports[0].success is False and "evicted" in reports[0].error


def test_loading_a_missing_block_fails_that_key_only():
    tier, pool, reports = attached(2)
    tier.submit_store(job(1, [b"a"], [0]))
    before = pool.clone()
    tier.submit_load(job(2, [b"a", b"gone"], [5, 6], promotion=True))
    assert reports[-1] == JobResult(2, False, "1 of 2 blocks failed: no longer in tier 'memory'",
                                    successful_keys=(b"a",))
    assert torch.equal(pool[5], before[0])  # the key present loaded
    assert torch.equal(pool[6], before[6])  # the missing key's row is not written


def test_a_job_larger_than_capacity_names_the_keys_it_kept():
    tier, _, reports = attached(1)
    tier.submit_store(job(1, [b"a", b"b"], [0, 1]))
    assert reports[0].successful_keys == (b"b",) and list(tier._blocks) == [b"b"]


def test_bad_capacity_is_a_value_error():
    with pytest.raises(ValueError):
        MemoryTier(capacity_blocks=0)
