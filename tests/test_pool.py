"""The block pool alone: states, pins, eviction, detach; a hypothesis state machine."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvactors import LookupResult, OffloadingEvent
from kvactors.core.policies import KeyedRowPolicy, LRUPolicy, make_policy
from kvactors.core.pool import BlockPool, PoolError
from tests import pool_check

A, B = ("a", 0), ("b", 0)


def pool(n: int = 4, policy: str = "lru") -> BlockPool:
    return BlockPool(n, make_policy(policy, n))


def test_prepared_blocks_are_pending_until_completed():
    p = pool()
    plan = p.prepare_store([b"k1", b"k2"], A)
    assert plan is not None and plan.keys == (b"k1", b"k2") and len(set(plan.rows)) == 2
    assert p.lookup([b"k1", b"k3"]) == [LookupResult.HIT_PENDING, LookupResult.MISS]
    outcome = p.complete_store([b"k1", b"k2"], A, success=True)
    assert (outcome.live, outcome.stale, outcome.stored) == (2, 0, (b"k1", b"k2"))
    assert p.lookup([b"k1"]) == [LookupResult.HIT]
    pool_check.check_invariants(p)


def test_present_and_duplicate_keys_are_left_out():
    p = pool()
    p.prepare_store([b"k1"], A)
    plan = p.prepare_store([b"k1", b"k2", b"k2"], B)
    assert plan is not None and plan.keys == (b"k2",)
    pool_check.check_invariants(p)


def test_failed_store_removes_the_block():
    p = pool()
    p.prepare_store([b"k1"], A)
    outcome = p.complete_store([b"k1"], A, success=False)
    assert outcome.live == 1 and outcome.stored == ()
    assert p.lookup([b"k1"]) == [LookupResult.MISS]
    assert p.stats()["blocks_free"] == 4
    pool_check.check_invariants(p)


def test_completing_unprepared_or_twice_is_an_error_that_changes_nothing():
    p = pool()
    p.prepare_store([b"k1"], A)
    before = pool_check.snapshot(p)
    with pytest.raises(PoolError):
        p.complete_store([b"k1"], B, success=True)  # another writer
    with pytest.raises(PoolError):
        p.complete_store([b"k1", b"nope"], A, success=True)
    with pytest.raises(PoolError):
        p.complete_store([b"k1", b"k1"], A, success=True)
    assert pool_check.snapshot(p) == before
    p.complete_store([b"k1"], A, success=True)
    with pytest.raises(PoolError):
        p.complete_store([b"k1"], A, success=True)


def test_eviction_takes_only_ready_unpinned_blocks():
    p = pool(3)
    p.prepare_store([b"ready", b"pinned"], A)
    p.complete_store([b"ready", b"pinned"], A, success=True)
    p.pin_for_load([b"pinned"], B)
    p.prepare_store([b"pending"], A)
    # Full: ready (evictable), pinned, pending. Room for one new block only.
    assert p.prepare_store([b"x", b"y"], A) is None
    pool_check.check_invariants(p)
    plan = p.prepare_store([b"x"], A)
    assert plan is not None and plan.evicted == (b"ready",)
    assert p.prepare_store([b"y"], A) is None  # pinned and pending are never evicted
    p.unpin_load([b"pinned"], B)
    plan = p.prepare_store([b"y"], A)
    assert plan is not None and plan.evicted == (b"pinned",)
    pool_check.check_invariants(p)


def test_every_pin_needs_exactly_one_unpin():
    p = pool()
    p.prepare_store([b"k"], A)
    with pytest.raises(PoolError):
        p.pin_for_load([b"k"], B)  # not ready yet
    p.complete_store([b"k"], A, success=True)
    p.pin_for_load([b"k", b"k"], B)
    assert p.stats()["blocks_pinned"] == 1
    p.unpin_load([b"k"], B)
    assert p.stats()["blocks_pinned"] == 1
    with pytest.raises(PoolError):
        p.unpin_load([b"k", b"k"], B)  # only one pin left
    with pytest.raises(PoolError):
        p.unpin_load([b"k"], A)  # not A's pin
    p.unpin_load([b"k"], B)
    with pytest.raises(PoolError):
        p.unpin_load([b"k"], B)  # a double unpin (LMCache #2954) is refused
    assert p.stats()["blocks_pinned"] == 0
    pool_check.check_invariants(p)


def test_a_refused_unpin_leaves_the_pins_as_they_were_in_order() -> None:
    p = pool()
    keys = [b"k1", b"k2", b"k3"]
    p.prepare_store(keys, A)
    p.complete_store(keys, A, success=True)
    p.pin_for_load(keys, B)
    before = list(p._pin_book.entries()), pool_check.snapshot(p)
    with pytest.raises(PoolError):
        p.unpin_load([b"k1", b"k2", b"never-pinned"], B)
    with pytest.raises(PoolError):
        p.unpin_load([b"k2", b"k2"], B)  # pinned once
    assert (list(p._pin_book.entries()), pool_check.snapshot(p)) == before
    p.unpin_load(keys, B)
    assert p.stats()["blocks_pinned"] == 0
    pool_check.check_invariants(p)


def test_reset_keeps_busy_rows_until_their_users_end():
    p = pool(2)
    p.prepare_store([b"read"], A)
    p.complete_store([b"read"], A, success=True)
    p.pin_for_load([b"read"], B)
    p.prepare_store([b"write"], A)
    assert p.reset() == 2
    assert p.lookup([b"read", b"write"]) == [LookupResult.MISS, LookupResult.MISS]
    assert p.stats()["blocks_detached"] == 2
    # Both rows are still being read or written: nothing can be allocated (TRT-LLM #8274).
    assert p.prepare_store([b"new"], B) is None
    outcome = p.complete_store([b"write"], A, success=True)
    assert (outcome.live, outcome.stale) == (0, 1)  # a late completion only frees its row
    assert p.prepare_store([b"new"], B) is not None
    p.unpin_load([b"read"], B)
    assert p.stats()["blocks_detached"] == 0 and p.stats()["blocks_free"] == 1
    pool_check.check_invariants(p)


@pytest.mark.parametrize("detach", ["deadline", "reset"])
@pytest.mark.parametrize("outcomes", [(True, True), (True, False), (False, True)])
def test_a_writer_stores_again_a_key_whose_write_was_detached(detach, outcomes):
    """Found in review: the key was left out (keys_to_store empty), so it was never stored although
    the writer was told nothing was missing. Now it gets a new row; the two completions cannot be told
    apart, so both rows stay held until the second, and the key is ready only if both succeeded."""
    p = pool()
    old = p.prepare_store([b"k"], A)
    if detach == "deadline":
        assert p.detach_write(A, b"k")
    else:
        p.reset()
    plan = p.prepare_store([b"k"], A)
    assert plan is not None and plan.keys == (b"k",) and set(plan.rows).isdisjoint(old.rows)
    assert p.lookup([b"k"]) == [LookupResult.HIT_PENDING]
    first = p.complete_store([b"k"], A, success=outcomes[0])
    assert (first.live, first.stale, first.stored) == (0, 1, ())  # one of two writes ended: nothing counted
    assert p.lookup([b"k"]) == [LookupResult.HIT_PENDING]
    assert p.stats()["blocks_detached"] == 1  # the old row is still held: its copy may be the one still running
    pool_check.check_invariants(p)
    last = p.complete_store([b"k"], A, success=outcomes[1])
    assert last.live == 1 and last.stored == ((b"k",) if all(outcomes) else ())
    assert p.lookup([b"k"]) == [LookupResult.HIT if all(outcomes) else LookupResult.MISS]
    assert p.stats()["blocks_detached"] == 0 and not p.has_pending_write(A, b"k")
    with pytest.raises(PoolError):
        p.complete_store([b"k"], A, success=True)  # a third completion: none is owed
    assert p.prepare_store([b"k"], B).keys == (() if all(outcomes) else (b"k",))
    pool_check.check_invariants(p)


def test_a_copy_that_never_ends_holds_two_rows_not_one_more_per_retry():
    """Found in review: each retry of a key whose first copy hung added a held row for good."""
    p = pool(8)
    p.prepare_store([b"k"], A)  # its copy never ends
    assert p.detach_write(A, b"k")
    second = p.prepare_store([b"k"], A)
    assert second is not None and second.keys == (b"k",)
    p.complete_store([b"k"], A, success=True)  # which write ended is unknown: both rows stay held
    assert p.detach_write(A, b"k")  # the second write's deadline passes too
    for _ in range(3):
        retry = p.prepare_store([b"k"], A)
        assert retry is not None and retry.keys == ()  # left out: no third row
    assert p.stats()["blocks_detached"] == 2 and p.stats()["blocks_free"] == 6
    p.complete_store([b"k"], A, success=True)  # the hung copy ends at last: every row comes back
    assert p.stats()["blocks_detached"] == 0 and p.stats()["blocks_free"] == 8
    assert p.prepare_store([b"k"], A).keys == (b"k",)
    pool_check.check_invariants(p)


def test_cascade_pins_and_timed_out_holds():
    p = pool(2)
    p.prepare_store([b"k"], A)
    p.complete_store([b"k"], A, success=True)
    p.pin_for_job(7, [b"k"])
    assert p.stats()["blocks_pinned"] == 1
    p.end_job(7, hold=True)  # timed out: the tier may still read the row
    assert p.stats()["blocks_pinned"] == 0 and p.stats()["jobs_held"] == 1
    p.reset()
    p.prepare_store([b"x"], B)
    assert p.prepare_store([b"y"], B) is None  # the held row is not reused
    assert p.release_hold(7)
    assert p.prepare_store([b"y"], B) is not None
    assert not p.release_hold(7)
    pool_check.check_invariants(p)


def test_promotions_become_ready_or_vanish():
    p = pool()
    rows = p.allocate_promotion(1, [b"p1", b"p2"])
    assert rows is not None and p.lookup([b"p1"]) == [LookupResult.HIT_PENDING]
    assert p.allocate_promotion(2, [b"p1"]) is None  # at most one promotion per key
    assert p.end_promotion(1, success=True) == (b"p1", b"p2")
    assert p.lookup([b"p1"]) == [LookupResult.HIT]
    p.allocate_promotion(3, [b"p3"])
    p.end_promotion(3, success=False)
    assert p.lookup([b"p3"]) == [LookupResult.MISS]
    p.allocate_promotion(4, [b"p4"])
    p.end_promotion(4, success=False, hold=True)
    assert p.lookup([b"p4"]) == [LookupResult.MISS] and p.stats()["blocks_detached"] == 1
    for busy in (4, 5):  # held (timed out), or promoting: its id is not given out again
        if busy == 5:
            p.allocate_promotion(5, [b"p5"])
        before = pool_check.snapshot(p)
        with pytest.raises(PoolError, match=f"job {busy}"):
            p.allocate_promotion(busy, [b"p6"])
        assert pool_check.snapshot(p) == before
    p.end_promotion(5, success=False)
    p.release_hold(4)
    assert p.stats()["blocks_detached"] == 0
    pool_check.check_invariants(p)


def test_events_report_stores_and_removals_in_order():
    p = pool(1)
    p.prepare_store([b"a"], A)
    p.complete_store([b"a"], A, success=True)
    p.prepare_store([b"b"], A)
    events = p.take_events()
    assert [(e.keys, e.removed) for e in events] == [((b"a",), False), ((b"a",), True)]
    assert all(e.tier == "cpu" for e in events)
    assert p.take_events() == []


# ---------------------------------------------------------------- pins belong to rows (issue 14, item 1)


def _ready(p: BlockPool, keys: list[bytes], writer=A) -> tuple[int, ...]:
    plan = p.prepare_store(keys, writer)
    assert plan is not None and plan.keys == tuple(keys)
    p.complete_store(keys, writer, success=True)
    return plan.rows


def _pins(p: BlockPool, row: int) -> int:
    return pool_check.snapshot(p)[5][row]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_pin_after_a_reset_is_booked_on_the_new_row(policy):
    """A request pins k, a reset detaches k's row, k is stored again and pinned again by the
    same request: two pins on two rows, each released on its own row (TRT-LLM #8274, LMCache #2954)."""
    p = pool(2, policy)
    (old,) = _ready(p, [b"k"])
    p.pin_for_load([b"k"], B)
    p.reset()
    (new,) = _ready(p, [b"k"])
    assert new != old
    p.pin_for_load([b"k"], B)
    assert (_pins(p, old), _pins(p, new)) == (1, 1)
    pool_check.check_invariants(p)
    # One copy ended, the other may still read either row: neither row may be handed out.
    p.unpin_load([b"k"], B)
    pool_check.check_invariants(p)
    assert (_pins(p, old), _pins(p, new)) == (1, 1)
    assert p.prepare_store([b"x"], A) is None, "a row still being read was handed to a new store"
    assert p.load_pins_of(B) == 1
    p.unpin_load([b"k"], B)
    assert (_pins(p, old), _pins(p, new)) == (0, 0)
    assert p.stats()["blocks_pinned"] == 0 and p.stats()["blocks_detached"] == 0
    assert p.lookup([b"k"]) == [LookupResult.HIT]  # the new row stays, evictable again
    plan = p.prepare_store([b"x"], A)
    assert plan is not None and plan.rows == (old,) and plan.evicted == ()  # the old row is free once read
    assert not p._load_pins
    pool_check.check_invariants(p)


def test_a_release_more_than_the_pins_taken_changes_nothing():
    p = pool(3)
    _ready(p, [b"k"])
    p.pin_for_load([b"k"], B)
    p.reset()
    _ready(p, [b"k"])
    p.pin_for_load([b"k"], B)
    p.unpin_load([b"k"], B)  # owed: the pins lie on two rows
    before = pool_check.snapshot(p)
    with pytest.raises(PoolError):
        p.unpin_load([b"k", b"k"], B)  # one pin left, two released
    with pytest.raises(PoolError):
        p.unpin_load([b"k"], A)  # another request
    assert pool_check.snapshot(p) == before
    p.unpin_load([b"k"], B)
    with pytest.raises(PoolError):
        p.unpin_load([b"k"], B)  # every pin was released once: a third release is refused
    assert p.stats()["blocks_pinned"] == 0
    pool_check.check_invariants(p)


def test_pins_on_one_row_are_released_at_once_and_a_new_row_of_the_key_waits_for_all():
    p = pool(4)
    (old,) = _ready(p, [b"k"])
    p.pin_for_load([b"k", b"k"], B)  # two pins on one row
    p.unpin_load([b"k"], B)
    assert _pins(p, old) == 1  # one row only: released at once
    p.reset()
    (new,) = _ready(p, [b"k"])
    p.pin_for_load([b"k"], B)
    p.pin_for_load([b"k"], B)
    assert (_pins(p, old), _pins(p, new)) == (1, 2)
    p.unpin_load([b"k", b"k"], B)
    assert (_pins(p, old), _pins(p, new)) == (1, 2)  # which two copies ended is unknown
    p.pin_for_load([b"k"], B)  # pinning again while releases are owed
    assert (_pins(p, old), _pins(p, new)) == (1, 3)
    pool_check.check_invariants(p)
    p.unpin_load([b"k", b"k"], B)
    assert (_pins(p, old), _pins(p, new)) == (0, 0)
    assert p.stats()["blocks_free"] == 3
    pool_check.check_invariants(p)


def test_a_promotion_into_a_new_row_while_the_old_one_is_pinned():
    p = pool(2)
    (old,) = _ready(p, [b"k"])
    p.pin_for_load([b"k"], B)
    p.reset()
    (new,) = p.allocate_promotion(1, [b"k"])
    assert new != old
    p.end_promotion(1, success=True)
    p.pin_for_load([b"k"], B)
    p.unpin_load([b"k"], B)
    assert p.allocate_promotion(2, [b"x"]) is None  # both rows may still be read
    p.unpin_load([b"k"], B)
    assert p.allocate_promotion(3, [b"x"]) == (old,)
    pool_check.check_invariants(p)


# ---------------------------------------------------------------- own keys are never evicted (item 2)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_store_never_evicts_a_key_of_its_own_call(policy):
    """vLLM PR #35846: ``a`` is left out as present, then evicted to make room for ``c``."""
    p = pool(2, policy)
    _ready(p, [b"a", b"b"])  # a is the least recently used
    plan = p.prepare_store([b"a", b"c"], B)
    assert plan is not None and plan.keys == (b"c",)
    assert plan.evicted == (b"b",), "the call evicted its own present key"
    assert p.lookup([b"a"]) == [LookupResult.HIT]
    pool_check.check_invariants(p)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_room_only_from_the_calls_own_keys_is_no_room(policy):
    p = pool(2, policy)
    _ready(p, [b"a", b"b"])
    before = pool_check.snapshot(p)
    assert p.prepare_store([b"a", b"b", b"c"], B) is None
    assert p.prepare_store([b"c", b"b", b"c", b"a"], B) is None  # duplicates change nothing
    assert pool_check.snapshot(p) == before and p.take_events() == [
        OffloadingEvent((b"a", b"b"), "cpu", False)]
    plan = p.prepare_store([b"b", b"c", b"c"], B)  # one other key is evictable: enough for one new key
    assert plan is not None and plan.keys == (b"c",) and plan.evicted == (b"a",)
    pool_check.check_invariants(p)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_duplicates_are_stored_once_and_spared_once(policy):
    p = pool(3, policy)
    _ready(p, [b"a", b"b", b"d"])
    plan = p.prepare_store([b"a", b"a", b"c", b"c", b"a"], B)
    assert plan is not None and plan.keys == (b"c",) and len(plan.rows) == 1
    assert b"a" not in plan.evicted and plan.evicted == (b"b",)
    pool_check.check_invariants(p)


KEYS = [bytes([n]) for n in range(6)]
WRITERS = [("w", 0), ("w", 1), ("v", 0)]


class PoolMachine(RuleBasedStateMachine):
    """Random sequences of every pool operation, misuse included.

    The machine keeps its own model of every row's holders, from the calls'
    results alone: writers (stores, promotions), load pins per request and
    key on the rows they were taken on (released as ``unpin_load`` documents:
    at once on one row, all together once the pins span rows), cascade pins
    and holds. After each step: the pool's invariants hold, its pins, writers
    and holds per row equal the model's, an operation that raised changed
    nothing, no row the model says is held was handed out again, and no
    ``prepare_store`` evicted a key of its own call.
    """

    ROWS = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.ROWS, make_policy("arc", self.ROWS))
        self.jobs = 0
        self.job_ids: list[int] = []
        self.held: list[int] = []
        self.promotions: list[int] = []
        # The model of every row's holders.
        # Per (writer, key): the rows of its writes not yet all completed (more than one: a key
        # written again after a reset or a deadline detached its write), and the completions so far.
        self.m_writes: dict[tuple[tuple[str, int], bytes], list[int]] = {}
        self.m_ended: Counter[tuple[tuple[str, int], bytes]] = Counter()
        self.m_reads: dict[tuple[tuple[str, int], bytes], list[int]] = {}  # rows pinned, one entry per pin
        self.m_released: Counter[tuple[tuple[str, int], bytes]] = Counter()
        self.m_job_rows: dict[int, tuple[int, ...]] = {}  # cascades and promotions, until they end
        self.m_holds: dict[int, tuple[int, ...]] = {}

    def _model_rows(self) -> tuple[Counter[int], set[int], Counter[int]]:
        pins: Counter[int] = Counter()
        for entry in self.m_reads.values():
            pins.update(entry)
        writers = {row for rows in self.m_writes.values() for row in rows}
        for job_id in self.promotions:
            writers.update(self.m_job_rows[job_id])
        for job_id in self.job_ids:
            pins.update(self.m_job_rows[job_id])
        holds: Counter[int] = Counter()
        for rows in self.m_holds.values():
            holds.update(rows)
        return pins, writers, holds

    def _busy_rows(self) -> set[int]:
        pins, writers, holds = self._model_rows()
        return set(pins) | writers | set(holds)

    def _guarded(self, call, *args, **kwargs):
        before = self._snapshot()
        try:
            return call(*args, **kwargs)
        except PoolError:
            assert self._snapshot() == before, "a refused operation changed state"
            return None

    def _store(self, keys, writer):
        busy = self._busy_rows()
        present = {key for key in keys if self.pool.row_of(key) is not None}
        plan = self.pool.prepare_store(keys, writer)
        if plan is None:
            return None
        assert not set(plan.rows) & busy, "a row with holders was handed to a new store"
        assert not set(plan.evicted) & set(keys), "prepare_store evicted a key of its own call"
        assert all(self.pool.row_of(key) is not None for key in present), "a present key of the call is gone"
        assert len(set(plan.keys)) == len(plan.keys) and not set(plan.keys) & present
        for key, row in zip(plan.keys, plan.rows, strict=True):
            self.m_writes.setdefault((writer, key), []).append(row)
        return plan

    def _completed(self, writer, key):
        """One completion of ``key`` by ``writer``: its rows are released once each write was completed."""
        entry = (writer, key)
        self.m_ended[entry] += 1
        if self.m_ended[entry] == len(self.m_writes[entry]):
            del self.m_writes[entry], self.m_ended[entry]

    def _pin(self, keys, owner):
        rows = self._guarded(self.pool.pin_for_load, keys, owner)
        if rows is None:
            return None
        for key, row in zip(keys, rows, strict=True):
            self.m_reads.setdefault((owner, key), []).append(row)
        return rows

    def _release(self, owner, key):
        entry = (owner, key)
        self.m_released[entry] += 1
        rows = self.m_reads[entry]
        if len(set(rows)) == 1:
            del rows[: self.m_released.pop(entry)]
        elif self.m_released[entry] == len(rows):
            rows.clear()
            del self.m_released[entry]
        if not rows:
            del self.m_reads[entry]


    def _snapshot(self) -> tuple[object, ...]:
        return pool_check.snapshot(self.pool)

    def _check(self) -> None:
        pool_check.check_invariants(self.pool)
    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), writer=st.sampled_from(WRITERS))
    def prepare_store(self, keys, writer):
        self._store(keys, writer)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), writer=st.sampled_from(WRITERS), ok=st.booleans())
    def complete_store(self, keys, writer, ok):
        if self._guarded(self.pool.complete_store, keys, writer, ok) is not None:
            for key in keys:
                self._completed(writer, key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), owner=st.sampled_from(WRITERS))
    def pin(self, keys, owner):
        self._pin(keys, owner)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), owner=st.sampled_from(WRITERS))
    def unpin(self, keys, owner):
        before = self._snapshot()
        try:
            self.pool.unpin_load(keys, owner)
        except PoolError:
            assert self._snapshot() == before, "a refused operation changed state"
            wanted = Counter(keys)
            assert any(len(self.m_reads.get((owner, key), ())) - self.m_released[(owner, key)] < count
                       for key, count in wanted.items()), "a release of pins held was refused"
            return
        for key in keys:
            self._release(owner, key)

    @precondition(lambda self: self.m_reads)
    @rule(data=st.data())
    def complete_a_load(self, data):
        """Release one pin actually held (``unpin`` mostly draws misuse)."""
        owner, key = data.draw(st.sampled_from(sorted(self.m_reads)))
        self.pool.unpin_load([key], owner)
        self._release(owner, key)

    @precondition(lambda self: self.m_reads)
    @rule(data=st.data(), writer=st.sampled_from(WRITERS))
    def reset_and_pin_again(self, data, writer):
        """The path of item 1: a pinned key's row is detached, the key stored anew and pinned again."""
        owner, key = data.draw(st.sampled_from(sorted(self.m_reads)))
        self.reset()
        plan = self._store([key], writer)
        if plan is None or not plan.keys:
            return
        self.pool.complete_store([key], writer, True)
        self._completed(writer, key)
        self._pin([key], owner)

    @rule(present=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
          new=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), writer=st.sampled_from(WRITERS))
    def store_among_own_keys(self, present, new, writer):
        """The path of item 2: a full pool, a call mixing its present keys with new ones (and duplicates)."""
        plan = self._store(present, writer)
        if plan is not None and plan.keys:
            self.pool.complete_store(list(plan.keys), writer, True)
            for key in plan.keys:
                self._completed(writer, key)
        self._store([*present, *new, *present], writer)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
    def cascade(self, keys):
        self.jobs += 1
        rows = self._guarded(self.pool.pin_for_job, self.jobs, keys)
        if rows is not None:
            self.job_ids.append(self.jobs)
            self.m_job_rows[self.jobs] = rows

    @precondition(lambda self: self.job_ids)
    @rule(hold=st.booleans(), data=st.data())
    def end_cascade(self, hold, data):
        job_id = data.draw(st.sampled_from(self.job_ids))
        self.job_ids.remove(job_id)
        assert self.pool.end_job(job_id, hold=hold)
        rows = self.m_job_rows.pop(job_id)
        if hold:
            self.held.append(job_id)
            self.m_holds[job_id] = rows

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_hold(self, data):
        job_id = data.draw(st.sampled_from(self.held))
        self.held.remove(job_id)
        assert self.pool.release_hold(job_id)
        del self.m_holds[job_id]

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
    def promote(self, keys):
        self.jobs += 1
        busy = self._busy_rows()
        rows = self._guarded(self.pool.allocate_promotion, self.jobs, keys)
        if rows is not None:
            assert not set(rows) & busy, "a row with holders was handed to a promotion"
            self.promotions.append(self.jobs)
            self.m_job_rows[self.jobs] = rows

    @precondition(lambda self: self.promotions)
    @rule(ok=st.booleans(), hold=st.booleans(), data=st.data())
    def end_promotion(self, ok, hold, data):
        job_id = data.draw(st.sampled_from(self.promotions))
        self.promotions.remove(job_id)
        self.pool.end_promotion(job_id, success=ok, hold=hold)
        rows = self.m_job_rows.pop(job_id)
        if hold:
            self.held.append(job_id)
            self.m_holds[job_id] = rows

    @rule(key=st.sampled_from(KEYS), writer=st.sampled_from(WRITERS))
    def detach(self, key, writer):
        self.pool.detach_write(writer, key)

    @rule()
    def reset(self):
        self.pool.reset()
        assert self.pool.stats()["blocks_ready"] == self.pool.stats()["blocks_pending"] == 0

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def lookup(self, keys):
        self.pool.lookup(keys)

    @invariant()
    def consistent(self):
        self._check()

    @invariant()
    def rows_hold_what_the_model_says(self):
        snapshot = self._snapshot()
        writer, pins, holds = snapshot[4], snapshot[5], snapshot[6]
        m_pins, m_writers, m_holds = self._model_rows()
        for row in range(self.ROWS):
            assert pins[row] == m_pins[row], f"row {row}: {pins[row]} pins, the model has {m_pins[row]}"
            assert (writer[row] is not None) == (row in m_writers), f"row {row}: writer"
            assert holds[row] == m_holds[row], f"row {row}: holds"


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class _KeyLRU(LRUPolicy):
    """The standalone (OrderedDict) LRU, seen by the pool through its keys (as ARC is)."""

    __slots__ = ()

    def bind_rows(self, row_of, key_of, num_rows):  # type: ignore[no-untyped-def, override]
        return KeyedRowPolicy(self, row_of, key_of)


