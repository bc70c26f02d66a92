"""The state of :class:`~kvactors.core.pool.BlockPool`, its per-row helpers, cascade pins and reset.

A base class, apart only to keep modules small: the pool's docstring says what
the states mean. The per-request calls of the pool do what these helpers do,
inline, on their hot paths; these serve the rarer ones. Not thread-safe: one
pool lives inside one actor.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from kvactors.core.events import EventBuffer
from kvactors.core.load_pins import LoadPinBook
from kvactors.core.policies.base import EvictionPolicy
from kvactors.core.policies.row_lru import RowLRUPolicy
from kvactors.core.pool_types import PoolError, Rewrite, Writer
from kvactors.types import PRIMARY_TIER_NAME, OffloadKey


class PoolRows:
    """Row states for ``num_blocks`` rows, and what changes one row at a time."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy, tier: str = PRIMARY_TIER_NAME, *,
                 on_events_dropped: Callable[[EventBuffer], None] | None = None) -> None:
        """``on_events_dropped(buffer)``: called when the events not taken yet overflow
        their bound (once per overflow: until the next ``take_events``)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self._policy = policy
        self._index: dict[OffloadKey, int] = {}
        self._keys: list[OffloadKey | None] = [None] * num_blocks
        self._indexed = bytearray(num_blocks)
        self._ready = bytearray(num_blocks)
        self._writer: list[Writer | None] = [None] * num_blocks
        # Pins: a list, not an array (faster to index and update on the load paths, 4 more
        # bytes a row: its small ints are shared); holds change only when jobs time out.
        self._pins = [0] * num_blocks
        self._holds = array("i", bytes(4 * num_blocks))
        # Popping from the end hands out low rows first, which keeps runs contiguous.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Per writer, so a request's calls find their keys without a tuple per key.
        self._pending_writes: dict[Writer, dict[OffloadKey, int]] = {}
        self._rewrites: dict[tuple[Writer, OffloadKey], Rewrite] = {}  # keys written again by their writer
        self._pin_book = LoadPinBook()
        self._load_pins = self._pin_book.multi  # keys pinned more than once by a request
        self._job_pins: dict[int, tuple[int, ...]] = {}
        self._held_jobs: dict[int, tuple[int, ...]] = {}
        self._promotions: dict[int, tuple[tuple[OffloadKey, int], ...]] = {}
        self._events = EventBuffer(tier, on_overflow=on_events_dropped)
        self._n_ready = 0
        self._n_pending = 0
        self._n_pinned = 0
        self._detached: set[int] = set()  # unindexed rows that are still busy
        self.evicted_keys = 0  # a counter for metrics: ready keys evicted to make room
        # A policy that can order rows itself (LRU) does so through our index
        # instead of keeping its own map of keys; the hot paths then call it by row.
        self._rows: RowLRUPolicy | None = None
        bind_rows = getattr(policy, "bind_rows", None)
        if callable(bind_rows):
            self._rows = bind_rows(self._index.get, self._keys, num_blocks)
            self._policy = self._rows

    # ------------------------------------------------------------------ cascade jobs

    def pin_for_job(self, job_id: int, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Pin the rows of ready ``keys`` while a tier reads them (a cascade)."""
        if job_id in self._job_pins or job_id in self._held_jobs:
            raise PoolError(f"job {job_id} already pins rows")
        rows = self._ready_rows(keys)
        for row in rows:
            self._pin(row)
        self._job_pins[job_id] = tuple(rows)
        return tuple(rows)

    def end_job(self, job_id: int, *, hold: bool) -> bool:
        """Release a cascade job's pins. ``hold``: it timed out, so keep its rows
        unreusable until :meth:`release_hold` (its tier may still be reading).

        Returns whether the job pinned rows here.
        """
        rows = self._job_pins.pop(job_id, None)
        if rows is None:
            return False
        for row in rows:
            self._unpin(row)
            if hold:
                self._holds[row] += 1
        if hold:
            self._held_jobs[job_id] = rows
        for row in rows:
            self._settle(row)
        return True

    def release_hold(self, job_id: int) -> bool:
        """The late report of a held job arrived: its rows may be reused."""
        rows = self._held_jobs.pop(job_id, None)
        if rows is None:
            return False
        for row in rows:
            self._holds[row] -= 1
            self._settle(row)
        return True

    # ------------------------------------------------------------------ reset

    def reset(self) -> int:
        """Unindex every block (lookups miss from now on); free the rows nobody uses.

        Rows still being written or read stay reserved until their writer or
        reader ends, exactly as after a deadline. Returns the number of keys removed.
        """
        removed_ready = []
        rows = list(self._index.values())
        freed_from = len(self._free)
        for row in rows:
            if self._ready[row]:
                removed_ready.append(self._keys[row])
            self._unindex(row)
            self._settle(row)
        # The free list is taken from its end: the freed rows go there highest first, so the
        # stores after a reset get ascending rows and the copies of consecutive requests
        # coalesce (docs/performance.md).
        self._free[freed_from:] = sorted(self._free[freed_from:], reverse=True)
        if removed_ready:
            self._events.add([k for k in removed_ready if k is not None], True)
        return len(rows)

    @property
    def event_keys_dropped(self) -> int:
        """Keys of events dropped unseen (nobody called ``take_events`` for too long)."""
        return self._events.dropped_keys

    # ------------------------------------------------------------------ per row

    def _ready_rows(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The rows of ``keys``; :class:`PoolError` if one is not ready."""
        rows = list(map(self._index.get, keys))
        try:
            if all(map(self._ready.__getitem__, rows)):  # type: ignore[arg-type]  # None: TypeError
                return rows  # type: ignore[return-value]  # no None: all ready
        except TypeError:
            pass  # a key is not indexed
        ready = self._ready
        key = next(key for key, row in zip(keys, rows, strict=True) if row is None or not ready[row])
        raise PoolError(f"key {key.hex()[:16]} is not ready in the pool")

    def _spared(self, present: Sequence[OffloadKey]) -> frozenset[OffloadKey]:
        """The evictable keys among a call's ``present`` ones: eviction must spare them."""
        if not present:
            return frozenset()
        policy = self._policy
        return frozenset(key for key in present if key in policy)

    def _make_ready(self, row: int) -> None:
        self._ready[row] = 1
        self._n_pending -= 1
        self._n_ready += 1

    def _unindex(self, row: int) -> None:
        key = self._keys[row]
        assert key is not None and self._indexed[row]
        if self._rows is not None:
            self._rows.discard_row(row)
        else:
            self._policy.discard(key)
        del self._index[key]
        self._indexed[row] = 0
        if self._ready[row]:
            self._n_ready -= 1
        else:
            self._n_pending -= 1
        self._ready[row] = 0
        if self._busy(row):
            self._detached.add(row)

    def _evict_one(self, spare: frozenset[OffloadKey] = frozenset()) -> OffloadKey:
        key = self._policy.victim(spare)
        assert key is not None, "caller checked there is an evictable key"
        row = self._index[key]
        assert self._ready[row] and not self._busy(row), "the policy only holds evictable keys"
        self._unindex(row)
        self._settle(row)
        return key

    def _busy(self, row: int) -> bool:
        return self._writer[row] is not None or self._pins[row] > 0 or self._holds[row] > 0

    def _pin(self, row: int) -> None:
        if self._pins[row] == 0:
            self._n_pinned += 1
            if self._rows is not None:
                self._rows.discard_row(row)
            else:
                key = self._keys[row]
                if key is not None:
                    self._policy.discard(key)
        self._pins[row] += 1

    def _unpin(self, row: int) -> None:
        assert self._pins[row] > 0, "every unpin matches one pin"
        self._pins[row] -= 1
        if self._pins[row] == 0:
            self._n_pinned -= 1

    def _settle(self, row: int) -> None:
        """Put ``row`` where its state says: the policy, the free list, or neither."""
        if self._busy(row):
            return
        key = self._keys[row]
        if self._indexed[row]:
            if self._rows is not None:
                if self._ready[row]:
                    self._rows.add_row(row)
            elif self._ready[row] and key is not None and key not in self._policy:
                self._policy.add(key)
        elif key is not None:
            # Unindexed and idle: nobody can reach or touch this row any more.
            self._keys[row] = None
            self._detached.discard(row)
            self._free.append(row)
