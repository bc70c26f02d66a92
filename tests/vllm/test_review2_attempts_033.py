"""review2: a late completion of attempt N must not complete attempt N+1's store (vLLM #51637 class).

vLLM's completions carry no attempt; the adapter matches them by key (requests.py OwedCompletions).
``storing`` overwrites an entry still owed by the previous attempt, so the previous attempt's late
completion pops (and completes) the new attempt's store.
"""

from __future__ import annotations

import time

import pytest


def _manager(transfer_timeout_s):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvactors import TieringManager
    from kvactors.integrations.vllm.manager import KvactorsOffloadingManager

    tm = TieringManager.start(num_blocks=8, block_bytes=64, transfer_timeout_s=transfer_timeout_s)
    return KvactorsOffloadingManager(tm, None, events_enabled=False, tier_kinds={}, hit_source=CacheHitSource.HOST,
                                     owns_shared=False)


K = b"key00001\0\0\0\0"


@pytest.mark.xfail(strict=True, reason="review2: OwedCompletions.stores is keyed by key only; storing() overwrites "
                   "an entry the previous attempt still owes (requests.py Request.storing)")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("late_success", [False, True])
def test_a_late_completion_of_the_old_attempt_leaves_the_new_attempts_store_pending(late_success):
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    mgr = _manager(transfer_timeout_s=0.2)
    try:
        rc = VReqContext("r1")
        mgr.on_new_request(rc)
        assert list(mgr.prepare_store([K], rc).keys_to_store) == [K]  # attempt 0 stores K
        deadline = time.monotonic() + 10  # attempt 0's store passes its kvactors deadline
        while mgr.tm.stats()["blocks_pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mgr.tm.stats()["blocks_pending"] == 0
        mgr.on_new_request(rc)  # re-announced (as after a preemption): attempt 1
        assert list(mgr.prepare_store([K], rc).keys_to_store) == [K]  # attempt 1 stores K again
        assert mgr.tm.wait_idle(10) and mgr.tm.stats()["blocks_pending"] == 1
        # vLLM reports attempt 0's job (its worker was stalled): it cannot say which attempt.
        mgr.complete_store([K], rc, success=late_success)
        assert mgr.tm.wait_idle(10)
        stats = mgr.stats()
        # Attempt 1's copy has not been reported: its block must still be pending, not ready/removed.
        assert (stats["blocks_pending"], stats["blocks_ready"]) == (1, 0), stats
    finally:
        mgr.shutdown()
