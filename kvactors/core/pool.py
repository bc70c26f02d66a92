"""The primary pool's block bookkeeping: which row holds which key, in which state.

No threads, no torch.
The rows themselves live in a tensor owned elsewhere.
This class decides which rows may be read, written, evicted or reused.

A row has these states.

* It is **indexed** when its key is visible to lookups (``index[key] == row``).
* It is **ready** when its bytes are complete (only ready rows are ``HIT``).
* It is **busy** while someone may still touch its bytes.
  A *writer* (a request's store, or a promotion job) keeps it busy until that write ends.
  *Pins* (loads by requests, cascade jobs reading it) keep it busy until they are released.
  *Holds* (jobs that timed out) keep it busy until the late report comes,
  as their tier may still be reading the row.

A row is **evictable** only when indexed, ready and not busy.
It is **reused** only when neither indexed nor busy.
``reset`` and deadlines *detach* rows, unindexing them so lookups miss,
without freeing rows that are still busy.
A row being written or read is never handed out again until the job touching it has ended (TRT-LLM #8274).

Every holder is booked on the row it holds, never on its key.
Once a row is detached, its key may be stored, promoted and pinned again in a new row
while the old row still has holders.
Each of them is released on its own row (see :meth:`BlockPool.unpin_load` for a request that pins both).

``prepare_store`` never evicts a key of its own call.
The caller is told those keys are present, so they must still be when it returns (vLLM PR #35846).

Every operation validates its whole input before changing anything.
So a :class:`PoolError` means nothing changed.

Not thread-safe: one pool lives inside one actor.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Iterable, Sequence

from kvactors.core.events import EventBuffer
from kvactors.core.load_pins import LoadPinBook, LoadPins
from kvactors.core.policies.base import EvictionPolicy
from kvactors.core.pool_types import (
    Identity,
    PinOwner,
    PoolError,
    PoolHoldings,
    Rewrite,
    StoreOutcome,
    StorePlan,
    Writer,
)
from kvactors.core.snapshot import PoolFigures, flat_dict
from kvactors.types import PRIMARY_TIER_NAME, LookupResult, OffloadingEvent, OffloadKey

__all__ = ["BlockPool", "Identity", "LoadPins", "PoolError", "StoreOutcome", "StorePlan", "Writer"]


class BlockPool:
    """Block states, pins and eviction for ``num_blocks`` rows.

    The eviction policy is bound to the rows (:meth:`EvictionPolicy.bind_rows
    <kvactors.core.policies.base.EvictionPolicy.bind_rows>`), and the pool speaks to every
    policy alike, by row. The per-request calls (``prepare_store``, ``complete_store``,
    ``pin_for_load``, ``unpin_load``, ``lookup``, and a cascade's ``pin_for_job`` and
    ``end_job``) do their per-key work in loops over locals and call the policy once per
    call. The helpers (``_unpin``, ``_settle``, ...) serve the rarer paths. Both keep the
    same state.
    """

    def __init__(self, num_blocks: int, policy: EvictionPolicy, tier: str = PRIMARY_TIER_NAME, *,
                 on_events_dropped: Callable[[EventBuffer], None] | None = None) -> None:
        """``on_events_dropped(buffer)`` is called when the events not taken yet overflow their bound.

        It is called once per overflow, that is once until the next ``take_events``.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
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
        self._policy = policy.bind_rows(self._index.get, self._keys, num_blocks)

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Iterable[OffloadKey]) -> list[LookupResult]:
        """``HIT`` (ready), ``HIT_PENDING`` (being written) or ``MISS`` per key.

        Hits count as uses.
        """
        results = []
        index_get, ready = self._index.get, self._ready
        miss, hit, pending = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
        hits = []
        for key in keys:
            row = index_get(key)
            if row is None:
                results.append(miss)
            elif ready[row]:
                hits.append(row)
                results.append(hit)
            else:
                results.append(pending)
        if hits:
            self._policy.access_rows(hits)
        return results

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark ``keys`` as used (those that are present)."""
        self._policy.access_rows([row for row in map(self._index.get, keys) if row is not None])

    def row_of(self, key: OffloadKey) -> int | None:
        """The row ``key`` is indexed at, if any."""
        return self._index.get(key)

    def is_ready(self, key: OffloadKey) -> bool:
        row = self._index.get(key)
        return row is not None and bool(self._ready[row])

    def has_pending_write(self, writer: Writer, key: OffloadKey) -> bool:
        return key in self._pending_writes.get(writer, ())

    def rewriting(self, writer: Writer) -> bool:
        """Whether ``writer`` writes some key again (:class:`Rewrite`). O(1) when nobody does."""
        return bool(self._rewrites) and any(pair[0] == writer for pair in self._rewrites)

    def pending_writes_of(self, writer: Writer) -> list[OffloadKey]:
        """Keys ``writer`` is still writing (indexed or detached). O(its pending writes)."""
        return list(self._pending_writes.get(writer, ()))

    def load_pins_of(self, identity: PinOwner) -> int:
        """How many load pins ``identity`` holds. O(load pins)."""
        return self._pin_book.outstanding_of(identity)

    def figures(self) -> PoolFigures:
        """Row counts by state, and the jobs pinning or holding rows, in O(1)."""
        return PoolFigures(
            blocks_total=self.num_blocks,
            blocks_free=len(self._free),
            blocks_ready=self._n_ready,
            blocks_pending=self._n_pending,
            blocks_pinned=self._n_pinned,
            blocks_detached=len(self._detached),
            blocks_evictable=len(self._policy),
            jobs_pinning=len(self._job_pins),
            jobs_held=len(self._held_jobs),
        )

    def stats(self) -> dict[str, int]:
        """:meth:`figures` by their ``stats()`` keys, in O(1)."""
        return flat_dict(self.figures())

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
        return self._events.take()

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Sequence[OffloadKey], writer: Identity) -> StorePlan | None:
        """Allocate not-ready rows for the keys that are not present, evicting if needed.

        Keys already indexed are left out.
        So are duplicates within ``keys``, as each key is stored once, at its first place.

        A key that ``writer`` is still writing, from an earlier store that a reset or a deadline detached,
        gets a new row.
        Its completions cannot tell the writes apart.
        So every row of the key stays held until the writer completed each of them,
        and the new row becomes ready only if every one succeeded (:class:`Rewrite`).
        This happens once only.
        A key whose second write was detached too is left out until the writer's writes of it end.
        So a copy that never ends holds two rows, not one more per retry.

        The keys of the call that are present (left out because indexed) are never evicted
        to make room for the others, as the caller is told they are cached.
        Returns ``None``, and changes nothing, when the free rows and the evictable rows of *other* keys
        are too few for every new key.
        It is all or nothing, as ``TieringManager.prepare_store`` says ("``None`` if there is no room").
        Storing only some of the keys would leave holes in a request's prefix.
        """
        index = self._index
        mine = self._pending_writes.get(writer)
        unique = dict.fromkeys(keys)  # each key once, at its first place
        new = [key for key in unique if key not in index]
        present = [key for key in unique if key in index] if len(new) != len(unique) else []
        if self._rewrites and mine is not None:
            # Written again once already, and that write detached too: a third row would be one
            # more held for good if the first copy never ends. Left out until the writes end.
            new = [key for key in new if (writer, key) not in self._rewrites]
        allocated = self._allocate(new, writer, present)
        if allocated is None:
            return None
        rows, evicted = allocated
        if new:
            if mine is None:
                self._pending_writes[writer] = dict(zip(new, rows, strict=True))
            else:
                # A key of ``mine`` that is not indexed is a detached write of it: a rewrite.
                for key in new:
                    old = mine.get(key)
                    if old is not None:
                        self._rewrites.setdefault((writer, key), Rewrite()).stale_rows.append(old)
                mine.update(zip(new, rows, strict=True))
        return StorePlan(tuple(new), rows, evicted)

    def eviction_candidates(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The keys a :meth:`prepare_store` of ``keys`` would evict now (oldest first), changing nothing.

        It is empty when the free rows suffice, or when the policy cannot tell
        (ARC, see :attr:`peeks_victims`).
        The write-back admission asks it before a store (:mod:`kvactors.core.admission`).
        """
        index = self._index
        unique = dict.fromkeys(keys)
        new = sum(1 for key in unique if key not in index)
        shortfall = new - len(self._free)
        if shortfall <= 0:
            return []
        present = [key for key in unique if key in index]
        rows = self._policy.peek_victims(shortfall, self._spared(present))
        return [self._keys[row] for row in rows]  # type: ignore[misc]  # evictable rows hold their keys

    @property
    def peeks_victims(self) -> bool:
        """Whether :meth:`eviction_candidates` can answer (with LRU, not with ARC)."""
        return self._policy.peeks

    def complete_store(self, keys: Sequence[OffloadKey], writer: Identity, success: bool) -> StoreOutcome:
        """End ``writer``'s writes of ``keys``: ready on success, removed on failure.

        Raises :class:`PoolError` (nothing changed) if a key has no pending
        write by ``writer`` (never prepared, already completed, or repeated).
        """
        mine = self._pending_writes.get(writer)
        try:
            rows = [mine[key] for key in keys]  # type: ignore[index]  # None: the TypeError below
        except (KeyError, TypeError):
            key = next(key for key in keys if mine is None or key not in mine)
            raise PoolError(f"key {key.hex()[:16]} has no pending store by {writer}") from None
        if len(set(rows)) != len(rows):
            raise PoolError("a key is completed twice in one call")
        if not rows:
            return StoreOutcome(0, 0, (), ())
        assert mine is not None
        if self._rewrites and any((writer, key) in self._rewrites for key in keys):
            return self._complete_rewrites(keys, rows, writer, mine, success)
        if len(rows) == len(mine):
            del self._pending_writes[writer]  # every write of the writer ends: no del per key
        else:
            for key in keys:
                del mine[key]
        writers, indexed, ready = self._writer, self._indexed, self._ready
        # A store's row has no pins or holds (nobody else reaches a row not ready),
        # so every row that becomes ready here is evictable (what _settle decides).
        all_live = False
        if success:
            lo, hi = min(rows), max(rows) + 1
            if hi - lo == len(rows) and b"\x00" not in indexed[lo:hi]:
                # The common case: every write still live, on one run of rows (they are distinct).
                writers[lo:hi] = [None] * len(rows)
                ready[lo:hi] = b"\x01" * len(rows)
                all_live = True
            elif all(map(indexed.__getitem__, rows)):
                for row in rows:  # every write still live
                    writers[row] = None
                    ready[row] = 1
                all_live = True
        if all_live:
            stored = tuple(keys)
            self._policy.add_rows(rows)
            self._n_pending -= len(stored)
            self._n_ready += len(stored)
            self._events.add(stored, False)
            return StoreOutcome(len(rows), 0, stored, tuple(rows))
        done: list[OffloadKey] = []
        live = sum(self._end_write(key, row, success, done) for key, row in zip(keys, rows, strict=True))
        if done:
            self._events.add(done, False)
        return StoreOutcome(live, len(rows) - live, tuple(done), tuple(rows))

    def _end_write(self, key: OffloadKey, row: int, ok: bool, done: list[OffloadKey]) -> bool:
        """The write of ``key`` into ``row`` ended.

        The row becomes ready if ``ok`` (and ``key`` is appended to ``done``), else it is removed.
        A detached row is only freed.
        Returns whether the write was still live (indexed).
        """
        self._writer[row] = None
        live = bool(self._indexed[row])
        if live:
            if ok:
                self._make_ready(row)
                done.append(key)
            else:
                self._unindex(row)
        self._settle(row)
        return live

    def _complete_rewrites(self, keys: Sequence[OffloadKey], rows: list[int], writer: Writer,
                           mine: dict[OffloadKey, int], success: bool) -> StoreOutcome:
        """:meth:`complete_store` of keys some of which ``writer`` writes again (:class:`Rewrite`)."""
        live = 0
        done: list[OffloadKey] = []
        for key, row in zip(keys, rows, strict=True):
            ok = success
            rewrite = self._rewrites.get((writer, key))
            if rewrite is not None:
                rewrite.ended += 1
                rewrite.ok = rewrite.ok and success
                if rewrite.ended <= len(rewrite.stale_rows):
                    continue  # one of its writes ended (stale), which one is unknown: every row stays held
                del self._rewrites[(writer, key)]
                for old in rewrite.stale_rows:
                    self._writer[old] = None
                    self._settle(old)
                ok = rewrite.ok
            del mine[key]
            live += self._end_write(key, row, ok, done)
        if not mine:
            del self._pending_writes[writer]
        if done:
            self._events.add(done, False)
        return StoreOutcome(live, len(rows) - live, tuple(done), tuple(rows))

    def detach_write(self, writer: Writer, key: OffloadKey) -> bool:
        """A pending store passed its deadline: unindex it, keep the row for its writer.

        Returns whether the write was still indexed (it counted as pending).
        """
        row = self._pending_writes.get(writer, {}).get(key)
        if row is None or not self._indexed[row]:
            return False
        self._unindex(row)
        return True

    def detach_writes(self, writer: Writer, keys: Iterable[OffloadKey]) -> int:
        """:meth:`detach_write` of each of ``keys``: how many were still indexed.
        O(1) when ``writer`` has no pending write left (a store that completed in time)."""
        mine = self._pending_writes.get(writer)
        if mine is None:
            return 0
        return sum(self.detach_write(writer, key) for key in keys if key in mine)

    # ------------------------------------------------------------------ loads

    def pin_for_load(self, keys: Sequence[OffloadKey], owner: PinOwner) -> tuple[int, ...]:
        """Pin the rows of ready ``keys`` for ``owner``, one pin per key given.

        Raises :class:`PoolError` (nothing changed) if a key is not ready.
        """
        rows = self._ready_rows(keys)
        self._pin_book.book(owner, keys, rows)
        pins = self._pins
        newly = 0
        for row in rows:
            if not pins[row]:
                newly += 1
            pins[row] += 1
        # A row pinned before was not evictable, so discarding every row is what a pin of
        # one row does. A pinned row is not evictable: a use of it would change nothing.
        self._policy.discard_rows(rows)
        self._n_pinned += newly
        return tuple(rows)

    def unpin_load(self, keys: Sequence[OffloadKey], owner: PinOwner) -> None:
        """Release pins taken by :meth:`pin_for_load`.

        One pin is released per key given, once, on the row it was taken on.
        Usually all of ``owner``'s pins of a key lie on one row, and the release takes effect at once.
        After a reset they may lie on two rows (a pin on the key's old, detached row, and one on its new row).
        A release does not say which copy ended.
        So releasing either row could free a row still being read (TRT-LLM #8274).
        Such releases are owed until ``owner`` has released every pin of that key.
        Then each row loses the pins taken on it.
        A row is therefore never freed before every copy that may read it has ended,
        and every pin is released exactly once.

        Raises :class:`PoolError` (nothing changed) if ``owner`` does not hold
        that many unreleased pins on a key.
        """
        rows = self._pin_book.take(owner, keys)
        pins, writers, holds, indexed, ready = self._pins, self._writer, self._holds, self._indexed, self._ready
        unpinned = 0
        evictable: list[int] = []
        for row in rows:
            left = pins[row] - 1
            assert left >= 0, "every unpin matches one pin"
            pins[row] = left
            if left:
                continue
            unpinned += 1
            if writers[row] is not None or holds[row]:
                continue  # still busy
            if indexed[row]:
                if ready[row]:
                    evictable.append(row)
            else:
                self._settle(row)  # detached and idle now: freed
        self._n_pinned -= unpinned
        if evictable:
            self._policy.add_rows(evictable)

    # ------------------------------------------------------------------ promotions

    def promotion_rows(self, job_id: int) -> tuple[tuple[OffloadKey, int], ...]:
        """The ``(key, row)`` pairs promotion ``job_id`` writes (none if it is not in flight)."""
        return self._promotions.get(job_id, ())

    def room(self) -> int:
        """How many rows an allocation could take now: the free ones and the evictable ready ones."""
        return len(self._free) + len(self._policy)

    def allocate_promotion(self, job_id: int, keys: Sequence[OffloadKey]) -> tuple[int, ...] | None:
        """Allocate not-ready rows for ``keys`` (all absent) to be loaded by job ``job_id``.

        All or nothing: ``None`` (nothing changed) if a key is present or there is
        no room.
        """
        if job_id in self._promotions or job_id in self._held_jobs:
            # A held job's late report would end the new job's rows with its own.
            raise PoolError(f"job {job_id} already promotes or holds rows")
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

        With ``ok_keys``, the job ended per key.
        The rows of those keys become ready (when ``success``).
        Every other row of the job is removed, never served.
        With ``hold``, the job timed out.
        The rows are removed from lookups but stay unreusable until :meth:`release_hold`,
        as the tier may still write them.
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
            self._events.add(stored, False)
        return tuple(stored)

    # ------------------------------------------------------------------ cascade jobs

    def pin_for_job(self, job_id: int, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Pin the rows of ready ``keys`` while a tier reads them (a cascade)."""
        if job_id in self._job_pins or job_id in self._held_jobs:
            raise PoolError(f"job {job_id} already pins rows")
        rows = tuple(self._ready_rows(keys))
        # A pin per row, in one loop (a pin per key of every cascade: a hot path).
        pins = self._pins
        newly = 0
        for row in rows:
            if not pins[row]:
                newly += 1
            pins[row] += 1
        self._policy.discard_rows(rows)  # a row pinned before is not tracked: a no-op for it
        self._n_pinned += newly
        self._job_pins[job_id] = rows
        return rows

    def end_job(self, job_id: int, *, hold: bool) -> bool:
        """Release a cascade job's pins. ``hold``: it timed out, so keep its rows
        unreusable until :meth:`release_hold` (its tier may still be reading).

        Returns whether the job pinned rows here.
        """
        rows = self._job_pins.pop(job_id, None)
        if rows is None:
            return False
        if hold:
            for row in rows:
                self._unpin(row)
                self._holds[row] += 1
            self._held_jobs[job_id] = rows
            for row in rows:
                self._settle(row)
            return True
        # Every pin of the job ends before any row settles (the job ends at once), as on the hold
        # path: a row pinned twice settles at its first place, not where its last pin ends. The
        # rows that become evictable go to the policy in one call, in order (the other outcomes
        # of _settle add none to it).
        pins, holds, writers, indexed, ready = self._pins, self._holds, self._writer, self._indexed, self._ready
        for row in rows:
            assert pins[row] > 0, "every unpin matches one pin"
            pins[row] -= 1
        freed = 0
        evictable = []
        for row in dict.fromkeys(rows):
            if pins[row]:
                continue
            freed += 1
            if indexed[row] and ready[row] and writers[row] is None and not holds[row]:
                evictable.append(row)
            else:
                self._settle(row)
        self._n_pinned -= freed
        if evictable:
            self._policy.add_rows(evictable)
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
        """Unindex every block (lookups miss from now on), and free the rows nobody uses.

        Rows still being written or read stay reserved until their writer or reader ends,
        exactly as after a deadline.
        Returns the number of keys removed.
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
        """The rows of ``keys``.

        Raises :class:`PoolError` if one is not ready.
        """
        rows = list(map(self._index.get, keys))
        try:
            if all(map(self._ready.__getitem__, rows)):  # type: ignore[arg-type]  # None: TypeError
                return rows  # type: ignore[return-value]  # no None: all ready
        except TypeError:
            pass  # a key is not indexed
        ready = self._ready
        key = next(key for key, row in zip(keys, rows, strict=True) if row is None or not ready[row])
        raise PoolError(f"key {key.hex()[:16]} is not ready in the pool")

    def _spared(self, present: Sequence[OffloadKey]) -> frozenset[int]:
        """The evictable rows of a call's ``present`` keys: eviction must spare them."""
        if not present:
            return frozenset()
        has_row = self._policy.has_row
        return frozenset([row for row in map(self._index.__getitem__, present) if has_row(row)])

    def _make_ready(self, row: int) -> None:
        self._ready[row] = 1
        self._n_pending -= 1
        self._n_ready += 1

    def _unindex(self, row: int) -> None:
        key = self._keys[row]
        assert key is not None and self._indexed[row]
        self._policy.discard_row(row)
        del self._index[key]
        self._indexed[row] = 0
        if self._ready[row]:
            self._n_ready -= 1
        else:
            self._n_pending -= 1
        self._ready[row] = 0
        if self._busy(row):
            self._detached.add(row)

    def _busy(self, row: int) -> bool:
        return self._writer[row] is not None or self._pins[row] > 0 or self._holds[row] > 0

    def _unpin(self, row: int) -> None:
        assert self._pins[row] > 0, "every unpin matches one pin"
        self._pins[row] -= 1
        if self._pins[row] == 0:
            self._n_pinned -= 1

    def _settle(self, row: int) -> None:
        """Put ``row`` where its state says: the policy, the free list, or neither."""
        if self._busy(row):
            return
        if self._indexed[row]:
            if self._ready[row]:
                self._policy.add_row(row)
        elif self._keys[row] is not None:
            # Unindexed and idle: nobody can reach or touch this row any more.
            self._keys[row] = None
            self._detached.discard(row)
            self._free.append(row)

    # ------------------------------------------------------------------ internals

    def _allocate(
        self, keys: Sequence[OffloadKey], writer: Writer, present: Sequence[OffloadKey] = ()
    ) -> tuple[tuple[int, ...], tuple[OffloadKey, ...]] | None:
        """Not-ready rows for absent ``keys``, evicting if needed, as ``(rows, evicted)``.

        Returns ``None`` (nothing changed) when free and evictable rows are too few.
        ``present`` is the caller's keys that are indexed.
        Eviction spares them.
        """
        free = self._free
        count = len(keys)
        shortfall = count - len(free)
        evicted: tuple[OffloadKey, ...] = ()
        keys_of, indexed, ready, writers, index = self._keys, self._indexed, self._ready, self._writer, self._index
        if shortfall > 0:
            spare = self._spared(present)
            policy = self._policy
            if len(policy) - len(spare) < shortfall:
                return None
            # Evicted in one pass, and reused at once: every free row is taken with them, so
            # they never pass through the free list (and an evictable row is never detached).
            victims = policy.take_victims(shortfall, spare)
            assert len(victims) == shortfall, "the caller checked there are enough evictable rows"
            evicted = tuple([keys_of[row] for row in victims])  # type: ignore[misc]  # indexed: a key
            for key in evicted:
                del index[key]
            self._n_ready -= shortfall
            taken = free + victims
            free.clear()
            self.evicted_keys += shortfall
            self._events.add(evicted, True)
        else:
            cut = len(free) - count
            taken = free[cut:]
            del free[cut:]
        # Ascending rows for consecutive keys: copies of a request's blocks then
        # coalesce into few large slice copies (rows freed by eviction come back
        # in reverse order, and one-block copies are much slower than long runs).
        taken.sort()
        # Each row now holds its key, being written (not ready: the victims were).
        if count and taken[-1] - taken[0] == count - 1:
            lo, hi = taken[0], taken[0] + count  # one run of rows (the common case): slices
            keys_of[lo:hi] = keys
            indexed[lo:hi] = b"\x01" * count
            ready[lo:hi] = bytes(count)
            writers[lo:hi] = [writer] * count
        else:
            for key, row in zip(keys, taken, strict=True):
                keys_of[row] = key
                indexed[row] = 1
                ready[row] = 0
                writers[row] = writer
        index.update(zip(keys, taken, strict=True))
        self._n_pending += count
        return tuple(taken), evicted

    def holdings(self) -> PoolHoldings:
        """What the pool holds now (copies: ready keys and their rows, pending writes, load
        pins, job pins, promotions in flight), for tests and tools. O(rows + pins)."""
        ready = self._ready
        return PoolHoldings(
            ready={key: row for key, row in self._index.items() if ready[row]},
            pending_writes=frozenset((writer, key) for writer, mine in self._pending_writes.items() for key in mine),
            load_pins={(owner, key): dict(rows) for owner, key, rows, _ in self._pin_book.entries()},
            job_pins=dict(self._job_pins),
            promotions=dict(self._promotions),
        )
