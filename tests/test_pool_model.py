"""The optimized pool against the reference (the pool before issue 17), on random operations.

Every operation runs on both pools; their answers (or errors), their whole states
(:meth:`snapshot`), their events, their counts and their eviction orders must agree
after each step. The operations include what the fast paths leave to the general
ones: duplicate keys, double pins, pins on two rows after a reset, releases owed,
unknown keys, failed stores, detached writes, evictions that must spare a call's
keys, cascade and promotion jobs that hold rows. With a policy kept through the rows
(LRU), one seen through its keys (ARC), and a recording LRU seen through its keys, as ARC
is, whose changes must be the same in both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvactors.core.policies import ARCPolicy, KeyedRowPolicy, LRUPolicy
from kvactors.core.pool import BlockPool, PoolError
from tests import pool_check
from tests.reference_pool import ReferencePool

KEYS = [bytes([65 + i]) * 2 for i in range(9)]
OWNERS = [("a", 0), ("b", 0), ("b", 1)]
ROWS = 5
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)


class RecordingLRU(LRUPolicy):
    """LRU by key, seen by the pool through :class:`KeyedRowPolicy` (as ARC is), that logs every
    change: every ``add`` and ``victim``, and each ``access`` or ``discard`` of a key it tracks
    (of another key, a no-op by the protocol, the pool by row makes some the reference does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def bind_rows(self, row_of: Callable[[bytes], int | None], key_of: Sequence[bytes | None],
                  num_rows: int) -> KeyedRowPolicy:  # type: ignore[override]
        return KeyedRowPolicy(self, row_of, key_of)

    def add(self, key: bytes) -> None:
        self.calls.append(("add", key))
        assert key not in self, "add of a tracked key"
        super().add(key)

    def access(self, key: bytes) -> None:
        if key in self:
            self.calls.append(("access", key))
        super().access(key)

    def discard(self, key: bytes) -> None:
        if key in self:
            self.calls.append(("discard", key))
        super().discard(key)

    def victim(self, exclude: Collection[bytes] = ()) -> bytes | None:
        self.calls.append(("victim", tuple(sorted(exclude))))
        return super().victim(exclude)


POLICIES: dict[str, Callable[[], Any]] = {"lru": LRUPolicy, "arc": lambda: ARCPolicy(ROWS), "recording": RecordingLRU}


def eviction_order(pool: Any) -> object:
    """What the pool's policy would evict next, in order (without changing it), and the calls a
    recording policy saw."""
    policy = pool._policy
    calls = getattr(getattr(policy, "policy", policy), "calls", None)  # the key policy a KeyedRowPolicy adapts
    return pool_check.eviction_order(pool), calls


def both(call: Callable[[Any], object], new: BlockPool, ref: ReferencePool) -> object:
    """``call`` on both pools: the same answer, or the same error type (and message)."""
    outcomes = []
    for pool in (new, ref):
        try:
            outcomes.append(("ok", call(pool)))
        except (PoolError, ValueError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], f"optimized {outcomes[0]} != reference {outcomes[1]}"
    return outcomes[0][1]


class Agreement(RuleBasedStateMachine):
    """Both pools, driven alike."""

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def start(self, policy: str) -> None:
        self.new = BlockPool(ROWS, POLICIES[policy]())
        self.ref = ReferencePool(ROWS, POLICIES[policy]())
        self.prepared: list[tuple[tuple[str, int], list[bytes]]] = []  # what each writer prepared
        self.pinned: list[tuple[tuple[str, int], list[bytes]]] = []
        self.jobs: list[int] = []

    def _both(self, call: Callable[[Any], object]) -> object:
        return both(call, self.new, self.ref)

    @rule(keys=key_lists, writer=st.sampled_from(OWNERS))
    def prepare_store(self, keys: list[bytes], writer: tuple[str, int]) -> None:
        plan = self._both(lambda p: p.prepare_store(keys, writer))
        if plan is not None and not isinstance(plan, str):
            self.prepared.append((writer, list(plan.keys)))  # type: ignore[attr-defined]

    @rule(data=st.data(), success=st.booleans())
    def complete_prepared(self, data: st.DataObject, success: bool) -> None:
        """A writer completes some of what it prepared (in another order, perhaps)."""
        if not self.prepared:
            return
        writer, keys = self.prepared.pop(data.draw(st.integers(0, len(self.prepared) - 1)))
        chosen = data.draw(st.permutations(keys))[: data.draw(st.integers(0, len(keys)))]
        self._both(lambda p: p.complete_store(chosen, writer, success))

    @rule(keys=key_lists, writer=st.sampled_from(OWNERS), success=st.booleans())
    def complete_store(self, keys: list[bytes], writer: tuple[str, int], success: bool) -> None:
        """Any keys: unknown, repeated, another writer's (errors), or right by chance."""
        self._both(lambda p: p.complete_store(keys, writer, success))

    @rule(keys=key_lists, writer=st.sampled_from(OWNERS), success=st.booleans())
    def store(self, keys: list[bytes], writer: tuple[str, int], success: bool) -> None:
        """prepare_store and its complete_store at once: ready keys are common."""
        plan = self._both(lambda p: p.prepare_store(keys, writer))
        if plan is not None and not isinstance(plan, str):
            self._both(lambda p: p.complete_store(plan.keys, writer, success))  # type: ignore[attr-defined]
            if success:
                self.pin_for_load(keys, writer)  # what the request stored, it loads (keys present too)

    def _mostly_ready(self, data: st.DataObject) -> list[bytes]:
        """Ready keys (a key perhaps twice), now and then with any key among them."""
        ready = [key for key in KEYS if self.new.is_ready(key)]
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=5)) if ready else []
        if not ready or data.draw(st.integers(0, 4)) == 0:
            keys.insert(data.draw(st.integers(0, len(keys))), data.draw(st.sampled_from(KEYS)))
        return keys

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def pin_ready(self, data: st.DataObject, owner: tuple[str, int]) -> None:
        self.pin_for_load(self._mostly_ready(data), owner)

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def unpin_some(self, data: st.DataObject, owner: tuple[str, int]) -> None:
        """Release keys ``owner`` pinned, perhaps one too many or one it never pinned, in any order."""
        held = [key for who, keys in self.pinned if who == owner for key in keys]
        keys = data.draw(st.lists(st.sampled_from(held), max_size=5)) if held else []
        keys.insert(data.draw(st.integers(0, len(keys))), data.draw(st.sampled_from(KEYS)))
        if data.draw(st.booleans()):
            keys.pop()
        self.unpin_load(keys, owner)

    def pin_for_load(self, keys: list[bytes], owner: tuple[str, int]) -> None:
        rows = self._both(lambda p: p.pin_for_load(keys, owner))
        if isinstance(rows, tuple):
            self.pinned.append((owner, keys))

    @rule(data=st.data())
    def unpin_pinned(self, data: st.DataObject) -> None:
        """A request releases some of what it pinned (perhaps not in one call)."""
        if not self.pinned:
            return
        owner, keys = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        cut = data.draw(st.integers(0, len(keys)))
        for part in (keys[:cut], keys[cut:]):
            self.unpin_load(part, owner)

    def unpin_load(self, keys: list[bytes], owner: tuple[str, int]) -> None:
        self._both(lambda p: p.unpin_load(keys, owner))

    @rule(data=st.data(), kind=st.sampled_from(["pin_for_job", "end_job", "release_hold", "allocate_promotion",
                                                 "end_promotion"]))
    def job(self, data: st.DataObject, kind: str) -> None:
        """Cascade jobs pin rows, and may hold them; promotions write rows, and may hold them.

        Job ids are never reused, as in the runtime (a promotion's id is not checked
        against held jobs), but a job may be ended or released twice, or never."""
        if kind == "pin_for_job" or kind == "allocate_promotion":
            keys = self._mostly_ready(data) if kind == "pin_for_job" else data.draw(key_lists)
            job = len(self.jobs) + 1
            self.jobs.append(job)
            self._both(lambda p: getattr(p, kind)(job, keys))
            return
        if not self.jobs:
            return
        job = data.draw(st.sampled_from(self.jobs))
        if kind == "end_job":
            hold = data.draw(st.booleans())
            self._both(lambda p: p.end_job(job, hold=hold))
        elif kind == "release_hold":
            self._both(lambda p: p.release_hold(job))
        else:
            success, hold = data.draw(st.booleans()), data.draw(st.booleans())
            ok = data.draw(st.none() | st.frozensets(st.sampled_from(KEYS)))
            self._both(lambda p: p.end_promotion(job, success=success, hold=hold, ok_keys=ok))

    @rule(data=st.data(), kind=st.sampled_from(["lookup", "touch", "detach_write", "detach_writes", "queries"]))
    def query(self, data: st.DataObject, kind: str) -> None:
        """Lookups and touches (uses), a deadline detaching a write, the pool's queries."""
        keys, key, writer = data.draw(key_lists), data.draw(st.sampled_from(KEYS)), data.draw(st.sampled_from(OWNERS))
        if kind == "lookup":
            self._both(lambda p: p.lookup(keys))
        elif kind == "touch":
            self._both(lambda p: p.touch(keys))
        elif kind == "detach_write":
            self._both(lambda p: p.detach_write(writer, key))
        elif kind == "detach_writes":  # the new pool's shortcut for a store's deadline: the sum of detach_write
            self._both(lambda p: p.detach_writes(writer, keys) if isinstance(p, BlockPool)
                       else sum(p.detach_write(writer, key) for key in keys))
        else:
            self._both(lambda p: (p.has_pending_write(writer, key), sorted(p.pending_writes_of(writer)),
                                  p.load_pins_of(writer), p.row_of(key), p.is_ready(key)))

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        """Now and then: every key detached, rows still in use kept for their holders."""
        if not now:
            self._both(lambda p: p.reset())

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "new"):
            return
        assert pool_check.snapshot(self.new) == self.ref.snapshot()
        assert self.new.stats() == self.ref.stats()
        assert self.new.state_counts() == self.ref.state_counts()
        assert self.new.evicted_keys == self.ref.evicted_keys
        assert eviction_order(self.new) == eviction_order(self.ref)
        assert self.new.take_events() == self.ref.take_events()
        pool_check.check_invariants(self.new)


