"""The public introspection the testing toolkit reads instead of private fields:
``BlockPool.holdings()``, ``PrimaryTier.request_identities()`` and ``PrimaryTier.observe_job_ended``."""

from __future__ import annotations

import dataclasses

import pytest

from kvactors import MemoryTier, ReqContext, TieringManager
from kvactors.actors import messages as m
from kvactors.actors.primary import PrimaryTier
from kvactors.core.policies import make_policy
from kvactors.core.pool import BlockPool
from kvactors.testing import SimRuntime
from kvactors.types import OffloadKey

pytestmark = pytest.mark.timeout(60)

A, B = ("a", 0), ("b", 0)


def test_holdings_say_what_the_pool_holds_and_are_copies() -> None:
    pool = BlockPool(8, make_policy("lru", 8))
    stored = pool.prepare_store([b"k1", b"k2"], A)
    assert stored is not None
    pool.complete_store([b"k1", b"k2"], A, success=True)
    pending = pool.prepare_store([b"k3"], B)
    assert pending is not None
    pool.pin_for_load([b"k1"], A)
    pool.pin_for_job(7, [b"k2"])
    promoted = pool.allocate_promotion(9, [b"k4"])
    assert promoted is not None
    held = pool.holdings()
    assert held.ready == dict(zip([b"k1", b"k2"], stored.rows, strict=True))
    assert held.pending_writes == {(B, b"k3")}
    assert held.load_pins == {(A, b"k1"): {stored.rows[0]: 1}}
    assert held.job_pins == {7: (stored.rows[1],)}
    assert held.promotions == {9: ((b"k4", promoted[0]),)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        held.ready = {}  # type: ignore[misc]
    pool.end_promotion(9, success=True)
    pool.end_job(7, hold=False)
    pool.unpin_load([b"k1"], A)
    assert held.promotions == {9: ((b"k4", promoted[0]),)}, "a snapshot does not follow the pool"
    after = pool.holdings()
    assert after.ready[b"k4"] == promoted[0] and not after.promotions and not after.job_pins and not after.load_pins


def test_the_primary_names_its_live_requests_and_reports_each_job_end() -> None:
    runtime = SimRuntime(1)
    manager = TieringManager.start(num_blocks=8, block_bytes=16, secondary_tiers=[MemoryTier(capacity_blocks=8)],
                                   runtime=runtime)
    primary = runtime.ref("primary").actor
    assert isinstance(primary, PrimaryTier)
    ended: list[tuple[int, bool, tuple[tuple[OffloadKey, int], ...]]] = []

    def observer(msg: m.JobEnded, promoted: tuple[tuple[OffloadKey, int], ...]) -> None:
        ended.append((msg.job_id, msg.is_promotion, promoted))
        ready = primary.pool.holdings().ready
        assert all(ready.get(key) == row for key, row in promoted), "called once applied"

    primary.observe_job_ended(observer)
    writer, reader = ReqContext("w"), ReqContext("r")
    manager.on_new_request(writer)
    assert primary.request_identities() == (writer.identity,)
    keys = [b"x" * 8, b"y" * 8]
    out = manager.prepare_store(keys, writer)
    assert out is not None
    manager.complete_store(keys, writer)
    manager.on_request_finished(writer)
    assert manager.wait_idle(5.0)
    assert [(promotion, made) for _, promotion, made in ended] == [(False, ())], "one cascade job"
    assert primary.request_identities() == ()
    manager.reset_cache()  # the keys now only in the memory tier: a lookup promotes them
    manager.on_new_request(reader)
    manager.lookup(keys, reader)
    assert manager.wait_idle(5.0)
    assert ended[-1][1] is True and [key for key, _ in ended[-1][2]] == keys
    assert primary.pool.promotion_rows(ended[-1][0]) == (), "ended: no longer in flight"
    manager.on_request_finished(reader)
    primary.observe_job_ended(None)
    manager.stop()
    runtime.close()
