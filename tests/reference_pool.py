"""The primary pool as it was before issue 17 (main at ee5fb26): the reference the
optimized :class:`~kvactors.core.pool.BlockPool` is compared with (tests/test_pool_model.py).

Kept as it was, not maintained: straightforward per-key code (a ``LoadPins`` per
pinned key, a ``(writer, key)`` tuple per pending write, helpers per row), and the
policy called by key (the pool binds it to its rows; LRU and its row form evict alike).
Its :meth:`ReferencePool.snapshot` has the same shape as ``tests.pool_check.snapshot``.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Collection, Iterable, Sequence

from kvactors.core.policies.base import EvictionPolicy
from kvactors.core.pool_types import Identity, PoolError, Rewrite, StoreOutcome, StorePlan, Writer
from kvactors.types import PRIMARY_TIER_NAME, LookupResult, OffloadingEvent, OffloadKey


class LoadPins:
    """One request's load pins of one key: how many on each row, and releases owed.

    ``rows`` counts the pins taken on each row. ``owed`` counts the releases
    (``complete_load``) received but not yet applied to a row, because the
    pins lie on more than one row and a release does not say which of the
    copies ended (see :meth:`BlockPool.unpin_load`).
    """

    __slots__ = ("owed", "rows")

    def __init__(self, row: int) -> None:
        self.rows: dict[int, int] = {row: 1}
        self.owed = 0

    @property
    def taken(self) -> int:
        return sum(self.rows.values())

    @property
    def outstanding(self) -> int:
        """Pins not yet released by the request."""
        return self.taken - self.owed

    def release(self, count: int) -> dict[int, int] | None:
        """``count`` more releases arrived: ``{row: pins to release}`` now, or ``None``
        while they must be owed (the pins lie on several rows and some are still out).

        Usually every pin lies on one row, and the releases apply at once. When they
        lie on several rows, a release does not say which copy ended, so releases are
        owed until every pin of the key is released; then each row loses its pins.
        """
        self.owed += count
        if len(self.rows) == 1:
            ((row, pins),) = self.rows.items()
            released = {row: self.owed}
            self.rows[row] = pins - self.owed
            self.owed = 0
            return released
        if self.owed == self.taken:
            released, self.rows, self.owed = self.rows, {}, 0
            return released
        return None


class ReferencePool:
    """Block states, pins and eviction for ``num_blocks`` rows."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy, tier: str = PRIMARY_TIER_NAME) -> None:
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
        self._pins = array("i", bytes(4 * num_blocks))
        self._holds = array("i", bytes(4 * num_blocks))
        # Popping from the end hands out low rows first, which keeps runs contiguous.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending_writes: dict[tuple[Writer, OffloadKey], int] = {}
        self._rewrites: dict[tuple[Writer, OffloadKey], Rewrite] = {}
        self._load_pins: dict[tuple[Identity, OffloadKey], LoadPins] = {}
        self._job_pins: dict[int, tuple[int, ...]] = {}
        self._held_jobs: dict[int, tuple[int, ...]] = {}
        self._promotions: dict[int, tuple[tuple[OffloadKey, int], ...]] = {}
        self._events: list[OffloadingEvent] = []
        self._n_ready = 0
        self._n_pending = 0
        self._n_pinned = 0
        self._detached: set[int] = set()  # unindexed rows that are still busy
        self.evicted_keys = 0  # a counter for metrics: ready keys evicted to make room

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Iterable[OffloadKey]) -> list[LookupResult]:
        """``HIT`` (ready), ``HIT_PENDING`` (being written) or ``MISS`` per key; hits count as uses."""
        results = []
        index_get, ready = self._index.get, self._ready
        miss, hit, pending = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
        for key in keys:
            row = index_get(key)
            if row is None:
                results.append(miss)
            elif ready[row]:
                self._policy.access(key)
                results.append(hit)
            else:
                results.append(pending)
        return results

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark ``keys`` as used (those that are present)."""
        for key in keys:
            self._policy.access(key)

    def row_of(self, key: OffloadKey) -> int | None:
        """The row ``key`` is indexed at, if any."""
        return self._index.get(key)

    def is_ready(self, key: OffloadKey) -> bool:
        row = self._index.get(key)
        return row is not None and bool(self._ready[row])

    def has_pending_write(self, writer: Writer, key: OffloadKey) -> bool:
        return (writer, key) in self._pending_writes

    def pending_writes_of(self, writer: Writer) -> list[OffloadKey]:
        """Keys ``writer`` is still writing (indexed or detached). O(pending writes)."""
        return [key for (w, key) in self._pending_writes if w == writer]

    def load_pins_of(self, identity: Identity) -> int:
        """How many load pins ``identity`` holds. O(load pins)."""
        return sum(pins.outstanding for (owner, _), pins in self._load_pins.items() if owner == identity)

    def stats(self) -> dict[str, int]:
        """Row counts by state; O(1)."""
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": len(self._free),
            "blocks_ready": self._n_ready,
            "blocks_pending": self._n_pending,
            "blocks_pinned": self._n_pinned,
            "blocks_detached": len(self._detached),
            "blocks_evictable": len(self._policy),
            "jobs_pinning": len(self._job_pins),
            "jobs_held": len(self._held_jobs),
        }

    def state_counts(self) -> dict[str, int]:
        """Rows by exclusive state, summing to ``num_blocks``: ``ready`` (indexed,
        ready, unpinned), ``pinned`` (indexed, ready, pinned), ``pending`` (indexed,
        being written), ``detached`` (unindexed, still in use), ``free``. O(detached rows)."""
        pinned_detached = sum(1 for row in self._detached if self._pins[row] > 0)
        pinned = self._n_pinned - pinned_detached
        return {"ready": self._n_ready - pinned, "pinned": pinned, "pending": self._n_pending,
                "detached": len(self._detached), "free": len(self._free)}

    def take_events(self) -> list[OffloadingEvent]:
        """Stores and removals since the last call, in order."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Sequence[OffloadKey], writer: Identity) -> StorePlan | None:
        """Allocate not-ready rows for the keys that are not present; evict if needed.

        Left out: keys already indexed, and duplicates within ``keys`` (each key
        is stored once, at its first place). A key ``writer`` is still writing
        from an earlier, detached store gets a new row; every row of it stays
        held until each of the writer's writes of it was completed.

        The keys of the call that are present (left out because indexed) are
        never evicted to make room for the others: the caller is told they are
        cached. Returns ``None``, and changes nothing, when the free rows and
        the evictable rows of *other* keys are too few for every new key (all
        or nothing, as ``TieringManager.prepare_store``: "``None`` if there is no room"; storing
        only some of the keys would leave holes in a request's prefix).
        """
        new: list[OffloadKey] = []
        present: list[OffloadKey] = []
        seen: set[OffloadKey] = set()
        index = self._index
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if key in index:
                present.append(key)
            elif (writer, key) not in self._rewrites:  # written again once already: left out
                new.append(key)
        allocated = self._allocate(new, writer, present)
        if allocated is None:
            return None
        rows, evicted = allocated
        for key, row in zip(new, rows, strict=True):
            old = self._pending_writes.get((writer, key))
            if old is not None:  # a detached write of the key: each row waits for every completion
                self._rewrites.setdefault((writer, key), Rewrite()).stale_rows.append(old)
            self._pending_writes[(writer, key)] = row
        return StorePlan(tuple(new), rows, evicted)

    def complete_store(self, keys: Sequence[OffloadKey], writer: Identity, success: bool) -> StoreOutcome:
        """End ``writer``'s writes of ``keys``: ready on success, removed on failure.

        Raises :class:`PoolError` (nothing changed) if a key has no pending
        write by ``writer`` (never prepared, already completed, or repeated).
        """
        rows = []
        for key in keys:
            row = self._pending_writes.get((writer, key))
            if row is None:
                raise PoolError(f"key {key.hex()[:16]} has no pending store by {writer}")
            rows.append(row)
        if len(set(rows)) != len(rows):
            raise PoolError("a key is completed twice in one call")
        live = stale = 0
        stored: list[OffloadKey] = []
        for key, row in zip(keys, rows, strict=True):
            ok = success
            rewrite = self._rewrites.get((writer, key))
            if rewrite is not None:
                rewrite.ended += 1
                rewrite.ok = rewrite.ok and success
                if rewrite.ended <= len(rewrite.stale_rows):
                    stale += 1
                    continue
                del self._rewrites[(writer, key)]
                for old in rewrite.stale_rows:
                    self._writer[old] = None
                    self._settle(old)
                ok = rewrite.ok
            del self._pending_writes[(writer, key)]
            self._writer[row] = None
            if self._indexed[row]:
                live += 1
                if ok:
                    self._make_ready(row)
                    stored.append(key)
                else:
                    self._unindex(row)
            else:
                stale += 1
            self._settle(row)
        if stored:
            self._events.append(OffloadingEvent(tuple(stored), self.tier, False))
        return StoreOutcome(live, stale, tuple(stored), tuple(rows))

    def detach_write(self, writer: Writer, key: OffloadKey) -> bool:
        """A pending store passed its deadline: unindex it, keep the row for its writer.

        Returns whether the write was still indexed (it counted as pending).
        """
        row = self._pending_writes.get((writer, key))
        if row is None or not self._indexed[row]:
            return False
        self._unindex(row)
        return True

    # ------------------------------------------------------------------ loads

    def pin_for_load(self, keys: Sequence[OffloadKey], owner: Identity) -> tuple[int, ...]:
        """Pin the rows of ready ``keys`` for ``owner``; one pin per key given.

        Raises :class:`PoolError` (nothing changed) if a key is not ready.
        """
        rows = self._ready_rows(keys)
        for key, row in zip(keys, rows, strict=True):
            entry = self._load_pins.get((owner, key))
            if entry is None:
                self._load_pins[(owner, key)] = LoadPins(row)
            else:
                # The same row again, or a new row of the key (an old one was
                # detached by a reset while pinned): each pin is booked on its own row.
                entry.rows[row] = entry.rows.get(row, 0) + 1
            self._pin(row)
            self._policy.access(key)
        return tuple(rows)

    def unpin_load(self, keys: Sequence[OffloadKey], owner: Identity) -> None:
        """Release pins taken by :meth:`pin_for_load`: one pin per key given,
        each released once, on the row it was taken on.

        Usually all of ``owner``'s pins of a key lie on one row, and the
        release takes effect at once. After a reset they may lie on two rows
        (a pin on the key's old, detached row, and one on its new row), and a
        release does not say which copy ended: releasing either row could
        free a row still being read (TRT-LLM #8274). Such releases are owed
        until ``owner`` has released every pin of that key; then each row loses
        the pins taken on it. A row is therefore never freed before every copy
        that may read it has ended, and every pin is released exactly once.

        Raises :class:`PoolError` (nothing changed) if ``owner`` does not hold
        that many unreleased pins on a key.
        """
        wanted = Counter(keys)
        for key, count in wanted.items():
            entry = self._load_pins.get((owner, key))
            if entry is None or entry.outstanding < count:
                raise PoolError(f"key {key.hex()[:16]} is not pinned by {owner}")
        for key, count in wanted.items():
            entry = self._load_pins[(owner, key)]
            released = entry.release(count)
            if released is None:
                continue  # pins on several rows: wait for the key's last release
            if not entry.outstanding:
                del self._load_pins[(owner, key)]
            for row, pins in released.items():
                for _ in range(pins):
                    self._unpin(row)
                self._settle(row)

    # ------------------------------------------------------------------ jobs

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

    def allocate_promotion(self, job_id: int, keys: Sequence[OffloadKey]) -> tuple[int, ...] | None:
        """Allocate not-ready rows for ``keys`` (all absent) to be loaded by job ``job_id``.

        All or nothing: ``None`` (nothing changed) if a key is present or there is
        no room.
        """
        if job_id in self._promotions:
            raise PoolError(f"job {job_id} already promotes")
        if len(set(keys)) != len(keys) or any(key in self._index for key in keys):
            return None
        allocated = self._allocate(keys, job_id)
        if allocated is None:
            return None
        rows, _ = allocated
        self._promotions[job_id] = tuple(zip(keys, rows, strict=True))
        return rows

    def end_promotion(self, job_id: int, *, success: bool, hold: bool = False,
                      ok_keys: Collection[OffloadKey] | None = None) -> tuple[OffloadKey, ...]:
        """A promotion ended: its rows become ready (success) or are removed.

        ``ok_keys``: the job ended per key; the rows of those keys become ready
        (when ``success``), every other row of the job is removed, never served.
        ``hold``: it timed out; the rows are removed from lookups but stay
        unreusable (the tier may still write them) until :meth:`release_hold`.
        Returns the keys that became ready.
        """
        entries = self._promotions.pop(job_id, None)
        if entries is None:
            return ()
        stored: list[OffloadKey] = []
        for key, row in entries:
            if hold:
                self._holds[row] += 1
            self._writer[row] = None
            if self._indexed[row]:
                if success and not hold and (ok_keys is None or key in ok_keys):
                    self._make_ready(row)
                    stored.append(key)
                else:
                    self._unindex(row)
            self._settle(row)
        if hold:
            self._held_jobs[job_id] = tuple(row for _, row in entries)
        if stored:
            self._events.append(OffloadingEvent(tuple(stored), self.tier, False))
        return tuple(stored)

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
            self._events.append(OffloadingEvent(tuple(k for k in removed_ready if k is not None), self.tier, True))
        return len(rows)

    def snapshot(self) -> tuple[object, ...]:
        """A comparable copy of the whole state (tests check that errors change nothing)."""
        return (
            dict(self._index), list(self._keys), bytes(self._indexed), bytes(self._ready), list(self._writer),
            self._pins.tolist(), self._holds.tolist(), list(self._free), dict(self._pending_writes),
            {k: (dict(v.rows), v.owed) for k, v in self._load_pins.items()}, dict(self._job_pins),
            dict(self._held_jobs),
            dict(self._promotions), self._policy.snapshot(), set(self._detached),
            {pair: (tuple(r.stale_rows), r.ended, r.ok) for pair, r in self._rewrites.items()},
        )

    # ------------------------------------------------------------------ internals

    def _ready_rows(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The rows of ``keys``; :class:`PoolError` if one is not ready."""
        rows = []
        for key in keys:
            row = self._index.get(key)
            if row is None or not self._ready[row]:
                raise PoolError(f"key {key.hex()[:16]} is not ready in the pool")
            rows.append(row)
        return rows

    def _spared(self, present: Sequence[OffloadKey]) -> frozenset[OffloadKey]:
        """The evictable keys among a call's ``present`` ones: eviction must spare them."""
        if not present:
            return frozenset()
        policy = self._policy
        return frozenset(key for key in present if key in policy)

    def _allocate(
        self, keys: Sequence[OffloadKey], writer: Writer, present: Sequence[OffloadKey] = ()
    ) -> tuple[tuple[int, ...], tuple[OffloadKey, ...]] | None:
        """Not-ready rows for absent ``keys``, evicting if needed: ``(rows, evicted)``,
        or ``None`` (nothing changed) when free and evictable rows are too few.

        ``present``: the caller's keys that are indexed; eviction spares them."""
        shortfall = len(keys) - len(self._free)
        spare = self._spared(present) if shortfall > 0 else frozenset()
        if shortfall > 0 and len(self._policy) - len(spare) < shortfall:
            return None
        evicted = tuple(self._evict_one(spare) for _ in range(max(shortfall, 0)))
        if evicted:
            self.evicted_keys += len(evicted)
            self._events.append(OffloadingEvent(evicted, self.tier, True))
        # Ascending rows for consecutive keys: copies of a request's blocks then
        # coalesce into few large slice copies (rows freed by eviction come back
        # in reverse order, and one-block copies are much slower than long runs).
        rows = tuple(sorted(self._free.pop() for _ in keys))
        for key, row in zip(keys, rows, strict=True):
            self._occupy(row, key, writer)
        return rows, evicted

    def _occupy(self, row: int, key: OffloadKey, writer: Writer) -> None:
        self._keys[row] = key
        self._indexed[row] = 1
        self._ready[row] = 0
        self._writer[row] = writer
        self._index[key] = row
        self._n_pending += 1

    def _make_ready(self, row: int) -> None:
        self._ready[row] = 1
        self._n_pending -= 1
        self._n_ready += 1

    def _unindex(self, row: int) -> None:
        key = self._keys[row]
        assert key is not None and self._indexed[row]
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
            if self._ready[row] and key is not None and key not in self._policy:
                self._policy.add(key)
        elif key is not None:
            # Unindexed and idle: nobody can reach or touch this row any more.
            self._keys[row] = None
            self._detached.discard(row)
            self._free.append(row)
