"""Attempts of one ``req_id`` that owe a store of the same key: each is completed by its own report (vLLM #51637 class).

An attempt's store that passed kvactors' ``transfer_timeout_s`` still owes vLLM's report, and its row stays held.
After a preemption the next attempt may store the key again, on a new row.
vLLM's completions carry only keys, so the adapter tells the two stores apart by their rows' copy status
in shared memory (the worker writes it before it reports), else by age.
"""

from __future__ import annotations

import pytest

K = b"key00001\0\0\0\0"
ROWS = 8
TIMEOUT_S = 30.0


def _manager(tmp_path, with_status):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvactors import TieringManager
    from kvactors.integrations.vllm.manager import KvactorsOffloadingManager
    from kvactors.integrations.vllm.shm import SharedPool
    from kvactors.testing import SimRuntime

    runtime = SimRuntime(1, time_jump_chance=0.0)
    tm = TieringManager.start(num_blocks=ROWS, block_bytes=64, transfer_timeout_s=TIMEOUT_S, runtime=runtime)
    shared = SharedPool(str(tmp_path / "pool"), num_blocks=ROWS, block_bytes=64) if with_status else None
    mgr = KvactorsOffloadingManager(tm, shared, events_enabled=False, tier_kinds={}, hit_source=CacheHitSource.HOST)
    return mgr, runtime


def _blocks(mgr):
    stats = mgr.stats()
    return {k: stats[f"blocks_{k}"] for k in ("pending", "ready", "detached", "free")}


def _store(mgr, rc):
    out = mgr.prepare_store([K], rc)
    assert out is not None and list(out.keys_to_store) == [K]
    return out.store_spec.block_ids[0]


CASES = [
    # (the worker's status byte in shared memory, which report comes first, the old copy's outcome)
    pytest.param(False, "old", True, id="no-status-old-first-ok"),
    pytest.param(False, "old", False, id="no-status-old-first-failed"),
    pytest.param(True, "old", True, id="status-old-first-ok"),
    pytest.param(True, "old", False, id="status-old-first-failed"),
    pytest.param(True, "new", True, id="status-new-first-old-ok"),
    pytest.param(True, "new", False, id="status-new-first-old-failed"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("with_status", "first", "old_ok"), CASES)
@pytest.mark.parametrize("new_ok", [True, False])
def test_each_attempts_store_of_one_key_is_completed_by_its_own_report(tmp_path, with_status, first, old_ok, new_ok):
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    from kvactors.integrations.vllm.shm import STORE_FAILED, STORE_OK

    mgr, runtime = _manager(tmp_path, with_status)
    try:
        rc = VReqContext("r1")
        mgr.on_new_request(rc)
        old_row = _store(mgr, rc)  # attempt 0 stores K
        runtime.advance(TIMEOUT_S + 1)  # its copy stalls past kvactors' deadline: its row is detached
        assert _blocks(mgr)["pending"] == 0 and _blocks(mgr)["detached"] == 1
        mgr.on_new_request(rc)  # re-announced (as after a preemption): attempt 1
        new_row = _store(mgr, rc)  # attempt 1 stores K again, on a new row
        assert new_row != old_row and _blocks(mgr)["pending"] == 1

        def report(row, ok):
            if with_status:  # the worker writes the row's status before vLLM reports its job
                mgr.shared.mark([row], 0, STORE_OK if ok else STORE_FAILED)
            mgr.complete_store([K], rc, success=ok if not with_status else True)

        if first == "old":
            report(old_row, old_ok)
            # Attempt 1's copy has not been reported: its block is still pending; attempt 0's row is freed.
            assert _blocks(mgr) == {"pending": 1, "ready": 0, "detached": 0, "free": ROWS - 1}
            report(new_row, new_ok)
        else:
            report(new_row, new_ok)
            # Attempt 0's row stays held for its worker, which is still copying.
            assert _blocks(mgr) == {"pending": 0, "ready": int(new_ok), "detached": 1, "free": ROWS - 1 - new_ok}
            report(old_row, old_ok)
        mgr.on_request_finished(rc)
        assert _blocks(mgr) == {"pending": 0, "ready": int(new_ok), "detached": 0, "free": ROWS - new_ok}
        assert mgr.stats()["vllm_tracked_requests"] == 0
    finally:
        mgr.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_status", [False, True])
def test_an_attempt_that_stores_a_key_again_after_its_deadline_owes_both_reports(tmp_path, with_status):
    """The pool holds both rows of a key written again by one attempt until both writes end (a rewrite)."""
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    from kvactors.integrations.vllm.shm import STORE_OK

    mgr, runtime = _manager(tmp_path, with_status)
    try:
        rc = VReqContext("r1")
        mgr.on_new_request(rc)
        rows = [_store(mgr, rc)]
        runtime.advance(TIMEOUT_S + 1)
        rows.append(_store(mgr, rc))  # the same attempt stores K again, on a new row
        for row in rows:
            if with_status:
                mgr.shared.mark([row], 0, STORE_OK)
            mgr.complete_store([K], rc, success=True)
        mgr.on_request_finished(rc)
        assert _blocks(mgr) == {"pending": 0, "ready": 1, "detached": 0, "free": ROWS - 1}
        assert mgr.stats()["vllm_tracked_requests"] == 0
    finally:
        mgr.shutdown()
