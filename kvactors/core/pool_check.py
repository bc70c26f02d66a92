"""The invariants of :class:`~kvactors.core.pool.BlockPool`, checked whole (for tests).

Reads the pool's private state on purpose: it is the pool's own checker, kept apart
because it is not on any operation's path.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvactors.core.pool import BlockPool
    from kvactors.core.pool_types import Writer


def check_invariants(pool: BlockPool) -> None:
    """Assert that every piece of the pool's state agrees with every other. O(rows)."""
    pins = Counter[int]()
    for entry in pool._load_pins.values():
        # Every pin is counted on the row it was taken on; owed releases only
        # while the pins lie on more than one row; no entry outlives its pins.
        assert entry.rows and all(count > 0 for count in entry.rows.values())
        assert 0 <= entry.owed < entry.taken and (entry.owed == 0 or len(entry.rows) > 1)
        pins.update(entry.rows)
    for rows in pool._job_pins.values():
        pins.update(rows)
    holds = Counter[int]()
    for rows in pool._held_jobs.values():
        holds.update(rows)
    writers: dict[int, Writer] = {}
    for (writer, key), row in pool._pending_writes.items():
        assert pool._keys[row] == key and row not in writers
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
        held_key = pool._keys[row]
        busy = pool._busy(row)
        if row in free:
            assert held_key is None and not busy and not pool._indexed[row], f"free row {row} in use"
            continue
        assert held_key is not None, f"row {row} is neither free nor holds a key"
        key = held_key
        if pool._indexed[row]:
            assert pool._index[key] == row
            assert bool(pool._ready[row]) == (pool._writer[row] is None), f"row {row}: ready vs writer"
            counts["ready" if pool._ready[row] else "pending"] += 1
            evictable = pool._ready[row] and not busy
            assert (key in pool._policy) == bool(evictable), f"row {row}: policy membership"
        else:
            assert busy, f"row {row} is unindexed and idle but not free"
            assert row in pool._detached
            counts["detached"] += 1
        counts["pinned"] += pool._pins[row] > 0
    assert len(pool._index) == counts["ready"] + counts["pending"]
    assert (pool._n_ready, pool._n_pending, pool._n_pinned, len(pool._detached)) == (
        counts["ready"], counts["pending"], counts["pinned"], counts["detached"])
    assert len(pool._policy) == sum(
        1 for row in pool._index.values() if pool._ready[row] and not pool._busy(row))
