"""The alarm: one wake-up per deadline that needs one, and no deadline without a tick by it.

The unit tests drive :class:`~kvactors.core.alarm.Alarm` against a model that
keeps every wake-up armed since the last tick. The scenario runs a manager on the
seeded scheduler and lists every tick the primary and the supervisor scheduled.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvactors import MemoryTier, ReqContext, TieringManager, TransferJob
from kvactors.actors import messages as m
from kvactors.actors.runtime import ActorRef
from kvactors.core import pool as pool_module
from kvactors.core import reservations as reservations_module
from kvactors.core.alarm import Alarm
from kvactors.testing import SimRuntime


class AlarmModel:
    """What the alarm must schedule, kept the long way: every wake-up armed since the last tick."""

    def __init__(self) -> None:
        self.armed_since_tick: list[float] = []
        self.wakes: list[float] = []

    def arm(self, deadline: float) -> None:
        if all(armed > deadline for armed in self.armed_since_tick):
            self.armed_since_tick.append(deadline)
            self.wakes.append(deadline)

    def fire(self) -> None:
        self.armed_since_tick.clear()

    def rearm(self, deadlines: Sequence[float | None]) -> None:
        present = [deadline for deadline in deadlines if deadline is not None]
        if present:
            self.arm(min(present))


deadlines = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@given(st.lists(st.one_of(st.tuples(st.just("arm"), deadlines), st.just(("fire",)),
                          st.tuples(st.just("rearm"), st.lists(st.none() | deadlines, max_size=4)))))
def test_the_alarm_schedules_what_the_model_does(ops: list[tuple]) -> None:
    wakes: list[float] = []
    alarm, model = Alarm(wakes.append), AlarmModel()
    for op, *args in ops:
        getattr(alarm, op)(*args)
        getattr(model, op)(*args)
        assert wakes == model.wakes
        assert alarm.due == (min(model.armed_since_tick) if model.armed_since_tick else None)


def test_a_tick_is_armed_only_for_a_deadline_earlier_than_the_armed_one() -> None:
    wakes: list[float] = []
    alarm = Alarm(wakes.append)
    alarm.arm(30.0)
    alarm.arm(31.0)  # the tick at 30 comes by it
    alarm.arm(5.0)
    assert wakes == [30.0, 5.0] and alarm.due == 5.0


def test_after_a_tick_the_soonest_deadline_of_the_books_is_armed() -> None:
    wakes: list[float] = []
    alarm = Alarm(wakes.append)
    alarm.arm(5.0)
    alarm.fire()
    assert alarm.fired and alarm.due is None
    alarm.rearm([None, 12.0, 9.0])
    assert not alarm.fired and wakes == [5.0, 9.0]
    alarm.fire()
    alarm.rearm([None, None])  # nothing left in the books: no tick
    assert wakes == [5.0, 9.0] and alarm.due is None


def test_a_deadline_armed_by_the_tick_itself_counts_for_the_rearm() -> None:
    wakes: list[float] = []
    alarm = Alarm(wakes.append)
    alarm.arm(5.0)
    alarm.fire()
    alarm.arm(8.0)  # a job the tick's handler sent
    alarm.rearm([8.0, 20.0])  # the tick at 8 comes by every deadline left
    assert wakes == [5.0, 8.0]


class AlarmOnAClock(RuleBasedStateMachine):
    """An actor's books, its alarm and the clock: every deadline in the books has a tick on its way by it."""

    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.books: list[float] = []
        self.on_the_way: list[float] = []  # the ticks scheduled and not yet arrived, a heap
        self.scheduled = 0
        self.model = AlarmModel()
        self.alarm = Alarm(self._schedule)

    def _schedule(self, deadline: float) -> None:
        heapq.heappush(self.on_the_way, deadline)
        self.scheduled += 1

    def _add(self, after: float) -> None:
        deadline = self.now + after
        self.books.append(deadline)
        self.alarm.arm(deadline)
        self.model.arm(deadline)

    @rule(after=st.floats(min_value=0.0, max_value=50.0, allow_nan=False))
    def add_deadline(self, after: float) -> None:
        self._add(after)

    @rule(added=st.lists(st.floats(min_value=0.0, max_value=50.0, allow_nan=False), max_size=3))
    def tick(self, added: list[float]) -> None:
        """The next tick arrives; its handler takes what is due and may add deadlines; then settle."""
        if not self.on_the_way:
            return
        self.now = max(self.now, heapq.heappop(self.on_the_way))
        self.alarm.fire()
        self.model.fire()
        self.books = [deadline for deadline in self.books if deadline > self.now]
        for after in added:
            self._add(after)
        self.alarm.rearm([min(self.books, default=None)])
        self.model.rearm([min(self.books, default=None)])

    @invariant()
    def every_deadline_has_a_tick_on_its_way_by_it(self) -> None:
        if self.books:
            assert self.on_the_way and self.on_the_way[0] <= min(self.books)

    @invariant()
    def the_ticks_are_the_models(self) -> None:
        assert self.scheduled == len(self.model.wakes)


