"""The block pool alone: states, pins, eviction, detach; a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvactors import LookupResult
from kvactors.core.policies import LRUPolicy, make_policy
from kvactors.core.pool import BlockPool, PoolError

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
    p.check_invariants()


def test_present_and_duplicate_keys_are_left_out():
    p = pool()
    p.prepare_store([b"k1"], A)
    plan = p.prepare_store([b"k1", b"k2", b"k2"], B)
    assert plan is not None and plan.keys == (b"k2",)
    p.check_invariants()


def test_failed_store_removes_the_block():
    p = pool()
    p.prepare_store([b"k1"], A)
    outcome = p.complete_store([b"k1"], A, success=False)
    assert outcome.live == 1 and outcome.stored == ()
    assert p.lookup([b"k1"]) == [LookupResult.MISS]
    assert p.stats()["blocks_free"] == 4
    p.check_invariants()


def test_completing_unprepared_or_twice_is_an_error_that_changes_nothing():
    p = pool()
    p.prepare_store([b"k1"], A)
    before = p.snapshot()
    with pytest.raises(PoolError):
        p.complete_store([b"k1"], B, success=True)  # another writer
    with pytest.raises(PoolError):
        p.complete_store([b"k1", b"nope"], A, success=True)
    with pytest.raises(PoolError):
        p.complete_store([b"k1", b"k1"], A, success=True)
    assert p.snapshot() == before
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
    p.check_invariants()
    plan = p.prepare_store([b"x"], A)
    assert plan is not None and plan.evicted == (b"ready",)
    assert p.prepare_store([b"y"], A) is None  # pinned and pending are never evicted
    p.unpin_load([b"pinned"], B)
    plan = p.prepare_store([b"y"], A)
    assert plan is not None and plan.evicted == (b"pinned",)
    p.check_invariants()


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
    p.check_invariants()


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
    p.check_invariants()


def test_a_writer_cannot_restore_a_key_it_is_still_writing_detached():
    p = pool()
    p.prepare_store([b"k"], A)
    assert p.detach_write(A, b"k")
    plan = p.prepare_store([b"k"], A)
    assert plan is not None and plan.keys == ()  # left out until the old write ends
    assert p.prepare_store([b"k"], B).keys == (b"k",)
    p.check_invariants()


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
    p.check_invariants()


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
    p.release_hold(4)
    assert p.stats()["blocks_detached"] == 0
    p.check_invariants()


def test_events_report_stores_and_removals_in_order():
    p = pool(1)
    p.prepare_store([b"a"], A)
    p.complete_store([b"a"], A, success=True)
    p.prepare_store([b"b"], A)
    events = p.take_events()
    assert [(e.keys, e.removed) for e in events] == [((b"a",), False), ((b"a",), True)]
    assert all(e.tier == "cpu" for e in events)
    assert p.take_events() == []


KEYS = [bytes([n]) for n in range(6)]
WRITERS = [("w", 0), ("w", 1), ("v", 0)]


class PoolMachine(RuleBasedStateMachine):
    """Random sequences of every pool operation, misuse included.

    After each step: the pool's invariants hold, an operation that raised
    changed nothing, and no row in use was handed out again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(4, make_policy("arc", 4))
        self.jobs = 0
        self.job_ids: list[int] = []
        self.held: list[int] = []
        self.promotions: list[int] = []

    def _busy_rows(self) -> set[int]:
        stats = self.pool.snapshot()
        writer, pins, holds = stats[4], stats[5], stats[6]
        return {row for row in range(4) if writer[row] is not None or pins[row] or holds[row]}

    def _guarded(self, call, *args, **kwargs):
        before = self.pool.snapshot()
        try:
            return call(*args, **kwargs)
        except PoolError:
            assert self.pool.snapshot() == before, "a refused operation changed state"
            return None

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), writer=st.sampled_from(WRITERS))
    def prepare_store(self, keys, writer):
        busy = self._busy_rows()
        plan = self.pool.prepare_store(keys, writer)
        if plan is not None:
            assert not set(plan.rows) & busy, "a busy row was handed to a new store"

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), writer=st.sampled_from(WRITERS), ok=st.booleans())
    def complete_store(self, keys, writer, ok):
        self._guarded(self.pool.complete_store, keys, writer, ok)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), owner=st.sampled_from(WRITERS))
    def pin(self, keys, owner):
        self._guarded(self.pool.pin_for_load, keys, owner)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3), owner=st.sampled_from(WRITERS))
    def unpin(self, keys, owner):
        self._guarded(self.pool.unpin_load, keys, owner)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
    def cascade(self, keys):
        self.jobs += 1
        if self._guarded(self.pool.pin_for_job, self.jobs, keys) is not None:
            self.job_ids.append(self.jobs)

    @precondition(lambda self: self.job_ids)
    @rule(hold=st.booleans(), data=st.data())
    def end_cascade(self, hold, data):
        job_id = data.draw(st.sampled_from(self.job_ids))
        self.job_ids.remove(job_id)
        assert self.pool.end_job(job_id, hold=hold)
        if hold:
            self.held.append(job_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_hold(self, data):
        job_id = data.draw(st.sampled_from(self.held))
        self.held.remove(job_id)
        assert self.pool.release_hold(job_id)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
    def promote(self, keys):
        self.jobs += 1
        busy = self._busy_rows()
        rows = self._guarded(self.pool.allocate_promotion, self.jobs, keys)
        if rows is not None:
            assert not set(rows) & busy
            self.promotions.append(self.jobs)

    @precondition(lambda self: self.promotions)
    @rule(ok=st.booleans(), hold=st.booleans(), data=st.data())
    def end_promotion(self, ok, hold, data):
        job_id = data.draw(st.sampled_from(self.promotions))
        self.promotions.remove(job_id)
        self.pool.end_promotion(job_id, success=ok, hold=hold)
        if hold:
            self.held.append(job_id)

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
        self.pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class _KeyLRU(LRUPolicy):
    """The standalone (OrderedDict) LRU: the pool cannot bind it to its rows."""

    __slots__ = ()
    bind_rows = None  # type: ignore[assignment]


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
    """The pool with its row-bound LRU behaves exactly as with the OrderedDict LRU."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _Twin(BlockPool(4, make_policy("lru", 4)), BlockPool(4, _KeyLRU()))  # type: ignore[assignment]

    @invariant()
    def same_state(self):
        assert self.pool.a.snapshot() == self.pool.b.snapshot()
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
    p.check_invariants()
