"""Rows, not keys, through the TieringManager (issue 14, items 1 and 2).

A load pin belongs to the row it was taken on: after ``reset_cache()`` a
request may pin a key's old row and its new row, and neither row is handed
out again before the last copy that may read it has ended. A
``prepare_store`` never evicts a key of its own call.
"""

from __future__ import annotations

import pytest

from kvactors import LookupResult, OffloadingEvent, ReqContext, TieringManager
from tests.support import settled

K, X = b"key-k", b"key-x"


def _store(manager: TieringManager, keys: list[bytes], ctx: ReqContext) -> tuple[int, ...]:
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    return out.store_spec.block_ids


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_load_across_a_reset_holds_both_rows_until_both_copies_end(eviction):
    with TieringManager.start(num_blocks=2, block_bytes=8, eviction=eviction) as manager:
        reader, writer = ReqContext("reader"), ReqContext("writer")
        manager.on_new_request(reader)
        manager.on_new_request(writer)
        _store(manager, [K], writer)
        (old,) = manager.prepare_load([K], reader).block_ids  # copy 1 reads the old row
        manager.reset_cache()
        (new,) = _store(manager, [K], writer)
        assert new != old
        assert manager.prepare_load([K], reader).block_ids == (new,)  # copy 2 reads the new row
        manager.complete_load([K], reader)  # one of the two copies ended: which one is not said
        # TRT-LLM #8274: the old row was freed here and handed to the next store while copy 1 read it.
        assert manager.prepare_store([X], writer) is None, "a row still being read was handed out"
        assert manager.stats()["blocks_pinned"] == 2
        manager.complete_load([K], reader)
        stats = settled(manager)
        # LMCache #2954: the second release went to the old row again and the new one stayed pinned.
        assert stats["blocks_pinned"] == 0 and stats["internal_errors"] == 0
        assert stats["contract_violations"] == 0
        assert manager.lookup([K], reader) == [LookupResult.HIT]
        out = manager.prepare_store([X], writer)
        assert out is not None and out.store_spec.block_ids == (old,) and out.evicted_keys == []
        manager.complete_load([K], reader)  # a third release: no pin left, counted, nothing changes
        manager.complete_store([X], writer)
        stats = settled(manager)
        assert stats["contract_violations"] == 1 and stats["blocks_pinned"] == 0 and stats["blocks_ready"] == 2
        manager.on_request_finished(reader)
        manager.on_request_finished(writer)


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_prepare_store_never_evicts_a_key_it_reports_present(eviction):
    """vLLM PR #35846: ``a`` was left out of keys_to_store as present, then evicted for ``c``."""
    a, b, c, d = b"key-a", b"key-b", b"key-c", b"key-d"
    with TieringManager.start(num_blocks=2, block_bytes=8, eviction=eviction) as manager:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        _store(manager, [a, b], ctx)  # a is the least recently used
        manager.take_events()
        out = manager.prepare_store([a, c, c, a], ctx)
        assert out is not None and out.keys_to_store == [c] and out.evicted_keys == [b]
        assert manager.take_events() == [OffloadingEvent((b,), "cpu", True)]
        assert manager.lookup([a, c], ctx) == [LookupResult.HIT, LookupResult.HIT_PENDING]
        manager.complete_store([c], ctx)
        # Room that only the call's own present keys could give is no room, and changes nothing.
        assert manager.prepare_store([a, c, d], ctx) is None
        assert manager.lookup([a, c], ctx) == [LookupResult.HIT, LookupResult.HIT]
        assert manager.take_events() == [OffloadingEvent((c,), "cpu", False)]
        manager.on_request_finished(ctx)
        assert settled(manager)["contract_violations"] == 0