TestAgreement = Agreement.TestCase
TestAgreement.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_request_lifecycle_agrees_in_steady_state(policy: str) -> None:
    """The common case the fast paths serve (unique keys, one pin each, evictions), at length."""
    new, ref = BlockPool(8, POLICIES[policy]()), ReferencePool(8, POLICIES[policy]())

    def do(name: str, *args: object) -> object:
        return both(lambda p: getattr(p, name)(*args), new, ref)

    for i in range(40):
        owner = ("r", i)
        keys = [b"%d.%d" % (i, j) for j in range(3)] + [b"%d.0" % (i - 1)] * (i > 0)
        do("prepare_store", keys, owner)
        do("complete_store", keys[:3], owner, i % 5 != 4)
        do("lookup", keys)
        ready = [key for key in keys if new.is_ready(key)]
        do("pin_for_load", ready, owner)
        do("unpin_load", ready, owner)
        assert pool_check.snapshot(new) == ref.snapshot() and eviction_order(new) == eviction_order(ref)
        assert new.take_events() == ref.take_events()


A, B, C, D, E = KEYS[:5]
R1, R2 = OWNERS[:2]
SCENARIOS: dict[str, list[tuple[Any, ...]]] = {
    # The branches the fast paths hand over to the general ones, each taken on purpose.
    "a load pin released while a held cascade keeps the row": [
        ("prepare_store", [A, B], R1), ("complete_store", [A, B], R1, True), ("pin_for_load", [A, B], R2),
        ("pin_for_job", 7, [A]), ("end_job", 7, {"hold": True}), ("unpin_load", [B, A], R2),
        ("prepare_store", [C, D, E], R1), ("release_hold", 7), ("prepare_store", [C, D, E], R2)],
    "pins on two rows after a reset: releases owed": [
        ("prepare_store", [A], R1), ("complete_store", [A], R1, True), ("pin_for_load", [A], R2), ("reset",),
        ("prepare_store", [A], R1), ("complete_store", [A], R1, True), ("pin_for_load", [A, B], R2),
        ("prepare_store", [A], R1), ("complete_store", [A], R1, True), ("pin_for_load", [A], R2),
        ("unpin_load", [A], R2), ("prepare_store", [B, C, D, E], R1), ("unpin_load", [A, A], R2),
        ("unpin_load", [A], R2), ("prepare_store", [B, C, D, E], R1)],
    "a release of a key not pinned, after one that is": [
        ("prepare_store", [A, B], R1), ("complete_store", [A, B], R1, True), ("pin_for_load", [A, B], R2),
        ("unpin_load", [A, C], R2), ("unpin_load", [B, B], R2), ("unpin_load", [B, A], R2), ("unpin_load", [A], R2)],
    "a key pinned twice in one call, released in two": [
        ("prepare_store", [A, B], R1), ("complete_store", [B, A], R1, True), ("pin_for_load", [A, B, A], R2),
        ("pin_for_load", [B], R2), ("unpin_load", [A, B], R2), ("unpin_load", [A, B, B], R2),
        ("unpin_load", [A, B], R2), ("unpin_load", [B], R2)],
    "eviction spares the call's present keys": [
        ("prepare_store", [A, B, C], R1), ("complete_store", [A, B, C], R1, True), ("lookup", [A]),
        ("prepare_store", [D, E], R1), ("complete_store", [E, D], R1, True),
        ("prepare_store", [B, KEYS[5], C, KEYS[6]], R2), ("prepare_store", [A, B, C, D, E, KEYS[7]], R2)],
    "completions live and stale, successful and failed": [
        ("prepare_store", [A, B, C], R1), ("detach_write", R1, B), ("prepare_store", [B, D], R1),
        ("prepare_store", [B], R2), ("complete_store", [C, B], R1, True), ("complete_store", [A, D], R1, False),
        ("complete_store", [B], R2, True), ("prepare_store", [A, B, C, D, E], R1), ("reset",),
        ("complete_store", [A, B], R1, True), ("complete_store", [C, D, E], R1, False)],
    # Hypothesis found this (ARC): a job's rows become evictable once all its pins end, a row
    # pinned twice at its first place (the fast path once added it at its last).
    "a cascade job that pins a row twice ends": [
        ("prepare_store", [A, B], R1), ("complete_store", [A, B], R1, True), ("pin_for_load", [A, B], R1),
        ("unpin_load", [], R1), ("unpin_load", [A, B], R1), ("complete_store", [], R1, False),
        ("pin_for_job", 1, [A, B, A]), ("end_job", 1, {"hold": False})],
    "cascade jobs that pin a row twice end, held, and on a detached row": [
        ("prepare_store", [A, B, C], R1), ("complete_store", [A, B, C], R1, True), ("pin_for_job", 1, [C, A, B, A]),
        ("pin_for_job", 2, [B, C, B]), ("end_job", 2, {"hold": True}), ("end_job", 1, {"hold": False}),
        ("release_hold", 2), ("pin_for_job", 3, [A, C, A]), ("reset",), ("end_job", 3, {"hold": False}),
        ("prepare_store", [D, E, A, B, C], R1)],
    "failed stores and errors change nothing": [
        ("prepare_store", [A, B], R1), ("complete_store", [A, A], R1, True), ("complete_store", [A, C], R1, True),
        ("complete_store", [A], R2, True), ("complete_store", [B, A], R1, False), ("pin_for_load", [A], R1),
        ("complete_store", [], R2, True), ("pin_for_load", [], R2), ("unpin_load", [], R2)],
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_agrees(scenario: str, policy: str) -> None:
    new, ref = BlockPool(ROWS, POLICIES[policy]()), ReferencePool(ROWS, POLICIES[policy]())
    for name, *args in SCENARIOS[scenario]:
        kwargs = args.pop() if args and isinstance(args[-1], dict) else {}
        both(lambda p, name=name, args=args, kwargs=kwargs: getattr(p, name)(*args, **kwargs),  # type: ignore[misc]
             new, ref)
        assert pool_check.snapshot(new) == ref.snapshot() and eviction_order(new) == eviction_order(ref), name
        assert new.take_events() == ref.take_events()
        pool_check.check_invariants(new)
