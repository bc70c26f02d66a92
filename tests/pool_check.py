"""The invariants of :class:`~kvactors.core.pool.BlockPool`, checked whole.

The pool's own checker, used by the tests only. It reads the pool's private state on
purpose, and its policy only through the policy's public ``snapshot``, ``has_row`` and
``check``. Tools read :meth:`~kvactors.core.pool.BlockPool.holdings` instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvactors.core.pool import BlockPool
    from kvactors.core.pool_types import PinOwner, Writer
    from kvactors.types import OffloadKey


def pending_writes(pool: BlockPool) -> Iterator[tuple[Writer, OffloadKey, int]]:
    """``(writer, key, row)`` for every pending store write (indexed or detached)."""
    for writer, mine in pool._pending_writes.items():
        for key, row in mine.items():
            yield writer, key, row


def load_pins(pool: BlockPool) -> dict[tuple[PinOwner, OffloadKey], tuple[dict[int, int], int]]:
    """``{(owner, key): ({row: pins}, owed)}`` for every key a request holds load pins of."""
    return {(owner, key): (dict(rows), owed) for owner, key, rows, owed in pool._pin_book.entries()}


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    """A comparable copy of the pool's whole state, whatever its representation."""
    return (
        dict(pool._index), list(pool._keys), bytes(pool._indexed), bytes(pool._ready), list(pool._writer),
        list(pool._pins), list(pool._holds), list(pool._free),
        {(writer, key): row for writer, key, row in pending_writes(pool)},
        load_pins(pool), dict(pool._job_pins), dict(pool._held_jobs),
        dict(pool._promotions), eviction_order(pool), set(pool._detached),
        {pair: (tuple(r.stale_rows), r.ended, r.ok) for pair, r in pool._rewrites.items()},
    )


def eviction_order(pool: BlockPool) -> tuple[object, ...]:
    """The pool's eviction state, in order: a refused call must not even touch a key's recency."""
    return pool._policy.snapshot()


def check_invariants(pool: BlockPool) -> None:
    """Assert that every piece of the pool's state agrees with every other. O(rows)."""
    pins = Counter[int]()
    book = pool._pin_book
    assert book.multi is pool._load_pins
    assert all(book.single.values()), "an owner with no single pins is left in the book"
    for owner, mine in book.single.items():
        assert not any((owner, key) in book.multi for key in mine), "a key in both books"
    for _, _, on_rows, owed in book.entries():
        # Every pin is counted on the row it was taken on; owed releases only
        # while the pins lie on more than one row; no entry outlives its pins.
        assert on_rows and all(count > 0 for count in on_rows.values())
        assert 0 <= owed < sum(on_rows.values()) and (owed == 0 or len(on_rows) > 1)
        pins.update(on_rows)
    for rows in pool._job_pins.values():
        pins.update(rows)
    holds = Counter[int]()
    for rows in pool._held_jobs.values():
        holds.update(rows)
    writers: dict[int, Writer] = {}
    assert all(pool._pending_writes.values()), "a writer with no pending write is left"
    for writer, key, row in pending_writes(pool):
        assert pool._keys[row] == key and row not in writers
        writers[row] = writer
    for (writer, key), rewrite in pool._rewrites.items():
        # Its live write is pending still; each earlier one holds its detached row.
        assert pool.has_pending_write(writer, key) and rewrite.stale_rows
        assert 0 <= rewrite.ended <= len(rewrite.stale_rows) and (rewrite.ok or rewrite.ended)
        for row in rewrite.stale_rows:
            assert pool._keys[row] == key and not pool._indexed[row] and row not in writers
            writers[row] = writer
    for job_id, entries in pool._promotions.items():
        for key, row in entries:
            assert pool._keys[row] == key and row not in writers
            writers[row] = job_id
    free = set(pool._free)
    assert len(free) == len(pool._free), "a row is free twice"
    counts = Counter[str]()
    for row in range(pool.num_blocks):
        assert pool._pins[row] == pins[row], f"row {row}: pins {pool._pins[row]} != {pins[row]}"
        assert pool._holds[row] == holds[row], f"row {row}: holds"
        assert pool._writer[row] == writers.get(row), f"row {row}: writer"
        # complete_store relies on it: nobody pins or holds a row while it is written.
        assert pool._writer[row] is None or not (pool._pins[row] or pool._holds[row]), f"row {row}: written and held"
        held_key = pool._keys[row]
        busy = pool._busy(row)
        if row in free:
            assert held_key is None and not busy and not pool._indexed[row], f"free row {row} in use"
            assert not pool._ready[row], f"free row {row} is marked ready"
            continue
        assert held_key is not None, f"row {row} is neither free nor holds a key"
        key = held_key
        if pool._indexed[row]:
            assert pool._index[key] == row
            assert bool(pool._ready[row]) == (pool._writer[row] is None), f"row {row}: ready vs writer"
            counts["ready" if pool._ready[row] else "pending"] += 1
            evictable = pool._ready[row] and not busy
            assert pool._policy.has_row(row) == bool(evictable), f"row {row}: policy membership"
        else:
            assert busy, f"row {row} is unindexed and idle but not free"
            assert not pool._policy.has_row(row), f"detached row {row} is evictable"
            assert row in pool._detached
            counts["detached"] += 1
        counts["pinned"] += pool._pins[row] > 0
    assert len(pool._index) == counts["ready"] + counts["pending"]
    assert (pool._n_ready, pool._n_pending, pool._n_pinned, len(pool._detached)) == (
        counts["ready"], counts["pending"], counts["pinned"], counts["detached"])
    assert len(pool._policy) == sum(
        1 for row in pool._index.values() if pool._ready[row] and not pool._busy(row))
    pool._policy.check()
