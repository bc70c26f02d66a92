"""The events kept for ``take_events`` are bounded: a caller that never asks does not make
the runtime grow (the primary pool, each built-in tier), the newest are kept, and the drop
is counted and logged once per overflow."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvactors.core.events as events_module
from kvactors import MemoryTier, ReqContext, TieringManager
from kvactors.core.events import EventBuffer
from tests.support import keys

pytestmark = pytest.mark.timeout(120)


@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 6), st.booleans(), st.booleans()), max_size=60))
def test_a_buffer_keeps_the_newest_events_within_its_bound_and_counts_the_rest(
    max_keys: int, script: list[tuple[int, bool, bool]]
) -> None:
    buffer = EventBuffer("t", max_keys=max_keys)
    added: list[tuple[tuple[bytes, ...], bool]] = []
    seq = 0
    total = kept_before_take = 0
    overflow_began = 0
    episode_open = False
    for size, removed, take in script:
        batch = tuple(b"%d" % (seq + i) for i in range(size))
        seq += size
        began = buffer.add(batch, removed)
        if batch:
            added.append((batch, removed))
            total += size
        if began:
            assert not episode_open, "an overflow was announced twice before a take"
            episode_open = True
            overflow_began += 1
        if take:
            taken = buffer.take()
            kept = [(e.keys, e.removed) for e in taken]
            assert all(e.tier == "t" for e in taken)
            assert kept == added[len(added) - len(kept):], "not the newest events, in order"
            assert sum(len(k) for k, _ in kept) <= max_keys or len(kept) == 1
            kept_before_take += sum(len(k) for k, _ in kept)
            added.clear()
            episode_open = False
            assert len(buffer) == 0
    kept_before_take += sum(len(e.keys) for e in buffer.take())
    assert kept_before_take + buffer.dropped_keys == total
    assert (buffer.dropped_keys > 0) == (overflow_began > 0)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", None.__class__])
def test_a_buffer_refuses_a_bound_that_is_not_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_keys"):
        EventBuffer("t", max_keys=bad)  # type: ignore[arg-type]


def test_a_manager_whose_events_are_never_taken_stays_bounded(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(events_module, "MAX_PENDING_EVENT_KEYS", 8)
    tier = MemoryTier(name="mem", capacity_blocks=64)
    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=64, block_bytes=8, secondary_tiers=[tier]) as manager:
        manager.on_new_request(ctx)
        for n in range(10):  # 30 keys stored at each tier, never taken
            batch = keys(*range(3 * n, 3 * n + 3))
            out = manager.prepare_store(batch, ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
        assert manager.wait_idle(30)
        assert manager.stats()["event_keys_dropped"] == 30 - 6  # the primary keeps its two newest events
        taken = manager.take_events()
        primary = [k for e in taken if e.tier == "cpu" for k in e.keys]
        memory = [k for e in taken if e.tier == "mem" for k in e.keys]
        assert primary == keys(*range(24, 30))
        assert memory and len(memory) <= 8 and memory == keys(*range(30 - len(memory), 30))
        assert manager.take_events() == []  # taken: the buffers start again
    dropped = [r.getMessage() for r in caplog.records if "events_dropped" in r.getMessage()]
    assert len([m for m in dropped if m.startswith("pool_events_dropped") and "tier=cpu" in m]) == 1, dropped
    assert len([m for m in dropped if "tier=mem" in m]) == 1, dropped