class _Twin:
    """Two pools driven alike: every call must return the same or raise the same."""

    def __init__(self, a: BlockPool, b: BlockPool) -> None:
        self.a, self.b = a, b

    def __getattr__(self, name):
        def call(*args, **kwargs):
            outcome = []
            for pool in (self.a, self.b):
                try:
                    outcome.append(("ok", getattr(pool, name)(*args, **kwargs)))
                except Exception as exc:
                    outcome.append(("raised", type(exc)))
            assert outcome[0] == outcome[1], f"{name}{args}: {outcome}"
            if outcome[0][0] == "raised":
                raise outcome[0][1]("raised by both pools")
            return outcome[0][1]
        return call


class RowLRUMachine(PoolMachine):
    """The pool with LRU kept through its rows behaves exactly as with the OrderedDict LRU
    seen through its keys."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _Twin(BlockPool(4, make_policy("lru", 4)), BlockPool(4, _KeyLRU()))  # type: ignore[assignment]

    def _snapshot(self) -> tuple[object, ...]:
        states = [pool_check.snapshot(pool) for pool in (self.pool.a, self.pool.b)]
        assert states[0] == states[1], "the two pools differ"
        return states[0]

    def _check(self) -> None:
        pool_check.check_invariants(self.pool.a)
        pool_check.check_invariants(self.pool.b)

    @invariant()
    def same_state(self):
        self._snapshot()
        assert list(self.pool.a._policy._key_of) == list(self.pool.a._keys)


TestRowLRUMachine = RowLRUMachine.TestCase
TestRowLRUMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rows_for_consecutive_keys_ascend_after_eviction():
    """Copies of a request coalesce only if its rows ascend; evicted rows come back reversed."""
    p = pool(8)
    first = p.prepare_store([bytes([n]) for n in range(8)], A)
    p.complete_store(list(first.keys), A, success=True)
    plan = p.prepare_store([bytes([100 + n]) for n in range(8)], B)  # evicts all 8, in LRU order
    assert plan is not None and len(plan.evicted) == 8
    assert list(plan.rows) == sorted(plan.rows) == list(range(8))
    pool_check.check_invariants(p)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_stores_after_a_reset_continue_each_others_rows(policy):
    """The engine merges the copies of consecutive requests whose rows continue each other."""
    p = pool(12, policy)
    for i in range(3):
        keys = [bytes([i, n]) for n in range(4)]
        p.prepare_store(keys, A)
        p.complete_store(keys, A, success=True)
    p.reset()
    plans = [p.prepare_store([bytes([9, i, n]) for n in range(4)], A) for i in range(3)]
    rows = [row for plan in plans for row in plan.rows]
    assert rows == list(range(12))
    pool_check.check_invariants(p)