TestAlarmOnAClock = AlarmOnAClock.TestCase
TestAlarmOnAClock.settings = settings(max_examples=200, stateful_step_count=40)


class WakeCountingRuntime(SimRuntime):
    """The seeded scheduler, listing each tick scheduled: the actor's name and when it is due."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, time_jump_chance=0.0)
        self.wakes: list[tuple[str, float]] = []

    def call_later(self, delay_s: float, ref: ActorRef, message: object) -> None:
        if isinstance(message, m.Tick):
            self.wakes.append((ref.name, self.now() + delay_s))
        super().call_later(delay_s, ref, message)


class StallingTier(MemoryTier):
    """A MemoryTier on its own thread whose stores are never reported."""

    inline_calls = frozenset()

    def submit_store(self, job: TransferJob) -> None:
        pass


def test_each_actor_schedules_one_tick_per_deadline_that_needs_one() -> None:
    """The ticks of a lookup, two stores and a stalled cascade, each due when the model of the
    actors says (these are the ticks the actors scheduled before the alarm was a class of its own)."""
    runtime = WakeCountingRuntime(3)
    tier = StallingTier(name="stalling", capacity_blocks=8)
    manager = TieringManager.start(num_blocks=8, block_bytes=16, secondary_tiers=[tier], transfer_timeout_s=30.0,
                                   lookup_timeout_s=5.0, runtime=runtime)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    manager.lookup([b"a" * 8], ctx)  # the supervisor's lookup deadline: a tick at 5
    out = manager.prepare_store([b"a" * 8], ctx)  # its store deadline: the primary's tick at 30
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)  # the cascade's deadline, 30: the tick at 5 comes first
    runtime.advance(1.0)
    assert manager.prepare_store([b"b" * 8], ctx) is not None  # deadline 31: the tick at 30 comes first
    assert runtime.wakes == [("supervisor", 5.0), ("primary", 30.0)]
    runtime.advance(40.0)  # at 5 the supervisor arms 30 (the cascade); at 30 the primary arms 31 (store b)
    assert manager.stats()["stores_timed_out"] == 1
    manager.on_request_finished(ctx)
    assert manager.wait_idle(5.0)  # its round through the tiers: the tier may be found stuck at 41 + 30
    manager.stop()  # its drain deadline, 41 + 30, has its tick at 71 already
    runtime.run()
    assert runtime.wakes == [("supervisor", 5.0), ("primary", 30.0), ("supervisor", 30.0), ("primary", 31.0),
                             ("supervisor", 71.0)]


def _raise_once(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[bool]:
    """Make ``cls.name`` raise at its first call, as a bug met by a tick's handler would; the calls that raised."""
    original: Callable = getattr(cls, name)
    raised: list[bool] = []

    def raising_once(self, *args):
        if not raised:
            raised.append(True)
            raise RuntimeError("planted: a bug met by a tick's handler")
        return original(self, *args)

    monkeypatch.setattr(cls, name, raising_once)
    return raised


def _two_stores_then_idle(runtime: SimRuntime) -> dict:
    """Stores a (deadline 30) and b (deadline 40), never completed, then 100 idle seconds: the stats after."""
    manager = TieringManager.start(num_blocks=8, block_bytes=16, transfer_timeout_s=30.0, runtime=runtime)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    assert manager.prepare_store([b"a" * 8], ctx) is not None
    runtime.advance(10.0)
    assert manager.prepare_store([b"b" * 8], ctx) is not None  # the tick at 30 covers it
    runtime.advance(100.0)  # nothing else happens: only ticks can time the stores out
    return manager.stats()


def test_a_tick_handler_that_raised_still_arms_the_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next tick is armed in settle, which follows a handler that raised too (review2)."""
    raised = _raise_once(monkeypatch, reservations_module.Reservations, "expire")  # first in the primary's tick
    stats = _two_stores_then_idle(SimRuntime(3, time_jump_chance=0.0))
    assert raised, "the tick at 30 ran"
    # Store a's deadline stayed in the book, and the rearm's tick found it; store b's tick came at 40.
    assert (stats["blocks_pending"], stats["stores_timed_out"], stats["internal_errors"]) == (0, 2, 1), stats


def test_an_expired_store_whose_timeout_raised_is_tried_again_and_the_others_still_time_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A deadline a book gave up is not lost when acting on it raises (review2)."""
    cls = next(c for c in vars(pool_module).values() if isinstance(c, type) and "detach_writes" in vars(c))
    raised = _raise_once(monkeypatch, cls, "detach_writes")  # store a's timeout, at 30
    stats = _two_stores_then_idle(SimRuntime(3, time_jump_chance=0.0))
    assert raised, "the tick at 30 ran"
    # Store b timed out at 40; store a, tried again a timeout later (60), too. The failure is counted.
    assert (stats["blocks_pending"], stats["stores_timed_out"], stats["internal_errors"]) == (0, 2, 1), stats
